"""Sales per second in each durability mode, side by side in one run.

    python bench/durability.py [--seconds 10] [--connections 64] [--rounds 3]

Starts a primary redis-server and a replica of it, and two capsvc workers on the primary,
the same configuration in `default` mode and in `replicas:1` mode (CAPSVC_DURABILITY).
Drives each with wrk and one-grid tickets (bench/one_grid.lua: claim + reserve + decision),
alternating the modes round by round, then each once more under light load (4
connections) for the latency a sale pays for its WAIT. Pinning as in bench/run.py: the
services on CPU 0, wrk and the primary on CPU 1; the replica on CPU 2 if there is one, else
on CPU 1 as well. Prints both rates, the ratio, latency, errors and WAITs per sale; asserts
nothing about speed.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from run import Result, config_file, cpu_seconds, tools_present, wrk

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository: tests.support
from tests.support.servers import RedisServer
from tests.support.service import ServiceProcess

SCRIPT = "one_grid.lua"
MODES = ("default", "replicas:1")


def pin(pid: int, cpu: str) -> None:
    subprocess.run(["taskset", "-pc", cpu, str(pid)], check=True, capture_output=True)


def wait_calls(server: RedisServer) -> int:
    """WAIT commands the server has run so far."""
    stats = server.client().info("commandstats")
    return int(stats.get("cmdstat_wait", {}).get("calls", 0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not tools_present():
        return 2
    replica_cpu = "2" if (os.cpu_count() or 1) >= 3 else "1"
    primary = RedisServer().start()
    replica = RedisServer(replica_of=primary).start()
    version = primary.client().info("server")["redis_version"]
    services: dict[str, ServiceProcess] = {}
    try:
        assert primary.process is not None
        assert replica.process is not None
        pin(primary.process.pid, "1")
        pin(replica.process.pid, replica_cpu)
        config = config_file()
        for mode in MODES:
            svc = services[mode] = ServiceProcess(
                config, primary.url, env={"CAPSVC_DURABILITY": mode}).start()
            assert svc.process is not None
            pin(svc.process.pid, "0")
        results: dict[str, list[Result]] = {mode: [] for mode in MODES}
        waits: dict[str, list[float]] = {mode: [] for mode in MODES}
        light: dict[str, Result] = {}
        for mode, svc in services.items():  # warm-up
            wrk(svc.base_url, 2, args.connections, f"warm-{mode}", SCRIPT)
        for r in range(args.rounds):
            for mode, svc in services.items():
                assert svc.process is not None
                before, cpu_before = wait_calls(primary), cpu_seconds(svc.process.pid)
                res = wrk(svc.base_url, args.seconds, args.connections, f"r{r}-{mode}", SCRIPT)
                res.server_cpu_us = 1e6 * (cpu_seconds(svc.process.pid) - cpu_before) / max(
                    res.requests, 1)
                waits[mode].append((wait_calls(primary) - before) / max(res.requests, 1))
                results[mode].append(res)
        for mode, svc in services.items():
            light[mode] = wrk(svc.base_url, args.seconds, 4, f"light-{mode}", SCRIPT)
    finally:
        for svc in services.values():
            svc.stop()
        replica.stop()
        primary.stop()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, redis-server {version}; capsvc on "
          f"CPU 0, wrk and the primary on CPU 1, the replica on CPU {replica_cpu}")
    print(f"load: wrk -t1 -c{args.connections} -d{args.seconds}s, bench/{SCRIPT} (one grid of "
          f"8-10 numbers), {args.rounds} alternating rounds, medians; light load: -c4")
    print(f"{'mode':<11} {'sales/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'errors':>7} "
          f"{'cpu µs/sale':>11} {'WAIT/sale':>9} | {'light: sales/s':>14} {'p50 ms':>7} "
          f"{'p99 ms':>7}")
    rate: dict[str, float] = {}
    for mode, runs in results.items():
        rate[mode] = statistics.median(r.rps for r in runs)
        lo = light[mode]
        print(f"{mode:<11} {rate[mode]:>8.0f} {statistics.median(r.p50_ms for r in runs):>7.2f} "
              f"{statistics.median(r.p99_ms for r in runs):>7.2f} "
              f"{sum(r.errors for r in runs) + lo.errors:>7} "
              f"{statistics.median(r.server_cpu_us for r in runs):>11.0f} "
              f"{statistics.median(waits[mode]):>9.3f} | {lo.rps:>14.0f} {lo.p50_ms:>7.2f} "
              f"{lo.p99_ms:>7.2f}")
    print(f"replicas:1 / default = {rate['replicas:1'] / rate['default']:.2f} (saturated), "
          f"{light['replicas:1'].rps / light['default'].rps:.2f} (light load)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
