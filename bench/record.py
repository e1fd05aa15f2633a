"""Redis CPU and memory of the sale in one call, by how the ticket record keeps the sale,
side by side in one run.

    python bench/record.py [--tickets 3000] [--rounds 6] [--grids 1]

Calls `capsvc_sell` (the whole sale: claim, count, record, index) straight from this
process through the Store, as a capsvc worker does, for `--tickets` new one-draw tickets of
`--grids` capped grids each (8-10 numbers, distinct combinations), alternating round by
round:
- `json`: the sale kept as JSON (`Sale`);
- `packed`: `validator.pack_sale` (MessagePack, nothing derivable).

Each round on a fresh Redis database; Redis CPU from `INFO commandstats` (the sell calls
only: `usec` of FCALL), memory from `used_memory` after the round (the decisions are not
journaled here: the pending index keeps its entries, the same in both). Prints per-call
Redis CPU and per-ticket memory, their medians and ratios. The hash seed is fixed
(PYTHONHASHSEED=0, re-executing itself). Asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
from run import with_fixed_hash_seed

from capsvc.domain import combination
from capsvc.domain.validator import Sale, SaleGrid, pack_sale
from capsvc.redis.store import Store, lua_source, ticket_key
from capsvc.redis.transport import Coalescer

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository: tests.support
from tests.support.sales import sell_alone
from tests.support.servers import RedisServer

GAME, CAP, MIN_STAKE, DRAW = "fdj-keno", 5000, 100, 13179
ENCODINGS: dict[str, Callable[[Sale], bytes]] = {"json": msgspec.json.encode,
                                                 "packed": pack_sale}


def sales(prefix: str, count: int, grids: int, seed: int) -> list[Sale]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        gs = []
        for g in range(grids):
            numbers = tuple(sorted(rng.sample(range(1, 71), rng.randint(8, 10))))
            stake = rng.choice([100, 200, 300, 500, 1000])
            gs.append(SaleGrid(g, numbers, combination.encode(numbers), stake, False, stake,
                               True))
        out.append(Sale(ticket_id=f"{prefix}-{i:07d}", game=GAME, player_id=None,
                        first_draw=DRAW, draws=1, grids=tuple(gs), joker_plus=False,
                        joker_cost=0, asked=True))
    return out


async def round_of(store: Store, batch: list[Sale], encode: Callable[[Sale], bytes]) -> None:
    far = int(time.time() * 1000) + 86_400_000
    for start in range(0, len(batch), 200):
        await asyncio.gather(*[
            sell_alone(store, ticket_key("bench", s.ticket_id), encode(s), far, far,
                       60_000, GAME, DRAW, 1, CAP, MIN_STAKE,
                       [(g.combo, g.stake) for g in s.grids], [far], "Europe/Paris",
                       fix_caps=False)
            for s in batch[start:start + 200]])


def fcall_usec(client: object) -> tuple[int, int]:
    stats = client.info("commandstats").get("cmdstat_fcall", {})  # type: ignore[attr-defined]
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


async def run(args: argparse.Namespace, server: RedisServer) -> dict[str, list[tuple[float,
                                                                                     float]]]:
    client = server.client()
    redis = Coalescer(server.url, timeout_s=30, library=lua_source())
    store = Store(redis)
    await store.load_library()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in ENCODINGS}
    for r in range(args.rounds):
        order = list(ENCODINGS) if r % 2 == 0 else list(reversed(ENCODINGS))
        for name in order:
            client.flushdb()
            await store.load_library()
            batch = sales(f"{name}{r}", args.tickets, args.grids, seed=r)
            await round_of(store, sales("warm", 200, args.grids, seed=99), ENCODINGS[name])
            client.config_resetstat()
            before = client.info("memory")["used_memory"]
            await round_of(store, batch, ENCODINGS[name])
            calls, usec = fcall_usec(client)
            used = client.info("memory")["used_memory"] - before
            results[name].append((usec / calls, used / args.tickets))
    await redis.aclose()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tickets", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--grids", type=int, default=1)
    args = parser.parse_args()
    rerun = with_fixed_hash_seed()
    if rerun is not None:
        return rerun
    server = RedisServer().start()
    try:
        version = server.client().info("server")["redis_version"]
        results = asyncio.run(run(args, server))
    finally:
        server.stop()
    print(f"redis {version} (default hash limits), {args.tickets} one-draw tickets of "
          f"{args.grids} capped grid(s) a round, {args.rounds} rounds alternating")
    medians = {}
    for name, rows in results.items():
        cpu = statistics.median(r[0] for r in rows)
        mem = statistics.median(r[1] for r in rows)
        medians[name] = (cpu, mem)
        print(f"  {name:7} Redis CPU {cpu:6.1f} µs a sale, memory {mem:6.0f} B a ticket   "
              "rounds: " + ", ".join(f"{r[0]:.1f}/{r[1]:.0f}" for r in rows))
    (jc, jm), (pc, pm) = medians["json"], medians["packed"]
    print(f"  packed / json: Redis CPU x{pc / jc:.2f} ({pc - jc:+.1f} µs), "
          f"memory x{pm / jm:.2f} ({pm - jm:+.0f} B)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
