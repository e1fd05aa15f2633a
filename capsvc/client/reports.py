"""The draw report's wire types: what `GET /v1/games/{game}/draws/{draw}/report` answers and
`capsvc report` writes (docs/audit.md, field by field). Built by capsvc.audit.report; read by
the client, which imports nothing else of the server."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct, field

from capsvc.client.models import INT64, Combinations, Grids, Money, Tickets

Line = Annotated[int, INT64, Meta(description="a line of the file, from 1")]
"""A place in a journal file, which grows with the sales (as its bytes and lines do)."""


class Source(Struct, frozen=True):
    """A journal file read, as it was when read (a report names each)."""

    directory: str
    file: str
    proc: str | None
    """The process that wrote it."""
    sha256: str
    """SHA-256 of the file's bytes read: `sha256sum` of the file, while it is not written
    to any more."""
    bytes: Annotated[int, INT64, Meta(description="a number of bytes")]
    lines: Annotated[int, INT64, Meta(description="a number of lines")]


class TicketCounts(Struct):
    """Tickets that play the draw, each counted once under its state now."""

    accepted: Tickets = 0
    partial: Tickets = 0
    rejected: Tickets = 0
    cancelled: Tickets = 0
    """Accepted or partial, then cancelled: stands no more."""
    void: Tickets = 0
    """Claimed, never answered: released by the janitor, or claimed after an admin stop."""


class ListedTicket(Struct):
    """A ticket of the draw that does not stand: refused, cancelled or void, with what an
    auditor needs to find it in the sales system and in the journal. Every field is always
    present (null where it does not apply)."""

    channel: str
    ticket_id: str
    sale: str
    """The sale id (16 hex digits): names this sale of the ticket id."""
    status: str | None
    """The decision as answered: `rejected`; for a cancelled ticket `accepted` or
    `partial`; null for a void (never answered)."""
    reason: str | None
    """Refused: the ticket's reason (`player_limit`, …), else its grids' reasons
    (`combination_capped`), comma-separated. Void: why (`abandoned`, `stopped`, `closed`).
    Cancelled: null."""
    decided_at: str
    """The sale's instant: when it was claimed (Redis TIME), the receipt's issue time of a
    decision."""
    first_draw: int
    draws: int
    """The draws the ticket plays, from `first_draw` (a subscription is in each one's
    report)."""
    grids: int
    stake: Money
    """Base stake on this draw: refused (every grid), given back by the cancellation (the
    grids that were accepted), or claimed and given back (void)."""
    total_cost: Money | None
    """The decision's total cost (all draws and options); null for a void."""
    released: Money | None
    """Cancelled: the cost given back."""
    cancelled_at: str | None
    """Cancelled: when the cancellation was decided (Redis TIME)."""
    proc: str
    """The process that journaled the record (host/pid)."""
    file: str
    line: Line
    """The journal record that puts the ticket in this list (the decision; the cancel; the
    void): its file (see `sources` for its directory) and line."""


class TicketLists(Struct):
    """The draw's tickets that do not stand, each once, sorted by channel, ticket id and
    sale id. Accepted and partial tickets are counted, not listed."""

    rejected: list[ListedTicket] = []
    cancelled: list[ListedTicket] = []
    void: list[ListedTicket] = []


class ReasonCount(Struct):
    reason: str
    grids: Grids


class GridCounts(Struct):
    accepted: Grids = 0
    """Grids that stand (their tickets not cancelled)."""
    cancelled: Grids = 0
    """Grids accepted, then given back by their ticket's cancellation."""
    rejected: list[ReasonCount] = []
    """Grids refused, by reason (whatever became of their tickets)."""


class PicksLine(Struct):
    picks: int
    grids: Grids
    stake: Money
    """Base stake on this draw (what the cap counts)."""
    amount: Money
    """What the players paid for this draw: twice the stake with the multiplier."""


class ChannelLine(Struct):
    channel: str
    tickets: Tickets
    """Standing tickets (accepted or partial)."""
    grids: Grids
    stake: Money
    amount: Money
    """Grids' amounts plus Joker+ for this draw."""
    cancelled: Tickets
    """Tickets cancelled."""


class CombinationLine(Struct, omit_defaults=True):
    numbers: list[int]
    staked: Money
    liability: Money | None = None
    """Top-rank liability: what the operator pays if the combination is drawn (preset
    `top_prizes`, per `prize_base_stake`)."""
    excess: Money | None = None
    """Over its cap: by how much."""


class Chain(Struct):
    intact: bool
    breaks: list[str]
    tails: list[str]
    """Torn last lines (a crash): not breaks."""


class RedisCheck(Struct):
    """The report's capped totals against Redis's counters, while the draw is retained."""

    compared: Annotated[int, INT64, Meta(description="a number of counters")]
    complete: bool
    """Every counter equals the journal's total: the journal read holds every stake
    Redis counted on this draw's capped combinations."""
    differences: list[str]


class DrawReport(Struct, omit_defaults=False):
    """The report of one draw (docs/audit.md, field by field)."""

    report: int
    game: str
    draw: int
    currency: str
    closes_at: str
    built_at: str
    """When the report was built (Redis TIME when a Redis was at hand, else the host's)."""
    final: bool
    """Built once the draw's last cancel and settlement could have been made."""
    activity: bool
    summary: str
    """"no activity" when nothing was sold or refused on the draw."""
    cap: Money | None
    """The cap in force on the draw (as its decisions carry it; the configuration's when
    nothing fixed it)."""
    cap_fixed: bool
    capped_picks: list[int]
    stopped_at: str | None
    """An admin stopped the draw's sales at this instant."""
    tickets: TicketCounts
    grids: GridCounts
    stake: Money
    """Base stake standing on the draw."""
    amount: Money
    """What the players paid for this draw (grids with the multiplier, Joker+)."""
    cancelled_stake: Money
    """Base stake given back by cancellations."""
    by_picks: list[PicksLine]
    by_channel: list[ChannelLine]
    at_cap: list[CombinationLine]
    """Combinations whose stake reached their cap exactly."""
    over_cap: list[CombinationLine]
    """Combinations whose stake passed their cap: empty when the cap held."""
    sold_out: Combinations
    """Combinations with less room than the smallest stake (at_cap included)."""
    combinations: Combinations
    """Capped combinations played."""
    top: list[CombinationLine]
    top_liability: Money | None
    sources: list[Source]
    chain: Chain
    redis: RedisCheck | None = None
    ticket_lists: TicketLists = field(default_factory=TicketLists)
    """The refused, cancelled and void tickets, one by one (`tickets` counts them)."""

    @property
    def flawed(self) -> bool:
        """A combination passed its cap, or a journal file read does not chain."""
        return bool(self.over_cap) or not self.chain.intact
