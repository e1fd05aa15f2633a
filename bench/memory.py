"""Redis memory per (combination, draw) counter with its grid record, and a hot combination.

    python bench/memory.py [--counters 100000] [--draws 1000]

1. Creates N counters the way a sale does (the reserve function: one grid of a distinct
   8-number combination on one draw, with its record and TTL) and prints the `INFO memory`
   used_memory delta divided by N, with Redis's default `hash-max-listpack-entries` (128)
   and with deploy/redis.conf's 512.
2. Sells one combination in `--draws` consecutive draws (50 accepted sales and 20 refused
   by the cap per draw, as a hot combination at its cap), each draw's keys expiring a
   moment after it is sold, and prints the memory in use after the first 5 draws and after
   all of them: what a draw stored goes with it, so the two stay the same.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from capsvc import combination
from capsvc.coalesce import Coalescer
from capsvc.store import COUNTER_BUCKETS, Store, lua_source, record_field
from capsvc.testing import RedisServer

GAME, CAP, MIN_STAKE = "fdj-keno", 5000, 100
FAR = 10**13  # a close instant far ahead (ms)


async def fill(store: Store, n: int) -> None:
    rng = random.Random(1)
    expire = int(time.time() * 1000) + 86_400_000
    for start in range(0, n, 1000):
        await asyncio.gather(*[
            store.reserve(GAME, combination.encode(sorted(rng.sample(range(1, 71), 8))),
                          record_field(f"{i:016x}", 0), 500, CAP, MIN_STAKE, 4711, [expire], FAR)
            for i in range(start, min(start + 1000, n))
        ])


async def hot(store: Store, client: Any, draws: int) -> tuple[int, int]:
    """Memory after the first 5 draws and after `draws`, the older ones expired."""
    combo = combination.encode([3, 7, 12, 18, 25, 33, 41, 56])
    sales = 0
    after_first = 0
    for draw in range(1, draws + 1):
        expire = int(time.time() * 1000) + 50  # the draw's retention ends just after
        await asyncio.gather(*[
            store.reserve(GAME, combo, record_field(f"{sales + i:016x}", 0), 100, CAP,
                          MIN_STAKE, draw, [expire], FAR)
            for i in range(70)  # 50 fit under the cap, 20 are refused and recorded
        ])
        sales += 70
        if draw == 5:
            await asyncio.sleep(0.1)
            expire_all(client)
            after_first = client.info("memory")["used_memory"]
    await asyncio.sleep(0.1)
    expire_all(client)
    return after_first, client.info("memory")["used_memory"]


def expire_all(client: Any) -> None:
    """Let Redis drop every expired key now (SCAN expires the keys it visits)."""
    for _ in client.scan_iter(count=10_000):
        pass


async def run(server: RedisServer, counters: int, draws: int) -> dict[str, float]:
    client = server.client()
    redis = Coalescer(server.url, timeout_s=30, library=lua_source())
    store = Store(redis)
    await store.load_library()
    before = client.info("memory")["used_memory"]
    await fill(store, counters)
    per_counter = (client.info("memory")["used_memory"] - before) / counters
    encoding = client.object("encoding", next(client.scan_iter("c:*")))
    keys = client.dbsize()
    client.flushall()
    first, last = await hot(store, client, draws)
    await redis.aclose()
    return {"per_counter": per_counter, "keys": keys, "encoding": encoding,
            "hot_first": first, "hot_last": last}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--counters", type=int, default=100_000)
    parser.add_argument("--draws", type=int, default=1000)
    args = parser.parse_args()
    for entries in (128, 512):
        server = RedisServer(extra=("--hash-max-listpack-entries", str(entries))).start()
        try:
            version = server.client().info("server")["redis_version"]
            r = asyncio.run(run(server, args.counters, args.draws))
        finally:
            server.stop()
        print(f"redis {version}, hash-max-listpack-entries {entries}: {args.counters} counters "
              f"in {r['keys']} keys ({COUNTER_BUCKETS} buckets, {r['encoding']!r}): "
              f"{r['per_counter']:.0f} bytes per counter with its grid record")
        print(f"  hot combination, 70 sales a draw: used_memory {r['hot_first']:,} B after 5 "
              f"draws, {r['hot_last']:,} B after {args.draws} draws (old draws expired): "
              f"ratio {r['hot_last'] / r['hot_first']:.3f}")


if __name__ == "__main__":
    main()
