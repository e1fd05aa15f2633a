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

from capsvc.client.models import Cancellation, TicketOut, TicketStatus
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


class Verdict(msgspec.Struct, frozen=True, gc=False):
    """What the metrics tally of a decision (`render`)."""

    game: str
    status: TicketStatus
    total_cost: int
    accepted: int
    """Grids accepted."""
    capped: tuple[int, ...]
    """The number of picks of each grid refused by the cap."""
    limit: bool
    """The whole ticket refused by the player's limit (every grid)."""
    grids: int


_encode = msgspec.json.encode
_zones: dict[str, ZoneInfo] = {}
_games: dict[str, bytes] = {}
_draws: dict[tuple[int, int], bytes] = {}
_issued: tuple[int, bytes, bytes] = (-1, b"", b"")
"""The last instant rendered, in its time zone (a batch's sales share theirs): replaced
whole, read once a render (the event loop and a report's thread both render)."""


def _zone(name: str) -> ZoneInfo:
    found = _zones.get(name)
    if found is None:
        found = _zones[name] = ZoneInfo(name)
    return found


def _draws_of(first: int, n: int) -> bytes:
    """`"draws":[first, …]` and the member before it, as JSON (remembered: a batch's sales
    share their draws)."""
    found = _draws.get((first, n))
    if found is None:
        if len(_draws) > 4096:
            _draws.clear()
        found = _draws[(first, n)] = (b'","draws":'
                                      + _encode(list(range(first, first + n))))
    return found


def render(channel_id: str, sale: Sale, sale_id: str, at: int, results: bytes
           ) -> tuple[bytes, Verdict]:
    """A sale's decision: its body (JSON, byte for byte msgspec's encoding of the
    TicketOut it describes) and what the metrics tally of it, from what the sale stored —
    its results (`results_of`: the time zone of the sale, then each grid's "-" not capped,
    "1" accepted, "0:<offset>:<room>" refused by the cap on draw first + offset with `room`
    left; or "P", the whole ticket refused by the player's limit), its sale id and instant.
    Nothing of the configuration of the day is used, so the body is the one first answered,
    byte for byte, for as long as it is kept. Built from byte pieces, those a batch's sales
    share (the game, the draws, the instant) made once: the one way every decision's body
    is made."""
    zone, _, outcomes = results.partition(b"|")
    first = sale.first_draw
    assert first is not None
    game = _games.get(sale.game)
    if game is None:
        game = _games[sale.game] = b',"game":' + _encode(sale.game) + b',"status":"'
    head = b'{"ticket_id":' + _encode(sale.ticket_id) + game
    draws = _draws_of(first, sale.draws)
    if outcomes == b"P":  # refused by the player's limit
        grids = b",".join([b'{"index":%d,"numbers":%b,"status":"rejected",'
                           b'"reason":"player_limit"}' % (g.index, _encode(g.numbers))
                           for g in sale.grids])
        return (head + b"rejected" + draws + b',"grids":[' + grids
                + b'],"total_cost":0,"receipt":null,"reason":"player_limit"}',
                Verdict(sale.game, "rejected", 0, 0, (), True, len(sale.grids)))
    parts, total, accepted, capped = [], 0, 0, []
    for g, outcome in zip(sale.grids, outcomes.split(b";"), strict=True):
        if outcome == b"-" or outcome == b"1":
            parts.append(b'{"index":%d,"numbers":%b,"status":"accepted","cost":%d}'
                         % (g.index, _encode(g.numbers), g.cost))
            total += g.cost
            accepted += 1
        else:
            _, offset, room = outcome.split(b":")
            parts.append(b'{"index":%d,"numbers":%b,"status":"rejected","reason":'
                         b'"combination_capped","draw":%d,"remaining":%b}'
                         % (g.index, _encode(g.numbers), first + int(offset), room))
            capped.append(len(g.numbers))
    status: TicketStatus = ("accepted" if accepted == len(parts)
                            else "partial" if accepted else "rejected")
    if accepted:
        total += sale.joker_cost
        global _issued
        issued = _issued  # read once: a thread (a report's) may render meanwhile
        if issued[0] != at or issued[1] != zone:
            issued = _issued = (at, zone, b'","issued_at":'
                                + _encode(instant(at, _zone(zone.decode()))) + b"}")
        receipt = (b'{"receipt_id":"' + receipt_id(channel_id, sale.ticket_id,
                                                   sale_id).encode() + issued[2])
    else:
        receipt = b"null"
    return (b"".join((head, status.encode(), draws, b',"grids":[', b",".join(parts),
                      b'],"total_cost":%d,"receipt":' % total, receipt, b"}")),
            Verdict(sale.game, status, total, accepted, tuple(capped), False, len(parts)))


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


def results_of(zone: str, replies: Sequence[Reserved | None] | None) -> bytes:
    """What `render` makes a sale's decision from: its time zone, then each grid's reply
    ("-" not capped, "1" accepted, "0:<offset>:<room>" rejected), or "P" (`replies` None)
    for a ticket the player's limit refused. A grid neither accepted nor rejected (its
    draw closed, its record released) has no decision: a 422 `draw_closed`."""
    if replies is None:
        return f"{zone}|P".encode()
    out = []
    for r in replies:
        if r is None:
            out.append("-")
        elif r.accepted:
            out.append("1")
        elif r.kind == REJECTED:
            out.append(f"0:{r.offset}:{r.room}")
        else:
            raise rule_error("draw_closed", "a draw of the sale closed while it was running",
                             "$.first_draw")
    return (zone + "|" + ";".join(out)).encode()


def derived_body(channel_id: str, sale: Sale, sale_id: str, at: int,
                 results: bytes | None) -> bytes:
    """The body of a decision stored as results (`sale`: its record's, unpacked): what the
    sale answered, byte for byte."""
    assert results is not None, "a decision is kept as a body or as results"
    return render(channel_id, sale, sale_id, at, results)[0]
