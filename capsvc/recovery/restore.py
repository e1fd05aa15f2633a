"""Putting back into Redis what it lost of the decisions in a journal directory.

When a Redis loses writes — a failover in `default` durability, a primary restarted from
an older AOF, a restored backup — decisions that were answered are gone from it, and the
cap would be enforced against counters that are too low. A process therefore never sells
on a Redis it has not reconciled with its journal directory:

- **The gate.** Every new connection reads the server's identity (`run_id` and
  `master_replid`, INFO) before anything else goes out (capsvc.redis.transport). An identity this
  process has not reconciled holds every command (503, `/readyz` not ready) and starts a
  restore; so does the process's start (its first connection).
- **The restore** runs on a connection of its own: it reads the journal files that can hold
  decisions still retained, and re-applies each record through functions fenced by the
  sale id (lua/capsvc.lua, RESTORE), which write only what is missing and never judge the
  cap (the decision was answered: sold). Restoring twice equals once. Then the identities
  seen are reconciled and sales resume.

At the speed of Redis: a Redis that lost everything takes back millions of decisions while
nothing is sold. Each record's ops are planned from the record alone (capsvc.recovery.planner:
for a large journal on more than two CPUs, in processes of their own that read and decode
the files too), and records are applied in windows of thousands, each in three rounds of
bulk calls (lua/capsvc.lua, THE BULK RESTORE; per slot on a cluster): the tickets' records,
then what their answers call for (grids counted or released, caps, budgets), then what
follows those (sold-out marks, a cancel's end, an unclaim). Records are applied in journal
order as far as they touch the same keys (see `Restorer._window`), the next window is
planned while Redis works on this one.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from capsvc.domain.errors import Unavailable
from capsvc.domain.games import Catalog, Game
from capsvc.journal.reader import retained_records
from capsvc.journal.recorder import Recorder
from capsvc.journal.records import (
    CapRecord,
    LimitRecord,
    Open,
    Record,
    SalesRecord,
    StakeRecord,
    StopRecord,
)
from capsvc.recovery.planner import (
    POOL_BYTES,
    Chunk,
    Item,
    Planned,
    Planner,
    PlanningFailed,
    pieces,
    planned_in_processes,
    planners,
)
from capsvc.redis.gate import Gate, identity
from capsvc.redis.store import (
    CountRestores,
    Store,
    TicketRestores,
    record_field,
    replies_of,
    restore_release,
)
from capsvc.service.caps import DrawCaps
from capsvc.service.steps import SaleSteps

log = logging.getLogger(__name__)

WINDOW = 8_192
"""Records applied together (each window in three rounds of bulk calls). Two windows are
in memory at a time (one applied, the next planned): ~60 MB here (the restoring process's
peak: 115 MB at 8,192, 163 at 16,384, 267 at 32,768, no faster), while a window of a few
thousand keeps Redis busy."""
CHUNK = 256
"""Records decoded and planned between two turns of the event loop (the replies of the
window being applied are read meanwhile)."""
RESTORE_TIMEOUT_S = 30.0
"""How long a restore's connection waits for a batch's replies (the sales' connections wait
`[redis] timeout`). A restore sends windows of thousands of records back to back, and Redis
works through them in order: on a loaded machine the replies of the last ones come seconds
after they were sent, from a Redis that is busy, not gone (measured: at 1,000,000 decisions
and a load of 6.5, replies more than a second behind). Sales are held while it runs either
way; a connection refused or reset still fails it at once."""
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


@dataclass(slots=True)
class _Window:
    """Records applied together: one per ticket, player or draw (`_key_of`), but a sale's
    cancel after it (see `Restorer._window`)."""

    tickets: list[Planned]
    steps: TicketRestores
    """The first round's ops (the tickets' records), added as records are planned."""
    after: TicketRestores
    """The first round's ops of the cancels of sales the window holds, sent after `steps`."""
    caps: list[tuple[int, CapRecord]] = field(default_factory=list)
    """Caps, with their place in the window: fixed in the second round, in journal order
    with the sales' (the first to fix a draw's cap puts it back)."""
    others: list[Record] = field(default_factory=list)
    """Stops, limits, stakes: applied one by one, beside the rounds."""
    keys: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    """The ticket (player, draw) of each record, with what it is ("sale", "cancel",
    "void", "stop" or ""), its sale id and its place in `tickets` (-1: one of `others`)."""


class Restorer:
    """Re-applies a journal directory's records to one Redis (see the module's docstring)."""

    def __init__(self, directory: Path, catalog: Catalog, store: Store,
                 on_over_cap: Callable[[str, int], None] = lambda game, n: None) -> None:
        self.dir = directory
        self.catalog = catalog
        self.store = store
        self.caps = DrawCaps(store)
        self.steps = SaleSteps(store, self.caps, Recorder(None, lambda: 0))  # journals nothing
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
        """Restore every record of a decision still retained; returns what was done. A
        large journal is read, decoded and planned by processes of their own (planner), or
        here if they cannot be (what it had applied is found present and not counted
        twice)."""
        now = await self.store.time_ms()
        since = self.oldest_useful(now)
        found = pieces(self.dir, since)
        workers = planners()
        out = Restored()
        if workers and sum(end - start for _, start, end in found) > POOL_BYTES:
            try:
                return await self._restore(planned_in_processes(
                    found, self.catalog, now, workers), now, out)
            except PlanningFailed as e:
                log.warning("restore: no planning process (%s): planning here", e)
                out.records = out.skipped = 0
        return await self._restore(self._planned(
            retained_records(self.dir, modified_since=since), now), now, out)

    async def restore(self, records: Iterable[Open | Record | SalesRecord]) -> Restored:
        """Apply `records` (decoded, in journal order: one ticket's in the order they were
        written) with the semantics of the module's docstring; records of decisions no
        longer retained (by Redis TIME) and `open` lines are passed over. Returns what was
        done."""
        now = await self.store.time_ms()
        return await self._restore(self._planned(records, now), now, Restored())

    async def _planned(self, records: Iterable[Open | Record | SalesRecord], now: int
                       ) -> AsyncGenerator[Chunk, None]:
        """`records` planned here, CHUNK at a time (the event loop reads the replies of the
        window being applied in between)."""
        planner = Planner(self.catalog, now)
        source = iter(records)
        while batch := list(islice(source, CHUNK)):
            yield planner.chunk(batch)
            await asyncio.sleep(0)

    async def _restore(self, chunks: AsyncGenerator[Chunk, None], now: int, out: Restored
                       ) -> Restored:
        """Apply the chunks' items, window after window, counting into `out`."""
        started = time.perf_counter()
        items = _Items(chunks, out)
        first: Item | None = None
        applying: asyncio.Future[None] | None = None
        # The cyclic garbage collector waits meanwhile: each of its full passes walked the
        # thousands of objects of the windows in flight (measured: a third of the
        # restore's Python time at 100,000 decisions); what a restore makes is freed by
        # reference counting, none of it is cyclic.
        collecting = gc.isenabled()
        gc.disable()
        try:
            while True:
                window, first = await self._window(items, first)
                if applying is not None:
                    await applying
                    applying = None
                if not window.keys and not window.caps:
                    break
                applying = asyncio.ensure_future(self._apply(window, now, out))
        finally:
            if applying is not None:
                applying.cancel()
            await chunks.aclose()
            if collecting:
                gc.enable()
        out.seconds += time.perf_counter() - started
        return out

    async def _window(self, items: _Items, first: Item | None
                      ) -> tuple[_Window, Item | None]:
        """The next window: `first`, then the next records up to (without) the next one of
        a ticket (player, draw) the window holds already, which is returned to start the
        window after. So records stay in journal order from window to window, and inside a
        window on each key they share (a cancel's release comes before a later sale's count
        on one counter: nothing is counted past the cap that is not). But three records of
        a ticket whose sale the window holds stay in it, as equal to applying them in turn:
        the sale reported again (a replay, a look-up: not applied twice), its cancel (its
        ticket's op sent after the sale's, its releases after the sale's counts), and the
        cancel reported again (nothing left to do); and a draw's stop reported again. A
        draw's caps do not end a window: they are fixed in journal order in it."""
        window = _Window([], self.store.restore_tickets(), self.store.restore_tickets())
        place = 0
        item = first
        while len(window.keys) < WINDOW:
            if item is None:
                item = next(items.chunk, None)
                if item is None:
                    if await items.next_chunk():
                        continue
                    break
            place += 1
            if isinstance(item, CapRecord):
                window.caps.append((place, item))
            elif not self._take(item, window, place):
                return window, item
            item = None
        return window, item

    @staticmethod
    def _take(item: Item, window: _Window, place: int) -> bool:
        """Add `item` to the window (see `_window`); False when it must wait for the next."""
        key = _key_of(item)
        held = window.keys.get(key)
        if held is not None:
            kind, sale_id, at = held
            if isinstance(item, StopRecord) and kind == "stop":
                return True  # the draw stopped again: nothing left to do
            if not isinstance(item, Planned) or item.sale_id != sale_id:
                return False
            if item.kind == kind == "sale":
                window.tickets[at].repeats += 1
                return True
            if item.kind == kind == "cancel":
                return True
            if kind != "sale" or item.kind != "cancel":
                return False
        if isinstance(item, Planned):
            window.keys[key] = (item.kind, item.sale_id, len(window.tickets))
            item.place, item.after = place, held is not None
            (window.steps if held is None else window.after).add(item.step)
            window.tickets.append(item)
        else:
            window.keys[key] = ("stop" if isinstance(item, StopRecord) else "", "", -1)
            window.others.append(item)
        return True

    async def _apply(self, window: _Window, now: int, out: Restored) -> None:
        """The window's three rounds (see the module's docstring), and its other records."""
        others = asyncio.ensure_future(replies_of(
            [asyncio.ensure_future(self._other(r, now)) for r in window.others]))
        try:
            codes = iter(await window.steps.send())
            later = iter(await window.after.send())  # a cancel's step after its sale's
            counts, budgets = self.store.restore_counts(), self.store.restore_budgets()
            caps = await self._caps_to_give_back(window.tickets)
            for t in window.tickets:
                code = t.code = next(later if t.after else codes)
                if t.gives_back:
                    if code != "n" or t.kind == "cancel":
                        self._give_back(t, counts, caps)
                        if t.budget is not None:
                            budgets.add(t.budget)
                            t.budgeted = True
                elif code != "c":  # a sale (not cancelled since)
                    for op in t.counts:
                        counts.add(op)
                    if t.budget is not None:
                        budgets.add(t.budget)
                        t.budgeted = True
            fixed = self._fix_caps(window)
            counted, budgeted = await asyncio.gather(counts.send(), budgets.send())
            await replies_of([f for t in window.tickets if t.fixing for f in t.fixing] + fixed)
            for f in fixed:
                if f.result() is None:
                    out.count("cap")
            follow: list[Any] = []
            grid_replies, budget_replies = iter(counted), iter(budgeted)
            for t in window.tickets:
                if t.gives_back:
                    grids = [next(grid_replies) for _ in t.released]
                else:
                    grids = [next(grid_replies) for _ in t.counts] if t.code != "c" else []
                budget = next(budget_replies) if t.budgeted else (0, 0)
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

    async def _caps_to_give_back(self, tickets: list[Planned]
                                 ) -> dict[tuple[str, int, int], str | int]:
        """The caps in force that releases of the window's cancels and voids pass."""
        wanted = {(t.game, t.first, t.draws): self.catalog.games[t.game] for t in tickets
                  if t.gives_back and any(g.capped for g in t.sale.grids)}
        found = await asyncio.gather(*[self.caps.argument(game, first, draws, fix=False)
                                       for (_, first, draws), game in wanted.items()])
        return dict(zip(wanted, found, strict=True))

    def _fix_caps(self, window: _Window) -> list[asyncio.Future[Any]]:
        """Fix the draws' caps that the window's sales (not cancelled since) and cap records
        carry, in journal order: the first to fix one puts it back. A sale fixes a draw
        only if no sale of this restore fixed it before. Returns the cap records' calls."""
        placed: list[tuple[int, Planned | CapRecord]] = [
            (t.place, t) for t in window.tickets if t.kind == "sale" and t.code != "c"
            and t.caps]
        placed += window.caps
        records = []
        for _, item in sorted(placed, key=lambda one: one[0]):
            if isinstance(item, CapRecord):
                records.append(self.store.fix_cap(item.game, item.draw, item.cap, item.until))
                continue
            game, fixing = self.catalog.games[item.game], []
            for draw, cap in enumerate(item.caps, item.first):
                if (item.game, draw) not in self._caps_fixed:
                    self._caps_fixed.add((item.game, draw))
                    fixing.append(self.store.fix_cap(item.game, draw, cap,
                                                     game.expire_at(draw)))
            item.fixing = fixing
        return records

    def _counted(self, t: Planned, grids: list[Any], budget: tuple[int, int],
                 out: Restored) -> list[Any]:
        """What a sale's rounds put back, counted; its sold-out marks to send."""
        if t.code == "o":
            out.other_sale += 1 + t.repeats  # one a record, as one record at a time counts
            log.error("restore: ticket %s of channel %s now holds another sale than the one "
                      "journaled (claimed again after Redis lost it); the journaled sale's "
                      "stakes are counted too", t.ticket, t.channel)
        put_back = (t.code == "w" or any(f.result() is None for f in t.fixing or ())
                    or any(budget))
        game = self.catalog.games[t.game]
        marks = []
        for index, (letter, over, offsets) in zip(t.counted, grids, strict=True):
            if letter == "0":
                continue
            put_back = True
            out.grids += 1
            g = t.sale.grids[index]
            if over:
                out.over_cap += over
                self.on_over_cap(t.game, over)
                log.warning("restore: ticket %s grid %d counted again past the cap on %d "
                            "draw(s) (it was sold before Redis lost it)", t.ticket, g.index,
                            over)
            marks += [self.store.mark_sold_out(t.game, t.first + o, g.combo,
                                               game.expire_at(t.first + o))
                      for o in offsets]
        if put_back:
            out.count("sale")
        return marks

    def _give_back(self, t: Planned, counts: CountRestores,
                   caps: dict[tuple[str, int, int], str | int]) -> None:
        """A cancel's or a void's second round: every capped grid released (and sealed);
        the whole budget is given back by its budget op."""
        rules = self.catalog.games[t.game].rules
        first, draws = t.first, t.draws
        t.released = tuple(g.index for g in t.sale.grids if g.capped)
        expire_at = self.catalog.games[t.game].expire_at(first + draws - 1)
        for index in t.released:
            g = t.sale.grids[index]
            counts.add(restore_release(t.game, g.combo, record_field(t.sale_id, index),
                                       caps[(t.game, first, draws)], rules.min_stake, first,
                                       draws, expire_at))

    def _given_back(self, t: Planned, grids: list[Any], budget: tuple[int, int],
                    out: Restored) -> list[Any]:
        """What a cancel's or a void's rounds gave back, counted; its last steps to send."""
        game = self.catalog.games[t.game]
        reopened = [self.store.feed_reopened(t.game, t.first + o, t.sale.grids[index].combo,
                                             game.expire_at(t.first + o))
                    for index, (_, _, offsets) in zip(t.released, grids, strict=True)
                    for o in offsets]
        given = sum(amount for _, amount, _ in grids) + budget[1]
        if t.kind == "cancel":
            if t.code in "kK" or given:
                out.count("cancel")
            return [*reopened, asyncio.ensure_future(self._cancelled(t, game))]
        if given or t.code == "u":
            out.count("void")
        if t.code == "u":
            reopened.append(asyncio.ensure_future(self.store.unclaim(t.key, t.sale_id)))
        return reopened

    async def _cancelled(self, t: Planned, game: Game) -> None:
        """A cancel's end, once all it took is given back: the ticket cancelled (taking a
        one-call sale's stakes out of its aggregates) and out of the pending index."""
        if t.code in "kK":
            one_call = (self.steps.one_call_aggregates(t.key, game, t.sale)
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
            written = await self.steps.players.restore_limit(
                r.player, r.at, r.limit, pending, r.from_day, r.until)
            return "limit" if written else None
        if isinstance(r, StakeRecord):
            if r.status != "accepted":
                return None
            reply = await self.steps.players.reserve(
                r.player, f"x/{r.channel}/{r.ref}", game.rules.daily_limit or 0, r.until,
                [(r.day, r.amount)], restore=True)
            return "stake" if reply.restored else None
        return None


class _Items:
    """The items of chunks, one after the other: `chunk` iterates the current one's, and
    `next_chunk()` moves to the next (counting the records it read)."""

    def __init__(self, chunks: AsyncIterator[Chunk], out: Restored) -> None:
        self.chunk: Iterator[Item] = iter(())
        self._chunks = chunks
        self._out = out

    async def next_chunk(self) -> bool:
        """Move to the next chunk; False when there is none."""
        chunk = await anext(self._chunks, None)
        if chunk is None:
            return False
        self._out.records += chunk.records
        self._out.skipped += chunk.skipped
        self.chunk = iter(chunk.items)
        return True


def _key_of(item: Item) -> str:
    """What orders records: one ticket's (one player's self-limits, one stake's, one draw's
    stops) in journal order. Stakes of different refs add up in any order."""
    if isinstance(item, Planned):
        return f"t/{item.channel}/{item.ticket}"
    if isinstance(item, LimitRecord):
        return f"p/{item.player}"
    if isinstance(item, StakeRecord):
        return f"x/{item.channel}/{item.ref}/{item.player}"
    return f"d/{item.game}/{item.draw}"


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
