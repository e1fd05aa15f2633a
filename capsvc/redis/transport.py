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
command reconnects. Error replies (`-ERR …`) fail only their own command; an `OOM` reply
(maxmemory reached under noeviction: nothing of that command ran) fails it with
`OutOfMemory`, a 503 whose outcome is unknown, since the request's other calls may have run.

Replica acknowledgements (`wait_replicas`, capsvc.redis.durability): Redis `WAIT` counts the
replicas that have every earlier write *of the connection it is sent on*, so it must travel
on this pipeline, after the writes. The WAITs asked for during one tick are one command,
sent last in that tick's batch, right behind a write of its own (the *fence*, `SET` of a
short-lived key): replication is one ordered stream, so replicas that have the fence have
everything Redis had run before it — the writes of this tick, and whatever another
connection or process wrote that this tick's reads saw (a replay, a GET). Without the
fence, what WAIT waits for depends on how the Redis version counts a connection's writes
(a read alone may not raise it). While a WAIT blocks, Redis holds the rest of the pipeline
behind it, so batches behind a WAIT get their deadline counted from the end of its timeout.

Only a primary is talked to: every new connection first asks `ROLE` (a node that answers
"slave" is left at once), a `READONLY` reply (the node was demoted under us) drops the
connection, and with a `redis+sentinel://` URL the primary's address is asked of the
sentinels before each connection and a `+switch-master` drops the connection at once
(capsvc.redis.sentinel).

Reconnections back off while they keep failing: the first attempt after a connection that
worked goes at once; after n failed attempts in a row the next one waits RECONNECT_S x
2^(n-1), at most RECONNECT_MAX_S, each pause drawn between half and all of that (jitter:
the workers and hosts of a deployment do not knock on a Redis that comes back in step).
While Redis stays down a coalescer soon makes at most one attempt every RECONNECT_MAX_S / 2
(one every 0.75 x RECONNECT_MAX_S on average), whatever its traffic. A primary that answers
ends the backoff, and so do the news of a new primary — a sentinel's switch, a cluster's
MOVED to this node (`retry_now`) — whose first attempt goes at once. A command issued during
a pause longer than RECONNECT_S fails at once with the last attempt's error (503) rather
than wait for the next attempt; during a shorter one it waits, as it always has.

With a gate (capsvc.redis.gate), the same handshake reads the node's maxmemory-policy and its
identity, and nothing goes to a node that may evict or that the journal has not reconciled;
the policy is read again every POLICY_S on a connection in use.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import ssl
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, cast
from urllib.parse import unquote, urlsplit

import hiredis
from redis.exceptions import ResponseError

from capsvc.domain.errors import Unavailable, own_copy
from capsvc.redis.gate import POLICY_S, Evicting, Gate, identity, info_field
from capsvc.redis.sentinel import Sentinels
from capsvc.urls import Address, is_sentinel_url, parse_sentinel_url

log = logging.getLogger(__name__)

BatchObserver = Callable[[int, float], None]
"""Called with (commands in the batch, seconds until its last reply) after each batch."""
ErrorObserver = Callable[[str], None]
"""Called with the kind of failure ("timeout", "connection", "reply", "readonly", "oom")."""
PrimaryObserver = Callable[[str, str], None]
"""Called with (node, event): "lost" when the connection to the primary failed, "up" when a
primary answers again, "switched" when the one that answers is another node than before
(or the same one after it was demoted: a failover), "forgotten" when the node is no longer
used (a cluster node removed from the slot map)."""

_MISSING_FUNCTION = "Function not found"
_OOM = "OOM"
"""The error reply of a command Redis refuses at maxmemory under noeviction."""
OOM_LOG_S = 10.0
"""Least time between two log lines of a node refusing writes out of memory (each refusal
is counted in `capsvc_redis_errors_total{kind="oom"}`)."""
_NOT_NOW = ("LOADING", "MASTERDOWN", "BUSY ")
"""Error replies that mean "not now": nothing ran."""

FLUSH_EVERY = 8
"""Commands after which a batch is written without waiting for the end of the tick. With
one write per tick, the requests of every connection fall into one batch and the process
sleeps while Redis works through it; written as it fills, Redis and Python overlap
(docs/performance.md: 0.36 -> 0.44 of bare; 4 and 16 measured worse)."""


def ignore_batch(size: int, seconds: float) -> None:
    return None


def ignore_error(kind: str) -> None:
    return None


def ignore_primary(node: str, event: str) -> None:
    return None


RECONNECT_S = 0.05
"""Least time between two connection attempts, and the first pause of the backoff: during
an outage, requests share attempts instead of each opening one (and asking the sentinels)
per event-loop tick."""
RECONNECT_MAX_S = 2.0
"""The backoff's ceiling: the longest pause between two failed connection attempts, so
also the longest a primary that is back waits to be found (docs/durability.md)."""
FAILOVER_HOLD_S = 10.0
"""Longest wait for the switch once the sentinels have started a failover (past it, the
sentinels are asked again: an announcement may have been missed)."""
FENCE_TTL_MS = 10_000
"""Life of the fence key written before each WAIT (one key per node, rewritten per tick)."""


class OutOfMemory(Unavailable):
    """Redis refused a command: used memory is past `maxmemory` (noeviction). The command
    did not run; what else the request sent may have: an unknown outcome (503)."""


class Transport(Protocol):
    """What the store needs from Redis: one node (`Coalescer`) or a cluster."""

    def submit(self, *args: Any) -> asyncio.Future[Any]: ...

    def submit_partly_declared(self, *args: Any) -> asyncio.Future[Any]:
        """`submit` of a command that reaches keys it does not declare (a cluster never
        sends it with ASKING: capsvc.redis.cluster)."""
        ...

    def before_flush(self, hook: Callable[[], None]) -> None:
        """Run `hook` once at the end of this turn of the event loop, before what it
        submits goes out: a caller that gathers calls over the turn queues them there."""
        ...

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
    """Where and how to connect, from a redis://, rediss://, unix:// or redis+sentinel://
    URL (`sentinels` set for the last: the address is theirs to give)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.sentinels: Sentinels | None = None
        if is_sentinel_url(url):
            s = parse_sentinel_url(url)
            self.sentinels = Sentinels(s, timeout_s)
            self.scheme = "rediss" if s.tls else "redis"
            self.host, self.port = s.sentinels[0]
            self.path = ""
            self.username, self.password, self.db = s.username, s.password, s.db
            return
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

    @property
    def address(self) -> str:
        """The node connected to (or last tried), for messages."""
        return self.path if self.scheme == "unix" else f"{self.host}:{self.port}"

    @property
    def name(self) -> str:
        """What stays the same across failovers: the node's address, or the service the
        sentinels name a primary for (for the observer of primaries)."""
        if self.sentinels is not None:
            return f"sentinel:{self.sentinels.url.service}"
        return self.address

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


class _Wire(asyncio.Protocol):
    """One connection of a coalescer. Events of a connection it has already left (the
    `connection_lost` of one it aborted, data still arriving on it) are not its business."""

    __slots__ = ("owner", "transport")

    def __init__(self, owner: Coalescer) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.owner.connection_made(self.transport)

    def data_received(self, data: bytes) -> None:
        if self.transport is self.owner._transport:
            self.owner.data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is self.owner._transport:
            self.owner.connection_lost(exc)


class Coalescer:
    """One pipelined connection to one Redis; commands of a tick travel in one write."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        on_batch: BatchObserver = ignore_batch,
        on_error: ErrorObserver = ignore_error,
        on_primary: PrimaryObserver = ignore_primary,
        library: str | None = None,
        fence_key: str = "w:{fence}",
        primary_only: bool = True,
        gate: Gate | None = None,
    ) -> None:
        self._target = _Target(url, timeout_s)
        self._timeout = timeout_s
        self._on_batch = on_batch
        self._on_error = on_error
        self._on_primary = on_primary
        self._library = library
        """Lua library source to reload when Redis answers "Function not found"."""
        self._loading: asyncio.Future[Any] | None = None
        """The reply of the FUNCTION LOAD in flight, if any: the calls that find the library
        missing meanwhile are sent again after it, without a load of their own."""
        self._library_there = False
        """The library answered (an FCALL) or was loaded (FUNCTION LOAD) through this
        transport: a later "Function not found" is a loss, the first one before that only
        an empty Redis."""
        self.fence_key = fence_key
        """The key written right before each WAIT (see the module's docstring)."""
        self._primary_only = primary_only
        """Refuse a node whose ROLE is not master (a cluster's nodes are judged by the
        cluster's own redirections instead)."""
        self._gate = gate
        """What says whether this process may use the server it reached (its journal
        reconciled with that server's identity: capsvc.recovery.restore); None: always."""
        self._identity: str | None = None
        self._node: str | None = None
        """The address the handshake judged (the gate's name for the node)."""
        self._policy_due = 0.0
        """Loop time from which the node's maxmemory-policy is read again (POLICY_S)."""
        self._policy_by_info = False
        """CONFIG GET was refused on this connection: the policy is read from INFO memory."""
        self._oom_said = float("-inf")
        """Loop time of the last line about this node refusing writes out of memory."""
        self._transport: asyncio.Transport | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._handshaking = False
        """Connected, but the greeting's replies (AUTH, SELECT, ROLE) are still awaited:
        nothing queued is written before the node is known to be the primary."""
        self._next_attempt = 0.0
        """Loop time before which no new connection is attempted (the backoff's pause)."""
        self._last_attempt = float("-inf")
        """Loop time of the last connection attempt's start."""
        self._failed_attempts = 0
        """Connection attempts that failed since a primary last answered (the backoff)."""
        self._wake: asyncio.Future[None] | None = None
        """Set while an attempt waits out its pause: resolving it ends the pause."""
        self._address: Address | None = None
        """The node of the current (or last) connection."""
        self._lost = False
        """The last connection failed and no primary has answered since."""
        self._demoted = False
        """The node we talked to was demoted (READONLY, a sentinel's switch): the next
        primary that answers is a failover, even at the same address."""
        self._watcher: asyncio.Task[None] | None = None
        self._held_until = 0.0
        """Loop time until which no connection is made: a failover is under way."""
        self._announced: Address | None = None
        """The primary a sentinel's switch announced, its failover counted already."""
        self._failure: Unavailable | None = None
        """The error the last failure gave its commands."""
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
        self._hooks: list[Callable[[], None]] = []
        """Run at this tick's flush, before the batch goes out (`before_flush`)."""
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

    def submit_partly_declared(self, *args: Any) -> asyncio.Future[Any]:
        """One Redis: every key is its own, no slot moves."""
        return self.submit(*args)

    def _bind(self) -> asyncio.AbstractEventLoop:
        """A coalescer serves the event loop it is first used on (asyncio's own lookup
        costs a getpid() per call on Python 3.11, and this is the hot path)."""
        self._loop = asyncio.get_running_loop()
        return self._loop

    def before_flush(self, hook: Callable[[], None]) -> None:
        """Run `hook` once at this tick's flush, before the batch goes out: a caller that
        gathers calls over the tick queues them there, in this tick's batch."""
        self._hooks.append(hook)
        if not self._scheduled:
            self._scheduled = True
            (self._loop or self._bind()).call_soon(self._flush)

    def send(self, *args: Any) -> None:
        """Queue a command whose reply nobody waits for (failures are only counted)."""
        self._enqueue(_Pending(args, None))

    async def call(self, *args: Any) -> Any:
        return await self.submit(*args)

    async def broadcast(self, *args: Any) -> list[Any]:
        """A keyless command on every primary: here, the one node."""
        return [await self.call(*args)]

    def retry_now(self) -> None:
        """News that the node may serve now (a cluster's MOVED to it, a sentinel's switch):
        the backoff ends, the next connection attempt goes at once (RECONNECT_S after the
        last one at the earliest), an attempt waiting out its pause included."""
        self._failed_attempts = 0
        self._next_attempt = min(self._next_attempt, self._last_attempt + RECONNECT_S)
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

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
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        if self._queued or self._waits or self._hooks:
            self.retry_now()  # what is queued gets one attempt now, not after a pause
            self._flush()
        elif self._wake is not None and self._connecting is not None:
            # An attempt waiting out its pause with nothing to deliver: not needed any more.
            self._connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._connecting
            self._connecting = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        # Until what was queued is answered (or the deadline): the handshake's replies also
        # leave nothing in flight, before the connection's own flush has sent the queue.
        while (self._inflight or self._connecting or self._queued) and loop.time() < deadline:
            self._idle = loop.create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle, deadline - loop.time())
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    # -- batching --------------------------------------------------------------------------

    def _enqueue(self, p: _Pending) -> None:
        self._buffer.append(encode_command(p.args))
        self._queued.append(p)
        if (len(self._queued) >= FLUSH_EVERY and self._transport is not None
                and not self._waits and not self._handshaking):
            self._flush()  # Redis starts on these while the loop prepares the next ones
        elif not self._scheduled:
            self._scheduled = True
            (self._loop or self._bind()).call_soon(self._flush)

    def _flush(self) -> None:
        while self._hooks:  # still scheduled: what they queue (hooks too) joins this flush
            hooks, self._hooks = self._hooks, []
            for hook in hooks:
                hook()
        self._scheduled = False
        if self._transport is None:
            loop = self._loop or self._bind()
            if self._connecting is None:
                self._connecting = loop.create_task(self._connect())
            if self._next_attempt - loop.time() > RECONNECT_S and self._failure is not None:
                self._backing_off(self._failure)  # Redis is down: say so now
            return  # flushed once connected
        if self._handshaking:
            return  # flushed once the node is known to be the primary
        if self._gate is not None:
            if (self._loop or self._bind()).time() >= self._policy_due:
                self._read_policy()
            if not self._gate.admits(self._identity, self._node):
                self._refuse()
                return
        hold = self._queue_waits() if self._waits else 0.0
        if self._queued:
            self._write(self._buffer, self._queued, hold)
            self._buffer, self._queued = [], []

    def _write(self, buffer: list[bytes], queued: list[_Pending], hold: float = 0.0) -> None:
        """Put a batch on the wire, its replies awaited in order, under one deadline."""
        assert self._transport is not None
        data = b"".join(buffer)
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
        """Put this tick's WAITs last in the batch, behind the fence; the seconds they may
        block. A WAIT answers its callers only if its fence was written: otherwise what it
        counted is not known to cover their reads."""
        waits, self._waits = self._waits, {}
        loop = self._loop or self._bind()
        fence: asyncio.Future[Any] = loop.create_future()
        self._enqueue_now(_Pending(("SET", self.fence_key, "1", "PX", FENCE_TTL_MS), fence))
        for (replicas, timeout_ms), fut in waits.items():
            acked: asyncio.Future[Any] = loop.create_future()
            acked.add_done_callback(functools.partial(_after_fence, fence, fut=fut))
            self._enqueue_now(_Pending(("WAIT", replicas, timeout_ms), acked))
        return sum(timeout_ms for _, timeout_ms in waits) / 1000

    def _refuse(self) -> None:
        """Fail what is queued, nothing sent: this node may evict (its maxmemory-policy),
        or this server is not reconciled with the journal yet (a restore is under way)."""
        assert self._gate is not None
        problem = self._gate.problem(self._node)
        error = Evicting(problem) if problem is not None else Unavailable(
            "Redis is being restored from the journal (a new server, or one that may have "
            "lost writes): nothing is sold until it is done")
        self._fail_queued(error)
        if problem is None and not self._gate.restoring:
            # Restored, and this server is still not one the restore reconciled (it changed
            # meanwhile, or its role did: a cluster node demoted under us): look at it
            # again on a new connection, whose handshake judges it afresh.
            if self._inflight:  # their outcome is unknown, as on any lost connection
                self._fail("connection", error)
                return
            transport, self._transport = self._transport, None
            if transport is not None:
                transport.abort()

    def _fail_queued(self, error: BaseException) -> None:
        """Fail what is queued in this tick (its WAITs too), nothing of it sent."""
        failed = [*self._queued, *(_Pending(("WAIT",), fut) for fut in self._waits.values())]
        self._queued, self._buffer, self._waits = [], [], {}
        for p in failed:
            if p.fut is not None and not p.fut.done():
                p.fut.set_exception(own_copy(error))

    def _backing_off(self, error: Unavailable) -> None:
        """Fail what is queued, nothing sent: the last attempt failed and the next one is
        not due yet (the backoff's pause). Not counted as a Redis error: nothing was tried."""
        self._fail_queued(error)
        self._wake_idle()

    def _pause(self) -> float:
        """The backoff's pause after `_failed_attempts` failures in a row (see the module's
        docstring): between half and all of RECONNECT_S x 2^(n-1), capped."""
        n = self._failed_attempts
        ceiling = min(RECONNECT_MAX_S, RECONNECT_S * 2 ** min(n - 1, 16)) if n else 0.0
        return ceiling * (0.5 + random.random() / 2)

    def _read_policy(self) -> None:
        """Read the node's maxmemory-policy again (every POLICY_S while the connection is
        used), ahead of this flush's batch and whatever the gate says of the node: a node
        held for its policy is released by this read once set to noeviction."""
        loop = self._loop or self._bind()
        self._policy_due = loop.time() + POLICY_S
        args: tuple[Any, ...] = (("INFO", "memory") if self._policy_by_info
                                 else ("CONFIG", "GET", "maxmemory-policy"))
        fut: asyncio.Future[Any] = loop.create_future()
        fut.add_done_callback(self._policy_read)
        self._write([encode_command(args)], [_Pending(args, fut)])

    def _policy_read(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled() or self._gate is None or self._node is None:
            return
        error = fut.exception()
        if isinstance(error, ResponseError) and not self._policy_by_info:
            self._policy_by_info = True  # CONFIG refused since (an ACL): INFO next time
            self._policy_due = 0.0
            return
        if error is None:
            self._gate.policy(self._node, _policy_of(fut.result(), self._policy_by_info))

    def _enqueue_now(self, p: _Pending) -> None:
        self._buffer.append(encode_command(p.args))
        self._queued.append(p)

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
        pause = self._next_attempt - loop.time()
        if pause > 0:
            self._wake = loop.create_future()
            try:
                await asyncio.wait((self._wake,), timeout=pause)
            finally:
                self._wake = None
        self._last_attempt = loop.time()
        self._next_attempt = self._last_attempt + RECONNECT_S
        reported = self._failure  # `_fail` reports a failure once: a new one replaces it
        try:
            if t.sentinels is not None:
                if self._watcher is None:
                    self._watcher = loop.create_task(t.sentinels.watch(self))
                if loop.time() < self._held_until:
                    raise Unavailable("a Redis failover is under way: no primary to use yet")
                t.host, t.port = await t.sentinels.locate()
            async with asyncio.timeout(self._timeout):
                if t.scheme == "unix":
                    await loop.create_unix_connection(lambda: _Wire(self), t.path)
                else:
                    context = ssl.create_default_context() if t.scheme == "rediss" else None
                    await loop.create_connection(lambda: _Wire(self), t.host, t.port,
                                                 ssl=context)
                await self._handshake()
        except Exception as e:  # refused, reset, slow, a replica, a reply that makes no sense
            self._connecting = None
            self._handshaking = False
            self._failed_attempts += 1
            self._next_attempt = max(self._next_attempt, loop.time() + self._pause())
            # Unless this attempt's failure was reported already (`_fail`: a handshake's
            # command past its deadline, the connection lost), which the connect's own
            # timeout may follow in the same turn of the loop.
            if self._failure is reported:
                kind = "timeout" if isinstance(e, TimeoutError) else "connection"
                reason = (e if isinstance(e, Unavailable)
                          else f"cannot connect to redis at {t.address}: {e}")
                self._fail(kind, Unavailable(str(reason) or "redis did not answer in time"))
            return
        self._connecting = None
        self._failed_attempts = 0
        self._primary_up((t.host, t.port))
        self._flush()
        if not self._inflight:
            self._wake_idle()  # a close waiting on this connection: nothing left to answer

    async def _handshake(self) -> None:
        """AUTH and SELECT; ROLE (is this node the primary?) and, with a gate, its
        maxmemory-policy (CONFIG GET, else INFO's memory section) and INFO (the server's
        identity, for the journal: capsvc.redis.gate). Their replies are awaited before
        anything queued goes out; all of them travel in one write, one round trip."""
        commands = self._target.greeting()
        greeting = len(commands)
        gate = self._gate
        if gate is not None:
            commands.append(("CONFIG", "GET", "maxmemory-policy"))
            commands.append(("INFO", "server", "replication", "memory"))
        asks_role = self._primary_only or gate is not None
        if asks_role:
            commands.append(("ROLE",))
        if not commands:
            self._handshaking = False
            return
        loop = self._loop or self._bind()
        pending = [_Pending(args, loop.create_future()) for args in commands]
        self._handshaking = True
        self._write([encode_command(p.args) for p in pending], pending)
        replies = await asyncio.gather(*[p.fut for p in pending if p.fut is not None],
                                       return_exceptions=True)
        self._handshaking = False
        for reply in replies[:greeting]:
            if isinstance(reply, BaseException):
                raise reply
        config = replies[greeting] if gate is not None else None
        info = replies[greeting + 1] if gate is not None else None
        role: bytes | None = None
        if asks_role:
            reply = replies[-1]
            if isinstance(reply, BaseException) and not _unknown_command(reply):
                raise reply
            # A proxy or a stand-in that has no ROLE: its node cannot be judged.
            role = None if isinstance(reply, BaseException) else cast(list[bytes], reply)[0]
        if isinstance(info, BaseException) and not _unknown_command(info):
            raise info
        if self._primary_only and role is not None and role != b"master":
            self._demoted = True
            raise Unavailable(f"redis at {self._target.address} is a {role.decode()}, "
                              "not the primary")
        if gate is not None:
            node = self._target.address
            if self._node is not None and self._node != node:
                gate.forget(self._node)  # a failover moved us: the old node is not used
            self._node = node
            # CONFIG refused (renamed or disabled, as on managed services; an ACL): INFO.
            self._policy_by_info = isinstance(config, BaseException)
            self._policy_due = (self._loop or self._bind()).time() + POLICY_S
            policy = (_policy_of(config, False) if not self._policy_by_info else None)
            if policy is None and isinstance(info, bytes | str):
                policy = _policy_of(info, True)
            gate.policy(node, policy)
            # A cluster's replica serves nothing (it redirects): only a primary's identity
            # is judged.
            known = role in (None, b"master") and isinstance(info, bytes | str)
            self._identity = identity(cast(bytes, info)) if known else None
            gate.seen(self._identity)

    def _primary_up(self, address: Address) -> None:
        event = "switched" if self._demoted or (
            self._address is not None and address != self._address) else "up"
        if event == "switched" and address == self._announced:
            event = "up"  # counted when the sentinels announced it
        self._announced = None
        if event == "switched":
            log.warning("redis primary is now %s:%s", *address)
        elif self._lost:
            log.info("redis primary %s:%s answers again", *address)
        if self._lost or event == "switched":
            self._on_primary(self._target.name, event)
        self._address, self._lost, self._demoted = address, False, False

    # -- a Sentinel failover (capsvc.redis.sentinel.FailoverEvents) -----------------------------

    def starting(self) -> None:
        """The sentinels chose a replica to promote: from that moment the old primary may
        go on being acknowledged by a replica that will follow the new one and drop what it
        got, so nothing more is answered from it (in flight: an unknown outcome). New
        connections wait for the switch, at most FAILOVER_HOLD_S."""
        loop = self._loop or self._bind()
        if loop.time() < self._held_until:
            return
        log.warning("the sentinels are failing the redis primary over: holding its use")
        self._held_until = loop.time() + FAILOVER_HOLD_S
        if self._transport is not None:
            self._fail("connection", Unavailable("a Redis failover is under way"))

    def aborted(self) -> None:
        if self._held_until:
            log.info("the sentinels gave the failover up: the primary is used again")
        self._held_until = 0.0
        self.retry_now()

    def switched(self, address: Address) -> None:
        """A sentinel announced a new primary: leave the old one now (anything in flight
        there is an unknown outcome), the next command connects to the new one at once."""
        self._held_until = 0.0
        self.retry_now()
        if address == self._address:
            return  # already there (each sentinel announces the same switch)
        if address != self._announced:
            log.warning("the sentinels switched the redis primary to %s:%s", *address)
            self._on_primary(self._target.name, "switched")
            self._announced = address
        self._demoted = True
        if self._transport is not None:
            self._fail("connection", Unavailable(
                f"the redis primary moved to {address[0]}:{address[1]} (sentinel)"))

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._reader = hiredis.Reader(replyError=ResponseError)
        # Nothing queued goes out before the handshake has judged the node (its role, its
        # identity): other tasks run between this callback and the handshake's start, and
        # one of them filling a batch must not write it to a node not judged yet.
        self._handshaking = True
        self._identity = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is not None:
            self._transport = None
            if self._inflight:
                self._fail("connection", Unavailable(f"redis connection lost: {exc}"))

    def _fail(self, kind: str, error: Unavailable) -> None:
        """Fail everything in flight and queued; drop the connection (its replies are lost)."""
        self._on_error(kind)
        self._failure = error
        if not self._lost:
            self._lost = True
            self._on_primary(self._target.name, "lost")
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
                p.fut.set_exception(own_copy(error))
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
                if self._transport is None:
                    return  # the reply dropped the connection: the rest is not read
                continue
            if not self._library_there:
                self._library_there = _uses_library(p.args)
            if p.fut is not None and not p.fut.done():
                p.fut.set_result(reply)

    def _error_reply(self, p: _Pending, reply: ResponseError) -> None:
        if str(reply).startswith("READONLY"):
            # The node was demoted under us: nothing more goes to it. What else is in flight
            # on this connection has an unknown outcome, like any lost connection.
            log.warning("redis at %s is read-only now (demoted): finding the primary again",
                        self._target.address)
            self._demoted = True
            self._fail("readonly", Unavailable(
                f"redis at {self._target.address} was demoted to a replica: {reply}"))
            if p.fut is not None and not p.fut.done():
                p.fut.set_exception(Unavailable(str(reply)))
            return
        if (self._library is not None and not p.retried and p.args[0] == "FCALL"
                and _MISSING_FUNCTION in str(reply)):
            # No library: nothing ran, so loading it and sending the call once more is safe.
            # Before it ever answered here, that is a first start on an empty Redis; after,
            # Redis lost it (FUNCTION FLUSH, a replica promoted without it, data lost).
            if self._library_there:
                log.warning("redis lost the Lua library: reloading it")
            else:
                log.info("redis at %s has no Lua library yet: loading it",
                         self._target.address)
            p.retried = True
            if self._loading is None:
                self._loading = (self._loop or self._bind()).create_future()
                self._loading.add_done_callback(self._loaded)
                self._enqueue(_Pending(("FUNCTION", "LOAD", "REPLACE", self._library),
                                       self._loading))
            self._enqueue(p)
            return
        if str(reply).startswith(_OOM):
            self._out_of_memory(p, reply)
            return
        self._on_error("reply")
        if str(reply).startswith(_NOT_NOW):
            # Redis ran nothing and may later: loading its data, a replica cut from its
            # primary, a script running. Unavailable (503), not a refusal.
            if p.fut is not None and not p.fut.done():
                p.fut.set_exception(Unavailable(f"redis is not serving: {reply}"))
            return
        if p.fut is None:
            log.warning("redis error reply to a background command %s: %s", p.args[0], reply)
        elif not p.fut.done():
            p.fut.set_exception(reply)

    def _loaded(self, fut: asyncio.Future[Any]) -> None:
        self._loading = None
        error = None if fut.cancelled() else fut.exception()
        if isinstance(error, ResponseError):
            log.warning("redis refused the Lua library: %s", error)

    def _out_of_memory(self, p: _Pending, reply: ResponseError) -> None:
        """Redis refused a command at maxmemory (noeviction). It refuses before running
        anything: a plain write, and an FCALL of a function without the `no-writes` flag
        (every capsvc function that writes), whose Lua is then not run at all — checked on
        Redis 7.0: a function that starts below maxmemory runs whole even if its writes pass
        it, one that would start above is refused up front, so a call never runs in part.
        The request's other calls may have run: its outcome is unknown (503), as for a
        timeout. One line per OOM_LOG_S, every refusal counted."""
        self._on_error("oom")
        loop = self._loop or self._bind()
        quiet = self._gate is not None and not self._gate.logs  # a tool says it itself
        if not quiet and loop.time() - self._oom_said >= OOM_LOG_S:
            self._oom_said = loop.time()
            log.error("redis at %s refuses writes: out of memory (maxmemory reached under "
                      "noeviction): requests that write answer 503 until memory is freed or "
                      "maxmemory raised (size it: README, Sizing Redis)", self._target.address)
        if p.fut is not None and not p.fut.done():
            p.fut.set_exception(OutOfMemory(
                f"redis at {self._target.address} is out of memory (maxmemory reached "
                f"under noeviction): {p.args[0]} refused, nothing of it ran"))


def _policy_of(reply: Any, from_info: bool) -> str | None:
    """The maxmemory-policy in a reply to CONFIG GET maxmemory-policy (a [name, value]
    list, or a map on RESP3) or INFO (its memory section); None: not there."""
    if from_info:
        return info_field(reply, "maxmemory_policy") if isinstance(reply, bytes | str) else None
    if isinstance(reply, dict):
        reply = [x for kv in reply.items() for x in kv]
    if isinstance(reply, list) and len(reply) == 2:
        value = reply[1]
        return value.decode() if isinstance(value, bytes) else str(value)
    return None


def _uses_library(args: tuple[Any, ...]) -> bool:
    """Whether a command that succeeded shows the library there: an FCALL, or a FUNCTION
    LOAD."""
    return args[0] == "FCALL" or args[:2] == ("FUNCTION", "LOAD")


def _unknown_command(reply: BaseException) -> bool:
    return isinstance(reply, ResponseError) and "unknown command" in str(reply)


def _after_fence(fence: asyncio.Future[Any], acked: asyncio.Future[Any], *,
                 fut: asyncio.Future[Any]) -> None:
    """Hand a WAIT's reply to its callers, unless its fence failed (then that error).
    Replies come in order: the fence is settled before its WAIT."""
    errors = [f.exception() for f in (fence, acked) if f.done() and not f.cancelled()]
    if fut.done():
        return
    error = next((e for e in errors if e is not None), None)
    if error is not None:
        fut.set_exception(error)
    elif not fence.done() or fence.cancelled() or acked.cancelled():
        fut.set_exception(Unavailable("the replicas' acknowledgement was not received"))
    else:
        fut.set_result(acked.result())
