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
from capsvc.audit.service import Audit, cancel_abandoned_tickets, due_ms, write_once
from capsvc.config import ConfigError, Settings, load_settings, parse_duration_ms
from capsvc.domain.errors import Unavailable
from capsvc.domain.games import Catalog, Game


def add_parsers(sub: Any) -> None:
    """The `report` and `reconcile` subcommands of `capsvc`."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--game", required=True)
    common.add_argument("--draw", required=True, type=int)
    common.add_argument("--config", action="append", metavar="PATH",
                        help="TOML configuration, the game's rules and [journal] dir; repeat "
                             "it to merge several files, in order (default: $CAPSVC_CONFIG, "
                             "paths separated by ':', else the built-in local one)")
    common.add_argument("--dir", action="append", metavar="DIR",
                        help="a journal directory to read (repeat for every host's); "
                             "default: [journal] dir and [audit] sources")
    common.add_argument("--redis-url", nargs="?", const=True, metavar="URL",
                        help="also ask Redis (default URL: [redis] url): its clock, the "
                             "counters of a draw still retained, other hosts' tickets")
    p = sub.add_parser("report", parents=[common],
                       help="a draw's report from the journal (exit 1 if a cap was passed "
                            "or a chain is broken)")
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


def _fail(command: str, message: str) -> int:
    print(f"capsvc {command}: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    command = args.command
    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        return _fail(command, "invalid configuration: " + "; ".join(e.problems))
    game = Catalog(settings.games).get(args.game)
    if game is None:
        return _fail(command, f"no game {args.game!r} in {settings.source} (games: "
                              f"{', '.join(settings.games)})")
    if not 1 <= args.draw <= game.calendar.last_draw:
        return _fail(command, f"no draw {args.draw} of {args.game}")
    dirs = [Path(d) for d in args.dir] if args.dir else [
        Path(settings.journal_dir), *map(Path, settings.audit_sources)]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        return _fail(command, f"no such directory: {', '.join(missing)}")
    url = None
    if args.redis_url or getattr(args, "cancel_abandoned", False):
        url = args.redis_url if isinstance(args.redis_url, str) else settings.redis_url
        if url is None:
            return _fail(command, "no Redis: give --redis-url URL or [redis] url")
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
    from capsvc.journal.writer import open_journal
    from capsvc.redis.cluster import connect
    from capsvc.redis.store import Store, lua_source
    from capsvc.wiring import build_usecases

    redis = connect(url, timeout_s=max(settings.redis_timeout_ms / 1000, 2.0),
                    library=lua_source())
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
