"""The draw calendar of a game: draw numbers, their instants, the draw currently on sale.

Draw `1` is the first draw of the day `draw_epoch` (in the game's time zone); numbers grow
by one from each draw to the next, across days. Sales for a draw close at its draw time.
Pure: the current time is always passed in (milliseconds since the Unix epoch).
"""

from __future__ import annotations

import time
from bisect import bisect_right
from datetime import date, datetime, timedelta

from capsvc.config import GameRules


class DrawCalendar:
    """Maps draw numbers to close instants and back, for one game."""

    def __init__(self, rules: GameRules) -> None:
        self.rules = rules
        self._per_day = len(rules.draw_times)
        self._day_cache: dict[int, tuple[int, ...]] = {}
        self._current: tuple[int, int, int] = (0, 0, -1)  # (draw, close_ms, valid_from_ms)
        # Python dates end with the year 9999; so does the calendar.
        self.last_draw = (date(9999, 12, 30) - rules.draw_epoch).days * self._per_day

    def _day_closes(self, day_index: int) -> tuple[int, ...]:
        """Close instants (ms) of every draw of one local day, in draw order."""
        closes = self._day_cache.get(day_index)
        if closes is None:
            day = self.rules.draw_epoch + timedelta(days=day_index)
            closes = tuple(
                int(datetime.combine(day, t, self.rules.tz).timestamp() * 1000)
                for t in self.rules.draw_times
            )
            if len(self._day_cache) > 64:
                self._day_cache.clear()
            self._day_cache[day_index] = closes
        return closes

    def close_ms(self, draw: int) -> int:
        """The instant sales for `draw` close (its draw time), in ms since the Unix epoch."""
        day_index, slot = divmod(draw - 1, self._per_day)
        return self._day_closes(day_index)[slot]

    def closes_at(self, draw: int) -> datetime:
        """The close instant of `draw` in the game's time zone."""
        return datetime.fromtimestamp(self.close_ms(draw) / 1000, self.rules.tz)

    def local_date(self, now_ms: int) -> date:
        return datetime.fromtimestamp(now_ms / 1000, self.rules.tz).date()

    def local_days(self, first_draw: int, draws: int) -> list[str]:
        """The local day (YYYY-MM-DD) of each draw of first_draw..first_draw+draws-1."""
        return [self.local_date(self.close_ms(d)).isoformat()
                for d in range(first_draw, first_draw + draws)]

    def current(self, now_ms: int) -> int:
        """The first draw whose sales are still open at `now_ms` (by the calendar alone)."""
        draw, close, valid_from = self._current
        if valid_from <= now_ms < close:
            return draw
        day_index = (self.local_date(now_ms) - self.rules.draw_epoch).days
        closes = self._day_closes(day_index)
        slot = bisect_right(closes, now_ms)
        if slot == len(closes):
            day_index, slot = day_index + 1, 0
        draw = max(1, day_index * self._per_day + slot + 1)
        self._current = (draw, self.close_ms(draw), now_ms)
        return draw

    def is_past(self, draw: int, now_ms: int) -> bool:
        return self.close_ms(draw) <= now_ms


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def rfc3339(dt: datetime) -> str:
    """RFC 3339 with offset and at most millisecond precision."""
    return dt.isoformat(timespec="milliseconds") if dt.microsecond else dt.isoformat()
