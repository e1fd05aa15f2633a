"""The journal when Redis loses answered decisions, and when the journal itself is harmed,
against real redis-server and real `capsvc serve` processes over HTTP.

Each test asserts a guaranteed behaviour: the cap holds when a second process sells before
an idle one has restored, a player is charged only what a restore from an older file says
was accepted, a Redis emptied in place is restored before the next sale, a full journal
disk leaves a bounded number of files, and verify names a tampered last sale and a missing
file too young to have been pruned.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from capsvc.recovery.reconciler import WATCH_S
from capsvc.redis.marks import NODE_MARK
from tests.conftest import CONFIG, TEN, TOKENS
from tests.support.failover import HttpClient
from tests.support.faults import FaultProxy, command
from tests.support.servers import RedisServer
from tests.support.service import ServiceProcess

pytestmark = pytest.mark.slow

_ids = itertools.count(1)
_RUN = os.urandom(3).hex()
EIGHT = TEN[:8]
FDJ_CAP = 5000


def _tid() -> str:
    return f"JR-{_RUN}-{next(_ids):05d}"


def _req(url: str, method: str, path: str, body: Any = None, token: str | None = "fr"
         ) -> tuple[int, Any]:
    client = HttpClient(5.0)
    try:
        return client.request(url, method, path, body=body,
                              token=None if token is None else TOKENS.get(token, token))
    finally:
        client.close()


def _until_answer(url: str, method: str, path: str, body: Any = None, token: str = "fr",
                  timeout_s: float = 20.0) -> tuple[int, Any]:
    """The request sent again while it answers 503 (or cannot connect), as a sales
    system must."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status, reply = _req(url, method, path, body, token)
        except OSError:
            status, reply = 0, None
        if status not in (0, 503) or time.monotonic() > deadline:
            return status, reply
        time.sleep(0.05)


def _sell(url: str, body: dict[str, Any], token: str = "fr") -> tuple[int, Any]:
    return _until_answer(url, "POST", "/v1/tickets", body, token)


def _current(url: str, game: str = "fdj-keno") -> int:
    status, body = _until_answer(url, "GET", f"/v1/games/{game}/draws/current", token="admin")
    assert status == 200, body
    return int(body["draw"])


def _staked(url: str, numbers: list[int], draw: int, game: str = "fdj-keno") -> int:
    path = f"/v1/games/{game}/draws/{draw}/combinations/{'-'.join(map(str, numbers))}"
    status, body = _until_answer(url, "GET", path, token="admin")
    assert status == 200, body
    return int(body["staked"])


def _fdj(draw: int, stake: int = 500, numbers: list[int] = EIGHT) -> dict[str, Any]:
    return {"ticket_id": _tid(), "game": "fdj-keno", "first_draw": draw,
            "grids": [{"numbers": numbers, "stake": stake}]}


def _verify(*dirs: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "capsvc", "journal", "verify",
                           *map(str, dirs)], capture_output=True, text=True, timeout=60)


def _files(directory: Path) -> list[Path]:
    return sorted(directory.glob("capsvc-*.jsonl"))


@pytest.fixture
def volatile_redis() -> Iterator[RedisServer]:
    """A Redis without persistence: a restart comes back empty, with a new run id."""
    server = RedisServer(extra=("--appendonly", "no")).start()
    yield server
    server.stop()


def _restart_empty(server: RedisServer) -> None:
    server.kill()
    server.start()


# -- 1. restore is per process: no other process sells past the cap before it ------------

def test_cap_holds_across_processes_after_redis_loses_everything(
        volatile_redis: RedisServer) -> None:
    """Two capsvc processes on one Redis, each with its own journal (the shipped StatefulSet:
    one volume claim per pod). A sells a combination to its cap; Redis restarts empty (new
    run id). B, which has nothing of its own to put back, then sells the same combination:
    were B to sell before A has put its decisions back, the acknowledged accepted stakes
    would add up to twice the cap, and the counter would pass it once A restores.

    What holds it: every process watches its Redis (a loss is noticed within the watch
    period, even by an idle process) and announces its restore in Redis; a process that
    found Redis behind waits `[journal] settle` (1 s, the default) and for every announced
    restore to end before it sells. The acknowledged accepted stakes and the counter stay
    within the cap."""
    config = Path(tempfile.mkdtemp(prefix="jr-settle-")) / "capsvc.toml"
    config.write_text(CONFIG.read_text().replace('settle = "0s"', 'settle = "1s"'))
    a = ServiceProcess(str(config), volatile_redis.url).start()
    b = ServiceProcess(str(config), volatile_redis.url).start()
    try:
        draw = _current(a.base_url)
        accepted = 0
        for _ in range(FDJ_CAP // 500):
            status, body = _sell(a.base_url, _fdj(draw))
            assert status == 200, body
            assert body["status"] == "accepted", body
            accepted += 500
        _restart_empty(volatile_redis)
        for _ in range(FDJ_CAP // 500):
            status, body = _sell(b.base_url, _fdj(draw))
            assert status == 200, body
            if body["status"] == "accepted":
                accepted += 500
        # A reaches the new Redis (any request), restores its journal.
        _current(a.base_url)
        time.sleep(0.5)
        staked = _staked(a.base_url, EIGHT, draw)
        what = f"acknowledged accepted stakes {accepted}, counter {staked}, cap {FDJ_CAP}"
        assert accepted <= FDJ_CAP, what
        assert staked <= FDJ_CAP, what
    finally:
        a.stop()
        b.stop()


def test_a_restorer_that_stalls_still_holds_the_others() -> None:
    """A puts its sales back after a FLUSHALL, and stalls half-way (forced: its first bulk
    call, and everything behind it on its restore's connection, its announcement's renewals
    too, held 1.5 s, as a process descheduled or paused by its host would stall). B, which
    lost nothing of its own, sells the same combination meanwhile: its sales wait for A's
    restore, and are judged on A's sales put back (refused by the cap), not on the emptied
    counter while A's announcement would have run out."""
    config = Path(tempfile.mkdtemp(prefix="jr-stall-")) / "capsvc.toml"
    config.write_text(CONFIG.read_text().replace('settle = "0s"', 'settle = "1s"'))
    redis = RedisServer().start()
    with FaultProxy("127.0.0.1", redis.port) as proxy:
        a = ServiceProcess(str(config), proxy.url).start()
        b = ServiceProcess(str(config), redis.url).start()
        try:
            draw = _current(a.base_url)
            for _ in range(FDJ_CAP // 500):
                assert _sell(a.base_url, _fdj(draw))[1]["status"] == "accepted"
            release = threading.Event()
            held = proxy.hold_request(command("FCALL", "capsvc_restore_tickets"), release)
            threading.Timer(1.5, release.set).start()
            redis.client().flushall()
            deadline = time.monotonic() + 10
            while held.hits == 0:  # A's restore has begun, and stalls
                assert time.monotonic() < deadline, "A did not restore"
                time.sleep(0.01)
            status, body = _until_answer(b.base_url, "POST", "/v1/tickets", _fdj(draw))
            assert release.is_set(), "B answered before A's restore could go on"
            assert (status, body["status"]) == (200, "rejected"), body
            assert _staked(b.base_url, EIGHT, draw) == FDJ_CAP
        finally:
            release.set()
            a.stop()
            b.stop()
    redis.stop()


# -- 2. restore from an older file: the player is charged only the accepted cost ---------

@pytest.mark.parametrize("sale_calls", ["one", "steps"])
def test_restore_after_older_aof_charges_the_player_only_the_accepted_cost(
        sale_calls: str, tmp_path: Path) -> None:
    """An lnm-keno sale (daily limit) answered `partial`: grid 0 refused by the cap, grid 1
    accepted (cost 2500). Redis then restarts from an older AOF: in one call, one without
    the sale (the AOF cut right before the MULTI of its effects); in steps (claim, take the
    requested cost from the budget, reserve, settle the budget to the accepted cost,
    finalize), one that has the budget's take but not its settlement (cut right before the
    settle's MULTI). The restore writes the journaled decision and its budget: the player's
    day holds 2500, not 0 nor the requested 5000 ("Stakes of grids rejected by the cap do
    not use the budget"), and the janitor's later turns change nothing, the ticket being
    decided."""
    config = tmp_path / "capsvc.toml"
    config.write_text(f'{CONFIG.read_text()}\n[redis]\nsale_calls = "{sale_calls}"\n')
    redis = RedisServer(extra=("--appendfsync", "always")).start()
    svc = ServiceProcess(str(config), redis.url).start()
    player = f"P-{_RUN}"
    full = [1, 2, 3, 4, 5, 6, 7, 8]
    other = [11, 12, 13, 14, 15, 16, 17, 18]
    try:
        draw = _current(svc.base_url, "lnm-keno") + 1
        for i in range(20):  # the cap of lnm-keno is 50000: 20 x 2500
            status, body = _sell(svc.base_url, {
                "ticket_id": _tid(), "game": "lnm-keno", "player_id": f"F{_RUN}{i}",
                "first_draw": draw, "grids": [{"numbers": full, "stake": 2500}]}, token="ma")
            assert status == 200, body
            assert body["status"] == "accepted", body
        status, body = _sell(svc.base_url, {
            "ticket_id": _tid(), "game": "lnm-keno", "player_id": player, "first_draw": draw,
            "grids": [{"numbers": full, "stake": 2500}, {"numbers": other, "stake": 2500}]},
            token="ma")
        assert status == 200, body
        assert (body["status"], body["total_cost"]) == ("partial", 2500), body
        status, before = _req(svc.base_url, "GET", f"/v1/players/{player}?game=lnm-keno",
                              token="ma")
        assert status == 200, before
        assert before["spent"] == 2500, before

        redis.stop()
        aof = sorted((redis.dir / "appendonlydir").glob("*.incr.aof"))[-1]
        data = aof.read_bytes()
        budget = f"b:{{pl:{player}}}".encode()
        if sale_calls == "one":  # the sale's effects, its budget's among them
            settle = data.rfind(budget)
        else:  # the settle gives the refused grid's 2500 back
            settle = data.rfind(b"-2500")
            assert data.rfind(budget, 0, settle) > 0
        assert settle > 0
        cut = data.rfind(b"*1\r\n$5\r\nMULTI\r\n", 0, settle)
        aof.write_bytes(data[:cut])  # an older file: the settle (and what follows) lost
        redis.start()

        time.sleep(0.5)
        status, after = _until_answer(svc.base_url, "GET",
                                      f"/v1/players/{player}?game=lnm-keno", token="ma")
        assert status == 200, after
        time.sleep(2.5)  # the janitor's turns (interval 1 s) change nothing either
        status, later = _until_answer(svc.base_url, "GET",
                                      f"/v1/players/{player}?game=lnm-keno", token="ma")
        assert later["spent"] == 2500, (
            f"the player's day holds {later['spent']} after the restore, for a ticket whose "
            "decision costs 2500")
    finally:
        svc.stop()
        redis.stop()


# -- 3. a Redis emptied in place keeps its identity, and is restored all the same --------

def test_flushall_is_restored_before_the_next_sale() -> None:
    """Redis loses everything without a restart (FLUSHALL, as an operator's mistake or a
    restored empty backup in place): its run id and replication id stay. The watch finds
    the process's mark gone within its period (capsvc.recovery.reconciler.WATCH_S) and
    restores: the next sale is judged on the restored counters, and the answered ticket is
    found. Its announcement is ended by then, not left to run out (the process sells as
    soon as its restore is done)."""
    redis = RedisServer().start()
    svc = ServiceProcess(str(CONFIG), redis.url).start()
    try:
        draw = _current(svc.base_url)
        first = _fdj(draw)
        assert _sell(svc.base_url, first)[1]["status"] == "accepted"
        for _ in range(FDJ_CAP // 500 - 1):
            assert _sell(svc.base_url, _fdj(draw))[1]["status"] == "accepted"
        redis.client().flushall()
        time.sleep(4 * WATCH_S)
        status, body = _until_answer(svc.base_url, "POST", "/v1/tickets", _fdj(draw))
        looked_up = _until_answer(svc.base_url, "GET", f"/v1/tickets/{first['ticket_id']}")
        assert (status, body["status"]) == (200, "rejected"), body
        assert looked_up[0] == 200, looked_up
        assert [f for f in redis.client().hkeys(NODE_MARK) if f.startswith(b"!")] == []
    finally:
        svc.stop()
        redis.stop()


def test_a_restore_waits_for_a_busy_redis_rather_than_starting_again() -> None:
    """A restore's replies come late (Redis working through the windows sent ahead of them
    on a loaded machine; forced here: the first bulk call's reply, and every one behind it
    on that connection, held 1.5 s, past the sales' `[redis] timeout` and the 1 s a restore
    once waited): the restore goes on and ends once, it is not failed and started over."""
    redis = RedisServer().start()
    with FaultProxy("127.0.0.1", redis.port) as proxy:
        svc = ServiceProcess(str(CONFIG), proxy.url).start()
        try:
            draw = _current(svc.base_url)
            sold = [_fdj(draw) for _ in range(3)]
            for ticket in sold:
                assert _sell(svc.base_url, ticket)[1]["status"] == "accepted"
            late = proxy.delay_reply(command("FCALL", "capsvc_restore_tickets"), 1.5)
            redis.client().flushall()
            status, _ = _until_answer(svc.base_url, "GET",
                                      f"/v1/tickets/{sold[0]['ticket_id']}")
            assert status == 200
            assert late.spent
            log = svc.log.read_text()
            assert "restore into redis failed" not in log
            assert log.count("redis reconciled with the journal") == 2  # the start, the loss
        finally:
            svc.stop()
    redis.stop()


# -- 4. a full journal disk: the failed batches leave a bounded number of files -----------

def test_full_journal_disk_does_not_create_files_without_bound(tmp_path: Path) -> None:
    """The journal directory on a 64 KiB tmpfs. Once it is full, every batch fails (each
    sale answering 503, as it must), and a failed write's file is cut back rather than left
    behind: however many requests fail while the disk stays full, the directory holds at
    most a handful of files."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    redis = RedisServer().start()
    journal = mount / "journal"
    svc = ServiceProcess(str(CONFIG), redis.url, env={"CAPSVC_JOURNAL_DIR": str(journal)})
    try:
        svc.start()
        draw = _current(svc.base_url)
        statuses: dict[int, int] = {}
        for i in range(400):
            numbers = sorted({(i * 7 + k * 5) % 70 + 1 for k in range(8)})
            status, _ = _req(svc.base_url, "POST", "/v1/tickets",
                             _fdj(draw, 100, numbers if len(numbers) == 8 else EIGHT))
            statuses[status] = statuses.get(status, 0) + 1
        assert statuses.get(503), f"the disk never filled: {statuses}"
        files = _files(journal)
        empty = [p for p in files if p.stat().st_size == 0]
        assert len(files) <= 5, (
            f"{len(files)} journal files ({len(empty)} of them empty) after {statuses}")
    finally:
        svc.stop()
        redis.stop()
        subprocess.run(["umount", str(mount)], capture_output=True)


# -- 5./6. verify: tampering at the newest end of a journal ------------------------------

@pytest.fixture
def journal_with_sales() -> Iterator[tuple[Path, str, str]]:
    """A service's journal with a few sales and small files (several of them, chained),
    the service stopped, its Redis still up. Yields (journal dir, config path, Redis URL)."""
    tmp = Path(tempfile.mkdtemp(prefix="jr-verify-"))
    config = tmp / "capsvc.toml"
    config.write_text(CONFIG.read_text().replace('settle = "0s"',
                                                 'settle = "0s"\nmax_file_bytes = 4096'))
    redis = RedisServer().start()
    svc = ServiceProcess(str(config), redis.url)
    try:
        svc.start()
        draw = _current(svc.base_url)
        for _ in range(30):
            status, _ = _sell(svc.base_url, _fdj(draw, 100))
            assert status == 200
        svc.stop()
        assert len(_files(svc.journal_dir)) >= 3
        assert _verify(svc.journal_dir).returncode == 0
        yield svc.journal_dir, str(config), redis.url
    finally:
        svc.stop()
        redis.stop()


def test_verify_detects_an_altered_last_sale(
        journal_with_sales: tuple[Path, str, str]) -> None:
    """The last sale a process journaled is altered (its ticket id and a grid's stake made
    to look like another sale): the process's last checkpoint, written as it stopped,
    follows it in the chain, so verify names the break; against Redis, while the draw is
    retained, the totals no longer match either."""
    directory, config, redis_url = journal_with_sales
    newest = next(f for f in reversed(_files(directory)) if b'"type":"sale' in f.read_bytes())
    lines = newest.read_bytes().split(b"\n")
    assert lines[-1] == b""
    n = max(i for i, line in enumerate(lines) if b'"type":"sale' in line)
    last = json.loads(lines[n])
    sold = last["sales"][-1] if last["type"] == "sales" else last  # sales made together
    sold["ticket"] = sold["ticket"] + "-forged"
    sold["grids"][0]["stake"] = 100
    lines[n] = json.dumps(last, separators=(",", ":")).encode()
    newest.write_bytes(b"\n".join(lines))
    out = _verify(directory)
    assert out.returncode == 1, out.stdout
    assert "differs" in out.stdout or "does not follow" in out.stdout, out.stdout
    against = subprocess.run([sys.executable, "-m", "capsvc", "journal", "verify",
                              str(directory), "--config", config, "--redis-url", redis_url],
                             capture_output=True, text=True, timeout=60)
    assert against.returncode == 1, against.stdout
    assert "differs from Redis" in against.stdout


def test_verify_detects_a_missing_file_that_cannot_have_been_pruned(
        journal_with_sales: tuple[Path, str, str]) -> None:
    """The first file of a process (its decisions of the last seconds, far from `keep`,
    90 days) is deleted: the next file's `open` line names it and its name says when it was
    opened, so verify cannot take it for a file pruned past `keep` and exits non-zero."""
    directory, _, _ = journal_with_sales
    first = _files(directory)[0]
    assert b'"seq":0' in first.read_bytes().split(b"\n")[0]
    first.unlink()
    out = _verify(directory)
    assert out.returncode != 0, f"verify missed a deleted file:\n{out.stdout}"
