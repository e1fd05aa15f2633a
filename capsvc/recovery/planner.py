"""What each journal record's restore calls for, planned from the record alone (no Redis):
the bulk ops of a sale, a cancel or a void (capsvc.redis.store, restore_sale and its kin), in this
process or, for a large journal, in processes of their own that read and decode the files
too (the part of a restore that takes Python the longest, out of the event loop's way).

Knows the records and what a restore does with each; the key names and op layouts are
capsvc.redis.store's, the order records are applied in capsvc.recovery.restore's.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
from collections import deque
from collections.abc import AsyncGenerator, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import msgspec

from capsvc.config import GameRules
from capsvc.domain.games import Catalog, Game
from capsvc.domain.validator import Sale, pack_sale
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
    line_decoder,
    sale_of,
    sold_sale,
)
from capsvc.journal.writer import journal_files
from capsvc.redis.store import (
    Op,
    record_field,
    restore_budget,
    restore_cancel,
    restore_count,
    restore_sale,
    restore_void,
    ticket_key,
    ticket_value,
)
from capsvc.service.caps import caps_argument
from capsvc.service.steps import SaleSteps, aggregate_value

CHUNK_BYTES = 4 * 1024 * 1024
"""How much of a journal file a planning process reads, decodes and plans at a time."""
POOL_BYTES = 64 * 1024 * 1024
"""Files to read larger than this (about 100,000 decisions) are planned in a process of
their own (`planners`)."""


class _Outcome(msgspec.Struct, gc=False):
    index: int
    status: str


class _Outcomes(msgspec.Struct, gc=False):
    grids: list[_Outcome]


_outcomes = msgspec.json.Decoder(_Outcomes).decode
"""A decision's grids, their index and status only (what a restore needs of a decision
it writes back byte for byte)."""


class Planned(msgspec.Struct, tag="planned", tag_field="type", gc=False, omit_defaults=True):
    """A sale, cancel or void, and the ops its restore calls for. Not tracked by the garbage
    collector: a restore holds thousands at a time."""

    kind: str
    """"sale", "cancel" or "void"."""
    channel: str
    ticket: str
    sale_id: str
    game: str
    first: int
    draws: int
    key: str
    """The ticket's name (capsvc.redis.store.ticket_key)."""
    sale: Sale
    accepted: tuple[int, ...]
    """The grids the decision accepted (none for a void)."""
    caps: tuple[int, ...]
    """The cap in force on each draw, as journaled (a sale's)."""
    step: Op
    """The ticket's op (capsvc_restore_tickets)."""
    counts: list[Op] = msgspec.field(default_factory=list)
    """A sale's accepted capped grids' ops (capsvc_restore_counts), in the grids' order."""
    counted: tuple[int, ...] = ()
    """The grids of `counts`."""
    budget: Op | None = None
    """The player budget's op (capsvc_restore_budgets): the sale's take and settle, or
    everything given back for a cancel or a void."""
    # What the restore learns as it goes (never carried between processes).
    code: str = ""
    """The ticket's op's answer (lua/capsvc.lua, restore_tickets)."""
    repeats: int = 0
    """The sale's records right after this one, reporting it again (not applied again)."""
    place: int = 0
    """The record's place in its window."""
    after: bool = False
    """A cancel of a sale its window holds: its ticket's op follows the sale's."""
    budgeted: bool = False
    """Whether its budget op went with the second round."""
    released: tuple[int, ...] = ()
    """A cancel's or a void's grids whose releases went with the second round."""
    fixing: Any = None
    """The calls fixing the draws' caps this sale fixes."""

    @property
    def gives_back(self) -> bool:
        """A cancel or a void: what the sale took is given back."""
        return self.kind != "sale"


Item = Planned | StopRecord | CapRecord | LimitRecord | StakeRecord
"""What a restore applies: a planned sale, cancel or void, or another record as it is."""


class Chunk(msgspec.Struct, gc=False):
    """What a planning process made of a piece of a file."""

    records: int
    """Records of decisions still retained."""
    skipped: int
    """Records of games no longer configured."""
    items: list[Item]


_chunk_decoder = msgspec.msgpack.Decoder(Chunk)
_chunk_encoder = msgspec.msgpack.Encoder()


class Planner:
    """Plans records (see the module's docstring) for the games of `catalog`, the records
    still retained at Redis TIME `now`."""

    def __init__(self, catalog: Catalog, now: int) -> None:
        self.catalog = catalog
        self.now = now
        self._expiries: dict[tuple[str, int], int] = {}

    def expire_at(self, game: Game, draw: int) -> int:
        """`game.expire_at(draw)`, remembered."""
        found = self._expiries.get((game.rules.id, draw))
        if found is None:
            found = self._expiries[(game.rules.id, draw)] = game.expire_at(draw)
        return found

    def chunk(self, lines: Iterable[Open | Record | SalesRecord]) -> Chunk:
        """The records still retained of `lines`, planned (a `sales` line's sales each
        a record)."""
        out = Chunk(0, 0, [])
        now = self.now
        for r in lines:
            if isinstance(r, Open) or r.until <= now:
                continue
            game = self.catalog.get(r.game)
            if isinstance(r, SalesRecord):
                for s in r.sales:
                    if r.until_of(s) > now:
                        out.records += 1
                        if game is None:
                            out.skipped += 1
                        else:
                            out.items.append(self._one_call(game, r, s))
                continue
            out.records += 1
            if game is None:
                out.skipped += 1
            else:
                out.items.append(self.plan(game, r))
        return out

    def plan(self, game: Game, r: Record) -> Item:
        """What restoring `r`, of `game`, calls for."""
        if not isinstance(r, SaleRecord | VoidRecord):
            return r
        sale = sale_of(r)
        key = ticket_key(r.channel, r.ticket)
        first, draws = r.first_draw, r.draws
        if isinstance(r, VoidRecord):
            return Planned("void", r.channel, r.ticket, r.sale, r.game, first, draws, key, sale,
                           (), (), restore_void(key, r.sale, self._given_back(sale, r)),
                           budget=self._budget(game, r.channel, r.sale, r.at, sale, None))
        accepted = tuple(g.index for g in _outcomes(r.decision).grids
                         if g.status == "accepted")
        packed = pack_sale(sale)
        body = bytes(r.decision)
        if isinstance(r, CancelRecord):
            step = restore_cancel(key, r.sale, r.until, ticket_value(
                r.until, b"k", r.at, r.sale, packed, body, r.cancelled_at, r.released),
                self._given_back(sale, r))
            return Planned("cancel", r.channel, r.ticket, r.sale, r.game, first, draws, key,
                           sale, accepted, (), step,
                           budget=self._budget(game, r.channel, r.sale, r.at, sale, None))
        return self._sale(game, r.channel, r.sale, r.at, r.until, r.caps, sale, accepted,
                          ticket_value(r.until, b"f", r.at, r.sale, packed, body),
                          one_call=False)

    def _one_call(self, game: Game, line: SalesRecord, s: SoldTicket) -> Planned:
        """A sale of a `sales` line put back as its call left it: its decision kept as
        results, its grids not capped added to its draws' totals by number of picks."""
        sale, at = sold_sale(line, s), line.at_of(s)
        until = line.until_of(s)
        record = ticket_value(until, b"f", at, s.sale, pack_sale(sale), None,
                              results=f"{line.zone}|{s.res}".encode())
        return self._sale(game, line.channel, s.sale, at, until, line.caps_of(s), sale,
                          s.accepted, record, one_call=True)

    def _sale(self, game: Game, channel: str, sale_id: str, at: int, until: int,
              caps: list[int] | None, sale: Sale, accepted: tuple[int, ...], record: bytes,
              *, one_call: bool) -> Planned:
        """A sale's decision (`record`, its ticket's value) and what its grids took."""
        rules = game.rules
        first, draws = sale.first_draw, sale.draws
        assert first is not None
        key = ticket_key(channel, sale.ticket_id)
        value = aggregate_value(sale, set(accepted)) if accepted else None
        step = restore_sale(
            key, sale_id, until, record,
            [(rules.id, d, value, self.expire_at(game, d)) for d in range(first, first + draws)]
            if value is not None else (), one_call=one_call)
        counted = tuple(g.index for g in sale.grids if g.capped and g.index in accepted)
        counts = []
        if counted:
            caps_arg = caps_argument(caps or [rules.cap_limit or 0], None)
            expiries = [self.expire_at(game, d) for d in range(first, first + draws)]
            counts = [restore_count(rules.id, g.combo, record_field(sale_id, g.index), g.stake,
                                    caps_arg, rules.min_stake, first, expiries)
                      for g in (sale.grids[i] for i in counted)]
        return Planned("sale", channel, sale.ticket_id, sale_id, rules.id, first, draws, key,
                       sale, accepted, tuple(caps or ()), step, counts, counted,
                       self._budget(game, channel, sale_id, at, sale, accepted))

    @staticmethod
    def _given_back(sale: Sale, r: SaleRecord | VoidRecord) -> list[tuple[str, int]]:
        """The aggregates a sale given back leaves (`SaleSteps.aggregates` with none accepted)."""
        if aggregate_value(sale, set()) is None:
            return []
        return [(r.game, d) for d in range(r.first_draw, r.first_draw + r.draws)]

    @staticmethod
    def _budget(game: Game, channel: str, sale_id: str, at: int, sale: Sale,
                accepted: tuple[int, ...] | None) -> Op | None:
        """The budget op of a sale (what its decision `accepted`: taken unless recorded,
        then settled) or of a cancel or a void (`accepted` None: all given back), as the
        ledger's steps make it."""
        if game.rules.daily_limit is None or sale.player_id is None:
            return None
        plan = SaleSteps.plan(channel, game, sale, sale_id, at)
        if plan is None:
            return None
        if accepted is None:
            return restore_budget(plan.player, plan.ref, plan.regulatory, plan.until, None,
                                  plan.shares(sale, set()), final=True, given_back=True)
        held = set(accepted)
        settle = plan.settlement(sale, held)
        take = plan.shares(sale, held) if held else None
        if take is None and settle is None:
            return None
        return restore_budget(plan.player, plan.ref, plan.regulatory, plan.until, take,
                              settle, final=not held)


# -- planning in processes of their own ---------------------------------------------------

_planner: Planner | None = None
"""A planning process's planner (set by `_start`)."""


def _start(games: dict[str, GameRules], now: int) -> None:
    global _planner
    _planner = Planner(Catalog(games), now)
    gc.disable()  # a piece's objects are freed by reference counting, none is cyclic


def _plan_piece(path: str, start: int, end: int) -> bytes:
    """In a planning process: the lines of `path` that start in [start, end), decoded and
    planned, as a Chunk (MessagePack). A last line without its newline (a torn tail) is
    passed over, as a line that is not a record."""
    assert _planner is not None
    with open(path, "rb") as f:
        if start:
            f.seek(start - 1)
            f.readline()  # the end of the line before: another piece's
        data = f.read(max(0, end - f.tell()))
        if data and not data.endswith(b"\n"):
            data += f.readline()
    lines = data.split(b"\n")
    lines.pop()  # after the last newline: nothing, or a torn tail
    return _chunk_encoder.encode(_planner.chunk(_decoded(lines)))


def _decoded(lines: list[bytes]) -> Iterator[Open | Record | SalesRecord]:
    decode = line_decoder.decode
    for line in lines:
        try:
            yield decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue


def planners() -> int:
    """How many planning processes a large restore starts: one a CPU this process may use
    beyond two (one for the restoring process, one for a Redis on the same host), so none on
    two CPUs. Each takes the next piece of the files as it is free; the restoring process
    takes their plans in journal order (`capsvc.recovery.restore` applies one ticket's, one
    key's records in that order). A plan handed over costs its planner about what planning
    it here costs (it is encoded, then decoded here), and the restoring process still spends
    ~22 µs a one-grid decision on what is left (windows, calls, replies), so more planners
    than the restoring process can take wait; on two CPUs, one of which Redis takes, a
    planner gains nothing (bench/restore.py with the real command: one-grid 21,457 against
    20,258 decisions a second with one, mixed 11,611 against 11,762)."""
    return max(0, len(os.sched_getaffinity(0)) - 2)


class PlanningFailed(Exception):
    """The planning processes could not be started, or died."""


def pieces(directory: Path, modified_since: float) -> list[tuple[str, int, int]]:
    """The directory's files last written at or after `modified_since` (host clock, s), in
    pieces of CHUNK_BYTES: (path, start, end)."""
    out = []
    for path in journal_files(directory):
        try:
            stat = os.stat(path)
        except FileNotFoundError:  # pruned meanwhile
            continue
        if stat.st_mtime >= modified_since:
            out += [(str(path), start, min(start + CHUNK_BYTES, stat.st_size))
                    for start in range(0, stat.st_size, CHUNK_BYTES)]
    return out


async def planned_in_processes(pieces: list[tuple[str, int, int]], catalog: Catalog,
                               now: int, workers: int) -> AsyncGenerator[Chunk, None]:
    """The pieces' chunks, in order, planned by `workers` processes of their own (started
    fresh, not forked: this process has threads), a few pieces ahead. Raises PlanningFailed
    when none can be started or one dies."""
    games = {gid: game.rules for gid, game in catalog.games.items()}
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start, initargs=(games, now))
    ahead: deque[Future[Any]] = deque()

    async def planned(piece: Future[Any]) -> Chunk:
        try:
            return _chunk_decoder.decode(await asyncio.wrap_future(piece))
        except BrokenProcessPool as e:
            raise PlanningFailed(str(e)) from e

    try:
        for piece in pieces:
            try:
                ahead.append(pool.submit(_plan_piece, *piece))
            except (OSError, RuntimeError) as e:  # no process could be started
                raise PlanningFailed(str(e)) from e
            if len(ahead) > 2 * workers:
                yield await planned(ahead.popleft())
        while ahead:
            yield await planned(ahead.popleft())
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
