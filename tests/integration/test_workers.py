"""`capsvc serve --workers 2`: one port, one metrics view, one drain."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from capsvc.testing import RedisCluster, RedisServer, free_port
from tests.conftest import CONFIG, TEN, Client, ticket


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name}


@pytest.fixture
def workers(redis_backend: RedisServer | RedisCluster, redis_db: redis.Redis,
            tmp_path: Path) -> Iterator[
        tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    with (tmp_path / "workers.log").open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "capsvc", "serve", "--workers", "2",
                                 "--config", str(CONFIG), "--redis-url", redis_backend.url,
                                 "--port", str(port)], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)
    yield proc, f"http://127.0.0.1:{port}"
    if proc.poll() is None:
        proc.kill()
        proc.wait()


async def wait_ready(session: aiohttp.ClientSession, url: str) -> None:
    """Until two different workers have answered /readyz (generated request ids start
    with the worker's pid)."""
    seen: set[str] = set()
    for _ in range(400):
        try:
            async with session.get(url + "/readyz") as resp:
                if resp.status == 200:
                    seen.add(resp.headers["X-Request-ID"].split("-")[0])
        except aiohttp.ClientError:
            pass
        if len(seen) == 2:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"workers not ready: {seen}")


async def test_two_workers_one_view_one_drain(
        workers: tuple[subprocess.Popen[bytes], str]) -> None:
    """Sales spread over two workers add up in /metrics whichever worker answers; SIGTERM
    drains both and the supervisor exits 0."""
    proc, url = workers
    connector = aiohttp.TCPConnector(force_close=True)  # new connections: both workers
    async with aiohttp.ClientSession(connector=connector) as session:
        await wait_ready(session, url)
        client = Client(session, url)
        replies = await asyncio.gather(*[
            client.sell(ticket([{"numbers": TEN, "stake": 100}])) for _ in range(40)])
        assert {r.status for r in replies} == {200}
        served_by = {r.headers["X-Request-ID"].split("-")[0] for r in replies}
        assert len(served_by) == 2  # generated ids start with the worker's pid
        await asyncio.sleep(1.5)  # each worker applies its tallies once a second
        for _ in range(6):
            text = (await client.get("/metrics", token=None)).raw.decode()
            tickets = samples(text, "capsvc_tickets_total")
            assert tickets[(("game", "fdj-keno"), ("status", "accepted"))] == 40
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 30) == 0


async def test_an_idle_pair_of_workers_reports_no_request_in_flight(
        workers: tuple[subprocess.Popen[bytes], str]) -> None:
    """In-flight requests are each worker's own, summed over the live ones (scrapes not
    counted): idle, the view says 0, whichever worker answers."""
    _, url = workers
    connector = aiohttp.TCPConnector(force_close=True)  # new connections: both workers
    async with aiohttp.ClientSession(connector=connector) as session:
        await wait_ready(session, url)
        await asyncio.sleep(1.5)  # every worker publishes its count once a second
        for _ in range(4):
            async with session.get(url + "/metrics") as resp:
                text = await resp.text()
            assert sum(samples(text, "capsvc_http_requests_in_flight").values()) == 0
