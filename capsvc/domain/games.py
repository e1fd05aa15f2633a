"""The configured games, and who may use them: the lookups every use-case starts with.

Knows the rules and calendars of the games and the channels' scopes; nothing of Redis.
"""

from __future__ import annotations

from capsvc.config import Channel, GameRules
from capsvc.domain.calendar import DrawCalendar
from capsvc.domain.errors import ApiError, not_found


class Game:
    """One configured game: its rules and its calendar."""

    __slots__ = ("calendar", "rules")

    def __init__(self, rules: GameRules) -> None:
        self.rules = rules
        self.calendar = DrawCalendar(rules)

    def expire_at(self, draw: int) -> int:
        """When what `draw` stored may go: its close plus the retention."""
        return self.calendar.close_ms(draw) + self.rules.retention_ms

    def expiries(self, first_draw: int, draws: int) -> list[int]:
        return [self.expire_at(d) for d in range(first_draw, first_draw + draws)]

    def check_draw(self, draw: int) -> None:
        """Draws are numbered from 1 to the calendar's last one (else 404)."""
        if not 1 <= draw <= self.calendar.last_draw:
            raise not_found(f"draw {draw}")


class Catalog:
    """Every configured game, by id."""

    def __init__(self, games: dict[str, GameRules]) -> None:
        self.games = {gid: Game(r) for gid, r in games.items()}

    def get(self, game_id: str) -> Game | None:
        return self.games.get(game_id)

    def game(self, game_id: str, channel: Channel, *scopes: str) -> Game:
        """The game, if it exists (404) and the channel may use it with one of `scopes` (403)."""
        game = self.games.get(game_id)
        if game is None:
            raise not_found(f"game {game_id!r}")
        if game_id not in channel.games:
            raise ApiError("forbidden", "forbidden",
                           f"channel {channel.id} may not use game {game_id}")
        require_scope(channel, *scopes)
        return game


def require_scope(channel: Channel, *scopes: str) -> None:
    if channel.scopes.isdisjoint(scopes):
        raise ApiError("forbidden", "forbidden",
                       f"channel {channel.id} lacks the scope {' or '.join(scopes)}")
