"""What a Redis Cluster primary spends on a sale's marked step, by how many steps a read of
it carries, and whether they come as that many calls or as one.

    python bench/node_calls.py [--steps 20000] [--rounds 4]

On a local 3-primary cluster, the first primary pinned to CPU 1 (this script to CPU 0):
`capsvc_reserve` of a one-grid ticket, each step on a counter bucket of a slot of its own
(as a batch's grids are), with its slot's mark and its primary's count, as a process sends
them. Variants, alternating round by round:

- `k calls a read`: k FCALLs pipelined, then their replies read (what the transport sends
  for the steps a tick queued for a node);
- `one call of k`: the k steps in one FCALL of a test function appended to the library,
  each step's mark checked and counted, the primary's count read and counted once a call
  (what "the batch's steps one call a node" sends);
- `one call of k, marks whole`: the same, each step wrapped by `marked` as a call of its
  own is (its primary's count too).

Prints the primary's CPU (from /proc) a step, median of the rounds. Asserts nothing. The
hash seed is fixed (PYTHONHASHSEED=0).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from run import cpu_seconds, with_fixed_hash_seed

sys.path.append(str(Path(__file__).resolve().parents[1]))
from capsvc.redis.cluster import slot_of
from capsvc.redis.marks import mark_of_slot, node_of_slot
from capsvc.redis.store import COUNTER_BUCKETS, counter_key, lua_source
from tests.support.servers import RedisCluster

MANY = """
local marked_reserve = marked(reserve)

-- ARGV: node, life, n, then each step's number of KEYS and of ARGV, what it knows of its
-- mark ("<G>:<own>:<sent>:<N>"), its KEYS (its mark last) and its ARGV.
local function steps_of(args)
  local out, a = {}, 4
  for i = 1, tonumber(args[3]) do
    local nk, na = tonumber(args[a]), tonumber(args[a + 1])
    out[i] = {seen = args[a + 2], keys = {unpack(args, a + 3, a + 2 + nk)},
              args = {unpack(args, a + 3 + nk, a + 2 + nk + na)}}
    a = a + 3 + nk + na
  end
  return out
end

local function bench_many(keys, args)
  local node, life = args[1], args[2]
  local n = redis.call('HMGET', node, '*', '!')
  if restoring(n[2]) then
    return redis.error_reply('RESTORING')
  end
  local out = {}
  for i, step in ipairs(steps_of(args)) do
    local mark = table.remove(step.keys)
    local refused, g, last, q = mark_refusal(mark, '', life, step.seen)
    if refused then
      out[i] = refused
    else
      local reply = reserve(step.keys, step.args)
      g = g + 1
      redis.call('HSET', mark, '*', g, life, g, last, q)
      out[i] = {g, reply}
    end
  end
  return {redis.call('HINCRBY', node, '*', #out), out}
end

local function bench_many_whole(keys, args)
  local out = {}
  for i, step in ipairs(steps_of(args)) do
    step.args[#step.args + 1] = args[1]
    step.args[#step.args + 1] = args[2]
    step.args[#step.args + 1] = step.seen
    out[i] = marked_reserve(step.keys, step.args)
  end
  return out
end

redis.register_function{function_name = 'bench_many', callback = bench_many,
                        flags = {'allow-cross-slot-keys'}}
redis.register_function{function_name = 'bench_many_whole', callback = bench_many_whole,
                        flags = {'allow-cross-slot-keys'}}
"""
SIZES = (1, 3, 10, 30)
FAR = 10**13


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    rerun = with_fixed_hash_seed()
    if rerun is not None:
        return rerun
    cluster = RedisCluster().start()
    try:
        for server in cluster.servers:
            server.client().function_load(lua_source() + MANY, replace=True)
        primary = cluster.servers[0]
        client = primary.client()
        pid = int(client.info("server")["process_id"])
        os.sched_setaffinity(pid, {1})
        os.sched_setaffinity(0, {0})
        owned = sorted(s for start, end, *_ in _ranges(client, primary.port)
                       for s in range(start, end + 1))
        node = node_of_slot(owned[-1])
        buckets = [b for b in range(COUNTER_BUCKETS)
                   if slot_of(counter_key("fdj-keno", b, 1)) in set(owned)]
        rng = random.Random(1)
        made = 0

        def step() -> tuple[list[Any], list[Any]]:
            nonlocal made
            made += 1
            key = counter_key("fdj-keno", buckets[made % len(buckets)], 1)
            combo = bytes(rng.sample(range(1, 71), 8)).decode("latin-1")
            return ([key, mark_of_slot(slot_of(key))],
                    [b"\0" + made.to_bytes(8, "big") + b"\0", combo, 100, 10**9, FAR, 100,
                     FAR])

        variants = [(f"{k} calls a read", k, "") for k in SIZES] + [
            (f"one call of {k}", k, "bench_many") for k in SIZES[1:]] + [
            (f"one call of {k}, marks whole", k, "bench_many_whole") for k in SIZES[1:]]
        out: dict[str, list[float]] = {name: [] for name, _, _ in variants}
        for r in range(args.rounds):
            for name, k, function in variants[r % len(variants):] + variants[:r % len(variants)]:
                before = cpu_seconds(pid)
                for _ in range(args.steps // k):
                    pipe = client.pipeline(transaction=False)
                    if not function:
                        for _ in range(k):
                            keys, argv = step()
                            pipe.fcall("capsvc_reserve", len(keys), *keys, *argv, node,
                                       "life", f"0:0:0:{made}:0")
                    else:
                        flat: list[Any] = []
                        for _ in range(k):
                            keys, argv = step()
                            flat += [len(keys), len(argv), f"0:0:0:{made}:0", *keys, *argv]
                        pipe.fcall(function, 1, flat[3], node, "life", k, *flat)
                    for reply in pipe.execute(raise_on_error=False):
                        if isinstance(reply, Exception):
                            raise SystemExit(f"{name}: {reply}")
                out[name].append((cpu_seconds(pid) - before) / (args.steps // k * k) * 1e6)
    finally:
        cluster.stop()
    print(f"{args.steps} steps a variant and round, {args.rounds} rounds alternating "
          "(medians); the primary's CPU a step:")
    for name, _, _ in variants:
        print(f"  {name:28} {statistics.median(out[name]):6.1f} µs")
    return 0


def _ranges(client: Any, port: int) -> list[tuple[int, int]]:
    """The slot ranges the primary on `port` serves."""
    return [(int(start), int(end)) for start, end, primary, *_ in
            client.execute_command("CLUSTER", "SLOTS") if int(primary[1]) == port]


if __name__ == "__main__":
    sys.exit(main())
