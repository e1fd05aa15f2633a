"""The journal against real processes: `capsvc serve`, a real Redis that loses what it
had, the journal restoring it before the next sale; restore run on demand (twice, and while
sales go on); a worker killed with SIGKILL under load; a disk that refuses writes; verify
against Redis; a restore that has to count past the cap, and says so."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from capsvc.journal.reader import records
from capsvc.journal.records import SaleRecord
from tests.support.failover import (
    FAILOVER_GAME,
    HOT_COMBINATIONS,
    OPS_TOKEN,
    SELLER_TOKEN,
    HttpClient,
    Sellers,
    audit,
    current_draw,
    write_failover_config,
)
from tests.support.servers import RedisServer
from tests.support.service import ServiceProcess

pytestmark = pytest.mark.slow


def lose_everything(redis: RedisServer) -> None:
    """Redis dies and comes back empty on the same port: a restart from an older (here,
    no) file, a backup that lacks the last hours. Its run id is new."""
    redis.kill()
    for p in redis.dir.iterdir():
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    redis.start()


def sell_for(service: ServiceProcess, seconds: float, *, count: int = 4, seed: int = 1,
             at_least: int = 1) -> Sellers:
    """`count` sellers for `seconds` from the first answer, and until `at_least` sales
    are acknowledged (a loaded machine answers fewer in the time)."""
    draw = current_draw(service.base_url)
    crowd = Sellers([service.base_url], [draw + 1 + i for i in range(6)], count=count,
                    seed=seed).start()
    crowd.wait_acknowledged(1)
    time.sleep(seconds)
    crowd.wait_acknowledged(at_least)
    crowd.stop()
    return crowd


def journaled(directory: Path) -> dict[str, list[SaleRecord]]:
    out: dict[str, list[SaleRecord]] = {}
    for _, _, r in records(directory):
        if isinstance(r, SaleRecord):
            out.setdefault(r.ticket, []).append(r)
    return out


def capsvc(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "capsvc", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})},
                          check=False)


def metric(base_url: str, name: str) -> float:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    return sum(float(v) for v in found)


@pytest.fixture
def config(tmp_path: Path) -> str:
    return write_failover_config(tmp_path)


@pytest.fixture
def redis() -> Any:
    server = RedisServer().start()
    yield server
    server.stop()


def test_a_redis_that_lost_everything_gets_every_answered_decision_back_before_a_sale(
        config: str, redis: RedisServer) -> None:
    service = ServiceProcess(config, redis.url).start()
    try:
        crowd = sell_for(service, 1.5, at_least=40)
        client = HttpClient()
        cancelled = []
        for sale in crowd.acknowledged[:40]:
            if sale.decision["total_cost"]:
                status, body = client.request(service.base_url, "POST",
                                              f"/v1/tickets/{quote(sale.ticket_id)}/cancel",
                                              token=SELLER_TOKEN)
                assert status == 200, body
                cancelled.append(sale)
            if len(cancelled) == 5:
                break
        assert len(cancelled) == 5
        lose_everything(redis)
        result = audit(service.base_url, crowd)
        assert result.lost == {}, "an answered decision did not come back"
        released: dict[tuple[str, int], int] = {}
        for sale in cancelled:
            status, body = client.request(service.base_url, "GET",
                                          f"/v1/tickets/{quote(sale.ticket_id)}",
                                          token=SELLER_TOKEN)
            assert status == 200
            assert body["cancelled"]["released"] == sale.decision["total_cost"]
            for g in sale.decision["grids"]:
                if g["status"] == "accepted":
                    key = ("-".join(map(str, g["numbers"])), int(sale.request["first_draw"]))
                    stake = int(sale.request["grids"][g["index"]]["stake"])
                    released[key] = released.get(key, 0) + stake
        for key, (staked, answered) in result.counters.items():
            assert staked == answered - released.get(key, 0), key
            assert staked <= result.cap
        # On demand, twice: nothing more to put back, nothing counted again.
        env = {"CAPSVC_JOURNAL_DIR": str(service.journal_dir)}
        for _ in range(2):
            out = capsvc("journal", "restore", "--config", config, "--redis-url", redis.url,
                         env=env)
            assert out.returncode == 0, out.stderr
            assert "nothing (Redis had every decision)" in out.stdout, out.stdout
        again = audit(service.base_url, crowd)
        assert again.counters == result.counters
        verified = capsvc("journal", "verify", str(service.journal_dir), "--config", config,
                          "--redis-url", redis.url)
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert metric(service.base_url, "capsvc_journal_restored_total") > 0
    finally:
        service.stop()


def test_restore_on_demand_while_sales_go_on_counts_nothing_twice(
        config: str, redis: RedisServer) -> None:
    service = ServiceProcess(config, redis.url).start()
    try:
        draw = current_draw(service.base_url)
        crowd = Sellers([service.base_url], [draw + 1 + i for i in range(6)], count=4,
                        seed=2).start()
        crowd.wait_acknowledged(20)
        env = {"CAPSVC_JOURNAL_DIR": str(service.journal_dir)}
        for _ in range(3):
            out = capsvc("journal", "restore", "--config", config, "--redis-url", redis.url,
                         env=env)
            assert out.returncode == 0, out.stderr
        crowd.stop()
        result = audit(service.base_url, crowd)
        assert result.lost == {}
        assert result.mismatched == []
        assert result.over_cap == []
    finally:
        service.stop()


def test_a_worker_killed_under_load_journaled_every_decision_it_answered(
        config: str, redis: RedisServer) -> None:
    service = ServiceProcess(config, redis.url, args=("--workers", "2")).start()
    try:
        draw = current_draw(service.base_url)
        crowd = Sellers([service.base_url], [draw + 1 + i for i in range(6)], count=6,
                        seed=3).start()
        crowd.wait_acknowledged(50)
        assert service.process is not None
        workers = [int(p) for p in subprocess.run(
            ["pgrep", "-P", str(service.process.pid)], capture_output=True, text=True,
            check=False).stdout.split()]
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)
        time.sleep(1.0)
        crowd.stop()
        found = journaled(service.journal_dir)
        missing = [s.ticket_id for s in crowd.acknowledged if s.ticket_id not in found]
        assert missing == [], f"{len(missing)} answered sale(s) not in the journal"
        for sale in crowd.acknowledged[:200]:
            assert any(json.loads(bytes(r.decision)) == sale.decision
                       for r in found[sale.ticket_id])
        verified = capsvc("journal", "verify", str(service.journal_dir))
        assert verified.returncode == 0, verified.stdout
    finally:
        service.stop()


def test_a_disk_that_refuses_writes_never_gets_an_unjournaled_decision_acknowledged(
        config: str, redis: RedisServer) -> None:
    """The journal's files may not grow past 96 KiB (RLIMIT_FSIZE: writes past it fail
    with EFBIG, as a full disk fails them with ENOSPC): batches fail, their sales answer
    503, a new file is opened; every 200 is in the journal."""

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (96 * 1024, 96 * 1024))

    service = ServiceProcess(config, redis.url, preexec_fn=small_files).start()
    try:
        draw = current_draw(service.base_url)
        crowd = Sellers([service.base_url], [draw + 1 + i for i in range(6)], count=6,
                        seed=4).start()
        # Sales until the limit has bitten (however many that takes on this machine): a
        # write failed, a sale was answered 503 and sent again, a new file was opened.
        deadline = time.monotonic() + 60
        while not (crowd.retries > 0
                   and metric(service.base_url, "capsvc_journal_errors_total") > 0
                   and len(list(service.journal_dir.iterdir())) > 1):
            assert time.monotonic() < deadline, "no write failed: the limit did not bite"
            time.sleep(0.1)
        crowd.stop()
        found = journaled(service.journal_dir)
        missing = [s.ticket_id for s in crowd.acknowledged if s.ticket_id not in found]
        assert missing == []
        assert len(list(service.journal_dir.iterdir())) > 1
        verified = capsvc("journal", "verify", str(service.journal_dir))
        assert verified.returncode == 0, verified.stdout
    finally:
        service.stop()


def test_a_restore_that_must_count_past_the_cap_does_and_says_so(
        config: str, redis: RedisServer, tmp_path: Path) -> None:
    """Process A sells a combination to its cap; Redis loses it all while A is down; B
    (another host, its own journal) sells it to the cap again on the empty Redis; A comes
    back and restores what it answered: the counter goes past the cap (it was sold twice
    over: what a journal per host cannot prevent when another host sells on the Redis
    first), the overshoot is logged, counted and named by verify."""
    a_env = {"CAPSVC_JOURNAL_DIR": str(tmp_path / "a")}
    a = ServiceProcess(config, redis.url, env=a_env).start()
    draw = current_draw(a.base_url) + 1
    numbers = list(HOT_COMBINATIONS[0])
    client = HttpClient()

    def fill(service: ServiceProcess, prefix: str) -> None:
        for i in range(4):  # 4 x 500 = the cap of 2000
            status, body = client.request(service.base_url, "POST", "/v1/tickets",
                                          token=SELLER_TOKEN, body={
                    "ticket_id": f"{prefix}{i}", "game": FAILOVER_GAME, "first_draw": draw,
                    "grids": [{"numbers": numbers, "stake": 500}]})
            assert status == 200, body
            assert body["status"] == "accepted", body

    fill(a, "A")
    a.stop()
    lose_everything(redis)
    b = ServiceProcess(config, redis.url, env={"CAPSVC_JOURNAL_DIR": str(tmp_path / "b")})
    b.start()
    try:
        fill(b, "B")
        a = ServiceProcess(config, redis.url, env=a_env).start()
        path = (f"/v1/games/{FAILOVER_GAME}/draws/{draw}/combinations/"
                f"{'-'.join(map(str, numbers))}")
        status, body = client.request(a.base_url, "GET", path, token=OPS_TOKEN)
        assert status == 200
        assert body["staked"] == 4000
        assert body["selectable"] is False
        # A's 4 grids, each counted back on a counter B had brought to the cap.
        assert metric(a.base_url, "capsvc_journal_restore_over_cap_total") == 4
        assert "past the cap" in a.log.read_text()
        verified = capsvc("journal", "verify", str(tmp_path / "a"), str(tmp_path / "b"))
        assert verified.returncode == 1
        assert "4000 staked, over its cap of 2000" in verified.stdout
    finally:
        b.stop()
        a.stop()


TEST_CONFIG = str(Path(__file__).parent.parent / "capsvc-test.toml")


def test_stops_player_budgets_limits_and_stakes_come_back_too(redis: RedisServer) -> None:
    """What else a process answers: an admin's stop, a player's sales against the daily
    limit, a self-limit, another game's stake. Redis loses it all; each is back, counted
    once, before anything else is judged."""
    service = ServiceProcess(TEST_CONFIG, redis.url).start()
    client = HttpClient()
    ma, ops = "t-ma", "t-admin"
    try:
        current = client.request(service.base_url, "GET", "/v1/games/lnm-keno/draws/current",
                                 token=ma)[1]["draw"]
        stopped = current + 3
        assert client.request(service.base_url, "POST",
                              f"/v1/games/fdj-keno/draws/{stopped}/close", token=ops)[0] == 200
        for i in range(3):
            status, body = client.request(service.base_url, "POST", "/v1/tickets", token=ma,
                                          body={"ticket_id": f"M{i}", "game": "lnm-keno",
                                                "player_id": "P-1", "draws": 2,
                                                "grids": [{"numbers": [1, 2, 3, 4, 5],
                                                           "stake": 1000}]})
            assert status == 200, body
            assert body["status"] == "accepted", body
        status, limit = client.request(service.base_url, "PUT", "/v1/players/P-1/limit",
                                       token=ma, body={"daily": 500000})
        assert status == 200, limit
        status, stake = client.request(service.base_url, "POST", "/v1/players/P-1/stakes",
                                       token=ma, body={"ref": "loto-1", "game": "loto",
                                                       "amount": 700})
        assert status == 200
        assert stake["status"] == "accepted"
        before = client.request(service.base_url, "GET", "/v1/players/P-1", token=ma)[1]
        assert before["spent"] == 3 * 2000 + 700
        lose_everything(redis)
        after = client.request(service.base_url, "GET", "/v1/players/P-1", token=ma)
        while after[0] == 503:
            time.sleep(0.05)
            after = client.request(service.base_url, "GET", "/v1/players/P-1", token=ma)
        assert after == (200, before)
        status, draw = client.request(service.base_url, "GET",
                                      f"/v1/games/fdj-keno/draws/{stopped}", token=ops)
        assert status == 200
        assert draw["status"] == "closed"
        # The stake's ref and the tickets' budgets are known again: a retry charges nothing.
        status, again = client.request(service.base_url, "POST", "/v1/players/P-1/stakes",
                                       token=ma, body={"ref": "loto-1", "game": "loto",
                                                       "amount": 700})
        assert status == 200
        assert again["remaining"] == stake["remaining"]
        assert client.request(service.base_url, "GET", "/v1/players/P-1",
                              token=ma)[1]["spent"] == before["spent"]
    finally:
        service.stop()


async def test_nothing_is_sold_and_readyz_is_not_ready_while_the_journal_is_restored(
        redis: RedisServer, tmp_path: Path) -> None:
    """A journal of 6,000 decisions restored into a Redis that has none of them: while it
    runs, /readyz says `restored: false` and a sale is a 503; then both go through."""
    import aiohttp

    from capsvc.config import load_settings
    from capsvc.http.server import build, prepare, start_serving
    from capsvc.journal.recorder import Recorder
    from capsvc.journal.writer import open_journal
    from capsvc.ops.workers import listen
    from tests.unit.test_journal import HOT, decision, sale

    settings = dataclasses.replace(load_settings(TEST_CONFIG), journal_dir=str(tmp_path / "j"))
    journal = open_journal(settings.journal_dir, max_file_bytes=1 << 30, keep_ms=86_400_000)
    rec = Recorder(journal, lambda: 1)
    await asyncio.gather(*[
        rec.sale("answer", "fr-retail", s, f"{i:016x}", 1, decision(s), 10**13, [5000])
        for i, s in enumerate(sale(f"R{i}", numbers=[1 + i % 60, *range(61, 68)])
                              for i in range(6000))])
    await journal.aclose()
    svc = build(settings, redis.url)
    sock = listen("127.0.0.1", 0)
    assert svc.reconciler is not None
    restoring = svc.reconciler.start()
    serving = await start_serving(svc, sock)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/readyz") as r:
                assert r.status == 503
                assert (await r.json())["checks"]["restored"] is False
            async with http.post(url + "/v1/tickets", headers={"Authorization": "Bearer t-fr"},
                                 json={"ticket_id": "NEW", "game": "fdj-keno",
                                       "grids": [{"numbers": HOT, "stake": 500}]}) as r:
                assert r.status == 503
            assert not restoring.done()
            await restoring
            await prepare(svc)
            async with http.get(url + "/readyz") as r:
                assert r.status == 200, await r.text()
            async with http.post(url + "/v1/tickets", headers={"Authorization": "Bearer t-fr"},
                                 json={"ticket_id": "NEW", "game": "fdj-keno",
                                       "grids": [{"numbers": HOT, "stake": 500}]}) as r:
                assert r.status == 200
    finally:
        await serving.cleanup()
        await svc.redis.aclose()
        assert svc.journal is not None
        await svc.journal.aclose()


def test_the_journal_turned_off_says_so_and_writes_nothing(tmp_path: Path,
                                                          redis: RedisServer) -> None:
    config = write_failover_config(tmp_path, journal=False)
    service = ServiceProcess(config, redis.url).start()
    try:
        crowd = sell_for(service, 0.5, count=2)
        assert crowd.acknowledged
        with urllib.request.urlopen(service.base_url + "/readyz", timeout=5) as resp:
            checks = json.loads(resp.read())["checks"]
        assert "journal" not in checks
        assert "restored" not in checks
        assert not service.journal_dir.exists()
        assert "the journal is off" in service.log.read_text()
    finally:
        service.stop()


def test_a_restart_on_the_same_redis_reads_nothing_a_redis_emptied_meanwhile_everything(
        config: str, redis: RedisServer, tmp_path: Path) -> None:
    """The lifetime's last checkpoint and its field in the Redis's mark: a process
    restarting on the Redis it left opens at once and puts nothing back; if the Redis was
    emptied in place meanwhile (same identity, mark gone), it restores."""
    env = {"CAPSVC_JOURNAL_DIR": str(tmp_path / "journal")}
    first = ServiceProcess(config, redis.url, env=env).start()
    crowd = sell_for(first, 0.5, count=2)
    first.stop()
    again = ServiceProcess(config, redis.url, env=env).start()
    again.stop()
    log = again.log.read_text()
    assert "it holds every decision of the directory" in log
    assert "put_back" not in log
    redis.client().flushall()
    third = ServiceProcess(config, redis.url, env=env).start()
    try:
        result = audit(third.base_url, crowd)
        assert result.lost == {}
        assert '"put_back":{' in third.log.read_text()
    finally:
        third.stop()


def test_a_process_killed_while_restoring_holds_the_others_back_only_until_its_announcement_ends(
        redis: RedisServer, tmp_path: Path) -> None:
    """A restores a long journal and is killed (SIGKILL) half-way: its announcement in the
    mark is no longer renewed. B's sales are refused while it holds (every marked call
    checks it), then go through once it has ended (ANNOUNCE_MS), not never."""
    import threading

    from capsvc.recovery.reconciler import ANNOUNCE_MS
    from capsvc.redis.marks import NODE_MARK, stamp
    from tests.unit.test_journal import decision, sale

    long_journal = tmp_path / "a"

    async def fill() -> None:
        from capsvc.journal.recorder import Recorder
        from capsvc.journal.writer import open_journal

        journal = open_journal(long_journal, max_file_bytes=1 << 30, keep_ms=86_400_000)
        rec = Recorder(journal, lambda: 1)
        for start in range(0, 60_000, 5_000):  # what may wait for the disk is bounded
            written = []
            for i in range(start, start + 5_000):
                stamp.set({NODE_MARK: i + 1})  # as if each had been made by a marked call
                s = sale(f"K{i}", numbers=[1 + i % 60, *range(61, 68)])
                written.append(rec.sale("answer", "fr-retail", s, f"{i:016x}", 1,
                                        decision(s), 10**13, [5000]))
            await asyncio.gather(*written)
        await journal.aclose()

    asyncio.run(fill())
    config = tmp_path / "capsvc.toml"
    config.write_text(Path(TEST_CONFIG).read_text().replace('settle = "0s"', 'settle = "1s"'))
    # B first, ready before A starts restoring: it sells the moment A is killed.
    b = ServiceProcess(str(config), redis.url).start()
    draw = current_draw(b.base_url, "fdj-keno", "t-fr")
    a = ServiceProcess(str(config), redis.url, env={"CAPSVC_JOURNAL_DIR": str(long_journal)})
    starting = threading.Thread(target=lambda: _start_quietly(a), daemon=True)
    starting.start()
    client = redis.client()
    deadline = time.monotonic() + 20
    while not client.hget(NODE_MARK, "!") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.hget(NODE_MARK, "!"), "A never announced its restore"
    assert a.process is not None
    a.process.kill()
    killed = time.monotonic()
    try:
        http = HttpClient(timeout_s=15)
        refused = 0
        while True:
            status, body = http.request(b.base_url, "POST", "/v1/tickets", token="t-fr", body={
                "ticket_id": "B-1", "game": "fdj-keno", "first_draw": draw,
                "grids": [{"numbers": [1, 2, 3], "stake": 200}]})
            if status != 503 or time.monotonic() - killed > 30:
                break
            refused += 1
            time.sleep(0.05)
        waited = time.monotonic() - killed
        assert status == 200, body
        assert refused, "B sold while A's announcement held"
        assert waited < ANNOUNCE_MS / 1000 + 5, f"B waited {waited:.1f} s"
    finally:
        b.stop()
        a.stop()


def _start_quietly(service: ServiceProcess) -> None:
    with contextlib.suppress(Exception):  # killed while it starts: that is the test
        service.start()
