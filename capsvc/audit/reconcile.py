"""Reconciliation of a draw with the sales system: its export of the tickets it sold
against capsvc's decisions, every difference named by ticket id.

Pure: the export's text in, the journal's history (capsvc.audit.history) and what Redis
says of tickets the journal read does not hold (another host's) in, the differences out.
Knows the export's CSV format (docs/audit.md); nothing of files, Redis or HTTP.

The kinds of difference:
- `not_accepted`: sold there, and capsvc did not accept it (unknown, rejected, cancelled,
  void): a stake sold past capsvc's cap, a breach;
- `not_sold`: accepted by capsvc and standing, not in the export: a receipt never printed,
  whose stake holds cap room for nothing (cancel it while it can be);
- `amount`: both have it, at different total costs;
- `duplicate`: the export lists one ticket on several lines.
A decision younger than the grace (during sales: the export may have been taken just
before it) is `in_flight`, not `not_sold`.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from datetime import tzinfo
from typing import Annotated, Literal

from msgspec import Meta, Struct

from capsvc.audit.history import History, Sold
from capsvc.client.models import INT64, Money, Tickets
from capsvc.config import ID_RE
from capsvc.domain.calendar import instant
from capsvc.domain.money import amount

REQUIRED = ("channel", "ticket_id", "total_cost")

Line = Annotated[int, INT64, Meta(description="a line of the export, from 1 (its header)")]
"""A place in the sales system's export, as long as its sales make it."""


class ExportError(ValueError):
    """The export cannot be read: nothing is compared, nothing cancelled."""


@dataclass(frozen=True, slots=True)
class ExportLine:
    line: int
    """The line of the file (1: the header)."""
    channel: str
    ticket: str
    total_cost: int


def read_export(text: str) -> list[ExportLine]:
    """The tickets of a sales system's export (CSV with a header naming at least
    channel, ticket_id, total_cost; other columns ignored); ExportError naming the line of
    the first problem."""
    reader = csv.reader(io.StringIO(text.removeprefix("\ufeff"), newline=""))
    try:
        header = next(reader, None)
        if header is None:
            raise ExportError("line 1: the export is empty (a header with channel, ticket_id, "
                              "total_cost is expected)")
        names = [h.strip().lower() for h in header]
        missing = [c for c in REQUIRED if c not in names]
        if missing:
            raise ExportError(f"line 1: the header lacks {', '.join(missing)} (it has "
                              f"{', '.join(names) or 'nothing'})")
        dupes = sorted({n for n in names if n and names.count(n) > 1})
        if dupes:
            raise ExportError(f"line 1: the header names {', '.join(dupes)} more than once")
        at = {c: names.index(c) for c in REQUIRED}
        out: list[ExportLine] = []
        start = 2
        for row in reader:
            n = start
            start = reader.line_num + 1
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) != len(names):
                raise ExportError(f"line {n}: {len(row)} field(s), the header has "
                                  f"{len(names)}")
            channel, ticket, cost = (row[at[c]].strip() for c in REQUIRED)
            if not ID_RE.fullmatch(channel):
                raise ExportError(f"line {n}: channel {channel!r} is not a channel id")
            if not ID_RE.fullmatch(ticket):
                raise ExportError(f"line {n}: ticket_id {ticket!r} is not a ticket id "
                                  "(1-64 of A-Z a-z 0-9 . _ : -)")
            if not cost.isascii() or not cost.isdigit() or len(cost) > 15:
                raise ExportError(f"line {n}: total_cost {cost!r} is not an amount in minor "
                                  "units (a whole number, e.g. 250 for 2.50)")
            out.append(ExportLine(n, channel, ticket, int(cost)))
    except csv.Error as e:
        raise ExportError(f"line {reader.line_num}: {e}") from None
    return out


CapsvcState = Literal["unknown", "rejected", "cancelled", "void", "other_draws",
                      "other_game"]


class NotAccepted(Struct):
    channel: str
    ticket_id: str
    line: Line
    amount: Money
    capsvc: CapsvcState
    """What capsvc has of the ticket: nothing, a rejection, a cancellation, a void (never
    answered), or a ticket of other draws or of another game."""


class NotSold(Struct, omit_defaults=True):
    channel: str
    ticket_id: str
    sale: str
    amount: Money
    status: str
    """accepted or partial."""
    decided_at: str
    listed: bool = False
    """The export lists this ticket id (for another sale of it: capsvc counted the ticket
    twice): never cancelled by --cancel-abandoned, which cannot tell the sales apart."""
    cancel: str | None = None
    """With --cancel-abandoned: `cancelled`, or why it could not be."""


class AmountDiff(Struct):
    channel: str
    ticket_id: str
    line: Line
    sold: Money
    """The export's total cost."""
    capsvc: Money
    """The decision's total cost."""


class Duplicate(Struct):
    channel: str
    ticket_id: str
    lines: list[Line]


class Side(Struct):
    tickets: Tickets
    amount: Money


class Reconciliation(Struct):
    """A draw reconciled (docs/audit.md)."""

    game: str
    draw: int
    balanced: bool
    """No difference: nothing sold past capsvc, nothing accepted unsold, amounts equal."""
    final: bool
    """The draw's last cancel and settlement could have been made: no decision is to come."""
    checked_at: str
    """By Redis TIME (the host's clock without a Redis)."""
    grace_ms: int
    sold: Side
    """The export: tickets (distinct) and their total costs."""
    capsvc: Side
    """capsvc's standing sales of the draw (accepted or partial, not cancelled)."""
    not_accepted: list[NotAccepted]
    not_sold: list[NotSold]
    amounts: list[AmountDiff]
    duplicates: list[Duplicate]
    in_flight: Tickets
    """Standing decisions younger than the grace, not in the export (not differences)."""
    elsewhere: Tickets
    """Exported tickets the journal read does not hold but Redis does (another host's)."""
    differences: Annotated[int, INT64, Meta(description="a number of differences")]


@dataclass(frozen=True, slots=True)
class Known:
    """A ticket the journal read does not hold, as Redis holds it (another host's)."""

    sale: str
    status: str
    total_cost: int
    plays: bool
    """It is of the reconciled game, and its draws include the reconciled one."""
    same_game: bool
    cancelled: bool


def capsvc_side(history: History, draw: int) -> dict[tuple[str, str], list[Sold]]:
    """(channel, ticket id) -> the decisions of the sales of that ticket id playing `draw`,
    oldest first: one, but when a ticket id was sold twice (a retry judged anew by a host
    whose Redis had lost the first sale, before that host restored it)."""
    out: dict[tuple[str, str], list[Sold]] = {}
    for sold in history.of(draw):
        out.setdefault((sold.record.channel, sold.record.ticket), []).append(sold)
    for sales in out.values():
        sales.sort(key=lambda s: s.record.at)
    return out


def unknown(history: History, draw: int, lines: list[ExportLine]) -> list[tuple[str, str]]:
    """The exported tickets the journal read holds no decision of, for this draw (to be
    looked up in Redis: another host may have decided them, a voided one included: its
    retry may have been sold by another host)."""
    side = capsvc_side(history, draw)
    return sorted({(x.channel, x.ticket) for x in lines if (x.channel, x.ticket) not in side})


def reconcile(history: History, draw: int, lines: list[ExportLine], *, now_ms: int,
              grace_ms: int, final: bool, tz: tzinfo,
              known: dict[tuple[str, str], Known] | None = None) -> Reconciliation:
    """`lines` (the export) against the decisions of `draw` (see the module's docstring).
    A final draw has no decision to come: no grace."""
    known = known or {}
    grace_ms = 0 if final else grace_ms
    side = capsvc_side(history, draw)
    voided = {(k[0], k[1]) for k in history.voids}
    seen: dict[tuple[str, str], list[int]] = {}
    matched: set[int] = set()
    """The standing sales an exported line stands for (by id())."""
    not_accepted: list[NotAccepted] = []
    amounts: list[AmountDiff] = []
    elsewhere = 0
    sold_amount = 0
    for x in lines:
        key = (x.channel, x.ticket)
        if key in seen:
            seen[key].append(x.line)
            continue
        seen[key] = [x.line]
        sold_amount += x.total_cost
        sales = side.get(key, [])
        standing = [s for s in sales if s.standing]
        state: CapsvcState
        if standing:
            # The line stands for one sale: the latest of the same cost if there is one
            # (the one Redis holds, whose answer the terminal got last), else the latest;
            # any other standing sale of the ticket id was counted without a receipt.
            sold = next((s for s in reversed(standing)
                         if s.decision.total_cost == x.total_cost), standing[-1])
            matched.add(id(sold))
            if sold.decision.total_cost != x.total_cost:
                amounts.append(AmountDiff(x.channel, x.ticket, x.line, x.total_cost,
                                          sold.decision.total_cost))
            continue
        if sales:
            state = "cancelled" if sales[-1].cancel is not None else "rejected"
        elif (other := known.get(key)) is not None:
            elsewhere += 1
            if other.plays and not other.cancelled and other.status != "rejected":
                if other.total_cost != x.total_cost:
                    amounts.append(AmountDiff(x.channel, x.ticket, x.line, x.total_cost,
                                              other.total_cost))
                continue
            state = ("other_game" if not other.same_game else
                     "other_draws" if not other.plays else
                     "cancelled" if other.cancelled else "rejected")
        else:
            state = "void" if key in voided else "unknown"
        not_accepted.append(NotAccepted(x.channel, x.ticket, x.line, x.total_cost, state))
    not_sold: list[NotSold] = []
    in_flight = 0
    totals = Side(0, 0)
    for key, sales in sorted(side.items()):
        for sold in sales:
            if not sold.standing:
                continue
            totals.tickets += 1
            totals.amount += sold.decision.total_cost
            if id(sold) in matched:
                continue
            if now_ms - sold.record.at < grace_ms:
                in_flight += 1
                continue
            not_sold.append(NotSold(key[0], key[1], sold.record.sale,
                                    sold.decision.total_cost, sold.decision.status,
                                    instant(sold.record.at, tz), listed=key in seen))
    duplicates = [Duplicate(c, t, found) for (c, t), found in sorted(seen.items())
                  if len(found) > 1]
    differences = len(not_accepted) + len(not_sold) + len(amounts) + len(duplicates)
    return Reconciliation(
        game=history.game, draw=draw, balanced=not differences, final=final,
        checked_at=instant(now_ms, tz), grace_ms=grace_ms, sold=Side(len(seen), sold_amount),
        capsvc=totals, not_accepted=not_accepted, not_sold=not_sold, amounts=amounts,
        duplicates=duplicates, in_flight=in_flight, elsewhere=elsewhere,
        differences=differences)


def counts(rec: Reconciliation) -> dict[str, int]:
    """The differences by kind (the metric's label)."""
    return {"not_accepted": len(rec.not_accepted), "not_sold": len(rec.not_sold),
            "amount": len(rec.amounts), "duplicate": len(rec.duplicates)}


def to_text(rec: Reconciliation, currency: str) -> str:
    """For a person: the verdict, the totals, then every difference by ticket id (amounts
    in `currency`, as the draw's report writes them)."""
    def money(minor: int) -> str:
        return amount(minor, currency)

    lines = [f"{rec.game} draw {rec.draw}: "
             f"{'BALANCED' if rec.balanced else f'NOT BALANCED ({rec.differences} difference(s))'}"
             f"{'' if rec.final else ' (draw still on sale or settling)'}",
             f"  sales system: {rec.sold.tickets} ticket(s), {money(rec.sold.amount)} total cost",
             f"  capsvc:       {rec.capsvc.tickets} ticket(s) standing, "
             f"{money(rec.capsvc.amount)} total cost"]
    if rec.in_flight:
        lines.append(f"  {rec.in_flight} decision(s) younger than the grace "
                     f"({rec.grace_ms / 1000:g} s) not in the export yet: not differences")
    if rec.elsewhere:
        lines.append(f"  {rec.elsewhere} exported ticket(s) decided by another host "
                     "(found in Redis)")
    for d in rec.not_accepted:
        lines.append(f"  sold, not accepted by capsvc ({d.capsvc}): {d.channel} "
                     f"{d.ticket_id} (line {d.line}, {money(d.amount)})")
    for s in rec.not_sold:
        tail = f"; {s.cancel}" if s.cancel else ""
        lines.append(f"  accepted by capsvc, never sold: {s.channel} {s.ticket_id} "
                     f"({s.status}, {money(s.amount)}, sale {s.sale}){tail}")
    for a in rec.amounts:
        lines.append(f"  amounts differ: {a.channel} {a.ticket_id} (line {a.line}): sold "
                     f"{money(a.sold)}, capsvc {money(a.capsvc)}")
    for dup in rec.duplicates:
        lines.append(f"  listed more than once: {dup.channel} {dup.ticket_id} (lines "
                     f"{', '.join(map(str, dup.lines))})")
    return "\n".join(lines) + "\n"
