"""The journal's restore one record at a time: each record re-applied through the single
functions of lua/capsvc.lua's RESTORE part (restore_ticket, restore_grid, restore_limit)
and the sale's steps, in journal order, a round trip per step. What the restore did before
it applied records in bulk; the tests compare the bulk restore against it, key by key."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from capsvc.client.models import TicketOut
from capsvc.domain.decisions import ACCEPTED, accepted_grids
from capsvc.domain.games import Catalog, Game
from capsvc.domain.validator import Sale, pack_sale
from capsvc.journal.recorder import Recorder
from capsvc.journal.records import (
    CancelRecord,
    CapRecord,
    LimitRecord,
    Open,
    Record,
    SaleRecord,
    SalesRecord,
    SoldTicket,
    StakeRecord,
    StopRecord,
    VoidRecord,
    sale_of,
)
from capsvc.recovery.restore import Restored
from capsvc.redis.store import (
    Store,
    bucket_keys,
    pending_key_of,
    record_field,
    replies_of,
    ticket_key,
)
from capsvc.service.caps import DrawCaps, caps_argument
from capsvc.service.steps import SaleSteps

_decision = msgspec.json.Decoder(TicketOut).decode


class OneByOne:
    """Re-applies records one at a time (see the module's docstring)."""

    def __init__(self, catalog: Catalog, store: Store) -> None:
        self.catalog = catalog
        self.store = store
        self.caps = DrawCaps(store)
        self.steps = SaleSteps(store, self.caps, Recorder(None, lambda: 0))
        self._caps_fixed: set[tuple[str, int]] = set()

    async def restore(self, records: Iterable[Open | Record | SalesRecord]) -> Restored:
        out = Restored()
        now = await self.store.time_ms()
        for r in records:
            if isinstance(r, Open) or r.until <= now:
                continue
            for one in (r.sales if isinstance(r, SalesRecord) else [r]):
                if (r.until_of(one) if isinstance(one, SoldTicket) else one.until) <= now:
                    continue
                out.records += 1
                if isinstance(one, SoldTicket):
                    assert isinstance(r, SalesRecord)
                    kind = await self._one_call(r, one, out)
                else:
                    kind = await self.apply(one, now, out)
                if kind:
                    out.count(kind)
        return out

    def _restore_ticket(self, ticket: str, sale_id: str, at: int,
                        sale: bytes, body: bytes, expire_at: int,
                        cancelled_at: int | None = None, released: int = 0,
                        results: bytes = b"") -> Any:
        keys, args = self.store.names(ticket)
        return self.store.fcall("capsvc_restore_ticket", keys, [
            *args, sale_id, at, sale, body, expire_at,
            "" if cancelled_at is None else cancelled_at, released, results])

    async def _one_call(self, line: SalesRecord, s: SoldTicket, out: Restored) -> str | None:
        """A sale of a `sales` line: its ticket kept as results, and, when the ticket is
        written, its grids not capped added to its draws' totals by number of picks (plain
        commands, one at a time)."""
        game = self.catalog.get(line.game)
        if game is None:
            out.skipped += 1
            return None
        accepted = set(s.accepted)
        record = SaleRecord(at=line.at_of(s), via=line.via, proc=line.proc, channel=line.channel,
                            ticket=s.ticket, sale=s.sale, game=line.game,
                            first_draw=line.first_of(s), draws=s.draws, asked=s.asked,
                            until=line.until_of(s), grids=s.grids, decision=msgspec.Raw(b""),
                            player=s.player, joker_plus=s.joker_plus, joker_cost=s.joker_cost,
                            caps=line.caps_of(s))
        return await self._sale(game, record, out, accepted,
                                f"{line.zone}|{s.res}".encode())

    async def _totals(self, key: str, game: Game, sale: Sale, sale_id: str) -> None:
        """A ticket whose decision is kept as results added to its draws' totals by number
        of picks (SaleSteps.one_call_aggregates: every grid not capped is accepted), in
        place of the share its claim may have written (sold in steps)."""
        totals = self.steps.one_call_aggregates(key, game, sale)
        if totals is None:
            return
        names, pairs = totals
        submit = self.store.redis.submit
        first = sale.first_draw
        assert first is not None
        for d, name in enumerate(names, first):
            await submit("HDEL", name, sale_id)
            for i in range(0, len(pairs), 2):
                await submit("HINCRBY", name, pairs[i], pairs[i + 1])
            if await submit("PEXPIRETIME", name) < game.expire_at(d):
                await submit("PEXPIREAT", name, game.expire_at(d))

    def _restore_grid(self, game: str, combo: str, record: bytes, stake: int,
                      caps: str | int, min_stake: int, first_draw: int,
                      expire_at: list[int]) -> Any:
        keys = bucket_keys(game, combo, first_draw, len(expire_at))
        return self.store.fcall("capsvc_restore_grid", keys,
                                [record, combo, stake, caps, min_stake, *expire_at])

    async def apply(self, r: Record, now: int, out: Restored) -> str | None:
        game = self.catalog.get(r.game)
        if game is None:
            out.skipped += 1
            return None
        if isinstance(r, CancelRecord):
            return await self._cancel(game, r, now)
        if isinstance(r, SaleRecord):
            return await self._sale(game, r, out)
        if isinstance(r, VoidRecord):
            return await self._void(game, r)
        if isinstance(r, StopRecord):
            stops = await self.store.stops(r.game, r.draw, 1)
            if stops[0] is not None:
                return None
            await self.store.stop(r.game, r.draw, r.until, r.at)
            return "stop"
        if isinstance(r, CapRecord):
            before = await self.store.fix_cap(r.game, r.draw, r.cap, r.until)
            return "cap" if before is None else None
        if isinstance(r, LimitRecord):
            pending = "none" if r.next_none else (None if r.next is None else str(r.next))
            written = await self.steps.players.restore_limit(
                r.player, r.at, r.limit, pending, r.from_day, r.until)
            return "limit" if written else None
        if isinstance(r, StakeRecord):
            if r.status != "accepted":
                return None
            reply = await self.steps.players.reserve(
                r.player, f"x/{r.channel}/{r.ref}", game.rules.daily_limit or 0, r.until,
                [(r.day, r.amount)], restore=True)
            return "stake" if reply.restored else None
        return None

    async def _sale(self, game: Game, r: SaleRecord, out: Restored,
                    accepted: set[int] | None = None, results: bytes = b"") -> str | None:
        """A sale's decision: its body (`r.decision`), or its `results` and `accepted`
        grids (sold in one call)."""
        sale = sale_of(r)
        key = ticket_key(r.channel, r.ticket)
        written = await self._restore_ticket(key, r.sale, r.at, pack_sale(sale),
                                             bytes(r.decision), r.until, results=results)
        kind = written[0]
        if kind == b"cancelled":
            return None
        if kind == b"other":
            out.other_sale += 1
        put_back = kind == b"written"
        if accepted is None:
            accepted = accepted_grids(_decision(r.decision))
        grids = [g for g in sale.grids if g.capped and g.index in accepted]
        caps = caps_argument(r.caps or [game.rules.cap_limit or 0], None)
        calls: list[Any] = [
            self._restore_grid(r.game, g.combo, record_field(r.sale, g.index), g.stake,
                               caps, game.rules.min_stake, r.first_draw,
                               game.expiries(r.first_draw, r.draws))
            for g in grids]
        fixing = [(r.first_draw + i, cap) for i, cap in enumerate(r.caps or ())
                  if (r.game, r.first_draw + i) not in self._caps_fixed]
        self._caps_fixed.update((r.game, d) for d, _ in fixing)
        calls += [self.store.fix_cap(r.game, d, cap, game.expire_at(d)) for d, cap in fixing]
        plan = self.steps.plan(r.channel, game, sale, r.sale, r.at)
        taking = plan is not None and bool(accepted)
        if plan is not None and accepted:
            calls.append(self.steps.players.reserve(
                plan.player, plan.ref, plan.regulatory, plan.until,
                plan.shares(sale, accepted), restore=True))
        if kind == b"written" and accepted and results:
            await self._totals(key, game, sale, r.sale)
        elif kind == b"written" and accepted:
            calls += self.steps.aggregates(key, game, sale, r.sale, accepted)
        replies = await replies_of(calls)
        n = len(grids)
        put_back = put_back or any(f is None for f in replies[n:n + len(fixing)])
        if taking:
            put_back = put_back or replies[n + len(fixing)].restored
        if plan is not None:
            settled = self.steps.settle_budget(plan, sale, accepted)
            if settled is not None and int(await settled):
                put_back = True
        marks = []
        for g, reply in zip(grids, replies[:n], strict=True):
            if reply[0] != ACCEPTED:  # capsvc_restore_grid's reply, as the Lua gives it
                continue
            put_back = True
            out.grids += 1
            out.over_cap += int(reply[1])
            marks += [self.store.mark_sold_out(r.game, r.first_draw + int(o), g.combo,
                                               game.expire_at(r.first_draw + int(o)))
                      for o in reply[2:]]
        if marks:
            await replies_of(marks)
        return "sale" if put_back else None

    async def _index(self, key: str, until: int) -> None:
        """The ticket in its pending index at Redis TIME unless it is there, the index kept
        until `until` at least (as a claim indexes it)."""
        pending, redis = pending_key_of(key), self.store.redis
        await redis.call("ZADD", pending, "NX", await self.store.time_ms(), key)
        if await redis.call("PEXPIRETIME", pending) < until:
            await redis.call("PEXPIREAT", pending, until)

    async def _cancel(self, game: Game, r: CancelRecord, now: int) -> str | None:
        sale = sale_of(r)
        key = ticket_key(r.channel, r.ticket)
        record = await self.store.ticket(key)
        state, sid = (None, None) if record is None else (record.state, record.sale_id)
        ours = state is None or sid == r.sale
        cancelling: list[Any] | None = None
        if ours and state != b"c":
            await self._index(key, r.until)
            reply = await self._restore_ticket(key, r.sale, r.at,
                                               pack_sale(sale),
                                               bytes(r.decision), r.until,
                                               r.cancelled_at, r.released)
            cancelling = reply if reply[0] == b"cancelling" else None
        given = await self._give_back(key, game, sale, r.sale, r.channel, r.at)
        if cancelling is not None:
            one_call = self.steps.one_call_aggregates(key, game, sale) if cancelling[1] else None
            await self.store.cancelled(key, r.sale, one_call)
        if cancelling is not None or (ours and state == b"c"):
            await self.store.unindex(key)
        return "cancel" if cancelling is not None or given else None

    async def _void(self, game: Game, r: VoidRecord) -> str | None:
        sale = sale_of(r)
        key = ticket_key(r.channel, r.ticket)
        record = await self.store.ticket(key)
        state, sid = (None, None) if record is None else (record.state, record.sale_id)
        if state is not None and (sid != r.sale or state not in (b"p", b"x")):
            return None
        given = await self._give_back(key, game, sale, r.sale, r.channel, r.at)
        if state is not None:
            await self.store.unclaim(key, r.sale)
        return "void" if given or state is not None else None

    async def _give_back(self, key: str, game: Game, sale: Sale, sale_id: str, channel: str,
                         at: int) -> int:
        """Everything a sale took given back, its budget sealed first if it took nothing
        yet (its take, put back later, charges nothing)."""
        plan = self.steps.plan(channel, game, sale, sale_id, at)
        if plan is not None:
            await self.steps.players.reserve(plan.player, plan.ref, plan.regulatory,
                                             plan.until, plan.shares(sale, set()), seal=True)
        return await self.steps.give_back(key, game, sale, sale_id, plan)
