"""The OpenAPI document of a configured service says, per game, what the service enforces
on a ticket: a ticket is valid by its game's schema exactly when the validator accepts it
(everything but the draw on sale, which moves with the clock). Property-based, both ways:
a schema looser than the service would have generated clients send what is refused; a
stricter one would have them refuse what sells."""

from __future__ import annotations

import tomllib
from functools import cache
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from capsvc.config import GameRules, parse_settings
from capsvc.domain.errors import ApiError
from capsvc.domain.models import TicketIn
from capsvc.domain.validator import validate_ticket
from capsvc.http.openapi import openapi_document
from tests.contract.conftest import CONFIG


@cache
def games() -> dict[str, GameRules]:
    return parse_settings(tomllib.loads(CONFIG.read_text()), str(CONFIG)).games


@cache
def validators() -> dict[str, Draft202012Validator]:
    doc = openapi_document(list(games().values()))
    body = doc["paths"]["/v1/tickets"]["post"]["requestBody"]["content"]["application/json"]
    assert {r["$ref"].rsplit("-", 2)[0] for r in body["schema"]["oneOf"]} == {
        "#/components/schemas/TicketIn"}
    return {g: Draft202012Validator({"$ref": f"#/components/schemas/TicketIn-{g}",
                                     "components": doc["components"]}) for g in games()}


def schema_accepts(ticket: dict[str, Any]) -> bool:
    return validators()[ticket["game"]].is_valid(ticket)


def service_accepts(ticket: dict[str, Any]) -> bool:
    try:
        validate_ticket(games()[ticket["game"]], msgspec.convert(ticket, TicketIn))
    except (ApiError, msgspec.ValidationError):
        return False
    return True


STAKES = sorted({s for g in games().values() for s in g.stakes} | {0, 7, 150, 10_000})


@st.composite
def tickets(draw: st.DrawFn) -> dict[str, Any]:
    """A ticket of a configured game, each field either drawn from the game's rules or
    anything near them (so that both sides, and every boundary, are reached often)."""
    g = games()[draw(st.sampled_from(sorted(games())))]
    numbers = st.one_of(
        st.lists(st.integers(1, g.numbers), min_size=g.picks_min, max_size=g.picks_max,
                 unique=True),
        st.lists(st.integers(0, 85), min_size=0, max_size=12))
    stakes = st.one_of(st.sampled_from(g.stakes), st.sampled_from(STAKES))
    grids = st.fixed_dictionaries({"numbers": numbers, "stake": stakes},
                                  optional={"multiplier": st.booleans()})
    ticket = {"ticket_id": "T-1", "game": g.id,
              "grids": draw(st.lists(grids, min_size=1,
                                     max_size=draw(st.sampled_from([3, g.max_grids + 2]))))}
    if draw(st.booleans()):
        ticket["player_id"] = draw(st.sampled_from(["P-1", None]))
    if draw(st.booleans()):
        ticket["draws"] = draw(st.one_of(st.sampled_from(g.durations),
                                         st.sampled_from([0, 1, 2, 3, 5, 10, 20, 21])))
    if draw(st.booleans()):
        ticket["joker_plus"] = draw(st.booleans())
    return ticket


@settings(max_examples=1500, deadline=None)
@given(tickets())
def test_a_ticket_is_valid_by_its_games_schema_exactly_when_the_service_accepts_it(
        ticket: dict[str, Any]) -> None:
    assert schema_accepts(ticket) == service_accepts(ticket), ticket


def test_examples_of_each_side() -> None:
    ten = [3, 7, 12, 18, 25, 33, 41, 56, 60, 70]
    fdj = {"ticket_id": "T-1", "game": "fdj-keno", "grids": [{"numbers": ten, "stake": 500}]}
    lnm = {"ticket_id": "T-1", "game": "lnm-keno", "player_id": "P-1", "draws": 5,
           "grids": [{"numbers": ten, "stake": 250}]}
    for ticket in (fdj, lnm):
        assert schema_accepts(ticket)
        assert service_accepts(ticket)
    refused = [
        {**fdj, "grids": [{"numbers": [*ten[:9], 3], "stake": 500}]},  # duplicate
        {**fdj, "grids": [{"numbers": ten, "stake": 250}]},  # an LNM stake
        {**fdj, "grids": [{"numbers": [*ten[:9], 71], "stake": 500}]},  # out of 1..70
        {**lnm, "player_id": None},  # player limits: the player is named
        {**lnm, "grids": [{"numbers": ten, "stake": 250, "multiplier": True}]},
        {**lnm, "joker_plus": True},
        {**lnm, "draws": 3},
    ]
    for ticket in refused:
        assert not schema_accepts(ticket), ticket
        assert not service_accepts(ticket), ticket


def test_a_document_for_some_games_changes_nothing_of_the_next_one() -> None:
    """The game-specific document narrows copies of its parameters: one built without
    games afterwards still has the game id's pattern (the parameters are shared)."""
    narrowed = openapi_document(list(games().values()))
    plain = openapi_document()

    def game_params(doc: dict[str, Any]) -> list[dict[str, Any]]:
        return [p["schema"] for item in doc["paths"].values() for op in item.values()
                for p in op.get("parameters", []) if (p["name"], p["in"]) == ("game", "path")]

    assert all("enum" in s for s in game_params(narrowed))
    assert all("pattern" in s and "enum" not in s for s in game_params(plain))
