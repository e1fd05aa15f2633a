"""Ids and path parameters are matched whole: no trailing newline, no control character."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from jsonschema import Draft202012Validator

from capsvc.client.models import ID_PATTERN, MAX_DRAW, StakeIn, TicketIn
from capsvc.config import (
    GAME_ID_RE,
    ID_RE,
    Channel,
    ConfigError,
    load_settings,
    parse_duration_ms,
    parse_settings,
)
from capsvc.domain.errors import ApiError
from capsvc.domain.validator import parse_numbers_path
from capsvc.http.app import PARAMS, _draw, _ticket_id, decode_body, request_id
from capsvc.http.openapi import openapi_document
from capsvc.service.players import Players
from tests.conftest import CONFIG

GOOD = ["X", "N-4", "P-9", "a.b_c:d-E9", "A" * 64, "0", "...", "-", ":"]
BAD = ["X\n", "N-4\n", "X\r", "X\r\n", "X\x00", "\x00X", "\nX", "X\nY", "X\t", "X ", " X",
       "X\x7f", "X\u2028", "X\u0085", "é", "X/1", "X?", "X#", "", "A" * 65, "N-4\n\n"]
SHA = "0" * 64


def routed(path: str, params: dict[str, str]) -> web.BaseRequest:
    """A request as the router hands it to a handler, with its path parameters."""
    request = make_mocked_request("GET", path)
    request[PARAMS] = params
    return request


def body(**fields: Any) -> bytes:
    """A valid ticket body as JSON bytes, with `fields` overriding its members."""
    doc: dict[str, Any] = {"ticket_id": "N-4", "game": "fdj-keno",
                           "grids": [{"numbers": [1, 2], "stake": 100}]}
    doc.update(fields)
    return json.dumps(doc).encode()


def refused(call: Any) -> ApiError:
    """The ApiError that `call()` raises (failing the test if it raises none)."""
    with pytest.raises(ApiError) as info:
        call()
    return info.value


@pytest.mark.parametrize("value", GOOD)
def test_valid_ids_pass_every_check(value: str) -> None:
    """Valid ids decode as ticket_id, player_id and ref, and pass every id regex."""
    ticket = decode_body(body(ticket_id=value, player_id=value), TicketIn)
    assert (ticket.ticket_id, ticket.player_id) == (value, value)
    stake = decode_body(json.dumps({"ref": value, "game": "loto", "amount": 1}).encode(),
                        StakeIn)
    assert stake.ref == value
    assert ID_RE.fullmatch(value)
    assert ID_RE.match(value)
    assert re.search(ID_PATTERN, value)


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("field", ["ticket_id", "player_id"])
def test_bad_ids_in_a_ticket_body_are_422(field: str, value: str) -> None:
    """A bad ticket_id or player_id in a real JSON body is 422 invalid_request at its path."""
    err = refused(lambda: decode_body(body(**{field: value}), TicketIn))
    assert (err.kind, err.code, err.path) == ("invalid", "invalid_request", f"$.{field}")
    if 1 <= len(value) <= 64:  # otherwise msgspec's own "Expected `str` of length ..."
        assert "1-64 characters of [A-Za-z0-9._:-]" in err.message
    assert "(?!" not in err.message  # says what an id is, not the regex


@pytest.mark.parametrize("value", BAD)
def test_bad_refs_in_a_stake_body_are_422(value: str) -> None:
    """A bad other-game stake ref is 422 invalid_request at $.ref."""
    raw = json.dumps({"ref": value, "game": "loto", "amount": 1}).encode()
    err = refused(lambda: decode_body(raw, StakeIn))
    assert (err.kind, err.code, err.path) == ("invalid", "invalid_request", "$.ref")


def test_escaped_newline_in_raw_json_is_refused() -> None:
    """The JSON escape \\n (as a client sends it) is refused by the msgspec type itself."""
    raw = b'{"ticket_id": "N-4\\n", "game": "fdj-keno", "grids": [{"numbers": [1], "stake": 1}]}'
    with pytest.raises(msgspec.ValidationError, match=r"\$\.ticket_id"):
        msgspec.json.decode(raw, type=TicketIn)
    raw = raw.replace(b"N-4\\n", b"N-4\\u000a")
    with pytest.raises(msgspec.ValidationError, match=r"\$\.ticket_id"):
        msgspec.json.decode(raw, type=TicketIn)


@pytest.mark.parametrize("value", BAD)
def test_id_regexes_refuse_with_match_search_and_fullmatch(value: str) -> None:
    """config.ID_RE refuses bad ids whichever method is used; so does the schema pattern."""
    assert not ID_RE.fullmatch(value)
    assert not ID_RE.match(value)
    assert not ID_RE.search(value)
    assert not (re.search(ID_PATTERN, value) and 1 <= len(value) <= 64)


@pytest.mark.parametrize("value", ["fdj-keno\n", "fdj-keno\r", "\nfdj-keno", "Fdj", "-x", ""])
def test_game_id_regex_is_whole(value: str) -> None:
    """GAME_ID_RE refuses a trailing newline, control characters and bad shapes."""
    assert not GAME_ID_RE.match(value)
    assert GAME_ID_RE.match("fdj-keno")


@pytest.mark.parametrize("value", BAD)
def test_ticket_id_path_parameter_is_matched_whole(value: str) -> None:
    """A bad ticket id from the URL path is 422 invalid_request at `ticket_id`."""
    request = routed("/v1/tickets/x", {"ticket_id": value})
    err = refused(lambda: _ticket_id(request))
    assert (err.kind, err.code, err.path) == ("invalid", "invalid_request", "ticket_id")


@pytest.mark.parametrize("value", GOOD)
def test_valid_ticket_id_path_parameter_passes(value: str) -> None:
    """A valid ticket id from the URL path comes back unchanged."""
    request = routed("/v1/tickets/x", {"ticket_id": value})
    assert _ticket_id(request) == value


@pytest.mark.parametrize("value", ["5\n", " 5", "5 ", "5_0", "\u0665", "+5", "0x5", "", "5\x00"])
def test_draw_path_parameter_is_digits_only(value: str) -> None:
    """A draw that is not plain ASCII digits is 404 not_found, never int()'s lenient parse."""
    request = routed("/v1/games/g/draws/x", {"draw": value})
    err = refused(lambda: _draw(request))
    assert (err.kind, err.code) == ("not_found", "not_found")


def test_draw_path_parameter_parses_digits() -> None:
    """Plain digits of 1 to MAX_DRAW parse; 0, a negative number, a larger one (as the
    OpenAPI document says) and an absurdly long one are a 404 naming it."""
    for text, draw in (("4711", 4711), ("1", 1), (str(MAX_DRAW), MAX_DRAW)):
        assert _draw(routed("/v1/games/g/draws/x", {"draw": text})) == draw
    for text in ("-3", "0", str(MAX_DRAW + 1), "1" * 13):
        request = routed("/v1/games/g/draws/x", {"draw": text})
        err = refused(lambda request=request: _draw(request))  # type: ignore[misc]
        assert (err.kind, err.code) == ("not_found", "not_found")
        assert f"draw {text[:12]}" in err.message


@pytest.mark.parametrize("value", BAD)
def test_player_id_path_parameter_is_matched_whole(value: str) -> None:
    """A bad player id from the URL path is 422 invalid_request at `player_id`."""
    players = Players(SimpleNamespace(games={}), None, None, None)  # type: ignore[arg-type]
    channel = Channel(id="c", token_sha256=b"", games=frozenset(), scopes=frozenset({"sell"}))
    err = refused(lambda: players.game_for(channel, value, None, "sell"))
    assert (err.kind, err.code, err.path) == ("invalid", "invalid_request", "player_id")


@pytest.mark.parametrize("text", [
    "3-7-12-18-25-33-41-56\n", "3-7-12-18-25-33-41-56\r", "3-7-12-18-25-33-41-56\x00",
    "\n3-7-12-18-25-33-41-56", "\u00b2-7-12-18-25-33-41-56", "\u0663-7-12-18-25-33-41-56",
    "3--7", "-3-7", "3-7-", " 3-7", "3 -7", "1_0-7", "1000-7", "3-x", "", "+3-7",
])
def test_numbers_path_parameter_is_matched_whole(text: str) -> None:
    """Combination numbers of the URL: ASCII digits joined by '-', nothing else: 422."""
    rules = load_settings(CONFIG).games["fdj-keno"]
    err = refused(lambda: parse_numbers_path(rules, text))
    assert (err.kind, err.code, err.path) == ("invalid", "invalid_request", "numbers")


def test_numbers_path_parameter_parses_valid_numbers() -> None:
    """Valid numbers parse into the sorted tuple."""
    rules = load_settings(CONFIG).games["fdj-keno"]
    assert parse_numbers_path(rules, "56-3-7-12-18-25-33-41") == (3, 7, 12, 18, 25, 33, 41, 56)


@pytest.mark.parametrize("value", ["abc\n", "abc\r", "a\x00c", "a c", "x" * 129])
def test_bad_request_id_is_replaced(value: str) -> None:
    """An X-Request-ID with a trailing newline or control character is not echoed."""
    request = make_mocked_request("GET", "/healthz", headers={"X-Request-ID": value})
    assert request_id(request) != value
    request = make_mocked_request("GET", "/healthz", headers={"X-Request-ID": "abc-123"})
    assert request_id(request) == "abc-123"


@pytest.mark.parametrize("value", ["250ms\n", "5s\r", " 5s", "\u0665s", "5 s"])
def test_config_durations_are_matched_whole(value: str) -> None:
    """A configured duration with a trailing newline or non-ASCII digit is refused."""
    with pytest.raises(ValueError, match="expected a duration"):
        parse_duration_ms(value)
    assert parse_duration_ms("250ms") == 250


@pytest.mark.parametrize(("where", "raw"), [
    ("games[0].id", {"games": [{"id": "g\n"}]}),
    ("channels[0].id", {"channels": [{"id": "c\n"}]}),
    ("channels[0].token_sha256", {"channels": [{"token_sha256": SHA + "\n"}]}),
    ("games[0].draw_times[0]", {"games": [{"draw_times": ["12:00\n"]}]}),
])
def test_config_ids_are_matched_whole(where: str, raw: dict[str, Any]) -> None:
    """Game ids, channel ids, token digests and times in the config refuse a trailing newline."""
    doc: dict[str, Any] = {
        "games": [{"id": "g", "preset": "fdj-keno-2008"}],
        "channels": [{"id": "c", "token_sha256": SHA, "games": ["g"], "scopes": ["sell"]}],
    }
    for section, entries in raw.items():
        doc[section][0].update(entries[0])
    with pytest.raises(ConfigError) as info:
        parse_settings(doc)
    assert any(p.startswith(where) for p in info.value.problems), info.value.problems


def _schemas() -> list[tuple[str, dict[str, Any]]]:
    """Every id schema of the OpenAPI document: body fields and path parameters."""
    doc = openapi_document()
    schemas = doc["components"]["schemas"]
    found = [(f"{t}.{f}", schemas[t]["properties"][f]) for t, f in (
        ("TicketIn", "ticket_id"), ("TicketIn", "player_id"), ("StakeIn", "ref"))]
    for path, item in doc["paths"].items():
        for op in item.values():
            for p in op.get("parameters", []):
                if p["name"] in ("ticket_id", "player_id"):
                    found.append((f"{path} {p['name']}", p["schema"]))
    return found


def _id_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The string schema of a possibly nullable property."""
    for option in schema.get("anyOf", [schema]):
        if option.get("type") == "string":
            return dict(option)
    raise AssertionError(schema)


def test_openapi_id_schemas_refuse_bad_ids() -> None:
    """jsonschema (Python re.search) takes the documented id schemas as the service does."""
    schemas = _schemas()
    assert len(schemas) >= 6
    for where, schema in schemas:
        validator = Draft202012Validator(_id_schema(schema))
        assert "\\Z" not in _id_schema(schema)["pattern"], where  # not ECMA-262
        for value in GOOD:
            assert validator.is_valid(value), (where, value)
        for value in BAD:
            assert not validator.is_valid(value), (where, value)


def test_openapi_path_patterns_refuse_a_trailing_newline() -> None:
    """The game and numbers path patterns refuse a trailing newline under Python's re."""
    params = {p["name"]: p["schema"]["pattern"]
              for item in openapi_document()["paths"].values() for op in item.values()
              for p in op.get("parameters", []) if "pattern" in p["schema"]}
    assert re.search(params["game"], "fdj-keno")
    assert not re.search(params["game"], "fdj-keno\n")
    assert re.search(params["numbers"], "1-2")
    assert not re.search(params["numbers"], "1-2\n")


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_openapi_patterns_behave_the_same_in_ecma_262() -> None:
    """Node's RegExp (ECMA-262, with and without the u flag) agrees with Python's re."""
    params = [p["schema"]["pattern"] for item in openapi_document()["paths"].values()
              for op in item.values() for p in op.get("parameters", [])
              if "pattern" in p["schema"]]
    patterns = sorted({ID_PATTERN, *params})
    values = [*GOOD, *BAD, "fdj-keno", "1-2-3", "1-2-3\n"]
    script = ("const [ps, vs] = JSON.parse(process.argv[1]);"
              "console.log(JSON.stringify(ps.map(p => ['', 'u'].map(f => "
              "vs.map(v => new RegExp(p, f).test(v))))));")
    out = subprocess.run(["node", "-e", script, json.dumps([patterns, values])],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    for pattern, per_flag in zip(patterns, json.loads(out), strict=True):
        expected = [bool(re.search(pattern, v)) for v in values]
        assert per_flag == [expected, expected], pattern
