"""The API's request and response types (msgspec Structs).

They are the single source of the wire format: requests are decoded straight into them,
responses encoded from them, and `/openapi.json` is generated from them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Raw, Struct

MAX_DRAW = 10**9
"""The largest draw number the API knows (a game drawn every minute reaches it in 1,900
years): a draw of the path beyond it is a 404."""

SAFE_INT = Meta(ge=-(2**53), le=2**53)
"""Any integer a JSON peer can represent exactly; game rules narrow it further."""

ID_PATTERN = r"^[A-Za-z0-9._:-]+(?!\n)$"
"""An id, matched whole both by Python's `re.search` (msgspec, jsonschema) and in ECMA-262
(JSON Schema): the lookahead stops Python's `$` from matching before a final newline, and
is always true at the end of the string in ECMA. The lengths are min/max_length's."""

TicketId = Annotated[
    str,
    Meta(min_length=1, max_length=64, pattern=ID_PATTERN,
         description="1-64 characters of [A-Za-z0-9._:-]", examples=["A-000123"]),
]
PlayerId = Annotated[
    str,
    Meta(min_length=1, max_length=64, pattern=ID_PATTERN,
         description="1-64 characters of [A-Za-z0-9._:-]", examples=["P-42"]),
]
INT64 = Meta(extra_json_schema={"format": "int64"})
"""An integer that can pass 2^31: `format: int64` in the document, so that generators give
it 64 bits (`Long` in Java), not the 32 they give an integer without a format. Money, and
every count that sums sales or grows with the journal, is one; what the contract bounds far
below 2^31 (a draw number, a ticket's draws and grids, a grid's numbers and index, picks,
a game's sizes and durations) is not."""

Money = Annotated[int, INT64, Meta(
    description="minor units of the game's currency (cents, centimes)")]
"""An amount: a stake, a cost, a cap, what is left under one, a liability, a limit."""
Tickets = Annotated[int, INT64, Meta(description="a number of tickets")]
Grids = Annotated[int, INT64, Meta(description="a number of grids")]
Combinations = Annotated[int, INT64, Meta(description="a number of combinations")]

Number = Annotated[int, SAFE_INT]
Amount = Annotated[Money, SAFE_INT]
"""An amount a request carries: any a JSON peer represents exactly (game rules narrow it)."""
Draw = Annotated[int, SAFE_INT, Meta(description="draw number")]
Numbers = Annotated[list[Number], Meta(max_length=100)]


class GridIn(Struct, forbid_unknown_fields=True):
    numbers: Numbers
    stake: Amount
    multiplier: bool = False


class TicketIn(Struct, forbid_unknown_fields=True):
    ticket_id: TicketId
    game: Annotated[str, Meta(max_length=64)]
    grids: Annotated[list[GridIn], Meta(min_length=1, max_length=100)]
    player_id: PlayerId | None = None
    first_draw: Draw | None = None
    draws: Annotated[int, SAFE_INT] = 1
    joker_plus: bool = False


class AvailabilityGridIn(Struct, forbid_unknown_fields=True):
    numbers: Numbers
    stake: Amount


class AvailabilityIn(Struct, forbid_unknown_fields=True):
    grids: Annotated[list[AvailabilityGridIn], Meta(min_length=1, max_length=100)]
    first_draw: Draw | None = None
    draws: Annotated[int, SAFE_INT] = 1


GridStatus = Literal["accepted", "rejected"]
TicketStatus = Literal["accepted", "partial", "rejected"]


class GridOut(Struct, omit_defaults=True):
    index: int
    numbers: list[int]
    status: GridStatus
    cost: Money | None = None
    reason: str | None = None
    draw: int | None = None
    remaining: Money | None = None


class Receipt(Struct):
    receipt_id: str
    issued_at: str


class Cancellation(Struct):
    """When a ticket was cancelled, and what it gave back (minor units)."""

    at: str
    released: Money


class TicketOut(Struct, omit_defaults=True):
    ticket_id: str
    game: str
    status: TicketStatus
    draws: list[int]
    grids: list[GridOut]
    total_cost: Money
    receipt: Receipt | None
    reason: str | None = None
    state: Literal["cancelled"] | None = None
    """Only on GET, once the ticket is cancelled: "cancelled" (absent: the decision stands
    as answered). What to switch on; `status` stays the decision's."""
    cancelled: Cancellation | None = None
    """Only on GET, once the ticket is cancelled (a POST replay answers the decision)."""


class CancelOut(Struct):
    ticket_id: str
    status: Literal["cancelled"]
    released: Money


class CombinationOut(Struct):
    numbers: list[int]
    draw: int
    cap: Money | None
    staked: Money | None
    remaining: Money | None
    selectable: bool


class AvailabilityGridOut(Struct, omit_defaults=True):
    index: int
    available: bool
    draw: int | None = None
    remaining: Money | None = None


class AvailabilityOut(Struct):
    grids: list[AvailabilityGridOut]


class CappedOut(Struct):
    draw: int
    combinations: list[list[int]]


class DrawOut(Struct):
    draw: int
    closes_at: str
    status: Literal["open", "closed"]
    cap: Money | None = None
    """The cap in force for the draw (minor units; null for a game without a cap): fixed
    by the draw's first sale, else the configured one, which the first sale will fix."""
    cap_fixed: bool = False
    """Whether a sale has fixed the draw's cap (a configuration change no longer moves it)."""


class PicksStake(Struct):
    picks: int
    stake: Money
    """Base stake accepted on the draw by grids of `picks` numbers (minor units)."""


class CappedPicks(Struct):
    picks: int
    played: Combinations
    """Combinations of this size with a stake on the draw."""
    at_cap: Combinations
    """Of those, combinations at their cap (the smallest stake no longer fits)."""
    near_cap: Combinations
    """Of those, combinations at 80 % of the cap or more (those at the cap included)."""
    stake: Money


class TopCombination(Struct):
    numbers: list[int]
    staked: Money
    liability: Money | None
    """The top-rank prize it would pay if drawn: staked / prize_base_stake x the game's top
    prize for its size (minor units); null when the game has no top prize for that size."""


class ExposureOut(Struct):
    draw: int
    cap: Money | None
    cap_fixed: bool
    computed_at: str
    """When these figures were computed (they are kept a few seconds)."""
    stakes: list[PicksStake]
    capped: list[CappedPicks]
    top: list[TopCombination]
    """The 20 combinations with the largest stake on the draw, largest first."""
    top_liability: Money | None
    """The largest `liability` of `top`."""


class CurrentDrawOut(Struct):
    draw: int
    closes_at: str


class GameOut(Struct):
    id: str
    preset: str
    description: str
    currency: str
    numbers: int
    picks_min: int
    picks_max: int
    stakes: list[Money]
    durations: list[int]
    cap_limit: Money | None
    shadow_cap_limit: Money | None
    capped_picks: list[int]
    daily_limit: Money | None
    time_zone: str
    draw_times: list[str]
    """Local times of the day's draws, "HH:MM" (or "HH:MM:SS" when a draw is not on a
    whole minute)."""
    cancel: str
    retention_seconds: int
    max_grids: int
    sales_horizon: int
    subscription_accounting: str
    multiplier: bool
    joker_plus_price: Money | None
    top_prizes: dict[str, Money]
    """Top-rank prize by number of picks, for a stake of `prize_base_stake`."""
    prize_base_stake: Money


class GamesOut(Struct):
    games: list[GameOut]


class LimitIn(Struct, forbid_unknown_fields=True):
    daily: Annotated[Money, Meta(ge=0, le=2**53)] | None
    """The player's own daily limit (minor units); null removes it."""


class StakeIn(Struct, forbid_unknown_fields=True):
    ref: TicketId
    game: Annotated[str, Meta(min_length=1, max_length=64)]
    amount: Annotated[Money, Meta(ge=1, le=2**53)]


class PlayerOut(Struct):
    player_id: str
    day: str
    spent: Money
    limit: Money
    """The regulatory daily limit."""
    self_limit: Money | None
    """The player's own limit in force today."""
    remaining: Money
    pending_self_limit: Money | None = None
    """A raised (or removed: null) self-limit waiting for `pending_from`."""
    pending_from: str | None = None


class StakeOut(Struct):
    status: Literal["accepted", "rejected"]
    remaining: Money


class TicketsIn(Struct, forbid_unknown_fields=True):
    """`POST /v1/ticket-batches`: several sales, each judged as if sent alone."""

    tickets: Annotated[list[TicketIn], Meta(min_length=1)]


class TicketResult(Struct, omit_defaults=True):
    """One ticket of a batch: the status and body `POST /v1/tickets` would have answered
    for it alone (a decision, `TicketOut`, or an error, `ErrorOut`), and whether it was a
    replay (decisions only)."""

    status: int
    body: Raw
    replayed: bool | None = None


class TicketsOut(Struct):
    """One result per ticket of the batch, in the order sent."""

    results: list[TicketResult]


class ErrorDetail(Struct):
    code: str
    message: str
    path: str | None


class ErrorOut(Struct):
    error: ErrorDetail


class HealthOut(Struct):
    status: str
    checks: dict[str, bool] = {}
