"""Property tests: whatever JSON arrives, the rules answer a priced sale or a 4xx error."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capsvc.client.models import TicketIn
from capsvc.config import GameRules, load_settings
from capsvc.domain.errors import ApiError
from capsvc.domain.validator import Sale, validate_ticket
from capsvc.http.app import decode_body
from tests.conftest import CONFIG

GAMES = load_settings(CONFIG).games

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner,
                                                                 max_size=5),
    max_leaves=30,
)

grid = st.fixed_dictionaries(
    {"numbers": st.lists(st.integers(-5, 90), max_size=12),
     "stake": st.sampled_from([0, 100, 200, 250, 300, 500, 700, 1000, 1500, 2500, -100])},
    optional={"multiplier": st.booleans()},
)
near_valid = st.fixed_dictionaries(
    {"ticket_id": st.from_regex(r"[A-Za-z0-9._:-]{1,64}", fullmatch=True),
     "game": st.sampled_from(sorted(GAMES)),
     "grids": st.lists(grid, min_size=0, max_size=22)},
    optional={"player_id": st.from_regex(r"[A-Za-z0-9]{1,8}", fullmatch=True),
              "draws": st.integers(-1, 25), "joker_plus": st.booleans(),
              "first_draw": st.integers(-10, 10**6)},
)


def outcome(doc: Any) -> tuple[TicketIn, GameRules, Sale] | ApiError | None:
    """The validated sale, the rule error, or None for a game that does not exist."""
    try:
        t = decode_body(json.dumps(doc).encode(), TicketIn)
        rules = GAMES.get(t.game)
        return None if rules is None else (t, rules, validate_ticket(rules, t))
    except ApiError as e:
        return e


def check(doc: Any) -> None:
    result = outcome(doc)
    if isinstance(result, ApiError):
        assert result.kind not in ("internal", "unavailable")
        assert result.code
        return
    if result is None:
        return
    t, rules, sale = result
    expected = sum(g.stake * (2 if g.multiplier else 1) * t.draws for g in t.grids)
    if t.joker_plus:
        expected += (rules.joker_plus_price or 0) * t.draws
    assert sale.requested_cost == expected
    assert all(g.stake in rules.stakes for g in sale.grids)
    assert all(list(g.numbers) == sorted(set(g.numbers)) for g in sale.grids)
    assert all(1 <= n <= rules.numbers for g in sale.grids for n in g.numbers)
    assert sale.draws in rules.durations


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(json_values)
def test_any_json_is_a_sale_or_a_4xx(doc: Any) -> None:
    """Arbitrary JSON never raises anything but a 4xx ApiError."""
    check(doc)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(near_valid)
def test_ticket_shaped_input_is_priced_by_the_formula(doc: dict[str, Any]) -> None:
    """Ticket-shaped input: a sale costs stake x multiplier x draws (+ Joker+), or a 4xx."""
    check(doc)
