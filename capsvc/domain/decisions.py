"""What a sale decides, as pure functions of what the Redis steps recorded.

A replay, a resumed request and the janitor all rebuild a ticket's decision from the same
records, so the body must be a function of them alone: the sale, its sale id, its claim
instant and the reserve replies. Also here: the budget a ticket takes, why a ticket may
not be cancelled, and how a cancellation shows on a stored decision.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import tzinfo
from typing import ClassVar
from zoneinfo import ZoneInfo

import msgspec

from capsvc.client.models import Cancellation, GridOut, Receipt, TicketOut, TicketStatus
from capsvc.config import GameRules
from capsvc.domain.calendar import DrawCalendar, instant
from capsvc.domain.errors import rule_error
from capsvc.domain.validator import Sale, budget_shares

DAY_MS = 86_400_000

ACCEPTED, REJECTED, CLOSED, RELEASED = 1, 0, -1, -2
SHADOWED = 2
"""A grid's reserve: accepted (SHADOWED: accepted, and the shadow cap would have refused
it), rejected by the cap, not counted because sales are closed, not counted because the
sale's record was released or sealed."""


@dataclass(frozen=True, slots=True)
class Reserved:
    """A grid's outcome: its reserve (lua/capsvc.lua, `reserve`, decoded by
    capsvc.redis.replies), or what a sale in one call recorded of it."""

    LUA: ClassVar[str] = ("{1, near, sold-out offsets…} accepted (now or by an earlier run "
                          "of the same sale)")
    kind: int
    """ACCEPTED, SHADOWED, REJECTED, CLOSED or RELEASED."""
    near: int = 0
    """Accepted: the counters this call brought to 80 % of the cap."""
    sold_out: tuple[int, ...] = ()
    """Accepted: the offsets of the draws this call brought to their cap."""
    offset: int = 0
    """Rejected: the draw (offset from the first) that would overflow."""
    room: int = 0
    """Rejected: the room left on that draw."""

    @property
    def accepted(self) -> bool:
        return self.kind >= ACCEPTED


@dataclass(slots=True)
class BudgetPlan:
    """What a ticket of a limited game takes from its player's daily budgets."""

    player: str
    ref: str
    """Names the sale (channel, ticket id, sale id): a reused ticket id is another ref."""
    regulatory: int
    until: int
    """When the budget records may go."""
    requested: list[tuple[str, int]]
    """(day, amount) if every grid is accepted: what is reserved before the grids."""
    days_of_draws: list[str]
    purchase_day: str
    policy: str

    def shares(self, sale: Sale, accepted: set[int]) -> list[tuple[str, int]]:
        """The shares that hold exactly what the `accepted` grids cost, over the requested
        days (amount 0 gives a day back)."""
        held = dict(budget_shares(self.days_of_draws, sale, self.policy, self.purchase_day,
                                  accepted))
        return [(day, held.get(day, 0)) for day, _ in self.requested]

    def settlement(self, sale: Sale, accepted: set[int]) -> list[tuple[str, int]] | None:
        """The shares a settle must make the budget hold once the `accepted` grids are
        known (all of them given back when none is: final), None when what was requested
        stands."""
        shares = self.shares(sale, accepted)
        return None if shares == self.requested and accepted else shares


def budget_ref(channel_id: str, ticket_id: str, sale_id: str) -> str:
    """What names a sale's take in its player's budgets (a reused ticket id is another
    ref); with no sale id, the prefix the sale id completes."""
    return f"t/{channel_id}/{ticket_id}/{sale_id}"


def budget_until(expire_last: int, at: int) -> int:
    """When a sale's budget records may go: a day past its last draw's retention or its
    purchase day's end, whichever is later."""
    return max(expire_last, at + DAY_MS) + DAY_MS


def budget_plan(channel_id: str, rules: GameRules, calendar: DrawCalendar, sale: Sale,
                sale_id: str, at: int, expire_last: int) -> BudgetPlan | None:
    """The budget plan of a sale claimed at `at` (Redis TIME: the player's day), for games
    with a daily limit."""
    if rules.daily_limit is None or sale.player_id is None:
        return None
    assert sale.first_draw is not None
    days = calendar.local_days(sale.first_draw, sale.draws)
    purchase_day = calendar.local_date(at).isoformat()
    return BudgetPlan(
        player=sale.player_id, ref=budget_ref(channel_id, sale.ticket_id, sale_id),
        regulatory=rules.daily_limit, until=budget_until(expire_last, at),
        requested=budget_shares(days, sale, rules.subscription_accounting, purchase_day),
        days_of_draws=days, purchase_day=purchase_day, policy=rules.subscription_accounting,
    )


def accepted_grids(decision: TicketOut | None) -> set[int]:
    return set() if decision is None else {
        g.index for g in decision.grids if g.status == "accepted"}


def receipt_id(channel_id: str, ticket_id: str, sale_id: str) -> str:
    """Derived from what the claim stored, so a rebuilt decision has the same receipt."""
    return hashlib.blake2b(f"{channel_id}/{ticket_id}/{sale_id}".encode(),
                           digest_size=10).hexdigest()


def build_decision(channel_id: str, tz: tzinfo, sale: Sale, sale_id: str, at: int,
                   replies: Sequence[Reserved | None]) -> TicketOut:
    """The ticket's decision from its sale and the reserve replies (None: uncapped grid),
    every one of them accepted or rejected; a draw that closed while the sale ran is a 422.
    """
    assert sale.first_draw is not None
    first = sale.first_draw
    grids = []
    total = 0
    accepted = 0
    for g, reply in zip(sale.grids, replies, strict=True):
        if reply is None or reply.accepted:
            grids.append(GridOut(index=g.index, numbers=list(g.numbers), status="accepted",
                                 cost=g.cost))
            total += g.cost
            accepted += 1
        elif reply.kind == REJECTED:
            grids.append(GridOut(index=g.index, numbers=list(g.numbers), status="rejected",
                                 reason="combination_capped", draw=first + reply.offset,
                                 remaining=reply.room))
        else:
            raise rule_error("draw_closed", f"draw {first} closed while the sale was running",
                             "$.first_draw")
    if accepted:
        total += sale.joker_cost
    status: TicketStatus = (
        "accepted" if accepted == len(grids) else ("partial" if accepted else "rejected")
    )
    receipt = None
    if accepted:
        receipt = Receipt(
            receipt_id=receipt_id(channel_id, sale.ticket_id, sale_id),
            issued_at=instant(at, tz),
        )
    return TicketOut(
        ticket_id=sale.ticket_id, game=sale.game, status=status,
        draws=list(range(first, first + sale.draws)), grids=grids, total_cost=total,
        receipt=receipt,
    )


def player_limit_decision(sale: Sale) -> TicketOut:
    """The whole ticket refused: it does not fit in the player's daily budget."""
    assert sale.first_draw is not None
    return TicketOut(
        ticket_id=sale.ticket_id, game=sale.game, status="rejected", reason="player_limit",
        draws=list(range(sale.first_draw, sale.first_draw + sale.draws)),
        grids=[GridOut(index=g.index, numbers=list(g.numbers), status="rejected",
                       reason="player_limit") for g in sale.grids],
        total_cost=0, receipt=None,
    )


def cancel_refusal(rules: GameRules, sale: Sale, decision: TicketOut) -> str | None:
    """Why the game's policy forbids cancelling this ticket, or None."""
    if rules.cancel == "never":
        return f"game {rules.id} does not allow cancellations"
    if rules.cancel == "single_draw_only" and sale.draws > 1:
        return f"game {rules.id} does not allow cancelling a subscription"
    if decision.receipt is None:
        return "nothing was accepted: there is nothing to cancel"
    return None


def with_cancellation(body: bytes, tz: tzinfo, at: int, released: int) -> bytes:
    """A stored decision's body with `state: "cancelled"` and its `cancelled` member added
    (the decision itself is kept byte for byte: it is an object, so the members go before
    its closing brace)."""
    member = msgspec.json.encode(Cancellation(
        at=instant(at, tz), released=released))
    return body[:-1] + b',"state":"cancelled","cancelled":' + member + b"}"


def decision_of(channel_id: str, sale: Sale, sale_id: str, at: int, results: bytes
                ) -> TicketOut:
    """The decision of a sale made in one call, from what it stored: the time zone of the
    sale, then the grids' results ("-" not capped, "1" accepted, "0:<offset>:<room>"
    rejected), or "P" for a ticket the player's limit refused (see lua/capsvc.lua, sell).
    Nothing of the configuration of the day is used, so the body is the one first answered,
    byte for byte, for as long as it is kept."""
    zone, _, grids = results.decode().partition("|")
    if grids == "P":  # refused by the player's limit
        return player_limit_decision(sale)
    replies: list[Reserved | None] = []
    for r in grids.split(";"):
        if r == "-":
            replies.append(None)
        elif r == "1":
            replies.append(Reserved(ACCEPTED))
        else:
            _, offset, room = r.split(":")
            replies.append(Reserved(REJECTED, offset=int(offset), room=int(room)))
    return build_decision(channel_id, ZoneInfo(zone), sale, sale_id, at, replies)


def results_of(zone: str, replies: Sequence[Reserved | None] | None) -> bytes:
    """What `decision_of` renders a sale's decision from: its time zone, then each grid's
    reply ("-" not capped, "1" accepted, "0:<offset>:<room>" rejected), or "P" (`replies`
    None) for a ticket the player's limit refused; `build_decision` of the same replies
    renders the same body."""
    if replies is None:
        return f"{zone}|P".encode()
    return (zone + "|" + ";".join(
        "-" if r is None else "1" if r.accepted else f"0:{r.offset}:{r.room}"
        for r in replies)).encode()


def derived_body(channel_id: str, sale: Sale, sale_id: str, at: int,
                 results: bytes | None) -> bytes:
    """The body of a decision stored as results (`sale`: its record's, unpacked): what the
    sale answered, byte for byte."""
    assert results is not None, "a decision is kept as a body or as results"
    return msgspec.json.encode(decision_of(channel_id, sale, sale_id, at, results))
