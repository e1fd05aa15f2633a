"""The service's one clock: Redis TIME, carried between readings by a monotonic clock.

Every instant that decides something is Redis TIME: inside the Lua functions (closes,
admin stops, pending and cancel deadlines), or this clock for what Python decides before a
call (the default first draw, the sales horizon, a player's day, the janitor's scan).
It reads TIME when it starts and every `refresh_s` after, and in between adds the
monotonic time elapsed, so a host wall clock set minutes off changes nothing; the host
clock is never read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from capsvc.domain.errors import Unavailable

log = logging.getLogger(__name__)


def _monotonic_ms() -> float:
    return time.monotonic_ns() / 1e6


class RedisClock:
    """Milliseconds since the Unix epoch by Redis TIME (call `sync` before `now`)."""

    def __init__(self, read_time_ms: Callable[[], Awaitable[int]],
                 monotonic_ms: Callable[[], float] = _monotonic_ms) -> None:
        self._read = read_time_ms
        self._monotonic = monotonic_ms
        self._offset: float | None = None

    @property
    def synced(self) -> bool:
        return self._offset is not None

    async def sync(self) -> None:
        """Read Redis TIME; the midpoint of the round trip is when it was read."""
        before = self._monotonic()
        redis_ms = await self._read()
        after = self._monotonic()
        self._offset = redis_ms - (before + after) / 2

    def now(self) -> int:
        if self._offset is None:
            raise Unavailable("the Redis clock has not been read yet")
        return int(self._monotonic() + self._offset)

    async def run(self, refresh_s: float) -> None:
        """Re-read Redis TIME forever (an unreachable Redis keeps the last offset)."""
        while True:
            try:
                await self.sync()
            except Unavailable:
                pass
            except Exception:
                log.exception("could not read the Redis clock")
            await asyncio.sleep(refresh_s if self.synced else 0.2)
