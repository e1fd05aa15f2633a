"""The Redis store: key names, the Lua steps, and what their replies mean.

The only module that knows how capsvc's state is laid out in Redis (lua/capsvc.lua's header
is where the layout is written down: keys, buckets, sale ids, ticket states, records).
Every key carries a hash tag, so the store works unchanged on Redis Cluster: every draw of
a combination shares a slot (its bucket), as do a ticket record and its pending index.
Every step that decides something reads Redis TIME inside its function.

Calls go through a transport (`Coalescer`, or `ClusterCoalescer` per node): `submit`
queues a command into the current tick's pipeline and returns a future, so a caller can
issue several independent steps and await them together without an extra round trip.
Every call that judges or reports a decision also names its slot's mark, and on a cluster
its primary's count (capsvc.redis.marks; `node_of`, `nodes`): on a cluster, while a slot is
being migrated, such a call names a key that exists (the mark, once moved) beside keys that
may not yet, and Redis answers TRYAGAIN until the slot has moved (the transport retries,
capsvc.redis.cluster): a sale on a migrating slot waits for the end of that slot's
migration.
"""

from __future__ import annotations

import asyncio
import functools
import os
import struct
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from operator import itemgetter
from typing import Any, Literal, TypeVar

import msgspec
from redis.exceptions import ResponseError

from capsvc.domain.decisions import Reserved
from capsvc.domain.errors import own_copy
from capsvc.redis.cluster import ClusterCoalescer
from capsvc.redis.marks import MARKED, NODE_MARK, MarkElsewhere, Marks, one_node, stamp
from capsvc.redis.replies import (
    Budget,
    Cancelling,
    Claim,
    Due,
    MarkState,
    NotCancelled,
    PlayerLimits,
    Released,
    Sold,
    TicketRecord,
    budget_of,
    cancel_of,
    claim_of,
    due_of,
    limit_set_of,
    limits_of,
    mark_state_of,
    released_of,
    reserved_of,
    sale_of,
    ticket_of,
)
from capsvc.redis.transport import Coalescer, Transport

T = TypeVar("T")

LIBRARY = "capsvc"
RECORD_VALUE_BYTES = 256
"""The `hash-max-listpack-value` under which a bucket of ticket records (records of ~90 to
~170 bytes) stays a listpack: ~300 bytes of Redis memory a ticket at 100,000, everything a
sale leaves, against ~345 with Redis's default of 64, under which every bucket is a hash
table (bench/memory.py)."""
SALES_PER_CALL = 64
"""Sales judged by one call of capsvc_sell at most: Redis runs nothing else meanwhile
(~1 ms for 64 one-grid sales)."""
TICKET_BUCKETS = 64
"""Ticket records are spread over this many hash tags, each with its own pending index."""
RECORD_BUCKETS = 256
"""Hashes per ticket slot that ticket records are spread over (see lua/capsvc.lua, TICKET
RECORDS): part of the layout, never to be changed while records are retained."""
COUNTER_BUCKETS = 4096
"""Buckets per game and draw that combinations are hashed to (see lua/capsvc.lua: part of
the layout, never to be changed while a draw is on sale or retained)."""


_random: list[bytes] = []
os.register_at_fork(after_in_child=_random.clear)  # a worker never reuses its parent's


def nonce() -> bytes:
    """8 random bytes for a claim or a sale (lua/capsvc.lua, SALES), taken from a buffer
    filled from os.urandom 4 KiB at a time: a getrandom() call per sale cost ~5 µs."""
    if not _random:
        data = os.urandom(4096)
        _random.extend(data[at:at + 8] for at in range(0, 4096, 8))
    return _random.pop()


def lua_source() -> str:
    return resources.files("capsvc.lua").joinpath("capsvc.lua").read_text("utf-8")


def _record_bucket(tag: str, h: int) -> str:
    """The record bucket, in slot `tag`, of the ticket whose `<channel>/<ticket id>` hashes
    to `h`: chosen by the bits of the hash after those that chose the slot."""
    return f"r:{tag}:{(h // TICKET_BUCKETS) % RECORD_BUCKETS}"


def ticket_names(channel: str, ticket_id: str) -> tuple[str, tuple[str, str]]:
    """A ticket's name, and its record's bucket and field there (`record_of`), from one
    hash of `<channel>/<ticket id>`: its slot, then its bucket in the slot."""
    ident = f"{channel}/{ticket_id}"
    h = zlib.crc32(ident.encode())
    tag = f"{{t:{h % TICKET_BUCKETS}}}"
    return f"t:{tag}:{ident}", (_record_bucket(tag, h), ident)


def ticket_key(channel: str, ticket_id: str) -> str:
    return ticket_names(channel, ticket_id)[0]


def record_of(ticket: str) -> tuple[str, str]:
    """The hash that holds ticket `ticket`'s record, in the ticket's slot, and its field
    there (`ticket_names`)."""
    end = ticket.index("}") + 1
    ident = ticket[end + 1:]
    return _record_bucket(ticket[2:end], zlib.crc32(ident.encode())), ident


def record_bucket_of(ticket: str) -> str:
    """The hash that holds ticket `ticket`'s record (`record_of`)."""
    return record_of(ticket)[0]


def ticket_in(bucket: str, field: str) -> str:
    """The name of the ticket whose record is `field` of record bucket `bucket`."""
    return f"t:{bucket[2:bucket.index('}') + 1]}:{field}"


_encode = msgspec.msgpack.Encoder().encode
_decode_entry = msgspec.msgpack.Decoder(tuple[int, list[tuple[str, str, bytes]]]).decode
"""An entry of the unjournaled sales (lua/capsvc.lua, THE KEYS): its call's instant, and the
record bucket, field and sale id's bytes of each of its sales."""


def record_bucket(slot: int, bucket: int) -> str:
    """Record bucket `bucket` of ticket slot `slot`."""
    return f"r:{{t:{slot}}}:{bucket}"


def ident_of(ticket: str) -> str:
    """`<channel>/<ticket id>` of a ticket's name: its field in a bucket."""
    return ticket[ticket.index("}:") + 2:]


def channel_of(ticket: str) -> str:
    """The channel of a ticket's name."""
    return ticket[ticket.index("}:") + 2 :].rsplit("/", 1)[0]


def pending_key_of(ticket: str) -> str:
    """The pending index in the same slot as the ticket record `ticket`."""
    return "p:" + ticket[2 : ticket.index("}") + 1]


def counter_key(game: str, bucket: int, draw: int) -> str:
    """One counter bucket of a draw (see lua/capsvc.lua, THE KEYS)."""
    return f"c:{{{game}:{bucket}}}:{draw}"


def aggregate_key(ticket: str, game: str, draw: int) -> str:
    """What the tickets of `ticket`'s slot accepted on a draw, by number of picks (the
    draw's exposure adds the 64 slots up)."""
    return f"a:{ticket[2 : ticket.index('}') + 1]}:{game}:{draw}"


def aggregate_keys(game: str, draw: int) -> list[str]:
    """A draw's aggregates, one per ticket slot."""
    return [f"a:{{t:{b}}}:{game}:{draw}" for b in range(TICKET_BUCKETS)]


UNJOURNALED = "q:{sales}"
"""The unjournaled sales of the calls of `sell` (lua/capsvc.lua, THE KEYS)."""
HALTS = "h:{sales}"
"""The requests a call of `sell` stopped judging, for the calls after it (lua/capsvc.lua,
THE KEYS)."""


def pending_key(bucket: int) -> str:
    return f"p:{{t:{bucket}}}"


def bucket_keys(game: str, combo: str, first_draw: int, draws: int) -> list[str]:
    """The counter buckets holding `combo` on draws first_draw..first_draw+draws-1."""
    bucket = zlib.crc32(combo.encode()) % COUNTER_BUCKETS
    return [counter_key(game, bucket, d) for d in range(first_draw, first_draw + draws)]


RELEASED_RECORD = b"X"
"""A grid's record once its stake was given back (a cancel's release) or once it was sealed
before it was decided (lua/capsvc.lua, RECORDS)."""


def record_field(sale_id: str, grid: int) -> bytes:
    """The field of one grid's record: a zero byte (no combination has one), the sale id's
    8 bytes, the grid index."""
    return b"\0" + bytes.fromhex(sale_id) + bytes((grid,))


def stops_key(game: str) -> str:
    return f"s:{{{game}}}"


def stop_copy_key(bucket: int) -> str:
    """The copy of the admin stops in one ticket slot (see `Store.stop`)."""
    return f"s:{{t:{bucket}}}"


def stop_copy_of(ticket: str) -> str:
    return "s:" + ticket[2 : ticket.index("}") + 1]


def capped_key(game: str, draw: int) -> str:
    return f"x:{{{game}}}:{draw}"


def cap_key(game: str, draw: int) -> str:
    """The cap in force for a draw, fixed by its first sale (same slot as the stops)."""
    return f"k:{{{game}}}:{draw}"


def feed_key(game: str) -> str:
    """The game's event stream (the live sold-out feed; same slot as the sold-out lists)."""
    return f"f:{{{game}}}"


def feed_closes_key(game: str) -> str:
    """The draws whose close the feed has announced (draw -> expiry)."""
    return f"e:{{{game}}}"


def record_names(ticket: str) -> tuple[list[str], list[Any]]:
    """The KEYS and ARGV that name ticket `ticket`'s record in a call of one of its
    functions, before the call's own: its bucket, and its field in it (lua/capsvc.lua,
    TICKET RECORDS)."""
    bucket, field = record_of(ticket)
    return [bucket], [field]


def stop_instants(replies: list[Any]) -> list[int | None]:
    """The instants (ms) sales stopped from HMGET replies of the stops hash."""
    return [None if r is None else int(r.split(b":", 1)[0]) for r in replies]


Shape = tuple[tuple[Any, ...], list[str], list[Any], list[int]]
"""What the sales of one game on the same draws share in a call of capsvc_sell (`shape`):
what identifies it, its KEYS and its ARGV, and the caps of its draws that a sale is judged
by when the call does not fix them."""


class SaleCall(msgspec.Struct):
    """One sale's part of a call of capsvc_sell (`sale_call`)."""

    shape: Shape
    keys: list[str]
    args: list[Any]
    grids: int
    tag: int
    nonce: bytes
    """Its sale id's bytes."""


@dataclass(slots=True)
class _QueuedSales:
    """Sales waiting for the end of the tick: their KEYS and ARGV, their replies' one
    future, the stamps of the requests they are for (capsvc.redis.marks)."""

    calls: list[SaleCall]
    out: asyncio.Future[list[Claim]]
    stamps: Sequence[dict[str, int] | None]
    continues: bool
    """Some of `calls` belong to a request an earlier call carried sales of."""


_Entry = tuple[str, str, str, bytes]
"""A ticket's entry in its pending index to let go: the index, the ticket, the sale id and
the state journaled (`Store.journaled`)."""


class Unjournaled:
    """A call's entry of the unjournaled sales (lua/capsvc.lua, `sell`): deleted once
    each of the sales it made has been journaled (`Store.journaled_sale`)."""

    __slots__ = ("field", "left")

    def __init__(self, field: str) -> None:
        self.field = field
        self.left = 0


def _answer_sales(groups: list[_QueuedSales], entry: Unjournaled,
                  call: asyncio.Future[Any]) -> None:
    """Each group of a call its replies (or the call's failure); each sale made carries
    the call's entry of the unjournaled sales."""
    if call.cancelled():
        for group in groups:
            group.out.cancel()
        return
    error = call.exception()
    now, replies = 0, []
    if error is None:
        try:
            now, *replies = call.result()
        except (TypeError, ValueError) as e:  # a reply of another layout: another library
            error = e  # its sales, if any, stay in its entry for the janitor
    at = 0
    for group in groups:
        n = len(group.calls)
        out = group.out
        if error is not None:
            if not out.done():
                out.set_exception(own_copy(error))
            continue
        try:
            claims = [sale_of(r, now, c.nonce.hex(), c.shape[3], entry)
                      for r, c in zip(replies[at:at + n], group.calls, strict=True)]
        except Exception as e:  # a reply of another layout: the library is not this one
            entry.left += n  # none reported journaled: the entry stays for the janitor
            if not out.done():
                out.set_exception(e)
            continue
        finally:
            at += n
        # Every sale made counts, a group nobody waits for any more too (its request gave
        # up): its sales are never reported journaled, so the entry stays for the janitor.
        entry.left += sum(1 for c in claims if isinstance(c, Sold))
        if not out.done():
            out.set_result(claims)


class Store:
    """capsvc's operations on Redis, each one atomic step (a Lua function) or one read."""

    def __init__(self, redis: Transport) -> None:
        self.redis = redis
        self._source = lua_source()
        self.single_node = isinstance(redis, Coalescer)
        """Every key on one Redis (not a cluster): a sale may be one multi-key call."""
        self._sales: list[_QueuedSales] = []
        """Sales to send at the end of this tick, in one call (`sell`)."""
        self._queued = 0
        """How many sales `_sales` holds."""
        self._journaled: list[_Entry] = []
        """Index entries to let go at the end of this tick (`journaled_later`)."""
        self.node_of = redis.node_of if isinstance(redis, ClusterCoalescer) else one_node
        """The count key of the cluster primary that serves a key (capsvc.redis.marks)."""
        self.marks = Marks.tool(self.single_node)
        """The marks the calls that judge or report a decision carry (capsvc.redis.marks): a
        tool's until the service gives the store its own."""

    async def load_library(self) -> None:
        """Install (or replace) the Lua library on every primary; idempotent, safe from
        every process."""
        await self.redis.broadcast("FUNCTION", "LOAD", "REPLACE", self._source)

    async def library_loaded(self) -> bool:
        replies = await self.redis.broadcast("FUNCTION", "LIST", "LIBRARYNAME", LIBRARY)
        return all(bool(r) for r in replies)

    async def record_limits(self) -> str | None:
        """Why ticket records will not be kept compact on this Redis (its hash limits, or
        that they cannot be read), in plain words; None when they will."""
        need = (f"ticket records stay compact (~300 bytes of Redis memory a ticket, ~345 "
                f"otherwise) when hash-max-listpack-value is at least {RECORD_VALUE_BYTES}, "
                "as in deploy/redis.conf")
        try:
            replies = await self.redis.broadcast("CONFIG", "GET", "hash-max-listpack-value")
        except ResponseError as e:
            return f"cannot read Redis's hash-max-listpack-value (CONFIG GET: {e}); {need}"
        values = [int(r[1]) for r in replies if r]
        if values and min(values) < RECORD_VALUE_BYTES:
            return (f"Redis has hash-max-listpack-value {min(values)}: {need}; size Redis "
                    "for ~345 bytes a ticket retained, or raise the setting")
        return None

    def names(self, ticket: str) -> tuple[list[str], list[Any]]:
        """The KEYS and ARGV that name ticket `ticket`'s record in a call, before the call's
        own (see record_names)."""
        return record_names(ticket)

    def fcall(self, name: str, keys: list[str], args: list[Any],
              decode: Callable[[Any], Any] | None = None, declared: bool = True
              ) -> asyncio.Future[Any]:
        """Queue one FCALL (the transport reloads the library if Redis lost it); a function
        that judges or reports a decision carries its mark (capsvc.redis.marks). `decode`:
        the reply's type (capsvc.redis.replies), applied where the reply is read.
        `declared` False: the call names in ARGV keys it does not declare
        (`Transport.submit_partly_declared`)."""
        if name in MARKED:
            return self.marks.call(self.redis, name, keys, args, decode)
        submit = self.redis.submit if declared else self.redis.submit_partly_declared
        call = submit("FCALL", name, len(keys), *keys, *args)
        return call if decode is None else decoded(call, decode)

    def mark_state(self, mark: str, lives: list[str]) -> asyncio.Future[MarkState]:
        """`mark` as it stands, with the G of each of `lives` (capsvc_marks_of, read
        only)."""
        return decoded(self.mark_call("capsvc_marks_of", mark, [len(lives), *lives]),
                       lambda reply: mark_state_of(reply[0]))

    def mark_states(self, marks: list[str], lives: list[str]
                    ) -> asyncio.Future[list[MarkState]]:
        """`mark_state` of each of `marks`, in order: one read a node (capsvc_marks_of), sent
        at once, the marks after the first undeclared (never sent with ASKING: on a node
        importing two slots, the other's mark not moved yet would read as absent, a mark
        gone back); the marks of a node whose read fails (its slots moved) read one by
        one."""
        groups = (self.redis.by_node(marks) if isinstance(self.redis, ClusterCoalescer)
                  else [marks])
        reads = [(group, self.redis.submit_partly_declared(
                     "FCALL", "capsvc_marks_of", 1, group[0], len(lives), *lives, *group[1:]))
                 for group in groups if group]
        return asyncio.ensure_future(self._mark_states(marks, lives, reads))

    async def _mark_states(self, marks: list[str], lives: list[str],
                           reads: list[tuple[list[str], asyncio.Future[Any]]]
                           ) -> list[MarkState]:
        await asyncio.gather(*[read for _, read in reads], return_exceptions=True)
        found: dict[str, MarkState] = {}
        for group, read in reads:  # every read's failure retrieved, the first one raised
            try:
                states = list(map(mark_state_of, read.result()))
            except (MarkElsewhere, ResponseError):  # a mark the node does not serve: each alone
                states = await asyncio.gather(*[self.mark_state(mark, lives) for mark in group])
            found.update(zip(group, states, strict=True))
        return [found[mark] for mark in marks]

    async def nodes(self) -> list[str]:
        """What counts every node's marked calls: the standalone Redis's mark, or each
        cluster primary's count key."""
        if isinstance(self.redis, ClusterCoalescer):
            return await self.redis.nodes()
        return [NODE_MARK]

    def mark_call(self, name: str, mark: str, args: list[Any]) -> asyncio.Future[Any]:
        """One of the marks' own functions (lua/capsvc.lua, MARKS) on `mark`."""
        return self.redis.submit("FCALL", name, 1, mark, *args)

    async def time_ms(self) -> int:
        """Redis TIME, in ms since the Unix epoch."""
        sec, usec = await self.redis.submit("TIME")
        return int(sec) * 1000 + int(usec) // 1000

    # -- tickets ---------------------------------------------------------------------------

    def claim(self, ticket: str, sale: bytes, close_ms: int, expire_at: int,
              stale_after_ms: int) -> asyncio.Future[Claim]:
        """The steps' first call: the ticket indexed for the janitor and claimed, in one
        atomic call (lua/capsvc.lua, claim)."""
        keys, args = self.names(ticket)
        return self.fcall("capsvc_claim", [*keys, pending_key_of(ticket)], [
            *args, sale, close_ms, expire_at, stale_after_ms, nonce().hex()], decode=claim_of)

    async def finalize(self, ticket: str, sale_id: str, body: bytes) -> bool:
        """Write the decision of a sale. False when the ticket is no longer that sale's
        pending claim (decided or forgotten by another actor). Its index entry stays until
        the decision is journaled (`journaled`)."""
        keys, args = self.names(ticket)
        return bool(await self.fcall("capsvc_finalize", keys, [*args, sale_id, body]))

    def journaled(self, ticket: str, sale_id: str, state: bytes) -> asyncio.Future[Any]:
        """The decision of sale `sale_id` in `state` (b"f" sold, b"c" cancelled, b"" voided:
        the ticket forgotten) is in the journal: the ticket's index entry goes, unless the
        ticket has moved on since (the janitor journals a decision whose entry is still
        there past the deadline). A request need not wait for it: an entry left by a
        failure only makes the janitor journal the decision again."""
        return self._release([(pending_key_of(ticket), ticket, sale_id, state)])

    def journaled_later(self, ticket: str, sale_id: str, state: bytes) -> None:
        """`journaled`, sent with the others of this tick: the decisions of one batch of
        the journal become durable together, and their entries go in one call a node
        (capsvc_journaled_many) rather than one each. Nobody waits for it (see
        `journaled`)."""
        batch = self._journaled
        if not batch:
            asyncio.get_running_loop().call_soon(self._send_journaled)
        batch.append((pending_key_of(ticket), ticket, sale_id, state))

    def _send_journaled(self) -> None:
        entries, self._journaled = self._journaled, []
        if isinstance(self.redis, ClusterCoalescer):
            groups = self.redis.by_node(entries, itemgetter(0))
        else:
            groups = [entries]
        for group in groups:
            for i in range(0, len(group), JOURNALED_PER_CALL):
                part = group[i:i + JOURNALED_PER_CALL]
                self._release(part).add_done_callback(
                    functools.partial(self._release_apart, part))

    def _release(self, entries: list[_Entry]) -> asyncio.Future[Any]:
        """One capsvc_journaled_many of `entries` (tickets of one node). Those of one
        pending index (one slot) declare every key they name, so that Redis checks them
        all while their slot moves (TRYAGAIN until it has); those of several are routed by
        the first one's index and declare only it (`submit_partly_declared`)."""
        args: list[Any] = []
        buckets: list[str] = []
        first = entries[0][0]
        one_index = True
        for index, ticket, sale_id, state in entries:
            bucket = record_bucket_of(ticket)
            args += (index, bucket, ident_of(ticket), sale_id, state)
            buckets.append(bucket)
            one_index = one_index and index == first
        if one_index:
            return self.fcall("capsvc_journaled_many", [first, *buckets], args)
        return self.fcall("capsvc_journaled_many", [first], args, declared=False)

    def _release_apart(self, entries: list[_Entry], call: asyncio.Future[Any]) -> None:
        """A node's release refused (a slot of it moved: "non local key", nothing removed):
        each index's entries on their own, routed to its slot's node. Whatever fails then
        is left to the janitor, which journals the decisions again (a call whose outcome
        is unknown, a node down or slow, too)."""
        if call.cancelled() or not isinstance(call.exception(), MarkElsewhere | ResponseError):
            return
        indexes: dict[str, list[_Entry]] = {}
        for entry in entries:
            indexes.setdefault(entry[0], []).append(entry)
        if len(indexes) > 1:
            for part in indexes.values():
                retrieving(self._release(part))

    async def unclaim(self, ticket: str, sale_id: str) -> None:
        """Forget the pending claim of `sale_id` (what it took given back, its void
        journaled), and its index entry."""
        keys, args = self.names(ticket)
        await self.fcall("capsvc_unclaim", keys, [*args, sale_id])
        await self.journaled(ticket, sale_id, b"")

    async def unindex(self, ticket: str) -> None:
        await self.redis.submit("ZREM", pending_key_of(ticket), ticket)

    def expire(self, ticket: str, deadline_ms: int) -> asyncio.Future[Due | Literal[False] | None]:
        """What the janitor is to settle of a ticket (capsvc.redis.replies.due_of)."""
        keys, args = self.names(ticket)
        return self.fcall("capsvc_expire", keys, [*args, deadline_ms], decode=due_of)

    def cancel(self, ticket: str, close_ms: int, game: str, first_draw: int, released: int,
               expire_at: int) -> asyncio.Future[Cancelling | NotCancelled]:
        """Decide a cancellation (indexing the ticket with it, for the janitor)."""
        keys, args = self.names(ticket)
        return self.fcall(
            "capsvc_cancel", [*keys, stop_copy_of(ticket), pending_key_of(ticket)],
            [*args, close_ms, f"{game}:{first_draw}", released, expire_at], decode=cancel_of)

    async def cancelled(self, ticket: str, sale_id: str,
                        aggregates: tuple[list[str], list[Any]] | None = None) -> None:
        """Mark a cancel complete; `aggregates` (a ticket sold in one call): its draws'
        aggregate keys and the picks, stake pairs to take out of them."""
        keys, args = self.names(ticket)
        aggregate_keys_, amounts = aggregates or ([], [])
        await self.fcall("capsvc_cancelled", [*keys, *aggregate_keys_],
                         [*args, sale_id, *amounts])

    def ticket(self, ticket: str) -> asyncio.Future[TicketRecord | None]:
        """A ticket id's record (None when unknown; a one-call sale has results, not a
        body)."""
        keys, args = self.names(ticket)
        return self.fcall("capsvc_ticket", keys, args, decode=ticket_of)

    @staticmethod
    def shape(game: str, first_draw: int, draws: int, close_ms: int, expire_at: int,
              stale_after_ms: int, caps: str | int, judged: list[int], min_stake: int,
              time_zone: str, fix_caps: bool, expiries: list[int]) -> Shape:
        """What the one-call sales of `game` on draws first_draw..first_draw+draws-1 share
        in a call of capsvc_sell (see lua/capsvc.lua, sell): built once a batch. `caps`:
        the draws' caps as the caller knows them, or the configured cap with `fix_caps`
        (the call fixes them), as the call takes them (with the shadow cap); `judged`: the
        same caps as a list (one for every draw, or the last for the draws after it)."""
        drawn = range(first_draw, first_draw + draws)
        keys = [stops_key(game), feed_key(game), *(capped_key(game, d) for d in drawn)]
        if fix_caps:
            keys += (cap_key(game, d) for d in drawn)
        args = [close_ms, expire_at, stale_after_ms, first_draw, draws, caps, min_stake,
                time_zone, "fix" if fix_caps else "", *expiries]
        return ((game, first_draw, draws, caps, fix_caps), keys, args,
                judged + judged[-1:] * (draws - len(judged)))

    @staticmethod
    def sale_call(shape: Shape, ticket: str, record: tuple[str, str], sale: bytes,
                  grids: list[tuple[str, int]], group: int = 0, asked: bool = True,
                  budget: tuple[list[str], list[Any]] | None = None) -> SaleCall:
        """One sale's part of a call of capsvc_sell, on `shape` (its game and draws): its
        ticket and its record's bucket and field (`ticket_names`; see lua/capsvc.lua,
        sell). `grids`: (combo, stake) of each grid, combo
        "\0<picks>" when the grid is not capped (a combination never holds a zero byte).
        `group` (a request's sales, 0 none) and `asked` (its first draw asked): a sale
        whose first draw was not asked and is closed or stopped leaves the later sales of
        its group to its caller. `budget`: the player's keys and the budget's ARGV, for a
        game with player limits (`budget_call`)."""
        (game, first_draw, draws, _, _), _, _, _ = shape
        keys: list[str] = [record[0]]
        args: list[Any] = [record[1]]
        uncapped = False
        for combo, _ in grids:
            if combo[0] != "\0":
                keys += bucket_keys(game, combo, first_draw, draws)
            else:
                uncapped = True
        if uncapped:
            keys += (aggregate_key(ticket, game, d)
                     for d in range(first_draw, first_draw + draws))
        sale_nonce = nonce()
        # The sale id and the sale as the ticket's record packs them (`ticket_value`).
        args.append(b"".join((_SID_HEAD, sale_nonce, _mp_head(len(sale)), sale)))
        for combo, stake in grids:
            args += (combo, stake)
        if budget is not None:
            keys += budget[0]
            args += budget[1]
        return SaleCall(shape, keys, args, len(grids), 2 * group + (0 if asked else 1),
                        sale_nonce)

    def sell(self, calls: list[SaleCall], stamps: Sequence[dict[str, int] | None] | None = None,
             continues: bool = False) -> asyncio.Future[list[Claim]]:
        """Whole sales, each in one call (standalone Redis; see lua/capsvc.lua, sell): the
        replies, in order, of one request's sales, queued until the end of the tick and sent
        with every other request's of that tick in one call (at most SALES_PER_CALL sales
        a call: `calls` must not hold more). One future for them all. `stamps`: the
        requests they are for (default: the current one), whose stamps get the call's G.
        `continues`: some of them belong to a request an earlier call carried sales of
        (their call then reads the groups the calls before it stopped judging)."""
        assert len(calls) <= SALES_PER_CALL
        if not self._sales:
            assert isinstance(self.redis, Coalescer)  # a sale in one call: one node
            self.redis.before_flush(self._send_sales)
        out: asyncio.Future[list[Claim]] = asyncio.get_running_loop().create_future()
        if self._queued + len(calls) > SALES_PER_CALL:
            # A full call leaves now: Redis works on it while the tick prepares the next
            # ones (and its answer is not timed from behind all of them).
            self._send_sales(at_once=True)  # the hook registered sends the rest at the flush
        self._sales.append(_QueuedSales(calls, out, (stamp.get(),) if stamps is None else stamps,
                                        continues))
        self._queued += len(calls)
        if self._queued >= SALES_PER_CALL:
            self._send_sales(at_once=True)
        return out

    def _send_sales(self, at_once: bool = False) -> None:
        """The sales queued since the last call, as one call (lua/capsvc.lua, sell): one
        Redis TIME, one mark and one index write for them all. Each request gets its own
        replies; a call that fails fails all of them (nothing of it ran, or its fate is
        unknown, as for a call of one)."""
        groups, self._sales, self._queued = self._sales, [], 0
        if not groups:  # sent when full, earlier in this tick
            return
        shapes: dict[tuple[Any, ...], int] = {}
        shape_sizes: list[Any] = []
        keys: list[str] = []
        args: list[Any] = []
        for group in groups:
            for c in group.calls:
                if c.shape[0] not in shapes:
                    shapes[c.shape[0]] = len(shapes) + 1
                    _, shape_keys, shape_args, _ = c.shape
                    shape_sizes += (len(shape_keys), len(shape_args))
                    keys += shape_keys
                    args += shape_args
        frames: list[bytes] = []
        frame = _FRAME.pack
        for group in groups:
            for c in group.calls:
                frames.append(frame(len(c.keys), len(c.args), c.grids, shapes[c.shape[0]],
                                    c.tag))
                keys += c.keys
                args += c.args
        entry = Unjournaled(nonce().hex())
        keys += (UNJOURNALED, HALTS)
        args += ("1" if any(group.continues for group in groups) else "", entry.field,
                 _encode([(c.keys[0], c.args[0], c.nonce)
                          for group in groups for c in group.calls]))
        call = self.marks.call(self.redis, "capsvc_sell", keys,
                               [len(shapes), *shape_sizes, len(frames), b"".join(frames),
                                *args],
                               stamps=[s for group in groups for s in group.stamps],
                               at_once=at_once)
        call.add_done_callback(functools.partial(_answer_sales, groups, entry))

    def journaled_sale(self, sold: Sold) -> None:
        """A sale made in one call (`sell`) is journaled: its call's entry of the
        unjournaled sales goes once every sale of the call is (one HDEL a call, nobody
        waiting for it: an entry left by a failure only makes the janitor journal its
        sales again)."""
        entry = sold.entry
        if not isinstance(entry, Unjournaled):
            return
        entry.left -= 1
        if entry.left == 0:
            self.redis.send("HDEL", UNJOURNALED, entry.field)

    async def unjournaled(self) -> list[tuple[str, int, list[tuple[str, str]]]]:
        """The entries of the unjournaled sales: (field, instant, [(ticket, sale id)])."""
        raw = await self.redis.submit("HGETALL", UNJOURNALED)
        items = raw.items() if isinstance(raw, dict) else zip(raw[::2], raw[1::2],
                                                              strict=True)
        out = []
        for field, value in items:
            at, sold = _decode_entry(value)
            out.append((field.decode() if isinstance(field, bytes) else field, at,
                        [(ticket_in(b, f), sid.hex()) for b, f, sid in sold]))
        return out

    def forget_unjournaled(self, field: str) -> asyncio.Future[Any]:
        """The janitor has journaled an entry's sales."""
        return self.redis.submit("HDEL", UNJOURNALED, field)

    def sweep(self, bucket: str, cursor: bytes, count: int) -> asyncio.Future[Any]:
        """Delete the records past their expiry of one page of a record bucket: [next
        cursor (b"0": done), records deleted]."""
        return self.fcall("capsvc_sweep", [bucket], [cursor, count])

    async def oldest_pending(self) -> int | None:
        """The instant of the oldest entry of the pending indexes (a ticket claimed, being
        cancelled, or decided and not journaled yet) and of the unjournaled sales, None
        when there is none."""
        replies = await replies_of([self.redis.submit("ZRANGE", pending_key(b), 0, 0,
                                                      "WITHSCORES")
                                    for b in range(TICKET_BUCKETS)])
        indexed = [int(float(r[1])) for r in replies if r]
        if self.single_node:
            indexed += [at for _, at, _ in await self.unjournaled()]
        return min(indexed, default=None)

    def pending(self, bucket: int, indexed_before_ms: int, limit: int, offset: int = 0
                ) -> asyncio.Future[Any]:
        return self.redis.submit(
            "ZRANGEBYSCORE", pending_key(bucket), "-inf", f"({indexed_before_ms}",
            "LIMIT", offset, limit,
        )

    # -- combinations ----------------------------------------------------------------------

    def reserve(self, game: str, combo: str, record: bytes, stake: int, caps: str | int,
                min_stake: int, first_draw: int, expire_at: list[int], close_ms: int
                ) -> asyncio.Future[Reserved]:
        """Count `stake` on every draw of the grid, or none; `close_ms=0` seals instead."""
        keys = bucket_keys(game, combo, first_draw, len(expire_at))
        return self.fcall("capsvc_reserve", keys, [
            record, combo, stake, caps, close_ms, min_stake, *expire_at], decode=reserved_of)

    def record(self, game: str, combo: str, record: bytes, first_draw: int, draws: int
               ) -> asyncio.Future[Any]:
        """A grid's record (see lua/capsvc.lua, RECORDS), None if there is none."""
        return self.redis.submit("HGET", bucket_keys(game, combo, first_draw, draws)[-1],
                                 record)

    def release(self, game: str, combo: str, record: bytes, caps: str | int, min_stake: int,
                first_draw: int, draws: int, expire_at: int) -> asyncio.Future[Released]:
        keys = bucket_keys(game, combo, first_draw, draws)
        return self.fcall("capsvc_release", keys, [record, combo, caps, min_stake, expire_at],
                          decode=released_of)

    def counters(self, game: str, combo: str, first_draw: int, draws: int
                 ) -> list[asyncio.Future[Any]]:
        """The counter of `combo` on each draw (one HGET each: one key each)."""
        return [self.redis.submit("HGET", key, combo)
                for key in bucket_keys(game, combo, first_draw, draws)]

    def counters_of(self, game: str, draw: int, combos: list[str]) -> list[asyncio.Future[Any]]:
        """Counters of several combinations for one draw."""
        return [self.redis.submit("HGET", bucket_keys(game, c, draw, 1)[0], c) for c in combos]

    def mark_sold_out(self, game: str, draw: int, combo: str, expire_at: int
                      ) -> asyncio.Future[Any]:
        """Add to the draw's sold-out list (advisory; the counters stay the authority)."""
        return self.fcall("capsvc_sold_out", [capped_key(game, draw), feed_key(game)],
                          [combo, expire_at, draw])

    def sold_out(self, game: str, draw: int) -> asyncio.Future[Any]:
        return self.redis.submit("SMEMBERS", capped_key(game, draw))

    def read_feed(self, game: str, after: str, count: int) -> asyncio.Future[Any]:
        """Up to `count` events of the game's stream after the id `after` (non-blocking)."""
        return self.redis.submit("XREAD", "COUNT", count, "STREAMS", feed_key(game), after)

    def feed_range(self, game: str, after: str, count: int) -> asyncio.Future[Any]:
        """Up to `count` events after the id `after`, oldest first."""
        return self.redis.submit("XRANGE", feed_key(game), f"({after}", "+", "COUNT", count)

    def newest_feed_entry(self, game: str) -> asyncio.Future[Any]:
        return self.redis.submit("XREVRANGE", feed_key(game), "+", "-", "COUNT", 1)

    def oldest_feed_entry(self, game: str) -> asyncio.Future[Any]:
        return self.redis.submit("XRANGE", feed_key(game), "-", "+", "COUNT", 1)

    def feed_info(self, game: str) -> asyncio.Future[Any]:
        """XINFO STREAM of the game's stream (a ResponseError when there is none)."""
        return self.redis.submit("XINFO", "STREAM", feed_key(game))

    def feed_closed(self, game: str, draw: int, expire_at: int) -> asyncio.Future[Any]:
        """Announce on the feed that a draw closed, once (whoever calls first)."""
        return self.fcall("capsvc_feed_closed", [feed_key(game), feed_closes_key(game)],
                          [draw, expire_at])

    def feed_reopened(self, game: str, draw: int, combo: str, expire_at: int
                      ) -> asyncio.Future[Any]:
        return self.fcall("capsvc_feed_event", [feed_key(game)],
                          ["reopened", draw, combo, expire_at])

    def exposure_of(self, game: str, buckets: range, draw: int, cap: int, min_stake: int,
                    floor: int) -> asyncio.Future[Any]:
        """Counter buckets' share of a draw's exposure (lua/capsvc.lua, exposure): one call
        for all of `buckets` (they must be on one node)."""
        return self.fcall("capsvc_exposure", [counter_key(game, b, draw) for b in buckets],
                          [cap, min_stake, floor])

    def aggregate(self, ticket: str, game: str, draw: int, sale_id: str, value: str,
                  expire_at: int) -> asyncio.Future[Any]:
        """Record what a sale accepted on a draw ("<picks>:<stake>,…") while its ticket is
        that sale's and not cancelled, or with value "" remove it (lua/capsvc.lua,
        AGGREGATES)."""
        keys, args = self.names(ticket)
        return self.fcall("capsvc_aggregate", [aggregate_key(ticket, game, draw), *keys],
                          [sale_id, value, expire_at, *args])

    def aggregate_sums(self, game: str, draw: int) -> list[asyncio.Future[Any]]:
        """[picks, stake, …] of each ticket slot's aggregate of a draw."""
        return [self.fcall("capsvc_aggregate_sum", [k], []) for k in aggregate_keys(game, draw)]

    async def take_turn(self, task: str, ttl_ms: int) -> bool:
        """Whether this process does `task` now: the first of all processes to ask in each
        `ttl_ms` (a key that expires by itself)."""
        return bool(await self.redis.submit("SET", f"g:{{{task}}}", os.getpid(), "NX", "PX",
                                            ttl_ms))

    def fix_cap(self, game: str, draw: int, cap: int, expire_at: int) -> asyncio.Future[Any]:
        """Fix the draw's cap at `cap` unless a sale fixed it already: the cap fixed before
        (bytes), or None when this call fixed it. It expires with the draw."""
        return self.redis.submit("SET", cap_key(game, draw), cap, "NX", "GET", "PXAT",
                                 expire_at)

    def fixed_cap(self, game: str, draw: int) -> asyncio.Future[Any]:
        """The draw's fixed cap (bytes), or None while no sale has fixed it."""
        return self.redis.submit("GET", cap_key(game, draw))

    # -- draws -----------------------------------------------------------------------------

    def stops(self, game: str, first_draw: int, draws: int) -> asyncio.Future[Any]:
        """HMGET of the stops of each draw (decode with `stop_instants`)."""
        return self.redis.submit("HMGET", stops_key(game),
                                 *range(first_draw, first_draw + draws))

    async def stop(self, game: str, draw: int, expire_at: int, instant: int | None = None
                   ) -> int:
        """Stop sales of a draw now, by Redis TIME (the first stop wins; idempotent), and
        copy the stop into every ticket slot, where a cancel checks it atomically. Returns
        once every copy is written (a cancel decided after that is refused) with the instant
        sales stopped (a sale claimed from then on does not stand). `instant`: the stop's
        own (a journal's restore puts it back), else Redis TIME."""
        at = [] if instant is None else [instant]
        stopped, *_ = await replies_of([
            self.fcall("capsvc_stop", [stops_key(game)], [draw, expire_at, *at]),
            *[self.fcall("capsvc_stop", [stop_copy_key(b)], [f"{game}:{draw}", expire_at, *at])
              for b in range(TICKET_BUCKETS)]])
        return int(stopped)

    # -- a journal's restore (lua/capsvc.lua, RESTORE and THE BULK RESTORE) --------------

    def restore_tickets(self) -> TicketRestores:
        """A batch of ticket records to put back (see TicketRestores)."""
        return TicketRestores(self)

    def restore_counts(self) -> CountRestores:
        """A batch of grids to count back or give back (see CountRestores)."""
        return CountRestores(self)

    def restore_budgets(self) -> BudgetRestores:
        """A batch of player budgets to put back (see BudgetRestores)."""
        return BudgetRestores(self)

    def identities(self) -> asyncio.Future[Any]:
        """INFO server and replication of every primary (see `identity`)."""
        return asyncio.ensure_future(self.redis.broadcast("INFO", "server", "replication"))


def budget_call(player: str, ref: str, regulatory: int, until: int, day: tuple[str, int, int],
                joker: int, days: list[tuple[str, int]], costs: list[int]
                ) -> tuple[list[str], list[Any]]:
    """A sale's player budget in its one call (`Store.sale_call`; lua/capsvc.lua,
    `budget_of`): the player's keys, and the ARGV. `ref`: the ref's prefix (the sale id ends
    it); `day`: the purchase day planned for and its bounds (ms); `joker`: Joker+'s cost a
    draw; `days`: (day, draws on it) charged; `costs`: each grid's cost a draw."""
    keys = [limit_key(player), *(budget_key(player, d) for d, _ in days)]
    args: list[Any] = [len(days), ref, regulatory, until, day[1], day[2], joker]
    for d, n in days:
        args += (d, n)
    args += costs
    return keys, args


def limit_key(player: str) -> str:
    return f"l:{{pl:{player}}}"


def budget_key(player: str, day: str) -> str:
    return f"b:{{pl:{player}}}:{day}"


class PlayerStore:
    """The player-budget steps (games with a daily limit), over the same transport."""

    def __init__(self, store: Store) -> None:
        self.fcall = store.fcall
        self.redis = store.redis

    def reserve(self, player: str, ref: str, regulatory: int, expire_at: int,
                shares: list[tuple[str, int]], *, seal: bool = False, restore: bool = False
                ) -> asyncio.Future[Budget]:
        """Take `shares` ((day, amount) pairs) from the player's budgets, all or nothing;
        `seal=True` (the janitor) makes sure `ref` can take nothing any more; `restore=True`
        (a journal's restore) takes them unchecked unless `ref` is recorded."""
        keys = [limit_key(player), *[budget_key(player, day) for day, _ in shares]]
        mode = "seal" if seal else "restore" if restore else "take"
        return self.fcall("capsvc_budget", keys, [
            ref, regulatory, expire_at, mode,
            *[day for day, _ in shares], *[amount for _, amount in shares]], decode=budget_of)

    def stake(self, player: str, ref: str, regulatory: int, expire_at: int, days: list[str],
              amount: int) -> asyncio.Future[Budget]:
        """Another game's stake, on `days[0]` (today), idempotent by `ref` over the two
        days before as well: taken (ACCEPTED) or refused, and the room left."""
        keys = [limit_key(player), *[budget_key(player, day) for day in days]]
        return self.fcall("capsvc_stake", keys, [ref, regulatory, expire_at, days[0], amount],
                          decode=budget_of)

    def settle(self, player: str, ref: str, shares: list[tuple[str, int]], *,
               final: bool = False) -> asyncio.Future[Any]:
        """Make `ref` hold exactly `shares` (amount 0: give back); idempotent. `final` seals
        `ref` afterwards: no later settle changes it."""
        keys = [budget_key(player, day) for day, _ in shares]
        return self.fcall("capsvc_settle", keys,
                          [ref, int(final), *[amount for _, amount in shares]])

    def set_limit(self, player: str, value: int | None, today: str, tomorrow: str,
                  expire_at: int, at: int) -> asyncio.Future[tuple[PlayerLimits, int]]:
        """Set at `at`, or just after the player's change before (lua/capsvc.lua,
        `set_limit`): the limits after it, and the instant it was set at, to journal."""
        return self.fcall(
            "capsvc_set_limit", [limit_key(player), budget_key(player, today)],
            ["none" if value is None else value, today, tomorrow, expire_at, at],
            decode=limit_set_of)

    def restore_limit(self, player: str, at: int, limit: int | None, pending: str | None,
                      pending_from: str | None, expire_at: int) -> asyncio.Future[Any]:
        """Put back a self-limit as journaled, unless Redis has one set since."""
        return self.fcall("capsvc_restore_limit", [limit_key(player)], [
            at, "" if limit is None else limit, pending or "", pending_from or "", expire_at])

    def state(self, player: str, today: str) -> asyncio.Future[PlayerLimits]:
        return self.fcall("capsvc_player", [limit_key(player), budget_key(player, today)],
                          [today], decode=limits_of)


RESTORE_OPS_PER_CALL = 512
"""Ops per call of a bulk restore function: a few milliseconds of Redis CPU, which the
other processes' calls wait behind."""
RESTORE_OPS_IN_FLIGHT = 4 * RESTORE_OPS_PER_CALL
"""Ops of bulk restore calls sent and not answered yet, at most (see `_Bulk.send`): a few
full calls on one Redis, many small ones on a cluster (a call per slot)."""


_FIXSTR = [bytes((0xA0 | n,)) for n in range(32)]


def _mp_head(n: int) -> bytes:
    """The header of a string of `n` bytes as Redis's cmsgpack packs it (str, never bin)."""
    if n < 32:
        return _FIXSTR[n]
    if n <= 0xFF:
        return b"\xd9" + bytes((n,))
    if n <= 0xFFFF:
        return b"\xda" + n.to_bytes(2, "big")
    return b"\xdb" + n.to_bytes(4, "big")


def _mp_uint(n: int) -> bytes:
    """A non-negative integer as Redis's cmsgpack packs it (the smallest form)."""
    if n <= 0x7F:
        return bytes((n,))
    if n <= 0xFF:
        return b"\xcc" + bytes((n,))
    if n <= 0xFFFF:
        return b"\xcd" + n.to_bytes(2, "big")
    if n <= 0xFFFFFFFF:
        return b"\xce" + n.to_bytes(4, "big")
    return b"\xcf" + n.to_bytes(8, "big")


_NIL = b"\xc0"
_SID_HEAD = _mp_head(8)
_FRAME = struct.Struct(">HHHHd")
"""A sale's frame in a call of capsvc_sell: its KEYS, ARGV and grids, its shape and tag."""


def ticket_value(expire_at: int, state: bytes, at: int, sale_id: str, sale: bytes,
                 body: bytes | None, cancelled_at: int | None = None,
                 released: int | None = None, results: bytes | None = None) -> bytes:
    """A bucketed ticket record's value, byte for byte as lua/capsvc.lua's `ticket_new`
    packs it (TICKET RECORDS: the expiry, then st, at, sid, sale, body, res, ca, rel;
    `at` an integer, `sid` its 8 bytes, `ca` and `rel` decimal strings, nil for what is
    absent). A decision is kept as its `body` (sold in steps) or as its `results` (sold in
    one call)."""
    head = _mp_head
    parts = [_mp_uint(expire_at), head(len(state)), state, _mp_uint(at), _SID_HEAD,
             bytes.fromhex(sale_id), head(len(sale)), sale]
    parts += (_NIL,) if body is None else (head(len(body)), body)
    parts += (_NIL,) if results is None else (head(len(results)), results)
    if cancelled_at is None:
        parts.append(_NIL)
    else:
        ca = b"%d" % cancelled_at
        parts += (head(len(ca)), ca)
    if released is None:
        parts.append(_NIL)
    else:
        rel = b"%d" % released
        parts += (head(len(rel)), rel)
    return b"".join(parts)


Op = tuple[list[str], list[Any]]
"""One op of a bulk restore function: its KEYS and its ARGV, its letter first (lua/capsvc.lua,
THE BULK RESTORE)."""


def restore_sale(ticket: str, sale_id: str, expire_at: int, record: bytes,
                 aggregates: Sequence[tuple[str, int, str, int]] = (), *,
                 one_call: bool = False) -> Op:
    """A sale's decision put back (`record`: ticket_value, state f), and, written with it,
    the aggregates (game, draw, value, expiry) of its grids not capped: the sale's share
    (sold in steps) or, `one_call`, added to the totals by number of picks."""
    keys, args = record_names(ticket)
    keys += [aggregate_key(ticket, game, draw) for game, draw, _, _ in aggregates]
    args += (expire_at, record, sale_id, len(aggregates))
    for _, _, value, expiry in aggregates:
        args += (value, expiry)
    return keys, ["S" if one_call else "s", *args]


def restore_cancel(ticket: str, sale_id: str, expire_at: int, record: bytes,
                   aggregates: Sequence[tuple[str, int]] = ()) -> Op:
    """A cancel put back (`record`: ticket_value, state k, with when and how much), and the
    aggregates (game, draw) of the sale given back."""
    keys, args = record_names(ticket)
    keys.append(pending_key_of(ticket))
    keys += [aggregate_key(ticket, game, draw) for game, draw in aggregates]
    return keys, ["c", *args, expire_at, record, sale_id, len(aggregates)]


def restore_void(ticket: str, sale_id: str, aggregates: Sequence[tuple[str, int]] = ()
                 ) -> Op:
    """A void: what the sale holds of the aggregates (game, draw), given back."""
    keys, args = record_names(ticket)
    keys += [aggregate_key(ticket, game, draw) for game, draw in aggregates]
    return keys, ["v", *args, sale_id, len(aggregates)]


def restore_count(game: str, combo: str, record: bytes, stake: int, caps: str | int,
                  min_stake: int, first_draw: int, expiries: list[int]) -> Op:
    """An accepted grid: its stake counted back on every draw unless recorded."""
    keys = bucket_keys(game, combo, first_draw, len(expiries))
    return keys, ["g", len(keys), record, combo, stake, caps, min_stake, *expiries]


def restore_release(game: str, combo: str, record: bytes, caps: str | int, min_stake: int,
                    first_draw: int, draws: int, expire_at: int) -> Op:
    """A grid given back (and sealed), once."""
    return (bucket_keys(game, combo, first_draw, draws),
            ["r", draws, record, combo, caps, min_stake, expire_at])


def restore_budget(player: str, ref: str, regulatory: int, expire_at: int,
                   take: list[tuple[str, int]] | None, settle: list[tuple[str, int]] | None,
                   final: bool = False, given_back: bool = False) -> Op:
    """`take` (day, amount) unchecked unless `ref` is recorded, then `settle` to the amounts
    given (`final`: sealed); the same days for both. `given_back` (a cancel, a void): `ref`
    sealed first if it took nothing yet."""
    days = [day for day, _ in (take or settle or [])]
    keys = [limit_key(player), *[budget_key(player, day) for day in days]]
    args: list[Any] = ["b", len(days), ref, regulatory, expire_at,
                       "1" if take is not None else "s" if given_back else "0",
                       "" if settle is None else "1" if final else "0", *days]
    args += [amount for _, amount in take] if take is not None else [0] * len(days)
    args += [amount for _, amount in settle] if settle is not None else [0] * len(days)
    return keys, args


def _tag(key: str) -> str:
    return key[key.index("{") + 1:key.index("}")]


class _Bulk:
    """Ops of one bulk restore function (lua/capsvc.lua, THE BULK RESTORE), sent many per
    FCALL, all calls at once: on one Redis, up to RESTORE_OPS_PER_CALL ops a call; on a
    cluster, calls per hash tag (a call touches one slot). `send()` sends them and gives each
    op's reply, in the order the ops were added."""

    function = ""
    by_first_key = False
    """Whether a call's ops may be put in the order of their first keys (ops on one key
    stay in the order they were added): their function does less when ops on one key
    follow one another."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._tagged = not store.single_node
        self._ops: dict[str, list[Op]] = {}
        self._where: list[tuple[str, int]] = []

    def __len__(self) -> int:
        return len(self._where)

    def add(self, op: Op) -> None:
        tag = _tag(op[0][0]) if self._tagged else ""
        ops = self._ops.get(tag)
        if ops is None:
            ops = self._ops[tag] = []
        self._where.append((tag, len(ops)))
        ops.append(op)

    def _split(self, reply: Any, ops: int) -> list[Any]:
        raise NotImplementedError

    async def send(self) -> list[Any]:
        """Send every call, in order (on each node's connection behind what was sent
        before), with at most RESTORE_OPS_IN_FLIGHT ops unanswered; each op's reply, in the
        order the ops were added. What is in flight keeps Redis busy and each call answered
        well within the connection's deadline, however many ops the batch holds."""
        calls: list[tuple[str, list[int], list[str], list[Any]]] = []
        for tag, ops in self._ops.items():
            order = (sorted(range(len(ops)), key=lambda i: ops[i][0][0])
                     if self.by_first_key else range(len(ops)))
            for start in range(0, len(ops), RESTORE_OPS_PER_CALL):
                placed = list(order[start:start + RESTORE_OPS_PER_CALL])
                keys: list[str] = []
                args: list[Any] = []
                for i in placed:
                    keys += ops[i][0]
                    args += ops[i][1]
                calls.append((tag, placed, keys, args))
        fcall, function = self._store.fcall, self.function
        marks = self._store.marks
        counter = marks.counter
        found: dict[str, list[Any]] = {tag: [None] * len(ops) for tag, ops in self._ops.items()}
        sent: deque[tuple[str, list[int], asyncio.Future[Any]]] = deque()
        in_flight = 0
        try:
            for tag, placed, keys, args in calls:
                while sent and in_flight + len(placed) > RESTORE_OPS_IN_FLIGHT:
                    in_flight -= await self._take_reply(sent, found)
                # The call counts itself in its slot's mark (a restore's: see Marks.restoring).
                mark = marks.mark_of(keys[0])
                if counter:
                    marks.written[mark] = marks.written.get(mark, 0) + 1
                sent.append((tag, placed, retrieving(fcall(function, [*keys, mark],
                                                           [*args, counter]))))
                in_flight += len(placed)
            while sent:
                await self._take_reply(sent, found)
        finally:
            for _, _, reply in sent:
                reply.cancel()
        return [found[tag][i] for tag, i in self._where]

    async def _take_reply(self, sent: deque[tuple[str, list[int], asyncio.Future[Any]]],
                          found: dict[str, list[Any]]) -> int:
        """The oldest call's reply, split into its ops' places; how many ops it had."""
        tag, placed, reply = sent.popleft()
        for at, one in zip(placed, self._split(await reply, len(placed)), strict=True):
            found[tag][at] = one
        return len(placed)


class TicketRestores(_Bulk):
    """Ticket records put back (capsvc_restore_tickets; ops of restore_sale, restore_cancel
    and restore_void): never two ops of one ticket in a batch. Each op's reply is a letter
    (see the function)."""

    function = "capsvc_restore_tickets"
    by_first_key = True

    def _split(self, reply: Any, ops: int) -> list[Any]:
        return list(reply.decode())


class CountRestores(_Bulk):
    """Grids counted back or given back (capsvc_restore_counts; ops of restore_count and
    restore_release). Each op's reply is (letter, draws above the cap or stake given back,
    offsets)."""

    function = "capsvc_restore_counts"

    def _split(self, reply: Any, ops: int) -> list[Any]:
        letters, details = reply
        out: list[Any] = []
        at = 0
        for letter in letters.decode():
            if letter == "x":
                amount, n = int(details[at]), int(details[at + 1])
                out.append((letter, amount, [int(o) for o in details[at + 2:at + 2 + n]]))
                at += 2 + n
            else:
                out.append((letter, 0, []))
        return out


class BudgetRestores(_Bulk):
    """Player budgets put back (capsvc_restore_budgets; ops of restore_budget). Each op's
    reply is (taken: whether the amounts were put back, given: what the settle gave back)."""

    function = "capsvc_restore_budgets"

    def _split(self, reply: Any, ops: int) -> list[Any]:
        return [(int(reply[i]), int(reply[i + 1])) for i in range(0, len(reply), 2)]


JOURNALED_PER_CALL = 256
"""Tickets per capsvc_journaled_many call (Lua's unpack has a limit; Redis stays responsive)."""


def decoded(call: asyncio.Future[Any], decode: Callable[[Any], T]) -> asyncio.Future[T]:
    """`call`'s reply decoded into its type (capsvc.redis.replies), as a future of its own
    that fails as the call does (its failure retrieved even when nobody waits)."""
    out: asyncio.Future[T] = call.get_loop().create_future()

    def done(reply: asyncio.Future[Any]) -> None:
        if reply.cancelled():
            out.cancel()
            return
        error = reply.exception()
        if out.done():
            return
        if error is not None:
            out.set_exception(error)
            return
        try:
            out.set_result(decode(reply.result()))
        except Exception as e:  # a reply of another layout: the library is not this one
            out.set_exception(e)

    call.add_done_callback(done)
    return out


def retrieving(call: asyncio.Future[Any]) -> asyncio.Future[Any]:
    """`call`, its failure retrieved even if nobody awaits it: for a call queued ahead of
    the step that needs it, which a failure of an earlier step (or a cancellation of the
    request) may never reach. Awaiting it still raises its failure; unawaited, it is not
    logged as "Future exception was never retrieved"."""
    call.add_done_callback(_retrieve)
    return call


def _retrieve(call: asyncio.Future[Any]) -> None:
    if not call.cancelled():
        call.exception()


async def replies_of(futures: Sequence[asyncio.Future[Any] | None]) -> list[Any]:
    """Await queued calls together (None stays None). Every failure is retrieved; the
    first one is raised once all have settled."""
    queued = [f for f in futures if f is not None]
    if len(queued) == 1:  # the common case: no gathering needed
        await queued[0]
    elif queued:
        await asyncio.gather(*queued, return_exceptions=True)
        for f in queued:
            error = f.exception()
            if error is not None:
                raise error
    return [None if f is None else f.result() for f in futures]
