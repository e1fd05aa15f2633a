"""Coalesced Redis calls over one pipelined connection.

Every command issued during one event-loop tick is encoded into one buffer and written in
one `write` (every FLUSH_EVERY commands when a tick issues more); Redis answers in order,
and replies are handed back to their callers as they arrive (parsed by hiredis). Under
load, the requests served in one tick share round trips instead of paying one each, which
is what lets one Python process keep up with Redis.

Why not redis-py's pipeline: profiling the hot path showed redis-py spending ~50 µs per
command in Python (argument encoding, a timeout context per read, pool checkout), more than
all of capsvc's own work. This module is the whole client capsvc needs: RESP encoding and
parsing by hiredis (C), in-order replies, a deadline per batch, reconnection.

Failure semantics: a connection error, or a batch unanswered past the timeout, closes the
connection and fails every command in flight with `Unavailable` (the caller cannot know
whether Redis ran them; capsvc's Lua steps are idempotent, so a retry converges). The next
command reconnects. Error replies (`-ERR …`) fail only their own command.

Replica acknowledgements (`wait_replicas`, capsvc.durability): Redis `WAIT` counts the
replicas that have every earlier write *of the connection it is sent on*, so it must travel
on this pipeline, after the writes. The WAITs asked for during one tick are one command,
sent last in that tick's batch: it covers every write queued before it, whoever queued it.
While it blocks, Redis holds the rest of the pipeline behind it, so batches behind a WAIT
get their deadline counted from the end of the WAIT's own timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, cast
from urllib.parse import unquote, urlsplit

import hiredis
from redis.exceptions import ResponseError

from capsvc.errors import Unavailable

log = logging.getLogger(__name__)

BatchObserver = Callable[[int, float], None]
"""Called with (commands in the batch, seconds until its last reply) after each batch."""
ErrorObserver = Callable[[str], None]
"""Called with the kind of failure ("timeout", "connection", "reply")."""

_MISSING_FUNCTION = "Function not found"

FLUSH_EVERY = 8
"""Commands after which a batch is written without waiting for the end of the tick. With
one write per tick, the requests of every connection fall into one batch and the process
sleeps while Redis works through it; written as it fills, Redis and Python overlap
(docs/performance.md: 0.36 -> 0.44 of bare; 4 and 16 measured worse)."""


def ignore_batch(size: int, seconds: float) -> None:
    return None


def ignore_error(kind: str) -> None:
    return None


class Transport(Protocol):
    """What the store needs from Redis: one node (`Coalescer`) or a cluster."""

    def submit(self, *args: Any) -> asyncio.Future[Any]: ...

    def send(self, *args: Any) -> None: ...

    async def call(self, *args: Any) -> Any: ...

    async def broadcast(self, *args: Any) -> list[Any]: ...

    async def wait_replicas(self, replicas: int, timeout_ms: int) -> int:
        """`WAIT replicas timeout_ms` after every write issued so far, on every primary; the
        fewest replicas that acknowledged them on any primary."""
        ...

    async def aclose(self) -> None: ...


encode_command: Callable[[tuple[Any, ...]], bytes] = hiredis.pack_command
"""RESP encoding of one command (str, bytes and int arguments), in C."""


class _Target:
    """Where and how to connect, from a redis://, rediss:// or unix:// URL."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        self.scheme = u.scheme
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 6379
        self.path = unquote(u.path)
        self.username = unquote(u.username) if u.username else None
        self.password = unquote(u.password) if u.password else None
        db = self.path.strip("/") if self.scheme != "unix" else ""
        query = dict(p.split("=", 1) for p in u.query.split("&") if "=" in p)
        self.db = int(query.get("db", db or 0))

    def greeting(self) -> list[tuple[Any, ...]]:
        """Commands sent first on every new connection."""
        cmds: list[tuple[Any, ...]] = []
        if self.password is not None:
            auth: tuple[Any, ...] = ("AUTH", self.password)
            cmds.append(auth if self.username is None else ("AUTH", self.username, self.password))
        if self.db:
            cmds.append(("SELECT", self.db))
        return cmds


class _Pending:
    """A command in flight: its future (None for fire-and-forget) and how to resend it."""

    __slots__ = ("args", "fut", "retried")

    def __init__(self, args: tuple[Any, ...], fut: asyncio.Future[Any] | None) -> None:
        self.args = args
        self.fut = fut
        self.retried = False


class Coalescer(asyncio.Protocol):
    """One pipelined connection to one Redis; commands of a tick travel in one write."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        on_batch: BatchObserver = ignore_batch,
        on_error: ErrorObserver = ignore_error,
        library: str | None = None,
    ) -> None:
        self._target = _Target(url)
        self._timeout = timeout_s
        self._on_batch = on_batch
        self._on_error = on_error
        self._library = library
        """Lua library source to reload when Redis answers "Function not found"."""
        self._transport: asyncio.Transport | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._reader = hiredis.Reader(replyError=ResponseError)
        self._buffer: list[bytes] = []
        self._queued: list[_Pending] = []
        self._inflight: deque[_Pending] = deque()
        self._batches: deque[list[float]] = deque()
        """[commands left, started (perf_counter), size, deadline (loop time)]"""
        self._waits: dict[tuple[int, int], asyncio.Future[Any]] = {}
        """The WAITs asked for in this tick, by (replicas, timeout): sent last in its batch."""
        self._blocked_until = 0.0
        """Loop time until which a WAIT in flight may hold the connection."""
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Future[None] | None = None
        """Set by aclose(): resolved when nothing is in flight any more."""

    # -- public ----------------------------------------------------------------------------

    def submit(self, *args: Any) -> asyncio.Future[Any]:
        """Queue a command for this tick's batch; the future gets its reply."""
        fut: asyncio.Future[Any] = (self._loop or self._bind()).create_future()
        self._enqueue(_Pending(args, fut))
        return fut

    def _bind(self) -> asyncio.AbstractEventLoop:
        """A coalescer serves the event loop it is first used on (asyncio's own lookup
        costs a getpid() per call on Python 3.11, and this is the hot path)."""
        self._loop = asyncio.get_running_loop()
        return self._loop

    def send(self, *args: Any) -> None:
        """Queue a command whose reply nobody waits for (failures are only counted)."""
        self._enqueue(_Pending(args, None))

    async def call(self, *args: Any) -> Any:
        return await self.submit(*args)

    async def broadcast(self, *args: Any) -> list[Any]:
        """A keyless command on every primary: here, the one node."""
        return [await self.call(*args)]

    def submit_wait(self, replicas: int, timeout_ms: int) -> asyncio.Future[Any]:
        """Queue `WAIT replicas timeout_ms` behind everything queued in this tick; the
        callers of one tick share it. Await it shielded: it is shared."""
        key = (replicas, timeout_ms)
        fut = self._waits.get(key)
        if fut is None:
            loop = self._loop or self._bind()
            fut = self._waits[key] = loop.create_future()
            if not self._scheduled:
                self._scheduled = True
                loop.call_soon(self._flush)
        return fut

    async def wait_replicas(self, replicas: int, timeout_ms: int) -> int:
        # Shielded: a cancelled request must not cancel the WAIT its neighbours share.
        return int(await asyncio.shield(self.submit_wait(replicas, timeout_ms)))

    async def aclose(self) -> None:
        """Deliver what is queued and wait for its replies (bounded), then disconnect."""
        if self._queued or self._waits:
            self._flush()
        if self._inflight or self._connecting:
            self._idle = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle, self._timeout)
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    # -- batching --------------------------------------------------------------------------

    def _enqueue(self, p: _Pending) -> None:
        self._buffer.append(encode_command(p.args))
        self._queued.append(p)
        if len(self._queued) >= FLUSH_EVERY and self._transport is not None and not self._waits:
            self._flush()  # Redis starts on these while the loop prepares the next ones
        elif not self._scheduled:
            self._scheduled = True
            (self._loop or self._bind()).call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if self._transport is None:
            if self._connecting is None:
                self._connecting = (self._loop or self._bind()).create_task(self._connect())
            return  # flushed once connected
        hold = self._queue_waits() if self._waits else 0.0
        if not self._queued:
            return
        data, queued = b"".join(self._buffer), self._queued
        self._buffer, self._queued = [], []
        self._inflight.extend(queued)
        loop = self._loop or self._bind()
        now = loop.time()
        # Redis answers nothing behind a blocked WAIT: a batch's deadline runs from when the
        # WAITs ahead of it (and its own) may last return, or a replica outage would pass
        # for an unresponsive Redis and cut the connection.
        ready = max(now, self._blocked_until) + hold
        if hold:
            self._blocked_until = ready
        # The batch's duration is timed on perf_counter: loop.time() under uvloop has a
        # millisecond resolution, which would put most batches in the first bucket.
        self._batches.append([len(queued), time.perf_counter(), len(queued),
                              ready + self._timeout])
        self._transport.write(data)
        if self._timer is None:
            self._timer = loop.call_later(self._timeout, self._check_deadline)

    def _queue_waits(self) -> float:
        """Put this tick's WAITs last in the batch; the seconds they may block."""
        waits, self._waits = self._waits, {}
        for (replicas, timeout_ms), fut in waits.items():
            args = ("WAIT", replicas, timeout_ms)
            self._buffer.append(encode_command(args))
            self._queued.append(_Pending(args, fut))
        return sum(timeout_ms for _, timeout_ms in waits) / 1000

    def _check_deadline(self) -> None:
        self._timer = None
        if not self._batches:
            return
        loop = asyncio.get_running_loop()
        overdue = self._batches[0][3] - loop.time()
        if overdue <= 0:
            self._fail("timeout", Unavailable(f"redis did not answer within {self._timeout}s"))
        else:
            self._timer = loop.call_later(overdue, self._check_deadline)

    # -- connection ------------------------------------------------------------------------

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        t = self._target
        try:
            async with asyncio.timeout(self._timeout):
                if t.scheme == "unix":
                    await loop.create_unix_connection(lambda: self, t.path)
                else:
                    context = ssl.create_default_context() if t.scheme == "rediss" else None
                    await loop.create_connection(lambda: self, t.host, t.port, ssl=context)
        except (OSError, TimeoutError) as e:
            self._connecting = None
            self._fail("connection", Unavailable(f"cannot connect to redis: {e}"))
            return
        self._connecting = None
        greeting = [_Pending(args, None) for args in self._target.greeting()]
        if greeting:  # AUTH / SELECT go before anything queued meanwhile
            self._buffer[:0] = [encode_command(p.args) for p in greeting]
            self._queued[:0] = greeting
        self._flush()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._reader = hiredis.Reader(replyError=ResponseError)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is not None:
            self._transport = None
            if self._inflight:
                self._fail("connection", Unavailable(f"redis connection lost: {exc}"))

    def _fail(self, kind: str, error: Unavailable) -> None:
        """Fail everything in flight and queued; drop the connection (its replies are lost)."""
        self._on_error(kind)
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.abort()
        failed = [*self._inflight, *self._queued,
                  *(_Pending(("WAIT",), fut) for fut in self._waits.values())]
        self._inflight.clear()
        self._queued, self._buffer, self._waits = [], [], {}
        self._batches.clear()
        self._blocked_until = 0.0
        for p in failed:
            if p.fut is not None and not p.fut.done():
                p.fut.set_exception(error)
        self._wake_idle()

    def _wake_idle(self) -> None:
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    # -- replies ---------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        inflight, batches = self._inflight, self._batches
        while True:
            reply = self._reader.gets()
            if reply is False:
                if not inflight:
                    self._wake_idle()
                return
            p = inflight.popleft()
            head = batches[0]
            head[0] -= 1
            if head[0] == 0:
                batches.popleft()
                self._on_batch(int(head[2]), time.perf_counter() - head[1])
            if isinstance(reply, ResponseError):
                self._error_reply(p, reply)
            elif p.fut is not None and not p.fut.done():
                p.fut.set_result(reply)

    def _error_reply(self, p: _Pending, reply: ResponseError) -> None:
        if (self._library is not None and not p.retried and p.args[0] == "FCALL"
                and _MISSING_FUNCTION in str(reply)):
            # Redis lost the library (FUNCTION FLUSH, a replica promoted without it): nothing
            # ran, so reloading and sending the call once more is safe.
            log.warning("redis lost the Lua library: reloading it")
            p.retried = True
            self._enqueue(_Pending(("FUNCTION", "LOAD", "REPLACE", self._library), None))
            self._enqueue(p)
            return
        self._on_error("reply")
        if p.fut is None:
            log.warning("redis error reply to a background command %s: %s", p.args[0], reply)
        elif not p.fut.done():
            p.fut.set_exception(reply)
