"""The OpenAPI 3.1 document of the API, generated from the msgspec request and response types.

It is the same for every deployment: what depends on the configuration (games, stakes,
picks, durations, options) is served by `GET /v1/games` and enforced with the documented
errors, never compiled into schemas. The repository keeps a copy, `openapi.json`, which a
test holds equal to this; `python -m capsvc.http.openapi > openapi.json` writes it. For
generators whose OpenAPI 3.1 support is partial, `openapi-3.0.json` is the same contract
in OpenAPI 3.0.3 (`as_openapi_30`; `python -m capsvc.http.openapi --3.0` writes it)."""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

from capsvc.audit.reconcile import Reconciliation
from capsvc.client.models import (
    ID_PATTERN,
    MAX_DRAW,
    AvailabilityIn,
    AvailabilityOut,
    CancelOut,
    CappedOut,
    CombinationOut,
    CurrentDrawOut,
    DrawOut,
    ErrorOut,
    ExposureOut,
    GamesOut,
    HealthOut,
    LimitIn,
    PlayerOut,
    StakeIn,
    StakeOut,
    TicketIn,
    TicketOut,
    TicketsIn,
    TicketsOut,
)
from capsvc.client.reports import DrawReport

_REF = "#/components/schemas/{name}"
_TYPES: tuple[Any, ...] = (
    TicketIn, TicketOut, CancelOut, AvailabilityIn, AvailabilityOut, CombinationOut,
    CappedOut, DrawOut, CurrentDrawOut, GamesOut, ErrorOut, HealthOut, LimitIn, PlayerOut,
    StakeIn, StakeOut, ExposureOut, DrawReport, Reconciliation, TicketsIn, TicketsOut,
)
_ERRORS = {
    "400": "Malformed JSON, or not an object (malformed_json); not valid HTTP "
           "(malformed_request)",
    "401": "No token, or unknown token",
    "403": "The channel may not use this game, or lacks the scope",
    "404": "Unknown game, ticket or draw",
    "409": "Ticket id reused with a different request; not cancellable; no decision yet",
    "413": "Body larger than the configured limit",
    "422": "Well-formed JSON that breaks a rule (schema or game rules)",
    "503": "Redis unreachable or too slow, draining or overloaded: to a sale or a cancel, "
           "the outcome is unknown, and the same request sent again converges; a GET changed "
           "nothing (see Retry-After)",
}


def _ref(t: Any) -> dict[str, str]:
    return {"$ref": _REF.format(name=t.__name__)}


def _json(t: Any) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": _ref(t)}}}


_REQUEST_ID = {"X-Request-ID": {
    "description": "the caller's X-Request-ID when it is 1-128 visible ASCII characters, "
                   "else one the service made; also in the service's log lines",
    "schema": {"type": "string"}}}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before sending the same "
                                               "request again",
                                "schema": {"type": "string", "pattern": "^[0-9]+$"}}}


def _error(code: str) -> dict[str, Any]:
    headers = {**_REQUEST_ID, **(_RETRY_AFTER if code == "503" else {})}
    return {"description": _ERRORS[code], "headers": headers, **_json(ErrorOut)}


def _op(summary: str, out: Any, *, body: Any = None, params: tuple[str, ...] = (),
        errors: tuple[str, ...] = ("401", "403", "404", "503"), auth: bool = True,
        headers: dict[str, Any] | None = None) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": "OK", "headers": {**_REQUEST_ID, **(headers or {})},
                          **_json(out)}
    op: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": ok, **{c: _error(c) for c in errors}},
    }
    if body is not None:
        op["requestBody"] = {"required": True, **_json(body)}
    if params:
        op["parameters"] = [_PARAMS[p] for p in params]
    if not auth:
        op["security"] = []
    return op


# Path patterns hold in Python's re.search and in ECMA-262 alike: see models.ID_PATTERN.
_ID = {"type": "string", "minLength": 1, "maxLength": 64, "pattern": ID_PATTERN}
_PARAMS: dict[str, dict[str, Any]] = {
    "game": {"name": "game", "in": "path", "required": True,
             "schema": {"type": "string", "pattern": r"^[a-z0-9][a-z0-9-]{0,31}(?!\n)$"}},
    "draw": {"name": "draw", "in": "path", "required": True,
             "schema": {"type": "integer", "minimum": 1, "maximum": MAX_DRAW}},
    "ticket_id": {"name": "ticket_id", "in": "path", "required": True, "schema": _ID},
    "player_id": {"name": "player_id", "in": "path", "required": True, "schema": _ID},
    "game_query": {"name": "game", "in": "query", "required": False,
                   "schema": {"type": "string"},
                   "description": "the limited game whose time zone and limit apply; needed "
                                  "only when the channel uses several"},
    "format": {"name": "format", "in": "query", "required": False,
               "schema": {"type": "string", "enum": ["json", "csv"], "default": "json"},
               "description": "csv: one figure a row (section,key,field,value)"},
    "grace": {"name": "grace", "in": "query", "required": False,
              "schema": {"type": "integer", "minimum": 0, "maximum": 999999},
              "description": "seconds: a decision this young, not in the export, is "
                             "in_flight, not a difference (default [audit] grace)"},
    "cancel_abandoned": {"name": "cancel_abandoned", "in": "query", "required": False,
                         "schema": {"type": "boolean", "default": False},
                         "description": "cancel the tickets accepted and never sold that "
                                        "can still be cancelled"},
    "numbers": {"name": "numbers", "in": "path", "required": True,
                "schema": {"type": "string", "pattern": r"^[0-9]{1,3}(-[0-9]{1,3})*(?!\n)$"},
                "description": "the numbers joined by '-', in any order"},
}


_DRAW = "/v1/games/{game}/draws/{draw}"
OPERATIONS: dict[tuple[str, str], tuple[str, str]] = {
    ("post", "/v1/tickets"): ("sellTicket", "tickets"),
    ("post", "/v1/ticket-batches"): ("sellTickets", "tickets"),
    ("get", "/v1/tickets/{ticket_id}"): ("getTicket", "tickets"),
    ("post", "/v1/tickets/{ticket_id}/cancel"): ("cancelTicket", "tickets"),
    ("get", "/v1/games"): ("listGames", "games"),
    ("get", "/v1/games/{game}/draws/current"): ("getCurrentDraw", "draws"),
    ("get", _DRAW): ("getDraw", "draws"),
    ("post", _DRAW + "/close"): ("closeDraw", "draws"),
    ("get", _DRAW + "/combinations/{numbers}"): ("getCombination", "availability"),
    ("get", _DRAW + "/capped"): ("listCappedCombinations", "availability"),
    ("get", "/v1/games/{game}/capped/stream"): ("streamCappedCombinations", "availability"),
    ("post", "/v1/games/{game}/availability"): ("checkAvailability", "availability"),
    ("get", _DRAW + "/exposure"): ("getExposure", "draws"),
    ("get", _DRAW + "/report"): ("getDrawReport", "audit"),
    ("post", _DRAW + "/reconcile"): ("reconcileDraw", "audit"),
    ("get", "/v1/players/{player_id}"): ("getPlayer", "players"),
    ("put", "/v1/players/{player_id}/limit"): ("setPlayerLimit", "players"),
    ("post", "/v1/players/{player_id}/stakes"): ("recordPlayerStake", "players"),
    ("get", "/healthz"): ("getHealth", "operations"),
    ("get", "/readyz"): ("getReadiness", "operations"),
    ("get", "/metrics"): ("getMetrics", "operations"),
    ("get", "/openapi.json"): ("getOpenApiDocument", "operations"),
}
"""(method, path) -> (operationId, tag): what a client generated from the document names
its functions and groups them by."""
_TAGS = [
    {"name": "tickets", "description": "Sell, look up and cancel tickets"},
    {"name": "availability", "description": "Whether combinations can still be played"},
    {"name": "games", "description": "The games and their rules"},
    {"name": "draws", "description": "Draws: on sale, closed, their exposure"},
    {"name": "players", "description": "Players' daily limits and stakes"},
    {"name": "audit", "description": "Draw reports and the reconciliation with the sales system"},
    {"name": "operations", "description": "Health, readiness, metrics, this document"},
]


CONTRACT_VERSION = "1.0.0"
"""The contract's version (`info.version`), semantic: docs/api.md says what changes it."""


def openapi_document() -> dict[str, Any]:
    """The document: the same for every deployment (see the module's docstring)."""
    (_, components) = msgspec.json.schema_components(_TYPES, ref_template=_REF)
    _settle_optional_fields(components)
    _type_enumerations(components)
    sell_errors = ("400", "401", "403", "404", "409", "413", "422", "503")
    write_errors = ("400", "401", "403", "404", "413", "422", "503")  # no 409
    draw = _DRAW
    replayed = {"Idempotent-Replayed": {"description": "true on a replay",
                                        "schema": {"type": "string", "enum": ["true"]}}}
    paths: dict[str, Any] = {
        "/v1/tickets": {"post": _op("Validate and record a sale", TicketOut, body=TicketIn,
                                    errors=sell_errors, headers=replayed)},
        "/v1/ticket-batches": {"post": _op(
            "Validate and record several sales, each as if sent alone", TicketsOut,
            body=TicketsIn, errors=("400", "401", "403", "413", "422", "503"))},
        "/v1/tickets/{ticket_id}": {"get": _op("The stored decision of a ticket", TicketOut,
                                               params=("ticket_id",),
                                               errors=("401", "403", "404", "409", "422",
                                                       "503"))},
        "/v1/tickets/{ticket_id}/cancel": {"post": _op(
            "Cancel a ticket, releasing what it took", CancelOut, params=("ticket_id",),
            errors=("401", "403", "404", "409", "422", "503"))},
        "/v1/games": {"get": _op("Every game with its rules", GamesOut, errors=("401",))},
        "/v1/games/{game}/draws/current": {"get": _op("The next draw still on sale",
                                                      CurrentDrawOut, params=("game",))},
        draw: {"get": _op("A draw and its status", DrawOut, params=("game", "draw"))},
        draw + "/close": {"post": _op("Stop sales for a draw now", DrawOut,
                                      params=("game", "draw"))},
        draw + "/combinations/{numbers}": {"get": _op(
            "How much a combination has staked on a draw", CombinationOut,
            params=("game", "draw", "numbers"), errors=("401", "403", "404", "422", "503"))},
        draw + "/capped": {"get": _op("The combinations at their cap for a draw", CappedOut,
                                      params=("game", "draw"))},
        draw + "/exposure": {"get": _op(
            "What is at stake on a draw: stakes by size, combinations at or near their cap, "
            "the 20 most played and their top-rank liability", ExposureOut,
            params=("game", "draw"))},
        draw + "/report": {"get": _op(
            "The draw's report from the journal: tickets and grids by outcome, stakes by "
            "size and channel, combinations at and over their cap, the top 20 and their "
            "liability, the journal files read (written once when the draw is final)",
            DrawReport, params=("game", "draw", "format"),
            errors=("401", "403", "404", "422", "503"))},
        draw + "/reconcile": {"post": _op(
            "The sales system's export of the draw (CSV: channel, ticket_id, total_cost) "
            "against capsvc's decisions: every difference by ticket id", Reconciliation,
            params=("game", "draw", "grace", "cancel_abandoned"),
            errors=("401", "403", "404", "413", "422", "503"))},
        "/v1/games/{game}/availability": {"post": _op(
            "Whether grids could be sold (advisory, counts nothing)", AvailabilityOut,
            body=AvailabilityIn, params=("game",), errors=write_errors)},
        "/v1/players/{player_id}": {"get": _op(
            "A player's day: spent, limits, remaining", PlayerOut,
            params=("player_id", "game_query"), errors=("401", "403", "404", "422", "503"))},
        "/v1/players/{player_id}/limit": {"put": _op(
            "Set (or remove, with null) the player's own daily limit: lowering applies at "
            "once, raising or removing from the next day", PlayerOut, body=LimitIn,
            params=("player_id", "game_query"), errors=write_errors)},
        "/v1/players/{player_id}/stakes": {"post": _op(
            "Record a stake played on another game against the same daily budget "
            "(idempotent by ref)", StakeOut, body=StakeIn, params=("player_id", "game_query"),
            errors=write_errors)},
        "/healthz": {"get": _op("Liveness", HealthOut, errors=(), auth=False)},
        "/readyz": {"get": _op("Readiness: Redis answers and the scripts are loaded",
                               HealthOut, errors=(), auth=False)},
    }
    export = {"type": "string", "description": (
        "UTF-8 CSV, a header naming at least channel, ticket_id, total_cost (minor units); "
        "other columns ignored")}
    paths[draw + "/reconcile"]["post"]["requestBody"] = {"required": True, "content": {
        "text/csv": {"schema": export},
        # The same bytes, for client generators that know no text/csv body.
        "application/octet-stream": {"schema": {**export, "format": "binary"}}}}
    paths[draw + "/report"]["get"]["responses"]["200"]["content"]["text/csv"] = {
        "schema": {"type": "string"}}
    paths["/readyz"]["get"]["responses"]["503"] = {"description": "Not ready, or draining",
                                                   "headers": _REQUEST_ID, **_json(HealthOut)}
    paths["/v1/games/{game}/capped/stream"] = {"get": {
        "summary": "The live sold-out feed, as server-sent events: a `snapshot` (or, with "
                   "Last-Event-ID, the events missed), then `capped`, `reopened` and `closed` "
                   "events and a comment heartbeat every 15 s",
        "parameters": [_PARAMS["game"], {
            "name": "draw", "in": "query", "required": False,
            "schema": {"type": "integer", "minimum": 1, "maximum": MAX_DRAW},
            "description": "follow this draw only"}, {
            "name": "Last-Event-ID", "in": "header", "required": False,
            "schema": {"type": "string", "pattern": r"^[0-9]+-[0-9]+(?!\n)$"},
            "description": "resume after this event"}],
        "responses": {"200": {"description": "OK", "headers": _REQUEST_ID, "content": {
            "text/event-stream": {"schema": {
                "description": "events of fields event, id and data (JSON); see docs/api.md"}}}},
            **{c: _error(c) for c in ("401", "403", "404", "422", "503")}}}}
    paths["/metrics"] = {"get": {
        "summary": "Prometheus metrics (text format 0.0.4); with several workers, all of them",
        "security": [],
        "responses": {"200": {"description": "OK", "headers": _REQUEST_ID, "content": {
            "text/plain": {"schema": {"type": "string"}}}}}}}
    paths["/openapi.json"] = {"get": {
        "summary": "This document",
        "security": [],
        "responses": {"200": {"description": "OK", "headers": _REQUEST_ID, "content": {
            "application/json": {"schema": {"type": "object"}}}}}}}
    # A batch's tickets are each judged as if sent alone: one that is not a valid ticket is
    # answered in its own result (422), not by the whole request.
    components["TicketsIn"]["properties"]["tickets"]["items"] = {
        "$ref": _REF.format(name="TicketIn"),
        "description": "a ticket as POST /v1/tickets takes it; one that is not is answered "
                       "in its result with the status it would have had alone"}
    _ticket_results(components)
    for path, operations in paths.items():
        for method, op in operations.items():
            op["operationId"], tag = OPERATIONS[method, path]
            op["tags"] = [tag]
    _add_links(paths)
    for path, method, text in _DESCRIPTIONS:
        paths[path][method]["description"] = text
    return {
        "openapi": "3.1.0",
        "info": {"title": "capsvc", "version": CONTRACT_VERSION, "description": _ABOUT},
        "tags": _TAGS,
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


_ABOUT = (
    "Stake-cap and sales-validation service for lottery Keno. This document is the same for "
    "every deployment: what a game allows (numbers, picks, stakes, durations, options, "
    "grids a ticket, player limits) is served by `GET /v1/games` and enforced with the "
    "documented errors (`422 stake_not_allowed`, `picks_not_allowed`, …). Its version is "
    "semantic: a breaking change (an operation, field or accepted value removed, a field "
    "renamed or newly required, a value added to a response's enumeration) makes a new "
    "major version; a minor one only adds (operations, optional request fields, response "
    "fields: ignore those you do not know).")

_UNKNOWN = (
    "A 503, a timeout or a broken connection means the outcome is unknown, not that nothing "
    "happened: send the same request again (the same ticket id and the same body), after "
    "Retry-After, until a decision comes back. Never sell it again under a new ticket id "
    "(the stake would be counted twice); never give up silently (a counted sale would have "
    "no receipt). ")
_DESCRIPTIONS = [
    ("/v1/tickets", "post",
     "Every grid is judged against the cap of its combination on every draw of the ticket; "
     "grids that would pass it are rejected, the others counted, atomically. " + _UNKNOWN +
     "A replay answers the decision already made, identical, with `Idempotent-Replayed: "
     "true`; the same ticket id with another body is `409 idempotency_conflict`, nothing "
     "counted. A decision is journaled before it is answered."),
    ("/v1/ticket-batches", "post",
     "1 to `[server] max_batch` tickets (default 256), each judged exactly as if it had been "
     "sent alone to POST /v1/tickets (same rules, same idempotency by ticket id, the same "
     "body a replay returns): one result per ticket, in the order sent, with the status and "
     "body that ticket alone would have been answered and, for a decision, whether it was a "
     "replay. Not a transaction: one ticket refused, capped or unknown changes nothing for "
     "the others. A result 503 is an unknown outcome: send that ticket again, alone or in "
     "a later batch, with the same ticket id and body. Whole-request problems answer as "
     "usual: 401/403, 400, 413, 422 when the body is not a list of 1 to max_batch tickets "
     "or names one ticket id twice (the path of the second), 503. Every decision is "
     "journaled before the answer."),
    ("/v1/tickets/{ticket_id}", "get",
     "The decision as first answered (with `cancelled` once cancelled); 404 if this channel "
     "never had it decided. `409 ticket_pending`: the sale was interrupted before its "
     "decision; send the original sale again, or ask again (the service settles it within "
     "its pending deadline)."),
    ("/v1/tickets/{ticket_id}/cancel", "post",
     "Gives back every counter and player budget the ticket took, exactly once: a replay "
     "answers the same. " + _UNKNOWN.replace("the same ticket id and the same body",
                                             "the same ticket id")),
]


BATCH_ITEM_ERRORS = (400, 403, 404, 409, 422, 503)
"""The statuses a ticket of a batch can be answered alone, but for 200 (401 and 413 are the
whole request's)."""


def _ticket_results(components: dict[str, Any]) -> None:
    """A ticket's result carries what POST /v1/tickets would have answered for it alone:
    a decision (200, TicketOut) or an error (ErrorOut). Told apart by `status`, an
    enumeration each, so that a generated client reads either body as the one it is."""
    result = components["TicketResult"]
    ref = _REF.format
    components["TicketDecisionResult"] = {
        "title": "TicketDecisionResult", "type": "object",
        "description": "A ticket of the batch decided: its decision, as POST /v1/tickets "
                       "would have answered it, and whether it was a replay.",
        "properties": {"status": {"type": "integer", "enum": [200]},
                       "replayed": {"type": "boolean"},
                       "body": {"$ref": ref(name="TicketOut")}},
        "required": ["status", "replayed", "body"]}
    components["TicketErrorResult"] = {
        "title": "TicketErrorResult", "type": "object",
        "description": "A ticket of the batch refused or of unknown outcome (503: send it "
                       "again), as POST /v1/tickets would have answered it.",
        "properties": {"status": {"type": "integer", "enum": list(BATCH_ITEM_ERRORS)},
                       "body": {"$ref": ref(name="ErrorOut")}},
        "required": ["status", "body"]}
    components["TicketResult"] = {
        "title": "TicketResult", "description": result["description"],
        "oneOf": [{"$ref": ref(name="TicketDecisionResult")},
                  {"$ref": ref(name="TicketErrorResult")}]}


def _add_links(paths: dict[str, Any]) -> None:
    """OpenAPI links: what a sale's answer lets a client do next (look it up, cancel it),
    and a player's limit set then read."""
    ticket = {"ticket_id": "$response.body#/ticket_id"}
    paths["/v1/tickets"]["post"]["responses"]["200"]["links"] = {
        "GetTicket": {"operationId": "getTicket", "parameters": ticket,
                      "description": "the decision, as stored"},
        "CancelTicket": {"operationId": "cancelTicket", "parameters": ticket,
                         "description": "give the stake back"},
    }
    player = {"player_id": "$request.path.player_id"}
    paths["/v1/players/{player_id}/limit"]["put"]["responses"]["200"]["links"] = {
        "GetPlayer": {"operationId": "getPlayer", "parameters": player,
                      "description": "the player's day"},
    }


def _settle_optional_fields(components: dict[str, Any]) -> None:
    """Optional fields as generated clients read them. A request's default is the server's
    to apply: it is said in the field's description, not as `default`, which generators
    (openapi-typescript's default options) read as "always present". A response field is
    either always there (required) or, when its struct omits defaults, absent at its
    default, never null for it."""
    for struct in _structs(msgspec.inspect.multi_type_info(_TYPES)):
        schema = components[struct.cls.__name__]
        config = struct.cls.__struct_config__
        request = config.forbid_unknown_fields
        for field in struct.fields:
            prop = schema["properties"][field.encode_name]
            default = prop.pop("default", None)
            if field.required:
                continue
            if request:
                if default is not None:
                    said = f"Default: {json.dumps(default)}."
                    prop["description"] = f"{prop['description']} {said}" \
                        if "description" in prop else said
            elif not config.omit_defaults:
                schema.setdefault("required", []).append(field.encode_name)
            elif field.default is None and "anyOf" in prop:
                (kept,) = [s for s in prop.pop("anyOf") if s.get("type") != "null"]
                prop.update(kept)
        if "required" in schema:
            order = [f.encode_name for f in struct.fields]
            schema["required"] = sorted(set(schema["required"]), key=order.index)


def _type_enumerations(schema: Any) -> None:
    """`"type": "string"` beside every enumeration of strings (msgspec says only `enum` for
    a Literal): generators type such a field as a string enum, not as unknown."""
    if isinstance(schema, dict):
        values = schema.get("enum")
        if values and "type" not in schema and all(isinstance(v, str) for v in values):
            schema["type"] = "string"
        for value in schema.values():
            _type_enumerations(value)
    elif isinstance(schema, list):
        for value in schema:
            _type_enumerations(value)


def _structs(types: Any) -> list[msgspec.inspect.StructType]:
    """Every struct reachable from `types`, each once."""
    found: dict[type, msgspec.inspect.StructType] = {}
    todo = list(types)
    while todo:
        t = todo.pop()
        if isinstance(t, msgspec.inspect.StructType):
            if t.cls in found:
                continue
            found[t.cls] = t
            todo.extend(f.type for f in t.fields)
        for attr in ("item_type", "key_type", "value_type"):
            if (inner := getattr(t, attr, None)) is not None:
                todo.append(inner)
        todo.extend(getattr(t, "types", ()))
    return list(found.values())


def as_openapi_30(document: dict[str, Any]) -> dict[str, Any]:
    """The same contract in OpenAPI 3.0.3: a nullable value is `nullable: true` (not an
    `anyOf` with `{"type": "null"}`), a schema's examples one `example`, and a `$ref` with
    a description of its own is wrapped in `allOf` (3.0 ignores a `$ref`'s siblings)."""
    def schema(node: Any) -> Any:
        if isinstance(node, list):
            return [schema(n) for n in node]
        if not isinstance(node, dict):
            return node
        node = {k: schema(v) for k, v in node.items()}
        options = node.get("anyOf")
        if options and {"type": "null"} in options:
            rest = [o for o in options if o != {"type": "null"}]
            del node["anyOf"]
            (only,) = rest
            node.update({"allOf": [only]} if "$ref" in only else only)
            node["nullable"] = True
        if isinstance(node.get("examples"), list) and "type" in node:
            node["example"] = node.pop("examples")[0]
        if "$ref" in node and len(node) > 1:
            node = {"allOf": [{"$ref": node.pop("$ref")}], **node}
        return node

    converted: dict[str, Any] = schema(copy.deepcopy(document))
    converted["openapi"] = "3.0.3"
    return converted


def openapi_text(document: dict[str, Any]) -> str:
    """The document as the repository keeps it: indented JSON, UTF-8 characters as they
    are, one newline at the end. `GET /openapi.json` serves these bytes, so the installed
    service, which has no copy of the file, serves the file byte for byte."""
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    """Print the document as the repository keeps it: `openapi.json`, or with `--3.0`
    `openapi-3.0.json`."""
    args = sys.argv[1:] if argv is None else list(argv)
    document = openapi_document()
    if args == ["--3.0"]:
        document = as_openapi_30(document)
    elif args:
        raise SystemExit("usage: python -m capsvc.http.openapi [--3.0]")
    sys.stdout.write(openapi_text(document))


if __name__ == "__main__":
    main()
