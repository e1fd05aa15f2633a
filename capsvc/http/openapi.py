"""The OpenAPI 3.1 document, generated from the msgspec request and response types."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import msgspec

from capsvc import __version__
from capsvc.audit.reconcile import Reconciliation
from capsvc.config import GameRules
from capsvc.domain.models import (
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
from capsvc.domain.reports import DrawReport

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
                "schema": {"type": "string", "pattern": r"^[0-9]+(-[0-9]+)*(?!\n)$"},
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


def openapi_document(games: Sequence[GameRules] = ()) -> dict[str, Any]:
    """The document; with the configured `games`, its schemas say what each game allows
    (numbers, picks, stakes, durations, options, grids a ticket, game ids), so that a
    request valid by the document breaks no rule of the game's that JSON Schema can say."""
    (_, components) = msgspec.json.schema_components(_TYPES, ref_template=_REF)
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
            body=TicketsIn, errors=("400", "401", "413", "422", "503"))},
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
        "description": "a ticket as POST /v1/tickets takes it (TicketIn); one that is not is "
                       "answered in its result with the status it would have had alone"}
    # A ticket's result carries what POST /v1/tickets would have answered for it alone.
    components["TicketResult"]["properties"]["body"] = {
        "oneOf": [{"$ref": _REF.format(name="TicketOut")},
                  {"$ref": _REF.format(name="ErrorOut")}]}
    for path, operations in paths.items():
        for method, op in operations.items():
            op["operationId"], tag = OPERATIONS[method, path]
            op["tags"] = [tag]
    _add_links(paths)
    for path, method, text in _DESCRIPTIONS:
        paths[path][method]["description"] = text
    if games:
        _narrow_to_games(games, paths, components)
    return {
        "openapi": "3.1.0",
        "info": {"title": "capsvc", "version": __version__,
                 "description": "Stake-cap and sales-validation service for lottery Keno."},
        "tags": _TAGS,
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


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


def _narrow_to_games(games: Sequence[GameRules], paths: dict[str, Any],
                     components: dict[str, Any]) -> None:
    """Per game, a ticket schema of its own (the sale's body: one of them, by `game`); the
    game-less bodies (availability) and path parameters narrowed to what some game allows."""
    refs = {}
    for g in games:
        grid, ticket = f"GridIn-{g.id}", f"TicketIn-{g.id}"
        components[grid] = _grid_schema(g, components["GridIn"])
        components[ticket] = _ticket_schema(g, components["TicketIn"], grid)
        refs[g.id] = _REF.format(name=ticket)
    body: dict[str, Any] = (
        {"$ref": next(iter(refs.values()))} if len(refs) == 1 else
        {"oneOf": [{"$ref": r} for r in refs.values()],
         "discriminator": {"propertyName": "game", "mapping": refs}})
    paths["/v1/tickets"]["post"]["requestBody"]["content"]["application/json"]["schema"] = body
    components["TicketIn"]["properties"]["game"] = {"type": "string", "enum": list(refs)}

    top, low, high = (max(g.numbers for g in games), min(g.picks_min for g in games),
                      max(g.picks_max for g in games))
    any_grid = components["AvailabilityGridIn"]["properties"]
    any_grid["numbers"] = _numbers_schema(top, low, high)
    any_grid["stake"] = {"type": "integer", "enum": sorted({s for g in games for s in g.stakes}),
                         "description": "a stake some game allows (the game's own: GET "
                                        "/v1/games)"}
    availability = components["AvailabilityIn"]["properties"]
    availability["draws"] = _draws_schema(sorted({d for g in games for d in g.durations}))
    availability["grids"]["maxItems"] = max(g.max_grids for g in games)
    availability["first_draw"] = _first_draw_schema()

    limits = [g.daily_limit for g in games if g.daily_limit is not None]
    if limits:  # a self-limit above the regulatory one is refused
        for option in components["LimitIn"]["properties"]["daily"]["anyOf"]:
            if option.get("type") == "integer":
                option["maximum"] = max(limits)
    limited = sorted(g.id for g in games if g.daily_limit is not None)
    narrowed = {  # new parameters: the shared ones (_PARAMS) stay as they are
        "game": {"type": "string", "enum": sorted(refs)},
        "numbers": {"type": "string", "pattern": (
            f"^{_number_re(top)}(-{_number_re(top)}){{{low - 1},{high - 1}}}(?!\\n)$")},
        "game_query": {"type": "string", "enum": limited} if limited else None,
    }
    for item in paths.values():
        for op in item.values():
            params = op.get("parameters")
            if params is None:
                continue
            op["parameters"] = [
                {**p, "schema": narrowed[key]}
                if (key := _param_key(p)) in narrowed and narrowed[key]
                else p
                for p in params]


def _param_key(param: dict[str, Any]) -> str:
    return "game_query" if (param["name"], param["in"]) == ("game", "query") else param["name"]


def _grid_schema(g: GameRules, base: dict[str, Any]) -> dict[str, Any]:
    schema = copy.deepcopy(base)
    schema["title"] = f"GridIn ({g.id})"
    props = schema["properties"]
    props["numbers"] = _numbers_schema(g.numbers, g.picks_min, g.picks_max)
    props["stake"] = {"type": "integer", "enum": list(g.stakes),
                      "description": "the base stake, minor units"}
    if not g.multiplier:
        props["multiplier"] = {"type": "boolean", "enum": [False], "default": False,
                               "description": "the game has no multiplier option"}
    return schema


def _ticket_schema(g: GameRules, base: dict[str, Any], grid: str) -> dict[str, Any]:
    schema = copy.deepcopy(base)
    schema["title"] = f"TicketIn ({g.id})"
    schema["description"] = f"A ticket of {g.id}: {g.description}"
    props = schema["properties"]
    props["game"] = {"type": "string", "enum": [g.id]}
    props["grids"] = {"type": "array", "items": {"$ref": _REF.format(name=grid)},
                      "minItems": 1, "maxItems": g.max_grids}
    props["draws"] = _draws_schema(list(g.durations))
    props["first_draw"] = _first_draw_schema()
    if g.joker_plus_price is None:
        props["joker_plus"] = {"type": "boolean", "enum": [False], "default": False,
                               "description": "the game has no Joker+ option"}
    required = set(schema.get("required", ()))
    if g.daily_limit is not None:  # player limits: the player is named
        props["player_id"] = next(s for s in props["player_id"]["anyOf"]
                                  if s.get("type") != "null")
        required.add("player_id")
    if 1 not in g.durations:
        required.add("draws")
    schema["required"] = sorted(required)
    return schema


def _numbers_schema(top: int, low: int, high: int) -> dict[str, Any]:
    return {"type": "array", "minItems": low, "maxItems": high, "uniqueItems": True,
            "items": {"type": "integer", "minimum": 1, "maximum": top},
            "description": f"{low} to {high} distinct numbers of 1..{top}, in any order"}


def _draws_schema(durations: list[int]) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer", "enum": durations,
                              "description": "consecutive draws played (1: one draw)"}
    if 1 in durations:
        schema["default"] = 1
    return schema


def _first_draw_schema() -> dict[str, Any]:
    return {"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_DRAW,
                       "description": "a draw on sale (default: the next one)"},
                      {"type": "null"}], "default": None}


def _number_re(top: int) -> str:
    """A regular expression of the decimal numbers 1..top (top < 100)."""
    if top < 10:
        return f"[1-{top}]"
    tens, units = divmod(top, 10)
    parts = ["[1-9]"]
    if tens > 1:
        parts.append(f"[1-{tens - 1}][0-9]")
    parts.append(f"{tens}[0-{units}]")
    return "(?:" + "|".join(parts) + ")"
