"""The draw calendar of a game: draw numbers, their instants, the draw currently on sale.

Draw `1` is the first draw of the day `draw_epoch` (in the game's time zone); numbers grow
by one from each draw to the next, across days. Sales for a draw close at its draw time.
Pure: the current time is always passed in (milliseconds since the Unix epoch).

Draw times are local wall-clock times, and every day has the same draws, so a draw's number
never depends on the clock changes. On the days the clock changes, a draw closes when the
clock first shows its time, as on any other day, and never before:

- a time the clock shows twice (fall back, 02:30 twice) closes at its first showing;
- a time the clock skips (spring forward, no 02:30 as 02:00 becomes 03:00) closes at the
  first instant after the gap, when the clock jumps (03:00), late rather than early;
- draws that would then close at one instant (every skipped one, and the 03:00 one) close
  1 ms apart, in draw order: every draw closes at least 1 ms after the one before.

One millisecond, the smallest step of the calendar's instants, keeps held draws as near as
can be to the jump, and delays the draws due at the jump or just after it by at most a few
milliseconds (a few seconds for draws every second). So close_ms(n) < close_ms(n + 1) for
every draw n. A draw's local day (`local_days`) is the day of its close, so never a day
before one on which it is still sold: that is the day it is scheduled on, except where a gap
reaches midnight. In Greenland (America/Nuuk) 23:00 becomes 00:00 on the last Saturday of
March: that evening's 23:xx draws close, and count, on the Sunday.
"""

from __future__ import annotations

import time
from array import array
from bisect import bisect_right
from datetime import date, datetime, timedelta, tzinfo

from capsvc.config import GameRules

_DAY = timedelta(days=1)
_MIDNIGHT = datetime.min.time()


class DrawCalendar:
    """Maps draw numbers to close instants and back, for one game."""

    def __init__(self, rules: GameRules) -> None:
        self.rules = rules
        self._per_day = len(rules.draw_times)
        # Each draw's time of day in ms after local midnight: on a day the UTC offset does not
        # change, a close is that day's midnight plus this, with no time zone work per draw.
        self._tod = tuple((t.hour * 3600 + t.minute * 60 + t.second) * 1000
                          for t in rules.draw_times)
        # Per local day: its midnight (ms) when the offset holds all day, else every close.
        self._day_cache: dict[int, int | array[int]] = {}
        self._current: tuple[int, int, int] = (0, 0, -1)  # (draw, close_ms, valid_from_ms)
        self._bounds: tuple[str, int, int] = ("", 0, 0)  # the last local_day
        # Python dates end with the year 9999; so does the calendar.
        self.last_draw = (date(9999, 12, 30) - rules.draw_epoch).days * self._per_day

    def _day(self, day_index: int) -> int | array[int]:
        """The local day's midnight (ms) if its closes are midnight + time of day, else its
        closes (ms) in draw order."""
        entry = self._day_cache.get(day_index)
        if entry is None:
            entry = self._compute_day(day_index)
            if len(self._day_cache) > 64:
                self._day_cache.clear()
            self._day_cache[day_index] = entry
        return entry

    def _compute_day(self, day_index: int) -> int | array[int]:
        day = self.rules.draw_epoch + timedelta(days=day_index)
        start = self._steady_midnight(day)
        # A day after a clock change may inherit from it: draws held to the end of a gap that
        # runs past midnight, or pushed to stay in order, can close on the next local day.
        floor = None
        if self._steady_midnight(day - _DAY) is None:
            floor = self.close_ms(day_index * self._per_day)
        if start is not None and (floor is None or floor < start + self._tod[0]):
            return start
        closes = array("q", self._wall_closes(day) if start is None
                       else (start + t for t in self._tod))
        previous = closes[0] - 1 if floor is None else floor
        for slot, close in enumerate(closes):
            if close <= previous:
                close = previous + 1
                closes[slot] = close
            previous = close
        return closes

    def _steady_midnight(self, day: date) -> int | None:
        """The instant (ms) local `day` starts, if its UTC offset holds from that midnight to
        the next; None on a day the clock changes."""
        tz = self.rules.tz
        start = datetime.combine(day, _MIDNIGHT, tz)
        end = datetime.combine(day + _DAY, _MIDNIGHT, tz)
        # Both midnights must exist once (fold 0 and 1 agree) and be 24 h apart. tzdb has no
        # two changes less than two days apart, so no change then hides between them.
        if (start.timestamp() != start.replace(fold=1).timestamp()
                or end.timestamp() != end.replace(fold=1).timestamp()
                or end.timestamp() - start.timestamp() != 86_400):
            return None
        return int(start.timestamp() * 1000)

    def _wall_closes(self, day: date) -> list[int]:
        """The instant (ms) of each draw time of `day`, by the rules of the module docstring,
        before they are made strictly increasing."""
        tz = self.rules.tz
        closes: list[int] = []
        change: int | None = None
        for t in self.rules.draw_times:
            wall = datetime.combine(day, t, tz)  # fold 0: the first of a repeated time
            first, other = wall.timestamp(), wall.replace(fold=1).timestamp()
            if first > other:
                # A skipped time: fold 0 reads it with the offset before the change, fold 1
                # with the offset after, so the change lies in (other, first].
                if change is None or not other < change <= first:
                    change = self._change_in(int(other), int(first))
                first = change
            closes.append(int(first * 1000))
        return closes

    def _change_in(self, lo: int, hi: int) -> int:
        """The instant (s) in (lo, hi] the UTC offset changes (to the one in force at hi)."""
        tz = self.rules.tz
        after = datetime.fromtimestamp(hi, tz).utcoffset()
        # Offsets change on whole seconds: bisect over them.
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if datetime.fromtimestamp(mid, tz).utcoffset() == after:
                hi = mid
            else:
                lo = mid
        return hi

    def close_ms(self, draw: int) -> int:
        """The instant sales for `draw` close (its draw time), in ms since the Unix epoch."""
        day_index, slot = divmod(draw - 1, self._per_day)
        entry = self._day(day_index)
        if isinstance(entry, int):
            return entry + self._tod[slot]
        return entry[slot]

    def closes_at(self, draw: int) -> datetime:
        """The close instant of `draw` in the game's time zone."""
        return datetime.fromtimestamp(self.close_ms(draw) / 1000, self.rules.tz)

    def local_date(self, now_ms: int) -> date:
        return datetime.fromtimestamp(now_ms / 1000, self.rules.tz).date()

    def local_day(self, now_ms: int) -> tuple[str, int, int]:
        """The local day (YYYY-MM-DD) of the instant `now_ms`, and the instants (ms) it
        starts and the next one starts."""
        bounds = self._bounds
        if bounds[1] <= now_ms < bounds[2]:
            return bounds
        day = self.local_date(now_ms)
        tz = self.rules.tz
        start = int(datetime.combine(day, _MIDNIGHT, tz).timestamp() * 1000)
        end = int(datetime.combine(day + _DAY, _MIDNIGHT, tz).timestamp() * 1000)
        # A midnight the clock skips or shows twice: the day holds `now_ms` all the same.
        self._bounds = bounds = (day.isoformat(), min(start, now_ms), max(end, now_ms + 1))
        return bounds

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
        entry = self._day(day_index)
        if isinstance(entry, int):
            slot = bisect_right(self._tod, now_ms - entry)
        else:
            slot = bisect_right(entry, now_ms)
        # slot == per_day is the first draw of the next day.
        draw = max(1, day_index * self._per_day + slot + 1)
        # Draws of the day before, held past midnight by a clock change, may still be open.
        while draw > 1 and self.close_ms(draw - 1) > now_ms:
            draw -= 1
        close = self.close_ms(draw)
        while close <= now_ms:
            draw += 1
            close = self.close_ms(draw)
        self._current = (draw, close, now_ms)
        return draw

    def is_past(self, draw: int, now_ms: int) -> bool:
        return self.close_ms(draw) <= now_ms


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def rfc3339(dt: datetime) -> str:
    """RFC 3339 with offset and at most millisecond precision."""
    return dt.isoformat(timespec="milliseconds") if dt.microsecond else dt.isoformat()


_seconds: dict[tzinfo, tuple[int, str, str]] = {}
"""Per time zone, the last whole second formatted: (second, date and time, offset)."""


def instant(ms: int, tz: tzinfo) -> str:
    """An instant (ms since the Unix epoch) in RFC 3339, in the time zone `tz`.

    Every receipt carries one: the second is formatted once (datetime's formatting costs
    a few µs) and the milliseconds put in, which gives `rfc3339`'s string exactly."""
    second, milli = divmod(ms, 1000)
    cached = _seconds.get(tz)
    if cached is None or cached[0] != second:
        text = datetime.fromtimestamp(second, tz).isoformat()
        cached = _seconds[tz] = (second, text[:19], text[19:])
    if milli:
        return f"{cached[1]}.{milli:03d}{cached[2]}"
    return cached[1] + cached[2]
