"""Fail closed: Redis down or slow answers 503 and records nothing it cannot prove;
after a restart from the AOF the counters are intact and sales resume."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from capsvc.config import Settings
from capsvc.domain.errors import rule_error
from capsvc.http.server import Service, build
from tests.conftest import TEN, Client, start_service, ticket
from tests.support.servers import RedisServer


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis of this test's own, which it may kill and restart."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
async def own_client(settings: Settings, own_redis: RedisServer) -> AsyncIterator[Client]:
    svc = build(settings, own_redis.url)
    runner, url = await start_service(svc)
    async with aiohttp.ClientSession() as session:
        yield Client(session, url)
    await runner.cleanup()
    await svc.redis.aclose()


async def wait_ready(client: Client, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (await client.get("/readyz", token=None)).status == 200:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("service did not become ready")


@pytest.mark.slow
async def test_redis_killed_and_restarted(own_client: Client, own_redis: RedisServer) -> None:
    """Killed Redis: 503 + Retry-After and /readyz 503; restarted from its AOF: counters
    intact and sales resume without restarting capsvc."""
    client = own_client
    draw = await client.current()
    for _ in range(3):
        assert (await client.sell(ticket([{"numbers": TEN, "stake": 1000}]))).status == 200
    own_redis.kill()
    body = ticket([{"numbers": TEN, "stake": 1000}])
    down = await client.sell(body)
    assert down.status == 503
    assert down.body["error"]["code"] == "unavailable"
    assert int(down.headers["Retry-After"]) >= 1
    assert (await client.get("/readyz", token=None)).status == 503
    assert (await client.get("/healthz", token=None)).status == 200
    own_redis.start()
    await wait_ready(client)
    assert await client.staked(TEN, draw) == 3000
    retry = await client.sell(body)
    assert retry.status == 200
    assert retry.body["status"] == "accepted"
    assert await client.staked(TEN, draw) == 4000
    assert (await client.sell(ticket([{"numbers": TEN, "stake": 1000}]))).body[
        "status"] == "accepted"
    assert (await client.sell(ticket([{"numbers": TEN, "stake": 100}]))).body[
        "status"] == "rejected"


@pytest.mark.slow
async def test_slow_redis_times_out_and_the_retry_converges(
        own_client: Client, own_redis: RedisServer) -> None:
    """Redis slower than the timeout: 503; the same ticket retried later is counted once."""
    client = own_client
    draw = await client.current()
    body = ticket([{"numbers": TEN, "stake": 500}, {"numbers": TEN[:8], "stake": 500}])
    own_redis.client().execute_command("CLIENT", "PAUSE", 600, "ALL")
    slow = await client.sell(body)
    assert slow.status == 503
    assert slow.body["error"]["code"] == "unavailable"
    await asyncio.sleep(0.7)
    first = await client.sell(body)
    again = await client.sell(body)
    assert first.status == again.status == 200
    assert first.raw == again.raw
    assert await client.staked(TEN, draw) == 500
    assert await client.staked(TEN[:8], draw) == 500


async def test_request_timeout_answers_503(service: tuple[Service, str], client: Client,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A request still running after server.request_timeout is cut short with a 503."""
    svc, _ = service

    async def hang(*args: object) -> None:
        await asyncio.sleep(3600)

    monkeypatch.setattr(svc.usecases.tickets, "sell", hang)
    started = time.monotonic()
    reply = await client.sell(ticket())
    assert reply.status == 503
    assert reply.body["error"]["code"] == "unavailable"
    assert "Retry-After" in reply.headers
    assert time.monotonic() - started < 60  # the request timeout (2 s), not the hang's end
    assert svc.health.in_flight == 0


async def test_requests_beyond_max_in_flight_are_shed(settings: Settings,
                                                      redis_server: RedisServer,
                                                      standalone_db: object) -> None:
    """With server.max_in_flight = 1, a second concurrent request is shed with 503."""
    svc = build(dataclasses.replace(settings, max_in_flight=1), redis_server.url)

    async def slow(*args: object) -> None:
        await asyncio.sleep(0.5)
        raise rule_error("draw_closed", "slow and refused")

    svc.usecases.tickets.sell = slow  # type: ignore[method-assign]
    runner, url = await start_service(svc)
    try:
        async with aiohttp.ClientSession() as session:
            client = Client(session, url)
            first = asyncio.create_task(client.sell(ticket()))
            await asyncio.sleep(0.1)
            shed = await client.get("/v1/games")
            assert shed.status == 503
            assert shed.body["error"]["code"] == "unavailable"
            assert shed.headers["Retry-After"] == "1"
            assert (await first).status == 422  # the slow one still completes
    finally:
        await runner.cleanup()
        await svc.redis.aclose()


async def test_redis_out_of_memory_fails_closed(own_client: Client,
                                                own_redis: RedisServer) -> None:
    """Redis full under noeviction refuses writes: 503, never a 500, nothing accepted."""
    own_redis.client().config_set("maxmemory", "1")
    try:
        reply = await own_client.sell(ticket([{"numbers": TEN, "stake": 500}]))
        assert reply.status == 503
        assert reply.body["error"]["code"] == "unavailable"
    finally:
        own_redis.client().config_set("maxmemory", "0")
    assert (await own_client.sell(ticket([{"numbers": TEN, "stake": 500}]))).status == 200
