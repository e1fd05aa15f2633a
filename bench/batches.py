"""Tickets a second in batches of 1, 8, 64 and 256 tickets, against the bare handler, side
by side in one run.

    python bench/batches.py [--sizes 1,8,64,256] [--seconds 5] [--rounds 3]
                            [--journal on|off] [--workload one-grid|mix] [--workers 1|2]
                            [--cluster] [--paced 0.7]

One `capsvc serve` (PYTHONHASHSEED=0) on a redis-server of its own (`--cluster`: a local
3-primary Redis Cluster), and bench/bare.py. With one worker, capsvc and the bare handler
on CPU 0, wrk (one thread, 64 connections) and Redis on CPU 1; with `--workers 2`, nothing
pinned: the workers, Redis, the journal and wrk share both cores. Batch size 1 is `POST
/v1/tickets` (bench/one_grid.lua or bench/tickets.lua); the others `POST
/v1/ticket-batches` (bench/batch.lua), of one-grid tickets or of the realistic mix
(`--workload mix`: 1-5 grids, subscriptions, a hot set at its cap). Round after round, each
target in turn. Prints per target the median tickets/s (requests/s times tickets a
request), p50/p99 per request, capsvc's CPU (all its processes), Redis CPU and Redis
commands per ticket (all nodes), and tickets/s ÷ the bare handler's requests/s. With
`--paced F`, then one run per target paced to F times its median request rate (each connection
pausing between requests), with the rate it reached and its p50/p99. Asserts nothing.
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
from tests.support.servers import RedisCluster, RedisServer, free_port
from tests.support.service import ServiceProcess

CONNECTIONS = 64


def wrk(url: str, seconds: int, prefix: str, size: int, workload: str, cpu: str | None,
        pause_ms: float = 0.0) -> tuple[float, float, float]:
    """(requests/s, p50 ms, p99 ms) of one wrk run; `size` 0: the bare handler."""
    if size == 0:
        script, extra = "one_grid.lua", ["1"]
    elif size == 1:
        script, extra = ("tickets.lua" if workload == "mix" else "one_grid.lua"), ["1"]
    else:
        script, extra = "batch.lua", [str(size), workload]
    cmd = ["wrk", "-t1", f"-c{CONNECTIONS}", f"-d{seconds}s", "-s", str(HERE / script), url,
           "--", TOKEN, prefix, "42", f"{pause_ms:.3f}", *extra]
    out = subprocess.run(pinned(cmd, cpu) if cpu else cmd, capture_output=True, text=True,
                         check=True).stdout
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50, _, p99 = (float(x) / 1000 for x in re.findall(r"PERCENTILES (\S+) (\S+) (\S+)",
                                                        out)[0])
    return rate, p50, p99


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and of its children (a master and its workers)."""
    total = cpu_seconds(pid)
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in task.read_text().split():
            total += tree_cpu_seconds(int(child))
    return total


class Redis:
    """The Redis the service sells on: one server, or a local 3-primary cluster."""

    def __init__(self, cluster: bool, cpu: str | None) -> None:
        self.cluster = RedisCluster().start() if cluster else None
        self.servers = (self.cluster.servers if self.cluster is not None
                        else [RedisServer().start()])
        self.url = self.cluster.url if self.cluster is not None else self.servers[0].url
        for server in self.servers:
            assert server.process is not None
            if cpu:
                subprocess.run(["taskset", "-pc", cpu, str(server.process.pid)], check=True,
                               capture_output=True)

    def side(self) -> dict[str, float]:
        """Commands executed and CPU seconds, all nodes."""
        sides = [redis_side(server) for server in self.servers]
        return {k: sum(side[k] for side in sides) for k in sides[0]}

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        else:
            self.servers[0].stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,8,64,256")
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--journal", choices=["on", "off"], default="on")
    parser.add_argument("--workload", choices=["one-grid", "mix"], default="one-grid")
    parser.add_argument("--workers", type=int, choices=[1, 2], default=1)
    parser.add_argument("--cluster", action="store_true")
    parser.add_argument("--paced", type=float, default=0.0,
                        help="then one run per target at this fraction of its rate")
    args = parser.parse_args()
    rerun = with_fixed_hash_seed()
    if rerun is not None:
        return rerun
    if not tools_present():
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    one = args.workers == 1
    server_cpu, side_cpu = ("0", "1") if one else (None, None)
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    redis = Redis(args.cluster, side_cpu)
    svc = ServiceProcess(config_file(journal=args.journal == "on"), redis.url, env=env,
                         args=("--workers", str(args.workers))).start()
    assert svc.process is not None
    if server_cpu:
        subprocess.run(["taskset", "-pc", server_cpu, str(svc.process.pid)], check=True,
                       capture_output=True)
    port = free_port()
    bare_cmd = [sys.executable, str(HERE / "bare.py"), str(port)]
    bare = subprocess.Popen(pinned(bare_cmd, server_cpu) if server_cpu else bare_cmd, env=env)
    rows: dict[str, list[tuple[float, float, float, float, float, float]]] = {}
    paced: dict[str, tuple[float, float, float]] = {}
    targets = [(f"batch {n}", n) for n in sizes] + [("bare", 0)]
    try:
        wait_listening(port)
        bare_url = f"http://127.0.0.1:{port}"

        def url_of(n: int) -> str:
            return bare_url if n == 0 else svc.base_url

        for _, n in targets:  # warm-up
            wrk(url_of(n), 2, f"warm{n}", n, args.workload, side_cpu)
        for r in range(args.rounds):
            for name, n in targets[r % len(targets):] + targets[:r % len(targets)]:
                pid = bare.pid if n == 0 else svc.process.pid
                before = redis.side() if n else None
                cpu = tree_cpu_seconds(pid)
                rate, p50, p99 = wrk(url_of(n), args.seconds, f"b{r}n{n}", n, args.workload,
                                     side_cpu)
                tickets = rate * max(n, 1) * args.seconds
                server = 1e6 * (tree_cpu_seconds(pid) - cpu)
                redis_us = cmds = 0.0
                if before is not None:
                    after = redis.side()
                    redis_us = 1e6 * (after["cpu"] - before["cpu"]) / max(tickets, 1)
                    cmds = (after["executed"] - before["executed"]) / max(tickets, 1)
                rows.setdefault(name, []).append(
                    (rate * max(n, 1), p50, p99, server / max(tickets, 1), redis_us, cmds))
        if args.paced:
            for name, n in targets:
                if n == 0:
                    continue
                peak = statistics.median(v[0] for v in rows[name]) / max(n, 1)
                # A connection's cycle is its answer's latency plus its pause; the latency
                # at the paced rate is unknown until measured: one run, then one corrected.
                pause_ms = 1000 * CONNECTIONS / (args.paced * peak)
                for attempt in range(2):
                    rate, p50, p99 = wrk(url_of(n), args.seconds, f"p{attempt}n{n}", n,
                                         args.workload, side_cpu, pause_ms)
                    pause_ms = max(0.0, pause_ms * rate / (args.paced * peak))
                paced[name] = (rate * max(n, 1), p50, p99)
    finally:
        bare.terminate()
        svc.stop()
        redis.stop()
    bare_rate = statistics.median(row[0] for row in rows["bare"])
    where = ("capsvc and the bare handler on CPU 0, wrk and Redis on CPU 1" if one else
             "nothing pinned: capsvc's workers, Redis, the journal and wrk share the cores")
    print(f"{args.workload} tickets, journal {args.journal}, {args.workers} worker(s), "
          f"{'a 3-primary Redis Cluster' if args.cluster else 'one Redis'}: wrk -t1 "
          f"-c{CONNECTIONS} -d{args.seconds}s, {args.rounds} rounds alternating, medians; "
          f"{where}")
    print(f"{'target':10} {'tickets/s':>10} {'p50 ms':>7} {'p99 ms':>7} {'cpu µs/t':>9} "
          f"{'redis µs/t':>10} {'cmds/t':>7} {'/ bare':>7}")
    for name, values in rows.items():
        med = [statistics.median(v[i] for v in values) for i in range(6)]
        print(f"{name:10} {med[0]:10.0f} {med[1]:7.2f} {med[2]:7.2f} {med[3]:9.1f} "
              f"{med[4]:10.1f} {med[5]:7.1f} {med[0] / bare_rate:7.3f}")
    if paced:
        print(f"paced to {args.paced:.0%} of each target's rate (one run):")
        for name, (rate, p50, p99) in paced.items():
            peak = statistics.median(v[0] for v in rows[name])
            print(f"{name:10} {rate:10.0f} tickets/s ({rate / peak:4.0%} of its peak), "
                  f"p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
