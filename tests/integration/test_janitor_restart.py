"""A sale whose process was SIGKILLed after Redis ran part of it, its draw closing while no
process runs: the restarted service settles and journals it (docs/api.md, "Interrupted
sales and the janitor"), as when it comes back before the close. And a call that never
reached Redis leaves nothing to settle. Real processes: redis-server, the fault proxy,
`capsvc serve`."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis as redis_py
import requests

from capsvc.redis.store import UNJOURNALED
from tests.support.faults import FaultProxy, command
from tests.support.servers import RedisServer
from tests.support.service import ServiceProcess

pytestmark = pytest.mark.slow

GAME, SELLER = "restart-keno", "restart-seller"
NUMBERS = [3, 7, 12, 18, 25, 33, 41, 56]
DRAW_S = 10


def _config(tmp_path: Path, sale_calls: str) -> str:
    digest = hashlib.sha256(SELLER.encode()).hexdigest()
    path = tmp_path / f"{sale_calls}.toml"
    path.write_text(f"""\
[redis]
timeout = "250ms"
sale_calls = "{sale_calls}"

[server]
request_timeout = "1s"
drain_delay = "100ms"

[janitor]
pending_deadline = "2s"
interval = "500ms"

[journal]
settle = "0s"

[[games]]
id = "{GAME}"
preset = "fdj-keno-2008"
draw_every = "{DRAW_S}s"
draw_from = "00:00"
draw_until = "23:59:50"
time_zone = "UTC"
retention = "10m"

[[channels]]
id = "fr-retail"
token_sha256 = "{digest}"
games = ["{GAME}"]
scopes = ["sell", "read"]
""")
    return str(path)


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


def _get(base: str, path: str) -> tuple[int, Any]:
    r = requests.get(base + path, headers={"Authorization": f"Bearer {SELLER}"}, timeout=5)
    return r.status_code, r.json()


def _journal(journal: Path, tid: str) -> list[dict[str, Any]]:
    return [rec for f in sorted(journal.glob("*.jsonl"))
            for rec in map(json.loads, f.read_text().splitlines()) if rec.get("ticket") == tid]


def _killed_mid_sale(tmp_path: Path, redis: RedisServer, sale_calls: str, fcall: str,
                     hold: bool, release_after_close: bool = False
                     ) -> tuple[str, str, int, Path, ServiceProcess]:
    """Sell one ticket with `fcall` held (hold) or its reply delayed (Redis ran it), SIGKILL
    the service, wait for the draw's close (then let the held command go to Redis with
    `release_after_close`; else it never reaches Redis); returns the config, ticket id,
    draw, journal dir and a restarted (unstarted) service on the same Redis and journal."""
    config = _config(tmp_path, sale_calls)
    journal = tmp_path / "journal"
    env = {"CAPSVC_JOURNAL_DIR": str(journal)}
    release = threading.Event()
    with FaultProxy("127.0.0.1", redis.port) as proxy:
        service = ServiceProcess(config, proxy.url, env=env).start()
        try:
            while True:
                _, cur = _get(service.base_url, f"/v1/games/{GAME}/draws/current")
                closes = datetime.fromisoformat(cur["closes_at"]).timestamp()
                if closes - time.time() > 4:
                    break
                time.sleep(closes - time.time() + 0.3)
            draw = int(cur["draw"])
            match = command("FCALL", fcall)
            rule = (proxy.hold_request(match, release) if hold
                    else proxy.delay_reply(match, 120))
            tid = f"K-{fcall}-{hold}"
            body = {"ticket_id": tid, "game": GAME, "first_draw": draw,
                    "grids": [{"numbers": NUMBERS, "stake": 500}]}

            def post() -> None:
                with contextlib.suppress(requests.RequestException):
                    requests.post(service.base_url + "/v1/tickets", json=body, timeout=10,
                                  headers={"Authorization": f"Bearer {SELLER}"})

            threading.Thread(target=post, daemon=True).start()
            assert rule.fired.wait(10)
            assert service.process is not None
            os.kill(service.process.pid, signal.SIGKILL)
            service.process.wait()
            time.sleep(max(0.0, closes + 0.5 - time.time()))
            assert not _journal(journal, tid)
            if release_after_close:
                release.set()
                proxy.wait_for(match)
                time.sleep(0.3)  # run by Redis (the proxy lingers for the replies)
        finally:
            service.stop()
    release.set()  # only once the proxy is gone: a held command must not reach Redis now
    return config, tid, draw, journal, ServiceProcess(config, redis.url, env=env)


def _settled(redis: RedisServer, service: ServiceProcess, journal: Path, tid: str,
             draw: int) -> tuple[list[dict[str, Any]], int, Any, int]:
    """After the restart and the janitor's deadline: the ticket's journal records (before the
    GET), GET, the
    combination's stake, and the entries left in the pending indexes and the unjournaled
    sales."""
    service.start()
    try:
        r = redis_py.Redis(port=redis.port)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            left = sum(r.zcard(k) for k in r.keys("p:*")) + r.hlen(UNJOURNALED)
            if not left:
                break
            time.sleep(0.2)
        records = _journal(journal, tid)  # before the GET, which journals a `lookup`
        status, got = _get(service.base_url, f"/v1/tickets/{tid}")
        _, combo = _get(service.base_url, f"/v1/games/{GAME}/draws/{draw}/combinations/"
                        + "-".join(map(str, NUMBERS)))
        return records, status, (got, combo["staked"]), left
    finally:
        service.stop()


def test_claimed_sale_of_a_closed_draw_is_voided_after_a_restart(
        tmp_path: Path, redis: RedisServer) -> None:
    """Steps: claimed, nothing counted, the process killed, the draw closed: the restarted
    service voids it (`abandoned`), GET 404, nothing staked, the index empty."""
    _, tid, draw, journal, service = _killed_mid_sale(
        tmp_path, redis, "steps", "capsvc_reserve", hold=True)
    records, status, (_, staked), left = _settled(redis, service, journal, tid, draw)
    assert [(r["type"], r.get("why")) for r in records] == [("void", "abandoned")]
    assert (status, staked, left) == (404, 0, 0)


@pytest.mark.parametrize(("calls", "held", "hold"), [
    # Steps: every grid counted, the decision never written.
    ("steps", "capsvc_finalize", True),
    # One call: Redis ran the sale, its reply never came back.
    ("one", "capsvc_sell", False),
])
def test_a_counted_sale_of_a_closed_draw_is_journaled_accepted_after_a_restart(
        tmp_path: Path, redis: RedisServer, calls: str, held: str, hold: bool) -> None:
    """The sale counted in Redis, its process killed before it journaled the decision, the
    draw closed: the restarted service writes and journals the decision, GET shows it."""
    _, tid, draw, journal, service = _killed_mid_sale(tmp_path, redis, calls, held, hold=hold)
    records, status, (got, staked), left = _settled(redis, service, journal, tid, draw)
    assert [(r["type"], r["via"]) for r in records] == [("sale", "janitor")]
    assert (status, got["status"], staked, left) == (200, "accepted", 500, 0)


def test_a_claim_that_reached_redis_after_the_close_leaves_nothing_to_settle(
        tmp_path: Path, redis: RedisServer) -> None:
    """Steps: the claim held by the proxy until after the close (the process killed
    meanwhile): Redis refuses it (`closed`), the index entry made before it goes, nothing is
    journaled: nothing was sold."""
    _, tid, draw, journal, service = _killed_mid_sale(
        tmp_path, redis, "steps", "capsvc_claim", hold=True, release_after_close=True)
    records, status, (_, staked), left = _settled(redis, service, journal, tid, draw)
    assert (records, status, staked, left) == ([], 404, 0, 0)
