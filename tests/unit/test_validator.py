"""The pure rules of a sale: normalization, costs, and every rule error with its path."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from capsvc.client.models import TicketIn
from capsvc.config import GameRules, load_settings
from capsvc.domain import combination
from capsvc.domain.errors import ApiError
from capsvc.domain.validator import sale_fingerprint, validate_ticket
from tests.conftest import CONFIG

GAMES = load_settings(CONFIG).games
FDJ, LNM = GAMES["fdj-keno"], GAMES["lnm-keno"]


def sale_of(rules: GameRules, **fields: Any) -> Any:
    body: dict[str, Any] = {"ticket_id": "T-1", "game": rules.id,
                            "grids": [{"numbers": [5, 1, 3], "stake": rules.stakes[0]}]}
    if rules.daily_limit is not None:
        body["player_id"] = "P-1"
    body.update(fields)
    return validate_ticket(rules, msgspec.convert(body, TicketIn))


def rule_code(rules: GameRules, **fields: Any) -> tuple[str, str | None]:
    with pytest.raises(ApiError) as e:
        sale_of(rules, **fields)
    assert e.value.kind == "invalid"
    return e.value.code, e.value.path


def test_normalizes_numbers_and_prices() -> None:
    """Numbers come out sorted with their canonical key; cost = stake x mult x draws."""
    sale = sale_of(FDJ, draws=5, joker_plus=True, grids=[
        {"numbers": [56, 3, 7, 12, 18, 25, 33, 41], "stake": 500, "multiplier": True}])
    grid = sale.grids[0]
    assert grid.numbers == (3, 7, 12, 18, 25, 33, 41, 56)
    assert grid.combo == combination.encode([3, 7, 12, 18, 25, 33, 41, 56])
    assert grid.cost == 500 * 2 * 5
    assert grid.capped
    assert sale.joker_cost == 200 * 5
    assert sale.requested_cost == 5000 + 1000


def test_uncapped_sizes() -> None:
    """Only 8, 9 and 10 numbers are capped."""
    assert not sale_of(FDJ).grids[0].capped


def test_fingerprint_ignores_order_and_defaults() -> None:
    """The same ticket written differently has one fingerprint; another ticket differs."""
    a = sale_of(FDJ, grids=[{"numbers": [1, 2, 3], "stake": 100}])
    b = sale_of(FDJ, draws=1, joker_plus=False,
                grids=[{"numbers": [3, 2, 1], "stake": 100, "multiplier": False}])
    c = sale_of(FDJ, grids=[{"numbers": [1, 2, 3], "stake": 200}])
    assert sale_fingerprint(a) == sale_fingerprint(b) != sale_fingerprint(c)


@pytest.mark.parametrize(("rules", "fields", "code", "path"), [
    (FDJ, {"grids": [{"numbers": [1, 2, 3], "stake": 400}]}, "stake_not_allowed",
     "$.grids[0].stake"),
    (LNM, {"grids": [{"numbers": [1, 2, 3], "stake": 700}]}, "stake_not_allowed",
     "$.grids[0].stake"),
    (LNM, {"grids": [{"numbers": [1, 2, 3], "stake": 1500}]}, "stake_not_allowed",
     "$.grids[0].stake"),
    (FDJ, {"grids": [{"numbers": [1], "stake": 100}]}, "picks_not_allowed",
     "$.grids[0].numbers"),
    (FDJ, {"grids": [{"numbers": [1, 2, 71], "stake": 100}]}, "number_out_of_range",
     "$.grids[0].numbers[2]"),
    (LNM, {"grids": [{"numbers": [80, 81], "stake": 250}]}, "number_out_of_range",
     "$.grids[0].numbers[1]"),
    (FDJ, {"grids": [{"numbers": [4, 2, 4], "stake": 100}]}, "duplicate_numbers",
     "$.grids[0].numbers[2]"),
    (FDJ, {"draws": 4}, "draws_not_allowed", "$.draws"),
    (FDJ, {"grids": [{"numbers": [1, 2], "stake": 100}] * 21}, "too_many_grids", "$.grids"),
    (LNM, {"player_id": None}, "player_required", "$.player_id"),
    (LNM, {"joker_plus": True}, "option_not_available", "$.joker_plus"),
    (LNM, {"grids": [{"numbers": [1, 2], "stake": 250, "multiplier": True}]},
     "option_not_available", "$.grids[0].multiplier"),
    (FDJ, {"grids": [{"numbers": [1, 2], "stake": 100},
                     {"numbers": [1, 2], "stake": 150}]}, "stake_not_allowed",
     "$.grids[1].stake"),
])
def test_rule_errors(rules: GameRules, fields: dict[str, Any], code: str, path: str) -> None:
    """Each broken rule gives its code and the JSONPath of the offending value."""
    assert rule_code(rules, **fields) == (code, path)


@pytest.mark.parametrize("draws", [1, 2, 5, 10, 20])
@pytest.mark.parametrize("stake", [250, 500, 1000, 2500])
def test_lnm_subscription_costs_match_the_seed_table(stake: int, draws: int) -> None:
    """RULES.md §2: cost = stake x draws exactly (e.g. 2.5 dh x 5 = 12.5 dh)."""
    table = {  # dirhams, from the seed
        250: {2: 5, 5: 12.5, 10: 25, 20: 50},
        500: {2: 10, 5: 25, 10: 50, 20: 100},
        1000: {2: 20, 5: 50, 10: 100, 20: 200},
        2500: {2: 50, 5: 125, 10: 250, 20: 500},
    }
    sale = sale_of(LNM, draws=draws, grids=[{"numbers": [1, 2, 3], "stake": stake}])
    expected = stake if draws == 1 else round(table[stake][draws] * 100)
    assert sale.requested_cost == expected


def test_combination_key_round_trip() -> None:
    """The canonical key is injective and decodes back to the sorted numbers."""
    assert combination.encode([3, 7, 12]) == "\x03\x07\x0c"
    assert combination.decode(combination.encode([3, 7, 12])) == [3, 7, 12]
    assert combination.decode(b"\x03\x07\x0c") == [3, 7, 12]
    assert combination.encode([1, 23]) != combination.encode([3, 12])
    assert len(combination.encode(range(1, 11)).encode()) == 10  # one byte a number
    assert "\0" not in combination.encode(range(1, 100))  # never taken for a record
