"""A game's draws as the journal alone tells them: one decision per sale, its cancel, the
voids, the caps and stops, and the files it was read from with their digests.

Knows the journal's files and records (capsvc.journal), nothing of Redis or HTTP: what it
reads works after Redis's retention and on a copy of the files on another machine.

A decision reported several times (the answer, replays, GETs, by several processes) is
journaled several times: a sale is named by (channel, ticket id, sale id) and kept once;
its `cancel`, in whichever order the files hold them, takes it back. A `void` names a sale
that was never answered (released by the janitor, or claimed after an admin stop); a sale
with a decision is never a void.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from capsvc.client.models import TicketOut
from capsvc.client.reports import Source
from capsvc.domain.games import Game
from capsvc.journal.reader import FileCheck, read
from capsvc.journal.records import (
    CancelRecord,
    CapRecord,
    Line,
    Open,
    SaleRecord,
    StopRecord,
    VoidRecord,
)
from capsvc.journal.writer import journal_files

_decision = msgspec.json.Decoder(TicketOut).decode

SaleKey = tuple[str, str, str]
"""(channel, ticket id, sale id): one sale, however many times it was journaled."""

CLOCK_MARGIN_MS = 3_600_000
"""Files last written this long before a draw could first be sold are still read: their
modification time is the host's clock, the draws' instants are Redis's."""


@dataclass(slots=True)
class Sold:
    """One sale's decision as answered, and its cancellation if any."""

    record: SaleRecord
    decision: TicketOut
    cancel: CancelRecord | None = None
    at: tuple[str, int] = ("", 0)
    """Where the decision was first read: (file name, line)."""
    cancel_at: tuple[str, int] = ("", 0)
    """Where the cancel was first read."""

    @property
    def standing(self) -> bool:
        """Sold (accepted or partial) and not cancelled: a receipt stands for it."""
        return self.cancel is None and self.decision.status != "rejected"

    def plays(self, draw: int) -> bool:
        r = self.record
        return r.first_draw <= draw < r.first_draw + r.draws


@dataclass
class History:
    """What the journal holds of a game's draws `draws` (see the module's docstring)."""

    game: str
    draws: range
    sales: dict[SaleKey, Sold] = field(default_factory=dict)
    voids: dict[SaleKey, VoidRecord] = field(default_factory=dict)
    void_at: dict[SaleKey, tuple[str, int]] = field(default_factory=dict)
    """Where each void was first read: (file name, line)."""
    caps: dict[int, int] = field(default_factory=dict)
    """The cap in force on a draw, as the decisions (or a `cap` record) carry it."""
    stops: dict[int, int] = field(default_factory=dict)
    """An admin's stop of a draw: its instant (Redis ms)."""
    sources: list[Source] = field(default_factory=list)
    breaks: list[str] = field(default_factory=list)
    """Lines that do not chain (`capsvc journal verify` tells more)."""
    tails: list[str] = field(default_factory=list)
    """Torn last lines: what a crash leaves, not a break."""

    def of(self, draw: int) -> list[Sold]:
        """The decisions of the sales that play `draw`, in journal order."""
        return [s for s in self.sales.values() if s.plays(draw)]

    def voids_of(self, draw: int) -> list[VoidRecord]:
        return [v for k, v in self.voids.items()
                if k not in self.sales and v.first_draw <= draw < v.first_draw + v.draws]

    def where_void(self, void: VoidRecord) -> tuple[str, int]:
        return self.void_at.get((void.channel, void.ticket, void.sale), ("", 0))


def first_sale_ms(game: Game, draw: int) -> int:
    """The earliest instant a sale playing `draw` can have been made: a subscription of the
    longest duration ending on it, bought as far ahead as the sales horizon allows."""
    rules = game.rules
    earliest = draw - max(rules.durations) - rules.sales_horizon
    return game.calendar.close_ms(max(1, earliest)) if earliest >= 1 else 0


Spans = dict[str, tuple[int, dict[str, tuple[int, int]]]]
"""File path -> (its size when read, game -> the draws its records are about (first,
last + 1)): what a file read once holds, so that a later read of other draws skips it while
its size is the same (a journal file is only ever appended to)."""


def read_history(directories: Iterable[Path], game: Game, draws: range, *,
                 spans: Spans | None = None) -> History:
    """The journal's history of `game`'s `draws` from every file of `directories` that can
    hold a decision of them: last written after the first of the draws could be sold
    (files copied without their times are newer: read). `spans`: a cache of what files
    hold, filled and used."""
    out = History(game.rules.id, draws)
    since_s = (first_sale_ms(game, draws.start) - CLOCK_MARGIN_MS) / 1000
    for directory in directories:
        for path in journal_files(directory):
            try:
                stat = os.stat(path)
                if stat.st_mtime < since_s:
                    continue
                known = spans.get(str(path)) if spans is not None else None
                if known is not None and known[0] == stat.st_size:
                    held = known[1].get(game.rules.id)
                    if held is None or held[1] <= draws.start or held[0] >= draws.stop:
                        continue
                found = _read_file(out, directory, path)
            except FileNotFoundError:  # pruned meanwhile
                continue
            if spans is not None and found is not None:
                spans[str(path)] = (stat.st_size, found)
    return out


def _read_file(out: History, directory: Path, path: Path
               ) -> dict[str, tuple[int, int]] | None:
    """Read one file into `out`; the draws each game's records are about (None when the
    file is not whole: a torn tail may be completed later)."""
    game, lo, hi = out.game, out.draws.start, out.draws.stop
    held: dict[str, tuple[int, int]] = {}

    def wanted(head: Line) -> bool:
        """A record of this game about these draws (the others are not decoded)."""
        if head.game is None:
            return False
        if head.draw is not None:
            first, last = head.draw, head.draw + 1
        elif head.first_draw is not None:
            first, last = head.first_draw, head.first_draw + (head.draws or 0)
        else:  # a player's limit or stake: of no draw
            return False
        span = held.get(head.game)
        held[head.game] = (first, last) if span is None else (min(span[0], first),
                                                               max(span[1], last))
        return head.game == game and first < hi and last > lo

    check = FileCheck(path, digest=hashlib.sha256())
    proc = None
    name = path.name
    for n, record in read(path, check, wanted=wanted):
        if isinstance(record, Open):
            proc = record.proc
        elif isinstance(record, VoidRecord):
            key = (record.channel, record.ticket, record.sale)
            if key not in out.voids:
                out.voids[key] = record
                out.void_at[key] = (name, n)
        elif isinstance(record, SaleRecord):
            key = (record.channel, record.ticket, record.sale)
            sold = out.sales.get(key)
            if sold is None:
                sold = out.sales[key] = Sold(record, _decision(record.decision), at=(name, n))
                for i, cap in enumerate(record.caps or ()):
                    out.caps.setdefault(record.first_draw + i, cap)
            if isinstance(record, CancelRecord) and sold.cancel is None:
                sold.cancel = record
                sold.cancel_at = (name, n)
        elif isinstance(record, CapRecord):
            out.caps.setdefault(record.draw, record.cap)
        elif isinstance(record, StopRecord):
            out.stops[record.draw] = min(out.stops.get(record.draw, record.at), record.at)
    assert check.digest is not None
    out.sources.append(Source(str(directory), path.name, proc, check.digest.hexdigest(),
                              check.size, check.lines))
    out.breaks += [f"{path}: {b}" for b in check.breaks]
    if check.tail:
        out.tails.append(f"{path}: {check.tail}")
        return None
    return held
