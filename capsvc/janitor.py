"""The janitor: settles sales and cancels that their request left unfinished.

Every process runs one; they may race each other and a client's retry, so every step is
fenced by the sale id and decided on Redis TIME (a ticket is due once it has been pending
for `janitor.pending_deadline` by Redis TIME: a host clock set off changes nothing).

A due sale is first sealed: its budget and each grid not decided yet get a tombstone, so
that the request (or a duplicate still running) can no longer count them. Then:
- every grid has its record (accepted or rejected): the sale ran to its end and an answer
  may have been sent, so the decision is rebuilt from the records and written;
- some grid was sealed: no answer was or will be sent for that sale (a request answers
  only once every grid has its record, and a sealed grid tells it to claim again), so
  what it took is given back and the claim forgotten; a retry starts a new sale.
Two janitors seal the same grids to the same states and so reach the same decision; the
writes are idempotent and fenced, so running both changes nothing more.
A cancel decided but not finished (its release lost) is finished the same way.
"""

from __future__ import annotations

import logging

import msgspec

from capsvc.clock import RedisClock
from capsvc.config import Settings
from capsvc.decisions import (
    ACCEPTED,
    REJECTED,
    RELEASED,
    accepted_grids,
    build_decision,
    player_limit_decision,
)
from capsvc.errors import ApiError, Unavailable
from capsvc.games import Catalog
from capsvc.ledger import Ledger
from capsvc.models import TicketOut
from capsvc.store import TICKET_BUCKETS, Store, channel_of
from capsvc.tickets import Tickets
from capsvc.validator import Sale

log = logging.getLogger(__name__)

_encode = msgspec.json.encode
_sale_decoder = msgspec.json.Decoder(Sale)
_ticket_decoder = msgspec.json.Decoder(TicketOut)


class Janitor:
    """Finds due tickets in the pending indexes and settles them."""

    def __init__(self, settings: Settings, catalog: Catalog, store: Store, ledger: Ledger,
                 tickets: Tickets, clock: RedisClock) -> None:
        self.deadline_ms = settings.pending_deadline_ms
        self.catalog = catalog
        self.store = store
        self.ledger = ledger
        self.tickets = tickets
        self.clock = clock

    async def run_once(self, limit: int = 100) -> int:
        """Settle what is due; returns how many tickets were settled."""
        # Index entries carry the Redis-clock instant they were made; the function decides.
        cutoff = self.clock.now() - self.deadline_ms + 1
        settled = 0
        for bucket in range(TICKET_BUCKETS):
            for raw_key in await self.store.pending(bucket, cutoff, limit):
                key = raw_key.decode()
                try:
                    settled += await self.settle(key)
                except (Unavailable, ApiError):
                    raise
                except Exception:  # one bad record must not stop the janitor
                    log.exception("janitor could not settle %s", key)
        return settled

    async def settle(self, key: str) -> int:
        """Settle one indexed ticket if it is due; returns 1 if it was settled."""
        reply = await self.store.expire(key, self.deadline_ms)
        if not reply:
            await self.store.unindex(key)
            return 0
        if reply[0] == b"wait":
            return 0
        at, sale_id, sale = int(reply[1]), reply[2].decode(), _sale_decoder.decode(reply[3])
        game = self.catalog.get(sale.game)
        if game is None or sale.first_draw is None:
            log.warning("janitor: ticket of a game no longer served", extra={"ticket_key": key})
            return 0
        channel_id = channel_of(key)
        if reply[0] == b"k":
            await self.tickets.finish_cancel(channel_id, game, key, sale, sale_id, at)
            log.info("janitor finished an interrupted cancel", extra={"ticket_key": key})
            return 1
        plan = self.ledger.plan(channel_id, game, sale, sale_id, at)
        budget_held = True
        if plan is not None:
            taken = await self.ledger.take_budget(plan, seal=True)
            if taken[0] == REJECTED:  # refused by the player's limit: that was the decision
                await self.store.finalize(key, sale_id, _encode(player_limit_decision(sale)))
                return 1
            budget_held = taken[0] != RELEASED
        replies = await self.ledger.reserve_all(game, sale, sale_id, 0)
        if budget_held and all(r is None or r[0] in (ACCEPTED, REJECTED) for r in replies):
            out = build_decision(channel_id, game.rules, sale, sale_id, at, replies)
            settled = self.ledger.settle_budget(plan, sale, accepted_grids(out))
            if settled is not None:
                await settled
            await self.store.finalize(key, sale_id, _encode(out))
            log.info("janitor finalized an interrupted sale", extra={"ticket_key": key})
        else:
            await self.ledger.give_back(game, sale, sale_id, plan)
            await self.store.unclaim(key, sale_id)
            log.info("janitor released an abandoned sale", extra={"ticket_key": key})
        return 1
