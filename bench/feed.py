"""The live sold-out feed at scale, and what exposure costs a worker that is selling.

    python bench/feed.py [--subscribers 1000] [--seconds 10]

Starts a redis-server (AOF on) and one capsvc worker (pinned to CPU 0; this client, wrk
and Redis on CPU 1), then:

1. opens N subscribers on `GET /v1/games/fdj-keno/capped/stream` and measures the worker's
   memory (RSS) before and after: memory per idle subscriber;
2. sells the realistic mix with wrk (bench/tickets.lua, which caps hot combinations and so
   sends events) while a prober brings a new combination to its cap every 100 ms; for each
   probe, the delay from its answer to its `capped` event at every subscriber (the fan-out
   latency, measured in this process: its own event loop's delays are included, so the
   figure is an upper bound), and the sales rate with the subscribers attached against
   without;
3. the sales rate and p99 with an operator asking for the exposure of the draw on sale
   every 500 ms, against without (alternated), and the time one exposure takes.

Prints figures; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository: tests.support
from tests.support.servers import RedisServer
from tests.support.service import ServiceProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import TOKEN, config_file, cpu_seconds, wrk

STREAM = "/v1/games/fdj-keno/capped/stream"


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


class Subscriber:
    """A raw-socket subscriber (cheaper than an HTTP client library: one client process
    holds them all): notes when each `capped` event arrives, by its numbers."""

    def __init__(self) -> None:
        self.seen: dict[bytes, float] = {}  # b"[1,2,…]" of a capped event -> arrival
        self.ready = asyncio.Event()

    async def run(self, host: str, port: int) -> None:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        writer.write(f"GET {STREAM} HTTP/1.1\r\nHost: {host}\r\n"
                     f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())
        capped = False
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                if line.startswith(b"event: "):
                    capped = line == b"event: capped\n"
                    if line == b"event: snapshot\n":
                        self.ready.set()
                elif capped and line.startswith(b"data: "):
                    start = line.index(b'"numbers":') + 10
                    self.seen[line[start:line.index(b"]", start) + 1]] = time.perf_counter()
        finally:
            writer.close()


async def probe(session: aiohttp.ClientSession, url: str, draw: int, seq: int
                ) -> tuple[bytes, float] | None:
    """Bring a fresh combination to its cap; (its key, when the answer came)."""
    numbers = sorted(random.Random(seq).sample(range(1, 71), 8))
    body = {"ticket_id": f"probe-{seq}-{time.time_ns()}", "game": "fdj-keno", "first_draw": draw,
            "grids": [{"numbers": numbers, "stake": 1000}] * 5}
    async with session.post(url + "/v1/tickets", json=body,
                            headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
        out = await resp.json()
    answered = time.perf_counter()
    if resp.status != 200 or out["status"] != "accepted":
        return None
    return json.dumps(numbers, separators=(",", ":")).encode(), answered


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def feed_bench(url: str, pid: int, subscribers: int, seconds: int) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.get(url + "/v1/games/fdj-keno/draws/current",
                               headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            draw = (await resp.json())["draw"] + 1
        base_rss = rss_kib(pid)
        subs = [Subscriber() for _ in range(subscribers)]
        host, port = url.removeprefix("http://").split(":")
        tasks = [asyncio.create_task(s.run(host, int(port))) for s in subs]
        await asyncio.gather(*(s.ready.wait() for s in subs))
        await asyncio.sleep(1)
        per_sub = (rss_kib(pid) - base_rss) * 1024 / subscribers
        print(f"feed: {subscribers} subscribers connected; worker RSS {base_rss / 1024:.1f} MiB "
              f"before, +{per_sub / 1024:.1f} KiB per idle subscriber")
        loop = asyncio.get_running_loop()
        cpu_before = cpu_seconds(pid)
        sales = loop.run_in_executor(None, wrk, url, seconds, 16, "feed-mix")
        probes: list[tuple[bytes, float]] = []
        seq = itertools.count()
        until = time.perf_counter() + seconds - 1
        while time.perf_counter() < until:
            got = await probe(session, url, draw, next(seq))
            if got is not None:
                probes.append(got)
            await asyncio.sleep(0.1)
        result = await sales
        cpu_with = 1e6 * (cpu_seconds(pid) - cpu_before) / max(result.requests, 1)
        await asyncio.sleep(1)
        delays, missing = [], 0
        for key, answered in probes:
            for s in subs:
                at = s.seen.get(key)
                if at is None:
                    missing += 1
                else:
                    delays.append((at - answered) * 1000)
        for t in tasks:
            t.cancel()
        print(f"feed: while selling {result.rps:.0f} tickets/s (wrk -c16, mix) with "
              f"{subscribers} subscribers: {len(probes)} probes x {subscribers} subscribers, "
              f"fan-out from the sale's answer to each subscriber: p50 "
              f"{percentile(delays, 0.5):.1f} ms, p99 {percentile(delays, 0.99):.1f} ms, "
              f"max {max(delays):.1f} ms; events missing: {missing}")
    cpu_before = cpu_seconds(pid)
    alone = wrk(url, seconds, 16, "feed-alone")
    cpu_alone = 1e6 * (cpu_seconds(pid) - cpu_before) / max(alone.requests, 1)
    print(f"feed: the same load without subscribers: {alone.rps:.0f} tickets/s "
          f"({result.rps / alone.rps:.2f} x with them; this client shares wrk's CPU); the "
          f"worker's CPU per ticket sold: {cpu_with:.0f} µs with the subscribers (events "
          f"written included), {cpu_alone:.0f} µs without")


async def exposure_bench(url: str, seconds: int) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/v1/games/fdj-keno/draws/current", headers=headers) as r:
            draw = (await r.json())["draw"]
        timings: list[float] = []

        async def poll(until: float) -> None:
            while time.perf_counter() < until:
                started = time.perf_counter()
                async with session.get(f"{url}/v1/games/fdj-keno/draws/{draw}/exposure",
                                       headers=headers) as r:
                    body = await r.json()
                if r.status == 200:
                    timings.append((time.perf_counter() - started) * 1000)
                    played = sum(c["played"] for c in body["capped"])
                await asyncio.sleep(0.5)
            print(f"exposure: draw {draw} with {played} combinations played; a request takes "
                  f"median {statistics.median(timings):.1f} ms, max {max(timings):.1f} ms "
                  "(one in ten computes, the others are the 5 s cache)")

        loop = asyncio.get_running_loop()
        runs: dict[str, list[tuple[float, float]]] = {"without": [], "with": []}
        for name in ("without", "with") * 3:
            sales = loop.run_in_executor(None, wrk, url, seconds, 64, f"exp-{name}")
            if name == "with":
                await poll(time.perf_counter() + seconds)
            r = await sales
            runs[name].append((r.rps, r.p99_ms))
        for name, values in runs.items():
            print(f"exposure: sales {name} an exposure every 500 ms: "
                  f"{statistics.median(v[0] for v in values):.0f} tickets/s, p99 "
                  f"{statistics.median(v[1] for v in values):.1f} ms (wrk -c64, mix)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--subscribers", type=int, default=1000)
    parser.add_argument("--seconds", type=int, default=10)
    args = parser.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    subprocess.run(["taskset", "-pc", "1", str(os.getpid())], check=True,
                   capture_output=True)
    redis = RedisServer().start()
    assert redis.process is not None
    subprocess.run(["taskset", "-pc", "1", str(redis.process.pid)], check=True,
                   capture_output=True)
    svc = ServiceProcess(config_file(), redis.url).start()
    assert svc.process is not None
    subprocess.run(["taskset", "-pc", "0", str(svc.process.pid)], check=True, capture_output=True)
    try:
        print(f"one worker on CPU 0; this client, wrk and Redis "
              f"{redis.client().info('server')['redis_version']} (AOF on) on CPU 1")
        asyncio.run(exposure_bench(svc.base_url, args.seconds))
        asyncio.run(feed_bench(svc.base_url, svc.process.pid, args.subscribers, args.seconds))
    finally:
        svc.stop()
        redis.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
