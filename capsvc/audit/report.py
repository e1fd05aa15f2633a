"""A draw's report: what was sold, refused and cancelled, and whether every cap held, as
pure functions of the journal's history (capsvc.audit.history) and the game's rules.

Knows the figures and their two renderings (JSON, the `DrawReport` type; CSV, one figure a
row); nothing of files, Redis or HTTP. docs/audit.md says what each figure means.
"""

from __future__ import annotations

import csv
import heapq
import io
from datetime import tzinfo

import msgspec

from capsvc.audit.history import History, Sold
from capsvc.client.reports import (
    Chain,
    ChannelLine,
    CombinationLine,
    DrawReport,
    GridCounts,
    ListedTicket,
    PicksLine,
    ReasonCount,
    RedisCheck,
    TicketCounts,
    TicketLists,
)
from capsvc.domain import combination
from capsvc.domain.calendar import instant
from capsvc.domain.games import Game
from capsvc.domain.money import amount
from capsvc.journal.records import VoidRecord

FORMAT = 2
"""The report's format version (`report` of the JSON): later versions only add fields."""
TOP = 20
NO_ACTIVITY = "no activity"


def _per_draw(sold: Sold, amount: int) -> int:
    return amount // sold.record.draws


def build(history: History, game: Game, draw: int, *, built_ms: int, final: bool,
          redis: RedisCheck | None = None) -> DrawReport:
    """The report of `draw` from `history` (which must cover it)."""
    rules = game.rules
    tz = rules.tz
    tickets = TicketCounts()
    accepted_grids = cancelled_grids = 0
    rejected: dict[str, int] = {}
    picks: dict[int, list[int]] = {}
    channels: dict[str, list[int]] = {}
    stake = amount = cancelled_stake = 0
    lists = TicketLists()
    sales = history.of(draw)
    for sold in sales:
        r, decision = sold.record, sold.decision
        channel = channels.setdefault(r.channel, [0, 0, 0, 0, 0])
        if sold.cancel is not None:
            tickets.cancelled += 1
            channel[4] += 1
            lists.cancelled.append(_cancelled(sold, tz))
        elif decision.status == "accepted":
            tickets.accepted += 1
        elif decision.status == "partial":
            tickets.partial += 1
        else:
            tickets.rejected += 1
            lists.rejected.append(_rejected(sold, tz))
        any_accepted = False
        for grid, outcome in zip(r.grids, decision.grids, strict=True):
            if outcome.status != "accepted":
                reason = outcome.reason or decision.reason or "rejected"
                rejected[reason] = rejected.get(reason, 0) + 1
                continue
            if sold.cancel is not None:
                cancelled_grids += 1
                cancelled_stake += grid.stake
                continue
            any_accepted = True
            accepted_grids += 1
            paid = grid.stake * (2 if grid.multiplier else 1)
            row = picks.setdefault(len(grid.numbers), [0, 0, 0])
            row[0] += 1
            row[1] += grid.stake
            row[2] += paid
            channel[1] += 1
            channel[2] += grid.stake
            channel[3] += paid
            stake += grid.stake
            amount += paid
        if any_accepted:
            channel[0] += 1
            joker = _per_draw(sold, r.joker_cost)
            channel[3] += joker
            amount += joker
    totals = capped_totals(history, draw)
    voids = history.voids_of(draw)
    tickets.void = len(voids)
    lists.void = [_void(v, history.where_void(v), tz) for v in voids]
    for listed in (lists.rejected, lists.cancelled, lists.void):
        listed.sort(key=lambda t: (t.channel, t.ticket_id, t.sale))
    cap = history.caps.get(draw)
    cap_fixed = cap is not None
    if cap is None:
        cap = rules.cap_limit
    prizes = dict(rules.top_prizes)

    def line(combo: str, staked: int, *, excess: bool = False) -> CombinationLine:
        numbers = combination.decode(combo)
        prize = prizes.get(len(numbers))
        return CombinationLine(
            numbers=numbers, staked=staked,
            liability=None if prize is None else staked * prize // rules.prize_base_stake,
            excess=staked - cap if excess and cap is not None else None)

    at_cap: list[CombinationLine] = []
    over_cap: list[CombinationLine] = []
    sold_out = 0
    if cap is not None:
        for combo, staked in sorted(totals.items()):
            if staked == cap:
                at_cap.append(line(combo, staked))
            elif staked > cap:
                over_cap.append(line(combo, staked, excess=True))
            if cap - staked < rules.min_stake:
                sold_out += 1
    top = [line(combo, staked) for combo, staked in heapq.nlargest(
        TOP, totals.items(), key=lambda t: (t[1], [-ord(c) for c in t[0]]))]
    liabilities = [t.liability for t in top if t.liability is not None]
    activity = bool(sales or voids)
    stopped = history.stops.get(draw)
    return DrawReport(
        report=FORMAT, game=rules.id, draw=draw, currency=rules.currency,
        closes_at=instant(game.calendar.close_ms(draw), tz), built_at=instant(built_ms, tz),
        final=final, activity=activity,
        summary=_summary(tickets, stake, rules.currency) if activity else NO_ACTIVITY,
        cap=cap, cap_fixed=cap_fixed, capped_picks=sorted(rules.capped_picks),
        stopped_at=None if stopped is None else instant(stopped, tz),
        tickets=tickets,
        grids=GridCounts(accepted=accepted_grids, cancelled=cancelled_grids,
                         rejected=[ReasonCount(k, v) for k, v in sorted(rejected.items())]),
        stake=stake, amount=amount, cancelled_stake=cancelled_stake,
        by_picks=[PicksLine(p, *v) for p, v in sorted(picks.items())],
        by_channel=[ChannelLine(c, *v) for c, v in sorted(channels.items())],
        at_cap=at_cap, over_cap=over_cap, sold_out=sold_out, combinations=len(totals),
        top=top, top_liability=max(liabilities, default=None),
        sources=history.sources,
        chain=Chain(intact=not history.breaks, breaks=history.breaks, tails=history.tails),
        redis=redis, ticket_lists=lists)


def _rejected(sold: Sold, tz: tzinfo) -> ListedTicket:
    r, decision = sold.record, sold.decision
    reason = decision.reason or ",".join(sorted(
        {g.reason or "rejected" for g in decision.grids if g.status != "accepted"}))
    return ListedTicket(
        channel=r.channel, ticket_id=r.ticket, sale=r.sale, status=decision.status,
        reason=reason or None, decided_at=instant(r.at, tz), first_draw=r.first_draw,
        draws=r.draws, grids=len(r.grids), stake=sum(g.stake for g in r.grids),
        total_cost=decision.total_cost, released=None, cancelled_at=None, proc=r.proc,
        file=sold.at[0], line=sold.at[1])


def _cancelled(sold: Sold, tz: tzinfo) -> ListedTicket:
    r, decision, cancel = sold.record, sold.decision, sold.cancel
    assert cancel is not None
    given_back = sum(g.stake for g, o in zip(r.grids, decision.grids, strict=True)
                     if o.status == "accepted")
    return ListedTicket(
        channel=r.channel, ticket_id=r.ticket, sale=r.sale, status=decision.status,
        reason=None, decided_at=instant(r.at, tz), first_draw=r.first_draw, draws=r.draws,
        grids=len(r.grids), stake=given_back, total_cost=decision.total_cost,
        released=cancel.released, cancelled_at=instant(cancel.cancelled_at, tz),
        proc=cancel.proc, file=sold.cancel_at[0], line=sold.cancel_at[1])


def _void(v: VoidRecord, where: tuple[str, int], tz: tzinfo) -> ListedTicket:
    return ListedTicket(
        channel=v.channel, ticket_id=v.ticket, sale=v.sale, status=None, reason=v.why,
        decided_at=instant(v.at, tz), first_draw=v.first_draw, draws=v.draws,
        grids=len(v.grids), stake=sum(g.stake for g in v.grids), total_cost=None,
        released=None, cancelled_at=None, proc=v.proc, file=where[0], line=where[1])


def _summary(t: TicketCounts, stake: int, currency: str) -> str:
    return (f"{t.accepted + t.partial} ticket(s) standing ({t.accepted} accepted, "
            f"{t.partial} partial), {t.rejected} rejected, {t.cancelled} cancelled, "
            f"{t.void} void; {amount(stake, currency)} staked")


def capped_totals(history: History, draw: int) -> dict[str, int]:
    """(combination key -> base stake standing) of the capped grids on `draw`: what Redis's
    counters hold while the draw is retained."""
    totals: dict[str, int] = {}
    for sold in history.of(draw):
        if sold.cancel is not None:
            continue
        for grid, outcome in zip(sold.record.grids, sold.decision.grids, strict=True):
            if grid.capped and outcome.status == "accepted":
                combo = combination.encode(grid.numbers)
                totals[combo] = totals.get(combo, 0) + grid.stake
    return totals


encode_json = msgspec.json.Encoder().encode


def to_json(report: DrawReport) -> bytes:
    return msgspec.json.format(encode_json(report), indent=2) + b"\n"


def to_csv(report: DrawReport) -> str:
    """One figure a row: `section,key,field,value` (a spreadsheet pivots it back); each
    listed ticket a row per field, its section the list's name (`rejected`, `cancelled`,
    `void`), its key `channel/ticket_id/sale`."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["section", "key", "field", "value"])
    for name in ("report", "game", "draw", "currency", "closes_at", "built_at", "final",
                 "activity", "summary", "cap", "cap_fixed", "stopped_at", "stake", "amount",
                 "cancelled_stake", "sold_out", "combinations", "top_liability"):
        w.writerow(["draw", "", name, csv_cell(getattr(report, name))])
    w.writerow(["draw", "", "capped_picks", " ".join(map(str, report.capped_picks))])
    for name in TicketCounts.__struct_fields__:
        w.writerow(["tickets", name, "count", getattr(report.tickets, name)])
    w.writerow(["grids", "accepted", "count", report.grids.accepted])
    w.writerow(["grids", "cancelled", "count", report.grids.cancelled])
    for r in report.grids.rejected:
        w.writerow(["grids", f"rejected:{r.reason}", "count", r.grids])
    for p in report.by_picks:
        for name in ("grids", "stake", "amount"):
            w.writerow(["by_picks", p.picks, name, getattr(p, name)])
    for c in report.by_channel:
        for name in ("tickets", "grids", "stake", "amount", "cancelled"):
            w.writerow(["by_channel", c.channel, name, getattr(c, name)])
    for section in ("at_cap", "over_cap", "top"):
        for combo in getattr(report, section):
            key = "-".join(map(str, combo.numbers))
            for name in ("staked", "liability", "excess"):
                if (value := getattr(combo, name)) is not None:
                    w.writerow([section, key, name, value])
    for s in report.sources:
        key = f"{s.directory}/{s.file}"
        for name in ("proc", "sha256", "bytes", "lines"):
            w.writerow(["source", key, name, csv_cell(getattr(s, name))])
    w.writerow(["chain", "", "intact", csv_cell(report.chain.intact)])
    for b in report.chain.breaks:
        w.writerow(["chain", "", "break", b])
    for t in report.chain.tails:
        w.writerow(["chain", "", "tail", t])
    if report.redis is not None:
        w.writerow(["redis", "", "compared", report.redis.compared])
        w.writerow(["redis", "", "complete", csv_cell(report.redis.complete)])
        for d in report.redis.differences:
            w.writerow(["redis", "", "difference", d])
    lists = report.ticket_lists
    for section, listed in (("rejected", lists.rejected), ("cancelled", lists.cancelled),
                            ("void", lists.void)):
        for ticket in listed:
            key = f"{ticket.channel}/{ticket.ticket_id}/{ticket.sale}"
            for name in ListedTicket.__struct_fields__:
                w.writerow([section, key, name, csv_cell(getattr(ticket, name))])
    return out.getvalue()


def csv_cell(value: object) -> str:
    """A value as a CSV cell of the audit files: empty for none, booleans in lower case."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
