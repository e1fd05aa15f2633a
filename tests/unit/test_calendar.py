"""The draw calendar: numbering, close instants, the current draw, clock changes."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from itertools import pairwise
from typing import Any
from zoneinfo import ZoneInfo, available_timezones

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capsvc.config import GameRules, load_settings, parse_settings
from capsvc.domain.calendar import DrawCalendar, instant, rfc3339
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


# Clock changes. Both zones below change on the hour: Paris at 01:00 UTC (last Sundays of
# March and October), Morocco at 02:00 UTC (back an hour during Ramadan: 15 February 2026 and
# 7 February 2027, forward again on 22 March 2026 and 14 March 2027).

ZONES = ("Europe/Paris", "Africa/Casablanca")
SCHEDULES: dict[str, dict[str, Any]] = {
    "every 4 minutes": {"draw_every": "4m", "draw_from": "00:00", "draw_until": "23:59"},
    "every minute": {"draw_every": "1m", "draw_from": "00:00", "draw_until": "23:59"},
    "around 02:00": {"draw_times": ["02:00", "02:30", "03:00"]},
}
EPOCH = date(2025, 12, 31)  # the day before the two years under test
DAYS = 730  # 2026 and 2027


def game(time_zone: str, epoch: date = EPOCH, **schedule: Any) -> GameRules:
    doc = {"games": [{"id": "g", "preset": "lnm-keno", "time_zone": time_zone,
                      "draw_epoch": epoch.isoformat(), **schedule}], "channels": []}
    return parse_settings(doc).games["g"]


CALENDARS = {(z, s): DrawCalendar(game(z, **SCHEDULES[s])) for z in ZONES for s in SCHEDULES}


def change_days(tz: ZoneInfo, first: date, days: int) -> list[date]:
    """The days whose UTC offset is not the same at both ends (or whose midnight is odd)."""
    def starts(d: date) -> tuple[float, float]:
        w = datetime.combine(d, datetime.min.time(), tz)
        return w.timestamp(), w.replace(fold=1).timestamp()
    found = []
    for i in range(days):
        d = first + timedelta(days=i)
        (a, a1), (b, b1) = starts(d), starts(d + timedelta(days=1))
        if a != a1 or b != b1 or b - a != 86_400:
            found.append(d)
    return found


def draws_of(cal: DrawCalendar, day: date) -> range:
    n = len(cal.rules.draw_times)
    first = (day - cal.rules.draw_epoch).days * n + 1
    return range(first, first + n)


def expected_closes(rules: GameRules, days: list[date]) -> list[int]:
    """The rule written out independently (both zones tested change on the hour)."""
    closes: list[int] = []
    for day in days:
        for t in rules.draw_times:
            wall = datetime.combine(day, t, rules.tz)
            first, other = int(wall.timestamp()), int(wall.replace(fold=1).timestamp())
            # An existing time at its first occurrence; a skipped one at the hour the clock
            # jumps (fold 1 reads it an hour early, before the jump); then 1 ms after the last.
            natural = (first if first <= other else (other // 3600 + 1) * 3600) * 1000
            closes.append(natural if not closes or natural > closes[-1] else closes[-1] + 1)
    return closes


@pytest.mark.parametrize("zone", ZONES)
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_closes_increase_every_day_of_two_years(zone: str, schedule: str) -> None:
    """Every draw of 2026-2027 closes after the one before, on its own local day."""
    cal = CALENDARS[zone, schedule]
    n = len(cal.rules.draw_times)
    closes = [cal.close_ms(d) for d in range(n + 1, n * (DAYS + 1) + 1)]
    assert all(a < b for a, b in pairwise(closes))
    for i in range(DAYS):
        day = (EPOCH + timedelta(days=i + 1)).isoformat()
        # Closes increase, so the first and the last draw of a day bracket all the others.
        assert cal.local_days(n * (i + 1) + 1, 1) == [day]
        assert cal.local_days(n * (i + 2), 1) == [day]


@pytest.mark.parametrize("zone", ZONES)
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_change_days_follow_the_rule(zone: str, schedule: str) -> None:
    """Around each clock change of 2026-2027, closes are exactly those the rule gives."""
    cal = CALENDARS[zone, schedule]
    changes = change_days(cal.rules.tz, date(2026, 1, 1), DAYS)
    assert len(changes) == 4
    for day in changes:
        days = [day + timedelta(days=k) for k in (-1, 0, 1)]
        draws = range(draws_of(cal, days[0]).start, draws_of(cal, days[-1]).stop)
        assert [cal.close_ms(d) for d in draws] == expected_closes(cal.rules, days)


@pytest.mark.parametrize(("zone", "day", "times", "closes"), [
    ("Europe/Paris", "2026-03-29", ["02:00", "02:30", "03:00"],
     ["03:00:00+02:00", "03:00:00.001+02:00", "03:00:00.002+02:00"]),
    ("Europe/Paris", "2026-03-29", ["01:59", "02:30", "03:01"],
     ["01:59:00+01:00", "03:00:00+02:00", "03:01:00+02:00"]),
    ("Europe/Paris", "2026-10-25", ["02:00", "02:30", "03:00"],
     ["02:00:00+02:00", "02:30:00+02:00", "03:00:00+01:00"]),
    ("Europe/Paris", "2027-03-28", ["02:00", "02:30", "03:00"],
     ["03:00:00+02:00", "03:00:00.001+02:00", "03:00:00.002+02:00"]),
    ("Europe/Paris", "2027-10-31", ["02:00", "02:30", "03:00"],
     ["02:00:00+02:00", "02:30:00+02:00", "03:00:00+01:00"]),
    ("Africa/Casablanca", "2026-02-15", ["02:00", "02:30", "03:00"],
     ["02:00:00+01:00", "02:30:00+01:00", "03:00:00+00:00"]),
    ("Africa/Casablanca", "2026-03-22", ["02:00", "02:30", "03:00"],
     ["03:00:00+01:00", "03:00:00.001+01:00", "03:00:00.002+01:00"]),
    ("Africa/Casablanca", "2027-02-07", ["02:00", "02:30", "03:00"],
     ["02:00:00+01:00", "02:30:00+01:00", "03:00:00+00:00"]),
    ("Africa/Casablanca", "2027-03-14", ["02:00", "02:30", "03:00"],
     ["03:00:00+01:00", "03:00:00.001+01:00", "03:00:00.002+01:00"]),
])
def test_skipped_and_repeated_times(zone: str, day: str, times: list[str],
                                    closes: list[str]) -> None:
    """A skipped time closes when the clock jumps (1 ms apart), a repeated one at its first."""
    cal = DrawCalendar(game(zone, draw_times=times))
    got = [rfc3339(cal.closes_at(d)) for d in draws_of(cal, date.fromisoformat(day))]
    assert got == [f"{day}T{c}" for c in closes]


def test_every_four_minutes_through_the_paris_gap() -> None:
    """Paris, every 4 min: 02:00-02:56 close at 03:00 1 ms apart, 03:00 next, 03:04 on time."""
    cal = CALENDARS["Europe/Paris", "every 4 minutes"]
    draws = draws_of(cal, date(2026, 3, 29))
    at_two = draws.start + 30  # 02:00 is the 31st draw of the day
    assert rfc3339(cal.closes_at(at_two - 1)) == "2026-03-29T01:56:00+01:00"
    for k in range(15):
        assert cal.close_ms(at_two + k) == ms("2026-03-29T03:00:00+02:00") + k
    assert rfc3339(cal.closes_at(at_two + 15)) == "2026-03-29T03:00:00.015+02:00"
    assert rfc3339(cal.closes_at(at_two + 16)) == "2026-03-29T03:04:00+02:00"
    assert cal.current(ms("2026-03-29T01:59:59.999+01:00")) == at_two
    assert cal.current(ms("2026-03-29T03:00:00.007+02:00")) == at_two + 8
    assert cal.current(ms("2026-03-29T03:00:00.015+02:00")) == at_two + 16


def test_repeated_hour_has_its_draws_once() -> None:
    """When Paris falls back, the 02:xx draws are in the first 02:xx hour, none in the second."""
    cal = CALENDARS["Europe/Paris", "every 4 minutes"]
    at_two = draws_of(cal, date(2026, 10, 25)).start + 30
    assert rfc3339(cal.closes_at(at_two)) == "2026-10-25T02:00:00+02:00"
    assert rfc3339(cal.closes_at(at_two + 14)) == "2026-10-25T02:56:00+02:00"
    assert rfc3339(cal.closes_at(at_two + 15)) == "2026-10-25T03:00:00+01:00"
    assert cal.current(ms("2026-10-25T02:30:00+01:00")) == at_two + 15


@pytest.mark.parametrize("zone", ZONES)
@pytest.mark.parametrize("schedule", [*sorted(SCHEDULES), "every 2 seconds"])
def test_current_turns_over_exactly_at_each_close(zone: str, schedule: str) -> None:
    """Around each clock change, current() turns from d to d + 1 exactly at d's close."""
    every_2s = {"draw_every": "2s", "draw_from": "00:00", "draw_until": "23:59:58"}
    cal = DrawCalendar(game(zone, **(SCHEDULES.get(schedule) or every_2s)))
    for day in change_days(cal.rules.tz, date(2026, 1, 1), 365):
        first = draws_of(cal, day - timedelta(days=1)).start
        last = draws_of(cal, day + timedelta(days=1)).stop - 1
        for d in range(first, last):
            close = cal.close_ms(d)
            assert cal.current(close - 1) == d
            assert cal.current(close) == d + 1
        for d in (first, (first + last) // 2, last):
            assert DrawCalendar(cal.rules).current(cal.close_ms(d) - 1) == d


def _transitions(zone: str) -> list[int]:
    tz = ZoneInfo(zone)
    return [int(datetime.combine(d + timedelta(days=1), datetime.min.time(), tz).timestamp()
                * 1000) for d in change_days(tz, EPOCH, DAYS + 1)]


NEAR_CHANGES = st.sampled_from(sorted(CALENDARS)).flatmap(
    lambda key: st.tuples(st.just(key), st.sampled_from(_transitions(key[0])).flatmap(
        lambda t: st.integers(t - 30 * 3_600_000, t + 6 * 3_600_000))))
ANYWHEN = st.tuples(st.sampled_from(sorted(CALENDARS)),
                    st.integers(ms("2026-01-01T00:00:00+00:00"),
                                ms("2027-12-31T12:00:00+00:00")))


@given(NEAR_CHANGES | ANYWHEN)
@settings(max_examples=300, deadline=None)
def test_current_is_the_first_open_draw(case: tuple[tuple[str, str], int]) -> None:
    """At any instant, current() is the first draw whose close is later than it."""
    key, now = case
    cal = CALENDARS[key]
    d = cal.current(now)
    assert cal.close_ms(d) > now >= cal.close_ms(d - 1)
    assert cal.local_date(now) <= date.fromisoformat(cal.local_days(d, 1)[0])


@given(zone=st.sampled_from(sorted(available_timezones())), year=st.integers(1970, 2037),
       schedule=st.sampled_from([
           {"draw_every": "10m", "draw_from": "00:00", "draw_until": "23:59"},
           {"draw_every": "1m", "draw_from": "00:30", "draw_until": "04:00"},
           {"draw_times": ["00:00", "00:30", "01:00", "02:00", "02:30", "03:00", "23:30"]},
       ]))
@settings(max_examples=150, deadline=None)
def test_any_zone_any_year(zone: str, year: int, schedule: dict[str, Any]) -> None:
    """In any zone, across a year's clock changes, closes increase and current() follows."""
    cal = DrawCalendar(game(zone, date(year - 1, 12, 30), **schedule))
    for day in change_days(cal.rules.tz, date(year, 1, 1), 365):
        draws = range(draws_of(cal, day - timedelta(days=1)).start,
                      draws_of(cal, day + timedelta(days=1)).stop)
        closes = [cal.close_ms(d) for d in draws]
        assert all(a < b for a, b in pairwise(closes))
        for d, close in zip(draws, closes, strict=True):
            assert cal.current(close - 1) == d


@pytest.mark.parametrize(("zone", "epoch", "odd_day"), [
    ("America/Nuuk", "2026-03-25", "2026-03-28"),  # 23:00 becomes 00:00
    ("America/Toronto", "1919-03-28", "1919-03-30"),  # 23:30 became 00:30
    ("Pacific/Apia", "2011-12-27", "2011-12-30"),  # a day that never was
])
def test_changes_across_midnight(zone: str, epoch: str, odd_day: str) -> None:
    """Draws held past midnight by a gap stay in order, on sale, and count on their close day."""
    cal = DrawCalendar(game(zone, date.fromisoformat(epoch), draw_every="10m",
                            draw_from="00:00", draw_until="23:59"))
    closes = [cal.close_ms(d) for d in range(1, 144 * 6 + 1)]
    assert all(a < b for a, b in pairwise(closes))
    for d, close in enumerate(closes, start=1):
        assert cal.current(close - 1) == d
        assert DrawCalendar(cal.rules).current(close - 1) == d
    last = draws_of(cal, date.fromisoformat(odd_day)).stop - 1
    assert cal.local_days(last, 1) == [(date.fromisoformat(odd_day) + timedelta(days=1))
                                       .isoformat()]


def test_greenland_evening_draws_close_on_sunday() -> None:
    """Nuuk, 28 March 2026: the skipped 23:xx draws close from 00:00 Sunday, 1 ms apart."""
    cal = DrawCalendar(game("America/Nuuk", draw_every="4m", draw_from="00:00",
                            draw_until="23:59"))
    at_eleven = draws_of(cal, date(2026, 3, 28)).start + 345  # 23:00, the 346th draw
    assert rfc3339(cal.closes_at(at_eleven - 1)) == "2026-03-28T22:56:00-02:00"
    assert rfc3339(cal.closes_at(at_eleven)) == "2026-03-29T00:00:00-01:00"
    assert rfc3339(cal.closes_at(at_eleven + 14)) == "2026-03-29T00:00:00.014-01:00"
    assert rfc3339(cal.closes_at(at_eleven + 15)) == "2026-03-29T00:00:00.015-01:00"
    assert rfc3339(cal.closes_at(at_eleven + 16)) == "2026-03-29T00:04:00-01:00"
    assert cal.local_days(at_eleven - 1, 2) == ["2026-03-28", "2026-03-29"]
    assert cal.current(ms("2026-03-28T22:59:59.999-02:00")) == at_eleven
    assert cal.current(ms("2026-03-29T00:00:00.003-01:00")) == at_eleven + 4


# Draws every few seconds.

def test_draws_every_two_seconds() -> None:
    """Every 2 s from 00:00 to 23:59:58 is 43,200 draws a day, numbered across days."""
    cal = DrawCalendar(game("Europe/Paris", draw_every="2s", draw_from="00:00",
                            draw_until="23:59:58"))
    assert len(cal.rules.draw_times) == 43_200
    d = cal.current(ms("2026-11-30T12:00:00.500+01:00"))
    assert rfc3339(cal.closes_at(d)) == "2026-11-30T12:00:02+01:00"
    assert cal.current(ms("2026-11-30T12:00:02+01:00")) == d + 1
    last = draws_of(cal, date(2026, 11, 30)).stop - 1
    assert rfc3339(cal.closes_at(last)) == "2026-11-30T23:59:58+01:00"
    assert rfc3339(cal.closes_at(last + 1)) == "2026-12-01T00:00:00+01:00"
    assert cal.current(ms("2026-11-30T23:59:59+01:00")) == last + 1


def test_two_seconds_through_the_paris_gap() -> None:
    """Every 2 s in Paris: the skipped hour's 1,800 draws close 1 ms apart from 03:00."""
    cal = DrawCalendar(game("Europe/Paris", draw_every="2s", draw_from="00:00",
                            draw_until="23:59:58"))
    at_two = draws_of(cal, date(2026, 3, 29)).start + 3600
    jump = ms("2026-03-29T03:00:00+02:00")
    assert cal.close_ms(at_two - 1) == jump - 2000
    assert [cal.close_ms(at_two + k) for k in range(1800)] == list(range(jump, jump + 1800))
    assert cal.close_ms(at_two + 1800) == jump + 1800
    assert cal.close_ms(at_two + 1801) == jump + 2000


@settings(max_examples=2000, deadline=None)
@given(ms=st.integers(min_value=0, max_value=4_102_444_800_000),
       zone=st.sampled_from(["Europe/Paris", "Pacific/Tahiti", "Africa/Casablanca", "UTC",
                             "Australia/Lord_Howe", "America/St_Johns", "Asia/Kathmandu"]))
def test_an_instant_is_rfc3339_of_its_datetime(ms: int, zone: str) -> None:
    """The per-second cache gives the string of the datetime itself, across offsets and
    transitions, with and without milliseconds."""
    tz = ZoneInfo(zone)
    for at in (ms, ms - ms % 1000, ms + 1):
        assert instant(at, tz) == rfc3339(datetime.fromtimestamp(at / 1000, tz))
