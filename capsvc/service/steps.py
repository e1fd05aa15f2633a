"""The Redis steps that act for one sale: its budget, its grids, its decision written, giving
them back, and the one epilogue of a sale that does not stand (`SaleSteps.conclude_or_void`).

Shared by the sale, the cancel and the janitor, so that all three take and give back
exactly the same way. Every step names the sale (its id, minted by the claim): a record
of another sale, even under the same ticket id, is never touched.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from capsvc.domain.decisions import (
    ACCEPTED,
    REJECTED,
    BudgetPlan,
    Reserved,
    Verdict,
    budget_plan,
    render,
    results_of,
)
from capsvc.domain.games import Game
from capsvc.domain.validator import Sale
from capsvc.journal.recorder import Recorder
from capsvc.journal.records import VoidWhy
from capsvc.redis.replies import Budget, Released
from capsvc.redis.store import (
    RELEASED_RECORD,
    PlayerStore,
    Store,
    aggregate_key,
    record_field,
    replies_of,
)
from capsvc.service.caps import DrawCaps


@dataclass(slots=True)
class Concluded:
    """A sale concluded with a decision (`SaleSteps.conclude`)."""

    body: bytes
    verdict: Verdict
    written: bool
    """Whether this call wrote the decision; False: another actor of the sale had (a
    request answers it then as a replay)."""


class SaleSteps:
    """A sale's budget and grid records, over the store; what a sale that does not stand
    leaves in the journal."""

    def __init__(self, store: Store, caps: DrawCaps, journal: Recorder) -> None:
        self.store = store
        self.caps = caps
        self.journal = journal
        self.players = PlayerStore(store)

    @staticmethod
    def plan(channel_id: str, game: Game, sale: Sale, sale_id: str, at: int
             ) -> BudgetPlan | None:
        """What the sale takes from its player's budgets (None: the game has no limit)."""
        assert sale.first_draw is not None
        return budget_plan(channel_id, game.rules, game.calendar, sale, sale_id, at,
                           game.expire_at(sale.first_draw + sale.draws - 1))

    def take_budget(self, plan: BudgetPlan, *, seal: bool = False) -> asyncio.Future[Budget]:
        """Reserve the requested cost (or, `seal`, make sure the sale takes nothing more)."""
        return self.players.reserve(plan.player, plan.ref, plan.regulatory, plan.until,
                                    plan.requested, seal=seal)

    def settle_budget(self, plan: BudgetPlan | None, sale: Sale, accepted: set[int]
                      ) -> asyncio.Future[Any] | None:
        """Make the budget hold what the `accepted` grids cost (nothing to do: None). Giving
        everything back is final: the ref is sealed and no later settle (a duplicate's,
        delayed) can charge it again."""
        shares = None if plan is None else plan.settlement(sale, accepted)
        if plan is None or shares is None:
            return None
        return self.players.settle(plan.player, plan.ref, shares, final=not accepted)

    async def uncounted(self, game: Game, sale: Sale, sale_id: str, accepted: set[int]
                        ) -> set[int]:
        """Of the `accepted` capped grids, those whose record does not say their stake was
        counted: gone (a Redis Cluster shard lost writes the others kept: the decision
        survived its counters), or a refusal left by counting them again when they no
        longer fitted. A grid released ("X") is no loss: a cancel begun since the decision
        was read gave its stake back (a decided sale's accepted grid is released by its
        cancel only), and the decision read stands as read."""
        assert sale.first_draw is not None
        grids = [g for g in sale.grids if g.capped and g.index in accepted]
        records = await replies_of([
            self.store.record(game.rules.id, g.combo, record_field(sale_id, g.index),
                              sale.first_draw, sale.draws) for g in grids])
        return {g.index for g, record in zip(grids, records, strict=True)
                if record not in (str(g.stake).encode(), RELEASED_RECORD)}

    async def reserve_all(self, game: Game, sale: Sale, sale_id: str, close_ms: int
                          ) -> list[Reserved | None]:
        """Reserve every capped grid at once, against the draws' caps (fixed by this sale if
        it is their first); one reply per grid (None: not capped). An accepted grid that
        the shadow cap would have refused replies SHADOWED, an accepted one that it would
        not, ACCEPTED. `close_ms=0` seals instead: a grid not decided yet can no longer be
        counted."""
        rules = game.rules
        assert sale.first_draw is not None
        if not any(g.capped for g in sale.grids):
            return [None] * len(sale.grids)
        caps = await self.caps.argument(game, sale.first_draw, sale.draws, fix=close_ms != 0)
        expire_at = game.expiries(sale.first_draw, sale.draws)
        return await replies_of([
            self.store.reserve(rules.id, g.combo, record_field(sale_id, g.index), g.stake,
                               caps, rules.min_stake, sale.first_draw, expire_at, close_ms)
            if g.capped else None
            for g in sale.grids
        ])

    async def release_all(self, game: Game, sale: Sale, sale_id: str) -> int:
        """Give back what every capped grid of the sale took, and seal the ones that took
        nothing (idempotent: once per grid). Returns the stake given back."""
        rules = game.rules
        first = sale.first_draw
        assert first is not None
        grids = [g for g in sale.grids if g.capped]
        if not grids:
            return 0
        caps = await self.caps.argument(game, first, sale.draws, fix=False)
        released: list[Released] = await replies_of([
            self.store.release(rules.id, g.combo, record_field(sale_id, g.index), caps,
                               rules.min_stake, first, sale.draws,
                               game.expire_at(first + sale.draws - 1))
            for g in grids
        ])
        # A combination that leaves its cap stays on the sold-out list (readers filter it
        # by its counter): a removal racing another process's re-fill could hide one at cap.
        # The feed says it reopened (the counters' transition, reported once by release).
        reopened = [self.store.feed_reopened(rules.id, first + offset, g.combo,
                                             game.expire_at(first + offset))
                    for g, reply in zip(grids, released, strict=True)
                    for offset in reply.reopened]
        if reopened:
            await replies_of(reopened)
        return sum(reply.stake for reply in released)

    async def write_decision(self, game: Game, key: str, sale: Sale, sale_id: str,
                             plan: BudgetPlan | None, replies: list[Reserved | None],
                             body: bytes) -> tuple[int, int] | None:
        """Write a decision built from `replies`: first the budget's settlement and the
        draws' sold-out lists (once the decision is written, a replay answers it and nothing
        does them again; on a cluster they are on other nodes, and either may be lost),
        then the decision. Returns (counters brought to 80 % of the cap, counters brought to
        their cap), or None when the ticket is no longer this sale's pending claim."""
        first = sale.first_draw
        assert first is not None
        near_cap, marks = 0, []
        for g, reply in zip(sale.grids, replies, strict=True):
            if reply is not None and reply.accepted:
                near_cap += reply.near
                marks += [self.store.mark_sold_out(game.rules.id, first + offset, g.combo,
                                                   game.expire_at(first + offset))
                          for offset in reply.sold_out]
        accepted = {g.index for g, reply in zip(sale.grids, replies, strict=True)
                    if reply is None or reply.accepted}
        settled = self.settle_budget(plan, sale, accepted)
        aggregates = self.aggregates(key, game, sale, sale_id, accepted)
        if marks or settled is not None or aggregates:
            await replies_of([settled, *marks, *aggregates])
        if not await self.store.finalize(key, sale_id, body):
            return None
        return near_cap, len(marks)

    def aggregates(self, key: str, game: Game, sale: Sale, sale_id: str, accepted: set[int]
                   ) -> list[asyncio.Future[Any]]:
        """Record on each of its draws what the sale accepted of the sizes not capped (base
        stake by number of picks), or, `accepted` empty, remove it."""
        value = aggregate_value(sale, accepted)
        if value is None:
            return []
        first = sale.first_draw
        assert first is not None
        return [self.store.aggregate(key, game.rules.id, d, sale_id, value, game.expire_at(d))
                for d in range(first, first + sale.draws)]

    def one_call_aggregates(self, key: str, game: Game, sale: Sale
                            ) -> tuple[list[str], list[Any]] | None:
        """What a ticket sold in one call added to its draws' aggregates (its grids not
        capped, all accepted): their keys and picks, stake pairs."""
        amounts = _uncapped(sale, {g.index for g in sale.grids})
        if not amounts:
            return None
        first = sale.first_draw
        assert first is not None
        draws = range(first, first + sale.draws)
        return ([aggregate_key(key, game.rules.id, d) for d in draws],
                [x for pair in amounts for x in pair])

    async def conclude(self, channel_id: str, game: Game, key: str, sale: Sale, sale_id: str,
                       at: int, *, void: bool = False) -> Concluded | None:
        """Settle a sale whatever its requests are doing: seal its budget and every grid
        not decided yet (a request can then no longer count them), then either write the
        decision the records make (every grid decided: an answer may have been sent; it
        says whether this call wrote it) or give back everything (returns None; the void
        is journaled and the claim forgotten by `conclude_or_void`). `void`: the sale must
        not stand (claimed after an admin stop): always give back.

        Every actor that concludes a sale sees the same sealed records, so the janitors and
        the requests of one sale all reach the same end."""
        plan = self.plan(channel_id, game, sale, sale_id, at)
        held = True
        if plan is not None:
            taken = await self.take_budget(plan, seal=True)
            if taken.kind == REJECTED and not void:  # refused by the limit: the decision
                body, verdict = render(channel_id, sale, sale_id, at,
                                       results_of(game.rules.time_zone, None))
                return Concluded(body, verdict,
                                 await self.store.finalize(key, sale_id, body))
            held = taken.kind == ACCEPTED
        replies = await self.reserve_all(game, sale, sale_id, 0)
        if not void and held and all(r is None or r.accepted or r.kind == REJECTED
                                     for r in replies):
            body, verdict = render(channel_id, sale, sale_id, at,
                                   results_of(game.rules.time_zone, replies))
            written = await self.write_decision(game, key, sale, sale_id, plan, replies, body)
            return Concluded(body, verdict, written is not None)
        await self.give_back(key, game, sale, sale_id, plan)
        return None

    async def conclude_or_void(self, channel_id: str, game: Game, key: str, sale: Sale,
                               sale_id: str, at: int, why: VoidWhy) -> Concluded | None:
        """The end of a sale that its request cannot finish, wherever it ends (an admin's
        stop, its draw closed mid-sale, the janitor): `conclude` (a `stopped` sale never
        stands); if it does not stand, its void journaled (`why`) and only then its claim
        forgotten (a void not journaled is concluded again by the janitor). Returns the
        decision when the sale stands (None: voided)."""
        concluded = await self.conclude(channel_id, game, key, sale, sale_id, at,
                                        void=why == "stopped")
        if concluded is not None:
            return concluded
        assert sale.first_draw is not None
        await self.journal.void(why, channel_id, sale, sale_id, at,
                                game.expire_at(sale.first_draw + sale.draws - 1))
        await self.store.unclaim(key, sale_id)
        return None

    async def give_back(self, key: str, game: Game, sale: Sale, sale_id: str,
                        plan: BudgetPlan | None) -> int:
        """Release every grid, the whole budget and the draws' aggregates of a sale;
        returns what this call gave back (stakes and budget: 0 when all was given back
        before)."""
        await replies_of(self.aggregates(key, game, sale, sale_id, set()))
        released = await self.release_all(game, sale, sale_id)
        settled = self.settle_budget(plan, sale, set())
        return released + (int(await settled) if settled is not None else 0)


def aggregate_value(sale: Sale, accepted: set[int]) -> str | None:
    """What `SaleSteps.aggregates` records on each draw of a sale: the base stake the
    `accepted` grids of sizes not capped took, by number of picks ("<picks>:<stake>,…"; ""
    removes the sale's), None when there is nothing to record."""
    if all(g.capped for g in sale.grids):  # the capped sizes' stakes are the counters'
        return None
    amounts = _uncapped(sale, accepted)
    if not amounts and accepted:
        return None
    return ",".join(f"{p}:{a}" for p, a in amounts)


def _uncapped(sale: Sale, accepted: set[int]) -> list[tuple[int, int]]:
    """(picks, base stake) of the accepted grids not capped, by number of picks ascending."""
    amounts: dict[int, int] = {}
    for g in sale.grids:
        if g.index in accepted and not g.capped:
            amounts[len(g.numbers)] = amounts.get(len(g.numbers), 0) + g.stake
    return sorted(amounts.items())
