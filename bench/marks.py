"""What the mark costs a one-grid sale in Redis (lua/capsvc.lua, MARKS), side by side.

    python bench/marks.py [--calls 20000] [--rounds 6]

On one redis-server, rounds alternating: `capsvc_sell` through `Store.sell` as a worker
calls it, once with a process's marks (checked and counted: one HMGET, one HSET) and once
with a tool's (the same function, its mark neither checked nor counted). Prints, per
variant, the median Redis CPU (the process's, from /proc) and FCALL time (INFO
commandstats) per sale, and the difference: what the mark adds. Asserts nothing. The hash
seed is fixed (PYTHONHASHSEED=0; the process re-executes itself to set it).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

from record import fcall_usec, round_of, sales
from run import cpu_seconds, with_fixed_hash_seed

from capsvc.domain.validator import pack_sale
from capsvc.redis.marks import Marks
from capsvc.redis.store import Store, lua_source
from capsvc.redis.transport import Coalescer

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository: tests.support
from tests.support.servers import RedisServer


async def measure(calls: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    server = RedisServer().start()
    try:
        client = server.client()
        pid = int(client.info("server")["process_id"])
        redis = Coalescer(server.url, timeout_s=30, library=lua_source())
        store = Store(redis)
        variants = {"marked": Marks("bench", single_node=True),
                    "unmarked": Marks.tool(single_node=True)}
        out: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        for r in range(rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                client.flushall()
                await store.load_library()
                store.marks = variants[name]
                store.marks.seen.clear()
                store.marks.made.clear()
                before_calls, before_usec = fcall_usec(client)
                before = cpu_seconds(pid)
                await round_of(store, sales(f"{name}{r}", calls, 1, seed=r), pack_sale)
                cpu = (cpu_seconds(pid) - before) / calls * 1e6
                after_calls, after_usec = fcall_usec(client)
                out[name].append((cpu, (after_usec - before_usec) / (after_calls
                                                                     - before_calls)))
        await redis.aclose()
        return out
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    rerun = with_fixed_hash_seed()
    if rerun is not None:
        return rerun
    results = asyncio.run(measure(args.calls, args.rounds))
    print(f"a one-grid capsvc_sell, {args.calls} calls a round, {args.rounds} rounds "
          "alternating (medians; Redis CPU from /proc, FCALL from INFO commandstats)")
    medians = {}
    for name, rows in results.items():
        cpu = statistics.median(c for c, _ in rows)
        fcall = statistics.median(f for _, f in rows)
        medians[name] = (cpu, fcall)
        print(f"  {name:9} Redis CPU {cpu:6.2f} µs a sale   FCALL {fcall:6.2f} µs   rounds: "
              + ", ".join(f"{c:.1f}" for c, _ in rows))
    cpu = medians["marked"][0] - medians["unmarked"][0]
    fcall = medians["marked"][1] - medians["unmarked"][1]
    pairs = [m[0] - u[0] for m, u in zip(results["marked"], results["unmarked"], strict=True)]
    print(f"  the mark adds {cpu:+.2f} µs of Redis CPU ({fcall:+.2f} µs of FCALL) a sale; "
          "round by round: " + ", ".join(f"{d:+.2f}" for d in pairs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
