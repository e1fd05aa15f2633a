"""Identical POSTs racing on one sale in steps (Redis Cluster; `sale_calls = "steps"` on a
standalone Redis), sent to two services: whichever request writes the decision answers it
first and is the only one to count it in the metrics; every other answers it as a replay.

The race: a duplicate that resumes the pending sale and writes its decision must answer
it first even though it found the claim pending, and the request that made the claim,
finding it decided, answers a replay: exactly one answers it first and counts it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from capsvc.config import Settings
from tests.conftest import TEN, Client, new_id, services, ticket
from tests.integration.test_metrics import delta, scrape
from tests.support.servers import RedisCluster, RedisServer

ROUNDS = 20
COPIES = 40
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrapes(clients: list[Client]) -> Samples:
    """The metrics of several services added up."""
    total: Samples = {}
    for c in clients:
        for key, value in (await scrape(c)).items():
            total[key] = total.get(key, 0.0) + value
    return total


async def race(clients: list[Client], body: dict[str, Any], token: str) -> int:
    """COPIES concurrent copies of `body`, spread over `clients`: how many answered without
    `Idempotent-Replayed` (every answer a 200 with one body)."""
    replies = await asyncio.gather(*[clients[i % len(clients)].sell(body, token=token)
                                     for i in range(COPIES)])
    assert {r.status for r in replies} == {200}, [r.body for r in replies]
    assert len({r.raw for r in replies}) == 1
    return sum(1 for r in replies if "Idempotent-Replayed" not in r.headers)


def grids(r: int, stake: int) -> list[dict[str, Any]]:
    """Three capped grids (three reserve steps; on a cluster, on several nodes)."""
    return [{"numbers": TEN, "stake": stake}, {"numbers": TEN[:9], "stake": stake},
            {"numbers": [*TEN[:7], 42 + r], "stake": stake}]


@pytest.fixture
async def clients(settings: Settings, redis_backend: RedisServer | RedisCluster,
                  redis_db: Any) -> Any:
    """Two services selling in steps on the test's Redis. No request may time out (a 503
    leaves its outcome unknown, and whether it was the one to answer first): the timeouts
    are far above any delay a loaded machine puts on 40 concurrent requests (one took over
    the 2 s of the suite's configuration on a machine with two busy loops beside it)."""
    steps = dataclasses.replace(settings, one_call_sales=False, request_timeout_ms=30_000,
                                redis_timeout_ms=10_000, pending_deadline_ms=60_000)
    async with services([steps, steps], redis_backend.url) as started:
        yield started


async def test_forty_racing_copies_answer_one_first_decision_counted_once(
        clients: list[Client]) -> None:
    """20 rounds of 40 concurrent copies of a new ticket: in every round one answer
    without `Idempotent-Replayed`, 40 identical bodies, and the metrics of the two
    services move by exactly one decision per ticket."""
    before = await scrapes(clients)
    fresh = [await race(clients, ticket(grids(r, 100), draws=2), "fr") for r in range(ROUNDS)]
    after = await scrapes(clients)
    assert fresh == [1] * ROUNDS, str(fresh)
    assert delta(after, before, "capsvc_tickets_total", game="fdj-keno",
                 status="accepted") == ROUNDS
    assert delta(after, before, "capsvc_grids_total", game="fdj-keno", status="accepted",
                 reason="") == 3 * ROUNDS
    assert delta(after, before, "capsvc_accepted_stake_total",
                 game="fdj-keno") == ROUNDS * 2 * 300


async def test_racing_copies_of_a_player_limited_sale_count_once(
        clients: list[Client]) -> None:
    """The same with player limits (the budget is one more step): tickets that fit and
    tickets refused by the player's limit, each answered first once and counted once."""
    refused = new_id("P")
    assert (await clients[0].request("PUT", f"/v1/players/{refused}/limit", {"daily": 0},
                                     token="ma")).status == 200
    before = await scrapes(clients)
    fresh = [await race(clients, ticket(grids(r, 250), game="lnm-keno",
                                        player_id=refused if r % 2 else new_id("P")), "ma")
             for r in range(ROUNDS // 2)]
    after = await scrapes(clients)
    assert fresh == [1] * (ROUNDS // 2), str(fresh)
    for status in ("accepted", "rejected"):
        assert delta(after, before, "capsvc_tickets_total", game="lnm-keno",
                     status=status) == ROUNDS // 4
    assert delta(after, before, "capsvc_grids_total", game="lnm-keno", status="rejected",
                 reason="player_limit") == 3 * (ROUNDS // 4)
    assert delta(after, before, "capsvc_player_limit_rejections_total",
                 game="lnm-keno") == ROUNDS // 4
