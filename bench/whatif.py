"""What `capsvc whatif` costs on a national day: one draw of ~1,000,000 tickets.

    python bench/whatif.py [--tickets 1000000] [--hosts 2] [--keep DIR] [--chart FILE.svg]

Writes, with the product's own recorder and writer (one journal per host, the tickets dealt
round-robin), the journal of one FDJ Keno draw as a national day sells it: tickets of 1 to
3 grids of 2 to 10 numbers (a third of the grids of 8 to 10: the capped sizes), the stakes
1-10 EUR, a tenth with the Multiplicateur; a third of the capped grids on popular
combinations (a Zipf law over 30,000 of them: the most played reach the 50 EUR cap and
are refused), the rest chosen at random (~300,000 combinations played); 8 % subscriptions
of 2, 5 or 10 draws bought on earlier draws; 3 % of the decisions journaled again (a
look-up, a replay), 1 % cancelled, 0.2 % voids; a tenth of the tickets on the next draw.
Every decision is judged live by the rule (counters per combination and draw, the cap in
force), at one instant a 40 ms apart over the day, so the journal passes the self-check.

Then runs `python -m capsvc whatif` over it (a process of its own, start included) under
the cap in force and two others, and prints its wall time and its peak memory (the
child's maximum resident set, `resource.getrusage`). Asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from zoneinfo import ZoneInfo

import msgspec

from capsvc.client.models import TicketIn
from capsvc.config import load_settings
from capsvc.domain.decisions import render, results_of
from capsvc.domain.games import Game
from capsvc.domain.validator import Sale, validate_ticket
from capsvc.journal.recorder import Recorder
from capsvc.journal.writer import journal_files, open_journal

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository: tests.journals
from tests.journals import LiveCaps

CONFIG = Path(__file__).resolve().parent.parent / "tests" / "capsvc-test.toml"
TZ = ZoneInfo("Europe/Paris")
DRAW = 13186
PICKS = (2, 3, 4, 5, 6, 7, 8, 9, 10)
PICK_WEIGHTS = (8, 10, 12, 14, 14, 9, 13, 10, 10)
STAKES = (100, 200, 300, 500, 1000)
STAKE_WEIGHTS = (35, 30, 10, 15, 10)
POPULAR = 30_000
BATCH = 4096


async def write(dirs: list[Path], game: Game, tickets: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    rules = game.rules
    cap = rules.cap_limit or 0
    live = LiveCaps(cap)
    journals = [open_journal(d, max_file_bytes=64 << 20, keep_ms=90 * 86_400_000,
                             proc=f"host-{k}/1") for k, d in enumerate(dirs)]
    recs = [Recorder(j, lambda: 0) for j in journals]
    popular = [sorted(rng.sample(range(1, rules.numbers + 1), rng.choice((8, 9, 10))))
               for _ in range(POPULAR)]
    zipf = [1 / (k + 1) ** 1.1 for k in range(POPULAR)]
    close = game.calendar.close_ms(DRAW)
    start = close - 12 * 3_600_000
    step = 12 * 3_600_000 // tickets
    waiting: list[asyncio.Future[None]] = []
    counts = {"tickets": 0, "records": 0, "cancelled": 0, "voids": 0, "again": 0}
    sold: list[tuple[int, Sale, str, int, bytes, set[int]]] = []

    def numbers() -> list[int]:
        picks = rng.choices(PICKS, PICK_WEIGHTS)[0]
        if picks >= 8 and rng.random() < 1 / 3:
            return rng.choices(popular, zipf)[0]
        return rng.sample(range(1, rules.numbers + 1), picks)

    async def flush() -> None:
        nonlocal waiting
        if len(waiting) >= BATCH:
            await asyncio.gather(*waiting)
            waiting = []

    subscriptions = tickets * 8 // 100
    bought = game.calendar.close_ms(DRAW - 10) - 86_400_000
    for i in range(tickets):
        host = i % len(dirs)
        rec = recs[host]
        if i < subscriptions:  # bought on earlier draws, the days before
            draws = rng.choice((2, 5, 10))
            first = DRAW - rng.randrange(draws)
            at = bought + i * 86_400_000 // subscriptions
        else:
            draws = 1
            first = DRAW + 1 if rng.random() < 0.1 else DRAW
            at = start + i * step
        grids = [{"numbers": numbers(), "stake": rng.choices(STAKES, STAKE_WEIGHTS)[0],
                  "multiplier": rng.random() < 0.1}
                 for _ in range(rng.choices((1, 2, 3), (60, 30, 10))[0])]
        t = msgspec.convert({"ticket_id": f"N-{i}", "game": rules.id, "first_draw": first,
                             "draws": draws, "grids": grids}, TicketIn)
        sale = msgspec.structs.replace(validate_ticket(rules, t), first_draw=first)
        sid = f"{rng.getrandbits(64):016x}"
        until = game.expire_at(first + draws - 1)
        counts["tickets"] += 1
        if rng.random() < 0.002:  # claimed, never answered
            waiting.append(rec.void("abandoned", "fr-retail", sale, sid, at, until))
            counts["voids"] += 1
            counts["records"] += 1
            await flush()
            continue
        body, _ = render("fr-retail", sale, sid, at, results_of(TZ.key, live.judge(sale)))
        caps = [cap] * draws
        waiting.append(rec.sale("answer", "fr-retail", sale, sid, at, body, until, caps))
        counts["records"] += 1
        accepted = {g["index"] for g in msgspec.json.decode(body)["grids"]
                    if g["status"] == "accepted"}
        if draws == 1 and accepted:
            sold.append((host, sale, sid, at, body, accepted))
            if len(sold) > 200:
                sold.pop(0)
        r = rng.random()
        if r < 0.03:  # journaled again: a look-up, a replay, on either host
            waiting.append(recs[rng.randrange(len(dirs))].sale(
                "lookup", "fr-retail", sale, sid, at, body, until, caps))
            counts["again"] += 1
            counts["records"] += 1
        elif r < 0.04 and sold:  # one of the last tickets sold, cancelled
            h, s, ssid, sat, sbody, acc = sold.pop(rng.randrange(len(sold)))
            live.give_back(s, acc)
            released = msgspec.json.decode(sbody)["total_cost"]
            waiting.append(recs[h].cancel("answer", "fr-retail", s, ssid, sat, sbody,
                                          game.expire_at(s.first_draw or 0), at + 1,
                                          released))
            counts["cancelled"] += 1
            counts["records"] += 1
        await flush()
    await asyncio.gather(*waiting)
    for j in journals:
        await j.aclose()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tickets", type=int, default=1_000_000)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", metavar="DIR",
                        help="write the journal there and keep it (default: a temporary "
                             "directory, removed)")
    parser.add_argument("--chart", metavar="FILE.svg", help="also draw the chart there")
    args = parser.parse_args()
    game = Game(load_settings(CONFIG).games["fdj-keno"])
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="capsvc-whatif-"))
    dirs = [root / f"host-{k}" for k in range(args.hosts)]
    try:
        if all(journal_files(d) for d in dirs):
            print(f"journal: {root} (already written)")
        else:
            t0 = time.perf_counter()
            counts = asyncio.run(write(dirs, game, args.tickets, args.seed))
            print(f"journal written in {time.perf_counter() - t0:.0f} s: {counts}")
        files = [p for d in dirs for p in journal_files(d)]
        size = sum(p.stat().st_size for p in files)
        print(f"{len(files)} file(s), {size / 1e6:.0f} MB, {args.hosts} host(s)")
        command = [sys.executable, "-m", "capsvc", "whatif", "--config", str(CONFIG),
                   "--game", "fdj-keno", "--draw", str(DRAW), "--cap", "5000", "--cap",
                   "2500", "--cap", "10000"]
        for d in dirs:
            command += ["--dir", str(d)]
        runs = [command] + ([[*command, "--chart", args.chart]] if args.chart else [])
        for run in runs:  # the chart's last: the children's peak is the largest so far
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            out = subprocess.run(run, capture_output=True, text=True, check=False)
            seconds = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
            print("$ capsvc " + " ".join(run[3:]).replace(str(CONFIG), "tests/capsvc-test.toml"))
            print(out.stdout + out.stderr, end="")
            print(f"exit {out.returncode}: {seconds:.1f} s wall (process start included), "
                  f"{cpu:.1f} s CPU, peak memory {after.ru_maxrss / 1024:.0f} MiB; "
                  f"load average {os.getloadavg()[0]:.1f}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
