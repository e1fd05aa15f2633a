"""Bad input of every kind: the documented status, code and path; nothing written."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
import redis

from capsvc.http.server import Service
from tests.conftest import TEN, Client, ticket

GRID = {"numbers": TEN[:8], "stake": 500}

def written(db: redis.Redis) -> list[bytes]:
    """Every key in Redis but the marks and a cluster's primaries' counts (lua/capsvc.lua,
    MARKS): a request refused after its ticket id was looked up counts that look-up there,
    and nothing else."""
    return [k for k in db.keys("*") if not k.startswith((b"m:{", b"n:{"))]



def with_grid(**fields: Any) -> dict[str, Any]:
    return ticket([dict(GRID, **fields)])


CASES: list[tuple[str, Any, str, int, str, str | None]] = [
    # name, body (dict → JSON, bytes → raw), token, status, code, path
    ("not json", b"{", "fr", 400, "malformed_json", None),
    ("empty body", b"", "fr", 400, "malformed_json", None),
    ("array", b"[1, 2]", "fr", 400, "malformed_json", None),
    ("string", b'"ticket"', "fr", 400, "malformed_json", None),
    ("bad utf-8", b'{"ticket_id": "\xff"}', "fr", 400, "malformed_json", None),
    ("no token", ticket(), None, 401, "unauthorized", None),
    ("unknown token", ticket(), "nope", 401, "unauthorized", None),
    ("game not sold by channel", ticket(game="lnm-keno", player_id="P-1",
                                        grids=[{"numbers": TEN, "stake": 250}]),
     "fr", 403, "forbidden", None),
    ("no sell scope", ticket(), "read", 403, "forbidden", None),
    ("unknown game", ticket(game="loto"), "fr", 404, "not_found", None),
    ("missing ticket_id", {"game": "fdj-keno", "grids": [GRID]}, "fr", 422,
     "invalid_request", "$.ticket_id"),
    ("missing stake", ticket([{"numbers": TEN[:8]}]), "fr", 422, "invalid_request",
     "$.grids[0].stake"),
    ("ticket_id too long", ticket(ticket_id="A" * 65), "fr", 422, "invalid_request",
     "$.ticket_id"),
    ("ticket_id bad chars", ticket(ticket_id="A/1"), "fr", 422, "invalid_request",
     "$.ticket_id"),
    ("empty ticket_id", ticket(ticket_id=""), "fr", 422, "invalid_request", "$.ticket_id"),
    ("unknown field", ticket(colour="red"), "fr", 422, "invalid_request", "$.colour"),
    ("no grids", ticket([]), "fr", 422, "invalid_request", "$.grids"),
    ("grids not a list", ticket(grids={"numbers": TEN}), "fr", 422, "invalid_request",
     "$.grids"),
    ("float stake", with_grid(stake=2.5), "fr", 422, "invalid_request", "$.grids[0].stake"),
    ("string stake", with_grid(stake="500"), "fr", 422, "invalid_request",
     "$.grids[0].stake"),
    ("huge stake", with_grid(stake=10**30), "fr", 422, "invalid_request", "$.grids[0].stake"),
    ("numbers not ints", with_grid(numbers=[1, 2, "3"]), "fr", 422, "invalid_request",
     "$.grids[0].numbers[2]"),
    ("multiplier not bool", with_grid(multiplier=1), "fr", 422, "invalid_request",
     "$.grids[0].multiplier"),
    ("first_draw string", ticket(first_draw="4711"), "fr", 422, "invalid_request",
     "$.first_draw"),
    ("player_id bad chars", ticket(player_id="P 1"), "fr", 422, "invalid_request",
     "$.player_id"),
    ("ticket_id trailing newline", ticket(ticket_id="N-4\n"), "fr", 422, "invalid_request",
     "$.ticket_id"),
    ("ticket_id trailing CR", ticket(ticket_id="N-4\r"), "fr", 422, "invalid_request",
     "$.ticket_id"),
    ("ticket_id NUL", ticket(ticket_id="N-4\x00"), "fr", 422, "invalid_request", "$.ticket_id"),
    ("ticket_id leading newline", ticket(ticket_id="\nN-4"), "fr", 422, "invalid_request",
     "$.ticket_id"),
    ("player_id trailing newline", ticket([{"numbers": TEN, "stake": 250}], game="lnm-keno",
                                          player_id="P-9\n"), "ma", 422, "invalid_request",
     "$.player_id"),
    ("stake not allowed", with_grid(stake=700), "fr", 422, "stake_not_allowed",
     "$.grids[0].stake"),
    ("negative stake", with_grid(stake=-500), "fr", 422, "stake_not_allowed",
     "$.grids[0].stake"),
    ("one number", with_grid(numbers=[5]), "fr", 422, "picks_not_allowed",
     "$.grids[0].numbers"),
    ("eleven numbers", with_grid(numbers=list(range(1, 12))), "fr", 422, "picks_not_allowed",
     "$.grids[0].numbers"),
    ("number 0", with_grid(numbers=[0, *TEN[:7]]), "fr", 422, "number_out_of_range",
     "$.grids[0].numbers[0]"),
    ("number 71", with_grid(numbers=[*TEN[:7], 71]), "fr", 422, "number_out_of_range",
     "$.grids[0].numbers[7]"),
    ("duplicate", with_grid(numbers=[*TEN[:7], 3]), "fr", 422, "duplicate_numbers",
     "$.grids[0].numbers[7]"),
    ("3 draws", ticket(draws=3), "fr", 422, "draws_not_allowed", "$.draws"),
    ("0 draws", ticket(draws=0), "fr", 422, "draws_not_allowed", "$.draws"),
    ("21 grids", ticket([GRID] * 21), "fr", 422, "too_many_grids", "$.grids"),
    ("past draw", ticket(first_draw=1), "fr", 422, "draw_closed", "$.first_draw"),
    ("draw zero", ticket(first_draw=0), "fr", 422, "draw_closed", "$.first_draw"),
    ("negative draw", ticket(first_draw=-10**12), "fr", 422, "draw_closed", "$.first_draw"),
    ("most negative draw", ticket(first_draw=-(2**53)), "fr", 422, "draw_closed",
     "$.first_draw"),
    ("far draw", ticket(first_draw=10**9), "fr", 422, "draw_not_on_sale", "$.first_draw"),
    ("lnm without player", ticket([{"numbers": TEN, "stake": 250}], game="lnm-keno"), "ma",
     422, "player_required", "$.player_id"),
    ("lnm multiplier", ticket([{"numbers": TEN, "stake": 250, "multiplier": True}],
                              game="lnm-keno", player_id="P-1"), "ma", 422,
     "option_not_available", "$.grids[0].multiplier"),
    ("lnm joker", ticket([{"numbers": TEN, "stake": 250}], game="lnm-keno", player_id="P-1",
                         joker_plus=True), "ma", 422, "option_not_available", "$.joker_plus"),
    ("lnm 15 dh", ticket([{"numbers": TEN, "stake": 1500}], game="lnm-keno",
                         player_id="P-1"), "ma", 422, "stake_not_allowed",
     "$.grids[0].stake"),
    ("lnm number 81", ticket([{"numbers": [*TEN[:9], 81], "stake": 250}], game="lnm-keno",
                             player_id="P-1"), "ma", 422, "number_out_of_range",
     "$.grids[0].numbers[9]"),
]


@pytest.mark.parametrize(("name", "body", "token", "status", "code", "path"), CASES,
                         ids=[c[0] for c in CASES])
async def test_bad_ticket(client: Client, redis_db: redis.Redis, name: str, body: Any,
                          token: str | None, status: int, code: str, path: str | None) -> None:
    """Each bad request gets its status, code and JSONPath, and writes nothing to Redis."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = await client.request("POST", "/v1/tickets", data=data, token=token,
                                 headers={"Content-Type": "application/json"})
    assert reply.status == status, reply.body
    error = reply.body["error"]
    assert error["code"] == code
    assert error["path"] == path
    assert error["message"]
    assert written(redis_db) == []


async def test_body_over_the_limit_is_413(client: Client, redis_db: redis.Redis) -> None:
    """A body over 64 KiB is refused with 413 payload_too_large."""
    body = json.dumps(ticket(padding="x" * 70_000)).encode()
    reply = await client.request("POST", "/v1/tickets", data=body)
    assert reply.status == 413
    assert reply.body["error"]["code"] == "payload_too_large"
    assert written(redis_db) == []


async def test_unknown_route_and_method_are_json_errors(client: Client) -> None:
    """Unknown routes are 404 and wrong methods 405, both with the error body."""
    reply = await client.get("/v1/nothing")
    assert (reply.status, reply.body["error"]["code"]) == (404, "not_found")
    reply = await client.request("DELETE", "/v1/tickets")
    assert reply.status == 405
    assert reply.body["error"]["code"] == "method_not_allowed"


async def test_wrong_auth_scheme_is_401(client: Client) -> None:
    """Only Bearer tokens are accepted."""
    reply = await client.get("/v1/games", token=None, headers={"Authorization": "Basic dDpm"})
    assert reply.status == 401
    assert reply.headers["WWW-Authenticate"] == "Bearer"


async def test_operations_routes_need_no_token(client: Client) -> None:
    """healthz, readyz, metrics and openapi.json answer without a token."""
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
        assert (await client.get(path, token=None)).status == 200, path


async def test_request_id_is_returned(client: Client) -> None:
    """A sane X-Request-ID is echoed; otherwise one is generated, unique per request."""
    given = await client.get("/v1/games", headers={"X-Request-ID": "abc-123"})
    assert given.headers["X-Request-ID"] == "abc-123"
    first = await client.get("/v1/games", headers={"X-Request-ID": "bad id with spaces"})
    second = await client.get("/healthz", token=None)
    assert first.headers["X-Request-ID"] != second.headers["X-Request-ID"]
    assert " " not in first.headers["X-Request-ID"]


def snapshot(db: Any) -> dict[bytes, Any]:
    """Every key of the test's Redis with its dump: proof that nothing was written."""
    return {k: db.dump(k) for k in sorted(db.scan_iter(count=1000))}


async def test_ticket_id_with_a_newline_is_not_another_ticket(client: Client,
                                                              redis_db: Any) -> None:
    """"N-4\\n" is refused (422) in the body and the path; "N-4" is untouched."""
    body = ticket(ticket_id="N-4")
    sold = await client.sell(body)
    assert (sold.status, sold.body["status"]) == (200, "accepted"), sold.body
    before = snapshot(redis_db)
    again = await client.sell(dict(body, ticket_id="N-4\n"))
    assert again.status == 422
    assert again.body["error"]["code"] == "invalid_request"
    assert again.body["error"]["path"] == "$.ticket_id"
    assert "[A-Za-z0-9._:-]" in again.body["error"]["message"]
    for method, path in (("GET", "/v1/tickets/N-4%0A"), ("GET", "/v1/tickets/N-4%0D"),
                         ("GET", "/v1/tickets/N-4%00"), ("GET", "/v1/tickets/%0AN-4"),
                         ("POST", "/v1/tickets/N-4%0A/cancel")):
        reply = await client.request(method, path)
        assert reply.status in (404, 422), (path, reply.body)
        assert reply.body["error"]["code"] in ("not_found", "invalid_request"), path
        if reply.status == 422:
            assert reply.body["error"]["path"] == "ticket_id", path
    assert snapshot(redis_db) == before
    assert (await client.get("/v1/tickets/N-4")).body == sold.body


async def test_player_id_with_a_newline_gets_no_budget(client: Client, redis_db: Any) -> None:
    """Once "P-9" is refused, "P-9\\n" is 422 on every route and spends nothing."""
    ok = await client.post("/v1/players/P-9/stakes",
                           {"ref": "r-1", "game": "loto", "amount": 4_000_000}, token="ma")
    assert ok.body["status"] == "accepted", ok.body
    refused = await client.post("/v1/players/P-9/stakes",
                                {"ref": "r-2", "game": "loto", "amount": 1}, token="ma")
    assert refused.body == {"status": "rejected", "remaining": 0}
    before = snapshot(redis_db)
    for method, path, payload in (
            ("POST", "/v1/players/P-9%0A/stakes", {"ref": "r-3", "game": "loto", "amount": 1}),
            ("PUT", "/v1/players/P-9%0A/limit", {"daily": 1000}),
            ("GET", "/v1/players/P-9%0A", None),
            ("GET", "/v1/players/P-9%0D", None),
            ("GET", "/v1/players/P-9%00", None)):
        reply = await client.request(method, path, payload, token="ma")
        assert reply.status == 422, (path, reply.body)
        assert reply.body["error"]["code"] == "invalid_request"
        assert reply.body["error"]["path"] == "player_id"
    bad_ref = await client.post("/v1/players/P-8/stakes",
                                {"ref": "r-1\n", "game": "loto", "amount": 1}, token="ma")
    assert (bad_ref.status, bad_ref.body["error"]["path"]) == (422, "$.ref")
    sale = await client.sell(ticket([{"numbers": TEN, "stake": 250}], game="lnm-keno",
                                    player_id="P-9\n"), token="ma")
    assert (sale.status, sale.body["error"]["path"]) == (422, "$.player_id")
    assert snapshot(redis_db) == before


async def test_draw_and_numbers_path_parameters_are_matched_whole(client: Client,
                                                                   redis_db: Any) -> None:
    """A newline or non-ASCII digit in game, draw or numbers is 404 or 422, never 500."""
    draw = await client.current()
    numbers = "-".join(map(str, TEN))
    base = f"/v1/games/fdj-keno/draws/{draw}/combinations/"
    for suffix in ("%0A", "%0D", "%00"):
        reply = await client.get(base + numbers + suffix)
        assert (reply.status, reply.body["error"]["path"]) == (422, "numbers"), reply.body
    for odd in ("%C2%B2", "%D9%A3"):  # superscript two, Arabic-Indic three
        reply = await client.get(base + odd + "-7-12-18-25-33-41-56")
        assert (reply.status, reply.body["error"]["code"]) == (422, "invalid_request")
    for path in (f"/v1/games/fdj-keno/draws/{draw}%0A", f"/v1/games/fdj-keno%0A/draws/{draw}",
                 f"/v1/games/fdj-keno/draws/{draw}%0A/combinations/{numbers}",
                 "/v1/games/fdj-keno%0A/draws/current"):
        reply = await client.get(path, token="admin")
        assert (reply.status, reply.body["error"]["code"]) == (404, "not_found"), path
    assert (await client.get(base + numbers)).status == 200
    assert written(redis_db) == []


MALFORMED = [
    ("NUL byte in a header", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n"),
    ("not HTTP", b"GARBAGE\r\n\r\n"),
    ("header line too long", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: "
     + b"a" * 9000 + b"\r\n\r\n"),
]


@pytest.mark.parametrize(("name", "raw"), MALFORMED, ids=[m[0] for m in MALFORMED])
async def test_malformed_http_is_a_json_error_counted_and_logged_once(
        service: tuple[Service, str], caplog: pytest.LogCaptureFixture, name: str,
        raw: bytes) -> None:
    """HTTP that cannot be parsed gets the API's JSON error (not aiohttp's text/plain), is
    counted in the request metrics, and is one warning line, not a traceback."""
    svc, url = service
    host, port = url.removeprefix("http://").split(":")
    caplog.set_level(logging.DEBUG)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(raw)
    head, _, body = (await asyncio.wait_for(reader.read(), 5)).partition(b"\r\n\r\n")
    writer.close()
    assert head.split(b"\r\n")[0].split(b" ")[1] == b"400"
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "malformed_request"
    assert error["message"].startswith("the request is not valid HTTP: ")
    assert b"x-request-id: " in head.lower()
    assert "\n" not in error["message"]
    problems = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.levelname for r in problems] == ["WARNING"]
    assert problems[0].exc_info is None
    assert "\n" not in problems[0].getMessage()
    text = svc.metrics.exposition().decode()
    assert ('capsvc_http_request_duration_seconds_count{method="-",route="malformed",'
            'status="400"} 1.0') in text


async def _raw(url: str, data: bytes) -> tuple[bytes, bytes]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    head, _, body = (await asyncio.wait_for(reader.read(), 5)).partition(b"\r\n\r\n")
    writer.close()
    return head, body


async def test_what_a_client_sends_never_makes_a_500(
        service: tuple[Service, str], caplog: pytest.LogCaptureFixture) -> None:
    """A token that is not UTF-8, a gzip body that is not gzip, a body cut short: 4xx in
    the JSON format, never a 500 (which would page someone), never a traceback."""
    svc, url = service
    caplog.set_level(logging.INFO)
    head, body = await _raw(url, b"GET /v1/games HTTP/1.1\r\nHost: x\r\n"
                                 b"Authorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n")
    assert b" 401 " in head.split(b"\r\n")[0]
    assert json.loads(body)["error"]["code"] == "unauthorized"
    sale = json.dumps(ticket([GRID])).encode()
    head, body = await _raw(url, b"POST /v1/tickets HTTP/1.1\r\nHost: x\r\n"
                                 b"Authorization: Bearer t-fr\r\nContent-Encoding: gzip\r\n"
                                 b"Connection: close\r\nContent-Length: "
                                 + str(len(sale)).encode() + b"\r\n\r\n" + sale)
    assert b" 400 " in head.split(b"\r\n")[0]
    assert json.loads(body)["error"]["code"] == "malformed_request"
    host, port = url.removeprefix("http://").split(":")
    _reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/tickets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t-fr\r\n"
                 b"Content-Length: 100\r\n\r\n{}")
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.close()  # gone before the rest of the body
    await asyncio.sleep(0.3)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []
    assert 'status="500"' not in svc.metrics.exposition().decode()


async def test_a_token_in_an_oversized_header_is_neither_logged_nor_answered(
        service: tuple[Service, str], caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp quotes the start of a header line it refuses: that may be a bearer token."""
    _, url = service
    caplog.set_level(logging.DEBUG)
    _head, body = await _raw(url, b"GET /v1/games HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                                 b"SECRET-TOKEN-abc123" + b"x" * 9000 + b"\r\n\r\n")
    assert json.loads(body)["error"]["code"] == "malformed_request"
    assert b"SECRET" not in body
    assert "SECRET" not in caplog.text
