"""The errors a request is refused with: one exception type carrying its kind, code, message
and JSONPath. What a kind is answered with (an HTTP status) is the HTTP layer's
(capsvc.http.app.STATUS_OF)."""

from __future__ import annotations

import copy
from typing import Literal, TypeVar

Kind = Literal["malformed", "unauthorized", "forbidden", "not_found", "method_not_allowed",
               "conflict", "too_large", "invalid", "internal", "unavailable"]
"""Why a request is refused: not readable, no or an unknown token, not allowed, unknown, a
conflict with what is recorded, too large, breaking a rule, an internal fault, unavailable
(the outcome unknown)."""


class ApiError(Exception):
    """An error answered to the client as `{"error": {"code", "message", "path"}}`."""

    def __init__(
        self,
        kind: Kind,
        code: str,
        message: str,
        path: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.kind: Kind = kind
        self.code = code
        self.message = message
        self.path = path
        self.headers = headers or {}


def rule_error(code: str, message: str, path: str | None = None) -> ApiError:
    """A well-formed request that breaks a rule."""
    return ApiError("invalid", code, message, path)


OUTCOME_UNKNOWN = ("{}: the outcome is unknown (it may have been recorded); send the same "
                   "request again to get the one decision, or GET the ticket")
"""The message of a 503 whose request may have changed something (format with the cause)."""

NOTHING_CHANGED = "{}: nothing was changed; send the request again"
"""The message of a 503 to a request that changes nothing (a GET: format with the cause)."""


def unavailable(message: str, retry_after_s: int) -> ApiError:
    """The outcome is unknown to the client, which should send the same request again
    after `retry_after_s` (it converges to one decision)."""
    return ApiError("unavailable", "unavailable", message, None,
                    {"Retry-After": str(retry_after_s)})


def not_found(what: str) -> ApiError:
    return ApiError("not_found", "not_found", f"{what} not found")


class Unavailable(Exception):
    """Redis could not be reached or answered too slowly: what was sent may or may not have
    run (the Lua steps are idempotent and fenced by sale, so the same request converges)."""


E = TypeVar("E", bound=BaseException)


def own_copy(error: E) -> E:
    """`error` anew, for one more future it fails: an instance raised by many awaits (every
    command a lost connection fails) gathers each one's frames in its traceback, which
    then grows for as long as the outage lasts and keeps those frames alive."""
    return copy.copy(error)
