"""The replies of the Lua functions that act for a ticket, decoded into named types.

lua/capsvc.lua documents each reply in the header of its function; each type here carries
that layout (`LUA`, as the header writes it), and tests/unit/test_replies.py holds the two
in step. Nothing above
the store indexes a reply by position.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

from capsvc.domain.decisions import ACCEPTED, REJECTED, Reserved


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _text(value: bytes) -> str:
    return value.decode()


# -- a sale's first call: claim (steps) or sell (one call) ---------------------------------

class Claimed(msgspec.Struct, frozen=True):
    """The ticket id is this sale's now (steps): its grids are still to be decided."""

    LUA: ClassVar[str] = "{'new', at, sid}"
    at: int
    sale_id: str


class Sold(msgspec.Struct, frozen=True):
    """The sale made and decided in that same call (one call), at the call's instant, with
    the sale id its caller chose."""

    LUA: ClassVar[str] = "{'new', res, near, sold, shadowed"
    at: int
    sale_id: str
    results: bytes
    near_cap: int
    """Counters this sale brought to 80 % of their cap."""
    sold_out: int
    """Counters at their cap after this sale."""
    shadowed: int
    """Grids accepted that the shadow cap would have refused."""
    caps: list[int] | None
    """The draws' caps the sale was judged by (those the call fixed or found fixed, when it
    was to fix them); None when it was judged by none (refused by the player's limit)."""
    entry: object = None
    """Its call's entry of the unjournaled sales (capsvc.redis.store.Unjournaled)."""


class Decided(msgspec.Struct, frozen=True):
    """The ticket id already holds a decision of this request: a replay."""

    LUA: ClassVar[str] = ("{'final', body or false, at, sid, sale, res or false, st, "
                          "cancelled at or false, released or false}")
    body: bytes | None
    """The decision's body, or None when it is kept as `results` (one call)."""
    at: int
    sale_id: str
    sale: bytes
    results: bytes | None
    state: bytes
    """b"f" decided, b"k" being cancelled, b"c" cancelled."""
    cancelled_at: int | None
    released: int | None


class Pending(msgspec.Struct, frozen=True):
    """The ticket id holds this request's sale, not decided yet: resume it."""

    LUA: ClassVar[str] = "{'pending', at, sid, sale}"
    at: int
    sale_id: str
    sale: bytes


class StoppedAt(msgspec.Struct, frozen=True):
    """An admin stopped the draw at `offset`: nothing was written (one call)."""

    LUA: ClassVar[str] = "{'stopped', offset}"
    offset: int


class Refused(msgspec.Struct, frozen=True):
    """Nothing claimed: `stale` (the id holds a sale that is the janitor's now: `sale`),
    `closed` (the first draw's close has passed), `later` (left to the caller behind a sale
    of its request that moved on) or `day` (judged at `at`, on another day than the
    player's budget was planned for)."""

    LUA: ClassVar[str] = "{'stale', sale} | {'closed'}"
    """(A call of `sell` also answers {'later'} and {'day', at}: see its header.)"""
    why: str
    at: int = 0
    sale: bytes | None = None


Claim = Claimed | Sold | Decided | Pending | StoppedAt | Refused


def claim_of(reply: list[Any]) -> Claim:
    """A claim's reply, or a one-call sale's that made no sale (`sale_of`)."""
    kind = reply[0]
    if kind == b"new":
        return Claimed(int(reply[1]), _text(reply[2]))
    if kind == b"final":
        return Decided(reply[1], int(reply[2]), _text(reply[3]), reply[4], reply[5],
                       reply[6], _int(reply[7] if len(reply) > 7 else None),
                       _int(reply[8] if len(reply) > 8 else None))
    if kind == b"pending":
        return Pending(int(reply[1]), _text(reply[2]), reply[3])
    if kind == b"stopped":
        return StoppedAt(int(reply[1]))
    if kind == b"day":
        return Refused("day", int(reply[1]))
    if kind == b"stale":
        return Refused("stale", sale=reply[1])
    return Refused(_text(kind))


def sale_of(reply: Any, at: int, sale_id: str, caps: list[int], entry: object = None
            ) -> Claim:
    """A reply of a one-call sale (lua/capsvc.lua, `sell`), made at `at` with `sale_id`
    (its call's instant, its caller's nonce); `entry`: its call's entry of the unjournaled
    sales. A sale made with nothing to report beside its results is its results alone,
    judged by `caps` (its shape's, as sent); else its reply says the caps it was judged by
    (fixed or found fixed by it when it was to fix them), or none (refused by the player's
    limit before any grid was judged)."""
    if type(reply) is bytes:
        return Sold(at, sale_id, reply, 0, 0, 0, caps, entry)
    if reply[0] == b"new":
        fixed = reply[5]
        return Sold(at, sale_id, reply[1], int(reply[2]), int(reply[3]), int(reply[4]),
                    [int(c) for c in fixed.split(b",")] if fixed else None, entry)
    return claim_of(reply)


# -- a ticket's record -------------------------------------------------------------------

class TicketRecord(msgspec.Struct, frozen=True):
    """A ticket id's record as it stands (`ticket`)."""

    LUA: ClassVar[str] = "st, body, sale, sid, at, ca, rel, res"
    state: bytes
    """b"p" pending, b"x" expired, b"f" decided, b"k" being cancelled, b"c" cancelled."""
    body: bytes | None
    sale: bytes
    sale_id: str
    at: int
    cancelled_at: int | None
    released: int | None
    results: bytes | None

    @property
    def decided(self) -> bool:
        return self.state in (b"f", b"k", b"c")


def ticket_of(reply: list[Any]) -> TicketRecord | None:
    """A `ticket` reply; None when the ticket id holds nothing."""
    if reply[0] is None:
        return None
    return TicketRecord(reply[0], reply[1], reply[2], _text(reply[3]), int(reply[4]),
                        _int(reply[5]), _int(reply[6]), reply[7])


# -- the janitor's hand-over ---------------------------------------------------------------

class Due(msgspec.Struct, frozen=True):
    """A ticket handed to the janitor (`expire`): a sale left pending (b"x"), a cancel left
    unfinished (b"k") or a decision maybe never journaled (b"f", b"c")."""

    LUA: ClassVar[str] = ("{'x', at, sid, sale} | {'k' or 'c', at, sid, sale, body, "
                          "cancelled at, released, res}")
    state: bytes
    at: int
    sale_id: str
    sale: bytes
    body: bytes | None = None
    cancelled_at: int | None = None
    released: int | None = None
    results: bytes | None = None


def due_of(reply: list[Any]) -> Due | Literal[False] | None:
    """An `expire` reply: what to settle; False when not due yet; None when the janitor has
    nothing to do with the ticket (its entry goes)."""
    if not reply:
        return None
    if reply[0] == b"wait":
        return False
    if reply[0] == b"x":
        return Due(b"x", int(reply[1]), _text(reply[2]), reply[3])
    return Due(reply[0], int(reply[1]), _text(reply[2]), reply[3], reply[4], _int(reply[5]),
               _int(reply[6]), reply[7])


# -- a cancel ----------------------------------------------------------------------------

class Cancelling(msgspec.Struct, frozen=True):
    """The cancel is decided (b"k": what the sale took is to be given back now; b"c":
    given back already, a replay)."""

    LUA: ClassVar[str] = ("{'k', at, released, sid} (also when an earlier cancel was "
                          "interrupted) | {'c', at, released}")
    state: bytes
    at: int
    released: int


class NotCancelled(msgspec.Struct, frozen=True):
    """Nothing decided: `closed` (the first draw is closed or stopped), `missing`,
    `undecided`."""

    LUA: ClassVar[str] = "{'closed'} | {'missing'} | {'undecided'}"
    why: str


def cancel_of(reply: list[Any]) -> Cancelling | NotCancelled:
    if reply[0] in (b"k", b"c"):
        return Cancelling(reply[0], int(reply[1]), int(reply[2]))
    return NotCancelled(_text(reply[0]))


# -- a grid's counters ---------------------------------------------------------------------

def reserved_of(reply: list[Any]) -> Reserved:
    kind = int(reply[0])
    if kind >= ACCEPTED:
        return Reserved(kind, int(reply[1]), tuple(int(o) for o in reply[2:]))
    if kind == REJECTED:
        return Reserved(kind, offset=int(reply[1]), room=int(reply[2]))
    return Reserved(kind)


class Released(msgspec.Struct, frozen=True):
    """A grid given back (`release`)."""

    LUA: ClassVar[str] = "{released stake, offsets that left the sold-out state…}"
    stake: int
    """What this call gave back (0: given back before, or nothing taken)."""
    reopened: tuple[int, ...]
    """The offsets of the draws that left their cap."""


def released_of(reply: list[Any]) -> Released:
    return Released(int(reply[0]), tuple(int(o) for o in reply[1:]))


# -- a player's budget -------------------------------------------------------------------

class Budget(msgspec.Struct, frozen=True):
    """What a sale took from its player's budgets (`budget`)."""

    LUA: ClassVar[str] = "{1, room left on day 1} | {0, room on the day that refused}"
    kind: int
    """ACCEPTED (taken), REJECTED (refused by the limit) or RELEASED (the ref was sealed:
    nothing can be taken any more)."""
    room: int = 0
    """The room left on the first day (taken), or on the day that refused."""
    restored: bool = False
    """Taken by this call of a restore (not recorded before): `budget`'s {1, 0, 1}."""


def budget_of(reply: list[Any]) -> Budget:
    return Budget(int(reply[0]), int(reply[1]) if len(reply) > 1 else 0, len(reply) > 2)


class PlayerLimits(msgspec.Struct, frozen=True):
    """A player's self-limit and spending today (`player`; `set_limit` answers the same)."""

    LUA: ClassVar[str] = ('{self-limit in force today or "none", pending value or "", from '
                          'or "", spent}')
    own: int | None
    """The self-limit in force today (None: none)."""
    pending: int | None
    """The self-limit that applies from `pending_from` (None: none, or its removal)."""
    pending_removal: bool
    """From `pending_from`, no self-limit any more."""
    pending_from: str | None
    spent: int


def limit_set_of(reply: list[Any]) -> tuple[PlayerLimits, int]:
    """A `set_limit` reply: the limits after the change, and the instant it was set at."""
    return limits_of(reply), int(reply[4])


def limits_of(reply: list[Any]) -> PlayerLimits:
    pending_from = reply[2].decode() if reply[2] else None
    removal = bool(pending_from) and reply[1] == b"none"
    return PlayerLimits(None if reply[0] == b"none" else int(reply[0]),
                        None if not pending_from or removal else int(reply[1]), removal,
                        pending_from, int(reply[3]))


# -- the marks -------------------------------------------------------------------------------

class MarkState(msgspec.Struct, frozen=True):
    """A mark as it stands (`marks`, each mark `marks_of` reads)."""

    LUA: ClassVar[str] = ("{G, announced until (or false), the G of each life (false when "
                          "none)}")
    g: int
    """The count of marked writes (0: no mark)."""
    announced_until: int
    """Until when a restore is announced (Redis TIME, ms; 0: none)."""
    lives: tuple[int, ...]
    """The G of each lifetime asked for, in order (0: none)."""


def mark_state_of(reply: list[Any]) -> MarkState:
    return MarkState(int(reply[0] or 0), int(reply[1] or 0),
                     tuple(int(f or 0) for f in reply[2:]))
