"""A small, pure reference model of the sale contract (capsvc's docs/API contract).

Written from the contract, not from the code: counters per (combination, draw), tickets per
(channel, ticket id) with the decision first returned, cancellations, admin stops, players'
daily budgets, and time (Redis TIME, in ms) deciding closes, retentions and days. The
stateful test drives the real service and this model with the same steps and compares every
answer and every counter.

Where the contract leaves an outcome open because a step lands within `MARGIN_MS` of a
close or of the end of a retention (the service and the test cannot act at the same
instant), the model says so (`None`) and the test does not take that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MARGIN_MS = 700


@dataclass
class Rules:
    cap: int
    capped_picks: frozenset[int]
    retention_ms: int
    close_ms: Any
    """draw -> the instant its sales close (ms)."""
    daily_limit: int | None = None
    """A player's daily limit (every sale names its player then)."""
    day_of: Any = None
    """instant (ms) -> (the player's day it falls on, the instants that day starts and
    ends)."""


@dataclass
class Ticket:
    request: dict[str, Any]
    first: int
    draws: int
    decision: dict[str, Any]
    raw: bytes
    taken: list[tuple[tuple[int, ...], int]]
    """(combination, stake) of every accepted capped grid: what a cancel gives back."""
    expires_ms: int
    cancelled: int | None = None
    """What the cancel gave back, once cancelled."""
    budget: tuple[str, str] | None = None
    """(player, day of purchase) its cost was charged to, in a game with a daily limit."""


@dataclass
class Expected:
    status: int
    code: str | None = None
    decision: dict[str, Any] | None = None
    replay_of: Ticket | None = None


@dataclass
class Model:
    rules: Rules
    counters: dict[tuple[tuple[int, ...], int], int] = field(default_factory=dict)
    tickets: dict[tuple[str, str], Ticket] = field(default_factory=dict)
    stopped: set[int] = field(default_factory=set)
    spent: dict[tuple[str, str], int] = field(default_factory=dict)
    """(player, day) -> what the player's accepted grids cost that day."""
    retired: dict[tuple[str, str], int] = field(default_factory=dict)
    """The expiry of every ticket `forget` dropped: the contract frees its id then, but its
    record may stay in Redis until the janitor's sweep reaches it."""

    # -- time ------------------------------------------------------------------------------

    def expiry(self, draw: int) -> int:
        return int(self.rules.close_ms(draw)) + self.rules.retention_ms

    def near(self, instant: int, now: int) -> bool:
        return abs(instant - now) < MARGIN_MS

    def forget(self, now: int) -> None:
        """What the contract says is gone by `now` (with the margin)."""
        self.counters = {k: v for k, v in self.counters.items()
                         if self.expiry(k[1]) > now - MARGIN_MS}
        for k, t in list(self.tickets.items()):
            if t.expires_ms <= now - MARGIN_MS:
                self.retired[k] = t.expires_ms
                del self.tickets[k]

    def ticket(self, channel: str, ticket_id: str, now: int) -> Ticket | bool | None:
        """The live ticket, None when the id is free, False when that is undecidable now."""
        t = self.tickets.get((channel, ticket_id))
        if t is None:
            return None
        if self.near(t.expires_ms, now):
            return False
        return t if t.expires_ms > now else None

    # -- sell ------------------------------------------------------------------------------

    def sell(self, channel: str, request: dict[str, Any], now: int) -> Expected | None:
        """What a POST /v1/tickets must answer (None: undecidable at this instant)."""
        existing = self.ticket(channel, request["ticket_id"], now)
        if existing is False:
            return None
        if isinstance(existing, Ticket):
            if existing.request == request:
                return Expected(200, replay_of=existing)
            return Expected(409, "idempotency_conflict")
        first, n = request["first_draw"], request.get("draws", 1)
        draws = range(first, first + n)
        if any(d in self.stopped for d in draws):
            return Expected(422, "draw_closed")
        close = int(self.rules.close_ms(first))
        if self.near(close, now):
            return None
        if close <= now:
            return Expected(422, "draw_closed")
        if self.rules.daily_limit is not None:
            day, start, end = self.rules.day_of(now)
            if self.near(start, now) or self.near(end, now):
                return None
            requested = sum(g["stake"] * (2 if g.get("multiplier") else 1) * n
                            for g in request["grids"])
            room = self.rules.daily_limit - self.spent.get((request["player_id"], day), 0)
            if requested > room:  # the whole ticket refused, nothing counted
                return Expected(200, decision={
                    "ticket_id": request["ticket_id"], "game": request["game"],
                    "status": "rejected", "reason": "player_limit", "draws": list(draws),
                    "grids": [{"index": i, "numbers": sorted(g["numbers"]),
                               "status": "rejected", "reason": "player_limit"}
                              for i, g in enumerate(request["grids"])],
                    "total_cost": 0})
        grids, total, accepted = [], 0, 0
        planned = dict(self.counters)
        for i, g in enumerate(request["grids"]):
            numbers = tuple(sorted(g["numbers"]))
            stake = g["stake"]
            out: dict[str, Any] = {"index": i, "numbers": list(numbers)}
            refusal = None
            if len(numbers) in self.rules.capped_picks:
                for d in draws:
                    room = self.rules.cap - planned.get((numbers, d), 0)
                    if stake > room:
                        refusal = (d, room)
                        break
            if refusal is None:
                if len(numbers) in self.rules.capped_picks:
                    for d in draws:
                        planned[(numbers, d)] = planned.get((numbers, d), 0) + stake
                cost = stake * (2 if g.get("multiplier") else 1) * n
                out.update(status="accepted", cost=cost)
                total += cost
                accepted += 1
            else:
                out.update(status="rejected", reason="combination_capped", draw=refusal[0],
                           remaining=refusal[1])
            grids.append(out)
        status = ("accepted" if accepted == len(grids)
                  else "partial" if accepted else "rejected")
        return Expected(200, decision={
            "ticket_id": request["ticket_id"], "game": request["game"], "status": status,
            "draws": list(draws), "grids": grids, "total_cost": total,
        })

    def record_sale(self, channel: str, request: dict[str, Any], decision: dict[str, Any],
                    raw: bytes, now: int) -> None:
        """Apply a new ticket's decision (already checked against `sell` at `now`): its
        counters, and its cost to its player's day (the grids the cap refused cost
        nothing)."""
        first, n = request["first_draw"], request.get("draws", 1)
        taken = []
        for g, out in zip(request["grids"], decision["grids"], strict=True):
            numbers = tuple(sorted(g["numbers"]))
            if out["status"] == "accepted" and len(numbers) in self.rules.capped_picks:
                taken.append((numbers, g["stake"]))
                for d in range(first, first + n):
                    self.counters[(numbers, d)] = self.counters.get((numbers, d), 0) + g["stake"]
        budget = None
        if self.rules.daily_limit is not None:
            budget = (request["player_id"], self.rules.day_of(now)[0])
            self.spent[budget] = self.spent.get(budget, 0) + int(decision["total_cost"])
        self.tickets[(channel, request["ticket_id"])] = Ticket(
            request=request, first=first, draws=n, decision=decision, raw=raw, taken=taken,
            expires_ms=self.expiry(first + n - 1), budget=budget)

    # -- cancel ----------------------------------------------------------------------------

    def cancel(self, channel: str, ticket_id: str, now: int) -> Expected | None:
        t = self.ticket(channel, ticket_id, now)
        if t is False:
            return None
        if t is None or not isinstance(t, Ticket):
            return Expected(404, "not_found")
        if t.cancelled is not None:
            return Expected(200)
        if t.decision["total_cost"] == 0:
            return Expected(409, "not_cancellable")
        close = int(self.rules.close_ms(t.first))
        if t.first in self.stopped:
            return Expected(409, "not_cancellable")
        if self.near(close, now):
            return None
        if close <= now:
            return Expected(409, "not_cancellable")
        return Expected(200)

    def record_cancel(self, channel: str, ticket_id: str) -> int:
        """Apply a cancellation; returns what it gives back."""
        t = self.tickets[(channel, ticket_id)]
        if t.cancelled is None:
            for numbers, stake in t.taken:
                for d in range(t.first, t.first + t.draws):
                    self.counters[(numbers, d)] -= stake
            t.cancelled = int(t.decision["total_cost"])
            if t.budget is not None:
                self.spent[t.budget] -= t.cancelled
        return t.cancelled
