"""What a draw's report and a reconciliation cost, from a journal of a given size.

    python bench/audit.py [--tickets 200000] [--draws 10]

Writes a journal as the service does (the real Recorder and writer, files of 8 MB:
decisions with 1 to 3 grids, a tenth of them journaled again as look-ups, a fiftieth
cancelled) over `--draws` draws of FDJ Keno sold one after the other, then times, on one
core, in this process:
- the report of one draw: reading every file that can hold its decisions (by their times,
  here all of them), the history, the report, its CSV;
- the same for the last draw (the one on sale) by a service that has read the journal once
  already (it skips the files that hold none of its decisions);
- the reconciliation of that draw against an export of all its tickets;
- `capsvc reconcile` as a command (process start included).
Prints seconds and journal records read per second. Asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from zoneinfo import ZoneInfo

import msgspec

from capsvc.audit.history import Spans, read_history
from capsvc.audit.reconcile import read_export, reconcile
from capsvc.audit.report import build, to_csv
from capsvc.client.models import TicketIn
from capsvc.config import load_settings
from capsvc.domain.decisions import ACCEPTED, REJECTED, Reserved, render, results_of
from capsvc.domain.games import Game
from capsvc.domain.validator import validate_ticket
from capsvc.journal.recorder import Recorder
from capsvc.journal.writer import journal_files, open_journal

TZ = ZoneInfo("Europe/Paris")


async def write_journal(directory: Path, game: Game, first: int, draws: int, tickets: int,
                        now: int) -> list[tuple[str, int, int]]:
    """The journal; (ticket id, total cost, draw) of each standing ticket."""
    journal = open_journal(directory, max_file_bytes=8 << 20, keep_ms=86_400_000)
    rec = Recorder(journal, lambda: now)
    rng = random.Random(1)
    standing = []
    batch = []
    for i in range(tickets):
        draw = first + i * draws // tickets  # sold draw after draw, as in life
        grids = [{"numbers": sorted(rng.sample(range(1, 71), rng.choice([2, 5, 8, 9, 10]))),
                  "stake": rng.choice([100, 200, 500])} for _ in range(rng.randint(1, 3))]
        t = msgspec.convert({"ticket_id": f"B-{i}", "game": game.rules.id,
                             "first_draw": draw, "grids": grids}, TicketIn)
        sale = msgspec.structs.replace(validate_ticket(game.rules, t), first_draw=draw)
        replies = [None if not g.capped else Reserved(ACCEPTED) if rng.random() < 0.9
                   else Reserved(REJECTED, room=100) for g in sale.grids]
        sid = f"{i:016x}"
        body, _ = render("fr-retail", sale, sid, now, results_of(TZ.key, replies))
        until = game.expire_at(draw)
        batch.append(rec.sale("answer", "fr-retail", sale, sid, now, body, until, [5000]))
        if i % 10 == 0:
            batch.append(rec.sale("lookup", "fr-retail", sale, sid, now, body, until))
        total = msgspec.json.decode(body)["total_cost"]
        if i % 50 == 0 and total:
            batch.append(rec.cancel("answer", "fr-retail", sale, sid, now, body, until,
                                    now + 1, total))
        elif total:
            standing.append((f"B-{i}", total, draw))
        if len(batch) >= 2000:
            await asyncio.gather(*batch)
            batch = []
    await asyncio.gather(*batch)
    await journal.aclose()
    return standing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tickets", type=int, default=200_000)
    parser.add_argument("--draws", type=int, default=10)
    args = parser.parse_args()
    config = Path(__file__).resolve().parent.parent / "tests" / "capsvc-test.toml"
    game = Game(load_settings(config).games["fdj-keno"])
    first = 9000
    now = game.calendar.close_ms(first) - 3_600_000
    with tempfile.TemporaryDirectory(prefix="capsvc-bench-audit-") as tmp:
        directory = Path(tmp) / "journal"
        t0 = time.perf_counter()
        standing = asyncio.run(write_journal(directory, game, first, args.draws,
                                             args.tickets, now))
        wrote = time.perf_counter() - t0
        files = journal_files(directory)
        size = sum(p.stat().st_size for p in files)
        lines = sum(1 for p in files for _ in p.open("rb"))
        print(f"journal: {args.tickets} tickets over {args.draws} draws, {lines} records, "
              f"{size / 1e6:.1f} MB in {len(files)} file(s) (written in {wrote:.1f} s)")
        draw = first
        t0 = time.perf_counter()
        history = read_history([directory], game, range(draw, draw + 1))
        read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = build(history, game, draw, built_ms=now, final=True)
        to_csv(report)
        build_s = time.perf_counter() - t0
        print(f"report of one draw ({report.tickets.accepted + report.tickets.partial} "
              f"standing tickets): journal read {read_s:.2f} s ({lines / read_s:,.0f} "
              f"records/s), report built {build_s:.3f} s")
        spans: Spans = {}
        read_history([directory], game, range(draw, draw + 1), spans=spans)
        live = first + args.draws - 1
        t0 = time.perf_counter()
        again = read_history([directory], game, range(live, live + 1), spans=spans)
        print(f"the draw on sale again, by a process that read the journal once: "
              f"{time.perf_counter() - t0:.2f} s ({len(again.sources)} of {len(files)} "
              "files read)")
        export = "channel,ticket_id,total_cost\n" + "".join(
            f"fr-retail,{t},{c}\n" for t, c, d in standing if d == draw)
        t0 = time.perf_counter()
        rec = reconcile(history, draw, read_export(export), now_ms=now, grace_ms=0,
                        final=True, tz=TZ)
        rec_s = time.perf_counter() - t0
        print(f"reconciliation of that draw against {rec.sold.tickets} exported tickets: "
              f"{rec_s:.3f} s after the read (balanced: {rec.balanced})")
        sold = Path(tmp) / "sold.csv"
        sold.write_text(export)
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "capsvc", "reconcile", "--config",
                              str(config), "--dir", str(directory), "--game", "fdj-keno",
                              "--draw", str(draw), "--sold", str(sold)],
                             capture_output=True, text=True, check=False)
        print(f"capsvc reconcile (a process, reading the whole journal): "
              f"{time.perf_counter() - t0:.2f} s, exit {out.returncode}")


if __name__ == "__main__":
    main()
