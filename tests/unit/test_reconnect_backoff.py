"""Reconnections to Redis back off while they keep failing, and only then.

The coalescer runs on an event loop with a virtual clock (a selector that, with nothing
ready, moves the clock to the next timer instead of sleeping): a minute of outage takes
milliseconds, and each figure is a count of connection attempts against the schedule,
never a measure of time. Connections are refused (or made) by a stand-in for
`create_connection`: no socket, nothing listening.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import hiredis
import pytest

from capsvc.domain.errors import Unavailable
from capsvc.redis.transport import RECONNECT_MAX_S, RECONNECT_S, Coalescer

WATCH_S = 0.05
"""The period of the reads a process makes with no traffic (the journal's watch)."""


class _VirtualSelector(selectors.BaseSelector):
    """The real selector, polled; with nothing ready, the virtual clock jumps by the
    timeout the loop would have slept."""

    def __init__(self, clock: list[float]) -> None:
        self._real = selectors.DefaultSelector()
        self._clock = clock

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._real.select(0)
        if not ready:
            assert timeout is not None, "nothing scheduled: the test would hang"
            self._clock[0] += timeout
        return ready

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.clock = [1000.0]
        super().__init__(_VirtualSelector(self.clock))

    def time(self) -> float:
        return self.clock[0]


def run(main: Callable[[VirtualLoop], Awaitable[None]]) -> None:
    loop = VirtualLoop()
    try:
        loop.run_until_complete(main(loop))
    finally:
        loop.close()


class _Transport:
    """A connection to a Redis that answers every command with a nil."""

    def __init__(self, loop: VirtualLoop, wire: Any) -> None:
        self._loop, self._wire = loop, wire
        self._parser = hiredis.Reader()

    def write(self, data: bytes) -> None:
        self._parser.feed(data)
        n = 0
        while self._parser.gets() is not False:
            n += 1
        self._loop.call_soon(self._wire.data_received, b"$-1\r\n" * n)

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


class Redis:
    """A stand-in for `create_connection`: every attempt's (virtual) time, and whether
    Redis is up (the connection is made, the handshake has nothing to ask) or down
    (refused)."""

    def __init__(self, loop: VirtualLoop) -> None:
        self.loop = loop
        self.up = False
        self.attempts: list[float] = []
        self.wire: Any = None

    async def create_connection(self, factory: Callable[[], Any], *args: Any,
                                **kwargs: Any) -> tuple[Any, Any]:
        self.attempts.append(self.loop.time())
        if not self.up:
            raise ConnectionRefusedError(111, "Connection refused")
        self.wire = factory()
        transport = _Transport(self.loop, self.wire)
        self.wire.connection_made(transport)
        return transport, self.wire


def coalescer(loop: VirtualLoop, errors: list[str] | None = None) -> tuple[Coalescer, Redis]:
    redis = Redis(loop)
    loop.create_connection = redis.create_connection  # type: ignore[method-assign]
    c = Coalescer("redis://127.0.0.1:6399/0", timeout_s=1.0, primary_only=False,
                  on_error=(errors.append if errors is not None else lambda kind: None))
    return c, redis


async def watch(c: Coalescer, loop: VirtualLoop, seconds: float) -> int:
    """What a process with no traffic does: one read every WATCH_S, failures ignored;
    how many of them failed."""
    failed = 0
    end = loop.time() + seconds
    while loop.time() < end:
        try:
            await c.call("GET", "mark")
        except Unavailable:
            failed += 1
        await asyncio.sleep(WATCH_S)
    return failed


def most_attempts(seconds: float) -> int:
    """The most attempts the backoff allows in `seconds` of outage: the first at once,
    then each after at least half of its step (RECONNECT_S doubling up to the ceiling),
    and never two within RECONNECT_S."""
    n, spent, step = 1, 0.0, RECONNECT_S
    while True:
        spent += max(step / 2, RECONNECT_S)
        if spent > seconds:
            return n
        n += 1
        step = min(step * 2, RECONNECT_MAX_S)


def test_redis_down_with_no_traffic_the_attempts_follow_the_backoff() -> None:
    """A minute of outage under a read every 50 ms: at most `most_attempts(60)` connection
    attempts (about one every 1.5 s once at the ceiling, against one per read without
    a backoff), each one error, none two within RECONNECT_S; still at least one every
    RECONNECT_MAX_S (plus a read's period), so a Redis that is back is found within the
    ceiling. The reads between attempts fail at once, without an attempt."""
    async def main(loop: VirtualLoop) -> None:
        errors: list[str] = []
        c, redis = coalescer(loop, errors)
        failed = await watch(c, loop, 60.0)
        attempts = len(redis.attempts)
        assert attempts <= most_attempts(60.0), attempts
        assert attempts >= 60.0 / (RECONNECT_MAX_S + WATCH_S), attempts
        assert errors == ["connection"] * attempts
        assert failed >= 60.0 / (WATCH_S * 2)  # every read answered: none waited a pause
        gaps = [b - a for a, b in zip(redis.attempts, redis.attempts[1:], strict=False)]
        assert min(gaps) >= RECONNECT_S - 1e-9
        assert max(gaps) <= RECONNECT_MAX_S + WATCH_S + 1e-9
        await c.aclose()

    run(main)


def test_a_primary_that_answers_ends_the_backoff() -> None:
    """Once Redis is back it is found within the ceiling; the connection that then breaks
    is tried again at once, and the attempts after start again from the first step."""
    async def main(loop: VirtualLoop) -> None:
        c, redis = coalescer(loop)
        await watch(c, loop, 30.0)  # the backoff at its ceiling
        redis.up = True
        back = loop.time()
        while not redis.attempts or redis.attempts[-1] < back:
            await watch(c, loop, WATCH_S)
        assert redis.attempts[-1] - back <= RECONNECT_MAX_S + WATCH_S
        assert redis.wire is not None
        await asyncio.sleep(10)  # a connection that works for a while
        redis.up = False
        redis.wire.connection_lost(ConnectionResetError())  # Redis goes away
        broke, before = loop.time(), len(redis.attempts)
        with pytest.raises(Unavailable):
            await c.call("GET", "mark")
        assert redis.attempts[before] == broke  # the first attempt: at once
        await watch(c, loop, 0.5)
        # Starting again from the first steps: 25-50 ms, 50-100 ms, 100-200 ms, ...
        assert len(redis.attempts) - before >= 3
        await c.aclose()

    run(main)


def test_a_sentinels_switch_ends_the_pause_at_once() -> None:
    """The backoff at its ceiling, an attempt waiting out its pause: the sentinels'
    announcement of a new primary starts that attempt at the same instant."""
    async def main(loop: VirtualLoop) -> None:
        c, redis = coalescer(loop)
        await watch(c, loop, 30.0)
        with pytest.raises(Unavailable):  # starts the next attempt's pause
            await c.call("GET", "mark")
        before = len(redis.attempts)
        await asyncio.sleep(0.01)
        assert len(redis.attempts) == before  # waiting out its pause
        redis.up = True
        switch = loop.time()
        c.switched(("127.0.0.1", 6380))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert redis.attempts[before:] == [switch]
        await c.aclose()

    run(main)
