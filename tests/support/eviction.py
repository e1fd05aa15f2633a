"""A Redis that runs out of memory while capsvc sells on it: the scenario of
`tests/integration/test_eviction.py` and `bench/eviction.py`.

A redis-server with `maxmemory` (8 MB) and a `maxmemory-policy`, a `capsvc serve` on it.
Six combinations are sold to their cap; another client then writes keys until Redis has
evicted `evictions` of them (or refuses its writes: noeviction); the same combinations are
sold again to their cap; `capsvc journal verify --redis-url` is run while Redis is full;
the other client's keys are deleted and every answered sale is asked for again. Where Redis
refuses the other client's writes (noeviction), `maxmemory` is then set a little below what
it uses (`squeeze`), so that it refuses every write, not only those that come while memory
is at the limit to the byte.

Figures: the sales answered accepted, those the service then no longer has or shows
otherwise (lost), the combinations whose answered stakes pass the cap, the answers 503.
Asserts nothing about time.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis

from tests.support.servers import RedisServer
from tests.support.service import ServiceProcess

CONFIG = Path(__file__).resolve().parents[1] / "capsvc-test.toml"
TOKEN = "t-fr"
ADMIN = "t-admin"
GAME = "fdj-keno"
CAP = 5000
"""fdj-keno's cap in the test configuration (50.00 EUR), minor units."""
STAKE = 200
COMBINATIONS = [list(range(1 + 9 * i, 9 + 9 * i)) for i in range(6)]
"""Six combinations of 8 numbers, none sharing a number."""
FILLER_BYTES = 1000
TRIES = 4
"""Times a sale answered 503 is sent again (the same body) before the seller gives up."""


@dataclass
class EvictionRun:
    policy: str
    ready: bool = False
    """/readyz answered 200 within READY_S of the start."""
    answered: int = 0
    """Sales answered accepted, both rounds."""
    lost: int = 0
    """Of those, the ones the service no longer has (404) or shows otherwise, once the other
    client's keys are deleted."""
    over_cap: int = 0
    """Combinations whose stakes answered accepted pass the cap."""
    highest: int = 0
    """The most staked answered accepted on one combination."""
    unavailable: int = 0
    """Answers 503 (every try counted)."""
    evicted: int = 0
    """Keys Redis evicted (INFO stats)."""
    filler_refused: str = ""
    """The other client's first refused write (noeviction), if any."""
    verify: tuple[int, str] = (0, "")
    """`capsvc journal verify --redis-url` while Redis was full: exit status, stderr."""
    statuses: dict[int, int] = field(default_factory=dict)
    log: str = ""
    """The service's log."""

    def line(self) -> str:
        return (f"{self.policy:<14} ready={'yes' if self.ready else 'no ':<3} answered="
                f"{self.answered:<4} lost={self.lost:<4} over cap={self.over_cap} (highest "
                f"{self.highest} on a cap of {CAP}) 503s={self.unavailable:<4} evicted="
                f"{self.evicted} verify exit {self.verify[0]}")


READY_S = 10.0


class _Seller:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, run: EvictionRun
                 ) -> None:
        self.session = session
        self.base = base_url
        self.run = run
        self.sold: dict[str, tuple[int, Any]] = {}
        """ticket id -> (combination index, the answer's grids)"""
        self.staked = [0] * len(COMBINATIONS)
        self._n = 0

    async def _send(self, method: str, path: str, body: Any = None, token: str = TOKEN
                    ) -> tuple[int, Any]:
        async with self.session.request(method, self.base + path, json=body, headers={
                "Authorization": f"Bearer {token}"}) as resp:
            data = await resp.json(content_type=None)
            self.run.statuses[resp.status] = self.run.statuses.get(resp.status, 0) + 1
            return resp.status, data

    async def sell_out(self, round_: str) -> None:
        """Sell every combination until the cap refuses it (or the seller gives up)."""
        for i, numbers in enumerate(COMBINATIONS):
            while True:
                self._n += 1
                ticket_id = f"E{round_}-{i}-{self._n:05d}"
                body = {"ticket_id": ticket_id, "game": GAME,
                        "grids": [{"numbers": numbers, "stake": STAKE}]}
                for _ in range(TRIES):
                    status, data = await self._send("POST", "/v1/tickets", body)
                    if status != 503:
                        break
                    self.run.unavailable += 1
                    await asyncio.sleep(0.05)
                if status != 200 or data["status"] != "accepted":
                    break  # refused by the cap (or still 503: the seller gives up)
                self.sold[ticket_id] = (i, data["grids"])
                self.staked[i] += STAKE

    async def lost(self) -> int:
        """Answered sales the service no longer has, or shows otherwise."""
        lost = 0
        for ticket_id, (_, grids) in self.sold.items():
            status, data = await self._send("GET", f"/v1/tickets/{ticket_id}")
            if status != 200 or data["status"] != "accepted" or data["grids"] != grids:
                lost += 1
        return lost

    async def ready(self, ready: bool = True) -> bool:
        """Whether /readyz says `ready` within READY_S."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_S
        while loop.time() < deadline:
            async with self.session.get(self.base + "/readyz") as resp:
                if (resp.status == 200) == ready:
                    return True
            await asyncio.sleep(0.1)
        return False


def fill(db: redis.Redis, evictions: int) -> tuple[int, str]:
    """Write keys until Redis has evicted `evictions` keys, or refuses a write; the keys
    evicted and the refusal."""
    i = 0
    while True:
        pipe = db.pipeline(transaction=False)
        for _ in range(50):
            pipe.set(f"filler:{i}", b"x" * FILLER_BYTES)
            i += 1
        try:
            pipe.execute()
        except redis.ResponseError as e:
            return int(db.info("stats")["evicted_keys"]), str(e)
        evicted = int(db.info("stats")["evicted_keys"])
        if evicted >= evictions:
            return evicted, ""


SQUEEZE_BYTES = 1_000_000


def squeeze(db: redis.Redis) -> None:
    """Set maxmemory below what Redis uses now (as if the other client's keys had grown
    on): under noeviction every write is refused from now on, not only those that come
    while memory is at the limit to the byte."""
    memory = db.info("memory")
    # What Redis compares with maxmemory: its memory less the AOF and replication buffers.
    counted = int(memory["used_memory"]) - int(memory.get("mem_not_counted_for_evict", 0))
    db.config_set("maxmemory", max(counted - SQUEEZE_BYTES, 1))


def unfill(db: redis.Redis) -> None:
    """Delete the other client's keys (what is left of them)."""
    batch = list(db.scan_iter("filler:*", count=1000))
    for start in range(0, len(batch), 1000):
        db.delete(*batch[start:start + 1000])


def verify(service: ServiceProcess) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-m", "capsvc", "journal", "verify",
                          str(service.journal_dir), "--config", service.config,
                          "--redis-url", service.redis_url],
                         capture_output=True, text=True, env=service.env, timeout=60)
    return out.returncode, out.stderr


async def eviction_scenario(policy: str, *, evictions: int = 2400, maxmemory: str = "8mb",
                            switched: bool = False) -> EvictionRun:
    """The scenario of the module's docstring on a Redis with `policy`. `switched`: Redis
    starts with noeviction and is switched to `policy` (CONFIG SET) after the first round,
    and back to noeviction once the other client's keys are deleted; the combinations are
    then sold to their cap a third time."""
    run = EvictionRun(f"{policy} (switched)" if switched else policy)
    server = RedisServer(extra=("--maxmemory", maxmemory, "--maxmemory-policy",
                                "noeviction" if switched else policy)).start()
    try:
        service = ServiceProcess(str(CONFIG), server.url).start()
        db = server.client()
        try:
            async with aiohttp.ClientSession() as session:
                seller = _Seller(session, service.base_url, run)
                run.ready = await seller.ready()
                await seller.sell_out("a")
                if switched:
                    db.config_set("maxmemory-policy", policy)
                    # A process reads the policy again every second (capsvc.redis.gate): the
                    # evictions begin once it had the time to (if it ever reads it).
                    await seller.ready(False)
                run.evicted, run.filler_refused = await asyncio.to_thread(fill, db, evictions)
                if run.filler_refused:
                    squeeze(db)
                await seller.sell_out("b")
                run.verify = await asyncio.to_thread(verify, service)
                await asyncio.to_thread(unfill, db)
                db.config_set("maxmemory", maxmemory)
                if switched:
                    db.config_set("maxmemory-policy", "noeviction")
                await seller.ready()  # a process held by its Redis may serve again now
                if switched:
                    await seller.sell_out("c")
                run.answered = len(seller.sold)
                run.lost = await seller.lost()
                run.highest = max(seller.staked)
                run.over_cap = sum(s > CAP for s in seller.staked)
        finally:
            db.close()
            service.stop()
            run.log = service.log.read_text()
    finally:
        server.stop()
    return run
