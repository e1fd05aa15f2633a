"""The contract: one OpenAPI document, checked into the repository as `openapi.json`, the
same for every deployment. What a game allows is served by `GET /v1/games` and enforced by
the validator with the documented errors, so the document may be looser than a game but
never stricter: every ticket a configured game accepts is valid by the document
(property-based), and what the document lets through that a game refuses is refused with a
documented code."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate

from capsvc.client.models import TicketIn
from capsvc.config import GameRules, parse_settings
from capsvc.domain.errors import ApiError
from capsvc.domain.validator import validate_ticket
from capsvc.http.openapi import CONTRACT_VERSION, as_openapi_30, main, openapi_document
from tests.contract.conftest import CONFIG

CHECKED_IN = Path(__file__).parents[2] / "openapi.json"
CHECKED_IN_30 = Path(__file__).parents[2] / "openapi-3.0.json"


@cache
def games() -> dict[str, GameRules]:
    return parse_settings(tomllib.loads(CONFIG.read_text()), str(CONFIG)).games


@cache
def validator() -> Draft202012Validator:
    doc = openapi_document()
    body = doc["paths"]["/v1/tickets"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/TicketIn"}
    return Draft202012Validator({**body["schema"], "components": doc["components"]})


def schema_accepts(ticket: dict[str, Any]) -> bool:
    return validator().is_valid(ticket)


def refusal(ticket: dict[str, Any]) -> str | None:
    """The validator's error code for the ticket, None when it accepts it."""
    try:
        validate_ticket(games()[ticket["game"]], msgspec.convert(ticket, TicketIn))
    except ApiError as e:
        return e.code
    except msgspec.ValidationError:
        return "invalid_request"
    return None


def service_accepts(ticket: dict[str, Any]) -> bool:
    return refusal(ticket) is None


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
def test_every_ticket_a_game_accepts_is_valid_by_the_document(ticket: dict[str, Any]) -> None:
    if service_accepts(ticket):
        assert schema_accepts(ticket), ticket


def test_what_the_document_lets_through_a_game_refuses_with_a_documented_code() -> None:
    ten = [3, 7, 12, 18, 25, 33, 41, 56, 60, 70]
    fdj = {"ticket_id": "T-1", "game": "fdj-keno", "grids": [{"numbers": ten, "stake": 500}]}
    lnm = {"ticket_id": "T-1", "game": "lnm-keno", "player_id": "P-1", "draws": 5,
           "grids": [{"numbers": ten, "stake": 250}]}
    for ticket in (fdj, lnm):
        assert schema_accepts(ticket)
        assert service_accepts(ticket)
    refused = [
        ({**fdj, "grids": [{"numbers": [*ten[:9], 3], "stake": 500}]}, "duplicate_numbers"),
        ({**fdj, "grids": [{"numbers": ten, "stake": 250}]}, "stake_not_allowed"),
        ({**fdj, "grids": [{"numbers": [*ten[:9], 71], "stake": 500}]},
         "number_out_of_range"),
        ({**fdj, "grids": [{"numbers": [1], "stake": 500}]}, "picks_not_allowed"),
        ({**lnm, "player_id": None}, "player_required"),
        ({**lnm, "draws": 3}, "draws_not_allowed"),
        ({**fdj, "game": "no-such-game"}, None),  # unknown game: 404, by the service
    ]
    for ticket, code in refused:
        assert schema_accepts(ticket), ticket
        if code is not None:
            assert refusal(ticket) == code, ticket
    documented = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    for _, code in refused:
        if code is not None:
            assert f"`{code}`" in documented, code


def test_the_repository_keeps_the_document_as_the_service_serves_it(
        capsys: Any) -> None:
    """`openapi.json` is the document, byte for byte as `python -m capsvc.http.openapi`
    writes it: a change to the API's types shows in the file's diff."""
    main([])
    written = capsys.readouterr().out
    assert CHECKED_IN.read_text() == written, (
        "openapi.json is not the document the code makes: review the change, then "
        "`python -m capsvc.http.openapi > openapi.json`")
    assert json.loads(written)["info"]["version"] == CONTRACT_VERSION
    main(["--3.0"])
    assert CHECKED_IN_30.read_text() == capsys.readouterr().out, (
        "openapi-3.0.json is not the document the code makes: "
        "`python -m capsvc.http.openapi --3.0 > openapi-3.0.json`")


def test_both_renderings_are_valid_openapi_and_say_the_same() -> None:
    """openapi.json is valid OpenAPI 3.1, openapi-3.0.json valid 3.0.3, and the 3.0 one
    is the 3.1 one but for how nullable values, examples and described references are
    written."""
    doc = openapi_document()
    validate(doc)
    old = as_openapi_30(doc)
    assert old["openapi"] == "3.0.3"
    validate(old)
    assert old["paths"].keys() == doc["paths"].keys()
    assert old["components"]["schemas"].keys() == doc["components"]["schemas"].keys()
    text = json.dumps(old)
    assert '"type": "null"' not in text
    assert '"examples"' not in json.dumps(old["components"])
    first_draw = old["components"]["schemas"]["TicketIn"]["properties"]["first_draw"]
    assert first_draw["nullable"] is True
    assert first_draw["type"] == "integer"


def test_the_document_names_no_game_of_any_configuration() -> None:
    """Nothing configured is compiled into it: no game id, no game's stake list."""
    text = json.dumps(openapi_document())
    for g in games().values():
        assert f'"{g.id}"' not in text
    schemas = openapi_document()["components"]["schemas"]
    assert "enum" not in schemas["GridIn"]["properties"]["stake"]
    assert [n for n in schemas if "-" in n] == []


def test_optional_fields_read_as_generated_clients_read_them() -> None:
    """No `default` keyword (a generator makes such a field required); a request's default
    is in its description; a response field that is absent at its default is never null."""
    schemas = openapi_document()["components"]["schemas"]
    def keys(node: Any) -> set[str]:
        if isinstance(node, dict):
            return set(node).union(*(keys(v) for v in node.values()))
        return set().union(*(keys(v) for v in node)) if isinstance(node, list) else set()

    assert "default" not in keys(schemas)
    assert "Default: 1." in schemas["TicketIn"]["properties"]["draws"]["description"]
    assert "Default: false." in schemas["GridIn"]["properties"]["multiplier"]["description"]
    grid = schemas["GridOut"]
    assert grid["properties"]["cost"] == {
        "type": "integer", "format": "int64",
        "description": "minor units of the game's currency (cents, centimes)"}
    assert "cost" not in grid["required"]
    assert schemas["TicketCounts"]["required"] == [
        "accepted", "partial", "rejected", "cancelled", "void"]
    assert schemas["TicketOut"]["properties"]["status"]["type"] == "string"


BELOW_2_31 = {
    "draw", "first_draw", "grace",  # draw numbers up to 10^9; seconds up to 999999
    "draws", "durations", "sales_horizon",  # a ticket's draws: up to 1000; the horizon 10^4
    "numbers", "picks", "picks_min", "picks_max", "capped_picks",  # below 100
    "CappedOut.combinations",  # a combination's numbers
    "index", "max_grids", "ListedTicket.grids",  # a ticket's grids: up to 100
    "retention_seconds", "grace_ms",  # up to 366 days; up to 999999 s
    "report", "status",  # the report's format; an HTTP status
}
"""The integers the contract bounds far below 2^31, by field (or schema.field): 32 bits."""


def integers(node: Any, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every integer schema under `node`, named `Schema.field` (or a parameter's name)."""
    if isinstance(node, list):
        for n in node:
            yield from integers(n, where)
    elif isinstance(node, dict):
        if node.get("type") == "integer":
            yield where, node
        for key, value in node.items():
            if key == "properties":
                for name, prop in value.items():
                    yield from integers(prop, f"{where.split('.')[0]}.{name}")
            else:
                yield from integers(value, where)


MONEY = "minor units of the game's currency (cents, centimes)"


def test_money_and_counts_are_64_bits_and_say_their_unit() -> None:
    """A generator gives an integer without a format 32 bits (`Integer` in Java), which an
    amount in minor units, or a count that sums sales, can pass. Every integer of both
    renderings is `format: int64` with its unit in its description, or one the contract
    bounds far below 2^31 (BELOW_2_31): a new integer field is the one or the other."""
    doc = openapi_document()
    for rendering in (doc, as_openapi_30(doc)):
        found = [i for name, schema in rendering["components"]["schemas"].items()
                 for i in integers(schema, name)]
        found += [i for path in rendering["paths"].values() for op in path.values()
                  for p in op.get("parameters", []) for i in integers(p["schema"], p["name"])]
        wide = {where: s for where, s in found if s.get("format") == "int64"}
        narrow = {where for where, s in found if where not in wide}
        assert {w for w in narrow
                if w not in BELOW_2_31 and w.split(".")[-1] not in BELOW_2_31} == set()
        assert {w for w in wide if w in BELOW_2_31 or w.split(".")[-1] in BELOW_2_31} == set()
        assert {w for w, s in wide.items() if s.get("description") != MONEY
                and not s.get("description", "").startswith(("a number of ", "a line of "))
                } == set()
        money = {w for w, s in wide.items() if s.get("description") == MONEY}
        assert {"TicketOut.total_cost", "GridIn.stake", "GridOut.cost", "CancelOut.released",
                "ExposureOut.top_liability", "TopCombination.liability", "DrawOut.cap",
                "PlayerOut.remaining", "DrawReport.top_liability", "Side.amount",
                "GameOut.top_prizes", "GameOut.stakes"} <= money
        assert {"TicketCounts.accepted", "CappedPicks.played", "DrawReport.combinations",
                "PicksLine.grids", "Side.tickets", "Source.bytes"} <= wide.keys() - money
