"""Coalesced Redis calls: every command issued during one event-loop tick goes out as one
pipeline, on one connection, in one write; replies are handed back to each caller.

This is the transport of the store (the only code that talks to Redis). Under load, the
requests served in one tick share a round trip instead of paying one each, which is what
lets one Python process keep up with Redis (DESIGN.md, "Hot path").

Failure semantics: any connection error or timeout fails every command of the batch with
`Unavailable` (the caller cannot know whether Redis ran them; the Lua steps are idempotent,
so a retry converges). Error replies (`-ERR …`) fail only their own command.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from redis.asyncio import BlockingConnectionPool, ConnectionPool
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from capsvc.errors import Unavailable

log = logging.getLogger(__name__)

Command = tuple[Any, ...]
BatchObserver = Callable[[int, float], None]
"""Called with (commands in the batch, seconds it took) after each batch."""
ErrorObserver = Callable[[str], None]
"""Called with the kind of error ("timeout", "connection", "reply") once per failure."""


def _noop_batch(size: int, seconds: float) -> None:
    return None


def _noop_error(kind: str) -> None:
    return None


class Coalescer:
    """Batches the commands of one event-loop tick into one pipeline to a single Redis."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        max_connections: int = 32,
        on_batch: BatchObserver = _noop_batch,
        on_error: ErrorObserver = _noop_error,
        pool: ConnectionPool | None = None,
    ) -> None:
        self.pool = pool or BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry_on_timeout=False,
        )
        self._queue: list[tuple[Command, asyncio.Future[Any] | None]] = []
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._on_batch = on_batch
        self._on_error = on_error

    def submit(self, *args: Any) -> asyncio.Future[Any]:
        """Queue a command for this tick's batch; the future gets its reply."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._enqueue(args, fut)
        return fut

    def send(self, *args: Any) -> None:
        """Queue a command whose reply nobody waits for (failures are only counted)."""
        self._enqueue(args, None)

    async def call(self, *args: Any) -> Any:
        return await self.submit(*args)

    def _enqueue(self, args: Command, fut: asyncio.Future[Any] | None) -> None:
        self._queue.append((args, fut))
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        batch, self._queue, self._scheduled = self._queue, [], False
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[Command, asyncio.Future[Any] | None]]) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        conn: Connection | None = None
        done = 0
        try:
            conn = await self.pool.get_connection()  # type: ignore[no-untyped-call]
            await conn.send_packed_command(
                conn.pack_commands([args for args, _ in batch]), check_health=False
            )
            for _, fut in batch:
                try:
                    reply = await conn.read_response()
                except ResponseError as e:
                    self._on_error("reply")
                    if fut is None:
                        log.warning("redis error reply to a background command: %s", e)
                    elif not fut.done():
                        fut.set_exception(e)
                else:
                    if fut is not None and not fut.done():
                        fut.set_result(reply)
                done += 1
        except (TimeoutError, RedisError, OSError) as e:
            kind = "timeout" if isinstance(e, RedisTimeoutError | asyncio.TimeoutError) else (
                "connection" if isinstance(e, RedisConnectionError | OSError) else "other"
            )
            self._on_error(kind)
            if conn is not None:
                await conn.disconnect()
            for _, fut in batch[done:]:
                if fut is not None and not fut.done():
                    fut.set_exception(Unavailable(f"redis {kind}: {e}"))
        except BaseException:
            # Cancelled mid-batch: the connection may hold unread replies; never reuse it.
            if conn is not None:
                await conn.disconnect()
            for _, fut in batch[done:]:
                if fut is not None and not fut.done():
                    fut.set_exception(Unavailable("redis batch cancelled"))
            raise
        finally:
            if conn is not None:
                await self.pool.release(conn)
            self._on_batch(len(batch), loop.time() - started)

    async def aclose(self) -> None:
        """Wait for the batches in flight (background writes included), then disconnect."""
        if self._queue:
            self._flush()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pool.disconnect()
