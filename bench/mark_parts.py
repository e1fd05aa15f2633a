"""What each part of the mark costs in Redis, by ablation, side by side.

    python bench/mark_parts.py [--calls 100000] [--rounds 6]

On one redis-server (AOF on), a library of test functions built from lua/capsvc.lua's
MARKS section: a plain function (an HSET, an HINCRBY and a TIME: a write as a sale makes
several) registered as is and run as a marked call of one through `calls`, and variants of
`calls` with one part of the mark taken out: the read (the HMGET of G, the announcement, the
caller's field and count), the write (the HSET of G, the field and the count), both (the
wrapping alone). FCALLs are pipelined, rounds alternate the variants; prints per variant
the median Redis CPU (from /proc) and FCALL time (INFO commandstats) per call, and what it
adds over the plain function. Asserts nothing. The hash seed is fixed (PYTHONHASHSEED=0).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from run import cpu_seconds, with_fixed_hash_seed

sys.path.append(str(Path(__file__).resolve().parents[1]))
from tests.support.servers import RedisServer

LUA = Path(__file__).resolve().parents[1] / "lua" / "capsvc.lua"
PLAIN = """
local function plain(keys, args)
  redis.call('HSET', keys[1], args[1], args[2])
  redis.call('HINCRBY', keys[1], 'n', 1)
  redis.call('TIME')
  return {1, 2, 3}
end
"""
READ = "local refused, g, last, q = mark_refusal(mark, life, seen)"
WRITE = "call('HSET', mark, '*', g, life, g, last, q)"


def library() -> str:
    """The test library: the MARKS section (and what it needs), the plain function, and a
    function per variant."""
    source = LUA.read_text()
    section = source[source.index("local call, "):
                     source.index("--[[ marks: KEYS mark")]
    if READ not in section or WRITE not in section:
        raise SystemExit("lua/capsvc.lua's MARKS section changed: update bench/mark_parts.py")
    unread = "local refused, g, last, q = nil, 0, '#x', 0"
    variants = {
        "marked": section,
        "no_read": section.replace(READ, unread),
        "no_write": section.replace(WRITE, ""),
        "wrap_only": section.replace(READ, unread)
                            .replace(WRITE, ""),
    }
    parts = ["#!lua name=markparts", PLAIN, "redis.register_function('plain', plain)"]
    for name, text in variants.items():
        parts += [f"do\n{text}\nMARKED.plain = plain\n"
                  f"redis.register_function('{name}', function(keys, args)\n"
                  f"  if not call then bind() end\n  return calls(keys, args)\nend)\nend"]
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    rerun = with_fixed_hash_seed()
    if rerun is not None:
        return rerun
    server = RedisServer().start()
    try:
        client = server.client()
        client.function_load(library(), replace=True)
        pid = int(client.info("server")["process_id"])
        names = ["plain", "marked", "no_read", "no_write", "wrap_only"]
        out: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                client.flushall()
                client.config_resetstat()
                before = cpu_seconds(pid)
                for start in range(0, args.calls, 1000):
                    pipe = client.pipeline(transaction=False)
                    for i in range(start, start + 1000):
                        field, value = f"f{i % 1000}", "x" * 200
                        if name == "plain":
                            pipe.fcall("plain", 1, "h", field, value)
                        else:
                            pipe.fcall(name, 1, "h", "", "life1234abcd5678", 0, "plain",
                                       2, "h", "m:{marks}", 2, field, value,
                                       f"0:0:0:{i + 1}")
                    pipe.execute()
                cpu = (cpu_seconds(pid) - before) / args.calls * 1e6
                fcall = client.info("commandstats")["cmdstat_fcall"]["usec_per_call"]
                out[name].append((cpu, float(fcall)))
    finally:
        server.stop()
    base = statistics.median(c for c, _ in out["plain"])
    base_f = statistics.median(f for _, f in out["plain"])
    print(f"{args.calls} pipelined FCALLs a round, {args.rounds} rounds alternating (medians)")
    for name in names:
        cpu = statistics.median(c for c, _ in out[name])
        fcall = statistics.median(f for _, f in out[name])
        print(f"  {name:10} Redis CPU {cpu:6.2f} µs ({cpu - base:+.2f})   FCALL {fcall:6.2f} µs "
              f"({fcall - base_f:+.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
