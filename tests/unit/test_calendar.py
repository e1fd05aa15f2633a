"""The draw calendar: numbering, close instants, the current draw, DST days."""

from __future__ import annotations

from datetime import UTC, datetime
from itertools import pairwise

from capsvc.calendar import DrawCalendar
from capsvc.config import load_settings
from tests.conftest import CONFIG

GAMES = load_settings(CONFIG).games


def ms(text: str) -> int:
    return int(datetime.fromisoformat(text).timestamp() * 1000)


def test_draw_numbers_follow_each_other_across_days() -> None:
    """FDJ: two draws a day; draw n+1 follows draw n, also over midnight."""
    cal = DrawCalendar(GAMES["fdj-keno"])
    first = cal.current(ms("2026-11-30T10:00:00+01:00"))
    assert cal.closes_at(first).isoformat() == "2026-11-30T13:00:00+01:00"
    assert cal.closes_at(first + 1).isoformat() == "2026-11-30T20:00:00+01:00"
    assert cal.closes_at(first + 2).isoformat() == "2026-12-01T13:00:00+01:00"
    assert cal.current(ms("2026-11-30T13:00:00+01:00")) == first + 1
    assert cal.current(ms("2026-11-30T12:59:59.999+01:00")) == first
    assert cal.current(ms("2026-11-30T21:00:00+01:00")) == first + 2


def test_epoch_draw_is_number_one() -> None:
    """Draw 1 is the first draw of the epoch day."""
    cal = DrawCalendar(GAMES["fdj-keno"])
    assert cal.closes_at(1).isoformat() == "2008-11-17T13:00:00+01:00"


def test_lnm_every_five_minutes() -> None:
    """LNM: 08:00 to 23:55 every 5 minutes is 192 draws a day."""
    cal = DrawCalendar(GAMES["lnm-keno"])
    assert len(GAMES["lnm-keno"].draw_times) == 192
    d = cal.current(ms("2026-11-30T07:00:00+01:00"))
    assert cal.closes_at(d).isoformat() == "2026-11-30T08:00:00+01:00"
    assert cal.closes_at(d + 191).isoformat() == "2026-11-30T23:55:00+01:00"
    assert cal.closes_at(d + 192).isoformat() == "2026-12-01T08:00:00+01:00"


def test_dst_change_keeps_local_draw_times() -> None:
    """Across the spring and autumn changes, draws stay at 13:00 and 20:00 local time."""
    cal = DrawCalendar(GAMES["fdj-keno"])
    d = cal.current(ms("2026-03-28T14:00:00+01:00"))  # Paris goes to CEST on 29 March
    assert cal.closes_at(d).isoformat() == "2026-03-28T20:00:00+01:00"
    assert cal.closes_at(d + 1).isoformat() == "2026-03-29T13:00:00+02:00"
    assert cal.close_ms(d + 1) - cal.close_ms(d) == 16 * 3_600_000
    d = cal.current(ms("2026-10-24T14:00:00+02:00"))  # back to CET on 25 October
    assert cal.close_ms(d + 1) - cal.close_ms(d) == 18 * 3_600_000


def test_close_instants_are_strictly_increasing() -> None:
    """Over a year of draws, every close is after the previous one."""
    cal = DrawCalendar(GAMES["fdj-keno"])
    d = cal.current(int(datetime(2026, 1, 1, tzinfo=UTC).timestamp() * 1000))
    closes = [cal.close_ms(n) for n in range(d, d + 730)]
    assert all(a < b for a, b in pairwise(closes))
