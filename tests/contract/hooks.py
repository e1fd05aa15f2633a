"""schemathesis hooks of the contract test: a request valid by the OpenAPI document and
refused all the same must be refused for one of the reasons docs/api.md lists ("What the
OpenAPI document cannot say"), never another."""

from __future__ import annotations

from typing import Any

import schemathesis

FLOAT = ("Expected `int", "got `float`")
"""JSON Schema counts 5.0 as an integer; capsvc wants 5 (any body with an integer)."""
DRAW = {"draw_closed", "draw_not_on_sale"}
"""The draws on sale move with the clock: the document cannot list them."""
GAME = {"stake_not_allowed", "picks_not_allowed", "number_out_of_range", "duplicate_numbers",
        "too_many_grids", "draws_not_allowed", "option_not_available", "player_required"}
"""What a game allows is served by GET /v1/games, not compiled into the document (the same
for every deployment): a body valid by the document may break its game's rules."""

PLAYERS = {"no_player_limits"}
"""Which game's limits apply depends on the token's channel. (And a channel with several
limited games names one with ?game=: `invalid_request` at `game`, checked below.)"""

DOCUMENTED: dict[str, set[str]] = {
    "POST /v1/tickets": DRAW | GAME,
    "POST /v1/games/{game}/availability": DRAW | GAME,
    "GET /v1/games/{game}/draws/{draw}/combinations/{numbers}": GAME,
    "POST /v1/games/{game}/draws/{draw}/reconcile": {"invalid_export"},
    "GET /v1/players/{player_id}": PLAYERS,
    "PUT /v1/players/{player_id}/limit": PLAYERS | {"limit_too_high"},
    "POST /v1/players/{player_id}/stakes": PLAYERS,
}


@schemathesis.check
def refusals_are_documented(ctx: Any, response: Any, case: Any) -> bool | None:
    """A 422 to a request generated valid: one of its operation's documented reasons."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 422:
        return None
    error = response.json()["error"]
    message: str = error["message"]
    if (error["code"] == "invalid_request" and message.startswith(FLOAT[0])
            and message.endswith(FLOAT[1])):
        return None
    if (error["code"] == "invalid_request" and error["path"] == "game"
            and case.operation.label.startswith(("GET /v1/players", "PUT /v1/players",
                                                 "POST /v1/players"))):
        return None  # "name the game with ?game=": the channel has several limited games
    if (error["code"] == "invalid_request" and "is in the batch twice" in message
            and case.operation.label == "POST /v1/ticket-batches"):
        return None  # one ticket id twice: JSON Schema cannot say "unique by a property"
    allowed = DOCUMENTED.get(case.operation.label, set())
    if error["code"] not in allowed:
        raise AssertionError(
            f"{case.operation.label}: a request valid by the document refused with "
            f"{error['code']} ({error['message']}), not a documented difference")
    return None
