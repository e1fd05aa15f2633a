"""Where a one-grid sale's Redis CPU goes: the floor of the call, and the sale's sections.

    python bench/floor.py [--calls 20000] [--rounds 3] [--seconds 10]

1. The floor, side by side in one run (rounds alternating, on one redis-server): Redis CPU
   (the process's, from /proc) and FCALL time (`INFO commandstats`) per sale of
   - `noop`: a function that returns at once, called with the sale's keys and arguments
     (3 keys, 10 arguments): what any one call costs;
   - `commands`: the commands a one-grid sale cannot do without (TIME, the ticket's HMGET,
     the stops' HMGET, HINCRBY of the counter, HSET of the grid's record, HSET and
     PEXPIREAT of the ticket; the call's entry of the unjournaled sales is one HSET a call),
     with no logic around them;
   - `capsvc_sell`: the sale itself, called through `Store.sell` as a worker calls it
     (the sales queued in one tick go in one call: batches of up to 64 here).
2. The sale's sections under the service: a copy of the library whose `capsvc_sell` reads
   Redis TIME (µs) between its steps replaces the library of a running capsvc worker
   driven by wrk (bench/one_grid.lua, 64 connections) for `--seconds`, and prints the µs a
   sale spends in each step, net of what reading the clock costs (the `empty` step).

Prints figures; asserts nothing. The hash seed is fixed (PYTHONHASHSEED=0; the process
re-executes itself to set it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

from run import config_file, cpu_seconds, with_fixed_hash_seed, wrk

from capsvc.domain import combination
from capsvc.domain.validator import Sale, SaleGrid, pack_sale
from capsvc.redis.store import (
    Store,
    bucket_keys,
    ident_of,
    lua_source,
    record_bucket_of,
    stops_key,
    ticket_key,
)
from capsvc.redis.transport import Coalescer

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository: tests.support
from tests.support.sales import sell_alone
from tests.support.servers import RedisServer
from tests.support.service import ServiceProcess

GAME, DRAW, CAP, MIN_STAKE = "fdj-keno", 13179, 5000, 100


def sales(prefix: str, count: int, seed: int) -> list[Sale]:
    """`count` new one-draw tickets of one capped grid (8-10 numbers, a random stake)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        numbers = tuple(sorted(rng.sample(range(1, 71), rng.randint(8, 10))))
        stake = rng.choice([100, 200, 300, 500, 1000])
        grid = SaleGrid(0, numbers, combination.encode(numbers), stake, False, stake, True)
        out.append(Sale(ticket_id=f"{prefix}-{i:07d}", game=GAME, player_id=None,
                        first_draw=DRAW, draws=1, grids=(grid,), joker_plus=False,
                        joker_cost=0, asked=True))
    return out


async def round_of(store: Store, batch: list[Sale]) -> None:
    """`batch` sold through `Store.sell` as a worker sells (200 at a time: the sales of one
    tick go up to 64 a call)."""
    far = int(time.time() * 1000) + 86_400_000
    for start in range(0, len(batch), 200):
        await asyncio.gather(*[
            sell_alone(store, ticket_key("bench", s.ticket_id), pack_sale(s), far, far,
                       60_000, GAME, DRAW, 1, CAP, MIN_STAKE,
                       [(g.combo, g.stake) for g in s.grids], [far], "Europe/Paris",
                       fix_caps=False)
            for s in batch[start:start + 200]])

FLOOR = r"""#!lua name=floor
local function noop(keys, args)
  return 1
end
local function commands(keys, args)
  local t = redis.call('TIME')
  redis.call('HGET', keys[1], args[1])
  redis.call('HMGET', keys[3], args[9])
  redis.call('HINCRBY', keys[2], args[7], args[8])
  redis.call('HSET', keys[2], '\0' .. args[5] .. '\0', args[8])
  redis.call('HSET', keys[1], args[1], cmsgpack.pack(args[10], 'f', args[2], t[1], args[4],
             args[3], false, '1'))
  redis.call('PEXPIREAT', keys[1], args[10])
  return 1
end
redis.register_function('floor_noop', noop)
redis.register_function('floor_commands', commands)
"""

# capsvc_sell's steps: after the line starting with the anchor, the step named ends (the
# sections are timed from one mark to the next).
SECTIONS = [
    ("  local now = now_ms()", "time"),
    ("  local replies = {now}", "shapes"),
    ("  local found = call('HMGET', bucket, field, '!')", "ticket read"),
    ("    S.stops = stops", "stops HMGET"),
    ("  local res = grids > 1 and {}", "arguments"),
    ("  local results = S.zone .. (res and", "grids (count, record)"),
    ("  decided(S, bucket, field, found[2], packed, results, batch)",
     "ticket record (HSET, bucket TTL), unjournaled queued"),
    ("    call('HSET', keys[#keys - 1], args[#args - 1]", "unjournaled HSET"),
]
CLOCK = """
local acc, times, mark_end = {}, {}, 0
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function mark(name)
  local now = clock()
  if name then
    acc[name] = (acc[name] or 0) + (now - mark_end)
    times[name] = (times[name] or 0) + 1
  end
  mark_end = clock()
end
local function sections(keys, args)
  local out = {}
  for name, us in pairs(acc) do
    out[#out + 1] = name
    out[#out + 1] = tostring(us)
    out[#out + 1] = tostring(times[name])
  end
  if args[1] == 'reset' then
    acc, times = {}, {}
  end
  return out
end
"""


def timed_library() -> str:
    """The library with marks between capsvc_sell's steps (and one empty step first)."""
    source = lua_source()
    start = source.index("local function shape_of(keys, k, args, a)")
    end = source.index("\n--[[ RESTORE", start)
    lines = source[start:end].split("\n")
    out = []
    anchors = dict(SECTIONS)
    found = set()
    for line in lines:
        if line.startswith("  return {'new', now, sid"):
            out.append("  mark('aggregates')")
        out.append(line)
        if line.startswith("local function sell(keys, args)"):
            out += ["  mark(nil)", "  mark('empty')"]
        for anchor, name in anchors.items():
            if line.startswith(anchor) and name not in found:
                out.append(f"  mark('{name}')")
                found.add(name)
    missing = set(anchors.values()) - found
    if missing:
        raise SystemExit(f"capsvc_sell changed: no anchor for {sorted(missing)} (SECTIONS)")
    timed = source[:start] + CLOCK + "\n".join(out) + source[end:]
    return timed.replace("register_marked('capsvc_sell', sell)",
                         "register_marked('capsvc_sell', sell)\n"
                         "redis.register_function('capsvc_sections', sections)")


def floor_args(i: int, far: int) -> list[object]:
    """3 keys and 10 arguments shaped like a one-grid sale's in a batch (lua/capsvc.lua,
    sell: what the batch's sales of one draw share is sent once a call, not counted)."""
    key = ticket_key("bench", f"F-{i}")
    combo = "\x01\x02\x03\x04\x05\x06\x07" + chr(8 + i % 60)
    keys = [record_bucket_of(key), bucket_keys(GAME, combo, DRAW, 1)[0], stops_key(GAME)]
    nonce = os.urandom(8)
    args = [ident_of(key), f"{i:032x}", os.urandom(50), nonce.hex(), nonce, 1, combo, 500,
            DRAW, far]
    return [len(keys), *keys, *args]


async def floor(calls: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    server = RedisServer().start()
    try:
        client = server.client()
        pid = int(client.info("server")["process_id"])
        redis = Coalescer(server.url, timeout_s=30, library=lua_source())
        store = Store(redis)
        far = int(time.time() * 1000) + 86_400_000
        out: dict[str, list[tuple[float, float]]] = {"noop": [], "commands": [],
                                                     "capsvc_sell": []}
        for r in range(rounds):
            names = list(out)[r % 3:] + list(out)[:r % 3]
            for name in names:
                client.flushall()
                await store.load_library()
                client.function_load(FLOOR, replace=True)
                client.config_resetstat()
                before = cpu_seconds(pid)
                if name == "capsvc_sell":
                    await round_of(store, sales(f"S{r}", calls, seed=r))
                else:
                    for start in range(0, calls, 200):
                        await asyncio.gather(*[
                            redis.submit("FCALL", f"floor_{name}", *floor_args(i, far))
                            for i in range(start, min(start + 200, calls))])
                cpu = (cpu_seconds(pid) - before) / calls * 1e6
                fcall = float(client.info("commandstats")["cmdstat_fcall"]["usec"]) / calls
                out[name].append((cpu, fcall))
        await redis.aclose()
        return out
    finally:
        server.stop()


def sections(seconds: int) -> tuple[float, dict[str, float], int, float]:
    """µs a sale spends in each step of capsvc_sell under a worker driven by wrk (net of
    reading the clock), FCALL µs a sale, sales, and what one step's clock reads cost."""
    server = RedisServer().start()
    service = ServiceProcess(config_file(), server.url).start()
    try:
        client = server.client()
        wrk(service.base_url, 3, 64, "warm", "one_grid.lua")  # the worker loaded its library
        client.function_load(timed_library(), replace=True)
        wrk(service.base_url, 1, 64, "warm2", "one_grid.lua")
        client.fcall("capsvc_sections", 0, "reset")
        client.config_resetstat()
        result = wrk(service.base_url, seconds, 64, "timed", "one_grid.lua")
        stat = client.info("commandstats")["cmdstat_fcall"]
        fcall = float(stat["usec"]) / result.requests
        raw = client.fcall("capsvc_sections", 0, "read")
        steps = {raw[i].decode(): (int(raw[i + 1]), int(raw[i + 2]))
                 for i in range(0, len(raw), 3)}
        us, times = steps.pop("empty")
        clock = us / times
        return fcall, {name: (us - times * clock) / result.requests
                       for name, (us, times) in steps.items()}, result.requests, clock
    finally:
        service.stop()
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=10)
    args = parser.parse_args()
    rerun = with_fixed_hash_seed()
    if rerun is not None:
        return rerun
    results = asyncio.run(floor(args.calls, args.rounds))
    print(f"1. the floor: {args.calls} calls a round, {args.rounds} rounds alternating "
          "(medians; Redis CPU from /proc, FCALL from INFO commandstats)")
    sell_cpu = statistics.median(c for c, _ in results["capsvc_sell"])
    for name, rows in results.items():
        cpu = statistics.median(c for c, _ in rows)
        fcall = statistics.median(f for _, f in rows)
        print(f"  {name:12} Redis CPU {cpu:6.1f} µs a sale ({cpu / sell_cpu:4.0%} of the "
              f"sale's)  FCALL {fcall:6.1f} µs   rounds: "
              + ", ".join(f"{c:.1f}" for c, _ in rows))
    fcall, steps, sold, clock = sections(args.seconds)
    print(f"2. capsvc_sell's steps under one worker and wrk (one grid, {sold} sales, sent "
          f"in batches of the sales of one tick; FCALL {fcall:.1f} µs a sale, the clock "
          f"read twice a step): µs a sale, net of reading the clock ({clock:.2f} µs a step)")
    for name, us in sorted(steps.items(), key=lambda kv: -kv[1]):
        print(f"  {name:32} {us:6.2f}")
    net = sum(steps.values())
    print(f"  {'all the steps':32} {net:6.2f}; the rest of the call and the clock reads "
          f"{fcall - net:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
