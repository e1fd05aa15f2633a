"""A Redis Cluster shard that lost a sale's counters while the others kept its decision
(its primary and the replica that had not confirmed them both lost: a decision answered
503, never confirmed). The retry must not answer "accepted" for a stake no counter holds:
it counts the lost grids again under the same sale, against the cap, or, if they no longer
fit, answers 503; a GET meanwhile says the ticket is pending, not decided.

The loss is made by hand (the record and the counter removed, as the shard's failover
would), so that the case runs in a second."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from capsvc.config import Settings
from capsvc.domain import combination
from capsvc.redis.store import bucket_keys, record_field, ticket_key
from tests.conftest import TEN, Client, services, ticket
from tests.records import held
from tests.support.servers import RedisCluster

STAKE = 1000


@pytest.fixture
def db(redis_cluster: RedisCluster) -> Any:
    """The session's cluster, emptied: a test file that ran before in this process may have
    sold the same combination on the same draw (CI saw a counter at 500 it did not sell)."""
    client = redis_cluster.client()
    client.flushall()
    return client


@pytest.fixture
async def seller(settings: Settings, redis_cluster: RedisCluster, db: Any
                 ) -> AsyncIterator[Client]:
    async with services([settings], redis_cluster.url) as (client,):
        yield client


def lose_counters(db: Any, body: dict[str, Any], draw: int) -> None:
    """What the shard's failover took: the grid's record and its stake on the counter."""
    key = ticket_key("fr-retail", body["ticket_id"])
    sale_id = held(db, key, "sid").decode()
    combo = combination.encode(body["grids"][0]["numbers"])
    bucket = bucket_keys("fdj-keno", combo, draw, 1)[-1]
    assert db.hdel(bucket, record_field(sale_id, 0)) == 1
    db.hincrby(bucket, combo, -STAKE)


async def test_the_retry_counts_again_what_a_shard_lost(seller: Client, db: Any) -> None:
    """GET says pending (409) while the counters are missing; the POST sent again counts
    the grid again and answers the decision as a replay."""
    draw = await seller.current() + 1
    body = ticket([{"numbers": TEN[:8], "stake": STAKE}], first_draw=draw)
    first = await seller.sell(body)
    assert first.status == 200, first.body
    lose_counters(db, body, draw)
    assert await seller.staked(TEN[:8], draw) == 0
    pending = await seller.get(f"/v1/tickets/{body['ticket_id']}")
    assert (pending.status, pending.body["error"]["code"]) == (409, "ticket_pending")
    again = await seller.sell(body)
    assert again.status == 200, again.body
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.body == first.body
    assert await seller.staked(TEN[:8], draw) == STAKE
    assert (await seller.sell(body)).body == first.body
    assert await seller.staked(TEN[:8], draw) == STAKE  # counted once
    assert (await seller.get(f"/v1/tickets/{body['ticket_id']}")).body == first.body


async def test_a_lost_grid_that_no_longer_fits_is_not_answered(seller: Client, db: Any
                                                                ) -> None:
    """Others sold the combination to its cap meanwhile: the retry is 503, never a 200 for
    a stake beyond the cap."""
    draw = await seller.current() + 2
    numbers = [*TEN[:7], 44]
    body = ticket([{"numbers": numbers, "stake": STAKE}], first_draw=draw)
    assert (await seller.sell(body)).status == 200
    lose_counters(db, {**body, "grids": [{"numbers": numbers}]}, draw)
    for _ in range(5):
        other = await seller.sell(ticket([{"numbers": numbers, "stake": STAKE}],
                                         first_draw=draw))
        assert other.body["status"] == "accepted"
    for _ in range(3):  # the refusal the first re-count left is no decision either
        again = await seller.sell(body)
        assert again.status == 503, again.body
        pending = await seller.get(f"/v1/tickets/{body['ticket_id']}")
        assert (pending.status, pending.body["error"]["code"]) == (409, "ticket_pending")
    assert await seller.staked(numbers, draw) == 5 * STAKE


@pytest.mark.parametrize("redis_backend", ["cluster"], indirect=True)
async def test_a_cancel_between_the_read_of_a_decision_and_its_grids_is_no_loss(
        service: Any, client: Client, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A GET (or a replay) reads a decision, then its accepted grids' records (a shard may
    have lost them). A cancel that gave the grids back in between left them released
    ("X"): that is the cancel, not a loss. The GET answers the decision as it read it, the
    replay answers it too (nothing counted again), and no error is logged. Answered 409
    and 503 (with an error for the operator) when each released grid read as lost."""
    svc, _ = service
    store = svc.store
    draw = await client.current() + 1
    body = ticket([{"numbers": TEN[:8], "stake": STAKE}], first_draw=draw)
    sold = await client.sell(body)
    assert sold.status == 200, sold.body
    key = ticket_key("fr-retail", body["ticket_id"])
    # The decision as a look-up and a replay's claim read it before the cancel.
    read_before = await store.ticket(key)
    claims: list[Any] = []
    claim = store.claim

    def claimed(name: str, *args: Any) -> Any:
        reply = claim(name, *args)
        reply.add_done_callback(lambda done: claims.append(done.result()))
        return reply

    monkeypatch.setattr(store, "claim", claimed)
    assert (await client.sell(body)).raw == sold.raw
    assert (await client.post(f"/v1/tickets/{body['ticket_id']}/cancel")).status == 200
    read = store.ticket

    def as_before(reply: Any) -> Any:
        done = asyncio.get_running_loop().create_future()
        done.set_result(reply)
        return done

    monkeypatch.setattr(store, "ticket",
                        lambda name: as_before(read_before) if name == key else read(name))
    monkeypatch.setattr(store, "claim",
                        lambda name, *args: as_before(claims[0]) if name == key
                        else claim(name, *args))
    caplog.set_level(logging.ERROR)
    got = await client.get(f"/v1/tickets/{body['ticket_id']}")
    assert got.status == 200, got.body
    assert got.raw == sold.raw
    again = await client.sell(body)
    assert again.status == 200, again.body
    assert again.raw == sold.raw
    assert await client.staked(TEN[:8], draw) == 0  # given back, not counted again
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
