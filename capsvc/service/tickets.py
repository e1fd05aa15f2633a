"""The tickets use-cases: sell, look up, cancel.

A sale's unit is a batch: `Tickets.sell(channel, tickets)` is the one entry (`POST
/v1/tickets` a batch of one), each ticket judged exactly as if sent alone, in order. It
reads top-down:

1. **prepare** the batch (`_prepare`): every rule that does not need Redis
   (capsvc.domain.validator), the first draw resolved; nothing touches Redis before;
2. **sell in one call** what can be (a standalone Redis, player limits included):
   the tickets of every request of this event-loop tick join one batch (`_joined`), cut
   into calls of SALES_PER_CALL (`_sell_joined`); each call (`_sell_group`) is one atomic
   `capsvc_sell` — claim, close, admin stops, the player's limit, every grid, the
   decision — one future, one journal append (a `sales` line), then the release of its
   entry of the unjournaled sales (capsvc.redis.store `journaled_sale`);
3. **the rest alone** (`_sell`): the tickets sold in steps (a Redis Cluster), and those a
   first call left a step to (`Decided`: a replay; `Claimed`, `Pending`: a claim to
   decide; a defaulted first draw that closed or was stopped moves on and is sold again; a
   sale judged on another day than its player's budget was planned for is planned again).
   In steps: the ticket indexed for the janitor and claimed (`capsvc_claim`, which mints
   the sale id that fences every later step), then
   **decided** (`_decide`: the player's budget, the admin stops read with the first step,
   every capped grid reserved at once, the decision built from their records), **written**
   (with the budget's settlement and the sold-out lists), **journaled**, and only then the
   ticket's index entry let go (`_journaled`). The tickets of a batch take each step
   together: the marked calls of one turn of the event loop go one call a node
   (capsvc.redis.marks), so their claims are one call a node, then their reserves, then
   their decisions, and a node that fails a step fails the tickets whose calls it
   carried, each as if sold alone (503, outcome unknown, the janitor's to conclude);
4. the HTTP layer then waits for the replicas (`replicas:N`) and answers.

What a step cannot finish is a value, not an exception: `AGAIN` (another actor of the sale
sealed or decided it: claim again), `Stop` (an admin stopped a draw of it: voided), a
`Refused` first call. A sale that does not stand ends in one epilogue (`SaleSteps.void`:
given back, the void journaled, the claim forgotten) wherever it ends: an admin's stop, a
draw closed mid-sale, the janitor.

A decision is written before the answer, so that a GET or a cancel sent on receipt, to any
process, finds it; if the write is lost the answer is a 503 (outcome unknown), a replay
rebuilds the identical body from the same records, and the janitor journals the ticket if
nobody asks again.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC
from typing import Any, Final

import msgspec

from capsvc.client.models import CancelOut, TicketIn, TicketOut
from capsvc.config import Channel, Settings
from capsvc.domain.decisions import (
    ACCEPTED,
    CLOSED,
    RELEASED,
    SHADOWED,
    Verdict,
    budget_ref,
    budget_until,
    cancel_refusal,
    derived_body,
    render,
    results_of,
    with_cancellation,
)
from capsvc.domain.errors import ApiError, Unavailable, not_found, rule_error, unavailable
from capsvc.domain.games import Catalog, Game, require_scope
from capsvc.domain.validator import (
    Sale,
    pack_sale,
    request_fingerprint,
    sale_fingerprint,
    unpack_sale,
    validate_ticket,
)
from capsvc.journal.recorder import Recorder, SaleDecision
from capsvc.journal.records import Via
from capsvc.redis.clock import RedisClock
from capsvc.redis.marks import Marks, stamp
from capsvc.redis.replies import (
    Cancelling,
    Claim,
    Claimed,
    Decided,
    Pending,
    Refused,
    Sold,
    StoppedAt,
    TicketRecord,
)
from capsvc.redis.store import (
    SALES_PER_CALL,
    SaleCall,
    Shape,
    Store,
    budget_call,
    channel_of,
    retrieving,
    stop_instants,
    ticket_key,
    ticket_names,
)
from capsvc.service.caps import caps_argument
from capsvc.service.draws import Draws
from capsvc.service.steps import SaleSteps

log = logging.getLogger(__name__)
_encode = msgspec.json.encode
_ticket_decoder = msgspec.json.Decoder(TicketOut)
_ATTEMPTS = 4
"""Claims per request: a defaulted first draw that just closed moves on, a sale the janitor
took over is claimed again."""


class SaleOutcome(msgspec.Struct):
    """What the HTTP layer answers for a sale."""

    body: bytes
    replayed: bool
    verdict: Verdict | None = None
    """The decision, when it was made by this call (for metrics); None on a stored replay."""
    near_cap: int = 0
    """Counters this sale brought to 80 % of their cap."""
    sold_out: int = 0
    """Counters at their cap after this sale (room below the smallest stake)."""
    shadowed: int = 0
    """Grids accepted that the game's shadow cap would have refused."""


class _Again:
    """Another actor of the sale sealed or decided it meanwhile: claim again."""


AGAIN: Final = _Again()


@dataclass(frozen=True, slots=True)
class Stop:
    """An admin stopped the sale's draw at `offset` before its claim: it was voided."""

    offset: int


Step = SaleOutcome | _Again | Stop
"""What deciding a claimed sale comes to."""

class _Prepared(msgspec.Struct):
    """A ticket of a batch that passed every check that does not need Redis."""

    index: int
    """Its place in the batch."""
    request: int
    """Its batch's number in this process: a ticket of it that moves on to another draw
    holds the batch's later tickets back until it has (lua/capsvc.lua, `sell`)."""
    ticket: TicketIn
    channel: Channel
    stamp: dict[str, int] | None
    """Its request's stamp (capsvc.redis.marks)."""
    game: Game
    sale: Sale
    key: str
    """Its record's name (capsvc.redis.store.ticket_key)."""
    record: tuple[str, str]
    """Its record's bucket and field (capsvc.redis.store.ticket_names)."""
    first: int
    one_call: bool
    """Sold in one atomic call (else in steps)."""
    stored: Sale
    """The sale as its first call stores it (its first draw resolved)."""
    expire_at: int


_GroupOutcome = SaleOutcome | ApiError | Unavailable | Claim
"""A one-call ticket's outcome, or its first call's reply when a step is left to take."""


_Joining = tuple[list[_Prepared], asyncio.Future[list[_GroupOutcome]]]
"""A request's one-call tickets in this tick, and the future of their outcomes."""


def _answer_joined(joining: list[_Joining], parts: list[list[_Prepared]],
                   done: asyncio.Future[list[Any]]) -> None:
    """Each of `joining` (requests whose tickets `parts`, calls of a tick, carry) its
    tickets' outcomes: a call that failed as unavailable fails its tickets so (outcome
    unknown); any other failure, every one of those requests."""
    outcomes: dict[int, _GroupOutcome] = {}
    failure: BaseException | None = None
    if done.cancelled():
        failure = asyncio.CancelledError()
    else:
        for part, result in zip(parts, done.result(), strict=True):
            if isinstance(result, Unavailable):
                outcomes.update((id(p), result) for p in part)
            elif isinstance(result, BaseException):
                failure = result
            else:
                outcomes.update(zip(map(id, part), result, strict=True))
    for group, out in joining:
        if out.done():
            continue
        if failure is not None:
            out.set_exception(failure)
        else:
            out.set_result([outcomes[id(p)] for p in group])


def _chains(alone: Sequence[tuple[int, _Prepared, Claim | None]]
            ) -> list[list[tuple[int, _Prepared, Claim | None]]]:
    """`alone` in chains, each in the order sent: two sales that share a player (a budget)
    or a capped combination (a counter) are in one chain, so that the later is judged after
    the earlier, as if sent alone after it; sales of different chains cannot change how
    another is judged."""
    owner: dict[tuple[str, ...], int] = {}  # a budget's or a counter's chain
    parent: list[int] = []

    def root(c: int) -> int:
        while parent[c] != c:
            parent[c] = parent[parent[c]]
            c = parent[c]
        return c

    for at, (_, p, _) in enumerate(alone):
        parent.append(at)
        keys: list[tuple[str, ...]] = [("c", p.game.rules.id, g.combo)
                                       for g in p.sale.grids if g.capped]
        if p.sale.player_id is not None:
            keys.append(("p", p.sale.player_id))
        for key in keys:
            if key in owner:
                parent[root(owner[key])] = root(at)
            owner[key] = at
    chains: dict[int, list[tuple[int, _Prepared, Claim | None]]] = {}
    for at, sale in enumerate(alone):
        chains.setdefault(root(at), []).append(sale)
    return list(chains.values())


def first_stopped(stops: list[int | None], at: int) -> int | None:
    """The offset of the first draw stopped at or before the instant `at`, or None."""
    return next((i for i, s in enumerate(stops) if s is not None and s <= at), None)


class Tickets:
    """Selling, looking up and cancelling tickets."""

    def __init__(self, settings: Settings, catalog: Catalog, draws: Draws, store: Store,
                 steps: SaleSteps, clock: RedisClock, journal: Recorder) -> None:
        self.settings = settings
        self.journal = journal
        self.catalog = catalog
        self.draws = draws
        self.store = store
        self.steps = steps
        self.clock = clock
        # A request may resume a pending ticket only while the janitor cannot touch it.
        self.stale_after_ms = settings.pending_deadline_ms - settings.request_timeout_ms
        self._one_call = {game.rules.id: settings.one_call_sales and store.single_node
                          for game in catalog.games.values()}
        """Whether each game's sales are one atomic call (else steps), fixed at wiring."""
        self._requests = itertools.count(1)
        self._joining: list[_Joining] = []
        """The one-call tickets of this tick's requests, sold together at its end."""

    # -- sell ------------------------------------------------------------------------------

    async def sell(self, channel: Channel, tickets: Sequence[TicketIn]
                   ) -> list[SaleOutcome | ApiError | Unavailable]:
        """The only sale entry: judge and record each ticket exactly as if it had been sent
        alone, in order, or answer the decision already recorded for its ticket id. One
        result per ticket: its outcome, or the error it would have been answered alone — a
        503 among them leaves that ticket's outcome unknown and nothing of the others'.
        Not a transaction: a ticket refused or capped changes nothing for the others, and a
        player's limit holds across them as across concurrent requests. `POST /v1/tickets`
        is a batch of one.

        The batch is prepared as a whole (`_prepare`), then its tickets on the one-call
        protocol go to Redis as one group (`_sell_group`: one future, one journal append,
        joined with the other requests' of the tick in one call), and the others — the
        steps' protocol, and what a first call leaves to do (a replay, a claim to resume,
        a first draw that moved on) — each as a sale alone (`_sell`). A request refused
        (4xx) before its ticket id was looked up is looked up then: a retry of a sale whose
        answer was lost still gets its decision when the configuration has changed since
        (a stake, a duration, a game no longer offered)."""
        results: list[SaleOutcome | ApiError | Unavailable | None] = [None] * len(tickets)
        request = next(self._requests)
        group: list[_Prepared] = []
        alone: list[tuple[int, _Prepared, Claim | None]] = []
        seen: dict[Any, Any] = {}
        for i, t in enumerate(tickets):
            try:
                prepared = self._prepare(channel, t, i, request, seen)
            except ApiError as e:
                results[i] = e
                continue
            if prepared.one_call:
                group.append(prepared)
            else:
                alone.append((i, prepared, None))
        while group:
            later: list[_Prepared] = []
            left: list[tuple[int, _Prepared, Claim | None]] = []
            for prepared, outcome in zip(group, await self._joined(group), strict=True):
                if isinstance(outcome, Refused) and outcome.why == "later":
                    later.append(prepared)  # behind a ticket that moves on: after it
                elif isinstance(outcome, SaleOutcome | ApiError | Unavailable):
                    results[prepared.index] = outcome
                else:
                    left.append((prepared.index, prepared, outcome))
            if later:  # the tickets before them first, in order, then they as a new group
                await self._alone(channel, left, results)
                request = next(self._requests)
                for p in later:
                    p.request = request
            else:
                alone += left
            group = later
        await self._alone(channel, alone, results)
        refused = [i for i, r in enumerate(results)
                   if isinstance(r, ApiError) and r.kind != "unavailable"
                   and r.code != "idempotency_conflict"]
        if refused:
            recorded = await asyncio.gather(*[self._recorded(channel, tickets[i])
                                              for i in refused], return_exceptions=True)
            for i, found in zip(refused, recorded, strict=True):
                if isinstance(found, BaseException) and not isinstance(
                        found, ApiError | Unavailable):
                    raise found  # a bug: only the contract's errors stand for a ticket
                if found is not None:
                    results[i] = found
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    async def _alone(self, channel: Channel,
                     alone: Sequence[tuple[int, _Prepared, Claim | None]],
                     results: list[SaleOutcome | ApiError | Unavailable | None]) -> None:
        """Each of `alone` sold as a sale of its own (`_sell`, from its first call's reply
        when it has one), its result put at its place: in order where one may change how
        the next is judged (`_chains`: the same player, a combination in common), the
        others at once."""
        if not alone:
            return

        async def chain(sales: list[tuple[int, _Prepared, Claim | None]]) -> None:
            for i, prepared, claim in sales:
                # Its records stamped with its own calls' G, not every call of the batch:
                # its task's own stamp, from the G of its first call when it continues
                # one (a replay reports what that call read: a write of this process).
                own = Marks.begin()
                if claim is not None and prepared.stamp is not None:
                    own.update(prepared.stamp)
                try:
                    results[i] = await self._sell(channel, prepared, claim)
                except (ApiError, Unavailable) as e:
                    results[i] = e

        await asyncio.gather(*[chain(c) for c in _chains(alone)])

    def _joined(self, group: list[_Prepared]) -> asyncio.Future[list[_GroupOutcome]]:
        """The outcomes of `group` (one request's one-call tickets), sold with every other
        request's of this event-loop tick: the tick's tickets are one batch, cut into calls
        of SALES_PER_CALL (`_sell_groups`). One future a request."""
        loop = asyncio.get_running_loop()
        out: asyncio.Future[list[_GroupOutcome]] = loop.create_future()
        if not self._joining:
            loop.call_soon(self._sell_joined)
        self._joining.append((group, out))
        return out

    def _sell_joined(self) -> None:
        """The tick's one-call tickets, every request's, sold in calls of SALES_PER_CALL
        (one task a call), each request answered its own as soon as the calls that carry
        its tickets are done (not after the tick's last call)."""
        joining, self._joining = self._joining, []
        items = [p for group, _ in joining for p in group]
        parts = [items[at:at + SALES_PER_CALL] for at in range(0, len(items), SALES_PER_CALL)]
        loop = asyncio.get_running_loop()
        # A request cut over two calls: the second reads what the first stopped judging.
        continues = [at > 0 and parts[at][0].request == parts[at - 1][-1].request
                     for at in range(len(parts))]
        tasks = [loop.create_task(self._sell_group(part, after))
                 for part, after in zip(parts, continues, strict=True)]
        spans: dict[tuple[int, int], list[_Joining]] = {}  # the calls of requests
        at = 0
        for joined in joining:
            span = (at // SALES_PER_CALL, (at + len(joined[0]) - 1) // SALES_PER_CALL)
            spans.setdefault(span, []).append(joined)
            at += len(joined[0])
        for (first, last), requests in spans.items():
            done = asyncio.gather(*tasks[first:last + 1], return_exceptions=True)
            done.add_done_callback(functools.partial(_answer_joined, requests,
                                                     parts[first:last + 1]))

    def _prepare(self, channel: Channel, t: TicketIn, index: int, request: int,
                 seen: dict[Any, Any]) -> _Prepared:
        """A ticket checked against every rule that does not need Redis, its first draw
        resolved (the calendar's current one when not asked), as its first call sends it.
        `seen`: what the batch's tickets share (a game and its current draw, an expiry),
        worked out once a batch."""
        found = seen.get(t.game)
        if found is None:
            game = self.catalog.game(t.game, channel, "sell")
            found = seen[t.game] = (game, game.calendar.current(self.clock.now()))
        game, current = found
        sale = validate_ticket(game.rules, t)
        first = sale.first_draw if sale.asked else current
        assert first is not None
        if first < 1:  # before the calendar's first draw: closed long ago
            raise _closed(first)
        self.draws.check_horizon(game, first, current)
        last = (t.game, first + sale.draws - 1)
        expire_at = seen.get(last)
        if expire_at is None:
            expire_at = seen[last] = game.expire_at(last[1])
        key, record = ticket_names(channel.id, t.ticket_id)
        return _Prepared(index, request, t, channel, stamp.get(), game, sale, key, record, first,
                         self._one_call[game.rules.id],
                         msgspec.structs.replace(sale, first_draw=first), expire_at)

    async def _sell_group(self, group: list[_Prepared], continues: bool = False
                          ) -> list[_GroupOutcome]:
        """Tickets of the one-call protocol (at most SALES_PER_CALL, of one or several
        requests), each sold in one atomic call, all in one Redis call: the outcome of each
        sale made, or the first call's reply when a step is left to take (`_sell` takes
        it). Each request's stamp gets the call's G, and stamps its records."""
        shapes: dict[tuple[str, int, int, bool], tuple[Shape, bool]] = {}
        calls, fixing = [], []
        for p in group:
            call, fix = self._sale_call(p.game, p.key, p.record, p.stored, p.expire_at,
                                        shapes, p.request)
            calls.append(call)
            fixing.append(fix)
        stamps = list({id(p.stamp): p.stamp for p in group}.values())
        claims = await self.store.sell(calls, stamps, continues)
        out: list[_GroupOutcome] = []
        records: list[SaleDecision] = []
        for p, claim, fix in zip(group, claims, fixing, strict=True):
            if not isinstance(claim, Sold):
                out.append(claim)
                continue
            self._fixed(p.game, p.first, fix, claim)
            body, verdict = render(p.channel.id, p.stored, claim.sale_id, claim.at,
                                   claim.results)
            records.append(("answer", p.channel.id, p.stored, claim.sale_id, claim.at, body,
                            p.expire_at, claim.caps, p.stamp, claim.results))
            out.append(SaleOutcome(body=body, replayed=False, verdict=verdict,
                                   near_cap=claim.near_cap, sold_out=claim.sold_out,
                                   shadowed=claim.shadowed))
        if records:
            try:
                await self.journal.sales(records)
            except Unavailable as e:
                return [e if isinstance(o, SaleOutcome) else o for o in out]
            for claim in claims:
                if isinstance(claim, Sold):
                    self.store.journaled_sale(claim)
        return out

    async def _recorded(self, channel: Channel, t: TicketIn) -> SaleOutcome | None:
        """The decision recorded for this request's ticket id, if it is this request's;
        409 if the id holds another request; None when there is none."""
        record = await self.store.ticket(ticket_key(channel.id, t.ticket_id))
        if record is None:
            return None
        held = unpack_sale(record.sale)
        if _another_request(held, request_fingerprint(t)):
            raise _conflict(t.ticket_id)
        if record.decided:
            body = record.body or derived_body(channel.id, held, record.sale_id, record.at,
                                               record.results)
            await self._journal_stored("replay", channel.id, record, held, body)
            return SaleOutcome(body=body, replayed=True)
        raise unavailable(f"ticket {t.ticket_id} is being settled after an interrupted sale; "
                          "retry shortly", self.settings.retry_after_s)

    async def _sell(self, channel: Channel, p: _Prepared, claim: Claim | None
                    ) -> SaleOutcome:
        """One ticket's sale from its first call (`claim`: its reply, when the group's call
        made it) to its answer, claiming again while a step sends it back: a defaulted
        first draw that just closed moves on, a sale the janitor took over is claimed
        again."""
        t, game, sale, key, first = p.ticket, p.game, p.sale, p.key, p.first
        defaulted = not sale.asked  # the calendar's current draw, moving on when it closes
        judged = 0  # Redis's instant of a call that judged the sale on another day
        for _ in range(_ATTEMPTS):
            if claim is None:
                self.draws.check_horizon(game, first)
            stored = msgspec.structs.replace(sale, first_draw=first)
            close_ms = game.calendar.close_ms(first)
            expire_at = game.expire_at(first + sale.draws - 1)
            if claim is None:
                claim = await (
                    self._sell_in_one_call(game, key, p.record, stored, expire_at, judged)
                    if p.one_call else
                    self._claim(game, key, stored, close_ms, expire_at))
            raw = claim.sale if isinstance(claim, Decided | Pending | Refused) else None
            held = None if raw is None else unpack_sale(raw)  # the sale the id holds
            if held is not None and _another_request(held, sale_fingerprint(sale)):
                raise _conflict(t.ticket_id)
            if isinstance(claim, Refused):
                if claim.why == "day":  # judged on another day than planned: plan again,
                    judged = claim.at  # for the day of Redis's instant
                    claim = None
                    continue
                if claim.why == "stale":
                    raise unavailable(f"ticket {t.ticket_id} is being settled after an "
                                      "interrupted sale; retry shortly",
                                      self.settings.retry_after_s)
                if not defaulted:  # closed by the calendar
                    raise _closed(first)
                first = max(first + 1, game.calendar.current(self.clock.now()))
                claim = None
                continue
            step = await self._after(channel, game, key, stored, expire_at, claim, held)
            claim = None
            if isinstance(step, SaleOutcome):
                return step
            if isinstance(step, Stop):
                if not defaulted or step.offset > 0:
                    raise _closed(first + step.offset)
                # On to the next draw that is neither past nor stopped (one read, however
                # many draws in a row an admin stopped).
                first = max(first + 1, await self.draws.current_draw(game))
        raise unavailable(f"ticket {t.ticket_id} could not be settled; retry shortly",
                          self.settings.retry_after_s)

    async def _after(self, channel: Channel, game: Game, key: str, sale: Sale, expire_at: int,
                     claim: Sold | Decided | Claimed | Pending | StoppedAt, held: Sale | None
                     ) -> Step:
        """What a first call's reply leads to: the answer, or a step to take again. `held`:
        the sale a known ticket id holds (a Decided's or a Pending's, unpacked)."""
        match claim:
            case Sold():  # decided in that same call
                body, verdict = render(channel.id, sale, claim.sale_id, claim.at,
                                       claim.results)
                await self.journal.sale("answer", channel.id, sale, claim.sale_id, claim.at,
                                        body, expire_at, claim.caps, claim.results)
                self.store.journaled_sale(claim)
                return SaleOutcome(body=body, replayed=False, verdict=verdict,
                                   near_cap=claim.near_cap, sold_out=claim.sold_out,
                                   shadowed=claim.shadowed)
            case Decided():
                assert held is not None
                if self._may_have_lost_counters(claim.state, claim.body):
                    assert claim.body is not None
                    await self._still_counted(game, held, claim.sale_id, claim.body)
                body = claim.body or derived_body(channel.id, held, claim.sale_id, claim.at,
                                                   claim.results)
                record = TicketRecord(claim.state, claim.body, claim.sale, claim.sale_id,
                                      claim.at, claim.cancelled_at, claim.released,
                                      claim.results)
                await self._journaled(key, claim.sale_id, claim.state,
                                      self._journal_stored("replay", channel.id, record, held,
                                                           body))
                return SaleOutcome(body=body, replayed=True)
            case Claimed():
                return await self._decide(channel, game, key, sale, claim.sale_id, claim.at,
                                          game.calendar.close_ms(sale.first_draw or 0))
            case Pending():
                # A retry, or a concurrent duplicate: re-running the steps returns what
                # they recorded. Whichever request of the sale writes the decision answers
                # it first (the claim's own request or not); the others find it written
                # and answer it as a replay.
                assert held is not None
                assert held.first_draw is not None
                return await self._decide(channel, game, key, held, claim.sale_id, claim.at,
                                          game.calendar.close_ms(held.first_draw))
            case StoppedAt():
                return Stop(claim.offset)

    async def _claim(self, game: Game, key: str, sale: Sale, close_ms: int, expire_at: int
                     ) -> Claim:
        """The steps' first call: the ticket indexed for the janitor and claimed, in one
        atomic call. The claim is the only write that decides; admin stops are checked once
        it has been made."""
        return await self.store.claim(key, pack_sale(sale), close_ms, expire_at,
                                      self.stale_after_ms)

    async def _sell_in_one_call(self, game: Game, key: str, record: tuple[str, str],
                                sale: Sale, expire_at: int, judged: int = 0) -> Claim:
        """The sale as one atomic call (standalone Redis), alone: a ticket whose first call
        moved it on (a draw closed or stopped, a day planned wrongly: `judged`, Redis's
        instant then, which the player's budget is planned for at least)."""
        assert sale.first_draw is not None
        call, fix = self._sale_call(game, key, record, sale, expire_at, {}, judged=judged)
        [claim] = await self.store.sell([call])
        self._fixed(game, sale.first_draw, fix, claim)
        return claim

    def _sale_call(self, game: Game, key: str, record: tuple[str, str], sale: Sale,
                   expire_at: int, shapes: dict[tuple[str, int, int, bool], tuple[Shape, bool]],
                   request: int = 0, judged: int = 0) -> tuple[SaleCall, bool]:
        """A one-call sale's part of a call of capsvc_sell, and whether it fixes its draws'
        caps: the draws' caps when this process has seen them fixed; else the configured
        cap, which the call fixes on the draws no sale has fixed yet, once nothing refused
        the sale, judging each draw by its own (lua/capsvc.lua, CAPS). What the sales of
        its game and draws share (`shapes`) is built once a batch."""
        rules = game.rules
        first = sale.first_draw
        assert first is not None
        capped = any(g.capped for g in sale.grids)
        made = shapes.get((rules.id, first, sale.draws, capped))
        if made is None:
            known = self.steps.caps.known(game, first, sale.draws) if capped else None
            fix = capped and known is None
            caps = known or [rules.cap_limit or 0]
            made = shapes[(rules.id, first, sale.draws, capped)] = (self.store.shape(
                rules.id, first, sale.draws, game.calendar.close_ms(first), expire_at,
                self.stale_after_ms, caps_argument(caps, rules.shadow_cap_limit), caps,
                rules.min_stake, rules.time_zone, fix, game.expiries(first, sale.draws)), fix)
        shape, fix = made
        return self.store.sale_call(
            shape, key, record, pack_sale(sale),
            [(g.combo if g.capped else f"\0{len(g.numbers)}", g.stake) for g in sale.grids],
            request, sale.asked, self._budget(game, key, sale, expire_at, judged)), fix

    def _budget(self, game: Game, key: str, sale: Sale, expire_at: int, judged: int = 0
                ) -> tuple[list[str], list[Any]] | None:
        """The player's budget in a one-call sale (a game with a daily limit), planned for
        the purchase day of Redis's time as this process estimates it (lua/capsvc.lua,
        `budget_of`: a sale judged on another day is planned again). It leaves what the
        ledger's steps leave (capsvc.domain.decisions, `budget_plan`)."""
        rules = game.rules
        if rules.daily_limit is None or sale.player_id is None:
            return None
        assert sale.first_draw is not None
        now = max(self.clock.now(), judged)
        day = game.calendar.local_day(now)
        if rules.subscription_accounting == "purchase_day":
            days = [(day[0], sale.draws)]
        else:
            days = list(collections.Counter(
                game.calendar.local_days(sale.first_draw, sale.draws)).items())
        return budget_call(sale.player_id, budget_ref(channel_of(key), sale.ticket_id, ""),
                           rules.daily_limit, budget_until(expire_at, now), day,
                           sale.joker_cost // sale.draws, days,
                           [g.cost // sale.draws for g in sale.grids])

    def _fixed(self, game: Game, first: int, fix: bool, claim: Claim) -> None:
        """Remember the caps a sale's call fixed (or found fixed) on its draws."""
        if fix and isinstance(claim, Sold) and claim.caps is not None:
            self.steps.caps.remember(game, first, claim.caps)

    async def _decide(self, channel: Channel, game: Game, key: str, sale: Sale, sale_id: str,
                      at: int, close_ms: int) -> Step:
        """Take the player's budget (games with a daily limit), reserve every capped grid
        (concurrently), build the decision, write it back with the budget settled.

        The request whose step writes the decision (capsvc_finalize reports it) answers it
        first, and only that one counts it: the request that made the claim, or a duplicate
        or a retry resuming it. A request that finds the decision written by another (its
        finalize writes nothing) claims again and answers the stored decision as a replay.

        The admin stops are read again after the claim (with the first step, no extra
        round trip): a sale claimed once a draw of it was stopped does not stand, whatever
        its reserves did (they are given back)."""
        rules = game.rules
        assert sale.first_draw is not None
        first = sale.first_draw
        until = game.expire_at(first + sale.draws - 1)
        # Read with the first step; awaited by whichever check comes first, or by none when
        # a step fails (or the request is cancelled) before: its failure is retrieved then.
        stops = retrieving(self.store.stops(rules.id, first, sale.draws))
        plan = self.steps.plan(channel.id, game, sale, sale_id, at)
        taken = None if plan is None else await self.steps.take_budget(plan)
        if taken is not None and taken.kind == RELEASED:
            return AGAIN
        if taken is not None and (stop := await self._stopped(channel.id, game, key, sale,
                                                               sale_id, at, stops)):
            return stop
        if taken is not None and taken.kind != ACCEPTED:
            results = results_of(rules.time_zone, None)
            body, verdict = render(channel.id, sale, sale_id, at, results)
            if not await self.store.finalize(key, sale_id, body):
                return AGAIN
            await self._journaled(key, sale_id, b"f", self.journal.sale(
                "answer", channel.id, sale, sale_id, at, body, until, results=results))
            return SaleOutcome(body=body, replayed=False, verdict=verdict)
        if (taken is None and any(g.capped for g in sale.grids)
                and self.steps.caps.known(game, first, sale.draws) is None
                and (stop := await self._stopped(channel.id, game, key, sale, sale_id, at,
                                                 stops))):
            return stop  # a draw's cap is fixed by its first sale, not by a voided one
        replies = await self.steps.reserve_all(game, sale, sale_id, close_ms)
        if taken is None and (stop := await self._stopped(channel.id, game, key, sale,
                                                          sale_id, at, stops)):
            return stop
        kinds = {r.kind for r in replies if r is not None}
        if RELEASED in kinds:
            return AGAIN
        if CLOSED in kinds:
            # A draw closed while the sale ran. Other requests of this sale may be running:
            # conclude it as the janitor would, so that all of them reach the same end.
            concluded = await self.steps.conclude_or_void(channel.id, game, key, sale,
                                                          sale_id, at, "closed")
            if concluded is None:  # given back, its void journaled: nothing was answered
                raise _closed(first)
            body = concluded.body
            await self._journaled(key, sale_id, b"f", self.journal.sale(
                "answer" if concluded.written else "replay", channel.id, sale, sale_id, at,
                body, until, self.steps.caps.known(game, first, sale.draws)))
            return SaleOutcome(body=body, replayed=not concluded.written,
                               verdict=concluded.verdict if concluded.written else None)
        results = results_of(rules.time_zone, replies)
        body, verdict = render(channel.id, sale, sale_id, at, results)
        written = await self.steps.write_decision(game, key, sale, sale_id, plan, replies,
                                                  body)
        if written is None:  # decided (or forgotten) by another actor meanwhile: ask again
            return AGAIN
        await self._journaled(key, sale_id, b"f", self.journal.sale(
            "answer", channel.id, sale, sale_id, at, body, until,
            self.steps.caps.known(game, first, sale.draws), results))
        near_cap, sold_out = written
        return SaleOutcome(body=body, replayed=False, verdict=verdict, near_cap=near_cap,
                           sold_out=sold_out,
                           shadowed=sum(1 for r in replies
                                        if r is not None and r.kind == SHADOWED))

    async def _stopped(self, channel_id: str, game: Game, key: str, sale: Sale, sale_id: str,
                       at: int, stops: asyncio.Future[Any]) -> Stop | None:
        """A draw of the sale stopped at or before its claim: the sale voided (the
        epilogue), and where it stopped; None when no draw was."""
        stopped = first_stopped(stop_instants(await stops), at)
        if stopped is None:
            return None
        await self.steps.conclude_or_void(channel_id, game, key, sale, sale_id, at, "stopped")
        return Stop(stopped)

    async def _still_counted(self, game: Game, sale: Sale, sale_id: str, body: bytes
                             ) -> None:
        """Before a replay on Redis Cluster: every grid the decision accepted still has its
        record. A shard can lose writes the others keep (its primary and the replica that
        had not yet confirmed them both lost: a decision never confirmed, answered 503);
        the retry must not answer "accepted" for a stake no counter holds. The missing
        grids are counted again, under the same sale, against the cap; if one no longer
        fits, the decision cannot be answered (503, an error logged for the operator)."""
        decision, missing = await self._uncounted(game, sale, sale_id, body)
        if not missing:
            return
        assert sale.first_draw is not None
        lost = msgspec.structs.replace(
            sale, grids=[g for g in sale.grids if g.index in missing])
        replies = await self.steps.reserve_all(game, lost, sale_id,
                                                game.calendar.close_ms(sale.first_draw))
        if all(r is not None and r.accepted for r in replies):
            log.warning("ticket %s: %d accepted grid(s) had lost their counters in Redis "
                        "(a shard lost writes): counted again", decision.ticket_id,
                        len(missing))
            return
        log.error("ticket %s: %d accepted grid(s) lost their counters in Redis and no longer "
                  "fit the cap: the decision cannot be answered; cancel the ticket",
                  decision.ticket_id, len(missing))
        raise unavailable(f"ticket {decision.ticket_id}: its decision lost part of its "
                          "counters in a Redis failure and cannot be answered",
                          self.settings.retry_after_s)

    async def _journaled(self, key: str, sale_id: str, state: bytes | None,
                         record: asyncio.Future[None]) -> None:
        """Wait until a decision this request reports (of sale `sale_id`, the ticket in
        `state`) is journaled, then let the ticket's index entry go if the ticket is still
        so (until then the janitor would journal it, should this process die; a cancel
        unfinished, state k, stays the janitor's)."""
        await record
        if state in (b"f", b"c"):
            self.store.journaled_later(key, sale_id, state)

    def _journal_stored(self, via: Via, channel_id: str, record: TicketRecord, sale: Sale,
                        body: bytes) -> asyncio.Future[None]:
        """Journal a stored decision this process reports (a replay, a GET; `sale`: the
        record's, unpacked)."""
        if not self.journal.enabled:
            return self.journal.nothing()
        game = self.catalog.get(sale.game)
        assert sale.first_draw is not None
        last = sale.first_draw + sale.draws - 1
        until = game.expire_at(last) if game is not None else 0
        return self.journal.ticket(via, channel_id, sale, record.sale_id, record.at,
                                   bytes(body), until, record.state, record.cancelled_at,
                                   record.released, record.results)

    def _may_have_lost_counters(self, state: bytes | None, body: bytes | None
                                ) -> bool:
        """Whether a stored decision's counters may sit on other shards than it, and be
        lost apart from it: a sale in steps (a body, not results) on Redis Cluster, still
        standing (not being cancelled or cancelled)."""
        return body is not None and state == b"f" and not self.store.single_node

    async def _uncounted(self, game: Game, sale: Sale, sale_id: str, body: bytes
                         ) -> tuple[TicketOut, set[int]]:
        """A decision of `sale`, and the grids it accepted whose record is gone."""
        decision = _ticket_decoder.decode(body)
        accepted = {g.index for g in decision.grids if g.status == "accepted"}
        return decision, await self.steps.uncounted(game, sale, sale_id, accepted)

    # -- look up ---------------------------------------------------------------------------

    async def ticket(self, channel: Channel, ticket_id: str) -> bytes:
        """The stored decision, with `cancelled` once the ticket is cancelled."""
        require_scope(channel, "sell", "read")
        record = await self.store.ticket(ticket_key(channel.id, ticket_id))
        if record is None:
            raise not_found(f"ticket {ticket_id!r}")
        sale = unpack_sale(record.sale)
        game = self.catalog.get(sale.game)
        body = record.body
        lost = False
        if game is not None and body is not None and self._may_have_lost_counters(
                record.state, body):
            # A decision whose counters a shard lost is no decision to show: the POST sent
            # again counts them again (see _still_counted).
            _, missing = await self._uncounted(game, sale, record.sale_id, body)
            lost = bool(missing)
        if body is None and record.results is not None:
            body = derived_body(channel.id, sale, record.sale_id, record.at, record.results)
        if lost or body is None:
            raise ApiError("conflict", "ticket_pending",
                           f"ticket {ticket_id} has no decision yet: retry the POST with the "
                           "same body to complete it")
        await self._journal_stored("lookup", channel.id, record, sale, body)
        if record.cancelled_at is None:
            return bytes(body)
        tz = game.rules.tz if game is not None else UTC
        return with_cancellation(bytes(body), tz, record.cancelled_at, record.released or 0)

    # -- cancel ----------------------------------------------------------------------------

    async def cancel(self, channel: Channel, ticket_id: str, only_sale: str | None = None
                     ) -> CancelOut:
        """Decide the cancellation (first draw still open, by Redis TIME), then give back
        every grid and the budget. A cancel interrupted after the decision is finished by
        its retry, or by the janitor. `only_sale`: cancel only that sale of the ticket id (an
        audit's cancel of a ticket it read in the journal: the id may have been used again
        since)."""
        require_scope(channel, "sell")
        key = ticket_key(channel.id, ticket_id)
        record = await self.store.ticket(key)
        if record is None:
            raise not_found(f"ticket {ticket_id!r}")
        if only_sale is not None and record.sale_id != only_sale:
            raise _not_cancellable(
                f"ticket {ticket_id} now holds another sale than {only_sale}")
        if record.body is None and record.results is None:
            raise _not_cancellable(f"ticket {ticket_id} has no decision yet")
        sale = unpack_sale(record.sale)
        game = self.catalog.get(sale.game)
        if game is None:
            raise _not_cancellable(f"game {sale.game} is no longer served")
        body = record.body or derived_body(channel.id, sale, record.sale_id, record.at,
                                           record.results)
        decision = _ticket_decoder.decode(body)
        assert sale.first_draw is not None
        refusal = cancel_refusal(game.rules, sale, decision)
        if refusal and record.state == b"f":
            raise _not_cancellable(refusal)
        reply = await self.store.cancel(key, game.calendar.close_ms(sale.first_draw),
                                        sale.game, sale.first_draw, decision.total_cost,
                                        game.expire_at(sale.first_draw + sale.draws - 1))
        if not isinstance(reply, Cancelling):
            if reply.why == "closed":
                raise _not_cancellable(
                    f"draw {sale.first_draw} is closed: ticket {ticket_id} stands")
            if reply.why == "missing":
                raise not_found(f"ticket {ticket_id!r}")
            raise _not_cancellable(f"ticket {ticket_id} has no decision yet")
        if reply.state == b"k":
            await self.finish_cancel(channel.id, game, key, sale, record.sale_id, record.at,
                                     record.results is not None)
        await self._journaled(key, record.sale_id, b"c", self.journal.cancel(
            "answer" if reply.state == b"k" else "replay", channel.id, sale, record.sale_id,
            record.at, bytes(body), game.expire_at(sale.first_draw + sale.draws - 1),
            reply.at, reply.released))
        return CancelOut(ticket_id=ticket_id, status="cancelled", released=reply.released)

    async def finish_cancel(self, channel_id: str, game: Game, key: str, sale: Sale,
                            sale_id: str, at: int, one_call: bool | None = None) -> None:
        """Give back what a cancelled sale took, then mark the cancel complete (a ticket
        sold in one call, `one_call`, read from the ticket when None, is taken out of its
        draws' aggregates then)."""
        plan = self.steps.plan(channel_id, game, sale, sale_id, at)
        await self.steps.give_back(key, game, sale, sale_id, plan)
        if one_call is None:
            record = await self.store.ticket(key)
            one_call = record is not None and record.results is not None
        await self.store.cancelled(
            key, sale_id, self.steps.one_call_aggregates(key, game, sale) if one_call else None)


def _not_cancellable(message: str) -> ApiError:
    return ApiError("conflict", "not_cancellable", message)


def _another_request(held: Sale, fingerprint: str | None) -> bool:
    """Whether the sale a ticket id holds (its record's, unpacked) is another request's than
    the one of `fingerprint` (the record keeps no fingerprint: its sale's is worked out from
    what it keeps)."""
    return sale_fingerprint(held) != fingerprint


def _conflict(ticket_id: str) -> ApiError:
    return ApiError("conflict", "idempotency_conflict",
                    f"ticket {ticket_id} was already used with a different request",
                    "$.ticket_id")


def _closed(draw: int) -> ApiError:
    return rule_error("draw_closed", f"draw {draw} is closed for sales", "$.first_draw")
