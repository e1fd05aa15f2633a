"""Redis going back in time, every way and in every order, under real `capsvc serve`
processes, against the reference model (tests/model.py).

A hypothesis state machine sells (a few hot 8-number combinations, stakes of 500 and 1000 on
a cap of 5000, so caps bind), replays, looks up and cancels tickets, and makes Redis go back:
`SAVE` then `DEBUG RELOAD NOSAVE` (a rollback in place: same run id, same replication id),
`FLUSHALL`, a key-by-key backup (DUMP of every key) put back in place (FLUSHALL + RESTORE),
a restart of a service process on its journal (gracefully or killed, Redis going back while
it is down or not), and a second process with a journal of its own on the same Redis. After
a step that makes Redis go back, the first call is any of the others (a sale judged, a
decision reported) or the check itself. Redis may also go back to the same point once more
while a process is putting its journal back (`again`: at the moment the lost tickets are
back and the process has not yet raised its marks, in one atomic step, see AGAIN).

The promise under test (API.md, "What an answer promises"): the model never goes back in
time, since every decision a process answered is put back from its journal before that
process judges or reports another one. So after every step, on real HTTP (503s sent again,
as the contract asks): every ticket answered is what `GET` returns now, byte for byte (with
its `cancelled` member once a cancel was answered, the same each time); every counter is the
accepted stakes answered net of the answered cancels, never past the cap; and the model's
counters agree with its own tickets.

With two processes, a sale right after Redis went back is held to the model too: the
decisions of every live process are back before any process sells again (docs/journal.md,
"Several hosts").

Each example has a Redis and journal directories of its own. Draws are fixed once for the
module (two draws a day: none closes during a run), ticket ids count steps: what a step draws
does not depend on the clock, so hypothesis replays a run's steps exactly.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from capsvc.config import load_settings
from capsvc.domain.calendar import DrawCalendar
from capsvc.redis.marks import NODE_MARK
from capsvc.redis.store import record_bucket_of, ticket_key
from tests.model import Expected, Model, Rules, Ticket
from tests.support.failover import (
    FAILOVER_GAME,
    OPS_TOKEN,
    SELLER_TOKEN,
    Transport,
    combination_key,
    write_failover_config,
)
from tests.support.servers import RedisServer, backup_keys, redis_ms
from tests.support.service import ServiceProcess

pytestmark = pytest.mark.slow

CAP = 5000
CHANNEL = "failover-seller"
HOT = [(3, 7, 12, 18, 25, 33, 41, 56), (1, 2, 3, 4, 5, 6, 7, 8)]
OFFSETS = (1, 2)
DRAWS = (1, 2)
ANSWER_S = 30.0
"""How long a request is sent again while it answers 503 (or nothing)."""
SETTLE = "1s"
"""`[journal] settle`: with two processes, how long a restore waits for the other one to
have looked at the marks (every 50 ms: capsvc.recovery.reconciler, WATCH_S). The default,
as deployments run it: CI runs two test files beside the services and Redis on two cores,
where a process may go unscheduled for longer than a shorter settle covers."""
AGAIN = """
if (redis.call('HGET', KEYS[1], '*') or '') ~= ARGV[1] then return -1 end
local n = tonumber(ARGV[2])
for i = 1, n do
  if redis.call('HEXISTS', ARGV[1 + 2 * i], ARGV[2 + 2 * i]) == 0 then return 0 end
end
redis.call('FLUSHALL')
for i = 3 + 2 * n, #ARGV, 3 do redis.call('RESTORE', ARGV[i], ARGV[i + 1], ARGV[i + 2]) end
return 1
"""
"""Redis back to a point again (FLUSHALL, then RESTORE of the point's keys, given as key,
ttl, DUMP after the tickets) in the same atomic step as it is seen that a restore has put
back every ticket given (ARGV[2] of them, as record bucket and field) and not yet raised the
mark's count of writes above what it was once Redis went back (ARGV[1]; "" when absent): 1.
Else nothing: 0 while some ticket is still missing, -1 once the count has moved (too late)."""
AGAIN_TRIES = 3
SETTLE_S = 5.0
"""The bound within which a process answers what another live process put back."""


@dataclass(frozen=True)
class Point:
    """A point Redis can go back to: its keys (key, time to live, DUMP) and the tickets it
    holds."""

    keys: list[tuple[Any, int, Any]]
    tickets: frozenset[str]


@dataclass(frozen=True)
class World:
    config: str
    base: int
    """The draw on sale when the module started: sales go to base + OFFSETS."""
    model_rules: Rules


def _world(settle: str) -> Iterator[World]:
    directory = Path(tempfile.mkdtemp(prefix="capsvc-rollback-model-"))
    config = write_failover_config(directory, cap=CAP)
    text = Path(config).read_text()
    assert 'settle = "0s"' in text
    Path(config).write_text(text.replace('settle = "0s"', f'settle = "{settle}"'))
    rules = load_settings(config).games[FAILOVER_GAME]
    calendar = DrawCalendar(rules)
    assert rules.cap_limit == CAP
    base = calendar.current(int(time.time() * 1000))
    yield World(config, base, Rules(cap=CAP, capped_picks=frozenset(rules.capped_picks),
                                    retention_ms=rules.retention_ms,
                                    close_ms=calendar.close_ms))
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    yield from _world(SETTLE)


@pytest.fixture(scope="module")
def slow_world() -> Iterator[World]:
    """`[journal] settle` 2 s: room for a process paused for a part of it."""
    yield from _world("2s")


# -- HTTP, as a sales system speaks it ------------------------------------------------------

def _call(url: str, method: str, path: str, body: Any, token: str
          ) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Authorization": f"Bearer {token}",
                              "Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def answered(url: str, method: str, path: str, body: Any = None, token: str = SELLER_TOKEN
             ) -> tuple[int, dict[str, str], bytes]:
    """The request, sent again while it answers 503 or nothing (the contract: the outcome
    is unknown, the same request converges), for up to ANSWER_S: the first other answer."""
    deadline = time.monotonic() + ANSWER_S
    while True:
        try:
            status, headers, raw = _call(url, method, path, body, token)
        except Transport:
            status, headers, raw = 0, {}, b""
        if status not in (0, 503):
            return status, headers, raw
        assert time.monotonic() < deadline, (
            f"{method} {path} still answers {status} after {ANSWER_S} s: {raw[:200]!r}")
        time.sleep(0.05)


# -- the steps' parameters ------------------------------------------------------------------

PICK = st.integers(0, 2**16)
"""Which known ticket a step takes, modulo how many there are."""
VIA = st.integers(0, 1)
"""Which service process a call goes to, modulo how many run (or how many may take it)."""
GRIDS = st.lists(st.fixed_dictionaries({"numbers": st.sampled_from(HOT).map(list),
                                        "stake": st.sampled_from([500, 1000])}),
                 min_size=1, max_size=2)
SALE = st.tuples(st.just("sell"), VIA, GRIDS, st.sampled_from(DRAWS),
                 st.sampled_from(OFFSETS))
TOUCH = st.tuples(st.sampled_from(["replay", "get", "cancel"]), PICK, VIA)
ACTION = st.one_of(SALE, TOUCH, st.just(("check",)))
"""What a step that makes Redis go back does first: a sale, a replay, a look-up or a cancel,
or nothing before the checks."""
BACK = st.sampled_from(["none", "reload", "flushall", "restore"])


def nth(known: dict[Any, Any], pick: int) -> tuple[Any, Any] | None:
    """The `pick`-th (key, value) of `known` in key order, modulo its size; None if empty."""
    return sorted(known.items(), key=lambda kv: kv[0])[pick % len(known)] if known else None


class RollbackMachine(RuleBasedStateMachine):
    """Processes are indices in `procs` (a restarted one keeps its index and its journal).

    Who must answer what: a process that reported a ticket's current state (its sale, its
    cancel; by the first answer, a replay or a look-up) journaled it, and answers it again
    at once, whatever Redis lost (`knows`). Another process may answer it only once the
    reporter put it back, within a bound (SETTLE_S here): right after a step that made Redis
    go back, a ticket is touched only through a process that knows it. At the start of any
    other step, the checks of the step before have seen every ticket in Redis."""

    world: World

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="capsvc-rollback-run-"))
        (self.dir / "redis").mkdir()
        self.redis = RedisServer(directory=str(self.dir / "redis"),
                                 extra=("--enable-debug-command", "yes")).start()
        self.db = self.redis.client()
        self.procs: list[ServiceProcess] = []
        self._spawn()
        self.model = Model(self.world.model_rules)
        self.knows: dict[str, set[int]] = {}
        """Ticket id -> the processes that reported its current state."""
        self.cancel_raw: dict[str, bytes] = {}
        """Ticket id -> the first answer to its cancel (a replay answers the same)."""
        self.got_cancelled: dict[str, bytes] = {}
        """Ticket id -> the first `GET` of it once cancelled (the same every time after)."""
        self.points: dict[str, Point] = {"flushall": Point([], frozenset())}
        """Where Redis can go back to: `reload` (the last SAVE), `restore` (the last backup),
        `flushall` (nothing)."""
        self.sold = 0
        self.pause_restorers_s = 0.0
        """When Redis goes back the second time (`go_back(again=True)`): how long the
        processes then restoring are stopped."""

    def teardown(self) -> None:
        for proc in self.procs:
            proc.stop()
        self.db.close()
        self.redis.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- processes and Redis -------------------------------------------------------------

    def _spawn(self) -> None:
        journal = self.dir / f"journal-{len(self.procs)}"
        self.procs.append(ServiceProcess(self.world.config, self.redis.url, env={
            "CAPSVC_JOURNAL_DIR": str(journal)}).start())

    def now(self) -> int:
        return redis_ms(self.db)

    def snapshot_keys(self) -> list[tuple[Any, int, Any]]:
        """Every key, its time to live and its DUMP, as of one instant."""
        return backup_keys(self.db)

    def go_back(self, how: str, again: bool = False, starting: ServiceProcess | None = None
                ) -> None:
        """Make Redis lose what it ran since the last SAVE (`reload`, DEBUG RELOAD NOSAVE),
        everything (`flushall`), or what it ran since the last backup (`restore`: FLUSHALL
        and a RESTORE of every key, in one transaction); nothing without such a point, or
        for `none`. `again`: and back to that point once more as soon as a restore has put
        back every ticket sold since, before it raised the marks (the whole tried again
        when that moment passed unseen), while `starting` starts, if given."""
        point = self.points.get(how)
        if point is None:
            if starting is not None:
                starting.start()
            return
        lost = sorted(tid for _, tid in self.model.tickets if tid not in point.tickets)
        for _ in range(AGAIN_TRIES):
            if how == "reload":
                reload = ("DEBUG", "RELOAD", "NOSAVE")
                self.db.execute_command(*reload)  # type: ignore[no-untyped-call]
                count = self.db.hget(NODE_MARK, "*")
            else:
                pipe = self.db.pipeline(transaction=True)
                pipe.flushall()
                for key, ttl, value in point.keys:
                    pipe.restore(key, ttl, value, replace=True)
                pipe.hget(NODE_MARK, "*")
                count = pipe.execute()[-1]
            if not again or not lost:
                break
            if self._again(point, lost, count or b"", starting):
                break
        if starting is not None and starting.process is None:
            starting.start()

    def _again(self, point: Point, lost: list[str], count: bytes | str,
               starting: ServiceProcess | None) -> bool:
        """AGAIN run until it acts (True) or the moment has passed (False)."""
        args: list[Any] = [count, len(lost)]
        for tid in lost:
            args += [record_bucket_of(ticket_key(CHANNEL, tid)), f"{CHANNEL}/{tid}"]
        args += [a for key, ttl, value in point.keys for a in (key, ttl, value)]
        thread = None
        if starting is not None and starting.process is None:
            thread = threading.Thread(target=starting.start)
            thread.start()
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                done = self.db.eval(AGAIN, 1, NODE_MARK, *args)
                if done == 1 and self.pause_restorers_s:
                    self._pause(starting, self.pause_restorers_s)
                if done:
                    return bool(done == 1)
            return False
        finally:
            if thread is not None:
                thread.join()

    def _pause(self, starting: ServiceProcess | None, seconds: float) -> None:
        """Every process but `starting` stopped (SIGSTOP) for `seconds`, as a descheduled
        one is: its restore's announcement, lost with the rest, is not renewed meanwhile."""
        for proc in self.procs:
            if proc is not starting and proc.process is not None:
                os.kill(proc.process.pid, signal.SIGSTOP)
                threading.Timer(seconds, os.kill, (proc.process.pid, signal.SIGCONT)).start()

    # -- the calls, checked against the model --------------------------------------------

    def url(self, via: int) -> str:
        return self.procs[via].base_url

    def act(self, action: tuple[Any, ...], anyone: bool = True) -> None:
        """`action` (see ACTION); a known ticket through any process (`anyone`), or only
        through one that knows its current state."""
        kind = action[0]
        if kind == "sell":
            _, via, grids, draws, offset = action
            self.sold += 1
            request = {"ticket_id": f"R-{self.sold:03d}", "game": FAILOVER_GAME,
                       "first_draw": self.world.base + offset, "draws": draws,
                       "grids": grids}
            self._sell(via % len(self.procs), request)
            return
        if kind == "check":
            return
        _, pick, via = action
        known = nth(self.model.tickets, pick)
        if known is None:
            return
        (_, tid), t = known
        may = range(len(self.procs)) if anyone else sorted(self.knows[tid])
        via = may[via % len(may)]
        if kind == "replay":
            self._sell(via, t.request)
        elif kind == "get":
            self._get(via, tid, t)
        else:
            self._cancel(via, tid)

    def _sell(self, via: int, request: dict[str, Any]) -> None:
        tid = request["ticket_id"]
        expected = self.model.sell(CHANNEL, request, self.now())
        assert expected is not None  # no draw closes during a run
        status, headers, raw = answered(self.url(via), "POST", "/v1/tickets", request)
        self._check(status, raw, expected)
        if expected.replay_of is not None:
            assert raw == expected.replay_of.raw, (
                f"replay of {tid} via process {via}: {raw!r}, first answered "
                f"{expected.replay_of.raw!r}")
            assert headers.get("Idempotent-Replayed") == "true"
            if expected.replay_of.cancelled is None:
                self.knows[tid].add(via)
            return
        assert expected.decision is not None
        got = json.loads(raw)
        receipt = got.pop("receipt")
        assert (receipt is not None) == (expected.decision["total_cost"] > 0)
        assert got == expected.decision, (
            f"sale {tid} via process {via}: {got}, the model {expected.decision}")
        self.model.record_sale(CHANNEL, request, expected.decision, raw, self.now())
        self.knows[tid] = {via}

    def _cancel(self, via: int, tid: str) -> None:
        expected = self.model.cancel(CHANNEL, tid, self.now())
        assert expected is not None
        status, _, raw = answered(self.url(via), "POST", f"/v1/tickets/{tid}/cancel")
        self._check(status, raw, expected)
        if status != 200:
            return
        if tid in self.cancel_raw:
            assert raw == self.cancel_raw[tid], (raw, self.cancel_raw[tid])
            self.knows[tid].add(via)
            return
        body = json.loads(raw)
        assert body == {"ticket_id": tid, "status": "cancelled",
                        "released": self.model.record_cancel(CHANNEL, tid)}, body
        self.cancel_raw[tid] = raw
        self.knows[tid] = {via}

    def _get(self, via: int, tid: str, t: Ticket) -> None:
        """`GET` of an answered ticket: its decision byte for byte, cancelled once a cancel
        was answered (the same `cancelled` every time); at once through a process that
        knows it, within SETTLE_S through another."""
        deadline = time.monotonic() + (0 if via in self.knows[tid] else SETTLE_S)
        while True:
            status, _, raw = answered(self.url(via), "GET", f"/v1/tickets/{tid}")
            problem = self._reported(tid, t, status, raw)
            if problem is None or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        assert problem is None, f"GET {tid} via process {via}: {problem}"
        self.knows[tid].add(via)

    def _reported(self, tid: str, t: Ticket, status: int, raw: bytes) -> str | None:
        """What is wrong with a `GET` of `tid` that answered (status, raw); None: nothing."""
        if status != 200:
            return f"{status} {raw[:300]!r}: an answered decision is gone"
        if t.cancelled is None:
            return None if raw == t.raw else f"{raw!r}, not its decision {t.raw!r}"
        if not raw.startswith(t.raw[:-1] + b',"state":"cancelled","cancelled":'):
            return f"{raw!r}: an answered cancel is undone, or the decision changed"
        if json.loads(raw)["cancelled"]["released"] != t.cancelled:
            return f"{raw!r}: released {t.cancelled} answered"
        first = self.got_cancelled.setdefault(tid, raw)
        return None if raw == first else f"{raw!r}, earlier {first!r}"

    @staticmethod
    def _check(status: int, raw: bytes, expected: Expected) -> None:
        assert status == expected.status, (status, raw[:300], expected)
        if expected.code is not None:
            assert json.loads(raw)["error"]["code"] == expected.code, raw

    # -- rules -----------------------------------------------------------------------------

    @initialize(sales=st.lists(SALE, min_size=2, max_size=4))
    def open_sales(self, sales: list[tuple[Any, ...]]) -> None:
        """A few tickets sold before anything goes back."""
        for sale in sales:
            self.act(sale)

    @rule(sales=st.lists(SALE, min_size=1, max_size=3))
    def sell(self, sales: list[tuple[Any, ...]]) -> None:
        """New tickets on the hot combinations."""
        for sale in sales:
            self.act(sale)

    @rule(touch=TOUCH)
    def touch(self, touch: tuple[Any, ...]) -> None:
        """A known ticket replayed (its first answer, byte for byte), looked up or
        cancelled, through any process."""
        self.act(touch)

    def _snapshot(self, backup: bool) -> None:
        """A snapshot point: a key-by-key backup (for `restore`), or `SAVE` (for `reload`;
        with its keys too, for going back to it again)."""
        tickets = frozenset(tid for _, tid in self.model.tickets)
        if backup:
            self.points["restore"] = Point(self.snapshot_keys(), tickets)
        else:
            self.db.save()
            self.points["reload"] = Point(self.snapshot_keys(), tickets)

    @rule(backup=st.booleans(), then=st.lists(ACTION, max_size=2))
    def snapshot(self, backup: bool, then: list[tuple[Any, ...]]) -> None:
        """A snapshot point, then `then`: the first calls after it are any of them."""
        self._snapshot(backup)
        for action in then:
            self.act(action)

    @rule(backup=st.booleans(), during=st.lists(ACTION, max_size=3), again=st.booleans(),
          then=ACTION)
    def episode(self, backup: bool, during: list[tuple[Any, ...]], again: bool,
                then: tuple[Any, ...]) -> None:
        """A snapshot point, `during`, Redis back to that point (a reload, or the backup
        restored; `again`: once more while a process restores), then `then`: what is lost
        is exactly what `during` did."""
        self._snapshot(backup)
        for action in during:
            self.act(action)
        self.go_back("restore" if backup else "reload", again)
        self.act(then, anyone=False)

    @rule(how=st.sampled_from(["reload", "flushall", "restore"]), again=st.booleans(),
          then=ACTION)
    def back(self, how: str, again: bool, then: tuple[Any, ...]) -> None:
        """Redis goes back in place (to the last SAVE, to nothing, to the last backup;
        `again`: once more while a process restores), then `then`."""
        self.go_back(how, again)
        self.act(then, anyone=False)

    @rule(which=VIA, kill=st.booleans(), meanwhile=BACK, again=st.booleans(), then=ACTION)
    def restart(self, which: int, kill: bool, meanwhile: str, again: bool,
                then: tuple[Any, ...]) -> None:
        """A process stopped (SIGTERM, or SIGKILL), Redis going back or not while it is
        down (`again`: once more while a process restores), started again on the same port
        and journal directory, then `then`."""
        i = which % len(self.procs)
        old = self.procs[i]
        if kill and old.process is not None:
            old.process.kill()
            old.process.wait()
            old.process = None
        old.stop()
        self.procs[i] = ServiceProcess(self.world.config, self.redis.url, port=old.port,
                                       env={"CAPSVC_JOURNAL_DIR": str(old.journal_dir)})
        self.go_back(meanwhile, again, starting=self.procs[i])
        self.act(then, anyone=False)

    @precondition(lambda self: len(self.procs) == 1)
    @rule()
    def second(self) -> None:
        """A second process, with a journal directory of its own, on the same Redis."""
        self._spawn()

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def every_answer_holds(self) -> None:
        """Every ticket answered is what GET returns through each process that reported
        it; every counter is the answers' net stake, within the cap; the model agrees with
        itself."""
        for (_, tid), t in sorted(self.model.tickets.items(), key=lambda kv: kv[0]):
            for via in sorted(self.knows[tid]):
                self._get(via, tid, t)
        answers: dict[tuple[tuple[int, ...], int], int] = {}
        for t in self.model.tickets.values():
            if t.cancelled is not None:
                continue
            for numbers, stake in t.taken:
                for d in range(t.first, t.first + t.draws):
                    answers[(numbers, d)] = answers.get((numbers, d), 0) + stake
        assert {k: v for k, v in self.model.counters.items() if v} == answers
        for numbers in HOT:
            for draw in range(self.world.base + 1,
                              self.world.base + max(OFFSETS) + max(DRAWS)):
                staked = self._staked(numbers, draw)
                assert answers.get((numbers, draw), 0) <= CAP
                assert staked <= CAP, (numbers, draw, staked)
                assert staked == answers.get((numbers, draw), 0), (
                    f"{combination_key(numbers)} draw {draw}: Redis counts {staked}, the "
                    f"answers {answers.get((numbers, draw), 0)}")

    def _staked(self, numbers: tuple[int, ...], draw: int) -> int:
        path = (f"/v1/games/{FAILOVER_GAME}/draws/{draw}/combinations/"
                f"{combination_key(numbers)}")
        status, _, raw = answered(self.url(0), "GET", path, token=OPS_TOKEN)
        assert status == 200, (status, raw[:300])
        body = json.loads(raw)
        assert body["cap"] == CAP, body
        return int(body["staked"])


SETTINGS = settings(max_examples=5, stateful_step_count=20, deadline=None, derandomize=True,
                    database=None, phases=(Phase.explicit, Phase.generate),
                    suppress_health_check=list(HealthCheck))
"""Fixed examples (derandomized) for a stable run of about a minute; no shrinking: a failing
run prints its steps at once (to shrink one locally, add Phase.shrink), and when a step's
outcome depends on timing, hypothesis reports it as flaky, still a failure."""


def test_no_answer_is_lost_whichever_way_redis_goes_back(world: World) -> None:
    """However and whenever Redis goes back, every answer stands and every counter is its net."""
    RollbackMachine.world = world
    run_state_machine_as_test(  # type: ignore[no-untyped-call]
        RollbackMachine, settings=SETTINGS)


def test_redis_back_again_while_a_sale_is_put_back_loses_nothing(world: World) -> None:
    """A sale put back after a reload survives Redis reloading again before the marks are raised."""
    # The shortest run found of the state machine: SAVE, a sale, DEBUG RELOAD NOSAVE, and
    # Redis back to the SAVE once more as the process has put the sale back from its
    # journal but not yet raised its marks; then the checks (GET of the sale, its counter).
    RollbackMachine.world = world
    machine = RollbackMachine()
    try:
        sale = ("sell", 0, [{"numbers": list(HOT[0]), "stake": 1000}], 1, 1)
        machine.episode(backup=False, during=[sale], again=True, then=("check",))
        machine.every_answer_holds()
    finally:
        machine.teardown()


def _fill_then_start_another(world: World, pause_s: float) -> None:
    """Process 0 fills a combination; Redis goes back to before while process 1 is down,
    and once more as process 0 has put its sales back (process 0 then stopped `pause_s`);
    process 1, started meanwhile, sells that combination at once: refused."""
    RollbackMachine.world = world
    machine = RollbackMachine()
    machine.pause_restorers_s = pause_s
    try:
        machine.second()
        machine.snapshot(backup=True, then=[])
        for _ in range(CAP // 1000):
            machine.act(("sell", 0, [{"numbers": list(HOT[0]), "stake": 1000}], 1, 1))
        machine.restart(which=1, kill=True, meanwhile="restore", again=True,
                        then=("sell", 1, [{"numbers": list(HOT[0]), "stake": 500}], 1, 1))
        machine.every_answer_holds()
    finally:
        machine.teardown()


def test_a_process_started_while_another_puts_back_its_sales_sells_nothing_past_them(
        world: World) -> None:
    """Process 0 fills a combination; Redis goes back to before while process 1 is down,
    and once more as process 0 has put its sales back (its restore runs again); process 1,
    started meanwhile, sells that combination at once: refused, as the model says (when
    Redis goes back the second time depends on the restores' timing: the state machine
    above tries the orders at random)."""
    _fill_then_start_another(world, pause_s=0.0)


def test_a_process_started_while_another_restoring_is_paused_waits_for_it(
        slow_world: World) -> None:
    """The same, process 0 stopped for 0.8 s (of a 2 s `[journal] settle`) the moment
    Redis goes back the second time (its announcement lost with the rest, and not renewed
    meanwhile, as a descheduled process would leave it): process 1, which starts then,
    waits `settle` before its first sale, by when process 0 has announced again; it sells
    nothing past process 0's sales."""
    _fill_then_start_another(slow_world, pause_s=0.8)


OTHER_RESTORING_MS = 4000
"""How long the restore of a third process, announced by the test, holds the others."""


def _back_to_point(machine: RollbackMachine, announced_until: int) -> None:
    """Redis back to the backup, with a third process's announcement until
    `announced_until` (Redis TIME, ms), in one transaction: its end and its own field, as
    capsvc_announce writes them."""
    pipe = machine.db.pipeline(transaction=True)
    pipe.flushall()
    for key, ttl, value in machine.points["restore"].keys:
        pipe.restore(key, ttl, value, replace=True)
    pipe.hset(NODE_MARK, mapping={"!": announced_until, "!third": announced_until})
    pipe.execute()


def _logged(proc: ServiceProcess, text: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while text not in proc.log.read_text():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_restore_waiting_for_another_sees_redis_go_back_again_at_once(world: World) -> None:
    """Process 0 fills a combination; Redis goes back to before it, while a third process
    restores (its announcement, written by the test, holds 4 s). Process 0 puts its sales
    back, settles and waits for that one. Redis goes back once more, with the third
    process's announcement: process 0 sees it and restores again, announcing, while the
    other still holds, not once it has ended; process 1 then sells nothing past process 0's
    sales."""
    RollbackMachine.world = world
    machine = RollbackMachine()
    try:
        machine.second()
        machine.snapshot(backup=True, then=[])
        for _ in range(CAP // 1000):
            machine.act(("sell", 0, [{"numbers": list(HOT[0]), "stake": 1000}], 1, 1))
        _back_to_point(machine, redis_ms(machine.db) + OTHER_RESTORING_MS)
        waiting = "waiting for other processes' restores"
        assert _logged(machine.procs[0], waiting, OTHER_RESTORING_MS / 1000)
        until = redis_ms(machine.db) + OTHER_RESTORING_MS
        _back_to_point(machine, until)
        assert _logged(machine.procs[0], "restoring again", 2 * OTHER_RESTORING_MS / 1000)
        assert redis_ms(machine.db) < until, (
            "process 0 saw Redis go back again only once the other's restore had ended")
        machine.act(("sell", 1, [{"numbers": list(HOT[0]), "stake": 500}], 1, 1))
        machine.every_answer_holds()
    finally:
        machine.teardown()
