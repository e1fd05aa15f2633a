"""The draws use-cases: which draw is on sale, a draw's status, an admin's stop of sales.

A draw is open until its close instant by the calendar, or until an admin stops it
(stored with the Redis TIME instant it was stopped at). The calendar is judged on the
Redis clock, never the host's.
"""

from __future__ import annotations

from capsvc.client.models import CurrentDrawOut, DrawOut
from capsvc.domain.calendar import rfc3339
from capsvc.domain.errors import rule_error
from capsvc.domain.games import Game
from capsvc.journal.recorder import Recorder
from capsvc.redis.clock import RedisClock
from capsvc.redis.store import Store, stop_instants
from capsvc.service.caps import DrawCaps


class Draws:
    """Draw status and stops, over the store and the Redis clock."""

    def __init__(self, store: Store, clock: RedisClock, caps: DrawCaps, journal: Recorder
                 ) -> None:
        self.store = store
        self.clock = clock
        self.caps = caps
        self.journal = journal

    def check_horizon(self, game: Game, first: int, current: int | None = None) -> None:
        """`first` is not beyond the sales horizon, or a 422. `current`: the calendar's
        current draw, when the caller has it."""
        if current is None:
            current = game.calendar.current(self.clock.now())
        if first > current + game.rules.sales_horizon:
            raise rule_error(
                "draw_not_on_sale",
                f"draw {first} is not on sale yet (sales run up to draw "
                f"{current + game.rules.sales_horizon})",
                "$.first_draw",
            )

    def check_window(self, game: Game, first: int) -> None:
        """The draws from `first` on are on sale by the calendar, or a 422."""
        if first < game.calendar.current(self.clock.now()):
            raise rule_error("draw_closed", f"draw {first} is closed for sales", "$.first_draw")
        self.check_horizon(game, first)

    async def stops(self, game: Game, first: int, draws: int) -> list[int | None]:
        """When an admin stopped each draw of first..first+draws-1 (ms), or None."""
        return stop_instants(await self.store.stops(game.rules.id, first, draws))

    async def current_draw(self, game: Game) -> int:
        """The next draw still on sale: by the calendar, skipping draws an admin stopped."""
        first = game.calendar.current(self.clock.now())
        horizon = game.rules.sales_horizon + 1
        stops = await self.stops(game, first, horizon)
        offset = next((i for i, s in enumerate(stops) if s is None), horizon)
        return first + offset

    async def current(self, game: Game) -> CurrentDrawOut:
        draw = await self.current_draw(game)
        return CurrentDrawOut(draw=draw, closes_at=rfc3339(game.calendar.closes_at(draw)))

    async def draw(self, game: Game, draw: int) -> DrawOut:
        game.check_draw(draw)
        (stop,) = await self.stops(game, draw, 1)
        closed = stop is not None or game.calendar.is_past(draw, self.clock.now())
        cap, fixed = await self._cap(game, draw)
        return DrawOut(draw=draw, closes_at=rfc3339(game.calendar.closes_at(draw)),
                       status="closed" if closed else "open", cap=cap, cap_fixed=fixed)

    async def close(self, game: Game, draw: int, channel_id: str) -> DrawOut:
        game.check_draw(draw)
        until = game.expire_at(draw)
        instant = await self.store.stop(game.rules.id, draw, until)
        await self.store.feed_closed(game.rules.id, draw, until)
        await self.journal.stop(channel_id, game.rules.id, draw, instant, until)
        cap, fixed = await self._cap(game, draw)
        return DrawOut(draw=draw, closes_at=rfc3339(game.calendar.closes_at(draw)),
                       status="closed", cap=cap, cap_fixed=fixed)

    async def _cap(self, game: Game, draw: int) -> tuple[int | None, bool]:
        """The cap in force for the draw and whether a sale has fixed it (None, False for a
        game without a cap)."""
        if game.rules.cap_limit is None:
            return None, False
        ((cap, fixed),) = await self.caps.in_force(game, draw, 1)
        return cap, fixed
