"""Tickets a second in batches of 1, 8, 64 and 256 one-grid tickets, against the bare
handler, side by side in one run.

    python bench/batches.py [--sizes 1,8,64,256] [--seconds 5] [--rounds 3] [--journal on|off]

One `capsvc serve` (one worker, pinned to CPU 0, PYTHONHASHSEED=0) on a redis-server of its
own, and bench/bare.py (also on CPU 0); wrk (one thread, 64 connections) and Redis on CPU 1.
Batch size 1 is `POST /v1/tickets` (bench/one_grid.lua); the others `POST
/v1/ticket-batches` (bench/batch.lua). Round after round, each target in turn. Prints per
target the median tickets/s (requests/s times tickets a request), p50/p99 per request, server
CPU, Redis CPU and Redis commands per ticket, and tickets/s ÷ the bare handler's requests/s.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from run import (
    HERE,
    TOKEN,
    config_file,
    cpu_seconds,
    pinned,
    redis_side,
    tools_present,
    wait_listening,
    with_fixed_hash_seed,
)

sys.path.append(str(Path(__file__).resolve().parents[1]))
from tests.support.servers import RedisServer, free_port
from tests.support.service import ServiceProcess

CONNECTIONS = 64


def wrk(url: str, seconds: int, prefix: str, size: int) -> tuple[float, float, float]:
    """(requests/s, p50 ms, p99 ms) of one wrk run; `size` 0: the bare handler."""
    script = "one_grid.lua" if size <= 1 else "batch.lua"
    out = subprocess.run(
        ["taskset", "-c", "1", "wrk", "-t1", f"-c{CONNECTIONS}", f"-d{seconds}s", "-s",
         str(HERE / script), url, "--", TOKEN, prefix, "42", "0", str(max(size, 1))],
        capture_output=True, text=True, check=True).stdout
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50, _, p99 = (float(x) / 1000 for x in re.findall(r"PERCENTILES (\S+) (\S+) (\S+)",
                                                        out)[0])
    return rate, p50, p99


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,8,64,256")
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--journal", choices=["on", "off"], default="on")
    args = parser.parse_args()
    rerun = with_fixed_hash_seed()
    if rerun is not None:
        return rerun
    if not tools_present():
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    redis = RedisServer().start()
    assert redis.process is not None
    subprocess.run(["taskset", "-pc", "1", str(redis.process.pid)], check=True,
                   capture_output=True)
    svc = ServiceProcess(config_file(journal=args.journal == "on"), redis.url, env=env).start()
    assert svc.process is not None
    subprocess.run(["taskset", "-pc", "0", str(svc.process.pid)], check=True,
                   capture_output=True)
    port = free_port()
    bare = subprocess.Popen(pinned([sys.executable, str(HERE / "bare.py"), str(port)], "0"),
                            env=env)
    rows: dict[str, list[tuple[float, float, float, float, float, float]]] = {}
    try:
        wait_listening(port)
        bare_url = f"http://127.0.0.1:{port}"
        targets = [(f"batch {n}", n) for n in sizes] + [("bare", 0)]
        for _, n in targets:  # warm-up
            wrk(bare_url if n == 0 else svc.base_url, 2, f"warm{n}", n)
        for r in range(args.rounds):
            for name, n in targets[r % len(targets):] + targets[:r % len(targets)]:
                url = bare_url if n == 0 else svc.base_url
                before = redis_side(redis) if n else None
                cpu = cpu_seconds(bare.pid if n == 0 else svc.process.pid)
                rate, p50, p99 = wrk(url, args.seconds, f"b{r}n{n}", n)
                tickets = rate * max(n, 1) * args.seconds
                server = 1e6 * (cpu_seconds(bare.pid if n == 0 else svc.process.pid) - cpu)
                redis_us = cmds = 0.0
                if before is not None:
                    after = redis_side(redis)
                    redis_us = 1e6 * (after["cpu"] - before["cpu"]) / max(tickets, 1)
                    cmds = (after["executed"] - before["executed"]) / max(tickets, 1)
                rows.setdefault(name, []).append(
                    (rate * max(n, 1), p50, p99, server / max(tickets, 1), redis_us, cmds))
    finally:
        bare.terminate()
        svc.stop()
        redis.stop()
    bare_rate = statistics.median(row[0] for row in rows["bare"])
    print(f"one-grid tickets, journal {args.journal}: wrk -t1 -c{CONNECTIONS} "
          f"-d{args.seconds}s, {args.rounds} rounds alternating, medians; capsvc and the bare "
          "handler on CPU 0, wrk and Redis on CPU 1")
    print(f"{'target':10} {'tickets/s':>10} {'p50 ms':>7} {'p99 ms':>7} {'cpu µs/t':>9} "
          f"{'redis µs/t':>10} {'cmds/t':>7} {'/ bare':>7}")
    for name, values in rows.items():
        med = [statistics.median(v[i] for v in values) for i in range(6)]
        print(f"{name:10} {med[0]:10.0f} {med[1]:7.2f} {med[2]:7.2f} {med[3]:9.1f} "
              f"{med[4]:10.1f} {med[5]:7.1f} {med[0] / bare_rate:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
