"""Redis Cluster: route each command to the primary that owns its key's slot.

`ClusterCoalescer` has the interface of `Coalescer` (submit, send, call, broadcast,
wait_replicas, aclose) and keeps one `Coalescer` per primary, so coalescing happens per node: the
commands of one tick bound for one node travel in one pipeline, and the grids of a ticket
that sit on different nodes are reserved concurrently.

Redirections are followed: `MOVED` updates the slot map (and refreshes it in the
background), `ASK` sends `ASKING` + the command to the importing node in one pipeline,
`TRYAGAIN` (a multi-key call on a slot being migrated) retries shortly after. Nothing ran
when Redis answered any of these, so resending is safe. A node that cannot be reached
fails its commands with `Unavailable` and triggers a refresh of the slot map, so the next
requests find the promoted replica; a node named by a `MOVED` or newly in the map is
connected to at once, out of its reconnection backoff (capsvc.redis.transport). Every
primary gets the Lua library (`FUNCTION LOAD REPLACE` on all of them) and reloads it on
"Function not found".

`wait_replicas` sends `WAIT` on every primary's connection, after whatever this tick queued
there and behind a fence write to a key of a slot that primary owns (capsvc.redis.transport): a
ticket's writes are spread over several primaries, and each primary's WAIT counts only its
own replicas.

A failover is counted when a primary leaves the slot map (its replica took its slots); the
coalescers of nodes no longer in the map are closed.

Each primary has a count of the marked calls it runs (capsvc.redis.marks): a key in the
highest slot it serves, which `node_of` names for a call's key from the slot map, and
`nodes` lists for the watch. A marked call that reaches a node its node's count is not on
(the map changed under it: "non local key", nothing ran) fails with `MarkElsewhere`, which
the marks send again, and refreshes the map.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from redis.crc import key_slot
from redis.exceptions import ResponseError

from capsvc.domain.errors import Unavailable
from capsvc.redis.gate import Evicting, Gate
from capsvc.redis.marks import NON_LOCAL, MarkElsewhere, node_of_slot
from capsvc.redis.transport import (
    BatchObserver,
    Coalescer,
    ErrorObserver,
    OutOfMemory,
    PrimaryObserver,
    ignore_batch,
    ignore_error,
    ignore_primary,
)

log = logging.getLogger(__name__)

SLOTS = 16384
_KEYLESS = frozenset({"FUNCTION", "PING", "TIME", "INFO", "CLUSTER"})
_REDIRECTED = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")
T = TypeVar("T")
_MAX_REDIRECTS = 16
"""Redirections and retries per command. A multi-key call whose keys are split by a slot
migration gets TRYAGAIN until the slot has moved: retried with a growing pause (20 ms, 40 ms,
… up to 100 ms; ~1.2 s in all), well inside a request's timeout."""


def key_of(args: tuple[Any, ...]) -> str | bytes | None:
    """The key that decides where a command goes (the first one), or None."""
    name = args[0]
    if name == "FCALL":
        return args[3] if int(args[2]) > 0 else None
    if name in _KEYLESS:
        return None
    if name == "XINFO":  # XINFO STREAM key
        return args[2]  # type: ignore[no-any-return]
    if name == "XREAD":  # XREAD [COUNT n] [BLOCK ms] STREAMS key… id…
        return args[args.index("STREAMS") + 1]  # type: ignore[no-any-return]
    return args[1]  # type: ignore[no-any-return]


def slot_of(key: str | bytes) -> int:
    return int(key_slot(key.encode() if isinstance(key, str) else key))


Node = tuple[str, int]

_LEARNT: dict[Node, set[Node]] = {}
"""By a cluster URL's seed, the primaries this process has seen in its slot maps: a transport
made later (a restore's) asks them too, not only the seed, which may be down."""


class ClusterCoalescer:
    """Per-node coalescing over a Redis Cluster, following its redirections."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        on_batch: BatchObserver = ignore_batch,
        on_error: ErrorObserver = ignore_error,
        on_primary: PrimaryObserver = ignore_primary,
        library: str | None = None,
        gate: Gate | None = None,
    ) -> None:
        u = urlsplit(url)
        self._gate = gate
        self._seeds: list[Node] = [(u.hostname or "127.0.0.1", u.port or 6379)]
        self._learnt = _LEARNT.setdefault(self._seeds[0], set())
        """The nodes this process has seen serve slots of this cluster, by any transport:
        asked for the map when the seed is down (a failover took its slots)."""
        self._password = u.password
        self._timeout = timeout_s
        self._on_batch = on_batch
        self._on_error = on_error
        self._on_primary = on_primary
        self._library = library
        self._nodes: dict[Node, Coalescer] = {}
        self._slots: list[Node | None] = [None] * SLOTS
        self._counts: dict[Node, str] = {}
        """Each primary's count of marked calls: a key of its highest slot
        (capsvc.redis.marks). The highest: `redis-cli --cluster reshard` moves a primary's
        lowest slots first, and a count whose slot moves away reads as a primary gone
        back (every process restores once)."""
        self._refreshing: asyncio.Task[None] | None = None
        self._hooks: list[Callable[[], None]] = []
        """Run at the end of this turn of the event loop (`before_flush`)."""
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- public ----------------------------------------------------------------------------

    def submit(self, *args: Any) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._route(args, fut, 0)
        return fut

    def submit_partly_declared(self, *args: Any) -> asyncio.Future[Any]:
        """`submit` of a command that reaches keys it does not declare (an FCALL of an
        `allow-cross-slot-keys` function naming keys of several slots of a node in ARGV),
        never sent with ASKING: on the node importing a slot, a key of it not moved yet
        reads as absent, and Redis checks only the declared keys first. An ASK fails it
        (MarkElsewhere): its caller sends its parts, each declaring its keys."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._route(args, fut, 0, declared=False)
        return fut

    def before_flush(self, hook: Callable[[], None]) -> None:
        """Run `hook` once at the end of this turn of the event loop: what it submits goes
        out with each node's next batch."""
        if not self._hooks:
            asyncio.get_running_loop().call_soon(self._run_hooks)
        self._hooks.append(hook)

    def _run_hooks(self) -> None:
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()

    def send(self, *args: Any) -> None:
        fut = self.submit(*args)
        fut.add_done_callback(self._log_background)

    async def call(self, *args: Any) -> Any:
        return await self.submit(*args)

    async def broadcast(self, *args: Any) -> list[Any]:
        """Run a keyless command on every primary; their replies."""
        await self._ensure_map()
        primaries = sorted({n for n in self._slots if n is not None})
        return list(await asyncio.gather(*[self._node(n).submit(*args) for n in primaries]))

    def node_of(self, key: str) -> str | None:
        """The count key of the primary that serves `key` (None: the map is not known
        yet)."""
        node = self._slots[slot_of(key)]
        count = self._counts.get(node) if node is not None else None
        if count is None:
            self._refresh_soon()
        return count

    def by_node(self, items: list[T], key: Callable[[T], str] = str) -> list[list[T]]:
        """`items` (keys, or what `key` gives the key of) grouped by the primary that serves
        their keys, as far as this process's slot map says (those of a slot it knows no
        node of: a group of their own), in order within a group."""
        groups: dict[Node | None, list[T]] = {}
        slots = self._slots
        for item in items:
            groups.setdefault(slots[slot_of(key(item))], []).append(item)
        return list(groups.values())

    async def nodes(self) -> list[str]:
        """Every primary's count key."""
        await self._ensure_map()
        return sorted(self._counts.values())

    async def wait_replicas(self, replicas: int, timeout_ms: int) -> int:
        """WAIT on every primary; the fewest acknowledgements of any of them."""
        await self._ensure_map()  # no suspension once the map is known: same tick as the writes
        primaries = sorted({n for n in self._slots if n is not None})
        waits = []
        for n in primaries:
            node = self._node(n)
            node.fence_key = self._fence_key(n, node.fence_key)
            waits.append(asyncio.shield(node.submit_wait(replicas, timeout_ms)))
        try:
            acks = await asyncio.gather(*waits)
        except ResponseError:  # a fence MOVED: the map is out of date
            self._refresh_soon()
            raise
        return min(int(a) for a in acks)

    def _fence_key(self, node: Node, current: str) -> str:
        """A fence key in a slot `node` serves (the current one while it still does)."""
        if self._slots[slot_of(current)] == node:
            return current
        for i in range(SLOTS * 64):
            key = f"w:{{fence:{i}}}"
            if self._slots[slot_of(key)] == node:
                return key
        return current  # a node without slots gets no WAIT (it is no primary in the map)

    async def aclose(self) -> None:
        self._run_hooks()  # what this turn gathered goes out with the rest
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*[c.aclose() for c in self._nodes.values()])

    # -- routing ---------------------------------------------------------------------------

    def _route(self, args: tuple[Any, ...], fut: asyncio.Future[Any], hops: int,
               node: Node | None = None, asking: bool = False, declared: bool = True
               ) -> None:
        """`declared`: the command declares every key it reaches (else
        `submit_partly_declared`)."""
        if node is None:
            key = key_of(args)
            node = self._slots[slot_of(key)] if key is not None else self._any_node()
            if node is None:  # no slot map yet (or a hole in it): learn it first
                self._later(self._route_after_refresh(args, fut, hops, declared))
                return
        coalescer = self._node(node)
        if asking:
            coalescer.send("ASKING")
        inner = coalescer.submit(*args)
        inner.add_done_callback(lambda done: self._settle(done, args, fut, hops, declared))

    def _settle(self, done: asyncio.Future[Any], args: tuple[Any, ...],
                fut: asyncio.Future[Any], hops: int, declared: bool) -> None:
        # The node's failure is retrieved even when the caller's future is done already
        # (cancelled: its request timed out): else, once collected, asyncio logs it as
        # "Future exception was never retrieved".
        error = None if done.cancelled() else done.exception()
        if fut.done():
            return
        if done.cancelled():
            fut.cancel()
            return
        if error is None:
            result = done.result()
            if not declared and isinstance(result, list) and any(
                    isinstance(r, ResponseError) and NON_LOCAL in str(r) for r in result):
                self._refresh_soon()  # parts of it reached keys another node serves
            fut.set_result(result)
            return
        if isinstance(error, Unavailable) and not isinstance(error, Evicting | OutOfMemory):
            self._refresh_soon()  # the node may be gone (not merely refusing: it answered)
        if isinstance(error, ResponseError) and hops < _MAX_REDIRECTS:
            text = str(error)
            kind = text.split(" ", 1)[0]
            if kind == "ASK" and not declared:  # see submit_partly_declared
                fut.set_exception(MarkElsewhere(f"redis cluster: {text} (names keys it "
                                                "does not declare: not followed)"))
                return
            if kind in ("MOVED", "ASK"):
                _, slot, where = text.split(" ")
                host, _, port = where.rpartition(":")
                target = (host or self._seeds[0][0], int(port))
                if kind == "MOVED":
                    self._slots[int(slot)] = target
                    self._refresh_soon()
                    self._node(target).retry_now()  # it serves the slot: no backoff
                self._route(args, fut, hops + 1, target, asking=kind == "ASK",
                            declared=declared)
                return
            if kind in ("TRYAGAIN", "CLUSTERDOWN"):
                self._later(self._retry(args, fut, hops + 1, declared))
                return
        if isinstance(error, ResponseError) and NON_LOCAL in str(error):
            # A node's count named from an outdated map, or a slot being moved: nothing
            # ran; the caller marks it anew (capsvc.redis.marks).
            self._refresh_soon()
            error = MarkElsewhere(f"redis cluster: {error}")
        if isinstance(error, ResponseError) and str(error).startswith(_REDIRECTED):
            # Still redirected or down after every retry (a failover under way): nothing
            # ran, and the cluster may serve it shortly. Unavailable (503), not a refusal.
            error = Unavailable(f"redis cluster: {error}")
        fut.set_exception(error)

    async def _retry(self, args: tuple[Any, ...], fut: asyncio.Future[Any], hops: int,
                     declared: bool) -> None:
        await asyncio.sleep(min(0.02 * hops, 0.1))
        self._route(args, fut, hops, declared=declared)

    async def _route_after_refresh(self, args: tuple[Any, ...], fut: asyncio.Future[Any],
                                   hops: int, declared: bool) -> None:
        try:
            await self._ensure_map()
        except Unavailable as e:
            if not fut.done():
                fut.set_exception(e)
            return
        key = key_of(args)
        node = self._slots[slot_of(key)] if key is not None else self._any_node()
        if node is None:
            if not fut.done():
                fut.set_exception(Unavailable("no Redis Cluster node serves this slot"))
            return
        self._route(args, fut, hops, node, declared=declared)

    def _any_node(self) -> Node | None:
        return next((n for n in self._slots if n is not None), None)

    def _node(self, node: Node) -> Coalescer:
        coalescer = self._nodes.get(node)
        if coalescer is None:
            auth = f":{self._password}@" if self._password else ""
            coalescer = self._nodes[node] = Coalescer(
                f"redis://{auth}{node[0]}:{node[1]}/0", timeout_s=self._timeout,
                on_batch=self._on_batch, on_error=self._on_error, on_primary=self._on_primary,
                library=self._library, primary_only=False, gate=self._gate)
        return coalescer

    def _later(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    def _log_background(fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("background redis command failed: %s", fut.exception())

    # -- slot map --------------------------------------------------------------------------

    async def _ensure_map(self) -> None:
        if self._any_node() is not None and None not in self._slots:
            return
        await self._refresh()

    def _refresh_soon(self) -> None:
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh_quietly())

    async def _refresh_quietly(self) -> None:
        try:
            await self._refresh()
        except Unavailable as e:
            log.warning("cannot refresh the Redis Cluster slot map: %s", e)

    def _adopt(self, slots: list[Node | None]) -> None:
        """Take a new slot map; a primary gone from it was failed over (or emptied)."""
        before = {n for n in self._slots if n is not None}
        self._slots = slots
        highest: dict[Node, int] = {}
        for slot, n in enumerate(slots):
            if n is not None:
                highest[n] = slot
        self._counts = {n: node_of_slot(slot) for n, slot in highest.items()}
        self._learnt.update(highest)
        after = {n for n in slots if n is not None}
        for new in after - before:  # a promoted replica, a node back: tried at once
            if new in self._nodes:
                self._nodes[new].retry_now()
        for gone in before - after:
            log.warning("redis cluster: %s:%s serves no slot any more", *gone)
            self._on_primary(f"{gone[0]}:{gone[1]}", "switched")
            self._on_primary(f"{gone[0]}:{gone[1]}", "forgotten")
            if self._gate is not None:
                self._gate.forget(f"{gone[0]}:{gone[1]}")
            old = self._nodes.pop(gone, None)
            if old is not None:
                self._later(old.aclose())

    async def _refresh(self) -> None:
        """Ask the known nodes, then the seeds, for CLUSTER SLOTS until one answers."""
        candidates = [*{n for n in self._slots if n is not None}, *self._seeds,
                      *sorted(self._learnt)]
        last: Exception | None = None
        for node in dict.fromkeys(candidates):
            try:
                reply = await self._node(node).call("CLUSTER", "SLOTS")
            except (Unavailable, ResponseError) as e:
                last = e
                continue
            slots: list[Node | None] = [None] * SLOTS
            for start, end, primary, *_ in reply:
                host = primary[0].decode() or node[0]
                for s in range(int(start), int(end) + 1):
                    slots[s] = (host, int(primary[1]))
            self._adopt(slots)
            return
        raise Unavailable(f"no Redis Cluster node answers CLUSTER SLOTS: {last}")


def connect(url: str, *, timeout_s: float, on_batch: BatchObserver = ignore_batch,
            on_error: ErrorObserver = ignore_error, on_primary: PrimaryObserver = ignore_primary,
            library: str | None = None, gate: Gate | None = None
            ) -> Coalescer | ClusterCoalescer:
    """The transport for a Redis URL: one node (found by the sentinels with
    `redis+sentinel://`), or a cluster (`redis+cluster://`). `gate`: holds every command
    to a server whose identity the journal has not been reconciled with."""
    factory: Callable[..., Coalescer | ClusterCoalescer] = (
        ClusterCoalescer if url.startswith("redis+cluster://") else Coalescer)
    return factory(url, timeout_s=timeout_s, on_batch=on_batch, on_error=on_error,
                   on_primary=on_primary, library=library, gate=gate)
