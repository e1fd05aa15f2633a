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

At the speed of Redis: a Redis that lost everything takes back millions of decisions while
nothing is sold, so records are applied in windows of thousands, each in three rounds of
bulk calls (lua/capsvc.lua, THE BULK RESTORE; per slot on a cluster): the tickets' records,
then what their answers call for (grids, caps, budgets, releases), then what follows those
(sold-out marks, a cancel's end). A window holds one record per ticket (per player, per
draw): the next record of a ticket goes to a later window, so one ticket's records are
applied in journal order, while the next window is decoded and planned as Redis works on
this one.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from capsvc.caps import DrawCaps, caps_argument
from capsvc.decisions import BudgetPlan
from capsvc.errors import Unavailable
from capsvc.games import Catalog, Game
from capsvc.journal.gate import Gate, identity
from capsvc.journal.reader import retained_records
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
from capsvc.ledger import Ledger, aggregate_value
from capsvc.store import (
    BudgetRestores,
    CountRestores,
    Store,
    TicketRestores,
    record_field,
    replies_of,
    ticket_key,
    ticket_value,
)
from capsvc.validator import Sale, SaleGrid

log = logging.getLogger(__name__)

WINDOW = 32_768
"""Records applied together (each window in three rounds of bulk calls)."""
CHUNK = 256
"""Records decoded and planned between two turns of the event loop (the replies of the
window being applied are read meanwhile)."""
LAYOUT_SCAN_KEYS = 1_000_000
"""A restore into a Redis of at most this many keys first scans it for ticket records of
the keyed layout (Store.settle_layout: a few hundred milliseconds at most); when there is
none, a new record goes straight into its bucket, without a look for a key of its ticket
(which costs Redis about as much as writing the record)."""
MARGIN_S = 2 * 86_400
"""Journal files last written this much before the oldest decision that can still be
retained are read too (the host's clock judges a file's age; a record's own expiry is
judged on Redis TIME)."""


class _Outcome(msgspec.Struct, gc=False):
    index: int
    status: str


class _Outcomes(msgspec.Struct, gc=False):
    grids: list[_Outcome]


_outcomes = msgspec.json.Decoder(_Outcomes).decode
"""A decision's grids, their index and status only (what a restore needs of a decision
it writes back byte for byte)."""


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


class _Ticket(msgspec.Struct, gc=False):
    """A sale, cancel or void of a window, and what putting it back takes. Not tracked by
    the garbage collector (nor is anything it holds but a budget plan): a window holds
    thousands, and full collections over them cost more than the restore's own work."""

    kind: str
    """"sale", "cancel" or "void"."""
    channel: str
    ticket: str
    sale_id: str
    game: Game
    first: int
    draws: int
    key: str
    sale: Sale
    plan: BudgetPlan | None
    accepted: tuple[int, ...]
    """The grids the decision accepted (none for a void)."""
    caps: tuple[int, ...] = ()
    """The cap in force on each draw, as journaled (a sale's)."""
    code: str = ""
    """The ticket's step's answer (lua/capsvc.lua, restore_tickets)."""
    counted: tuple[SaleGrid, ...] = ()
    """The grids of ops of the second round, in their order."""
    budget: bool = False
    """Whether a budget op of the second round is this ticket's."""
    fixing: tuple[asyncio.Future[Any], ...] = ()
    """The draws' caps this sale fixes."""
    repeats: int = 0
    """The sale's records right after this one, reporting it again (not applied again)."""
    place: int = 0
    """The record's place in its window."""
    after: bool = False
    """A cancel of a sale the window holds: its ticket's step follows the sale's."""

    @property
    def gives_back(self) -> bool:
        """A cancel or a void: what the sale took is given back."""
        return self.kind != "sale"


@dataclass(slots=True)
class _Window:
    """Records applied together: one per ticket, player or draw (`_key_of`), but a sale's
    cancel after it (see `Restorer._window`)."""

    tickets: list[_Ticket]
    steps: TicketRestores
    """The first round's ops (the tickets' records), added as records are planned."""
    after: TicketRestores
    """The first round's ops of the cancels of sales the window holds, sent after `steps`."""
    caps: list[tuple[int, CapRecord]] = field(default_factory=list)
    """Caps, with their place in the window: fixed in the second round, in journal order
    with the sales' (the first to fix a draw's cap puts it back)."""
    others: list[Record] = field(default_factory=list)
    """Stops, limits, stakes: applied one by one, beside the rounds."""
    keys: dict[str, tuple[type, str, int]] = field(default_factory=dict)
    """The ticket (player, draw) of each record, with the record's type, sale id and place
    in `tickets` (-1: one of `others`)."""


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
        self._expiries: dict[tuple[str, int], int] = {}

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
        return await self.restore(retained_records(
            self.dir, modified_since=self.oldest_useful(now)))

    async def restore(self, records: Iterable[Open | Record]) -> Restored:
        """Apply `records` (decoded, in journal order: one ticket's in the order they were
        written) with the semantics of the module's docstring; records of decisions no
        longer retained (by Redis TIME) and `open` lines are passed over. Returns what was
        done."""
        started = time.perf_counter()
        out = Restored()
        store = self.store
        if not store.layout_settled and await store.key_count() <= LAYOUT_SCAN_KEYS:
            await store.settle_layout()
        now = await store.time_ms()
        source = iter(records)
        first: Record | None = None
        applying: asyncio.Future[None] | None = None
        # The cyclic garbage collector waits meanwhile: each of its full passes walked the
        # thousands of objects of the windows in flight (measured: a third of the
        # restore's Python time at 100,000 decisions); what a restore makes is freed by
        # reference counting, none of it is cyclic.
        collecting = gc.isenabled()
        gc.disable()
        try:
            while True:
                window, first = await self._window(source, first, now, out)
                if applying is not None:
                    await applying
                    applying = None
                if not window.keys:
                    break
                applying = asyncio.ensure_future(self._apply(window, now, out))
        finally:
            if applying is not None:
                applying.cancel()
            if collecting:
                gc.enable()
        out.seconds = time.perf_counter() - started
        return out

    async def _window(self, source: Iterator[Open | Record], first: Record | None,
                      now: int, out: Restored) -> tuple[_Window, Record | None]:
        """The next window: `first`, then the source's records up to (without) the next one
        of a ticket (player, draw) the window holds already, which is returned to start the
        window after. So records stay in journal order from window to window, and inside a
        window on each key they share (a cancel's release comes before a later sale's count
        on one counter: nothing is counted past the cap that is not). But three records of
        a ticket whose sale the window holds stay in it, as equal to applying them in turn:
        the sale reported again (a replay, a look-up: not applied twice), its cancel (its
        ticket's step sent after the sale's, its releases after the sale's counts), and the
        cancel reported again (nothing left to do); and a draw's stop reported again. A
        draw's caps do not end a window: they are fixed in journal order in it."""
        window = _Window([], self.store.restore_tickets(), self.store.restore_tickets())
        taken = 0
        r = first
        while len(window.keys) < WINDOW:
            if r is None:
                line = next(source, None)
                if line is None:
                    break
                if isinstance(line, Open) or line.until <= now:
                    continue
                out.records += 1
                r = line
            taken += 1
            if taken % CHUNK == 0:
                await asyncio.sleep(0)
            game = self.catalog.get(r.game)
            if game is None:
                out.skipped += 1
            elif isinstance(r, CapRecord):
                window.caps.append((taken, r))
            elif not self._take(r, game, window, taken):
                return window, r
            r = None
        return window, r

    def _take(self, r: Record, game: Game, window: _Window, place: int) -> bool:
        """Add `r` to the window (see `_window`); False when it must wait for the next."""
        key = _key_of(r)
        held = window.keys.get(key)
        if held is not None:
            kind, sale_id, at = held
            if type(r) is StopRecord and kind is StopRecord:
                return True  # the draw stopped again: nothing left to do
            if getattr(r, "sale", None) != sale_id or not isinstance(r, SaleRecord):
                return False
            if type(r) is SaleRecord and kind is SaleRecord:
                window.tickets[at].repeats += 1
                return True
            if type(r) is CancelRecord and kind is CancelRecord:
                return True
            if kind is not SaleRecord or window.tickets[at].after:
                return False
        if isinstance(r, SaleRecord | VoidRecord):
            window.keys[key] = (type(r), r.sale, len(window.tickets))
            t = self._plan(r, game, window.steps if held is None else window.after)
            t.place, t.after = place, held is not None
            window.tickets.append(t)
        else:
            window.keys[key] = (type(r), "", -1)
            window.others.append(r)
        return True

    def _plan(self, r: SaleRecord | VoidRecord, game: Game, steps: TicketRestores
              ) -> _Ticket:
        """A ticket's record planned, its step added to the first round."""
        sale = sale_of(r)
        key = ticket_key(r.channel, r.ticket)
        plan = (self.ledger.plan(r.channel, game, sale, r.sale, r.at)
                if game.rules.daily_limit is not None and r.player is not None else None)
        first, draws = r.first_draw, r.draws
        if isinstance(r, VoidRecord):
            steps.void(key, r.sale, self._given_back_aggregates(sale, r.game, first, draws))
            return _Ticket("void", r.channel, r.ticket, r.sale, game, first, draws, key, sale,
                           plan, ())
        accepted = tuple(g.index for g in _outcomes(r.decision).grids
                         if g.status == "accepted")
        packed = self.store.sale_record(sale)
        body = bytes(r.decision)
        if isinstance(r, CancelRecord):
            steps.cancel(key, r.sale, r.until, ticket_value(
                r.until, b"k", r.fp, r.at, r.sale, packed, body, r.cancelled_at, r.released),
                self._given_back_aggregates(sale, r.game, first, draws))
            return _Ticket("cancel", r.channel, r.ticket, r.sale, game, first, draws, key,
                           sale, plan, accepted)
        value = aggregate_value(sale, set(accepted)) if accepted else None
        steps.sale(key, r.sale, r.until,
                   ticket_value(r.until, b"f", r.fp, r.at, r.sale, packed, body),
                   [(r.game, d, value, self._expire_at(game, d))
                    for d in range(first, first + draws)] if value is not None else ())
        return _Ticket("sale", r.channel, r.ticket, r.sale, game, first, draws, key, sale,
                       plan, accepted, tuple(r.caps or ()))

    @staticmethod
    def _given_back_aggregates(sale: Sale, game: str, first: int, draws: int
                               ) -> list[tuple[str, int]]:
        """The aggregates a sale given back leaves (`Ledger.aggregates` with none accepted)."""
        if aggregate_value(sale, set()) is None:
            return []
        return [(game, d) for d in range(first, first + draws)]

    def _expire_at(self, game: Game, draw: int) -> int:
        found = self._expiries.get((game.rules.id, draw))
        if found is None:
            found = self._expiries[(game.rules.id, draw)] = game.expire_at(draw)
        return found

    async def _apply(self, window: _Window, now: int, out: Restored) -> None:
        """The window's three rounds (see the module's docstring), and its other records."""
        others = asyncio.ensure_future(replies_of(
            [asyncio.ensure_future(self._other(r, now)) for r in window.others]))
        try:
            steps, after = window.steps.send(), window.after.send()
            codes, later = iter(await steps), iter(await after)
            counts, budgets = self.store.restore_counts(), self.store.restore_budgets()
            caps = await self._caps_to_give_back(window.tickets)
            for t in window.tickets:
                code = t.code = next(later if t.after else codes)
                if t.gives_back:
                    if code != "n" or t.kind == "cancel":
                        self._give_back(t, counts, budgets, caps)
                elif code != "c":  # a sale (not cancelled since)
                    self._count(t, counts, budgets)
            fixed = self._fix_caps(window)
            counted, budgeted = await asyncio.gather(counts.send(), budgets.send())
            await replies_of([f for t in window.tickets for f in t.fixing] + fixed)
            for f in fixed:
                if f.result() is None:
                    out.count("cap")
            follow: list[Any] = []
            grid_replies, budget_replies = iter(counted), iter(budgeted)
            for t in window.tickets:
                grids = [next(grid_replies) for _ in t.counted]
                budget = next(budget_replies) if t.budget else (0, 0)
                if t.gives_back:
                    follow += self._given_back(t, grids, budget, out)
                elif t.code != "c":
                    follow += self._counted(t, grids, budget, out)
            await replies_of(follow)
            for kind in await others:
                if kind:
                    out.count(kind)
        finally:
            others.cancel()

    async def _caps_to_give_back(self, tickets: list[_Ticket]
                                 ) -> dict[tuple[str, int, int], str | int]:
        """The caps in force that releases of the window's cancels and voids pass."""
        wanted = {(t.game.rules.id, t.first, t.draws): t.game for t in tickets
                  if t.gives_back and any(g.capped for g in t.sale.grids)}
        found = await asyncio.gather(*[self.caps.argument(game, first, draws, fix=False)
                                       for (_, first, draws), game in wanted.items()])
        return dict(zip(wanted, found, strict=True))

    def _count(self, t: _Ticket, counts: CountRestores, budgets: BudgetRestores) -> None:
        """A sale's second round: its accepted capped grids, its draws' caps, its budget."""
        game, rules = t.game, t.game.rules
        gid, first = rules.id, t.first
        t.counted = tuple(g for g in t.sale.grids if g.capped and g.index in t.accepted)
        if t.counted:
            caps = caps_argument(t.caps or [rules.cap_limit or 0], None)
            expiries = [self._expire_at(game, d) for d in range(first, first + t.draws)]
            for g in t.counted:
                counts.grid(gid, g.combo, record_field(t.sale_id, g.index), g.stake, caps,
                            rules.min_stake, first, expiries)
        plan = t.plan
        if plan is not None:
            accepted = set(t.accepted)
            settle = plan.settlement(t.sale, accepted)
            take = plan.shares(t.sale, accepted) if accepted else None
            if take is not None or settle is not None:
                budgets.budget(plan.player, plan.ref, plan.regulatory, plan.until, take,
                               settle, final=not accepted)
                t.budget = True

    def _fix_caps(self, window: _Window) -> list[asyncio.Future[Any]]:
        """Fix the draws' caps that the window's sales (not cancelled since) and cap records
        carry, in journal order: the first to fix one puts it back. A sale fixes a draw
        only if no sale of this restore fixed it before. Returns the cap records' calls."""
        placed: list[tuple[int, _Ticket | CapRecord]] = [
            (t.place, t) for t in window.tickets if t.kind == "sale" and t.code != "c"
            and t.caps]
        placed += window.caps
        records = []
        for _, item in sorted(placed, key=lambda one: one[0]):
            if isinstance(item, CapRecord):
                records.append(self.store.fix_cap(item.game, item.draw, item.cap, item.until))
                continue
            gid, fixing = item.game.rules.id, []
            for draw, cap in enumerate(item.caps, item.first):
                if (gid, draw) not in self._caps_fixed:
                    self._caps_fixed.add((gid, draw))
                    fixing.append(self.store.fix_cap(gid, draw, cap,
                                                     self._expire_at(item.game, draw)))
            item.fixing = tuple(fixing)
        return records

    def _counted(self, t: _Ticket, grids: list[Any], budget: tuple[int, int],
                 out: Restored) -> list[Any]:
        """What a sale's rounds put back, counted; its sold-out marks to send."""
        if t.code == "o":
            out.other_sale += 1 + t.repeats  # one a record, as one record at a time counts
            log.error("restore: ticket %s of channel %s now holds another sale than the one "
                      "journaled (claimed again after Redis lost it); the journaled sale's "
                      "stakes are counted too", t.ticket, t.channel)
        put_back = (t.code == "w" or any(f.result() is None for f in t.fixing)
                    or any(budget))
        gid = t.game.rules.id
        marks = []
        for g, (letter, over, offsets) in zip(t.counted, grids, strict=True):
            if letter == "0":
                continue
            put_back = True
            out.grids += 1
            if over:
                out.over_cap += over
                self.on_over_cap(gid, over)
                log.warning("restore: ticket %s grid %d counted again past the cap on %d "
                            "draw(s) (it was sold before Redis lost it)", t.ticket, g.index,
                            over)
            marks += [self.store.mark_sold_out(gid, t.first + o, g.combo,
                                               self._expire_at(t.game, t.first + o))
                      for o in offsets]
        if put_back:
            out.count("sale")
        return marks

    def _give_back(self, t: _Ticket, counts: CountRestores, budgets: BudgetRestores,
                   caps: dict[tuple[str, int, int], str | int]) -> None:
        """A cancel's or a void's second round: every capped grid released (and sealed),
        the whole budget given back."""
        rules = t.game.rules
        first, draws = t.first, t.draws
        t.counted = tuple(g for g in t.sale.grids if g.capped)
        for g in t.counted:
            counts.release(rules.id, g.combo, record_field(t.sale_id, g.index),
                           caps[(rules.id, first, draws)], rules.min_stake, first, draws,
                           self._expire_at(t.game, first + draws - 1))
        plan = t.plan
        if plan is not None:
            budgets.budget(plan.player, plan.ref, plan.regulatory, plan.until, None,
                           plan.shares(t.sale, set()), final=True)
            t.budget = True

    def _given_back(self, t: _Ticket, grids: list[Any], budget: tuple[int, int],
                    out: Restored) -> list[Any]:
        """What a cancel's or a void's rounds gave back, counted; its last steps to send."""
        gid = t.game.rules.id
        reopened = [self.store.feed_reopened(gid, t.first + o, g.combo,
                                             self._expire_at(t.game, t.first + o))
                    for g, (_, _, offsets) in zip(t.counted, grids, strict=True)
                    for o in offsets]
        given = sum(amount for _, amount, _ in grids) + budget[1]
        if t.kind == "cancel":
            if t.code in "kK" or given:
                out.count("cancel")
            return [*reopened, asyncio.ensure_future(self._cancelled(t))]
        if given or t.code == "u":
            out.count("void")
        if t.code == "u":
            reopened.append(asyncio.ensure_future(self.store.unclaim(t.key, t.sale_id)))
        return reopened

    async def _cancelled(self, t: _Ticket) -> None:
        """A cancel's end, once all it took is given back: the ticket cancelled (taking a
        one-call sale's stakes out of its aggregates) and out of the pending index."""
        if t.code in "kK":
            one_call = (self.ledger.one_call_aggregates(t.key, t.game, t.sale)
                        if t.code == "K" else None)
            await self.store.cancelled(t.key, t.sale_id, one_call)
        if t.code in "kKc":
            await self.store.unindex(t.key)  # journaled already (by an earlier run: the same)

    async def _other(self, r: Record, now: int) -> str | None:
        """Re-apply a stop, a limit or a stake; the kind of what it put back, None when
        Redis had it."""
        game = self.catalog.get(r.game)
        assert game is not None
        if isinstance(r, StopRecord):
            stops = await self.store.stops(r.game, r.draw, 1)
            if stops[0] is not None:
                return None
            await self.store.stop(r.game, r.draw, r.until, r.at)
            return "stop"
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


def _key_of(r: Record) -> str:
    """What orders records: one ticket's (one player's self-limits, one stake's, one draw's
    stops) in journal order. Stakes of different refs add up in any order."""
    if isinstance(r, SaleRecord | VoidRecord):
        return f"t/{r.channel}/{r.ticket}"
    if isinstance(r, LimitRecord):
        return f"p/{r.player}"
    if isinstance(r, StakeRecord):
        return f"x/{r.channel}/{r.ref}/{r.player}"
    return f"d/{r.game}/{r.draw}"


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
