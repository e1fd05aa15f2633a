"""Redis going back in time under a running capsvc, on real processes: redis-server (DEBUG
enabled), `capsvc serve` over HTTP, the journal on local disk.

The promise under test (API.md, "What an answer promises"): every decision a process
answered is in Redis, or put back from its journal, before that process judges another sale
or reports another decision; another live process's decisions are back before it sells; no
combination is sold past its cap. Each test makes Redis lose answered decisions — a reload
of an older RDB in place (`DEBUG RELOAD NOSAVE`: same run id, same replication id), a
backup restored key by key, a `FLUSHALL` — at a moment the process's own signs of a loss do
not show it (its newest journaled decision is a look-up, replay or cancel of a ticket the
rollback kept; another host's sale; a sibling worker's), then asks for every answered
ticket (a 503 is "try again") and sells the combinations to exhaustion: every ticket must
answer its decision byte for byte, every answered cancel stay cancelled, and every counter
equal the accepted stakes answered net of cancels, within the cap.

The game: FDJ rules, a cap of 5000 (`failover_config`), 8-number grids of 500 or more.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from capsvc.redis.marks import NODE_MARK
from tests.support.failover import (
    FAILOVER_GAME,
    OPS_TOKEN,
    SELLER_TOKEN,
    Sellers,
    Transport,
    audit,
    combination_key,
    current_draw,
    write_failover_config,
)
from tests.support.faults import FaultProxy, command
from tests.support.servers import RedisServer, backup_keys, restore_keys
from tests.support.service import ServiceProcess

pytestmark = pytest.mark.slow

CAP = 5000
STAKE = 500
X = (3, 7, 12, 18, 25, 33, 41, 56)
Y = (1, 2, 3, 4, 5, 6, 7, 8)
Z = (10, 20, 30, 40, 50, 60, 65, 70)
ANSWER_S = 30.0
RETRY_S = 0.05
"""The pause before a 503 is sent again."""
"""How long a request is sent again while it answers 503 (or nothing)."""

_ids = itertools.count(1)
_RUN = os.urandom(3).hex()


def _tid(prefix: str) -> str:
    return f"RB-{_RUN}-{prefix}-{next(_ids):04d}"


# -- HTTP, as a sales system speaks it ------------------------------------------------------

def _call(url: str, method: str, path: str, body: Any = None, token: str = SELLER_TOKEN
          ) -> tuple[int, bytes]:
    """One request on a connection of its own (with several workers, any of them may take
    it): the status and the body's bytes."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=5)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Authorization": f"Bearer {token}",
                              "Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _answered(url: str, method: str, path: str, body: Any = None, token: str = SELLER_TOKEN,
              timeout_s: float = ANSWER_S) -> tuple[int, bytes]:
    """The same request sent again while it answers 503 or nothing (the contract: a 503
    means "try again"), until `timeout_s`: the first other answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status, raw = _call(url, method, path, body, token)
        except Transport:
            status, raw = 0, b""
        if status not in (0, 503) or time.monotonic() > deadline:
            return status, raw
        time.sleep(RETRY_S)


def _counter(url: str, numbers: Sequence[int], draw: int) -> dict[str, Any]:
    """`GET …/combinations/{numbers}` (retrying 503s): cap, staked, remaining."""
    path = f"/v1/games/{FAILOVER_GAME}/draws/{draw}/combinations/{combination_key(numbers)}"
    status, raw = _answered(url, "GET", path, token=OPS_TOKEN)
    assert status == 200, (status, raw[:300])
    body: dict[str, Any] = json.loads(raw)
    return body


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout_s} s")
        time.sleep(0.02)


# -- what the callers were answered -------------------------------------------------------

@dataclass(frozen=True)
class Answer:
    """A decision answered to a caller: a 200 to `POST /v1/tickets`."""

    url: str
    """The service that answered it."""
    request: dict[str, Any]
    raw: bytes
    """The decision's bytes as first answered."""

    @property
    def decision(self) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(self.raw)
        return body


class Ledger:
    """Every decision answered in a test (sales, cancels), and the checks of the promise
    against a service: each ticket as answered, each counter the accepted stakes answered
    net of cancels, within the cap."""

    def __init__(self, draw: int) -> None:
        self.draw = draw
        self.sales: dict[str, Answer] = {}
        self.cancels: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def body(self, numbers: Sequence[int], stake: int = STAKE, prefix: str = "T"
             ) -> dict[str, Any]:
        return {"ticket_id": _tid(prefix), "game": FAILOVER_GAME, "first_draw": self.draw,
                "grids": [{"numbers": list(numbers), "stake": stake}]}

    def send(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        """Sell `body` (503s sent again); the decision, kept."""
        status, raw = _answered(url, "POST", "/v1/tickets", body)
        assert status == 200, (body["ticket_id"], status, raw[:300])
        with self._lock:
            self.sales[body["ticket_id"]] = Answer(url, body, raw)
        decision: dict[str, Any] = json.loads(raw)
        return decision

    def sell(self, url: str, numbers: Sequence[int], stake: int = STAKE, prefix: str = "T"
             ) -> str:
        """A sale of one grid on `numbers`; its ticket id."""
        body = self.body(numbers, stake, prefix)
        self.send(url, body)
        return str(body["ticket_id"])

    def sell_together(self, url: str, bodies: Sequence[dict[str, Any]]) -> None:
        """Every sale sent at once, each on its own connection and thread."""
        with ThreadPoolExecutor(len(bodies)) as pool:
            list(pool.map(lambda b: self.send(url, b), bodies))

    def sell_out(self, url: str, numbers: Sequence[int]) -> None:
        """Sell `numbers` by STAKE until a sale is refused by the cap (at most twice what
        the cap allows)."""
        for _ in range(2 * CAP // STAKE + 2):
            decision = self.send(url, self.body(numbers, prefix="S"))
            if decision["status"] == "rejected":
                assert decision["grids"][0].get("reason") == "combination_capped", decision
                return
        raise AssertionError(f"{combination_key(numbers)} still sells after "
                             f"{2 * CAP // STAKE + 2} sales of {STAKE} on a cap of {CAP}")

    def replay(self, url: str, tid: str) -> None:
        """The sale of `tid` sent again: its decision, unchanged."""
        sale = self.sales[tid]
        status, raw = _answered(url, "POST", "/v1/tickets", sale.request)
        assert (status, raw) == (200, sale.raw), (status, raw[:300])

    def lookup(self, url: str, tid: str) -> None:
        """`GET` of `tid`: its decision, unchanged."""
        status, raw = _answered(url, "GET", f"/v1/tickets/{tid}")
        assert (status, raw) == (200, self.sales[tid].raw), (status, raw[:300])

    def cancel(self, url: str, tid: str) -> None:
        """Cancel `tid`: answered cancelled, releasing its cost; kept."""
        status, raw = _answered(url, "POST", f"/v1/tickets/{tid}/cancel")
        assert status == 200, (status, raw[:300])
        body: dict[str, Any] = json.loads(raw)
        assert body["status"] == "cancelled", body
        assert body["released"] == self.sales[tid].decision["total_cost"], body
        with self._lock:
            self.cancels[tid] = body

    def totals(self) -> dict[tuple[str, int], int]:
        """(combination, draw) -> the accepted stakes answered, net of answered cancels."""
        out: dict[tuple[str, int], int] = {}
        for tid, sale in self.sales.items():
            sign = 0 if tid in self.cancels else 1
            for g in sale.decision["grids"]:
                stake = int(sale.request["grids"][g["index"]]["stake"])
                for draw in sale.decision["draws"]:
                    key = (combination_key(g["numbers"]), int(draw))
                    out[key] = out.get(key, 0) + (
                        sign * stake if g["status"] == "accepted" else 0)
        return out

    def lost(self, via: Callable[[Answer], str] | None = None,
             tickets: Sequence[str] | None = None) -> list[str]:
        """Answered tickets the service does not show as answered: `GET` (503s asked again)
        through the service that answered each (or `via(answer)`); a cancelled ticket
        must carry its cancellation."""
        problems = []
        for tid in tickets if tickets is not None else list(self.sales):
            sale = self.sales[tid]
            status, raw = _answered(via(sale) if via else sale.url, "GET", f"/v1/tickets/{tid}")
            if status != 200:
                problems.append(f"GET {tid} answered {status} {raw[:120]!r}: an answered "
                                "decision is gone")
                continue
            if tid not in self.cancels:
                if raw != sale.raw:
                    problems.append(f"GET {tid} answered {raw[:200]!r}, not its decision "
                                    f"{sale.raw[:200]!r}")
                continue
            body = json.loads(raw)
            cancelled = body.pop("cancelled", None)
            if (cancelled is None or cancelled.get("released") != self.cancels[tid]["released"]
                    or body.pop("state", None) != "cancelled"):
                problems.append(f"GET {tid}: an answered cancel is undone ({cancelled})")
            if body != sale.decision:
                problems.append(f"GET {tid} answered {body}, not its decision")
        return problems

    def over(self, url: str, settle_s: float = 0.0) -> list[str]:
        """Counters past the cap, or other than the accepted stakes answered net of
        cancels. With `settle_s`, each counter is read again until it equals the answers,
        for up to that long: what another process puts back within its documented bound
        counts."""
        problems = []
        for (key, draw), answered in sorted(self.totals().items()):
            numbers = [int(n) for n in key.split("-")]
            deadline = time.monotonic() + settle_s
            while True:
                staked = int(_counter(url, numbers, draw)["staked"])
                if staked == answered or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
            if answered > CAP:
                problems.append(f"{key} draw {draw}: {answered} answered accepted (net of "
                                f"cancels) on a cap of {CAP}")
            if staked > CAP:
                problems.append(f"{key} draw {draw}: Redis counts {staked} on a cap of {CAP}")
            if staked != answered:
                problems.append(f"{key} draw {draw}: Redis counts {staked}, the answers "
                                f"{answered}")
        return problems


# -- processes -------------------------------------------------------------------------------

@pytest.fixture
def debug_redis() -> Iterator[RedisServer]:
    """A redis-server of the test's own that takes `DEBUG RELOAD`."""
    server = RedisServer(extra=("--enable-debug-command", "yes")).start()
    yield server
    server.stop()


def _config(settle: str = "0s") -> str:
    """The failover configuration (FDJ rules, cap CAP) with `[journal] settle`."""
    path = write_failover_config(tempfile.mkdtemp(prefix="capsvc-rollback-"), cap=CAP)
    text = Path(path).read_text()
    assert 'settle = "0s"' in text
    Path(path).write_text(text.replace('settle = "0s"', f'settle = "{settle}"'))
    return path


@pytest.fixture
def config() -> str:
    """One capsvc (its workers share one journal directory): no other host to wait for."""
    return _config()


def _verify(config: str, redis_url: str, *dirs: Path) -> subprocess.CompletedProcess[str]:
    """`capsvc journal verify --redis URL DIR…` (the chains, the caps, and Redis)."""
    return subprocess.run([sys.executable, "-m", "capsvc", "journal", "verify", "--config",
                           config, "--redis-url", redis_url, *map(str, dirs)],
                          capture_output=True, text=True, timeout=120)


def _assert_verified(config: str, redis_url: str, *dirs: Path) -> None:
    out = _verify(config, redis_url, *dirs)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def _rollback(server: RedisServer, how: str) -> None:
    c = server.client()
    try:
        if how == "reload":
            c.execute_command("DEBUG", "RELOAD", "NOSAVE")  # type: ignore[no-untyped-call]
        else:
            c.flushall()
    finally:
        c.close()


def _identity(server: RedisServer) -> tuple[str, str]:
    c = server.client()
    try:
        return (c.info("server")["run_id"], c.info("replication")["master_replid"])
    finally:
        c.close()


def _dump_all(server: RedisServer) -> list[tuple[bytes, int, Any]]:
    """Every key, its time to live and its DUMP, as of one instant: a key-by-key backup."""
    c = server.client()
    try:
        return backup_keys(c)
    finally:
        c.close()


def _restore_all(server: RedisServer, keys: list[tuple[bytes, int, Any]]) -> None:
    """The backup put back in place: FLUSHALL, then every key RESTOREd."""
    c = server.client()
    try:
        restore_keys(c, keys)
    finally:
        c.close()


def _assert_none(problems: list[str]) -> None:
    """Fail with every problem found, each once."""
    if problems:
        pytest.fail("\n".join(dict.fromkeys(problems)), pytrace=False)


def _hide(ledger: Ledger, url: str, how: str, tid: str) -> None:
    """Report `tid`'s decision once more (a look-up, a replay) or cancel it: the newest
    decision the process journals is then one of a ticket sold before the save."""
    {"lookup": ledger.lookup, "replay": ledger.replay, "cancel": ledger.cancel}[how](url, tid)


HIDES = ["lookup", "replay", "cancel"]


# -- 1. a reload in place, hidden by a look-up, a replay or a cancel --------------------------
#
# T1 sold, SAVE, T2 sold on the same combination, then T1 reported again (GET, a replay) or
# cancelled: the newest decision the process journals is about T1, which the saved file
# holds. `DEBUG RELOAD NOSAVE` takes Redis back to the save with the same run id and
# replication id: only T2 (and T1's cancel) are gone.

@pytest.mark.parametrize("hide", HIDES)
def test_reload_in_place_puts_back_what_was_answered_after_the_save(
        debug_redis: RedisServer, config: str, hide: str) -> None:
    """A reload in place, masked by a report on an older ticket, loses no answer, passes no cap."""
    svc = ServiceProcess(config, debug_redis.url).start()
    try:
        ledger = Ledger(current_draw(svc.base_url) + 1)
        t1 = ledger.sell(svc.base_url, X)
        debug_redis.client().save()
        t2 = ledger.sell(svc.base_url, X)
        assert ledger.sales[t2].decision["status"] == "accepted"
        _hide(ledger, svc.base_url, hide, t1)
        before = _identity(debug_redis)
        _rollback(debug_redis, "reload")
        assert _identity(debug_redis) == before  # no new run id or replication id to see

        problems = ledger.lost(tickets=[t2, t1])  # the first calls after the rollback
        ledger.sell_out(svc.base_url, X)
        problems += ledger.over(svc.base_url)
        problems += ledger.lost()
        _assert_none(problems)
        _assert_verified(config, debug_redis.url, svc.journal_dir)
    finally:
        svc.stop()


# -- 2. a backup restored in place while the process was down, then its start -----------------
#
# As in 1, with a key-by-key backup (DUMP of every key after T1; FLUSHALL and RESTORE of each
# while the process is stopped) and the process started again on its journal directory: the
# newest line of its file is about T1, which the backup holds, with the directory's mark.

@pytest.mark.parametrize("hide", HIDES)
def test_start_on_a_backup_restored_in_place_puts_back_what_was_answered_after_it(
        debug_redis: RedisServer, config: str, hide: str) -> None:
    """A start on a backup restored key by key puts back every later answer before selling."""
    svc = ServiceProcess(config, debug_redis.url).start()
    again: ServiceProcess | None = None
    try:
        ledger = Ledger(current_draw(svc.base_url) + 1)
        t1 = ledger.sell(svc.base_url, X)
        backup = _dump_all(debug_redis)
        t2 = ledger.sell(svc.base_url, X)
        assert ledger.sales[t2].decision["status"] == "accepted"
        _hide(ledger, svc.base_url, hide, t1)
        svc.stop()
        _restore_all(debug_redis, backup)
        again = ServiceProcess(config, debug_redis.url, port=svc.port,
                               env={"CAPSVC_JOURNAL_DIR": str(svc.journal_dir)}).start()

        problems = ledger.lost(tickets=[t2, t1])
        ledger.sell_out(again.base_url, X)
        problems += ledger.over(again.base_url)
        problems += ledger.lost()
        _assert_none(problems)
        _assert_verified(config, debug_redis.url, svc.journal_dir)
    finally:
        if again is not None:
            again.stop()
        svc.stop()


# -- 3. two hosts: one rolls back its answers, the other sells at once ------------------------
#
# Hosts A and B, a journal each, `settle` at its default. B sells T1, A sells, SAVE, A sells
# T2; the rollback loses T2 (reload) or everything (FLUSHALL), and B at once sends more than
# the room left once T2 counts. B's own newest decision (T1) survives the reload.

@pytest.mark.parametrize("how", ["reload", "flushall"])
def test_another_host_sells_nothing_past_the_cap_after_a_rollback(
        debug_redis: RedisServer, how: str) -> None:
    """After a rollback losing host A's sale, host B selling at once sells nothing past the cap."""
    config = _config(settle="1s")  # several hosts: the default wait for the others
    a = ServiceProcess(config, debug_redis.url).start()
    b = ServiceProcess(config, debug_redis.url).start()
    try:
        ledger = Ledger(current_draw(a.base_url) + 1)
        ledger.sell(b.base_url, X)
        ledger.sell(a.base_url, X)
        debug_redis.client().save()
        t2 = ledger.sell(a.base_url, X)
        assert ledger.sales[t2].decision["status"] == "accepted"
        room = CAP - sum(ledger.totals().values())
        rush = [ledger.body(X, prefix="B") for _ in range(room // STAKE + 4)]
        time.sleep(0.5)  # the documented bound for every host to have seen A's last answer
        _rollback(debug_redis, how)
        ledger.sell_together(b.base_url, rush)

        # Once A's decisions are back (within the bound a restore of another host takes),
        # the counter must hold every answered stake, and no more than the cap.
        problems = ledger.over(a.base_url, settle_s=5.0)
        problems += ledger.lost()  # each through the host that answered it
        _assert_none(problems)
        _assert_verified(config, debug_redis.url, a.journal_dir, b.journal_dir)
    finally:
        a.stop()
        b.stop()


@pytest.mark.parametrize("how", ["reload", "flushall"])
def test_a_host_that_saw_the_lost_answers_waits_for_them_though_it_lost_nothing(
        debug_redis: RedisServer, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host B saw A's answers (its watch) before a rollback lost them, lost nothing of its own,
    and is sent sales retried every 2 ms: it sells again only once A has put them back."""
    monkeypatch.setattr(sys.modules[__name__], "RETRY_S", 0.002)
    config = _config(settle="1s")
    a = ServiceProcess(config, debug_redis.url).start()
    b = ServiceProcess(config, debug_redis.url).start()
    try:
        for service in (a, b):  # listening is not ready: the start's restore comes first
            _wait(lambda s=service: _call(s.base_url, "GET", "/readyz")[0] == 200, 20,
                  "not ready")
        for trial, numbers in enumerate((X, Y, Z)):
            ledger = Ledger(current_draw(a.base_url) + 1 + trial)
            ledger.sell(a.base_url, numbers)
            debug_redis.client().save()
            for _ in range(5):
                ledger.sell(a.base_url, numbers)
            time.sleep(0.3)  # B's watch has seen them
            _rollback(debug_redis, how)
            ledger.sell_together(b.base_url, [ledger.body(numbers, prefix="B")
                                              for _ in range(CAP // STAKE)])
            problems = ledger.over(a.base_url, settle_s=5.0)
            problems += ledger.lost()
            _assert_none(problems)
    finally:
        a.stop()
        b.stop()


@pytest.mark.parametrize("how", ["reload", "flushall"])
def test_a_rollback_while_the_process_restores_is_put_back_too(
        debug_redis: RedisServer, config: str, how: str) -> None:
    """Redis goes back in time (or is emptied) again while the process puts back what a
    first rollback lost: the restore notices it lost its own work and runs again; nothing
    answered is lost, nothing passes the cap."""
    svc = ServiceProcess(config, debug_redis.url).start()
    try:
        ledger = Ledger(current_draw(svc.base_url) + 1)
        ledger.sell(svc.base_url, X)
        client = debug_redis.client()
        client.save()
        for _ in range(4):
            ledger.sell(svc.base_url, X)
        rng = random.Random(7)
        others = [ledger.body(sorted(rng.sample(range(1, 71), 8)), prefix="O")
                  for _ in range(1500)]  # a restore that takes a while
        for i in range(0, len(others), 100):
            ledger.sell_together(svc.base_url, others[i:i + 100])
        _rollback(debug_redis, "reload")
        _wait(lambda: client.hget(NODE_MARK, "!") is not None, 10, "no restore announced")
        time.sleep(0.05)
        _rollback(debug_redis, how)

        ledger.sell_out(svc.base_url, X)
        problems = ledger.over(svc.base_url)
        problems += ledger.lost()
        _assert_none(problems)
    finally:
        svc.stop()


def test_a_snapshot_taken_while_the_process_restores_then_loaded_is_put_back_too(
        debug_redis: RedisServer, config: str) -> None:
    """Redis is emptied; while the process puts its sales back, a snapshot is saved (after
    its tickets' records, before its counters: forced, the restore's connection held at
    its first counters' call), and once everything is back (the restore's end held), Redis
    goes back to that snapshot in place. The snapshot holds the restore's token, but not
    the counters: the restore's end sees that some of its writes are gone, and it runs
    again; nothing answered is lost, nothing passes the cap."""
    with FaultProxy("127.0.0.1", debug_redis.port) as proxy:
        svc = ServiceProcess(config, proxy.url).start()
        try:
            ledger = Ledger(current_draw(svc.base_url) + 1)
            for _ in range(CAP // STAKE):
                ledger.sell(svc.base_url, X)
            client = debug_redis.client()
            counting, ending = threading.Event(), threading.Event()
            counts = proxy.hold_request(command("FCALL", "capsvc_restore_counts"), counting)
            end = proxy.hold_request(command("FCALL", "capsvc_mark_restored"), ending)
            try:
                client.flushall()
                _wait(lambda: counts.hits > 0, 20, "the restore did not count")
                client.save()  # its token and tickets' records, not its counters
                counting.set()
                _wait(lambda: end.hits > 0, 20, "the restore did not end")
                client.execute_command("DEBUG", "RELOAD", "NOSAVE")  # type: ignore[no-untyped-call]
            finally:
                counting.set()
                ending.set()
            ledger.sell_out(svc.base_url, X)
            problems = ledger.over(svc.base_url)
            problems += ledger.lost()
            _assert_none(problems)
            assert "the restore's writes are not all there" in svc.log.read_text() or \
                "went back in time again" in svc.log.read_text()
        finally:
            svc.stop()


def test_a_rollback_while_a_restore_waits_for_the_others_is_put_back_too(
        debug_redis: RedisServer) -> None:
    """Redis goes back again after a restore has put everything back and raised the marks,
    while it waits `[journal] settle` for the other processes: the restore finds what it put
    back gone and runs again; the process answers nothing before."""
    config = _config(settle="2s")
    svc = ServiceProcess(config, debug_redis.url).start()
    again: ServiceProcess | None = None
    client = debug_redis.client()
    try:
        ledger = Ledger(current_draw(svc.base_url) + 1)
        ledger.sell(svc.base_url, X)
        backup = _dump_all(debug_redis)
        g = int(client.hget(NODE_MARK, "*") or 0)
        later = [ledger.sell(svc.base_url, X) for _ in range(3)]
        assert svc.process is not None
        svc.process.kill()
        svc.process.wait()
        svc.process = None
        _restore_all(debug_redis, backup)
        again = ServiceProcess(config, debug_redis.url, port=svc.port,
                               env={"CAPSVC_JOURNAL_DIR": str(svc.journal_dir)})
        starting = threading.Thread(target=again.start)
        starting.start()
        try:
            # The restore of the killed lifetime's sales is done and its marks raised (G
            # past the backup's): it waits for the settle.
            _wait(lambda: int(client.hget(NODE_MARK, "*") or 0) > g, 20,
                  "the restore never raised the marks")
            _restore_all(debug_redis, backup)
        finally:
            starting.join()

        problems = ledger.lost(via=lambda _: again.base_url, tickets=later)
        ledger.sell_out(again.base_url, X)
        problems += ledger.over(again.base_url)
        problems += ledger.lost(via=lambda _: again.base_url)
        _assert_none(problems)
    finally:
        client.close()
        if again is not None:
            again.stop()
        svc.stop()


def _sale_of(ticket_id: str) -> Callable[[Sequence[bytes]], bool]:
    """A FaultProxy match: the sale's call (the one FCALL a one-call sale sends)."""
    tid = ticket_id.encode()
    return lambda command: (command[0].upper() == b"FCALL"
                            and any(tid in arg for arg in command))


@pytest.mark.parametrize("unseen", [False, True], ids=["", "after-a-write-whose-answer-was-lost"])
def test_a_call_sent_before_the_last_reply_was_read_is_refused_after_a_rollback(
        debug_redis: RedisServer, config: str, unseen: bool) -> None:
    """Two sales on one connection: X2 is sent while X1's reply is still on its way; Redis
    runs X1, goes back in place to before it, then runs X2. X2 must not pass on what the
    process knew when X2 was sent (X1's G not read yet): it would write X1's G again and
    the mark would cover the lost X1. Refused, X1 is put back; nothing past the cap.

    `unseen`: before the save, a sale whose call ran but whose answer was lost with the
    connection (503, the outcome unknown) left in Redis a write of the process it does not
    expect. Counted, that write stood in for the lost X1: X2 passed, and X1, answered, was
    never put back (a break-it run reproduced it 4 times in 4)."""
    proxy = FaultProxy("127.0.0.1", debug_redis.port).start()
    svc = ServiceProcess(config, proxy.url).start()
    client = debug_redis.client()
    try:
        ledger = Ledger(current_draw(svc.base_url) + 1)
        ledger.sell(svc.base_url, X)
        if unseen:
            body = ledger.body(Y, prefix="U")  # Y: not in the ledger, its outcome unknown
            lost = proxy.drop_reply(_sale_of(body["ticket_id"]))
            status, _ = _call(svc.base_url, "POST", "/v1/tickets", body)
            assert status == 503
            assert lost.fired.is_set()
        ledger.sell(svc.base_url, X)
        client.save()
        x1, x2 = ledger.body(X, prefix="X1"), ledger.body(X, prefix="X2")
        proxy.delay_reply(_sale_of(x1["ticket_id"]), 0.12)
        release = threading.Event()
        held = proxy.hold_request(_sale_of(x2["ticket_id"]), release)
        first = ThreadPoolExecutor(2)
        try:
            one = first.submit(ledger.send, svc.base_url, x1)
            proxy.wait_for(_sale_of(x1["ticket_id"]))
            two = first.submit(ledger.send, svc.base_url, x2)  # 503s are sent again
            assert held.fired.wait(5), "X2 never reached Redis's connection"
            one.result(timeout=30)
            client.execute_command("DEBUG", "RELOAD", "NOSAVE")  # X1 lost
            release.set()
            two.result(timeout=60)
        finally:
            release.set()
            first.shutdown()

        problems = ledger.lost()
        ledger.sell_out(svc.base_url, X)
        problems += ledger.over(svc.base_url)
        problems += ledger.lost()
        _assert_none(problems)
    finally:
        client.close()
        svc.stop()
        proxy.stop()


def _restore_journal(config: str, redis_url: str, directory: Path) -> None:
    """`capsvc journal restore`: the whole directory re-applied, whatever the marks say."""
    out = subprocess.run([sys.executable, "-m", "capsvc", "journal", "restore", "--config",
                          config, "--redis-url", redis_url, "--dir", str(directory)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_a_backup_copied_key_by_key_during_sales_is_repaired_by_journal_restore(
        debug_redis: RedisServer, config: str) -> None:
    """A backup copied key by key while sales ran holds a mark copied after data keys that
    miss a sale answered meanwhile: no state Redis ever had, which the marks cannot judge.
    The documented procedure (docs/durability.md, Backups) — services stopped, the backup
    put back, `capsvc journal restore` of the directory, services started — loses nothing
    and passes no cap."""
    svc = ServiceProcess(config, debug_redis.url).start()
    again: ServiceProcess | None = None
    client = debug_redis.client()
    try:
        ledger = Ledger(current_draw(svc.base_url) + 1)
        ledger.sell(svc.base_url, X)
        backup = [(key, max(client.pttl(key), 0), client.dump(key))
                  for key in client.scan_iter(count=1000) if key != NODE_MARK.encode()]
        ledger.sell(svc.base_url, X)  # answered while the copy runs
        backup.append((NODE_MARK.encode(), max(client.pttl(NODE_MARK), 0),
                       client.dump(NODE_MARK)))
        ledger.sell(svc.base_url, X)
        svc.stop()
        _restore_all(debug_redis, [b for b in backup if b[2] is not None])
        _restore_journal(config, debug_redis.url, svc.journal_dir)
        again = ServiceProcess(config, debug_redis.url, port=svc.port,
                               env={"CAPSVC_JOURNAL_DIR": str(svc.journal_dir)}).start()

        problems = ledger.lost(via=lambda _: again.base_url)
        ledger.sell_out(again.base_url, X)
        problems += ledger.over(again.base_url)
        problems += ledger.lost(via=lambda _: again.base_url)
        _assert_none(problems)
        _assert_verified(config, debug_redis.url, svc.journal_dir)
    finally:
        client.close()
        if again is not None:
            again.stop()
        svc.stop()


# -- 4. two workers, one journal directory -----------------------------------------------------
#
# `capsvc serve --workers 2` (one file per worker): both workers answer sales before the save
# and after it, then both report a ticket sold before it, so that neither worker's newest
# decision is one the reload loses. Which worker answered what is read from the journal.

def _decisions_by_worker(directory: Path) -> dict[str, list[dict[str, Any]]]:
    """Each process's decision records (`sale`, `cancel`) in the directory, oldest first."""
    out: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(directory.glob("capsvc-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a line being written by the other worker
                continue
            if record.get("type") in ("sale", "cancel"):
                out.setdefault(record["proc"], []).append(record)
            elif record.get("type") == "sales":  # sales made together: each as a `sale`
                out.setdefault(record["proc"], []).extend(
                    {**sold, "type": "sale", "via": record["via"], "proc": record["proc"]}
                    for sold in record["sales"])
    return out


def _sell_from_both(svc: ServiceProcess, ledger: Ledger, prefix: str,
                    combinations: Iterator[tuple[int, ...]]) -> set[str]:
    """Sales of `combinations`, two at a time on connections of their own, until each of
    the service's two workers has answered one of them: their ticket ids."""
    sold: set[str] = set()
    deadline = time.monotonic() + 30
    while len({proc for proc, records in _decisions_by_worker(svc.journal_dir).items()
               if any(r.get("via") == "answer" and r["ticket"] in sold
                      for r in records)}) < 2:
        assert time.monotonic() < deadline, "one worker answered every sale"
        bodies = [ledger.body(next(combinations), prefix=prefix) for _ in range(2)]
        ledger.sell_together(svc.base_url, bodies)
        sold.update(b["ticket_id"] for b in bodies)
    return sold


def test_two_workers_put_back_what_either_answered_after_a_reload(
        debug_redis: RedisServer, config: str) -> None:
    """With two workers, a reload in place loses neither worker's answers and passes no cap."""
    svc = ServiceProcess(config, debug_redis.url, args=("--workers", "2")).start()
    try:
        url = svc.base_url
        ledger = Ledger(current_draw(url) + 1)
        rng = random.Random(4)
        spare = iter(lambda: tuple(sorted(rng.sample(range(1, 71), 8))), None)
        hot = [X, Y, Z]
        grids = itertools.cycle(hot)

        # Both workers up and selling (a combination of its own per sale: no room taken).
        _sell_from_both(svc, ledger, "W", (c for c in spare if c not in hot))
        saved = _sell_from_both(svc, ledger, "P", grids)
        debug_redis.client().save()
        after = _sell_from_both(svc, ledger, "Q", grids)
        assert any(ledger.sales[t].decision["status"] == "accepted" for t in after)
        t1 = min(saved)

        def both_report_t1() -> bool:
            newest = [records[-1] for records in _decisions_by_worker(svc.journal_dir).values()]
            return len(newest) == 2 and all(
                r.get("via") == "lookup" and r["ticket"] == t1 for r in newest)

        deadline = time.monotonic() + 30
        while not both_report_t1():
            assert time.monotonic() < deadline, "one worker answered every look-up"
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(lambda _: ledger.lookup(url, t1), range(2)))
        _rollback(debug_redis, "reload")

        problems = ledger.lost(tickets=sorted(after))
        for combination in hot:
            ledger.sell_out(url, combination)
        problems += ledger.over(url)
        problems += ledger.lost()
        _assert_none(problems)
        _assert_verified(config, debug_redis.url, svc.journal_dir)
    finally:
        svc.stop()



def test_a_worker_judges_nothing_until_a_stopped_worker_has_put_back_its_answers(
        debug_redis: RedisServer, config: str) -> None:
    """Two workers, one stopped (SIGSTOP) when Redis goes back: the other, which restores its
    own answers at once, answers neither a look-up of the stopped one's lost tickets nor a
    sale until the stopped one, continued, has put them back: it reads in their shared
    journal directory what that worker answered, and waits for Redis to hold it, however
    long the worker takes (no time bound, no `settle`)."""
    svc = ServiceProcess(config, debug_redis.url, args=("--workers", "2")).start()
    try:
        url = svc.base_url
        ledger = Ledger(current_draw(url) + 1)
        rng = random.Random(5)
        spare = iter(lambda: tuple(sorted(rng.sample(range(1, 71), 8))), None)
        # Both workers' marks in Redis before the SAVE: a partial loss.
        _sell_from_both(svc, ledger, "W", spare)
        debug_redis.client().save()
        sold = _sell_from_both(svc, ledger, "Q", spare)
        stopped, records = sorted(_decisions_by_worker(svc.journal_dir).items())[0]
        theirs = sorted({r["ticket"] for r in records if r["via"] == "answer"} & sold)
        assert theirs
        pid = int(stopped.rpartition("/")[2])
        os.kill(pid, signal.SIGSTOP)
        try:
            _rollback(debug_redis, "reload")
            # While it is stopped, the other worker accepts every connection: every answer
            # is the other's. Its first call finds Redis behind and restores its own; then
            # it must wait for the stopped one's.
            answers: list[int] = []
            until = time.monotonic() + 3
            while time.monotonic() < until:
                for tid in theirs:
                    try:
                        status, raw = _call(url, "GET", f"/v1/tickets/{tid}")
                    except Transport:
                        continue
                    assert status == 503, (tid, status, raw[:200])
                    answers.append(status)
                status, raw = _call(url, "POST", "/v1/tickets",
                                    ledger.body(X, prefix="D"))
                assert status == 503, ("a sale judged meanwhile", status, raw[:200])
            assert len(answers) >= 2 * len(theirs), answers
        finally:
            os.kill(pid, signal.SIGCONT)
        _assert_none(ledger.lost(tickets=sorted(sold)) + ledger.over(url) + ledger.lost())
        _assert_verified(config, debug_redis.url, svc.journal_dir)
    finally:
        svc.stop()

# -- 5. FLUSHALL under load --------------------------------------------------------------------
#
# Six sellers (tests.support.failover.Sellers: every 503 sent again, same id and body) on three
# combinations and two draws until every counter is at its cap, then FLUSHALL while they go
# on. Nothing is cancelled: once a counter is full no later sale fits, so a sale sent after
# the FLUSHALL and accepted was judged against the emptied Redis.

def test_flushall_under_load_loses_nothing_and_sells_nothing_on_the_emptied_redis(
        debug_redis: RedisServer, config: str) -> None:
    """A FLUSHALL under load loses no answer and accepts nothing against the emptied Redis."""
    svc = ServiceProcess(config, debug_redis.url).start()
    try:
        draw = current_draw(svc.base_url) + 1
        draws = [draw, draw + 1]
        combos = [X, Y, Z]
        crowd = Sellers([svc.base_url], draws, combinations=combos, stakes=(500, 1000),
                        max_grids=1, skew=0.0, count=6, seed=5)
        with crowd:
            def full() -> bool:
                return all(not _counter(svc.base_url, c, d)["selectable"]
                           for c in combos for d in draws)

            _wait(full, 30, "the hot combinations at their cap")
            _rollback(debug_redis, "flushall")
            at = crowd.mark("flushall")
            _wait(lambda: sum(s.sent_at > at for s in crowd.acknowledged) >= 60, 30,
                  "60 sales answered after the FLUSHALL")
        result = audit(svc.base_url, crowd)

        assert not crowd.unexpected, crowd.unexpected[:5]
        assert not crowd.unanswered, crowd.unanswered[:5]
        assert not result.unreadable, result.unreadable[:5]
        late = [s for s in crowd.acknowledged
                if s.sent_at > at and s.decision["status"] != "rejected"]
        problems = [f"{k}: past the cap of {CAP}: (staked, answered) {result.counters[k]}"
                    for k in result.over_cap]
        problems += [f"{k}: Redis counts {result.counters[k][0]}, the answers "
                     f"{result.counters[k][1]}" for k in result.mismatched]
        problems += [f"{tid}: {what}" for tid, what in list(result.lost.items())[:10]]
        if late:
            problems.append(f"{len(late)} sale(s) sent after the FLUSHALL answered accepted "
                            f"on full counters, e.g. {late[0].ticket_id}: "
                            f"{late[0].decision['grids']}")
        if problems:
            problems.insert(0, f"{result.acknowledged} answered, {len(result.lost)} lost")
        _assert_none(problems)
        _assert_verified(config, debug_redis.url, svc.journal_dir)
    finally:
        svc.stop()
