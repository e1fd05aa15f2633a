"""Sales while Redis pauses its writes (`CLIENT PAUSE … WRITE`, as during a failover or a
slow fsync): each request answers 503 (outcome unknown) or its decision, and no Redis
call of a failed request is left with an error nobody retrieved, which asyncio logs as
"Future exception was never retrieved" (one error-level line per lost call).

A sale in steps queues the janitor's index beside its claim and awaits the claim first:
when the claim fails, the index's failure must be retrieved too, or every request during a
pause logs a line."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from capsvc.config import Settings
from tests.conftest import TEN, Client, services, ticket
from tests.support.servers import RedisCluster, RedisServer

SELLERS = 24
HELD_S = 120
"""How long a write pause is asked for: longer than the test could take, so that only the
test's UNPAUSE ends it (once it has seen what it needs), never the clock."""
WITHIN_S = 60.0
"""How long each step may take before the test fails (a hang, not a speed)."""


def primaries(backend: RedisServer | RedisCluster) -> list[RedisServer]:
    return backend.servers if isinstance(backend, RedisCluster) else [backend]


async def sell_until(client: Client, stop: asyncio.Event, r: int, statuses: list[int]) -> None:
    """Sell tickets (four grids, three of them capped; retrying one answered 503, as a
    client does) until `stop` is set."""
    while not stop.is_set():
        body = ticket([{"numbers": TEN, "stake": 100}, {"numbers": TEN[:9], "stake": 100},
                       {"numbers": [*TEN[:7], 42 + r % 20], "stake": 100},
                       {"numbers": [1, 2], "stake": 100}], draws=2)
        await client.sell_until_decided(body, tries=3, pause_s=0, statuses=statuses)


async def redis_timeouts(client: Client) -> float:
    """`capsvc_redis_errors_total{kind="timeout"}` of the service: its Redis calls failed by
    the Redis timeout so far."""
    text = (await client.get("/metrics", token=None)).raw.decode()
    line = next(x for x in text.splitlines()
                if x.startswith('capsvc_redis_errors_total{kind="timeout"}'))
    return float(line.rsplit(" ", 1)[1])


async def until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll `condition` until it holds; fail after WITHIN_S (something hangs)."""
    deadline = asyncio.get_running_loop().time() + WITHIN_S
    while not await condition():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"not within {WITHIN_S}s: {what}")
        await asyncio.sleep(0.02)


async def sell_through_a_pause(variant: Settings, backend: RedisServer | RedisCluster,
                               caplog: pytest.LogCaptureFixture) -> list[int]:
    """SELLERS clients sell while every primary pauses its writes, held until every
    seller has been answered 503 and the service has counted a Redis timeout (calls failed
    by it, also those of requests cancelled before); the statuses answered, one sale
    decided after the pause last. Asserts that asyncio logged no unretrieved future."""
    statuses: list[int] = []
    caplog.set_level(logging.ERROR, logger="asyncio")
    async with services([variant], backend.url) as (client,):
        # Connected, library loaded (a 503 is "send it again", under load too).
        assert (await client.sell_until_decided(ticket())).status == 200
        before = await redis_timeouts(client)
        stop = asyncio.Event()
        sellers = [asyncio.create_task(sell_until(client, stop, r, statuses))
                   for r in range(SELLERS)]
        try:
            for server in primaries(backend):
                server.client().execute_command("CLIENT", "PAUSE", HELD_S * 1000, "WRITE")
            paused_at = len(statuses)

            async def failed() -> bool:
                return (statuses[paused_at:].count(503) >= SELLERS
                        and await redis_timeouts(client) > before)

            await until(failed, "503s and a Redis timeout during the pause")
        finally:
            for server in primaries(backend):
                server.client().execute_command("CLIENT", "UNPAUSE")
            stop.set()
            await asyncio.gather(*sellers)
        # Sells again once the writes resume (retrying the 503s of a reconnection).
        assert (await client.sell_until_decided(ticket(), statuses=statuses)).status == 200
        await asyncio.sleep(0.2)  # what the last requests left in flight settles
    gc.collect()  # a future held in a reference cycle logs when the cycle is collected
    await asyncio.sleep(0)
    lost = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]
    assert not lost, f"{len(lost)} unretrieved: {lost[0]}"
    assert set(statuses) == {200, 503}, statuses
    return statuses


@pytest.mark.parametrize("sale_calls", ["one", "steps"])
async def test_no_unretrieved_future_during_a_write_pause(
        settings: Settings, redis_backend: RedisServer | RedisCluster, redis_db: Any,
        sale_calls: str, caplog: pytest.LogCaptureFixture) -> None:
    """Redis calls failing by the Redis timeout (250 ms): some answers are 503, the
    others 200, and asyncio logs no unretrieved future."""
    if sale_calls == "one" and isinstance(redis_backend, RedisCluster):
        pytest.skip("a cluster always sells in steps")
    await sell_through_a_pause(
        dataclasses.replace(settings, one_call_sales=sale_calls == "one"), redis_backend,
        caplog)


async def test_no_unretrieved_future_when_requests_time_out_during_a_write_pause(
        settings: Settings, redis_backend: RedisServer | RedisCluster, redis_db: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    """A request timeout (300 ms) shorter than the Redis timeout (1 s): requests are
    cancelled while their Redis calls are in flight, and those calls fail afterwards,
    awaited by nobody; asyncio logs no unretrieved future."""
    await sell_through_a_pause(
        dataclasses.replace(settings, one_call_sales=False, request_timeout_ms=300,
                            redis_timeout_ms=1000), redis_backend, caplog)
