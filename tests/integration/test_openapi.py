"""/openapi.json: generated from the code's types and true to real responses (schemathesis
with every check: tests/contract/)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

from tests.conftest import TEN, Client, Reply, ticket

CONTRACT = Path(__file__).parents[2] / "openapi.json"


async def document(client: Client) -> dict[str, Any]:
    reply = await client.get("/openapi.json", token=None)
    assert reply.status == 200
    doc: dict[str, Any] = reply.body
    return doc


def check(doc: dict[str, Any], method: str, path: str, reply: Reply) -> None:
    """The reply's body validates against the documented schema for its status."""
    responses = doc["paths"][path][method.lower()]["responses"]
    assert str(reply.status) in responses, (path, reply.status)
    schema = responses[str(reply.status)]["content"]["application/json"]["schema"]
    Draft202012Validator({**schema, "components": doc["components"]}).validate(reply.body)


async def test_document_is_openapi_31_from_the_types(client: Client) -> None:
    """OpenAPI 3.1 with the msgspec types as components and every route."""
    doc = await document(client)
    assert doc["openapi"] == "3.1.0"
    assert {"TicketIn", "TicketOut", "ErrorOut", "PlayerOut"} <= set(doc["components"]["schemas"])
    ticket_in = doc["components"]["schemas"]["TicketIn"]
    assert ticket_in["properties"]["ticket_id"]["pattern"] == r"^[A-Za-z0-9._:-]+(?!\n)$"
    assert len(doc["paths"]) >= 15


async def test_the_served_document_is_the_one_the_repository_keeps(client: Client) -> None:
    """The contract is the same for every deployment: this service's games and stakes
    change nothing of it. What is served is the file, byte for byte (indented as the
    repository keeps it), not only the same JSON."""
    reply = await client.get("/openapi.json", token=None)
    assert reply.headers["Content-Type"] == "application/json"
    assert reply.raw == CONTRACT.read_bytes()


async def test_real_responses_match_the_document(client: Client) -> None:
    """Responses of every kind (sales, errors, draws, players) validate against it."""
    doc = await document(client)
    draw = await client.current()
    body = ticket([{"numbers": TEN, "stake": 500}, {"numbers": [1, 2], "stake": 100}])
    calls: list[tuple[str, str, Reply]] = [
        ("POST", "/v1/tickets", await client.sell(body)),
        ("POST", "/v1/tickets", await client.sell(body)),
        ("POST", "/v1/tickets", await client.sell(ticket([{"numbers": TEN, "stake": 7}]))),
        ("POST", "/v1/tickets", await client.request("POST", "/v1/tickets", data=b"{")),
        ("POST", "/v1/tickets", await client.sell(ticket(), token="nope")),
        ("POST", "/v1/ticket-batches", await client.post(
            "/v1/ticket-batches", {"tickets": [ticket()]}, token="read")),
        ("GET", "/v1/tickets/{ticket_id}", await client.get(f"/v1/tickets/{body['ticket_id']}")),
        ("POST", "/v1/tickets/{ticket_id}/cancel",
         await client.post(f"/v1/tickets/{body['ticket_id']}/cancel")),
        ("GET", "/v1/games", await client.get("/v1/games")),
        ("GET", "/v1/games/{game}/draws/current", await client.get(
            "/v1/games/fdj-keno/draws/current")),
        ("GET", "/v1/games/{game}/draws/{draw}", await client.get(
            f"/v1/games/fdj-keno/draws/{draw}")),
        ("GET", "/v1/games/{game}/draws/{draw}/combinations/{numbers}", await client.get(
            f"/v1/games/fdj-keno/draws/{draw}/combinations/{'-'.join(map(str, TEN))}")),
        ("GET", "/v1/games/{game}/draws/{draw}/capped", await client.get(
            f"/v1/games/fdj-keno/draws/{draw}/capped")),
        ("POST", "/v1/games/{game}/availability", await client.post(
            "/v1/games/fdj-keno/availability", {"grids": [{"numbers": TEN, "stake": 500}]})),
        ("GET", "/v1/players/{player_id}", await client.get("/v1/players/P-1", token="ma")),
        ("PUT", "/v1/players/{player_id}/limit", await client.request(
            "PUT", "/v1/players/P-1/limit", {"daily": 1000}, token="ma")),
        ("POST", "/v1/players/{player_id}/stakes", await client.post(
            "/v1/players/P-1/stakes", {"ref": "r-1", "game": "loto", "amount": 10},
            token="ma")),
        ("GET", "/healthz", await client.get("/healthz", token=None)),
        ("GET", "/readyz", await client.get("/readyz", token=None)),
    ]
    for method, path, reply in calls:
        check(doc, method, path, reply)
