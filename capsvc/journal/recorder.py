"""What the use-cases journal, in their own terms: a sale's decision, a cancel, a void, an
admin's stop, a draw's cap, a player's limit or stake.

Each method builds the record and queues it on the journal; the future it returns resolves
once the record is durable, and the use-case answers only then. With the journal off
(`[journal] enabled = false`) every method returns a future already resolved.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from capsvc.domain.validator import Sale
from capsvc.journal.records import (
    CancelRecord,
    CapRecord,
    Checkpoint,
    LimitRecord,
    Record,
    SaleRecord,
    SalesRecord,
    SoldTicket,
    StakeRecord,
    StopRecord,
    Via,
    VoidRecord,
    grids_of,
)
from capsvc.journal.writer import Journal
from capsvc.redis.marks import Marks
from capsvc.redis.replies import PlayerLimits

SaleDecision = tuple[Via, str, Sale, str, int, bytes, int, "list[int] | None",
                     "dict[str, int] | None", "bytes | None"]
"""A sale's decision as `Recorder.sale` takes it: via, channel, sale, sale id, instant,
body, until, caps; its stamp (`Recorder.stamp` of the request that made it); and its
results (capsvc.domain.decisions.results_of; a sale made in one call: lua/capsvc.lua, `sell`),
from which the body is rendered again on reading, when the caller has them."""


class Recorder:
    """Journals decisions for the use-cases (see the module's docstring)."""

    def __init__(self, journal: Journal | None, now: Callable[[], int]) -> None:
        self.journal = journal
        self.now = now
        """Redis TIME (ms), as the process's Redis clock tells it."""
        self.proc = journal.proc if journal is not None else ""
        self._done: asyncio.Future[None] | None = None
        self._checkpointed: dict[str, int] = {}
        self._tick: tuple[list[SaleDecision], asyncio.Future[None]] | None = None
        """First answers given to `sale` in this event-loop tick, and their future."""
        self.marks: Marks | None = None
        """The process's marks (capsvc.redis.marks), set by the service: what a record made
        outside a request is stamped with."""

    @property
    def enabled(self) -> bool:
        return self.journal is not None

    def nothing(self) -> asyncio.Future[None]:
        """A future already resolved: nothing to journal."""
        return self._resolved()

    def _resolved(self) -> asyncio.Future[None]:
        done = self._done
        if done is None:
            done = self._done = asyncio.get_running_loop().create_future()
            done.set_result(None)
        return done

    def sale(self, via: Via, channel: str, sale: Sale, sale_id: str, at: int, body: bytes,
             until: int, caps: list[int] | None = None, results: bytes | None = None
             ) -> asyncio.Future[None]:
        """A sale's decision (`body`: the answer, byte for byte; `results`: what renders
        it, when known, journaled instead of it, in one `sales` line with the others given
        in the same event-loop tick: sales decided apart, in steps, share a line too)."""
        decision: SaleDecision = (via, channel, sale, sale_id, at, body, until, caps,
                                  self.stamp(), results)
        if self.journal is None or results is None:
            return self.sales([decision])
        if self._tick is None:
            loop = asyncio.get_running_loop()
            self._tick = ([], loop.create_future())
            loop.call_soon(self._append_tick)
        self._tick[0].append(decision)
        return self._tick[1]

    def _append_tick(self) -> None:
        """Journal the tick's first answers together; their future follows the append's."""
        assert self._tick is not None
        decisions, out = self._tick
        self._tick = None
        try:
            appended = self.sales(decisions)
        except Exception as e:  # refused (its disk not keeping up): every caller is told,
            out.set_exception(e)  # none is left waiting
            return

        def settle(done: asyncio.Future[None]) -> None:
            if out.done():
                return
            if done.cancelled():
                out.cancel()
            elif (error := done.exception()) is not None:
                out.set_exception(error)
            else:
                out.set_result(None)
        appended.add_done_callback(settle)

    def sales(self, decisions: Sequence[SaleDecision]) -> asyncio.Future[None]:
        """Several sales' decisions, durable together: one future for them all. Those with
        results (every sale's first answer, whichever protocol made it; a replay or a
        look-up of one kept as results) are one `sales` line a channel, game and way they
        were reported (what they share once, each sale's own after: its instant too when it
        is not the line's), the others (a settlement, a decision kept as its body) a
        `sale` line each. A sale of a `sales` line leaves out what it shares with the line
        (SoldTicket): the line's first draw and `until`, one draw, its draws' caps when all
        are the line's `cap`."""
        journal = self.journal
        if journal is None:
            return self._resolved()
        records: list[Record | SalesRecord] = []
        lines: dict[tuple[Via, str, str, str], list[tuple[SaleDecision, str]]] = {}
        stamps: dict[tuple[Via, str, str, str], dict[str, int]] = {}
        # Each stamp merged once a line (a request's tickets share theirs); held here, so
        # that no id is another stamp's.
        merged: dict[tuple[tuple[Via, str, str, str], int], dict[str, int]] = {}
        for d in decisions:
            via, channel, sale, sale_id, at, body, until, caps, marks, results = d
            if results is None:
                capped = caps if caps is not None and any(g.capped for g in sale.grids) else None
                records.append(SaleRecord(
                    **self._ticket(via, channel, sale, sale_id, at, body, until, marks),
                    caps=capped))
                continue
            zone, _, res = results.decode().partition("|")
            key = (via, channel, sale.game, zone)
            lines.setdefault(key, []).append((d, res))
            stamp = stamps.setdefault(key, {})
            if marks is None:
                marks = self.stamp()
            if marks and (key, id(marks)) not in merged:
                merged[key, id(marks)] = marks
                for mark, g in marks.items():
                    if g > stamp.get(mark, 0):
                        stamp[mark] = g
        for key, made in lines.items():
            records.append(self._line(key, made, stamps[key] or None))
        return journal.append_many(records)

    def _line(self, key: tuple[Via, str, str, str], made: list[tuple[SaleDecision, str]],
              marks: dict[str, int] | None) -> SalesRecord:
        """The `sales` line of sales `made` (of one way, channel, game and time zone; each
        with its grids' results)."""
        via, channel, game, zone = key
        line_at = made[0][0][4]
        first = last = until = cap = 0
        ends: dict[int, int] = {}  # a last draw: the until of the first sale ending there
        for (_, _, sale, _, _, _, until_, caps, _, _), _ in made:
            assert sale.first_draw is not None
            first = min(first, sale.first_draw) if first else sale.first_draw
            last = max(last, sale.first_draw + sale.draws)
            until = max(until, until_)
            ends.setdefault(sale.first_draw + sale.draws - 1, until_)
            if not cap and caps:
                cap = caps[0]
        untils = ([ends.get(d) for d in range(first, last)]
                  if len(set(ends.values())) > 1 else None)
        sold = []
        for (_, _, sale, sale_id, at, _, until_, caps, _, _), res in made:
            assert sale.first_draw is not None
            own_caps = None
            if any(g.capped for g in sale.grids):
                if not caps:
                    own_caps = []
                elif any(c != cap for c in caps):
                    own_caps = caps
            sold.append(SoldTicket(
                sale.ticket_id, sale_id, grids_of(sale), res,
                0 if sale.first_draw == first else sale.first_draw, sale.draws,
                0 if until_ == (until if untils is None else
                                untils[sale.first_draw + sale.draws - 1 - first])
                else until_, own_caps, sale.player_id,
                sale.joker_plus, sale.joker_cost, sale.asked, None if at == line_at else at))
        return SalesRecord(at=line_at, via=via, proc=self.proc, channel=channel, game=game,
                           first_draw=first, draws=last - first, until=until, zone=zone,
                           sales=sold, cap=cap or None, untils=untils, marks=marks)

    def cancel(self, via: Via, channel: str, sale: Sale, sale_id: str, at: int, body: bytes,
               until: int, cancelled_at: int, released: int) -> asyncio.Future[None]:
        journal = self.journal
        if journal is None:
            return self._resolved()
        return journal.append(CancelRecord(
            **self._ticket(via, channel, sale, sale_id, at, body, until),
            cancelled_at=cancelled_at, released=released))

    def _ticket(self, via: Via, channel: str, sale: Sale, sale_id: str, at: int, body: bytes,
                until: int, marks: dict[str, int] | None = None) -> dict[str, Any]:
        """The fields a sale's and a cancel's records share: the ticket and its decision;
        `marks`: its stamp (default: `stamp`)."""
        assert sale.first_draw is not None
        return {"at": at, "via": via, "proc": self.proc, "channel": channel,
                "ticket": sale.ticket_id, "sale": sale_id, "game": sale.game,
                "first_draw": sale.first_draw, "draws": sale.draws, "asked": sale.asked,
                "until": until, "grids": grids_of(sale), "decision": msgspec.Raw(body),
                "player": sale.player_id, "joker_plus": sale.joker_plus,
                "joker_cost": sale.joker_cost,
                "marks": self.stamp() if marks is None else marks}

    def ticket(self, via: Via, channel: str, sale: Sale, sale_id: str, at: int,
               body: bytes, until: int, state: bytes | None, cancelled_at: Any,
               released: Any, results: bytes | None = None) -> asyncio.Future[None]:
        """A stored decision reported again (a replay, a GET): as a cancel once the ticket
        is cancelled or being cancelled, else as a sale (its `results` when Redis keeps
        them: put back in the form it is kept in)."""
        if self.journal is None:
            return self._resolved()
        if state in (b"k", b"c") and cancelled_at is not None:
            return self.cancel(via, channel, sale, sale_id, at, body, until,
                               int(cancelled_at), int(released or 0))
        return self.sale(via, channel, sale, sale_id, at, body, until, results=results)

    def void(self, why: Any, channel: str, sale: Sale, sale_id: str, at: int, until: int
             ) -> asyncio.Future[None]:
        journal = self.journal
        if journal is None:
            return self._resolved()
        assert sale.first_draw is not None
        return journal.append(VoidRecord(
            at=at, why=why, proc=self.proc, channel=channel, ticket=sale.ticket_id,
            sale=sale_id, game=sale.game, first_draw=sale.first_draw, draws=sale.draws,
            until=until, grids=grids_of(sale), player=sale.player_id, marks=self.stamp()))

    def stop(self, channel: str, game: str, draw: int, at: int, until: int
             ) -> asyncio.Future[None]:
        journal = self.journal
        if journal is None:
            return self._resolved()
        return journal.append(StopRecord(at=at, proc=self.proc, channel=channel, game=game,
                                         draw=draw, until=until, marks=self.stamp()))

    def cap(self, game: str, draw: int, cap: int, until: int) -> None:
        """A draw's cap, first learnt by this process (nobody waits for it: the decisions
        judged by it carry it too, in the same batch or a later one)."""
        if self.journal is not None:
            self.journal.note(CapRecord(at=self.now(), proc=self.proc, game=game, draw=draw,
                                        cap=cap, until=until, marks=self.stamp()))

    def limit(self, channel: str, player: str, game: str, daily: int | None, at: int,
              until: int, limits: PlayerLimits) -> asyncio.Future[None]:
        """A self-limit set; `limits`: what Redis holds now."""
        journal = self.journal
        if journal is None:
            return self._resolved()
        return journal.append(LimitRecord(
            at=at, proc=self.proc, channel=channel, player=player, game=game, daily=daily,
            until=until, limit=limits.own, next=limits.pending,
            next_none=limits.pending_removal, from_day=limits.pending_from,
            marks=self.stamp()))

    def stake(self, channel: str, player: str, game: str, ref: str, amount: int, day: str,
              accepted: bool, remaining: int, at: int, until: int) -> asyncio.Future[None]:
        journal = self.journal
        if journal is None:
            return self._resolved()
        return journal.append(StakeRecord(
            at=at, via="answer", proc=self.proc, channel=channel, player=player, game=game,
            ref=ref, amount=amount, day=day, status="accepted" if accepted else "rejected",
            remaining=remaining, until=until, marks=self.stamp()))

    def stamp(self) -> dict[str, int] | None:
        """A record's stamp: the G of the current request's marked calls; outside a request
        (a background task), all that the process has written through its marks so far —
        no lower than the calls that made the record, so a restore that must put the record
        back finds it stamped above the Redis's mark."""
        current = Marks.current()
        if current is not None or self.marks is None:
            return current
        return dict(self.marks.made)

    def checkpoint(self, made: dict[str, int]) -> None:
        """Write down what this process has written through each mark (`made`, capsvc.redis.marks),
        if that moved since the last checkpoint: a restore reads no further back than the
        newest checkpoint Redis covers (capsvc.journal.lives)."""
        journal = self.journal
        if journal is not None and made != self._checkpointed:
            self._checkpointed = dict(made)
            journal.note(Checkpoint(life=journal.life, made=self._checkpointed))
