"""The coalescer batches one tick's commands into one pipeline (fakeredis transport)."""

from __future__ import annotations

import pytest
from fakeredis import FakeServer
from fakeredis.aioredis import FakeAsyncRedisConnection
from redis.asyncio import ConnectionPool
from redis.exceptions import ResponseError

from capsvc.coalesce import Coalescer


def fake_coalescer(batches: list[int], server: FakeServer | None = None) -> Coalescer:
    pool = ConnectionPool(connection_class=FakeAsyncRedisConnection,
                          server=server or FakeServer())
    return Coalescer("redis://fake", timeout_s=1, pool=pool,
                     on_batch=lambda size, seconds: batches.append(size))


async def test_one_tick_is_one_batch() -> None:
    """50 commands submitted in one tick travel in one pipeline, replies in order."""
    batches: list[int] = []
    c = fake_coalescer(batches)
    futures = [c.submit("INCRBY", "k", 1) for _ in range(50)]
    assert [await f for f in futures] == list(range(1, 51))
    assert batches == [50]
    await c.aclose()


async def test_error_reply_fails_only_its_command() -> None:
    """An error reply fails its own future; the others of the batch get their replies."""
    c = fake_coalescer([])
    ok1 = c.submit("SET", "a", "x")
    bad = c.submit("INCR", "a")
    ok2 = c.submit("GET", "a")
    assert await ok1 == b"OK"
    with pytest.raises(ResponseError):
        await bad
    assert await ok2 == b"x"
    await c.aclose()


async def test_background_writes_are_flushed_on_close() -> None:
    """send() needs no waiting; aclose() still delivers it."""
    server = FakeServer()
    c = fake_coalescer([], server)
    c.send("SET", "bg", "1")
    await c.aclose()
    reader = fake_coalescer([], server)
    assert await reader.call("GET", "bg") == b"1"
    await reader.aclose()
