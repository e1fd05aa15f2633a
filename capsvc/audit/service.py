"""The audit use-cases: a draw's report, its reconciliation with the sales system, the
abandoned tickets cancelled, and the reports the service writes by itself.

Wires the pure parts (capsvc.audit.history, report, reconcile) to Redis for what only the
live state can tell: Redis TIME, the counters of a draw still retained (is the journal read
complete?), the tickets another host decided, and cancellations (through the tickets
use-case, so that each is journaled before it is reported). Nothing of HTTP.

Journal reads run in a worker thread, one at a time per process: a report of a draw reads
every file that can hold its decisions, which must not hold the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from capsvc.audit.history import History, Spans, read_history
from capsvc.audit.reconcile import (
    ExportLine,
    Known,
    Reconciliation,
    read_export,
    reconcile,
    unknown,
)
from capsvc.audit.report import build, capped_totals, to_csv, to_json
from capsvc.client.reports import DrawReport, RedisCheck
from capsvc.config import Channel, Settings
from capsvc.domain import combination
from capsvc.domain.calendar import instant
from capsvc.domain.decisions import derived_body
from capsvc.domain.errors import ApiError
from capsvc.domain.games import Catalog, Game
from capsvc.domain.validator import unpack_sale
from capsvc.journal.recorder import Recorder
from capsvc.journal.ship import shipped_until
from capsvc.journal.verify import opened_at
from capsvc.journal.writer import journal_files
from capsvc.redis.clock import RedisClock
from capsvc.redis.store import Store, replies_of, stop_instants, ticket_key
from capsvc.service.exposure import Exposure
from capsvc.service.tickets import Tickets

log = logging.getLogger(__name__)

_report = msgspec.json.Decoder(DrawReport).decode
REPORTS = "reports"
"""Under the journal directory: reports/<game>/<draw>.json and .csv."""
BATCH = 50
"""Draws reported from one read of the journal at most."""
LIVE_CACHE_S = 10.0
"""A report built on demand (no report written yet) is served again this long."""
DIFFERENCES_SHOWN = 50
"""A Redis check names this many differing counters at most (and counts the rest)."""


def _ignore(*args: object) -> None:
    pass


def settle_ms(settings: Settings) -> int:
    """How long after a claim the janitor has settled the sale, if interrupted."""
    return settings.pending_deadline_ms + 2 * settings.janitor_interval_ms


def due_ms(settings: Settings, game: Game, draw: int) -> int:
    """When a draw's decisions are all made: its close (the last cancel of a ticket playing
    it; the last claim) plus the time the janitor takes to settle a sale interrupted then."""
    return game.calendar.close_ms(draw) + settle_ms(settings)


class Audit:
    """See the module's docstring."""

    def __init__(self, settings: Settings, catalog: Catalog, store: Store, clock: RedisClock,
                 exposure: Exposure, tickets: Tickets, recorder: Recorder) -> None:
        self.settings = settings
        self.catalog = catalog
        self.store = store
        self.clock = clock
        self.exposure = exposure
        self.tickets = tickets
        self.recorder = recorder
        self.directory = Path(settings.journal_dir)
        self.sources = [self.directory, *map(Path, settings.audit_sources)]
        self.on_reconciled: Callable[[Reconciliation], None] = _ignore
        """Told of every reconciliation (the metrics)."""
        self.on_report: Callable[[str, bool], None] = _ignore
        """Told of every report written: (game, passed a cap or read a broken chain)."""
        self._reading = asyncio.Lock()
        self._spans: Spans = {}
        """What the journal files read so far hold (see capsvc.audit.history)."""
        self._next: dict[str, int] = {}
        """Per game, the first draw whose report may not be written yet."""
        self._live: dict[tuple[str, int], tuple[float, DrawReport]] = {}

    # -- reading the journal ---------------------------------------------------------------

    async def history(self, game: Game, draws: range) -> History:
        async with self._reading:
            return await asyncio.to_thread(read_history, self.sources, game, draws,
                                           spans=self._spans)

    async def last_final(self, game: Game) -> int:
        """The last draw of `game` whose decisions are all made and journaled: closed a
        settlement ago (no claim or cancel of it can come), and before any ticket still
        indexed (claimed, being cancelled, or decided and not journaled yet: the janitor
        settles and journals it; a ticket indexed at an instant plays draws on sale then)."""
        last = game.calendar.current(self.clock.now() - settle_ms(self.settings)) - 1
        oldest = await self.store.oldest_pending()
        if oldest is not None:
            last = min(last, game.calendar.current(oldest) - 1)
        return last

    # -- the report ------------------------------------------------------------------------

    def path(self, game: str, draw: int, suffix: str) -> Path:
        return self.directory / REPORTS / game / f"{draw}{suffix}"

    async def report(self, game: Game, draw: int) -> DrawReport:
        """The report written for the draw if there is one, else built now."""
        game.check_draw(draw)
        written = self.path(game.rules.id, draw, ".json")
        with contextlib.suppress(FileNotFoundError):
            return _report(await asyncio.to_thread(written.read_bytes))
        cached = self._live.get((game.rules.id, draw))
        if cached is not None and time.monotonic() - cached[0] < LIVE_CACHE_S:
            return cached[1]
        history = await self.history(game, range(draw, draw + 1))
        report = await self.build(history, game, draw)
        self._live = {k: v for k, v in self._live.items()
                      if time.monotonic() - v[0] < LIVE_CACHE_S}
        self._live[game.rules.id, draw] = (time.monotonic(), report)
        return report

    async def build(self, history: History, game: Game, draw: int) -> DrawReport:
        now = self.clock.now()
        retained = game.expire_at(draw) > now
        if retained and draw not in history.stops:
            await self._journal_lost_stop(history, game, draw)
        check = (await redis_check(self.store, self.exposure, history, game, draw)
                 if retained else None)
        return build(history, game, draw, built_ms=now,
                     final=draw <= await self.last_final(game), redis=check)

    async def _journal_lost_stop(self, history: History, game: Game, draw: int) -> None:
        """An admin's stop Redis holds and no journal read has (its answer was lost before
        it was journaled: a 503 nobody sent again) is journaled now, by this process, with
        no channel (Redis does not keep it), so that the report and the journal alone have
        it."""
        (instant,) = stop_instants(await self.store.stops(game.rules.id, draw, 1))
        if instant is None:
            return
        await self.recorder.stop("", game.rules.id, draw, instant, game.expire_at(draw))
        history.stops[draw] = instant

    # -- reconciliation --------------------------------------------------------------------

    async def reconcile(self, game: Game, draw: int, export: str, *, grace_ms: int,
                        cancel_abandoned: bool = False) -> Reconciliation:
        """The export (CSV text) against the draw's decisions; ExportError when it cannot be
        read (nothing compared, nothing cancelled)."""
        game.check_draw(draw)
        lines = read_export(export)
        history = await self.history(game, range(draw, draw + 1))
        rec = await self.compare(history, game, draw, lines, grace_ms)
        if cancel_abandoned:
            await cancel_abandoned_tickets(self.tickets, self.settings.channels, rec)
        self.on_reconciled(rec)
        return rec

    async def compare(self, history: History, game: Game, draw: int,
                      lines: list[ExportLine], grace_ms: int) -> Reconciliation:
        now = self.clock.now()
        known = (await lookup(self.store, unknown(history, draw, lines), game.rules.id, draw)
                 if game.expire_at(draw) > now else {})
        return reconcile(history, draw, lines, now_ms=now, grace_ms=grace_ms,
                         final=draw <= await self.last_final(game), tz=game.rules.tz,
                         known=known)

    # -- the reports the service writes ----------------------------------------------------

    async def write_due(self) -> int:
        """Write the report of every draw whose decisions are all made and that has none
        yet, since the journal directory began (one process of the directory at a time:
        the others skip); returns how many were written."""
        lock = await asyncio.to_thread(try_lock, self.directory / REPORTS / ".lock")
        if lock is None:
            return 0  # another process of this directory is writing them
        try:
            written = 0
            for game in self.catalog.games.values():
                written += await self._write_game(game)
            return written
        finally:
            os.close(lock)  # releases the lock

    async def _write_game(self, game: Game) -> int:
        gid = game.rules.id
        last = await self.last_final(game)
        first = self._next.get(gid) or max(1, game.calendar.current(self._began_ms()))
        missing = unreported(self.directory / REPORTS / gid, range(first, last + 1))
        for chunk in missing:
            history = await self.history(game, spanning(chunk))
            for draw in chunk:
                await self._write(game, draw, history)
        self._next[gid] = max(first, last + 1)
        return sum(map(len, missing))

    def _began_ms(self) -> int:
        """When this journal directory's oldest file was opened, within `[journal] keep`."""
        files = journal_files(self.directory)
        opened = opened_at(files[0].name) if files else None
        began = int((opened if opened is not None else time.time()) * 1000)
        return max(began, self.clock.now() - self.settings.journal_keep_ms)

    async def _write(self, game: Game, draw: int, history: History) -> None:
        gid = game.rules.id
        json_path, csv_path = self.path(gid, draw, ".json"), self.path(gid, draw, ".csv")
        report = None
        if not json_path.exists():
            report = await self.build(history, game, draw)
        try:
            report = await asyncio.to_thread(_store, json_path, csv_path, report)
        except NotAReport as e:
            log.error("draw report: %s; left as it is", e)
            return
        self.on_report(gid, report.flawed)
        if report.flawed:
            log.error("draw report: %s draw %d %s", gid, draw,
                      "passed its cap" if report.over_cap else "read a broken chain",
                      extra={"over_cap": len(report.over_cap),
                             "breaks": len(report.chain.breaks)})


@dataclasses.dataclass
class FinalReports:
    """What `write_final_reports` did for a game."""

    game: str
    written: list[int] = dataclasses.field(default_factory=list)
    existing: int = 0
    """Final draws whose report was there already (never written over)."""
    flawed: list[int] = dataclasses.field(default_factory=list)
    """Draws written whose report passed a cap or read a broken chain."""
    last: int = 0
    """The last draw reported (or found reported)."""
    waiting: list[str] = dataclasses.field(default_factory=list)
    """Copies behind (their shipper's `.shipped`): their draws wait for the next run."""
    unreadable: list[str] = dataclasses.field(default_factory=list)
    """Report files there already that are not a report (cut short, not capsvc's): named,
    left alone (never written over), and the other draws written all the same."""


SHIP_MARGIN_MS = 60_000
"""A shipped copy covers a draw this long after it is due (the hosts' clocks differ)."""


def write_final_reports(settings: Settings, game: Game, dirs: list[Path], out: Path,
                        now_ms: int, last_final: int | None = None) -> FinalReports:
    """Write under `out` (`<game>/<draw>.json`, `.csv`, each once, never over a file) the
    report of every final draw of `game` read from all of `dirs` together that has none,
    since the oldest journal file of `dirs` (within `[journal] keep`). A draw is final at
    `due_ms` by `now_ms` (or up to `last_final`, Redis's view), and once every shipped copy
    among `dirs` is known whole past it (capsvc.journal.ship). One writer of `out` at a
    time (`out/.lock`: another one running, nothing is done)."""
    gid = game.rules.id
    result = FinalReports(gid)
    settle = settle_ms(settings)
    last = game.calendar.current(now_ms - settle) - 1
    if last_final is not None:
        last = min(last, last_final)
    for directory in dirs:
        until = shipped_until(directory)
        if until is None:
            continue
        whole = until - SHIP_MARGIN_MS - settle
        covered = (game.calendar.current(whole) - 1
                   if whole >= game.calendar.close_ms(1) else 0)
        if covered < last:
            last = covered
            result.waiting.append(f"{directory}: shipped until "
                                  f"{instant(until, game.rules.tz)}")
    opened = [o for d in dirs if (files := journal_files(d))
              and (o := opened_at(files[0].name)) is not None]
    if not opened or last < 1:
        return result
    began = max(int(min(opened) * 1000), now_ms - settings.journal_keep_ms)
    first = max(1, game.calendar.current(began))
    result.last = max(0, last)

    def path(draw: int, suffix: str) -> Path:
        return out / gid / f"{draw}{suffix}"

    draws = range(first, last + 1)
    missing = unreported(out / gid, draws)
    result.existing = len(draws) - sum(map(len, missing))
    for chunk in missing:
        history = read_history(dirs, game, spanning(chunk))
        for draw in chunk:
            report = None if path(draw, ".json").exists() else build(
                history, game, draw, built_ms=now_ms, final=True)
            try:
                report = _store(path(draw, ".json"), path(draw, ".csv"), report)
            except FileExistsError:  # written meanwhile by another: never over it
                result.existing += 1
                continue
            except NotAReport as e:
                result.unreadable.append(str(e))
                continue
            result.written.append(draw)
            if report.flawed:
                result.flawed.append(draw)
    return result


def unreported(reports: Path, draws: range) -> list[list[int]]:
    """The draws of `draws` whose report files are not both under `reports`, BATCH at most
    a list: each list's draws are read with one pass over the journal (spanning(), the files
    holding none of them skipped)."""
    missing = [draw for draw in draws
               if not ((reports / f"{draw}.json").exists()
                       and (reports / f"{draw}.csv").exists())]
    return [missing[i:i + BATCH] for i in range(0, len(missing), BATCH)]


def spanning(draws: list[int]) -> range:
    """The draws from the first of `draws` to the last."""
    return range(draws[0], draws[-1] + 1)


def try_lock(path: Path) -> int | None:
    """An exclusive lock on `path` (made if need be), or None if another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class NotAReport(Exception):
    """A report file there already that is not a report (cut short by a copy or a restore:
    capsvc writes whole files): named, left alone, never written over."""


def _store(json_path: Path, csv_path: Path, report: DrawReport | None) -> DrawReport:
    """Write a draw's report files, each once: `report` as JSON (None: the JSON is there
    already, a crash left the CSV out: made from it), then as CSV."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    if report is None:
        try:
            report = _report(json_path.read_bytes())
        except msgspec.DecodeError as e:
            raise NotAReport(f"{json_path}: not a report ({e})") from None
    else:
        write_once(json_path, to_json(report))
    if not csv_path.exists():
        write_once(csv_path, to_csv(report).encode())
    return report


def write_once(path: Path, data: bytes) -> None:
    """Write a file durably, never over one that exists (FileExistsError)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # fails if it exists: a report is written once
    finally:
        tmp.unlink()
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def redis_check(store: Store, exposure: Exposure, history: History, game: Game,
                      draw: int) -> RedisCheck | None:
    """The journal's capped totals of a retained draw against Redis's counters: each
    combination the journal knows, and the draw's whole capped stake and combinations
    played (which tell of counters the journal read does not hold: another host's
    sales, or decisions never journaled)."""
    if game.rules.cap_limit is None:
        return None
    totals = capped_totals(history, draw)
    combos = sorted(totals)
    replies = await replies_of(store.counters_of(game.rules.id, draw, combos)) if combos else []
    differences: list[str] = []
    differing = 0
    for combo, reply in zip(combos, replies, strict=True):
        counted = int(reply or 0)
        if counted != totals[combo]:
            differing += 1
            if len(differences) < DIFFERENCES_SHOWN:
                numbers = "-".join(map(str, combination.decode(combo)))
                differences.append(f"{numbers}: the journal has {totals[combo]}, Redis "
                                   f"{counted}")
    if differing > DIFFERENCES_SHOWN:
        differences.append(f"… and {differing - DIFFERENCES_SHOWN} more combination(s)")
    out = await exposure.of(game, draw)
    redis_stake = sum(c.stake for c in out.capped)
    redis_played = sum(c.played for c in out.capped)
    journal_stake = sum(totals.values())
    played = sum(1 for v in totals.values() if v)
    if redis_stake != journal_stake or redis_played != played:
        differences.append(f"capped stake: the journal has {journal_stake} on {played} "
                           f"combination(s), Redis {redis_stake} on {redis_played}")
    return RedisCheck(compared=len(combos), complete=not differences,
                      differences=differences)


async def lookup(store: Store, keys: list[tuple[str, str]], game: str, draw: int
                 ) -> dict[tuple[str, str], Known]:
    """The decisions Redis holds of tickets (another host's), by (channel, ticket id), and
    whether each is of `game` and plays `draw`."""
    out: dict[tuple[str, str], Known] = {}
    for start in range(0, len(keys), 1000):
        chunk = keys[start:start + 1000]
        replies = await replies_of([store.ticket(ticket_key(c, t)) for c, t in chunk])
        for (channel, ticket), record in zip(chunk, replies, strict=True):
            if record is None or (record.body is None and record.results is None):
                continue  # unknown, or no decision yet
            sale = unpack_sale(record.sale)
            body = record.body or derived_body(channel, sale, record.sale_id, record.at,
                                               record.results)
            decision = msgspec.json.decode(body)
            assert sale.first_draw is not None
            same_game = sale.game == game
            out[channel, ticket] = Known(
                sale=record.sale_id, status=decision["status"],
                total_cost=int(decision["total_cost"]),
                plays=same_game and sale.first_draw <= draw < sale.first_draw + sale.draws,
                same_game=same_game, cancelled=record.cancelled_at is not None)
    return out


async def cancel_abandoned_tickets(tickets: Tickets, channels: tuple[Channel, ...],
                                   rec: Reconciliation) -> None:
    """Cancel every `not_sold` ticket of `rec` that can still be (the game's policy, its
    first draw open), each fenced by its sale id (a ticket id used again since is another
    sale: left alone); say in each one's `cancel` what came of it."""
    by_id = {c.id: c for c in channels}
    for item in rec.not_sold:
        channel = by_id.get(item.channel)
        if item.listed:
            item.cancel = ("not cancelled: the export lists this ticket id (capsvc counted "
                           "it twice): cancel the sale without a receipt by hand")
            continue
        if channel is None:
            item.cancel = f"not cancelled: channel {item.channel} is no longer configured"
            continue
        # The operator cancels on the channel's behalf, whatever scopes its token has now.
        acting = dataclasses.replace(channel, scopes=channel.scopes | {"sell"})
        try:
            out = await tickets.cancel(acting, item.ticket_id, only_sale=item.sale)
        except ApiError as e:
            item.cancel = f"not cancelled: {e.message}"
        else:
            item.cancel = f"cancelled: {out.released} released"
