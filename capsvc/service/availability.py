"""The availability use-cases: can a combination still be played, the sold-out list.

Advisory reads of the counters: nothing here counts or reserves anything.
"""

from __future__ import annotations

from capsvc.client.models import (
    AvailabilityGridOut,
    AvailabilityIn,
    AvailabilityOut,
    CappedOut,
    CombinationOut,
)
from capsvc.domain import combination
from capsvc.domain.errors import rule_error
from capsvc.domain.games import Game
from capsvc.domain.validator import parse_numbers_path, validate_availability
from capsvc.redis.store import Store, replies_of, retrieving, stop_instants
from capsvc.service.draws import Draws


class Availability:
    """Reads of the counters for terminals."""

    def __init__(self, store: Store, draws: Draws) -> None:
        self.store = store
        self.draws = draws

    async def combination(self, game: Game, draw: int, numbers_text: str) -> CombinationOut:
        rules = game.rules
        numbers = parse_numbers_path(rules, numbers_text)
        game.check_draw(draw)
        if not rules.is_capped(len(numbers)):
            return CombinationOut(numbers=list(numbers), draw=draw, cap=None, staked=None,
                                  remaining=None, selectable=True)
        queued = [retrieving(f) for f in
                  self.store.counters(rules.id, combination.encode(numbers), draw, 1)]
        ((cap, _),) = await self.draws.caps.in_force(game, draw, 1)
        (raw,) = await replies_of(queued)
        staked = int(raw or 0)
        return CombinationOut(numbers=list(numbers), draw=draw, cap=cap, staked=staked,
                              remaining=cap - staked, selectable=cap - staked >= rules.min_stake)

    async def availability(self, game: Game, a: AvailabilityIn) -> AvailabilityOut:
        rules = game.rules
        probes = validate_availability(rules, a)
        first = a.first_draw if a.first_draw is not None else await self.draws.current_draw(game)
        self.draws.check_window(game, first)
        # Every read in one round trip; a failure of one that is not awaited (an earlier
        # one failed, or the draw is stopped) is retrieved all the same.
        stops = retrieving(self.store.stops(rules.id, first, a.draws))
        queued = [[retrieving(f) for f in self.store.counters(rules.id, p.combo, first, a.draws)]
                  if p.capped else None for p in probes]
        caps = ([c for c, _ in await self.draws.caps.in_force(game, first, a.draws)]
                if any(p.capped for p in probes) else [])
        stopped = next((first + i for i, s in enumerate(stop_instants(await stops))
                        if s is not None), None)
        if stopped is not None:  # a sale would be refused for the whole ticket
            raise rule_error("draw_closed", f"draw {stopped} is closed for sales",
                             "$.first_draw")
        counters = [None if q is None else await replies_of(q) for q in queued]
        grids = []
        for p, values in zip(probes, counters, strict=True):
            out = AvailabilityGridOut(index=p.index, available=True)
            for offset, raw in enumerate(values or ()):
                room = caps[offset] - int(raw or 0)
                if p.stake > room:
                    out = AvailabilityGridOut(index=p.index, available=False,
                                              draw=first + offset, remaining=room)
                    break
            grids.append(out)
        return AvailabilityOut(grids=grids)

    async def sold_out(self, game: Game, draw: int) -> CappedOut:
        """The draw's sold-out combinations, each checked against its counter."""
        rules = game.rules
        game.check_draw(draw)
        members = sorted(await self.store.sold_out(rules.id, draw))
        if not members:
            return CappedOut(draw=draw, combinations=[])
        values = await replies_of(self.store.counters_of(rules.id, draw,
                                                         [m.decode() for m in members]))
        ((cap, _),) = await self.draws.caps.in_force(game, draw, 1)
        return CappedOut(draw=draw, combinations=[
            combination.decode(m) for m, v in zip(members, values, strict=True)
            if cap - int(v or 0) < rules.min_stake
        ])
