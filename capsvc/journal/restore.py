"""Putting back into Redis what it lost of the decisions in a journal directory.

When a Redis loses writes — a failover in `default` durability, a primary restarted from
an older AOF, a restored backup — decisions that were answered are gone from it, and the
cap would be enforced against counters that are too low. A process therefore never sells
on a Redis it has not reconciled with its journal directory:

- **The gate.** Every new connection reads the server's identity (`run_id` and
  `master_replid`, INFO) before anything else goes out (capsvc.coalesce). An identity this
  process has not reconciled holds every command (503, `/readyz` not ready) and starts a
  restore; so does the process's start (its first connection).
- **The restore** runs on a connection of its own: it reads the journal files that can hold
  decisions still retained, and re-applies each record through functions fenced by the
  sale id (lua/capsvc.lua, RESTORE), which write only what is missing and never judge the
  cap (the decision was answered: sold). Restoring twice equals once. Then the identities
  seen are reconciled and sales resume.

One ticket's records are applied in journal order; different tickets concurrently.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from capsvc.caps import DrawCaps, caps_argument
from capsvc.decisions import accepted_grids
from capsvc.errors import Unavailable
from capsvc.games import Catalog, Game
from capsvc.journal.gate import Gate, identity
from capsvc.journal.reader import records
from capsvc.journal.records import (
    CancelRecord,
    CapRecord,
    LimitRecord,
    Open,
    Record,
    SaleRecord,
    StakeRecord,
    StopRecord,
    VoidRecord,
    sale_of,
)
from capsvc.ledger import Ledger
from capsvc.models import TicketOut
from capsvc.store import Store, record_field, replies_of, ticket_key

log = logging.getLogger(__name__)

_decision = msgspec.json.Decoder(TicketOut).decode
_encode = msgspec.json.encode
CONCURRENCY = 256
"""Tickets restored at once (their calls pipelined together)."""
MARGIN_S = 2 * 86_400
"""Journal files last written this much before the oldest decision that can still be
retained are read too (the host's clock judges a file's age; a record's own expiry is
judged on Redis TIME)."""


@dataclass
class Restored:
    """What a restore did."""

    records: int = 0
    """Records read (of decisions still retained)."""
    applied: dict[str, int] = field(default_factory=dict)
    """Records that put something back, by type."""
    grids: int = 0
    """Accepted grids counted again."""
    over_cap: int = 0
    """Grids counted back past their cap, one per grid and draw (sold past it: logged,
    counted in a metric, alerted)."""
    other_sale: int = 0
    """Decisions whose ticket id Redis holds for another sale (claimed again after the loss,
    before this journal was restored): their stakes are counted, the record left as is."""
    skipped: int = 0
    """Records of games no longer configured."""
    seconds: float = 0.0

    def count(self, kind: str) -> None:
        self.applied[kind] = self.applied.get(kind, 0) + 1

    def merge(self, other: Restored) -> None:
        """Add what another restore did."""
        self.records += other.records
        for kind, n in other.applied.items():
            self.applied[kind] = self.applied.get(kind, 0) + n
        self.grids += other.grids
        self.over_cap += other.over_cap
        self.other_sale += other.other_sale
        self.skipped += other.skipped
        self.seconds += other.seconds


class Restorer:
    """Re-applies a journal directory's records to one Redis (see the module's docstring)."""

    def __init__(self, directory: Path, catalog: Catalog, store: Store,
                 on_over_cap: Callable[[str, int], None] = lambda game, n: None) -> None:
        self.dir = directory
        self.catalog = catalog
        self.store = store
        self.caps = DrawCaps(store)
        self.ledger = Ledger(store, self.caps)
        self.on_over_cap = on_over_cap
        self._caps_fixed: set[tuple[str, int]] = set()
        """(game, draw) whose cap this restore has put back already."""

    def oldest_useful(self, now_ms: int) -> float:
        """The host time (s) before which a file cannot hold a decision still retained."""
        span = 0
        for game in self.catalog.games.values():
            r = game.rules
            current = game.calendar.current(now_ms)
            last = current + r.sales_horizon + max(r.durations)
            span = max(span, game.expire_at(last) - now_ms)
        return time.time() - span / 1000 - MARGIN_S

    async def run(self) -> Restored:
        """Restore every record of a decision still retained; returns what was done."""
        now = await self.store.time_ms()
        reader = (r for _, _, r in records(self.dir, modified_since=self.oldest_useful(now)))
        return await self.restore(reader, now)

    async def restore(self, source: Iterable[Open | Record], now: int | None = None
                      ) -> Restored:
        """Restore the records of `source` (in journal order) still retained at `now`
        (Redis TIME); returns what was done."""
        started = time.perf_counter()
        out = Restored()
        if now is None:
            now = await self.store.time_ms()
        batch: dict[str, list[Record]] = {}
        loop = asyncio.get_running_loop()
        # Files are read in a thread (a large directory must not stall the event loop of a
        # process whose other connections are held meanwhile).
        reader = iter(source)
        while True:
            chunk = await loop.run_in_executor(None, _take, reader, 4 * CONCURRENCY)
            if not chunk:
                break
            for record in chunk:
                if isinstance(record, Open) or record.until <= now:
                    continue
                out.records += 1
                batch.setdefault(_key_of(record), []).append(record)
                if len(batch) >= CONCURRENCY:
                    await self._apply(batch, now, out)
                    batch = {}
        if batch:
            await self._apply(batch, now, out)
        out.seconds = time.perf_counter() - started
        return out

    async def _apply(self, batch: dict[str, list[Record]], now: int, out: Restored) -> None:
        await asyncio.gather(*[self._apply_in_order(rs, now, out) for rs in batch.values()])

    async def _apply_in_order(self, rs: list[Record], now: int, out: Restored) -> None:
        for r in rs:
            kind = await self.apply(r, now, out)
            if kind:
                out.count(kind)

    async def apply(self, r: Record, now: int, out: Restored) -> str | None:
        """Re-apply one record; the kind of what it put back, None when Redis had it."""
        game = self.catalog.get(r.game)
        if game is None:
            out.skipped += 1
            return None
        if isinstance(r, CancelRecord):
            return await self._cancel(game, r, now)
        if isinstance(r, SaleRecord):
            return await self._sale(game, r, out)
        if isinstance(r, VoidRecord):
            return await self._void(game, r)
        if isinstance(r, StopRecord):
            stops = await self.store.stops(r.game, r.draw, 1)
            if stops[0] is not None:
                return None
            await self.store.stop(r.game, r.draw, r.until, r.at)
            return "stop"
        if isinstance(r, CapRecord):
            before = await self.store.fix_cap(r.game, r.draw, r.cap, r.until)
            return "cap" if before is None else None
        if isinstance(r, LimitRecord):
            pending = "none" if r.next_none else (None if r.next is None else str(r.next))
            written = await self.ledger.players.restore_limit(
                r.player, r.at, r.limit, pending, r.from_day, r.until)
            return "limit" if written else None
        if isinstance(r, StakeRecord):
            if r.status != "accepted":
                return None
            reply = await self.ledger.players.reserve(
                r.player, f"x/{r.channel}/{r.ref}", game.rules.daily_limit or 0, r.until,
                [(r.day, r.amount)], restore=True)
            return "stake" if reply == [1, 0] else None
        return None

    async def _sale(self, game: Game, r: SaleRecord, out: Restored) -> str | None:
        """The ticket first (written decided if Redis lacks it: from then on no janitor
        settles it), then, in one round trip, its grids, the draws' caps, the player's
        budget and the draws' aggregates."""
        sale = sale_of(r)
        key = ticket_key(r.channel, r.ticket)
        written = await self.store.restore_ticket(key, r.sale, r.fp, r.at,
                                                  self.store.sale_record(sale),
                                                  bytes(r.decision), r.until)
        kind = written[0]
        if kind == b"cancelled":
            return None  # cancelled since: its release stands
        if kind == b"other":
            out.other_sale += 1
            log.error("restore: ticket %s of channel %s now holds another sale than the one "
                      "journaled (claimed again after Redis lost it); the journaled sale's "
                      "stakes are counted too", r.ticket, r.channel)
        put_back = kind == b"written"
        decision = _decision(r.decision)
        accepted = accepted_grids(decision)
        grids = [g for g in sale.grids if g.capped and g.index in accepted]
        caps = caps_argument(r.caps or [game.rules.cap_limit or 0], None)
        calls: list[asyncio.Future[Any] | None] = [
            self.store.restore_grid(r.game, g.combo, record_field(r.sale, g.index), g.stake,
                                    caps, game.rules.min_stake, r.first_draw,
                                    game.expiries(r.first_draw, r.draws))
            for g in grids]
        fixing = [(r.first_draw + i, cap) for i, cap in enumerate(r.caps or ())
                  if (r.game, r.first_draw + i) not in self._caps_fixed]
        self._caps_fixed.update((r.game, d) for d, _ in fixing)
        calls += [self.store.fix_cap(r.game, d, cap, game.expire_at(d)) for d, cap in fixing]
        plan = self.ledger.plan(r.channel, game, sale, r.sale, r.at)
        taking = plan is not None and bool(accepted)
        if plan is not None and accepted:
            calls.append(self.ledger.players.reserve(
                plan.player, plan.ref, plan.regulatory, plan.until,
                plan.shares(sale, accepted), restore=True))
        if kind == b"written" and accepted:
            calls += self.ledger.aggregates(key, game, sale, r.sale, accepted)
        replies = await replies_of(calls)
        n = len(grids)
        put_back = put_back or any(f is None for f in replies[n:n + len(fixing)])
        if taking:
            put_back = put_back or replies[n + len(fixing)] == [1, 0]
        if plan is not None:
            # Redis may hold the budget the sale first took (its requested cost) without the
            # settlement its decision made: the budget holds what the decision accepted.
            settled = self.ledger.settle_budget(plan, sale, accepted)
            if settled is not None and int(await settled):
                put_back = True
        if grids:
            marks = []
            for g, reply in zip(grids, replies[:n], strict=True):
                if reply[0] != 1:
                    continue
                put_back = True
                out.grids += 1
                over = int(reply[1])
                if over:
                    out.over_cap += over
                    self.on_over_cap(r.game, over)
                    log.warning("restore: ticket %s grid %d counted again past the cap on %d "
                                "draw(s) (it was sold before Redis lost it)", r.ticket,
                                g.index, over)
                marks += [self.store.mark_sold_out(r.game, r.first_draw + int(o), g.combo,
                                                   game.expire_at(r.first_draw + int(o)))
                          for o in reply[2:]]
            if marks:
                await replies_of(marks)
        return "sale" if put_back else None

    async def _cancel(self, game: Game, r: CancelRecord, now: int) -> str | None:
        sale = sale_of(r)
        key = ticket_key(r.channel, r.ticket)
        state, sid = (await self.store.ticket(key))[0:4:3]
        ours = state is None or sid.decode() == r.sale
        cancelling: list[Any] | None = None
        if ours and state != b"c":
            await self.store.index(key, now, r.until)  # the janitor finishes what we do not
            reply = await self.store.restore_ticket(key, r.sale, r.fp, r.at,
                                                    self.store.sale_record(sale),
                                                    bytes(r.decision), r.until,
                                                    r.cancelled_at, r.released)
            cancelling = reply if reply[0] == b"cancelling" else None
        given = await self.ledger.give_back(
            key, game, sale, r.sale, self.ledger.plan(r.channel, game, sale, r.sale, r.at))
        if cancelling is not None:
            one_call = self.ledger.one_call_aggregates(key, game, sale) if cancelling[1] else None
            await self.store.cancelled(key, r.sale, one_call)
        if cancelling is not None or (ours and state == b"c"):
            await self.store.unindex(key)  # journaled already (by an earlier run: the same)
        return "cancel" if cancelling is not None or given else None

    async def _void(self, game: Game, r: VoidRecord) -> str | None:
        sale = sale_of(r)
        key = ticket_key(r.channel, r.ticket)
        state, sid = (await self.store.ticket(key))[0:4:3]
        if state is not None and (sid.decode() != r.sale or state not in (b"p", b"x")):
            return None  # decided, or another sale: nothing of this one to give back
        given = await self.ledger.give_back(
            key, game, sale, r.sale, self.ledger.plan(r.channel, game, sale, r.sale, r.at))
        if state is not None:
            await self.store.unclaim(key, r.sale)
        return "void" if given or state is not None else None


def _key_of(r: Record) -> str:
    """What orders records: one ticket's (or one player's, one draw's) in journal order."""
    if isinstance(r, SaleRecord | VoidRecord):
        return f"t/{r.channel}/{r.ticket}"
    if isinstance(r, LimitRecord | StakeRecord):
        return f"p/{r.player}"
    return f"d/{r.game}/{r.draw}"


def _take(reader: Any, n: int) -> list[Any]:
    out = []
    for item in reader:
        out.append(item)
        if len(out) >= n:
            break
    return out


async def identities(store: Store) -> list[str | None]:
    """The identity of every primary behind `store`."""
    return [identity(info) for info in await store.identities()]


async def restore_once(directory: Path, catalog: Catalog, store: Store,
                       on_over_cap: Callable[[str, int], None] = lambda game, n: None
                       ) -> tuple[Restored, list[str | None]]:
    """Load the library, restore, and return what was done with the identities it was
    done on (the same before and after, else it runs again)."""
    await store.load_library()
    while True:
        before = await identities(store)
        done = await Restorer(directory, catalog, store, on_over_cap).run()
        after = await identities(store)
        if before == after:
            return done, after
        log.warning("restore: Redis changed identity while restoring: restoring again")


__all__ = ["Gate", "Restored", "Restorer", "Unavailable", "identities", "identity",
           "restore_once"]
