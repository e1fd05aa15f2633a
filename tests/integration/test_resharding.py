"""Slots move between primaries while sales run: nothing lost, nothing counted twice."""

from __future__ import annotations

import asyncio
import random
import subprocess
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from capsvc.config import Settings
from capsvc.server import build
from capsvc.testing import RedisCluster, cli_binary
from tests.conftest import Client, Reply, start_service, ticket


@pytest.fixture
def cluster() -> Iterator[RedisCluster]:
    c = RedisCluster().start()
    yield c
    c.stop()


def reshard(cluster: RedisCluster, source: int, target: int, slots: int) -> None:
    ids = [s.client().execute_command("CLUSTER", "MYID").decode() for s in cluster.servers]
    subprocess.run([cli_binary(), "--cluster", "reshard", cluster.addresses[0],
                    "--cluster-from", ids[source], "--cluster-to", ids[target],
                    "--cluster-slots", str(slots), "--cluster-yes",
                    "--cluster-pipeline", "10"],
                   check=True, capture_output=True, timeout=300)


@pytest.mark.slow
async def test_resharding_under_load(settings: Settings, cluster: RedisCluster) -> None:
    """While 2 x 3000 slots move, hundreds of sales on 40 combinations keep every counter
    equal to the stakes accepted on it, never above the cap."""
    svc = build(settings, cluster.url)
    runner, url = await start_service(svc)
    rng = random.Random(3)
    combos = [sorted(rng.sample(range(1, 71), 8)) for _ in range(40)]
    accepted: dict[tuple[str, int], int] = {}
    statuses: list[int] = []

    async def sell_until_decided(client: Client, body: dict[str, Any]) -> Reply:
        for _ in range(50):
            reply = await client.sell(body)
            statuses.append(reply.status)
            if reply.status != 503:
                return reply
            await asyncio.sleep(0.05)  # Retry-After, shortened: the same ticket again
        raise AssertionError("no decision")

    moved = asyncio.Event()

    async def seller(client: Client, k: int) -> None:
        sold = 0
        while not moved.is_set() or sold < 20:  # sell for as long as slots are moving
            sold += 1
            combo = combos[rng.randrange(len(combos))]
            body = ticket([{"numbers": combo, "stake": rng.choice([100, 500, 1000])}])
            reply = await sell_until_decided(client, body)
            assert reply.status == 200, reply.body
            if reply.body["status"] == "accepted":
                key = ("-".join(map(str, combo)), reply.body["draws"][0])
                accepted[key] = accepted.get(key, 0) + body["grids"][0]["stake"]

    try:
        async with aiohttp.ClientSession() as session:
            client = Client(session, url)
            sellers = asyncio.gather(*[seller(client, k) for k in range(8)])
            await asyncio.to_thread(reshard, cluster, 0, 1, 3000)
            await asyncio.to_thread(reshard, cluster, 1, 2, 3000)
            moved.set()
            await sellers
            for (combo, draw), stake in accepted.items():
                staked = await client.staked(list(map(int, combo.split("-"))), draw)
                assert staked == stake
                assert staked <= 5000
        assert sum(accepted.values()) > 0
        assert 500 not in statuses
        assert len(statuses) > 8 * 20
    finally:
        await runner.cleanup()
        await svc.redis.aclose()
