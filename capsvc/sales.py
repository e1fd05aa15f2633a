"""The sales use-cases: sell, look up, cancel, check availability, manage draws.

Between the HTTP layer (which decodes and authenticates) and the store (which knows Redis).
A sale takes two dependent Redis steps: claim the ticket id (refusing a different body under
the same id), then reserve every capped grid, all grids at once. The decision is built from
what those steps returned and written back without making the client wait: if that write is
lost, a replay rebuilds the identical body from the same records, and the janitor finalizes
the ticket (every grid has its record, so an answer may have been sent) rather than
releasing it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec

from capsvc import combination
from capsvc.calendar import DrawCalendar, rfc3339
from capsvc.config import Channel, GameRules, Settings
from capsvc.errors import ApiError, Unavailable, not_found, rule_error, unavailable
from capsvc.models import (
    AvailabilityGridOut,
    AvailabilityIn,
    AvailabilityOut,
    CancelOut,
    CappedOut,
    CombinationOut,
    CurrentDrawOut,
    DrawOut,
    GridOut,
    Receipt,
    TicketIn,
    TicketOut,
    TicketStatus,
)
from capsvc.store import (
    TICKET_BUCKETS,
    PlayerStore,
    Store,
    channel_of,
    holder,
    ticket_key,
)
from capsvc.validator import (
    Sale,
    budget_shares,
    parse_numbers_path,
    validate_availability,
    validate_ticket,
)

log = logging.getLogger(__name__)

_encode = msgspec.json.encode
DAY_MS = 86_400_000
_sale_decoder = msgspec.json.Decoder(Sale)
_ticket_decoder = msgspec.json.Decoder(TicketOut)


@dataclass(slots=True)
class SaleOutcome:
    """What the HTTP layer answers for a sale."""

    body: bytes
    replayed: bool
    ticket: TicketOut | None = None
    """The decision, when it was made by this call (for metrics); None on a stored replay."""
    near_cap: int = 0
    """Counters this sale brought to 80 % of their cap."""
    sold_out: int = 0
    """Counters at their cap after this sale (room below the smallest stake)."""


@dataclass(slots=True)
class BudgetPlan:
    """What a ticket of a limited game takes from its player's daily budgets."""

    player: str
    ref: str
    regulatory: int
    until: int
    """When the budget records may go."""
    requested: list[tuple[str, int]]
    """(day, amount) for every grid accepted: what is reserved before the grids."""

    def settlement(self, accepted: list[tuple[str, int]]) -> list[tuple[str, int]] | None:
        """The shares to settle to, over the requested days; None when nothing changes."""
        held = dict(accepted)
        shares = [(day, held.get(day, 0)) for day, _ in self.requested]
        return None if shares == self.requested else shares


class Game:
    """One configured game: its rules and its calendar."""

    __slots__ = ("calendar", "rules")

    def __init__(self, rules: GameRules) -> None:
        self.rules = rules
        self.calendar = DrawCalendar(rules)

    def expire_at(self, draw: int) -> int:
        """When the keys of `draw` may go: its close plus the retention."""
        return self.calendar.close_ms(draw) + self.rules.retention_ms

    def expiries(self, first_draw: int, draws: int) -> list[int]:
        return [self.expire_at(d) for d in range(first_draw, first_draw + draws)]


class Sales:
    """The service's use-cases over a store, for a set of games."""

    def __init__(self, settings: Settings, store: Store, clock: Callable[[], int]) -> None:
        self.settings = settings
        self.store = store
        self.clock = clock
        self.games = {gid: Game(r) for gid, r in settings.games.items()}
        self.players = PlayerStore(store)
        # A request may resume a pending ticket only while the janitor cannot touch it.
        self.stale_after_ms = settings.pending_deadline_ms - settings.request_timeout_ms

    # -- access ----------------------------------------------------------------------------

    def game(self, game_id: str, channel: Channel, *scopes: str) -> Game:
        """The game, if it exists (404) and the channel may use it with one of `scopes` (403)."""
        game = self.games.get(game_id)
        if game is None:
            raise not_found(f"game {game_id!r}")
        if game_id not in channel.games:
            raise ApiError(403, "forbidden", f"channel {channel.id} may not use game {game_id}")
        require_scope(channel, *scopes)
        return game

    # -- draws -----------------------------------------------------------------------------

    def _window(self, game: Game, first: int, draws: int, now: int) -> None:
        """The draws first..first+draws-1 are on sale by the calendar, or a 422."""
        if first < game.calendar.current(now):
            raise rule_error("draw_closed", f"draw {first} is closed for sales", "$.first_draw")
        self._horizon(game, first, now)

    def _horizon(self, game: Game, first: int, now: int) -> None:
        """`first` is not beyond the sales horizon, or a 422."""
        current = game.calendar.current(now)
        if first > current + game.rules.sales_horizon:
            raise rule_error(
                "draw_not_on_sale",
                f"draw {first} is not on sale yet (sales run up to draw "
                f"{current + game.rules.sales_horizon})",
                "$.first_draw",
            )

    async def current_draw(self, game: Game) -> int:
        """The next draw still on sale: by the calendar, skipping draws an admin stopped."""
        first = game.calendar.current(self.clock())
        horizon = game.rules.sales_horizon + 1
        stops = await self.store.stops(game.rules.id, first, horizon)
        offset = next((i for i, s in enumerate(stops) if s is None), horizon)
        return first + offset

    async def current(self, game: Game) -> CurrentDrawOut:
        draw = await self.current_draw(game)
        return CurrentDrawOut(draw=draw, closes_at=rfc3339(game.calendar.closes_at(draw)))

    async def draw(self, game: Game, draw: int) -> DrawOut:
        check_draw(game, draw)
        (stop,) = await self.store.stops(game.rules.id, draw, 1)
        closed = stop is not None or game.calendar.is_past(draw, self.clock())
        return DrawOut(draw=draw, closes_at=rfc3339(game.calendar.closes_at(draw)),
                       status="closed" if closed else "open")

    async def close_draw(self, game: Game, draw: int) -> DrawOut:
        check_draw(game, draw)
        await self.store.stop(game.rules.id, draw, self.clock(), game.expire_at(draw))
        return DrawOut(draw=draw, closes_at=rfc3339(game.calendar.closes_at(draw)),
                       status="closed")

    # -- sell ------------------------------------------------------------------------------

    async def sell(self, channel: Channel, t: TicketIn) -> SaleOutcome:
        game = self.game(t.game, channel, "sell")
        sale = validate_ticket(game.rules, t)
        key = ticket_key(channel.id, t.ticket_id)
        now = self.clock()
        first = sale.first_draw if sale.first_draw is not None else game.calendar.current(now)
        # A defaulted first draw moves on when the one we took for open has just closed.
        # A closed draw is refused by the claim itself, and only when the ticket has no
        # record: the replay of a decided ticket returns its decision at any time.
        for _ in range(3):
            self._horizon(game, first, now)
            stored = msgspec.structs.replace(sale, first_draw=first)
            close_ms = game.calendar.close_ms(first)
            claim = await self.store.claim(
                key, game.rules.id, first, sale.draws, sale.fingerprint, _encode(stored),
                close_ms, game.expire_at(first + sale.draws - 1), self.stale_after_ms,
            )
            kind = claim[0]
            if kind == b"new":
                return await self._decide(channel, game, key, stored, int(claim[1]), close_ms,
                                          replayed=False)
            if kind == b"final":
                return SaleOutcome(body=claim[1], replayed=True)
            if kind == b"pending":
                # A retry, or a concurrent duplicate: re-running the reserve steps returns
                # what they recorded. After an admin stop it may only read (close_ms 0).
                resumed = _sale_decoder.decode(claim[2])
                assert resumed.first_draw is not None
                close_ms = 0 if claim[3] else game.calendar.close_ms(resumed.first_draw)
                return await self._decide(channel, game, key, resumed, int(claim[1]), close_ms,
                                          replayed=True)
            if kind == b"conflict":
                raise ApiError(409, "idempotency_conflict",
                               f"ticket {t.ticket_id} was already used with a different request",
                               "$.ticket_id")
            if kind == b"stale":
                raise unavailable(f"ticket {t.ticket_id} is being settled after an "
                                  "interrupted sale; retry shortly", self.settings.retry_after_s)
            offset = int(claim[1])  # closed: -1 by the clock, else the stopped draw's offset
            if sale.first_draw is not None or offset > 0:
                draw = first + max(offset, 0)
                raise rule_error("draw_closed", f"draw {draw} is closed for sales", "$.first_draw")
            first += 1
            now = self.clock()
        raise rule_error("draw_closed", "no open draw found", "$.first_draw")

    async def _decide(
        self, channel: Channel, game: Game, key: str, sale: Sale, at: int, close_ms: int,
        *, replayed: bool,
    ) -> SaleOutcome:
        """Take the player's budget (games with a daily limit), reserve every capped grid
        (concurrently), build the decision, write it back with the budget settled."""
        rules = game.rules
        assert sale.first_draw is not None
        first = sale.first_draw
        expire_at = game.expiries(first, sale.draws)
        plan = self._budget(channel.id, game, sale, at)
        if plan is not None:
            taken = await self.players.reserve(plan.player, plan.ref, plan.regulatory,
                                               plan.until, plan.requested)
            if taken[0] != 1:
                out = player_limit_decision(sale)
                body = _encode(out)
                self.store.finalize(key, at, body)
                return SaleOutcome(body=body, replayed=replayed, ticket=out)
        replies = await self._reserve_all(channel.id, game, sale, expire_at, close_ms)
        out = build_decision(channel.id, rules, game.calendar, sale, at, replies)
        near_cap = sold_out = 0
        for g, reply in zip(sale.grids, replies, strict=True):
            if reply is not None and reply[0] == 1:
                near_cap += reply[1]
                for offset in reply[2:]:
                    sold_out += 1
                    self.store.mark_sold_out(rules.id, first + offset, g.combo, expire_at[offset])
        settlement = self._settlement(plan, game, sale, at, out)
        if plan is not None and settlement is not None:
            self.players.settle_later(plan.player, plan.ref, settlement)
        body = _encode(out)
        self.store.finalize(key, at, body)
        return SaleOutcome(body=body, replayed=replayed, ticket=out, near_cap=near_cap,
                           sold_out=sold_out)

    def _budget(self, channel_id: str, game: Game, sale: Sale, at: int) -> BudgetPlan | None:
        """The ticket's budget plan, for games with a daily limit."""
        if game.rules.daily_limit is None or sale.player_id is None:
            return None
        assert sale.first_draw is not None
        last = sale.first_draw + sale.draws - 1
        return BudgetPlan(
            player=sale.player_id, ref=f"t/{channel_id}/{sale.ticket_id}",
            regulatory=game.rules.daily_limit,
            until=max(game.expire_at(last), at + DAY_MS) + DAY_MS,
            requested=self._shares(game, sale, at, None),
        )

    def _shares(self, game: Game, sale: Sale, at: int, accepted: set[int] | None
                ) -> list[tuple[str, int]]:
        assert sale.first_draw is not None
        cal = game.calendar
        return budget_shares(cal.local_days(sale.first_draw, sale.draws), sale,
                             game.rules.subscription_accounting, cal.local_date(at).isoformat(),
                             accepted)

    def _settlement(self, plan: BudgetPlan | None, game: Game, sale: Sale, at: int,
                    decision: TicketOut | None) -> list[tuple[str, int]] | None:
        """The shares that make the budget hold what `decision` accepted (nothing when it
        is None), or None when there is no budget or nothing to change."""
        if plan is None:
            return None
        accepted = ({g.index for g in decision.grids if g.status == "accepted"}
                    if decision is not None else set())
        return plan.settlement(self._shares(game, sale, at, accepted))

    async def _reserve_all(self, channel_id: str, game: Game, sale: Sale, expire_at: list[int],
                           close_ms: int) -> list[Any]:
        """Reserve every capped grid at once; one reply per grid (None: not capped)."""
        rules = game.rules
        assert sale.first_draw is not None
        return await replies_of([
            self.store.reserve(
                rules.id, g.combo, holder(channel_id, sale.ticket_id, g.index), g.stake,
                rules.cap_limit or 0, rules.min_stake, sale.first_draw, expire_at, close_ms,
            )
            if g.capped else None
            for g in sale.grids
        ])

    # -- tickets ---------------------------------------------------------------------------

    async def ticket(self, channel: Channel, ticket_id: str) -> bytes:
        require_scope(channel, "sell", "read")
        state, body, _, _ = await self.store.ticket(ticket_key(channel.id, ticket_id))
        if state is None:
            raise not_found(f"ticket {ticket_id!r}")
        if body is None:
            raise ApiError(409, "ticket_pending",
                           f"ticket {ticket_id} has no decision yet: retry the POST with the "
                           "same body to complete it")
        return bytes(body)

    async def cancel(self, channel: Channel, ticket_id: str) -> CancelOut:
        require_scope(channel, "sell")
        key = ticket_key(channel.id, ticket_id)
        state, body, raw_sale, claimed_at = await self.store.ticket(key)
        if state is None:
            raise not_found(f"ticket {ticket_id!r}")
        if body is None:
            raise ApiError(409, "not_cancellable", f"ticket {ticket_id} has no decision yet")
        sale = _sale_decoder.decode(raw_sale)
        decision = _ticket_decoder.decode(body)
        game = self.games.get(sale.game)
        if game is None:
            raise ApiError(409, "not_cancellable", f"game {sale.game} is no longer served")
        assert sale.first_draw is not None
        rules = game.rules
        refusal = cancel_refusal(rules, sale, decision)
        if refusal and state != b"c":
            raise ApiError(409, "not_cancellable", refusal)
        (stop,) = await self.store.stops(rules.id, sale.first_draw, 1)
        close_ms = game.calendar.close_ms(sale.first_draw)
        if stop is not None:
            close_ms = min(close_ms, int(stop))
        reply = await self.store.cancel(key, close_ms, decision.total_cost)
        if reply[0] == b"closed":
            raise ApiError(409, "not_cancellable",
                           f"draw {sale.first_draw} is closed: ticket {ticket_id} stands")
        if reply[0] != b"ok":
            raise ApiError(409, "not_cancellable", f"ticket {ticket_id} has no decision yet")
        await self.release(channel.id, game, sale, decision)
        plan = self._budget(channel.id, game, sale, int(claimed_at))
        settlement = self._settlement(plan, game, sale, int(claimed_at), None)
        if plan is not None and settlement is not None:
            await self.players.settle(plan.player, plan.ref, settlement)
        return CancelOut(ticket_id=ticket_id, status="cancelled", released=int(reply[1]))

    async def release(self, channel_id: str, game: Game, sale: Sale, decision: TicketOut | None
                      ) -> int:
        """Give back what every capped grid of a ticket took (idempotent, once per grid)."""
        rules = game.rules
        assert sale.first_draw is not None
        accepted = {g.index for g in decision.grids if g.status == "accepted"} if decision else None
        futures = [
            (g, self.store.release(rules.id, g.combo, holder(channel_id, sale.ticket_id, g.index),
                                   rules.cap_limit or 0, rules.min_stake, sale.first_draw,
                                   sale.draws))
            for g in sale.grids
            if g.capped and (accepted is None or g.index in accepted)
        ]
        released = 0
        replies = await replies_of([f for _, f in futures])
        for (g, _), reply in zip(futures, replies, strict=True):
            released += int(reply[0])
            for offset in reply[1:]:
                self.store.unmark_sold_out(rules.id, sale.first_draw + offset, g.combo)
        return released

    # -- availability ----------------------------------------------------------------------

    async def combination(self, game: Game, draw: int, numbers_text: str) -> CombinationOut:
        rules = game.rules
        numbers = parse_numbers_path(rules, numbers_text)
        check_draw(game, draw)
        if not rules.is_capped(len(numbers)):
            return CombinationOut(numbers=list(numbers), draw=draw, cap=None, staked=None,
                                  remaining=None, selectable=True)
        cap = rules.cap_limit or 0
        (raw,) = await self.store.counters(rules.id, combination.encode(numbers), draw, 1)
        staked = int(raw or 0)
        return CombinationOut(numbers=list(numbers), draw=draw, cap=cap, staked=staked,
                              remaining=cap - staked, selectable=cap - staked >= rules.min_stake)

    async def availability(self, game: Game, a: AvailabilityIn) -> AvailabilityOut:
        rules = game.rules
        probes = validate_availability(rules, a)
        first = a.first_draw if a.first_draw is not None else await self.current_draw(game)
        self._window(game, first, a.draws, self.clock())
        cap = rules.cap_limit or 0
        futures = [
            self.store.counters(rules.id, p.combo, first, a.draws) if p.capped else None
            for p in probes
        ]
        grids = []
        for p, values in zip(probes, await replies_of(futures), strict=True):
            out = AvailabilityGridOut(index=p.index, available=True)
            if values is None:
                grids.append(out)
                continue
            for offset, raw in enumerate(values):
                room = cap - int(raw or 0)
                if p.stake > room:
                    out = AvailabilityGridOut(index=p.index, available=False,
                                              draw=first + offset, remaining=room)
                    break
            grids.append(out)
        return AvailabilityOut(grids=grids)

    async def sold_out(self, game: Game, draw: int) -> CappedOut:
        """The draw's sold-out combinations, each checked against its counter."""
        rules = game.rules
        check_draw(game, draw)
        members = sorted(m.decode() for m in await self.store.sold_out(rules.id, draw))
        values = await replies_of(self.store.counters_of(rules.id, draw, members))
        cap = rules.cap_limit or 0
        return CappedOut(draw=draw, combinations=[
            combination.decode(m) for m, v in zip(members, values, strict=True)
            if cap - int(v or 0) < rules.min_stake
        ])

    # -- janitor ---------------------------------------------------------------------------

    async def settle_pending(self, limit: int = 100) -> int:
        """Settle tickets left pending past the deadline; returns how many were settled.

        If every capped grid has its record, the sale ran to its end and an answer may have
        been sent: the decision is rebuilt and written. Otherwise no answer was sent (a
        request answers only after every grid has its record): what was taken is released
        and the ticket forgotten, so a retry starts afresh.
        """
        cutoff = self.clock() - self.settings.pending_deadline_ms
        settled = 0
        for bucket in range(TICKET_BUCKETS):
            keys = await self.store.pending(bucket, cutoff, limit)
            for raw_key in keys:
                key = raw_key.decode()
                try:
                    settled += await self._settle(key, cutoff)
                except (Unavailable, ApiError):
                    raise
                except Exception:  # one bad record must not stop the janitor
                    log.exception("janitor could not settle %s", key)
        return settled

    async def _settle(self, key: str, cutoff: int) -> int:
        reply = await self.store.expire(key, cutoff)
        if not reply:
            return 0
        at = int(reply[1])
        sale = _sale_decoder.decode(reply[2])
        game = self.games.get(sale.game)
        channel_id = channel_of(key)
        if game is None or sale.first_draw is None:
            await self.store.unclaim(key, at)
            return 1
        rules = game.rules
        first, n = sale.first_draw, sale.draws
        plan = self._budget(channel_id, game, sale, at)
        budget_taken = True
        if plan is not None:
            taken = await self.players.reserve(plan.player, plan.ref, plan.regulatory, 0,
                                               plan.requested)
            if taken[0] == 0:  # refused by the player's limit: that was the decision
                await self.store.finalize(key, at, _encode(player_limit_decision(sale)))
                return 1
            budget_taken = taken[0] == 1
        expire_at = game.expiries(first, n)
        replies = await self._reserve_all(channel_id, game, sale, expire_at, 0)
        if budget_taken and all(r is None or r[0] != -1 for r in replies):
            out: TicketOut | None = build_decision(channel_id, rules, game.calendar, sale, at,
                                                   replies)
        else:
            out = None
            await self.release(channel_id, game, sale, None)
        settlement = self._settlement(plan, game, sale, at, out)
        if plan is not None and settlement is not None:
            await self.players.settle(plan.player, plan.ref, settlement)
        if out is not None:
            await self.store.finalize(key, at, _encode(out))
            log.info("janitor finalized an interrupted sale", extra={"ticket_key": key})
        else:
            await self.store.unclaim(key, at)
            log.info("janitor released an abandoned sale", extra={"ticket_key": key})
        return 1


async def replies_of(futures: Sequence[asyncio.Future[Any] | None]) -> list[Any]:
    """Await queued calls together (None stays None). Every failure is retrieved; the
    first one is raised once all have settled."""
    queued = [f for f in futures if f is not None]
    if len(queued) == 1:  # the common case: no gathering needed
        await queued[0]
    elif queued:
        await asyncio.gather(*queued, return_exceptions=True)
        for f in queued:
            error = f.exception()
            if error is not None:
                raise error
    return [None if f is None else f.result() for f in futures]


def check_draw(game: Game, draw: int) -> None:
    """Draws are numbered from 1 to the calendar's last one."""
    if not 1 <= draw <= game.calendar.last_draw:
        raise not_found(f"draw {draw}")


def require_scope(channel: Channel, *scopes: str) -> None:
    if channel.scopes.isdisjoint(scopes):
        raise ApiError(403, "forbidden",
                       f"channel {channel.id} lacks the scope {' or '.join(scopes)}")


def cancel_refusal(rules: GameRules, sale: Sale, decision: TicketOut) -> str | None:
    """Why the game's policy forbids cancelling this ticket, or None."""
    if rules.cancel == "never":
        return f"game {rules.id} does not allow cancellations"
    if rules.cancel == "single_draw_only" and sale.draws > 1:
        return f"game {rules.id} does not allow cancelling a subscription"
    if decision.receipt is None:
        return "nothing was accepted: there is nothing to cancel"
    return None


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


def receipt_id(channel_id: str, ticket_id: str, at: int) -> str:
    """Derived from what the claim stored, so a rebuilt decision has the same receipt."""
    return hashlib.blake2b(f"{channel_id}/{ticket_id}/{at}".encode(), digest_size=10).hexdigest()


def build_decision(
    channel_id: str, rules: GameRules, calendar: DrawCalendar, sale: Sale, at: int,
    replies: list[Any],
) -> TicketOut:
    """The ticket's decision from its sale and the reserve replies (None: uncapped grid).

    Pure: a replay or the janitor rebuilds the identical body from the same records.
    """
    assert sale.first_draw is not None
    first = sale.first_draw
    grids = []
    total = 0
    accepted = 0
    for g, reply in zip(sale.grids, replies, strict=True):
        if reply is None or reply[0] == 1:
            grids.append(GridOut(index=g.index, numbers=list(g.numbers), status="accepted",
                                 cost=g.cost))
            total += g.cost
            accepted += 1
        elif reply[0] == 0:
            grids.append(GridOut(index=g.index, numbers=list(g.numbers), status="rejected",
                                 reason="combination_capped", draw=first + int(reply[1]),
                                 remaining=int(reply[2])))
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
            receipt_id=receipt_id(channel_id, sale.ticket_id, at),
            issued_at=rfc3339(datetime.fromtimestamp(at / 1000, rules.tz)),
        )
    return TicketOut(
        ticket_id=sale.ticket_id, game=sale.game, status=status,
        draws=list(range(first, first + sale.draws)), grids=grids, total_cost=total,
        receipt=receipt,
    )
