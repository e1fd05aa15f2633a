"""The janitor: settles sales and cancels that their request left unfinished.

Every process runs one; they may race each other and a client's retry, so every step is
fenced by the sale id and decided on Redis TIME (a ticket is due once it has been pending
for `janitor.pending_deadline` by Redis TIME: a host clock set off changes nothing).

A due sale is concluded (`SaleSteps.conclude_or_void`): its budget and each grid not decided yet get
a tombstone, so that the request (or a duplicate still running) can no longer count them.
Then:
- every grid has its record (accepted or rejected): the sale ran to its end and an answer
  may have been sent, so the decision is rebuilt from the records and written;
- some grid was sealed: no answer was or will be sent for that sale (a request answers
  only once every grid has its record, and a sealed grid tells it to claim again), so
  what it took is given back and the claim forgotten; a retry starts a new sale;
- a sale claimed once an admin had stopped one of its draws is given back in any case
  (none of its requests may answer it).
Two janitors seal the same grids to the same states and so reach the same decision; the
writes are idempotent and fenced, so running both changes nothing more.
A cancel decided but not finished (its release lost) is finished the same way. A decision
(a sale, a cancel) still indexed past the deadline was made in Redis by a request that may
have died before journaling it: the janitor journals it. An index entry goes only once the
ticket's outcome is journaled, so that every decision Redis holds reaches the journal (the
draw reports are written once no entry of a draw is left: capsvc.audit.service).

It also sweeps the bucketed ticket records (lua/capsvc.lua, TICKET RECORDS): a record past
its expiry is absent to every reader already, so the sweep only gives its memory back. Each
round sweeps its share of the RECORD_BUCKETS * TICKET_BUCKETS buckets, in turn from a random
start, so that one process passes over all of them in `[janitor] sweep` (10 minutes): a
record's memory outlives its retention by that at most, less with several processes.
"""

from __future__ import annotations

import logging
import math
import random

from capsvc.config import Settings
from capsvc.domain.decisions import derived_body
from capsvc.domain.errors import ApiError, Unavailable
from capsvc.domain.games import Catalog, Game
from capsvc.domain.validator import Sale, unpack_sale
from capsvc.journal.records import VoidWhy
from capsvc.redis.clock import RedisClock
from capsvc.redis.marks import Marks
from capsvc.redis.store import (
    RECORD_BUCKETS,
    TICKET_BUCKETS,
    Store,
    channel_of,
    record_bucket,
    replies_of,
    stop_instants,
)
from capsvc.service.steps import SaleSteps
from capsvc.service.tickets import Tickets, first_stopped

log = logging.getLogger(__name__)

ALL_BUCKETS = TICKET_BUCKETS * RECORD_BUCKETS
"""Record buckets in all (capsvc.redis.store.record_bucket(slot, bucket))."""
SWEEP_PAGE = 200
"""Records looked at by one sweep call (HSCAN's COUNT)."""



class Janitor:
    """Finds due tickets in the pending indexes and settles them."""

    def __init__(self, settings: Settings, catalog: Catalog, store: Store, steps: SaleSteps,
                 tickets: Tickets, clock: RedisClock) -> None:
        self.deadline_ms = settings.pending_deadline_ms
        self.catalog = catalog
        self.store = store
        self.steps = steps
        self.tickets = tickets
        self.clock = clock
        self.sweep_buckets = min(ALL_BUCKETS, max(1, math.ceil(
            ALL_BUCKETS * settings.janitor_interval_ms / settings.sweep_ms)))
        """Record buckets swept in a round."""
        self._sweep_next = random.randrange(ALL_BUCKETS)

    async def run_once(self, limit: int = 100) -> int:
        """Settle what is due; returns how many tickets were settled."""
        # Index entries carry the Redis-clock instant they were made; the function decides.
        cutoff = self.clock.now() - self.deadline_ms + 1
        settled = 0
        if self.store.single_node:
            for field, at, sold in await self.store.unjournaled():
                if at < cutoff:
                    settled += await self.journal_sold(field, sold)
        for bucket in range(TICKET_BUCKETS):
            # Page by page: entries that must wait (a game no longer configured) do not
            # hide the ones behind them.
            offset = 0
            while True:
                page = await self.store.pending(bucket, cutoff, limit, offset)
                for raw_key in page:
                    key = raw_key.decode()
                    try:
                        settled += await self.settle(key)
                    except (Unavailable, ApiError):
                        raise
                    except Exception:  # one bad record must not stop the janitor
                        log.exception("janitor could not settle %s", key)
                if len(page) < limit:
                    break
                offset += len(page)  # settled ones have left: the next round sees the rest
        return settled

    async def sweep(self, buckets: int | None = None) -> int:
        """Delete the bucketed records past their expiry in the next `buckets` buckets (the
        round's share by default); returns how many went."""
        buckets = buckets or self.sweep_buckets
        first, self._sweep_next = self._sweep_next, (self._sweep_next + buckets) % ALL_BUCKETS
        keys = [record_bucket(*divmod(i % ALL_BUCKETS, RECORD_BUCKETS))
                for i in range(first, first + buckets)]
        deleted = 0
        cursors = [b"0"] * len(keys)
        pending = list(range(len(keys)))
        while pending:  # every bucket's pages in turn, the buckets' calls queued together
            replies = await replies_of([self.store.sweep(keys[i], cursors[i], SWEEP_PAGE)
                                        for i in pending])
            for i, (cursor, gone) in zip(pending, replies, strict=True):
                cursors[i] = cursor
                deleted += gone
            pending = [i for i in pending if cursors[i] != b"0"]
        return deleted

    async def journal_sold(self, field: str, sold: list[tuple[str, str]]) -> int:
        """Journal the sales of a call's entry of the unjournaled sales (sold in one call,
        their request ended before journaling them), then delete the entry; returns how
        many were journaled. A sale since cancelled is its cancel's to journal (the cancel
        indexed it), one forgotten or expired has nothing left to journal. An entry with a
        sale of a game no longer configured waits, whole, until it is configured again."""
        journaled = 0
        for key, sale_id in sold:
            Marks.begin()  # its journal record is stamped with this settlement's calls only
            record = await self.store.ticket(key)
            if record is None or record.sale_id != sale_id or record.state != b"f":
                continue
            sale = unpack_sale(record.sale)
            game = self.catalog.get(sale.game)
            if game is None or sale.first_draw is None:
                log.error("janitor: ticket of a game no longer configured: configure %s again "
                          "to journal it", sale.game, extra={"ticket_key": key})
                return journaled
            await self._journal_sold(key, game, sale, sale_id, record.at, record.body,
                                     record.results)
            journaled += 1
        await self.store.forget_unjournaled(field)
        return journaled

    async def _journal_sold(self, key: str, game: Game, sale: Sale, sale_id: str, at: int,
                            body: bytes | None, results: bytes | None) -> None:
        """Journal a sold ticket's decision that its request may have died before
        journaling (its body, or rendered from its results)."""
        assert sale.first_draw is not None
        channel_id = channel_of(key)
        await self.tickets.journal.sale(
            "janitor", channel_id, sale, sale_id, at,
            body or derived_body(channel_id, sale, sale_id, at, results),
            game.expire_at(sale.first_draw + sale.draws - 1),
            self.steps.caps.known(game, sale.first_draw, sale.draws))
        log.info("janitor journaled a sale whose request ended before its answer",
                 extra={"ticket_key": key})

    async def settle(self, key: str) -> int:
        """Settle one indexed ticket if it is due, journal its outcome, then drop its index
        entry; returns 1 if it was settled."""
        Marks.begin()  # its journal record is stamped with this settlement's calls only
        due = await self.store.expire(key, self.deadline_ms)
        if due is None:  # nothing to settle: its entry goes, unless a new sale took it
            await self.store.journaled(key, "", b"")
            return 0
        if due is False:  # not due yet
            return 0
        state, at, sale_id, sale = due.state, due.at, due.sale_id, unpack_sale(due.sale)
        game = self.catalog.get(sale.game)
        if game is None or sale.first_draw is None:
            # Its rules are needed to settle or journal it: it waits, indexed (and the draw
            # reports with it), until the game is configured again.
            log.error("janitor: ticket of a game no longer configured: configure %s again to "
                      "settle it", sale.game, extra={"ticket_key": key})
            return 0
        channel_id = channel_of(key)
        journal = self.tickets.journal
        until = game.expire_at(sale.first_draw + sale.draws - 1)
        if state in (b"k", b"c", b"f"):
            if state == b"k":
                await self.tickets.finish_cancel(channel_id, game, key, sale, sale_id, at)
                log.info("janitor finished an interrupted cancel", extra={"ticket_key": key})
            if state == b"f":  # decided, maybe never journaled: its request died
                await self._journal_sold(key, game, sale, sale_id, at, due.body,
                                         due.results)
            else:
                body = due.body or derived_body(channel_id, sale, sale_id, at, due.results)
                await journal.cancel("janitor", channel_id, sale, sale_id, at, body, until,
                                     due.cancelled_at or 0, due.released or 0)
            # Unless the ticket moved on meanwhile (a cancel decided): the next round's.
            await self.store.journaled(key, sale_id, b"c" if state == b"k" else state)
            return 1
        stops = stop_instants(await self.store.stops(game.rules.id, sale.first_draw,
                                                     sale.draws))
        why: VoidWhy = "stopped" if first_stopped(stops, at) is not None else "abandoned"
        out = await self.steps.conclude_or_void(channel_id, game, key, sale, sale_id, at, why)
        if out is not None:
            await journal.sale("janitor", channel_id, sale, sale_id, at,
                               out.body, until,
                               self.steps.caps.known(game, sale.first_draw, sale.draws))
            await self.store.journaled(key, sale_id, b"f")
            log.info("janitor finalized an interrupted sale", extra={"ticket_key": key})
        else:
            log.info("janitor released an abandoned sale", extra={"ticket_key": key})
        return 1
