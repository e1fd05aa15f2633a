"""capsvc's Python client: the sale protocol done right for an integrator.

`Client(base_url, token)` (async, aiohttp; an async context manager) and
`SyncClient(base_url, token)` (the same methods, blocking, for scripts). The types are the
API's msgspec types (`capsvc.client.models`, `capsvc.client.reports`), which the service
itself decodes and encodes, re-exported here.

What it gets right, so that its callers do not have to:
- a sale (`sell`) and a cancel (`cancel`) are sent again, with the same ticket id and the
  same body, on a 503, a timeout or a broken connection, with exponential backoff, jitter
  and the server's `Retry-After`, until a decision comes or the caller's deadline passes:
  then `OutcomeUnknown`, carrying the ticket id — never a guess (the sale may have been
  counted; `ticket()` tells, once decided);
- a 4xx is never sent again: it raises its typed error (`ValidationError`,
  `ConflictError`, `AuthError`, `NotFoundError`);
- one connection pool (HTTP keep-alive), the bearer token, the caller's request id;
- everything it raises is a `CapsvcError`.

The base install of the `capsvc` distribution (the service is its `server` extra): it needs
aiohttp and msgspec, and knows the HTTP API only (docs/api.md), nothing of Redis or of the
service's insides.
"""

from capsvc.client.api import Client, FeedEvent, SyncClient
from capsvc.client.errors import (
    AnswerError,
    AuthError,
    CapsvcError,
    ClientClosed,
    ConflictError,
    NotFoundError,
    OutcomeUnknown,
    ServiceError,
    Unavailable,
    UsageError,
    ValidationError,
)
from capsvc.client.models import (
    AvailabilityIn,
    AvailabilityOut,
    CancelOut,
    CappedOut,
    CombinationOut,
    CurrentDrawOut,
    DrawOut,
    GamesOut,
    GridIn,
    PlayerOut,
    StakeOut,
    TicketIn,
    TicketOut,
)
from capsvc.client.reports import DrawReport

__all__ = [
    "AnswerError",
    "AuthError",
    "AvailabilityIn",
    "AvailabilityOut",
    "CancelOut",
    "CappedOut",
    "CapsvcError",
    "Client",
    "ClientClosed",
    "CombinationOut",
    "ConflictError",
    "CurrentDrawOut",
    "DrawOut",
    "DrawReport",
    "FeedEvent",
    "GamesOut",
    "GridIn",
    "NotFoundError",
    "OutcomeUnknown",
    "PlayerOut",
    "ServiceError",
    "StakeOut",
    "SyncClient",
    "TicketIn",
    "TicketOut",
    "Unavailable",
    "UsageError",
    "ValidationError",
]
