"""What a journal line holds: the record types, version 1 (docs/journal.md, field by field).

A line is one JSON object: `prev` (the SHA-256, hex, of the previous line of the file, its
bytes without the newline; null on a file's first line), then `type` and the record's
fields. The writer puts `prev` in front of the encoded record (capsvc.journal.writer), so
the hot path encodes a record once and never hashes.

Every decision record carries what is needed to put the decision back into a Redis that
lost it, without the request: the channel, the ticket id, the sale id the claim minted, the
request's meaning (game, player, draws, whether the first draw was named, grids with
numbers, stake, multiplier, whether the cap counts them), the decision exactly as
answered (`decision`, the response body), the cap in force on each draw, and when it
expires from Redis (`until`).
"""

from __future__ import annotations

from typing import Literal, get_args

import msgspec
from msgspec import Raw, Struct

from capsvc.domain import combination
from capsvc.domain.decisions import render
from capsvc.domain.validator import Sale, SaleGrid

VERSION = 1
"""The format's version (`v` of a file's `open` line); readers refuse a newer one."""

Via = Literal["answer", "replay", "lookup", "janitor", "restore"]
"""How a decision record came to be written: the answer that made it, a replay of a sale
(or of a cancel), a GET of the ticket, the janitor's settlement, a restore's report."""


class Grid(Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=False, gc=False):
    """One grid as sold: what the request asked and whether the game's cap counts it."""

    numbers: list[int]
    stake: int
    multiplier: bool = False
    capped: bool = False


class Open(Struct, tag="open", tag_field="type", forbid_unknown_fields=False):
    """The first line of every file."""

    v: int
    file: str
    proc: str
    """host/pid of the process that writes the file: for people (in a container every
    process may be pid 1)."""
    life: str
    """The process lifetime's own id (16 hex digits, random): its files are one chain."""
    seq: int
    """0 for the first file of a lifetime, then 1, 2, …"""
    opened: str
    """When the file was opened, by the host's clock (RFC 3339, UTC): for people only."""
    after: str | None = None
    """The file of the same lifetime this one follows (its `seq` is one less)."""
    after_lines: int | None = None
    """How many lines `after` has: `prev` is the hash of the last of them, and `after` ends
    there."""


class Checkpoint(Struct, tag="marks", tag_field="type", forbid_unknown_fields=False):
    """What the process had written through each mark when this line was written (the G of
    its newest write there, lua/capsvc.lua, MARKS): every record before this line is
    stamped no higher, so a Redis whose marks of this lifetime reach these lacks none of
    them. Written once a second while the marks move, and when the process stops."""

    life: str
    made: dict[str, int]


class SaleRecord(Struct, tag="sale", tag_field="type", omit_defaults=True,
                 forbid_unknown_fields=False):
    """A sale's decision (accepted, partial or rejected), as answered."""

    at: int
    """Redis TIME (ms since the Unix epoch) when the sale was claimed: the decision's
    instant, the receipt's issue time."""
    via: Via
    proc: str
    channel: str
    ticket: str
    sale: str
    """The sale id the claim minted (16 hex digits): names this sale of the ticket id."""
    game: str
    first_draw: int
    draws: int
    until: int
    """When Redis forgets the ticket (ms): the close of its last draw plus retention."""
    grids: list[Grid]
    decision: Raw
    """The response body of the decision, byte for byte (without `cancelled`)."""
    player: str | None = None
    joker_plus: bool = False
    joker_cost: int = 0
    asked: bool = False
    """Whether the request named its first draw (else the service chose it): with the rest,
    what a retry with another meaning is refused against (its fingerprint, worked out)."""
    caps: list[int] | None = None
    """The cap in force on each draw of the ticket, when a grid is capped."""
    marks: dict[str, int] | None = None
    """The G of the calls that made or reported it, by mark (lua/capsvc.lua, MARKS): Redis
    holds it if the marks of the record's process lifetime are no lower (absent: restored
    whenever its lifetime's records are)."""


class CancelRecord(SaleRecord, tag="cancel", omit_defaults=True,
                   forbid_unknown_fields=False):
    """A ticket cancelled: the sale's fields, and when and how much it gave back."""

    cancelled_at: int = 0
    """Redis TIME (ms) when the cancellation was decided."""
    released: int = 0
    """The cost given back (minor units): the decision's total cost."""


class SoldTicket(Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=False, gc=False):
    """One sale of a `sales` line: what is its own (see SalesRecord); what it shares with
    its line is left out, and read through the line (`SalesRecord.first_of`, `until_of`,
    `caps_of`)."""

    ticket: str
    sale: str
    grids: list[Grid]
    res: str
    """Each grid's outcome, joined by ";": "-" not capped, "1" accepted,
    "0:<offset>:<room>" refused by the cap at draw first_draw + offset, `room` left there;
    "P": the whole ticket refused by the player's limit."""
    first_draw: int = 0
    """0 (absent): the line's `first_draw`."""
    draws: int = 1
    until: int = 0
    """0 (absent): the line's `until` for its last draw (`SalesRecord.until_of`)."""
    caps: list[int] | None = None
    """The cap on each draw, when a grid is capped; None (absent): the line's `cap` on
    every draw; [] when none was recorded."""
    player: str | None = None
    joker_plus: bool = False
    joker_cost: int = 0
    asked: bool = False
    """Whether the request named its first draw (else the service chose it): with the rest,
    what a retry with another meaning is refused against (its fingerprint, worked out)."""
    at: int | None = None
    """The sale's instant when it is not its line's (sales decided apart, journaled in one
    line)."""

    @property
    def accepted(self) -> tuple[int, ...]:
        """The indexes of the grids the decision accepted."""
        if self.res == "P":
            return ()
        return tuple(i for i, result in enumerate(self.res.split(";")) if result in ("-", "1"))


class SalesRecord(Struct, tag="sales", tag_field="type", omit_defaults=True,
                  forbid_unknown_fields=False):
    """First answers: the decisions of sales made together in one call (a standalone Redis's
    `sell`), of one channel and one game, or of one sale made in steps: what they share
    once, then each sale's own. Each stands for the `sale` record it is read as
    (`sale_records`): its `decision` is rendered from the sale and `res` exactly as the
    answer was (capsvc.domain.decisions.render)."""

    at: int
    """Its sales' instant (Redis TIME, ms), but a sale's own `at`."""
    via: Via
    proc: str
    channel: str
    game: str
    first_draw: int
    """The first draw of any of its sales (with `draws`: the span they play, for readers
    that skip lines of other draws)."""
    draws: int
    until: int
    """The latest `until` of its sales."""
    zone: str
    """The game's time zone at the sale (the receipts' instants are rendered in it)."""
    sales: list[SoldTicket]
    cap: int | None = None
    """The cap on every draw of its sales that have a capped grid, but those that say
    otherwise (`caps`)."""
    untils: list[int | None] | None = None
    """When its sales end on different draws: at i, the `until` of its sales whose last
    draw is first_draw + i (None where none ends)."""
    marks: dict[str, int] | None = None

    def at_of(self, s: SoldTicket) -> int:
        """The instant of its sale `s`."""
        return self.at if s.at is None else s.at

    def first_of(self, s: SoldTicket) -> int:
        """The first draw of its sale `s`."""
        return s.first_draw or self.first_draw

    def until_of(self, s: SoldTicket) -> int:
        """When Redis forgets its sale `s`."""
        if s.until:
            return s.until
        if self.untils is None:
            return self.until
        until = self.untils[self.first_of(s) + s.draws - 1 - self.first_draw]
        assert until is not None, "a sale without its own until ends where the line says"
        return until

    def caps_of(self, s: SoldTicket) -> list[int] | None:
        """The cap on each draw of its sale `s`, when a grid of it is capped (None when
        none is, or none was recorded)."""
        if s.caps is not None:
            return s.caps or None
        if self.cap is None or not any(g.capped for g in s.grids):
            return None
        return [self.cap] * s.draws


VoidWhy = Literal["abandoned", "stopped", "closed"]
"""Why a sale does not stand (VoidRecord.why)."""


class VoidRecord(Struct, tag="void", tag_field="type", omit_defaults=True,
                 forbid_unknown_fields=False):
    """A sale that does not stand and was never answered: given back by the janitor
    (`abandoned` before it was decided), voided (`stopped`: claimed once a draw of it was
    stopped) or given back by its request (`closed`: its first draw closed between its
    claim and its grids)."""

    at: int
    why: VoidWhy
    proc: str
    channel: str
    ticket: str
    sale: str
    game: str
    first_draw: int
    draws: int
    until: int
    grids: list[Grid]
    player: str | None = None
    marks: dict[str, int] | None = None


class StopRecord(Struct, tag="stop", tag_field="type", omit_defaults=True,
                 forbid_unknown_fields=False):
    """An admin stopped the sales of a draw."""

    at: int
    """Redis TIME (ms) of the stop: sales claimed from then on do not stand."""
    proc: str
    channel: str
    game: str
    draw: int
    until: int
    marks: dict[str, int] | None = None


class CapRecord(Struct, tag="cap", tag_field="type", omit_defaults=True,
                forbid_unknown_fields=False):
    """The cap in force for a draw, fixed by its first sale (written once per process and
    draw, when the process first learns it)."""

    at: int
    proc: str
    game: str
    draw: int
    cap: int
    until: int
    marks: dict[str, int] | None = None


class LimitRecord(Struct, tag="limit", tag_field="type", omit_defaults=True,
                  forbid_unknown_fields=False):
    """A player's self-limit set (what was asked, and what is in force after)."""

    at: int
    proc: str
    channel: str
    player: str
    game: str
    daily: int | None
    """What was asked (null: remove the self-limit)."""
    until: int
    limit: int | None = None
    """The self-limit in force today after the change (null: none)."""
    next: int | None = None
    """A raise or a removal pending from `from_day` (null: none pending)."""
    next_none: bool = False
    """The pending change removes the self-limit."""
    from_day: str | None = None
    marks: dict[str, int] | None = None


class StakeRecord(Struct, tag="stake", tag_field="type", omit_defaults=True,
                  forbid_unknown_fields=False):
    """A stake played on another game, against the player's daily budget."""

    at: int
    via: Via
    proc: str
    channel: str
    player: str
    game: str
    ref: str
    amount: int
    day: str
    """The player's day (in the game's time zone) the stake counted on."""
    status: Literal["accepted", "rejected"]
    remaining: int
    until: int
    marks: dict[str, int] | None = None


Record = (SaleRecord | CancelRecord | VoidRecord | StopRecord | CapRecord | LimitRecord
          | StakeRecord)
DecisionRecord = SaleRecord | CancelRecord

_encoder = msgspec.json.Encoder()
encode = _encoder.encode


KNOWN_TYPES = frozenset(str(t.__struct_config__.tag)
                        for t in (Open, SalesRecord, *get_args(Record)))
"""The record types this reader decodes; a line of another type (a later version's) is
chained like any other and skipped."""


class Link(Struct, forbid_unknown_fields=False):
    """What every line has, whatever its type: its place in the chain."""

    prev: str | None = None
    type: str = ""


class Line(Link, forbid_unknown_fields=False):
    """A line's link, and what tells which game and draws a record is about (to skip the
    full decoding of the others)."""

    game: str | None = None
    first_draw: int | None = None
    draws: int | None = None
    draw: int | None = None


line_decoder = msgspec.json.Decoder(Open | Record | SalesRecord)
"""Decodes a line's record (the `prev` field is read with `Line`); a `sales` line is read
as the records it stands for with `expanded`."""


def sale_records(r: SalesRecord) -> list[SaleRecord]:
    """The `sale` records a `sales` line stands for, in its order."""
    out = []
    for s in r.sales:
        at = r.at_of(s)
        body, _ = render(r.channel, sold_sale(r, s), s.sale, at, f"{r.zone}|{s.res}".encode())
        out.append(SaleRecord(
            at=at, via=r.via, proc=r.proc, channel=r.channel, ticket=s.ticket, sale=s.sale,
            game=r.game, first_draw=r.first_of(s), draws=s.draws, asked=s.asked,
            until=r.until_of(s), grids=s.grids, decision=Raw(body), player=s.player,
            joker_plus=s.joker_plus, joker_cost=s.joker_cost, caps=r.caps_of(s),
            marks=r.marks))
    return out


def expanded(record: Open | Record | SalesRecord) -> list[Open | Record]:
    """A decoded line as the records it stands for."""
    if isinstance(record, SalesRecord):
        return list(sale_records(record))
    return [record]
chain_decoder = msgspec.json.Decoder(Line)
link_decoder = msgspec.json.Decoder(Link)
"""For a line of an unknown type whose fields `Line` cannot read."""


def grids_of(sale: Sale) -> list[Grid]:
    return [Grid(list(g.numbers), g.stake, g.multiplier, g.capped) for g in sale.grids]


def _sale_grids(grids: list[Grid], draws: int) -> tuple[SaleGrid, ...]:
    return tuple(
        SaleGrid(i, tuple(g.numbers), combination.encode(g.numbers), g.stake, g.multiplier,
                 g.stake * (2 if g.multiplier else 1) * draws, g.capped)
        for i, g in enumerate(grids))


def sale_of(r: SaleRecord | VoidRecord) -> Sale:
    """The sale a record describes, as capsvc stores it in Redis."""
    grids = _sale_grids(r.grids, r.draws)
    if isinstance(r, SaleRecord):
        return Sale(r.ticket, r.game, r.player, r.first_draw, r.draws, grids, r.joker_plus,
                    r.joker_cost, r.asked)
    return Sale(r.ticket, r.game, r.player, r.first_draw, r.draws, grids, False, 0, True)


def sold_sale(line: SalesRecord, s: SoldTicket) -> Sale:
    """The sale of one ticket of a `sales` line, as capsvc stores it in Redis."""
    return Sale(s.ticket, line.game, s.player, line.first_of(s), s.draws,
                _sale_grids(s.grids, s.draws), s.joker_plus, s.joker_cost, s.asked)
