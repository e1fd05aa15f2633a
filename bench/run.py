"""Side-by-side throughput and latency of capsvc and of a bare aiohttp+msgspec handler.

    python bench/run.py [--seconds 10] [--connections 64] [--rounds 2]

Starts a redis-server, one capsvc worker and the bare handler (bench/bare.py), then drives
each with wrk and the same seeded ticket generator (bench/tickets.lua), alternating the
targets round by round. Each server is pinned to CPU 0; wrk and Redis share CPU 1. Prints
tickets/s, p50/p99 latency, errors, Redis commands per ticket, and the capsvc/bare ratio.
Asserts nothing about speed: it reports figures measured in one run.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from capsvc.testing import RedisServer, ServiceProcess, free_port

HERE = Path(__file__).resolve().parent
TOKEN = "bench-token"


def config_file() -> str:
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    text = f"""
[server]
max_in_flight = 100000

[[games]]
id = "fdj-keno"
preset = "fdj-keno-2008"

[[channels]]
id = "bench"
token_sha256 = "{digest}"
games = ["fdj-keno"]
scopes = ["sell", "read"]
"""
    path = Path(tempfile.mkdtemp(prefix="capsvc-bench-")) / "bench.toml"
    path.write_text(text)
    return str(path)


@dataclass
class Result:
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int
    server_cpu_us: float = 0.0
    """Server CPU per ticket (µs)."""
    server_busy: float = 0.0
    """Share of the run the server spent on the CPU (1.0: CPU-bound)."""


def _ms(value: str) -> float:
    m = re.match(r"([\d.]+)(us|ms|s)", value)
    assert m, value
    return float(m.group(1)) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[m.group(2)]


def wrk(url: str, seconds: int, connections: int, prefix: str) -> Result:
    out = subprocess.run(
        ["taskset", "-c", "1", "wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency",
         "-s", str(HERE / "tickets.lua"), url, "--", TOKEN, prefix, "42"],
        capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _ms(re.search(r"50%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"99%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = (int(bad.group(1)) if bad else 0) + (
        sum(int(x) for x in sock.groups()) if sock else 0)
    return Result(rps, p50, p99, total, errors)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def redis_calls(server: RedisServer) -> int:
    stats = server.client().info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items()
               if k not in ("cmdstat_info", "cmdstat_ping"))


def pinned(cmd: list[str], cpu: str) -> list[str]:
    return ["taskset", "-c", cpu, *cmd]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for tool in ("wrk", "taskset"):
        if shutil.which(tool) is None:
            package = "wrk" if tool == "wrk" else "util-linux"
            print(f"{tool} is needed: apt-get install -y {package}")
            return 2
    redis = RedisServer(binary=None).start()
    subprocess.run(["taskset", "-pc", "1", str(redis.process.pid)],  # type: ignore[union-attr]
                   check=True, capture_output=True)
    svc = ServiceProcess(config_file(), redis.url).start()
    subprocess.run(["taskset", "-pc", "0", str(svc.process.pid)],  # type: ignore[union-attr]
                   check=True, capture_output=True)
    bare_port = free_port()
    bare = subprocess.Popen(pinned([sys.executable, str(HERE / "bare.py"), str(bare_port)], "0"))
    time.sleep(1.5)
    targets = {"capsvc": svc.base_url, "bare": f"http://127.0.0.1:{bare_port}"}
    pids = {"capsvc": svc.process.pid, "bare": bare.pid}  # type: ignore[union-attr]
    results: dict[str, list[Result]] = {name: [] for name in targets}
    calls: list[float] = []
    try:
        for name, url in targets.items():  # warm-up
            wrk(url, 2, args.connections, f"warm-{name}")
        for r in range(args.rounds):
            for name, url in targets.items():
                before = redis_calls(redis) if name == "capsvc" else 0
                cpu_before = cpu_seconds(pids[name])
                res = wrk(url, args.seconds, args.connections, f"r{r}-{name}")
                cpu = cpu_seconds(pids[name]) - cpu_before
                res.server_cpu_us = 1e6 * cpu / max(res.requests, 1)
                res.server_busy = cpu / args.seconds
                if name == "capsvc":
                    calls.append((redis_calls(redis) - before) / max(res.requests, 1))
                results[name].append(res)
    finally:
        bare.terminate()
        svc.stop()
        redis.stop()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}; server on CPU 0, wrk and Redis on CPU 1")
    print(f"load: wrk -t1 -c{args.connections} -d{args.seconds}s, new FDJ tickets of 1-3 grids "
          f"(2-10 numbers), {args.rounds} alternating rounds, medians")
    print(f"{'target':<8} {'tickets/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7} "
          f"{'cpu µs/ticket':>14} {'cpu busy':>9}")
    med: dict[str, float] = {}
    for name, runs in results.items():
        med[name] = statistics.median(r.rps for r in runs)
        print(f"{name:<8} {med[name]:>10.0f} {statistics.median(r.p50_ms for r in runs):>8.2f} "
              f"{statistics.median(r.p99_ms for r in runs):>8.2f} "
              f"{sum(r.errors for r in runs):>7} "
              f"{statistics.median(r.server_cpu_us for r in runs):>14.0f} "
              f"{statistics.median(r.server_busy for r in runs):>9.2f}")
    print(f"capsvc / bare = {med['capsvc'] / med['bare']:.2f}")
    print(f"redis commands per ticket (capsvc) = {statistics.median(calls):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
