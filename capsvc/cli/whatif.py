"""`capsvc whatif`: a draw replayed from the journal under other caps (capsvc.audit.whatif).

Reads the journal directories as `capsvc report` does (`--dir`, `--journals PARENT`, else
the configuration's); needs no Redis. Exit 0 with the scenarios; 1 when the journal's chain
is broken (unless `--ignore-chain`) or the self-check finds a grid whose live outcome the
rule does not give (nothing printed but that finding: the figures would rest on it); 2 on
bad input. Every problem is one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from capsvc.audit.service import write_once
from capsvc.audit.whatif import Replay, read_demand, replay, to_csv, to_json, to_text
from capsvc.cli import CONFIG_OPTION
from capsvc.cli.audit import directories
from capsvc.config import ConfigError, load_settings
from capsvc.domain.games import Catalog

COMMAND = "whatif"
MAX_CAP = 10**15
"""The largest cap taken (minor units): the configuration's bound on an amount."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        COMMAND, help="a draw replayed from the journal under other caps: what each would "
                      "have accepted, refused and risked (exit 1 if the journal and the "
                      "replay disagree)")
    p.add_argument("--config", **CONFIG_OPTION)
    p.add_argument("--game", required=True)
    p.add_argument("--draw", required=True, help="the draw's number")
    p.add_argument("--cap", action="append", required=True, metavar="AMOUNT",
                   help="a cap to replay the draw under, in minor units like cap_limit "
                        "(repeat for each)")
    p.add_argument("--dir", action="append", metavar="DIR",
                   help="a journal directory to read (repeat for every host's); default: "
                        "[journal] dir and [audit] sources")
    p.add_argument("--journals", metavar="PARENT",
                   help="read every journal directory under PARENT (each host's: the "
                        "copies `capsvc journal ship` keeps), with any --dir")
    p.add_argument("--format", choices=("text", "json", "csv"), default="text")
    p.add_argument("--out", metavar="FILE", help="write it there (never over a file)")
    p.add_argument("--chart", metavar="FILE.svg",
                   help="also draw the combinations by accepted stake under each cap "
                        "(SVG; needs the charts extra; never over a file)")
    p.add_argument("--ignore-chain", action="store_true",
                   help="replay a journal whose chain is broken all the same (said on "
                        "stderr)")


def _fail(message: str, status: int = 2) -> int:
    print(f"capsvc {COMMAND}: {message}", file=sys.stderr)
    return status


def _cap(text: str) -> int | None:
    """A cap in minor units: a whole number from 0, else None."""
    text = text.strip()
    if not text.isascii() or not text.isdigit() or int(text) > MAX_CAP:
        return None
    return int(text)


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        return _fail("invalid configuration: " + "; ".join(e.problems))
    caps: list[int] = []
    for text in args.cap:
        cap = _cap(text)
        if cap is None:
            return _fail(f"--cap {text!r}: expected an amount in minor units, a whole "
                         f"number from 0 to {MAX_CAP}")
        if cap not in caps:
            caps.append(cap)
    game = Catalog(settings.games).get(args.game)
    if game is None:
        return _fail(f"no game {args.game!r} in {settings.source} (games: "
                     f"{', '.join(settings.games)})")
    if game.rules.cap_limit is None:
        return _fail(f"game {args.game} has no cap (cap_limit): no grid of it is capped")
    draw = int(args.draw) if args.draw.isascii() and args.draw.isdigit() else 0
    if not 1 <= draw <= game.calendar.last_draw:
        return _fail(f"no draw {args.draw} of {args.game}")
    try:
        dirs = directories(settings, args.dir, args.journals)
    except ValueError as e:
        return _fail(str(e))
    chart = Path(args.chart) if args.chart else None
    if chart is not None:
        from capsvc.audit import chart as charts

        if not charts.available():
            return _fail(f"--chart needs matplotlib, which is not installed: "
                         f"{charts.EXTRA}")
    for option, path in (("--out", args.out), ("--chart", args.chart)):
        if path and Path(path).exists():
            return _fail(f"{option} {path} exists: nothing is written over a file")
    demand = read_demand(dirs, game, draw)
    if not demand.sales:
        return _fail(f"no sale of {args.game} draw {draw} in the journal "
                     f"({', '.join(map(str, dirs))})")
    if demand.breaks:
        first = f"{len(demand.breaks)} line(s) that do not chain, the first: {demand.breaks[0]}"
        if not args.ignore_chain:
            return _fail(f"the journal's chain is broken ({first}); nothing replayed "
                         "(capsvc journal verify tells more; --ignore-chain replays it all "
                         "the same)", 1)
        print(f"capsvc {COMMAND}: replayed with its chain broken (--ignore-chain): {first}",
              file=sys.stderr)
    result = replay(demand, game, caps)
    if result.finding is not None:
        assert demand.cap is not None
        return _fail(result.finding.describe(demand.cap, game.rules.currency,
                                             result.differing), 1)
    if args.format == "json":
        data = to_json(result.what)
    elif args.format == "csv":
        data = to_csv(result.what).encode()
    else:
        data = to_text(result, demand.cap, game.rules.min_stake).encode()
    if args.out:
        try:
            write_once(Path(args.out), data)
        except FileExistsError:
            return _fail(f"--out {args.out} exists: nothing is written over a file")
        except OSError as e:
            return _fail(f"--out {args.out}: {e.strerror or e}")
    else:
        sys.stdout.buffer.write(data)
    if chart is not None:
        return _chart(result, chart)
    return 0


def _chart(result: Replay, path: Path) -> int:
    from capsvc.audit import chart as charts

    try:
        write_once(path, charts.draw(result))
    except FileExistsError:
        return _fail(f"--chart {path} exists: nothing is written over a file")
    except OSError as e:
        return _fail(f"--chart {path}: {e.strerror or e}")
    return 0
