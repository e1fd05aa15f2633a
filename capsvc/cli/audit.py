"""`capsvc report` and `capsvc reconcile`: the audit from the command line.

Both read journal directories (the configuration's `[journal] dir` and `[audit] sources`,
or those given with `--dir`): they work after Redis's retention and on copies of the files
on another machine. Redis, when given (`--redis`), adds what only it can tell: its clock,
the counters of a draw still retained, tickets another host decided. `--cancel-abandoned`
cancels through the same use-case as the API, journaling each cancel (in `[journal] dir`)
before reporting it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from capsvc.audit.history import read_history
from capsvc.audit.reconcile import (
    ExportError,
    ExportLine,
    Reconciliation,
    read_export,
    reconcile,
    to_text,
)
from capsvc.audit.report import build, encode_json, to_csv, to_json
from capsvc.audit.service import (
    Audit,
    cancel_abandoned_tickets,
    due_ms,
    try_lock,
    write_final_reports,
    write_once,
)
from capsvc.cli import CONFIG_OPTION, files_read
from capsvc.config import ConfigError, Settings, load_settings, parse_duration_ms
from capsvc.domain.errors import Unavailable
from capsvc.domain.games import Catalog, Game


def add_parsers(sub: Any) -> None:
    """The `report` and `reconcile` subcommands of `capsvc`."""
    config = argparse.ArgumentParser(add_help=False)
    config.add_argument("--config", **CONFIG_OPTION)
    config.add_argument("--dir", action="append", metavar="DIR",
                        help="a journal directory to read (repeat for every host's); "
                             "default: [journal] dir and [audit] sources")
    config.add_argument("--redis-url", nargs="?", const=True, metavar="URL",
                        help="also ask Redis (default URL: [redis] url): its clock, the "
                             "counters of a draw still retained, other hosts' tickets")
    config.add_argument("--journals", metavar="PARENT",
                        help="read every journal directory under PARENT (each host's: the "
                             "copies `capsvc journal ship` keeps), with any --dir")
    common = argparse.ArgumentParser(add_help=False, parents=[config])
    common.add_argument("--game", required=True)
    common.add_argument("--draw", required=True, type=int)
    p = sub.add_parser("report", parents=[config],
                       help="a draw's report from the journal (exit 1 if a cap was passed "
                            "or a chain is broken); --all-final: every final draw's, "
                            "written once")
    p.add_argument("--game", help="the game (with --all-final: default every game)")
    p.add_argument("--draw", type=int, help="the draw")
    p.add_argument("--all-final", action="store_true",
                   help="write the report of every final draw that has none yet, under "
                        "--reports (never over a file)")
    p.add_argument("--reports", metavar="DIR",
                   help="with --all-final: where to write <game>/<draw>.json and .csv "
                        "(default: PARENT/reports of --journals)")
    p.add_argument("--format", choices=("json", "csv"), default="json")
    p.add_argument("--out", metavar="FILE", help="write it there (never over a file)")
    p = sub.add_parser("reconcile", parents=[common],
                       help="the sales system's export of a draw against capsvc's decisions "
                            "(exit 0 only when balanced)")
    p.add_argument("--sold", required=True, metavar="FILE",
                   help="CSV with a header naming channel, ticket_id, total_cost")
    p.add_argument("--cancel-abandoned", action="store_true",
                   help="cancel the tickets accepted and never sold, where still possible "
                        "(needs Redis: [redis] url or --redis-url URL)")
    p.add_argument("--grace", default="0s",
                   help="decisions this young are not differences yet (during sales: the "
                        "export lags, e.g. 60s); default 0s")
    p.add_argument("--format", choices=("text", "json"), default="text")


REPORTS = "reports"
"""Under --journals PARENT: not a journal directory, the default --reports."""


def journal_dirs(parent: Path) -> list[Path]:
    """Every journal directory under `parent` (its subdirectories, `reports` and hidden ones
    aside), sorted by name."""
    return sorted(p for p in parent.iterdir()
                  if p.is_dir() and p.name != REPORTS and not p.name.startswith("."))


def directories(settings: Settings, dirs: list[str] | None, journals: str | None
                ) -> list[Path]:
    """The journal directories a command reads: those given (`--dir`) and every one under
    `--journals PARENT`; with neither, `[journal] dir` and `[audit] sources`. ValueError
    (its one line to print) when one is missing."""
    out = [Path(d) for d in dirs or ()]
    if journals is not None:
        if not Path(journals).is_dir():
            raise ValueError(f"no such directory: {journals}")
        out += journal_dirs(Path(journals))
        if not out:
            raise ValueError(f"no journal directory under {journals}")
    if not out:
        out = [Path(settings.journal_dir), *map(Path, settings.audit_sources)]
    missing = [str(d) for d in out if not d.is_dir()]
    if missing:
        raise ValueError(f"no such directory: {', '.join(missing)}")
    return out


def _fail(command: str, message: str) -> int:
    print(f"capsvc {command}: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    command = args.command
    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        return _fail(command, "invalid configuration: " + "; ".join(e.problems) + "; "
                     + files_read(args.config))
    catalog = Catalog(settings.games)
    all_final = getattr(args, "all_final", False)
    if command == "report" and not all_final and (args.game is None or args.draw is None):
        return _fail(command, "give --game and --draw, or --all-final")
    if all_final and (args.draw is not None or args.out):
        return _fail(command, "--all-final writes every final draw under --reports: "
                              "no --draw, no --out")
    game = catalog.get(args.game) if args.game is not None else None
    if args.game is not None and game is None:
        return _fail(command, f"no game {args.game!r} in {settings.source} (games: "
                              f"{', '.join(settings.games)})")
    if game is not None and args.draw is not None and not (
            1 <= args.draw <= game.calendar.last_draw):
        return _fail(command, f"no draw {args.draw} of {args.game}")
    journals = args.journals
    try:
        dirs = directories(settings, args.dir, journals)
    except ValueError as e:
        return _fail(command, str(e))
    url = None
    if args.redis_url or getattr(args, "cancel_abandoned", False):
        url = args.redis_url if isinstance(args.redis_url, str) else settings.redis_url
        if url is None:
            return _fail(command, "no Redis: give --redis-url URL or [redis] url")
    if all_final:
        reports = args.reports or (str(Path(journals) / REPORTS) if journals else None)
        if reports is None:
            return _fail(command, "--all-final needs --reports DIR (or --journals PARENT)")
        games = [game] if game is not None else list(catalog.games.values())
        return _all_final(settings, games, dirs, Path(reports), url)
    assert game is not None
    if command == "report":
        return _report(args, settings, game, dirs, url)
    try:
        grace_ms = parse_duration_ms(args.grace)
        lines = read_export(Path(args.sold).read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:  # ExportError is a ValueError: nothing cancelled
        what = "the export" if isinstance(e, ExportError | UnicodeDecodeError | OSError) \
            else "--grace"
        return _fail(command, f"{what}: {e}")
    try:
        rec = asyncio.run(_reconcile(settings, game, args.draw, dirs, url, lines, grace_ms,
                                     args.cancel_abandoned))
    except (Unavailable, OSError, RedisError) as e:
        return _fail(command, f"redis: {e}")
    if args.format == "json":
        sys.stdout.write(encode_json(rec).decode() + "\n")
    else:
        sys.stdout.write(to_text(rec, game.rules.currency))
    return 0 if _balanced_after(rec) else 1


def _balanced_after(rec: Reconciliation) -> bool:
    """No difference left: none at all, or only tickets never sold that were cancelled."""
    return (not rec.not_accepted and not rec.amounts and not rec.duplicates
            and all((s.cancel or "").startswith("cancelled") for s in rec.not_sold))


def _report(args: argparse.Namespace, settings: Settings, game: Game, dirs: list[Path],
            url: str | None) -> int:
    draw = args.draw
    history = read_history(dirs, game, range(draw, draw + 1))
    if url is None:
        now = int(time.time() * 1000)
        report = build(history, game, draw, built_ms=now,
                       final=now >= due_ms(settings, game, draw))
    else:
        try:
            report = asyncio.run(_with_redis(settings, url, lambda audit: audit.build(
                history, game, draw)))
        except (Unavailable, OSError, RedisError) as e:
            return _fail("report", f"redis: {e}")
    data = to_json(report) if args.format == "json" else to_csv(report).encode()
    if args.out:
        try:
            write_once(Path(args.out), data)
        except FileExistsError:
            return _fail("report", f"{args.out} exists: a report is never written over")
        except OSError as e:
            return _fail("report", f"--out {args.out}: {e.strerror or e}")
    else:
        sys.stdout.buffer.write(data)
    return 1 if report.flawed else 0


def _all_final(settings: Settings, games: list[Game], dirs: list[Path], reports: Path,
               url: str | None) -> int:
    """Write every final draw's report of `games` from `dirs` together, each once; exit 1
    when one written passed a cap or read a broken chain."""
    try:
        reports.mkdir(parents=True, exist_ok=True)
        lock = try_lock(reports / ".lock")
    except OSError as e:
        return _fail("report", f"--reports {reports}: {e.strerror or e}")
    if lock is None:
        return _fail("report", f"another writer holds {reports / '.lock'}: nothing written")
    try:
        if url is None:
            now = int(time.time() * 1000)
            lasts: dict[str, int | None] = {g.rules.id: None for g in games}
        else:
            try:
                now, lasts = asyncio.run(_with_redis(settings, url, lambda audit: _finals(
                    audit, games)))
            except (Unavailable, OSError, RedisError) as e:
                return _fail("report", f"redis: {e}")
        flawed = False
        for game in games:
            try:
                done = write_final_reports(settings, game, dirs, reports, now,
                                           lasts[game.rules.id])
            except OSError as e:
                return _fail("report", f"--reports {reports}: {e.strerror or e}")
            print(f"{done.game}: {len(done.written)} report(s) written, {done.existing} "
                  f"already there, through draw {done.last}")
            for why in done.waiting:
                print(f"{done.game}: waiting for {why}")
            for draw in done.flawed:
                flawed = True
                print(f"{done.game}: draw {draw} passed a cap or read a broken chain",
                      file=sys.stderr)
            for why in done.unreadable:
                flawed = True
                print(f"{done.game}: {why}; left as it is", file=sys.stderr)
        return 1 if flawed else 0
    finally:
        os.close(lock)


async def _finals(audit: Audit, games: list[Game]) -> tuple[int, dict[str, int | None]]:
    """Redis's clock and, per game, the last draw final by Redis (its pending index)."""
    lasts: dict[str, int | None] = {}
    for game in games:
        lasts[game.rules.id] = await audit.last_final(game)
    return audit.clock.now(), lasts


async def _reconcile(settings: Settings, game: Game, draw: int, dirs: list[Path],
                     url: str | None, lines: list[ExportLine], grace_ms: int, cancel: bool
                     ) -> Reconciliation:
    history = await asyncio.to_thread(read_history, dirs, game, range(draw, draw + 1))
    if url is None:
        now = int(time.time() * 1000)
        return reconcile(history, draw, lines, now_ms=now, grace_ms=grace_ms,
                         final=now >= due_ms(settings, game, draw), tz=game.rules.tz)

    async def work(audit: Audit) -> Reconciliation:
        rec = await audit.compare(history, game, draw, lines, grace_ms)
        if cancel:
            await cancel_abandoned_tickets(audit.tickets, settings.channels, rec)
        return rec

    out: Reconciliation = await _with_redis(settings, url, work, journaled=cancel)
    return out


async def _with_redis(settings: Settings, url: str, work: Any, *, journaled: bool = False
                      ) -> Any:
    """Run `work(audit)` with the audit use-cases over Redis at `url` (and, `journaled`,
    a journal in `[journal] dir` for the cancels)."""
    from capsvc.cli import redis_for_tools
    from capsvc.journal.writer import open_journal
    from capsvc.redis.store import Store, lua_source
    from capsvc.wiring import build_usecases

    redis = redis_for_tools(url, settings, lua_source())
    journal = (open_journal(settings.journal_dir,
                            max_file_bytes=settings.journal_max_file_bytes,
                            keep_ms=settings.journal_keep_ms)
               if journaled and settings.journal_enabled else None)
    try:
        store = Store(redis)
        usecases = build_usecases(settings, store, journal=journal)
        await usecases.clock.sync()
        return await work(usecases.audit)
    finally:
        await redis.aclose()
        if journal is not None:
            await journal.aclose()
