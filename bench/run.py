"""Side by side in one run: capsvc, the naive design, and a bare aiohttp+msgspec handler.

    python bench/run.py [--seconds 10] [--connections 64] [--rounds 2]

Starts a redis-server, one capsvc worker as shipped (journal on) and one with its journal
off, the naive server (bench/naive.py: one awaited EVALSHA per grid, no coalescing) and the
bare handler (bench/bare.py: no Redis), then drives each with wrk and the same seeded
generator of realistic tickets (bench/tickets.lua), alternating the targets round by round.
Each server is pinned to CPU 0; wrk and Redis share CPU 1. Then capsvc again, each
connection pausing after an answer so that the rate is about 70 % of its peak, for its
latency below saturation. Last, `capsvc serve --workers 2` on the CPUs wrk and Redis
leave free, against one worker.

Prints throughput, p50/p95/p99, errors, server CPU per ticket, the rejection mix, and the
Redis side per ticket (commands sent, commands executed including those inside Lua, Redis
CPU). Asserts nothing about speed: it reports figures measured in one run.
"""

from __future__ import annotations

import argparse
import contextlib
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
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository: tests.support
from tests.support.servers import RedisServer, free_port
from tests.support.service import ServiceProcess

HERE = Path(__file__).resolve().parent
TOKEN = "bench-token"
WORKLOADS = {"mix": "tickets.lua", "one-grid": "one_grid.lua", "lnm": "lnm.lua"}
WORKLOAD_TEXT = {
    "mix": "1-5 grids of 2-10 numbers, 15 % subscriptions, a hot set at the cap",
    "one-grid": "one capped grid of 8-10 numbers, one draw, an allowed stake",
    "lnm": "LNM (player limits): one capped grid of 8-10 numbers, 100,000 players",
}


def config_file(journal: bool = True, redis: str = "") -> str:
    """A configuration for the bench: fdj-keno and lnm-keno, the bench's token, its own
    journal; `redis`: lines of a `[redis]` section."""
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    text = f"""
[redis]
{redis}

[server]
max_in_flight = 100000

[[games]]
id = "fdj-keno"
preset = "fdj-keno-2008"

[[games]]
id = "lnm-keno"
preset = "lnm-keno"

[[channels]]
id = "bench"
token_sha256 = "{digest}"
games = ["fdj-keno", "lnm-keno"]
scopes = ["sell", "read"]
"""
    path = Path(tempfile.mkdtemp(prefix="capsvc-bench-")) / "bench.toml"
    # A journal of its own: in the default var/journal of the working directory, each run
    # would restore every earlier run's decisions before selling (a two-worker service
    # took longer to start than the bench waits once that had grown to 137 MB).
    text += (f'\n[journal]\ndir = "{path.parent / "journal"}"\n' if journal
             else "\n[journal]\nenabled = false\n")
    path.write_text(text)
    return str(path)


@dataclass
class Result:
    rps: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    requests: int
    errors: int
    server_cpu_us: float = 0.0
    """Server CPU per ticket (µs)."""
    server_busy: float = 0.0
    """Share of the run the server spent on the CPU (1.0: CPU-bound)."""
    redis: dict[str, float] = field(default_factory=dict)
    threads_cpu_us: float = 0.0
    """CPU per ticket (µs) of the server's threads other than its event loop's (the
    journal's writer), user and system: part of `server_cpu_us`."""


def wrk(url: str, seconds: int, connections: int, prefix: str,
        script: str = "tickets.lua", pause_ms: float = 0.0,
        extra: tuple[str, ...] = (), cpu: str | None = "1") -> Result:
    """wrk with one of the ticket scripts; `pause_ms`: each connection waits that long after
    an answer before its next request, on average (exponentially distributed: the load is
    paced as independent terminals would send it; latency is timed without the pause);
    `extra`: the script's further arguments (bench/batch.lua: the batch's size, its kind);
    `cpu`: the CPU wrk runs on (None: not pinned)."""
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", str(HERE / script), url,
           "--", TOKEN, prefix, "42", f"{pause_ms:g}", *extra]
    out = subprocess.run(pinned(cmd, cpu) if cpu else cmd, capture_output=True, text=True,
                         check=True).stdout

    def number(pattern: str) -> float:
        m = re.search(pattern, out)
        assert m, (pattern, out)
        return float(m.group(1))

    p50, p95, p99 = (float(x) / 1000 for x in re.findall(r"PERCENTILES (\S+) (\S+) (\S+)",
                                                          out)[0])
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = (int(bad.group(1)) if bad else 0) + (
        sum(int(x) for x in sock.groups()) if sock else 0)
    return Result(number(r"Requests/sec:\s+([\d.]+)"), p50, p95, p99,
                  int(number(r"(\d+) requests in")), errors)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    return _stat_cpu(Path(f"/proc/{pid}/stat"))


def other_threads_cpu_seconds(pid: int) -> float:
    """User + system CPU time so far of a process's threads but its main one (threads that
    ended are not counted: the journal's writer lives as long as the process)."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        if task.name != str(pid):
            with contextlib.suppress(FileNotFoundError):  # ended meanwhile
                total += _stat_cpu(task / "stat")
    return total


def _stat_cpu(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def redis_side(server: RedisServer) -> dict[str, float]:
    """Commands executed (including inside Lua) and CPU seconds of Redis so far."""
    client = server.client()
    stats = client.info("commandstats")
    cpu = client.info("cpu")
    return {
        "executed": sum(int(v["calls"]) for k, v in stats.items()
                        if k not in ("cmdstat_info", "cmdstat_ping")),
        "cpu": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
        "fcall": float(stats.get("cmdstat_fcall", {}).get("usec", 0)) / 1e6,
    }


def capsvc_counters(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(base_url + "/metrics") as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def with_fixed_hash_seed() -> int | None:
    """Run this script again with PYTHONHASHSEED=0 (the seed alone moves a result by a few
    µs) and return its exit status; None when the seed is already fixed."""
    if os.environ.get("PYTHONHASHSEED") == "0":
        return None
    return subprocess.call([sys.executable, *sys.argv], env={**os.environ, "PYTHONHASHSEED": "0"})


def pinned(cmd: list[str], cpu: str) -> list[str]:
    return ["taskset", "-c", cpu, *cmd]


def wait_listening(port: int) -> None:
    for _ in range(200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=0.2)
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {port}")


def mix(before: dict[tuple[str, tuple[tuple[str, str], ...]], float],
        after: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> str:
    """Ticket statuses and grid rejection reasons over a run, as shares."""
    def delta(name: str) -> dict[tuple[tuple[str, str], ...], float]:
        return {labels: after[(n, labels)] - before.get((n, labels), 0.0)
                for (n, labels) in after if n == name}
    tickets = delta("capsvc_tickets_total")
    grids = delta("capsvc_grids_total")
    t_total = sum(tickets.values()) or 1.0
    g_total = sum(grids.values()) or 1.0
    parts = [f"tickets {dict(labels)['status']} {100 * v / t_total:.1f}%"
             for labels, v in sorted(tickets.items()) if v]
    parts += [f"grids {dict(labels)['reason'] or 'accepted'} {100 * v / g_total:.1f}%"
              for labels, v in sorted(grids.items()) if v]
    sent = delta("capsvc_redis_batch_size_sum")
    batches = delta("capsvc_redis_batch_size_count")
    parts.append(f"{sum(sent.values()) / t_total:.2f} commands sent per ticket, "
                 f"{sum(sent.values()) / (sum(batches.values()) or 1):.1f} per pipeline")
    return "; ".join(parts)


def tools_present() -> bool:
    """wrk and taskset are on the PATH (else say how to get them)."""
    for tool in ("wrk", "taskset"):
        if shutil.which(tool) is None:
            package = "wrk" if tool == "wrk" else "util-linux"
            print(f"{tool} is needed: apt-get install -y {package}")
            return False
    return True


def two_workers(redis_url: str, args: argparse.Namespace) -> tuple[float, str]:
    """Throughput of `capsvc serve --workers 2`, on every CPU but the one wrk and Redis
    use (CPU 0 alone on a machine of two)."""
    cpus = os.cpu_count() or 1
    cores = ",".join(str(c) for c in range(cpus) if c != 1) if cpus >= 3 else "0"
    port = free_port()
    proc = subprocess.Popen(pinned([sys.executable, "-m", "capsvc", "serve", "--workers", "2",
                                    "--config", config_file(), "--redis-url", redis_url,
                                    "--port", str(port)], cores),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_listening(port)
        url = f"http://127.0.0.1:{port}"
        wrk(url, 2, args.connections, "warm-two")
        runs = [wrk(url, args.seconds, args.connections, f"two-{r}").rps
                for r in range(args.rounds)]
    finally:
        proc.terminate()
        proc.wait(30)
    return statistics.median(runs), cores


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not tools_present():
        return 2
    redis = RedisServer().start()
    assert redis.process is not None
    redis_version = redis.client().info("server")["redis_version"]
    subprocess.run(["taskset", "-pc", "1", str(redis.process.pid)], check=True,
                   capture_output=True)
    svc = ServiceProcess(config_file(), redis.url).start()
    assert svc.process is not None
    subprocess.run(["taskset", "-pc", "0", str(svc.process.pid)], check=True,
                   capture_output=True)
    # The same service with its journal off, on the same Redis (the same library).
    off = ServiceProcess(config_file(journal=False), redis.url).start()
    assert off.process is not None
    subprocess.run(["taskset", "-pc", "0", str(off.process.pid)], check=True,
                   capture_output=True)
    bare_port, naive_port = free_port(), free_port()
    bare = subprocess.Popen(pinned([sys.executable, str(HERE / "bare.py"), str(bare_port)], "0"))
    naive = subprocess.Popen(pinned([sys.executable, str(HERE / "naive.py"), str(naive_port),
                                     redis.url], "0"))
    wait_listening(bare_port)
    wait_listening(naive_port)
    targets = {"capsvc": svc.base_url, "no-jrnl": off.base_url,
               "naive": f"http://127.0.0.1:{naive_port}", "bare": f"http://127.0.0.1:{bare_port}"}
    pids = {"capsvc": svc.process.pid, "no-jrnl": off.process.pid, "naive": naive.pid,
            "bare": bare.pid}
    results: dict[tuple[str, str], list[Result]] = {
        (w, name): [] for w in WORKLOADS for name in targets}
    mixes: dict[str, list[str]] = {w: [] for w in WORKLOADS}
    try:
        for name, url in targets.items():  # warm-up
            wrk(url, 2, args.connections, f"warm-{name}")
        for w, script in WORKLOADS.items():
            for r in range(args.rounds):
                for name, url in targets.items():
                    redis_before = redis_side(redis)
                    metrics_before = capsvc_counters(svc.base_url) if name == "capsvc" else {}
                    cpu_before = cpu_seconds(pids[name])
                    res = wrk(url, args.seconds, args.connections, f"{w}-r{r}-{name}", script)
                    cpu = cpu_seconds(pids[name]) - cpu_before
                    res.server_cpu_us = 1e6 * cpu / max(res.requests, 1)
                    res.server_busy = cpu / args.seconds
                    redis_after = redis_side(redis)
                    res.redis = {k: (redis_after[k] - redis_before[k]) / max(res.requests, 1)
                                 for k in redis_after}
                    if name == "capsvc":
                        time.sleep(1.1)  # tallies reach /metrics once a second
                        mixes[w].append(mix(metrics_before, capsvc_counters(svc.base_url)))
                    results[(w, name)].append(res)
        peak = statistics.median(r.rps for r in results[("mix", "capsvc")])
        two = two_workers(redis.url, args)
        # Below saturation: the same connections, each pausing after an answer, the pause
        # adjusted until the rate is about 70 % of the peak (wrk cannot send at a fixed
        # rate; fewer connections would time the queue they form, not the service).
        paced: Result | None = None
        pause = args.connections / (0.7 * peak) * 1000
        for attempt in range(4):
            paced = wrk(svc.base_url, args.seconds, args.connections, f"paced-{attempt}",
                        pause_ms=pause)
            if 0.65 * peak <= paced.rps <= 0.75 * peak:
                break
            pause *= paced.rps / (0.7 * peak)
    finally:
        bare.terminate()
        naive.terminate()
        svc.stop()
        off.stop()
        redis.stop()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}; servers on CPU 0, wrk and Redis on CPU 1; "
          f"Redis {redis_version} with appendonly yes, appendfsync everysec")
    print(f"load: wrk -t1 -c{args.connections} -d{args.seconds}s, {args.rounds} alternating "
          "rounds, medians")
    ratios: dict[str, float] = {}
    ratios_off: dict[str, float] = {}
    redis_us: dict[str, float] = {}
    for w, script in WORKLOADS.items():
        print(f"\nworkload {w} (bench/{script}): {WORKLOAD_TEXT[w]}")
        print(f"{'target':<8} {'tickets/s':>10} {'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} "
              f"{'errors':>7} {'cpu µs/t':>9} {'busy':>5} {'redis cmds/t':>13} "
              f"{'redis µs/t':>11}")
        med: dict[str, float] = {}
        for name in targets:
            runs = results[(w, name)]
            med[name] = statistics.median(r.rps for r in runs)

            def m(attr: str, runs: list[Result] = runs) -> float:
                return float(statistics.median(getattr(r, attr) for r in runs))

            executed = statistics.median(r.redis["executed"] for r in runs)
            redis_cpu = statistics.median(r.redis["cpu"] for r in runs) * 1e6
            if name == "capsvc":
                redis_us[w] = redis_cpu
            print(f"{name:<8} {med[name]:>10.0f} {m('p50_ms'):>7.2f} {m('p95_ms'):>7.2f} "
                  f"{m('p99_ms'):>7.2f} {sum(r.errors for r in runs):>7} "
                  f"{m('server_cpu_us'):>9.0f} {m('server_busy'):>5.2f} {executed:>13.1f} "
                  f"{redis_cpu:>11.1f}")
        ratios[w] = med["capsvc"] / med["bare"]
        ratios_off[w] = med["no-jrnl"] / med["bare"]
        print(f"capsvc / bare = {ratios[w]:.2f} (journal off: {ratios_off[w]:.2f}); "
              f"capsvc / naive = {med['capsvc'] / med['naive']:.2f}")
        for i, text in enumerate(mixes[w]):
            print(f"capsvc round {i}: {text}")
    print()
    if paced is not None:
        print(f"capsvc below saturation (mix, {args.connections} connections pausing "
              f"{pause:.1f} ms on average after each answer): {paced.rps:.0f} tickets/s "
              f"({100 * paced.rps / peak:.0f} % of peak): p50 {paced.p50_ms:.2f} ms, "
              f"p95 {paced.p95_ms:.2f} ms, p99 {paced.p99_ms:.2f} ms")
    rps, cores = two
    note = "" if (os.cpu_count() or 0) >= 3 else (
        " (this machine has no core to spare for the second worker: wrk and Redis hold the "
        "other one, so this says nothing of scaling)")
    print(f"capsvc --workers 2 on CPUs {cores}: {rps:.0f} tickets/s = "
          f"{rps / peak:.2f} x one worker{note}")
    print("targets: capsvc / bare >= 0.70 with the journal on (mix {:.2f}, one-grid "
          "{:.2f}; journal off {:.2f}, {:.2f}); Redis µs per ticket <= 35 on the mix ({:.1f}), "
          "<= 20 one-grid ({:.1f})".format(
              ratios["mix"], ratios["one-grid"], ratios_off["mix"], ratios_off["one-grid"],
              redis_us["mix"], redis_us["one-grid"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
