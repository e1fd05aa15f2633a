"""Redis Sentinel and demoted nodes, with real processes: capsvc finds the primary through
the sentinels, follows a switch by itself, never goes on talking to a demoted node, answers
503 (never a 500) and is not ready while no primary is known, and the Lua library is there
on whatever node is promoted."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.conftest import new_id
from tests.support.servers import RedisSentinels, RedisServer, free_port
from tests.support.service import ServiceProcess

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "tests" / "capsvc-test.toml")
SELLER = {"Authorization": "Bearer t-fr"}


def sale(first: int) -> dict[str, Any]:
    """A one-grid FDJ ticket on its own combination (8 numbers from `first`)."""
    return {"ticket_id": new_id("S"), "game": "fdj-keno",
            "grids": [{"numbers": list(range(first, first + 8)), "stake": 100}]}


def post(base: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(f"{base}/v1/tickets", json=body, headers=SELLER, timeout=5)


def sell_until_decided(base: str, body: dict[str, Any], within_s: float) -> float:
    """Send the same sale (retrying 503s, as the contract says) until it is decided; the
    seconds it took. Fails on anything but 200 or 503."""
    started = time.monotonic()
    while time.monotonic() - started < within_s:
        reply = post(base, body)
        if reply.status_code == 200:
            return time.monotonic() - started
        assert reply.status_code == 503, reply.text
        assert reply.headers["Retry-After"]
        time.sleep(0.1)
    raise AssertionError(f"no decision within {within_s}s")


def metric(base: str, name: str) -> float:
    text = requests.get(f"{base}/metrics", timeout=5).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def ready(base: str) -> int:
    return requests.get(f"{base}/readyz", timeout=5).status_code


@pytest.fixture
def sentinel_group() -> Iterator[tuple[list[RedisServer], RedisSentinels]]:
    """A primary, two replicas and three sentinels (quorum 2, down-after 1 s)."""
    primary = RedisServer().start()
    replicas = [RedisServer(replica_of=primary).start() for _ in range(2)]
    sentinels = RedisSentinels(primary).start()
    yield [primary, *replicas], sentinels
    sentinels.stop()
    for server in (*replicas, primary):
        server.stop()


def by_port(servers: list[RedisServer], port: int) -> RedisServer:
    return next(s for s in servers if s.port == port)


def test_a_switch_is_followed_by_itself(
        sentinel_group: tuple[list[RedisServer], RedisSentinels]) -> None:
    """SENTINEL FAILOVER (the old primary stays up, as a replica): capsvc, not restarted,
    moves to the new primary, which has the Lua library, and counts the failover."""
    servers, sentinels = sentinel_group
    service = ServiceProcess(CONFIG, sentinels.url()).start()
    try:
        assert post(service.base_url, sale(1)).status_code == 200
        old = servers[0].port
        sentinels.client().execute_command("SENTINEL", "FAILOVER", sentinels.service)
        new = sentinels.wait_failover(old)
        assert sell_until_decided(service.base_url, sale(11), within_s=10) < 10
        promoted = by_port(servers, new).client()
        libraries = promoted.execute_command("FUNCTION", "LIST", "LIBRARYNAME", "capsvc")
        assert libraries, "the promoted node has no capsvc library"
        assert ready(service.base_url) == 200
        deadline = time.monotonic() + 5
        while metric(service.base_url, "capsvc_redis_failovers_total") < 1:
            assert time.monotonic() < deadline, "the switch was not counted"
            time.sleep(0.1)
        assert "Traceback" not in service.log.read_text()
    finally:
        service.stop()


def test_the_primary_killed_is_replaced_within_ten_seconds(
        sentinel_group: tuple[list[RedisServer], RedisSentinels]) -> None:
    """SIGKILL of the primary with two workers on the sentinel URL: sales are 503 (never
    500) and readiness 503 while no primary answers, and resume within 10 s (within 5 s of
    the sentinels' agreeing, when their election takes longer); the time without a primary
    is counted."""
    servers, sentinels = sentinel_group
    service = ServiceProcess(CONFIG, sentinels.url(), args=("--workers", "2")).start()
    try:
        assert sell_until_decided(service.base_url, sale(21), within_s=10) < 10
        servers[0].kill()
        killed = time.monotonic()
        time.sleep(0.3)
        assert ready(service.base_url) == 503
        assert post(service.base_url, sale(31)).status_code == 503
        # The sentinels' election is theirs (a split vote waits twice failover-timeout
        # before the next try): within 10 s of the kill when they agree within 5 s, and
        # in any case within 5 s of their agreeing.
        switched: list[float] = []
        watcher = threading.Thread(target=lambda: (
            sentinels.wait_failover(servers[0].port), switched.append(time.monotonic())))
        watcher.start()
        sell_until_decided(service.base_url, sale(41), within_s=30)
        resumed = time.monotonic() - killed
        watcher.join()
        election = switched[0] - killed
        assert resumed < max(10, election + 5), (resumed, election)
        deadline = time.monotonic() + 5
        while ready(service.base_url) != 200:
            assert time.monotonic() < deadline, "not ready again after the failover"
            time.sleep(0.1)
        without = metric(service.base_url, "capsvc_redis_no_primary_seconds_total")
        assert without > 0.5
        # The clock stops once every worker has found the new primary: it stands still over
        # 1.5 s within 10 s (a loaded machine delays the last worker's discovery).
        deadline = time.monotonic() + 10
        while True:
            time.sleep(1.5)
            after = metric(service.base_url, "capsvc_redis_no_primary_seconds_total")
            if after - without < 0.5 or time.monotonic() > deadline:
                break
            without = after
        assert after - without < 0.5
        assert "Traceback" not in service.log.read_text()
    finally:
        service.stop()


def test_no_primary_known_is_503_and_not_ready(
        sentinel_group: tuple[list[RedisServer], RedisSentinels]) -> None:
    """Sentinels that know no such service: 503 with Retry-After, /readyz 503, no
    traceback."""
    _, sentinels = sentinel_group
    service = ServiceProcess(CONFIG, sentinels.url("nobody")).start()
    try:
        reply = post(service.base_url, sale(51))
        assert reply.status_code == 503, reply.text
        assert reply.headers["Retry-After"]
        assert "nobody" in reply.text or reply.json()["error"]["code"] == "unavailable"
        assert ready(service.base_url) == 503
        assert "Traceback" not in service.log.read_text()
    finally:
        service.stop()


def test_a_demoted_node_is_left_at_once() -> None:
    """A plain URL whose node is demoted under capsvc (REPLICAOF): its READONLY drops the
    connection, the node (now a replica) is refused at the next connection (ROLE), sales
    are 503 and readiness 503 — nothing goes on being read from or written to it."""
    a = RedisServer().start()
    b = RedisServer(replica_of=a).start()
    service = ServiceProcess(CONFIG, a.url).start()
    try:
        assert post(service.base_url, sale(61)).status_code == 200
        b.client().replicaof("NO", "ONE")
        a.client().replicaof("127.0.0.1", b.port)
        for first in (1, 11, 21):
            reply = post(service.base_url, sale(first))
            assert reply.status_code == 503, reply.text
        assert ready(service.base_url) == 503
        # READONLY, or the connection dropped by the role change (as a Redis version may)
        left = sum(metric(service.base_url, f'capsvc_redis_errors_total{{kind="{kind}"}}')
                   for kind in ("readonly", "connection"))
        assert left >= 1
        assert "Traceback" not in service.log.read_text()
    finally:
        service.stop()
        b.stop()
        a.stop()


def test_check_config_names_the_sentinel_service(tmp_path: Path) -> None:
    """`capsvc check-config` takes a Sentinel URL and says where it leads (no password)."""
    config = tmp_path / "capsvc.toml"
    config.write_text(Path(CONFIG).read_text().replace(
        "[server]", f'[redis]\nurl = "redis+sentinel://:pw@127.0.0.1:{free_port()},'
        f'127.0.0.1:{free_port()}/mymaster?db=1"\n\n[server]', 1))
    out = subprocess.run([sys.executable, "-m", "capsvc", "check-config", "--config", str(config)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "redis: the primary of 'mymaster'" in out.stdout
    assert "pw" not in out.stdout
