"""What capsvc.client costs its caller, against a bare aiohttp call, side by side in one run.

    python bench/client.py [--tickets 5000] [--concurrency 32] [--rounds 4]

Starts a redis-server and one capsvc worker (pinned to CPU 0; Redis and this process on
CPU 1), then sells `--tickets` one-grid tickets per round from this process, alternating
round by round:
- `raw`: an aiohttp session posting the encoded body and decoding the answer into
  `TicketOut` (what an integrator would write by hand, without retries);
- `client`: `Client.sell(TicketIn)`, the same session settings, with its retry protocol,
  request id and typed errors.

Prints, per variant, tickets/s and this process's CPU per ticket (µs), and the ratios.
The hash seed is fixed (PYTHONHASHSEED=0; the process re-executes itself to set it).
Asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import msgspec
from run import with_fixed_hash_seed

from capsvc.client import Client, GridIn, TicketIn, TicketOut

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository: tests.support
from tests.support.servers import RedisServer
from tests.support.service import ServiceProcess

TOKEN = "bench-token"


def config_file() -> str:
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    path = Path(tempfile.mkdtemp(prefix="capsvc-bench-client-")) / "bench.toml"
    path.write_text(f"""
[server]
max_in_flight = 100000

[[games]]
id = "fdj-keno"
preset = "fdj-keno-2008"
cap_limit = 100000000

[[channels]]
id = "bench"
token_sha256 = "{digest}"
games = ["fdj-keno"]
scopes = ["sell", "read"]
""")
    return str(path)


def tickets(prefix: str, count: int, draw: int) -> list[TicketIn]:
    return [TicketIn(ticket_id=f"{prefix}-{i}", game="fdj-keno", first_draw=draw,
                     grids=[GridIn(numbers=[1 + i % 60, 61, 62, 63, 64, 65, 66, 67],
                                   stake=100)])
            for i in range(count)]


async def drive(sell: Callable[[TicketIn], Awaitable[TicketOut]], batch: list[TicketIn],
                concurrency: int) -> tuple[float, float]:
    """(tickets/s, this process's CPU µs a ticket)."""
    queue = iter(batch)

    async def worker() -> None:
        for t in queue:
            answer = await sell(t)
            assert answer.status == "accepted", answer

    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return len(batch) / wall, cpu / len(batch) * 1e6


async def run(args: argparse.Namespace, url: str) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    decode = msgspec.json.Decoder(TicketOut).decode
    encode = msgspec.json.Encoder().encode
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector) as session, \
            Client(url, TOKEN, connections=args.concurrency) as client:
        draw = (await client.current_draw("fdj-keno")).draw

        async def raw(t: TicketIn) -> TicketOut:
            async with session.post(url + "/v1/tickets", data=encode(t),
                                    headers=headers) as resp:
                body = await resp.read()
                assert resp.status == 200, body
                return decode(body)

        variants = {"raw": raw, "client": client.sell}
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        await drive(raw, tickets("warm", 500, draw), args.concurrency)
        await drive(client.sell, tickets("warm-c", 500, draw), args.concurrency)
        for r in range(args.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                batch = tickets(f"{name}{r}", args.tickets, draw)
                results[name].append(await drive(variants[name], batch, args.concurrency))
    print(f"{args.tickets} one-grid tickets a round, {args.rounds} rounds alternating, "
          f"{args.concurrency} concurrent sales, PYTHONHASHSEED={os.environ['PYTHONHASHSEED']}")
    print(f"{'':8}{'tickets/s':>12}{'caller CPU µs/ticket':>24}")
    medians = {}
    for name, rows in results.items():
        rate = statistics.median(r[0] for r in rows)
        cpu = statistics.median(r[1] for r in rows)
        medians[name] = (rate, cpu)
        print(f"{name:8}{rate:12.0f}{cpu:24.1f}   rounds: "
              + ", ".join(f"{r[0]:.0f}/{r[1]:.0f}" for r in rows))
    (raw_rate, raw_cpu), (cl_rate, cl_cpu) = medians["raw"], medians["client"]
    print(f"client / raw: rate x{cl_rate / raw_rate:.2f}, caller CPU x{cl_cpu / raw_cpu:.2f} "
          f"(+{cl_cpu - raw_cpu:.1f} µs a ticket)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tickets", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    rerun = with_fixed_hash_seed()
    if rerun is not None:
        return rerun
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {1})
    redis = RedisServer().start()
    service = ServiceProcess(config_file(), redis.url).start()
    try:
        if hasattr(os, "sched_setaffinity") and service.process is not None:
            os.sched_setaffinity(service.process.pid, {0})
        asyncio.run(run(args, service.base_url))
    finally:
        service.stop()
        redis.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
