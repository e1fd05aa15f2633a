"""Redis memory per (combination, draw) counter, including its idempotency record.

    python bench/memory.py [--counters 100000]

Creates N counters the way a sale does (the reserve function: counter + hold record, one
grid of a distinct 8-number combination on one draw, with TTLs), and prints the
`INFO memory` used_memory delta divided by N.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from capsvc import combination
from capsvc.coalesce import Coalescer
from capsvc.store import Store, lua_source
from capsvc.testing import RedisServer


async def fill(url: str, n: int) -> None:
    redis = Coalescer(url, timeout_s=10, library=lua_source())
    store = Store(redis)
    await store.load_library()
    rng = random.Random(1)
    expire = int(time.time() * 1000) + 86_400_000
    close = expire
    for start in range(0, n, 1000):
        futures = [
            store.reserve("fdj-keno", combination.encode(sorted(rng.sample(range(1, 71), 8))),
                          f"bench/M-{i}/0", 500, 5000, 100, 4711, [expire], close)
            for i in range(start, min(start + 1000, n))
        ]
        await asyncio.gather(*futures)
    await redis.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--counters", type=int, default=100_000)
    args = parser.parse_args()
    server = RedisServer().start()
    try:
        client = server.client()
        version = client.info("server")["redis_version"]
        before = client.info("memory")["used_memory"]
        asyncio.run(fill(server.url, args.counters))
        after = client.info("memory")["used_memory"]
        keys = client.dbsize()
    finally:
        server.stop()
    print(f"redis {version}: {args.counters} counters, {keys} keys, "
          f"{(after - before) / args.counters:.0f} bytes per counter with its hold record")


if __name__ == "__main__":
    main()
