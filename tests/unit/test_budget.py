"""What a ticket takes from a player's daily budget, by policy, across midnight and DST."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec
import pytest

from capsvc.client.models import TicketIn
from capsvc.config import GameRules, parse_settings
from capsvc.domain.calendar import DrawCalendar
from capsvc.domain.validator import Sale, budget_shares, validate_ticket


def game(policy: str, **overrides: Any) -> GameRules:
    doc = {"games": [{"id": "g", "preset": "lnm-keno", "subscription_accounting": policy,
                      "time_zone": "Europe/Paris", "draw_times": ["00:30", "23:30"],
                      **overrides}],
           "channels": []}
    return parse_settings(doc).games["g"]


def sale_on(rules: GameRules, first_draw: int, draws: int, stakes: list[int]) -> Sale:
    t = msgspec.convert({"ticket_id": "T", "game": "g", "player_id": "P", "draws": draws,
                         "first_draw": first_draw,
                         "grids": [{"numbers": [1, 2], "stake": s} for s in stakes]}, TicketIn)
    return validate_ticket(rules, t)


def ms(text: str) -> int:
    return int(datetime.fromisoformat(text).timestamp() * 1000)


def draw_at(cal: DrawCalendar, local: str) -> int:
    """The draw closing at that local instant."""
    d = cal.current(ms(local) - 1)
    assert cal.close_ms(d) == ms(local)
    return d


@pytest.mark.parametrize(("policy", "expected"), [
    ("purchase_day", [("2026-11-30", 1000)]),
    ("draw_day", [("2026-11-30", 500), ("2026-12-01", 500)]),
])
def test_across_midnight(policy: str, expected: list[tuple[str, int]]) -> None:
    """A 2-draw subscription at 23:30 and 00:30: one day, or each draw on its own day."""
    rules = game(policy)
    cal = DrawCalendar(rules)
    first = draw_at(cal, "2026-11-30T23:30:00+01:00")
    sale = sale_on(rules, first, 2, [500])
    days = cal.local_days(first, 2)
    assert budget_shares(days, sale, policy, "2026-11-30") == expected


@pytest.mark.parametrize("policy", ["purchase_day", "draw_day"])
def test_across_a_dst_change(policy: str) -> None:
    """Over the night of 28-29 March 2026 (Paris goes to summer time at 02:00), draws keep
    their local days and the amounts add up to the cost."""
    rules = game(policy)
    cal = DrawCalendar(rules)
    first = draw_at(cal, "2026-03-28T23:30:00+01:00")
    assert cal.closes_at(first + 1).isoformat() == "2026-03-29T00:30:00+01:00"
    assert cal.closes_at(first + 2).isoformat() == "2026-03-29T23:30:00+02:00"
    sale = sale_on(rules, first, 5, [250, 1000])
    shares = budget_shares(cal.local_days(first, 5), sale, policy, "2026-03-28")
    assert sum(amount for _, amount in shares) == sale.requested_cost == 6250
    if policy == "draw_day":
        assert shares == [("2026-03-28", 1250), ("2026-03-29", 2500), ("2026-03-30", 2500)]
    else:
        assert shares == [("2026-03-28", 6250)]


def test_accepted_grids_only() -> None:
    """Grids the cap refused do not count; with none accepted, nothing counts."""
    rules = game("draw_day")
    cal = DrawCalendar(rules)
    first = draw_at(cal, "2026-11-30T23:30:00+01:00")
    sale = sale_on(rules, first, 2, [500, 2500])
    days = cal.local_days(first, 2)
    assert budget_shares(days, sale, "draw_day", "x", {1}) == [
        ("2026-11-30", 2500), ("2026-12-01", 2500)]
    assert budget_shares(days, sale, "draw_day", "x", set()) == [
        ("2026-11-30", 0), ("2026-12-01", 0)]
