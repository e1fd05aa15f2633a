"""The players use-cases (games with a daily limit): state, self-limits, other games' stakes.

A player's budget is per calendar day in the time zone of the game it is looked at
through, all games together. A channel that may use one limited game needs no `game`
query parameter; one with several must name the game.
"""

from __future__ import annotations

from datetime import timedelta

from capsvc.client.models import LimitIn, PlayerOut, StakeIn, StakeOut
from capsvc.config import ID_RE, Channel
from capsvc.domain.decisions import ACCEPTED
from capsvc.domain.errors import ApiError, rule_error
from capsvc.domain.games import Catalog, Game, require_scope
from capsvc.journal.recorder import Recorder
from capsvc.redis.clock import RedisClock
from capsvc.redis.replies import PlayerLimits
from capsvc.redis.store import PlayerStore

SELF_LIMIT_TTL_MS = 400 * 86_400_000
"""A self-limit record lives 400 days after it was last set (no key lives forever)."""
DAY_MS = 86_400_000


class Players:
    """Player budgets and self-limits, over the same games and store as the sales."""

    def __init__(self, catalog: Catalog, store: PlayerStore, clock: RedisClock,
                 journal: Recorder) -> None:
        self.games = catalog.games
        self.store = store
        self.clock = clock
        self.journal = journal

    def game_for(self, channel: Channel, player_id: str, game_id: str | None,
                 *scopes: str) -> Game:
        """The limited game through which the channel looks at the player."""
        require_scope(channel, *scopes)
        if not ID_RE.fullmatch(player_id):
            raise ApiError("invalid", "invalid_request",
                           "player ids are 1-64 characters of [A-Za-z0-9._:-]", "player_id")
        if game_id is not None:
            game = self.games.get(game_id)
            if game is None:
                raise ApiError("not_found", "not_found", f"game {game_id!r} not found")
            if game_id not in channel.games:
                raise ApiError("forbidden", "forbidden",
                               f"channel {channel.id} may not use game {game_id}")
            if game.rules.daily_limit is None:
                raise rule_error("no_player_limits", f"game {game_id} has no player limits",
                                 "game")
            return game
        limited = [g for gid, g in self.games.items()
                   if g.rules.daily_limit is not None and gid in channel.games]
        if not limited:  # as with ?game= naming a game without limits
            raise rule_error("no_player_limits",
                             f"channel {channel.id} sells no game with player limits", "game")
        if len(limited) != 1:
            raise ApiError("invalid", "invalid_request",
                           "name the game with ?game= (the channel has "
                           f"{len(limited)} games with player limits)", "game")
        return limited[0]

    def _days(self, game: Game) -> tuple[int, str, str]:
        """Now (Redis TIME), today and tomorrow in the game's time zone."""
        now = self.clock.now()
        today = game.calendar.local_date(now)
        return now, today.isoformat(), (today + timedelta(days=1)).isoformat()

    def _out(self, game: Game, player_id: str, today: str, limits: PlayerLimits
             ) -> PlayerOut:
        regulatory = game.rules.daily_limit or 0
        own = limits.own
        limit = regulatory if own is None else min(own, regulatory)
        return PlayerOut(
            player_id=player_id, day=today, spent=limits.spent, limit=regulatory,
            self_limit=own, remaining=max(0, limit - limits.spent),
            pending_self_limit=limits.pending, pending_from=limits.pending_from,
        )

    async def state(self, channel: Channel, player_id: str, game_id: str | None) -> PlayerOut:
        game = self.game_for(channel, player_id, game_id, "sell", "read")
        _, today, _ = self._days(game)
        return self._out(game, player_id, today, await self.store.state(player_id, today))

    async def set_limit(self, channel: Channel, player_id: str, game_id: str | None,
                        body: LimitIn) -> PlayerOut:
        game = self.game_for(channel, player_id, game_id, "sell")
        regulatory = game.rules.daily_limit or 0
        if body.daily is not None and body.daily > regulatory:
            raise rule_error("limit_too_high",
                             f"a self-limit may not exceed the regulatory {regulatory}",
                             "$.daily")
        now, today, tomorrow = self._days(game)
        until = now + SELF_LIMIT_TTL_MS
        reply, at = await self.store.set_limit(player_id, body.daily, today, tomorrow, until,
                                               now)
        await self.journal.limit(channel.id, player_id, game.rules.id, body.daily, at, until,
                                 reply)
        return self._out(game, player_id, today, reply)

    async def stake(self, channel: Channel, player_id: str, game_id: str | None,
                    body: StakeIn) -> StakeOut:
        """A stake played on another game, against the same budget; idempotent by ref."""
        game = self.game_for(channel, player_id, game_id, "sell")
        now, today, _ = self._days(game)
        # The ref is looked up on the two days before as well: a retry just after
        # midnight is not charged again (idempotent for at least 48 hours).
        day = game.calendar.local_date(now)
        days = [today, *[(day - timedelta(days=n)).isoformat() for n in (1, 2)]]
        until = now + 3 * DAY_MS + game.rules.retention_ms
        reply = await self.store.stake(
            player_id, f"x/{channel.id}/{body.ref}", game.rules.daily_limit or 0, until, days,
            body.amount)
        taken = reply.kind == ACCEPTED
        out = StakeOut(status="accepted" if taken else "rejected",
                       remaining=max(0, reply.room))
        await self.journal.stake(channel.id, player_id, game.rules.id, body.ref, body.amount,
                                 today, taken, out.remaining, now, until)
        return out
