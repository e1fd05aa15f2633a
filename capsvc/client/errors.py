"""The client's errors: one type per thing a caller does something different about, all
of them `CapsvcError`s."""

from __future__ import annotations


class CapsvcError(Exception):
    """Everything the client raises: an error answer of the service (`AnswerError`), no
    answer in time (`Unavailable`, `OutcomeUnknown`), a misuse of the client
    (`UsageError`)."""


class UsageError(CapsvcError, ValueError):
    """The client used as it cannot be: an option out of range, a call outside `async with`
    or after `close()`. Nothing was sent."""


class ClientClosed(UsageError, RuntimeError):
    """The client is closed (or closing): nothing was sent."""


class AnswerError(CapsvcError):
    """An answer of the service that is not a success: its status, code and message."""

    def __init__(self, status: int, code: str, message: str, path: str | None = None
                 ) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.path = path
        """The JSONPath of the offending value, when the service names one."""


class ValidationError(AnswerError):
    """400, 413, 422: the request breaks a rule (a stake, a draw closed…): sending it again
    changes nothing; nothing was counted."""


class ConflictError(AnswerError):
    """409: the ticket id was used with another body (`idempotency_conflict`), or the ticket
    cannot be cancelled (`not_cancellable`)."""


class AuthError(AnswerError):
    """401, 403: the token is unknown, or its channel may not do this."""


class NotFoundError(AnswerError):
    """404: unknown game, draw or ticket (for this channel)."""


class ServiceError(AnswerError):
    """A 5xx on a request that is not retried (a 500 is a bug of the service)."""


class Unavailable(CapsvcError):
    """The service gave no answer before the caller's deadline (every attempt a 502, 503 or
    504, a timeout or a broken connection). For a request that decides nothing (a game, a
    draw, a combination), this is all there is to it: ask again later."""

    def __init__(self, message: str, attempts: int, last: str, request_id: str = "") -> None:
        super().__init__(message)
        self.attempts = attempts
        self.last = last
        """What the last attempt got (a status, a timeout, a connection error)."""
        self.request_id = request_id
        """The X-Request-ID every attempt was sent with (the service's logs show them)."""


class OutcomeUnknown(Unavailable):
    """No decision came before the caller's deadline: the sale (or the cancel) may have
    been recorded. Send the same request again later, or look the ticket up: never sell
    it under another id (its stake would be counted twice)."""

    def __init__(self, ticket_id: str, attempts: int, last: str, request_id: str = ""
                 ) -> None:
        super().__init__(f"ticket {ticket_id}: no decision after {attempts} attempt(s) "
                         f"({last}); the outcome is unknown", attempts, last, request_id)
        self.ticket_id = ticket_id
        """The ticket (or the stake's `ref`) whose outcome is unknown."""


def error_for(status: int, code: str, message: str, path: str | None) -> AnswerError:
    kind: type[AnswerError]
    if status in (401, 403):
        kind = AuthError
    elif status == 404:
        kind = NotFoundError
    elif status == 409:
        kind = ConflictError
    elif 400 <= status < 500:
        kind = ValidationError
    else:
        kind = ServiceError
    return kind(status, code, message, path)
