"""The marks: how every call that judges or reports a decision knows, inside Redis and in
the same atomic call, whether Redis went back in time behind this process.

lua/capsvc.lua (MARKS) lays the mark out: per node (standalone, Sentinel) or per slot
(cluster), the count G of marked writes, and per process lifetime the G of its newest
write; on a cluster each primary also counts every marked write it runs, whatever its slot
(N, its node's key: `node_of`). This module is the process's side: which functions are
marked, which mark and node a call carries, what the process last saw of each (`seen`: any
process's writes; `made`: its own; `node_seen`: N), and the stamp each journal record gets
— the G of the calls that made it, collected per request in a context variable — so that a
restore can tell exactly which records a Redis lacks: those stamped above the mark of their
lifetime.

The marked calls a process makes in one turn of its event loop go to each node as one
FCALL of capsvc_calls, in the order made (`Marks.call`, then `_send` at the turn's end, when
the transport flushes): a batch's steps on a cluster — its tickets' claims, then their
grids' reserves, then their decisions — are one call a node a step, however many tickets;
each call in it is judged and counted in its own mark as if sent alone, and fails alone.

A call refused because the mark or its node is behind (`BEHIND`) fails with `Behind` (a
503: nothing ran) and tells `on_behind`, which starts the restore; a call refused while a
process announces a restore (`RESTORING`) fails with `Unavailable`. A call that reached its
mark before writes of this process sent ahead of it (`UNSETTLED`: a slot's move reordered
them, or a rollback in place lost them before their answers were read) is sent again,
marked anew, once their answers are in: a write lost then reads as BEHIND.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any, Protocol

from redis.crc import key_slot
from redis.exceptions import ResponseError

from capsvc.domain.errors import Unavailable, own_copy

MARKED = frozenset({
    "capsvc_claim", "capsvc_ticket", "capsvc_finalize", "capsvc_unclaim", "capsvc_expire",
    "capsvc_cancel", "capsvc_cancelled", "capsvc_reserve", "capsvc_release", "capsvc_stop",
    "capsvc_budget", "capsvc_stake", "capsvc_settle", "capsvc_set_limit", "capsvc_player",
    "capsvc_sell"})
"""The functions that judge or report a decision: lua/capsvc.lua runs them only as calls
carried by capsvc_calls (its MARKED table), each checked and counted in its mark."""

NODE_MARK = "m:{marks}"
"""The one mark of a standalone (or Sentinel-managed) Redis."""

NodeOf = Callable[[str], "str | None"]
"""The count key of the cluster primary that serves a key ("" on one Redis, whose one mark
is the node's; None: not known yet, the cluster's slot map is being learnt)."""

stamp: ContextVar[dict[str, int] | None] = ContextVar("capsvc_stamp", default=None)
"""The G of the marked calls of the current request, by mark (see `Marks.begin`)."""


class Behind(Unavailable):
    """Redis refused a call: its mark is behind what this process saw (it lost writes).
    Nothing of the call ran."""


class Unsettled(Unavailable):
    """Redis refused a call: its mark counts fewer writes of this process than were sent
    ahead of it and not seen to fail. Nothing ran."""


NON_LOCAL = "non local key"
"""Redis's refusal of a script that reached a key another node serves: a marked call whose
node's count was named from an outdated slot map."""


class MarkElsewhere(Unavailable):
    """Redis refused a call: its node's count is on another node than the call's keys (a
    cluster whose slot map changed: a slot moving, a node's highest slot moved). Nothing
    ran."""


MOVE_TRIES = 16
"""How many times a call refused with MarkElsewhere or Unsettled is sent again, after 20 ms,
40 ms, … up to 100 ms (~1.3 s in all: a slot's move, or the slot map learnt again)."""


class Joining(Protocol):
    """What the marks send their calls through (capsvc.redis.transport's `Transport`)."""

    def submit_partly_declared(self, *args: Any) -> asyncio.Future[Any]: ...

    def before_flush(self, hook: Callable[[], None]) -> None: ...


class _Call:
    """A marked call and what its answer is for, kept until it has been answered."""

    __slots__ = ("args", "decode", "keys", "name", "out", "redis", "stamps", "tries")

    def __init__(self, redis: Joining, name: str, keys: list[str], args: list[Any],
                 decode: Callable[[Any], Any] | None,
                 stamps: Sequence[dict[str, int] | None], out: asyncio.Future[Any]) -> None:
        self.redis = redis
        self.name = name
        self.keys = keys
        self.args = args
        self.decode = decode
        self.stamps = stamps
        self.out = out
        self.tries = 0
        """How many times it was sent again (MOVE_TRIES)."""


class Restoring(Unavailable):
    """Redis refused a call: a process announces a restore of its journal. Nothing of the
    call ran."""


@functools.cache
def slot_tags() -> tuple[str, ...]:
    """For each cluster slot, a hash tag that hashes to it."""
    tags: list[str | None] = [None] * 16384
    left, i = 16384, 0
    while left:
        tag = str(i)
        slot = key_slot(tag.encode())
        if tags[slot] is None:
            tags[slot] = tag
            left -= 1
        i += 1
    return tuple(t for t in tags if t is not None)


def restore_counter(token: str) -> str:
    """The field of the marks a restore's writes count themselves in."""
    return f"%{token}"


def mark_of_slot(slot: int) -> str:
    return f"m:{{{slot_tags()[slot]}}}"


def node_of_slot(slot: int) -> str:
    """The count key of the cluster primary whose highest slot is `slot`."""
    return f"n:{{{slot_tags()[slot]}}}"


def one_node(key: str) -> str:
    """One Redis: no count apart from its one mark."""
    return ""


class Marks:
    """This process's side of the marks (see the module's docstring)."""

    def __init__(self, life: str, *, single_node: bool, node_of: NodeOf = one_node,
                 on_behind: Callable[[str, str], None] | None = None) -> None:
        self.life = life
        """The process lifetime (capsvc.journal.writer's `Journal.life`); "" for a tool,
        whose calls are neither checked nor counted."""
        self.counter = life if life.startswith("%") else ""
        """The field a restore's writes count themselves in ("" for other marks)."""
        self.checked = bool(life) and not self.counter
        """Whether Redis checks this process's calls against its mark (a tool's and a
        restore's it does not: their writes are not numbered)."""
        self.single_node = single_node
        self.node_of = node_of
        """The node's count a call carries too (the cluster transport's `node_of`)."""
        self.seen: dict[str, int] = {}
        """Per mark, the highest G this process has seen there."""
        self.made: dict[str, int] = {}
        """Per mark, the G of this process's newest write there."""
        self.sent: dict[str, int] = {}
        """Per mark, the number of this process's newest write sent there (its writes
        through a mark are numbered 1, 2, 3, … as they are sent)."""
        self.written: dict[str, int] = {}
        """A restore's: per mark, how many of its writes were sent there and not seen to
        fail, which its end checks Redis holds (capsvc.recovery.reconciler)."""
        self.expected: dict[str, dict[int, None]] = {}
        """Per mark, the numbers of this process's writes sent there whose answer has not
        been read yet, in the order sent (the newest last)."""
        self.answered: dict[str, int] = {}
        """Per mark, the number of this process's newest write answered there. The newest
        of these and of `expected` is what a call sent next expects to have run before it
        (lua/capsvc.lua, MARKS: UNSETTLED); a write that failed, run or not, is not."""
        self.node_seen: dict[str, int] = {}
        """Per node (a cluster primary's count key), the highest N this process has seen."""
        self.on_behind = on_behind or (lambda mark, found: None)
        self._joining: dict[Joining, dict[str, list[_Call]]] = {}
        """The marked calls queued in this turn of the event loop, by transport and node."""

    @classmethod
    def tool(cls, single_node: bool) -> Marks:
        """Marks for a tool (an audit, `capsvc journal restore`): calls go unchecked and
        uncounted."""
        return cls("", single_node=single_node)

    @classmethod
    def restoring(cls, token: str, single_node: bool) -> Marks:
        """Marks for a process's restore (capsvc.recovery.reconciler): its calls go
        unchecked, and each counts itself in its mark's field `counter` (lua/capsvc.lua,
        MARKS), its bulk calls too (capsvc.redis.store); `written` has how many went through
        each mark, which the restore's end checks Redis holds, every one."""
        return cls(restore_counter(token), single_node=single_node)

    def mark_of(self, key: str) -> str:
        """The mark a call whose first key is `key` carries (in that key's slot)."""
        if self.single_node:
            return NODE_MARK
        return mark_of_slot(key_slot(key.encode()))

    def call(self, redis: Joining, name: str, keys: list[str], args: list[Any],
             decode: Callable[[Any], Any] | None = None,
             stamps: Sequence[dict[str, int] | None] | None = None, at_once: bool = False
             ) -> asyncio.Future[Any]:
        """Queue a marked call of function `name` to go, at the end of this turn of the
        event loop, with every other marked call of that turn to the same node, in one FCALL
        of capsvc_calls (lua/capsvc.lua): the mark as its last key, what this process saw of
        it, and of the node's count, with them. The future answers the function's own reply,
        decoded by `decode` if given (capsvc.redis.replies). `stamps`: the requests the call
        acts for (default: the current one), whose stamps get its G. `at_once`: the node's
        calls queued so far, this one last, go now (Redis starts on a full call while the
        turn prepares the next). A call that reached a node its node's count is not on
        (`MarkElsewhere`: a cluster's slot moving, nothing ran) is sent again, marked anew,
        for as long as a slot's move takes (MOVE_TRIES), and so is one that reached its mark
        ahead of writes sent before it (`Unsettled`)."""
        out: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue(_Call(redis, name, keys, args, decode,
                          (stamp.get(),) if stamps is None else stamps, out), at_once)
        return out

    def _queue(self, c: _Call, at_once: bool = False) -> None:
        if c.out.done():  # its request gave up meanwhile
            return
        node = self.node_of(c.keys[0])
        if node is None:  # a cluster whose slot map is not known yet: nothing sent
            self._again(c, Unavailable("the Redis Cluster's slot map is not known yet"))
            return
        joining = self._joining.get(c.redis)
        if joining is None:
            joining = self._joining[c.redis] = {}
            c.redis.before_flush(functools.partial(self._send_joined, c.redis))
        joining.setdefault(node, []).append(c)
        if at_once:
            self._send(c.redis, node, joining.pop(node))

    def _send_joined(self, redis: Joining) -> None:
        """The turn's marked calls through `redis`, one FCALL a node."""
        for node, calls in self._joining.pop(redis, {}).items():
            self._send(redis, node, calls)

    def _send(self, redis: Joining, node: str, calls: list[_Call]) -> None:
        """`calls` (of one node, in the order queued) numbered through their marks and sent
        as one FCALL of capsvc_calls."""
        args: list[Any] = [node, self.life, self.node_seen.get(node, 0)]
        sent: list[tuple[str, int, _Call]] = []
        for c in calls:
            if c.out.done():
                continue
            mark = self.mark_of(c.keys[0])
            q = self.sent.get(mark, 0) + 1
            expected = self.expected.setdefault(mark, {})
            lo = max(self.answered.get(mark, 0), next(reversed(expected), 0))
            args += (c.name, len(c.keys) + 1, *c.keys, mark, len(c.args), *c.args,
                     f"{self.seen.get(mark, 0)}:{self.made.get(mark, 0)}:{lo}:{q}")
            if self.checked:
                self.sent[mark] = q
                expected[q] = None
            elif self.counter:
                self.written[mark] = self.written.get(mark, 0) + 1
            sent.append((mark, q, c))
        if sent:
            reply = redis.submit_partly_declared("FCALL", "capsvc_calls", 1,
                                                 sent[0][2].keys[0], *args)
            reply.add_done_callback(functools.partial(self._unwrap, node, sent))

    def _again(self, c: _Call, error: BaseException) -> None:
        """`c` sent again shortly (the slot map is being learnt), or failed with `error`."""
        if c.tries >= MOVE_TRIES:
            if not c.out.done():
                c.out.set_exception(error)
            return
        c.tries += 1
        asyncio.get_running_loop().call_later(min(0.02 * c.tries, 0.1), self._queue, c)

    def _unwrap(self, node: str, sent: list[tuple[str, int, _Call]],
                reply: asyncio.Future[Any]) -> None:
        for mark, q, _ in sent:  # answered, failed or given up: no later call expects them
            self.expected[mark].pop(q, None)
        if reply.cancelled():
            for mark, _, c in sent:
                self._unwritten(mark)
                c.out.cancel()
            return
        error = reply.exception()  # retrieved even when nobody waits for the calls any more
        if error is not None:
            for mark, q, c in sent:
                self._failed(mark, node, q, c, own_copy(error))
            return
        n, *replies = reply.result()
        if n and n > self.node_seen.get(node, 0):
            self.node_seen[node] = n
        for (mark, q, c), one in zip(sent, replies, strict=True):
            if isinstance(one, ResponseError):
                self._failed(mark, node, q, c, MarkElsewhere(f"redis cluster: {one}")
                             if NON_LOCAL in str(one) else one)
            else:
                self._answered(mark, q, c, one)

    def _failed(self, mark: str, node: str, q: int, c: _Call, error: BaseException) -> None:
        """A call refused, or its fate unknown (a lost connection, a timeout): no later call
        expects it (one that ran left its number in Redis, which no check minds: a number
        above lo was written by a call that found lo there)."""
        self._unwritten(mark)
        if isinstance(error, ResponseError) and str(error).startswith("UNSETTLED"):
            error = Unsettled("calls of this process sent before this one have not run in "
                              "Redis yet (a slot moving, a connection stalled): nothing ran")
        if isinstance(error, MarkElsewhere | Unsettled):
            self._again(c, error)
        elif not c.out.done():
            c.out.set_exception(self._refusal(mark, node, error))

    def _unwritten(self, mark: str) -> None:
        """A restore's write through `mark` that failed or was given up: not one of those
        its end checks Redis holds."""
        if self.counter:
            self.written[mark] -= 1

    def _answered(self, mark: str, q: int, c: _Call, reply: list[Any]) -> None:
        if q > self.answered.get(mark, 0):
            self.answered[mark] = q
        g, *rest = reply
        if g:
            if g > self.seen.get(mark, 0):
                self.seen[mark] = g
            if g > self.made.get(mark, 0):
                self.made[mark] = g
            for stamped in c.stamps:
                if stamped is not None and g > stamped.get(mark, 0):
                    stamped[mark] = g
        out = c.out
        if out.done():
            return
        result = rest[0] if rest else None
        if c.decode is None:
            out.set_result(result)
            return
        try:
            out.set_result(c.decode(result))
        except Exception as e:  # a reply of another layout: the library is not this one
            out.set_exception(e)

    def _refusal(self, mark: str, node: str, error: BaseException) -> BaseException:
        if not isinstance(error, ResponseError):
            return error
        text = str(error)
        if text.startswith("BEHIND node "):
            self.on_behind(node, text.removeprefix("BEHIND node "))
        elif text.startswith("BEHIND"):
            self.on_behind(mark, text.partition(" ")[2])
        if text.startswith("BEHIND"):
            return Behind("Redis has lost decisions this process answered (it went back "
                          "in time): they are being put back from the journal; nothing is "
                          "judged meanwhile")
        if text.startswith("RESTORING"):
            return Restoring("a capsvc process is putting its journal back into Redis: "
                             "nothing is judged meanwhile")
        return error

    def saw(self, mark: str, g: int) -> None:
        """The watch read G on `mark`."""
        if g > self.seen.get(mark, 0):
            self.seen[mark] = g

    def saw_node(self, node: str, n: int) -> None:
        """The watch read N on `node`."""
        if n > self.node_seen.get(node, 0):
            self.node_seen[node] = n

    @staticmethod
    def begin() -> dict[str, int]:
        """A request starts: its calls' G are collected from here on (read by the journal's
        records, `current`)."""
        d: dict[str, int] = {}
        stamp.set(d)
        return d

    @staticmethod
    def current() -> dict[str, int] | None:
        """The G of the current request's marked calls so far (a copy), None outside one."""
        d = stamp.get()
        return dict(d) if d is not None else None
