"""The journal's cost, side by side in one run: journal on against journal off.

    python bench/journal.py [--seconds 10] [--connections 64] [--rounds 3]

Starts a redis-server and two capsvc workers on it, the same configuration with `[journal]
enabled = true` (the default) and `false`, and drives each with wrk and the mix of
realistic tickets (bench/tickets.lua), alternating round by round; then each under light
load (4 connections) for the latency a sale pays for its fdatasync. Pinning as in
bench/run.py: the services on CPU 0, wrk and Redis on CPU 1. The journal directory is on
the disk the working directory is on (its fdatasync is what is measured).

Prints tickets/s, p50/p99, errors, server CPU per ticket, the ratio on/off, journal bytes
per ticket sold and per record; then the restore: Redis loses everything (restarted empty),
`capsvc journal restore` puts the journal back, and its speed in records per second.
Asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run import Result, config_file, cpu_seconds, tools_present, wrk

from capsvc.journal.reader import records
from capsvc.journal.records import SaleRecord

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository: tests.support
from tests.support.servers import RedisServer
from tests.support.service import ServiceProcess

SCRIPT = "tickets.lua"
MODES = ("journal on", "journal off")


def pin(pid: int, cpu: str) -> None:
    subprocess.run(["taskset", "-pc", cpu, str(pid)], check=True, capture_output=True)


def journal_size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.jsonl"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not tools_present():
        return 2
    redis = RedisServer().start()
    version = redis.client().info("server")["redis_version"]
    on_config = config_file()
    off_config = config_file(journal=False)
    journal_dir = Path(tempfile.mkdtemp(prefix="capsvc-bench-journal-", dir=Path.cwd()))
    services: dict[str, ServiceProcess] = {}
    try:
        assert redis.process is not None
        pin(redis.process.pid, "1")
        for mode, config in zip(MODES, (on_config, off_config), strict=True):
            svc = services[mode] = ServiceProcess(
                config, redis.url, env={"CAPSVC_JOURNAL_DIR": str(journal_dir)}).start()
            assert svc.process is not None
            pin(svc.process.pid, "0")
        results: dict[str, list[Result]] = {mode: [] for mode in MODES}
        for mode, svc in services.items():  # warm-up
            wrk(svc.base_url, 2, args.connections, f"warm-{mode[8:]}", SCRIPT)
        sold = 0
        written = 0
        for r in range(args.rounds):
            for mode, svc in services.items():
                assert svc.process is not None
                size, cpu = journal_size(journal_dir), cpu_seconds(svc.process.pid)
                res = wrk(svc.base_url, args.seconds, args.connections,
                          f"r{r}-{mode[8:]}", SCRIPT)
                res.server_cpu_us = 1e6 * (cpu_seconds(svc.process.pid) - cpu) / max(
                    res.requests, 1)
                if mode == "journal on":
                    sold += res.requests
                    written += journal_size(journal_dir) - size
                results[mode].append(res)
        light = {mode: wrk(svc.base_url, args.seconds, 4, f"light-{mode[8:]}", SCRIPT)
                 for mode, svc in services.items()}
        for svc in services.values():
            svc.stop()
        lines = sum(1 for _ in records(journal_dir))
        decisions = sum(1 for _, _, r in records(journal_dir) if isinstance(r, SaleRecord))
        # The restore: Redis comes back empty; the journal puts it back.
        redis.kill()
        shutil.rmtree(redis.dir)
        redis.dir.mkdir()
        redis.start()
        started = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "capsvc", "journal", "restore", "--config", on_config,
             "--redis-url", redis.url, "--dir", str(journal_dir)],
            capture_output=True, text=True, check=True)
        restore_s = time.perf_counter() - started
    finally:
        for svc in services.values():
            svc.stop()
        redis.stop()
        shutil.rmtree(journal_dir, ignore_errors=True)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, redis-server {version}; capsvc on CPU 0, wrk and "
          "Redis on CPU 1")
    print(f"load: wrk -t1 -c{args.connections} -d{args.seconds}s, bench/{SCRIPT} (the mix), "
          f"{args.rounds} alternating rounds, medians; light load: -c4")
    print(f"{'mode':<12} {'tickets/s':>9} {'p50 ms':>7} {'p99 ms':>7} {'errors':>7} "
          f"{'cpu µs/ticket':>13} | {'light: tickets/s':>16} {'p50 ms':>7} {'p99 ms':>7}")
    rate: dict[str, float] = {}
    p99: dict[str, float] = {}
    for mode, runs in results.items():
        rate[mode] = statistics.median(r.rps for r in runs)
        p99[mode] = statistics.median(r.p99_ms for r in runs)
        lo = light[mode]
        print(f"{mode:<12} {rate[mode]:>9.0f} {statistics.median(r.p50_ms for r in runs):>7.2f} "
              f"{p99[mode]:>7.2f} {sum(r.errors for r in runs) + lo.errors:>7} "
              f"{statistics.median(r.server_cpu_us for r in runs):>13.0f} | {lo.rps:>16.0f} "
              f"{lo.p50_ms:>7.2f} {lo.p99_ms:>7.2f}")
    print(f"journal on / off = {rate['journal on'] / rate['journal off']:.2f} (saturated), "
          f"{light['journal on'].rps / light['journal off'].rps:.2f} (light load); p99 "
          f"+{p99['journal on'] - p99['journal off']:.2f} ms saturated, "
          f"+{light['journal on'].p99_ms - light['journal off'].p99_ms:.2f} ms light")
    print(f"journal: {written / max(sold, 1):.0f} bytes per ticket sold under load "
          f"({lines} records, {decisions} of them decisions, in the whole run)")
    print(f"restore: {lines} records read, Redis empty, in {restore_s:.2f} s (the command, "
          f"start to end): {lines / restore_s:,.0f} records/s")
    print("  " + out.stdout.strip().replace("\n", "\n  "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
