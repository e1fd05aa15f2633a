"""Tickets left pending (a crash or an outage between steps) converge to one decision."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import redis

from capsvc.config import Settings
from capsvc.domain.errors import Unavailable
from capsvc.http.server import Service
from capsvc.redis.store import pending_key_of, ticket_key
from tests.conftest import TEN, Client, past_deadline, ticket


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """Sales in steps, as on a Redis Cluster: these tests fail them between steps (a sale in
    one call has no step to fail between, and leaves nothing pending)."""
    return dataclasses.replace(settings, one_call_sales=False)


def fail_second_reserve(svc: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the second reserve of the next sale fail as if Redis went away."""
    original = svc.store.reserve
    calls = {"n": 0}

    def reserve(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise Unavailable("simulated outage")
        return original(*args, **kwargs)

    monkeypatch.setattr(svc.store, "reserve", reserve)


async def test_retry_after_a_failure_between_steps_converges(
        service: tuple[Service, str], client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """First grid counted, second step failed (503): the retry completes, counting once."""
    svc, _ = service
    draw = await client.current()
    body = ticket([{"numbers": TEN, "stake": 500}, {"numbers": TEN[:8], "stake": 300}])
    fail_second_reserve(svc, monkeypatch)
    assert (await client.sell(body)).status == 503
    assert await client.staked(TEN, draw) == 500
    got = await client.get(f"/v1/tickets/{body['ticket_id']}")
    assert (got.status, got.body["error"]["code"]) == (409, "ticket_pending")
    monkeypatch.undo()
    retry = await client.sell(body)
    assert retry.status == 200
    assert retry.body["status"] == "accepted"
    assert await client.staked(TEN, draw) == 500
    assert await client.staked(TEN[:8], draw) == 300


async def test_janitor_releases_an_abandoned_sale(
        service: tuple[Service, str], client: Client, redis_db: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A sale that never completed (no answer was sent) is released past the deadline; a
    later retry starts afresh and counts once."""
    svc, _ = service
    draw = await client.current()
    body = ticket([{"numbers": TEN, "stake": 500}, {"numbers": TEN[:8], "stake": 300}])
    fail_second_reserve(svc, monkeypatch)
    assert (await client.sell(body)).status == 503
    monkeypatch.undo()
    assert await svc.usecases.janitor.run_once() == 0  # not yet due
    assert await past_deadline(svc.usecases.janitor).run_once() == 1
    assert await client.staked(TEN, draw) == 0
    assert (await client.get(f"/v1/tickets/{body['ticket_id']}")).status == 404
    retry = await client.sell(body)
    assert retry.body["status"] == "accepted"
    assert await client.staked(TEN, draw) == 500
    assert await past_deadline(svc.usecases.janitor).run_once() == 0


async def test_janitor_finalizes_a_sale_whose_last_write_was_lost(
        service: tuple[Service, str], client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every grid recorded but the decision write lost: the answer is a 503 (outcome
    unknown); replays rebuild the identical decision, and so does the janitor when nobody
    asks again; the counts are kept once."""
    svc, _ = service
    draw = await client.current()
    body = ticket([{"numbers": TEN, "stake": 500}, {"numbers": [1, 2, 3], "stake": 200}])

    async def lost(*args: object) -> None:
        raise Unavailable("the decision write was lost")

    monkeypatch.setattr(svc.store, "finalize", lost)
    assert (await client.sell(body)).status == 503
    replay = await client.sell(body)
    assert replay.status == 503
    monkeypatch.undo()
    assert (await client.get(f"/v1/tickets/{body['ticket_id']}")).status == 409
    assert await past_deadline(svc.usecases.janitor).run_once() == 1
    got = await client.get(f"/v1/tickets/{body['ticket_id']}")
    assert got.status == 200
    assert got.body["status"] == "accepted"
    replay = await client.sell(body)
    assert (replay.raw, replay.headers["Idempotent-Replayed"]) == (got.raw, "true")
    assert await client.staked(TEN, draw) == 500


async def test_janitor_gives_an_abandoned_sale_budget_back(
        service: tuple[Service, str], client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """A limited game's sale interrupted after the budget step: the janitor gives the
    player's budget back with the counters, once."""
    svc, _ = service
    body = ticket([{"numbers": TEN, "stake": 1000}, {"numbers": TEN[:9], "stake": 500}],
                  game="lnm-keno", player_id="P-J")
    fail_second_reserve(svc, monkeypatch)
    assert (await client.sell(body, token="ma")).status == 503
    monkeypatch.undo()
    state = await client.get("/v1/players/P-J", token="ma")
    assert state.body["spent"] == 1500
    assert await past_deadline(svc.usecases.janitor).run_once() == 1
    assert await past_deadline(svc.usecases.janitor).run_once() == 0
    state = await client.get("/v1/players/P-J", token="ma")
    assert state.body["spent"] == 0
    assert await client.staked(TEN, await client.current("lnm-keno"), game="lnm-keno") == 0


async def test_a_draws_stakes_count_a_settled_sale_once_and_an_abandoned_one_never(
        service: tuple[Service, str], client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exposure's stakes by size: a sale whose decision write failed is counted once
    whether its retry or the janitor completes it; a sale the janitor gives back, never."""
    from capsvc.service import exposure

    monkeypatch.setattr(exposure, "CACHE_S", 0.0)
    svc, _ = service
    draw = await client.current() + 1

    async def stakes() -> list[dict[str, int]]:
        reply = await client.get(f"/v1/games/fdj-keno/draws/{draw}/exposure", token="admin")
        assert reply.status == 200, reply.body
        got: list[dict[str, int]] = reply.body["stakes"]
        return got

    original = svc.store.finalize

    async def lost(*args: Any, **kwargs: Any) -> bool:
        raise Unavailable("simulated outage")

    settled = ticket([{"numbers": TEN, "stake": 500}, {"numbers": TEN[:3], "stake": 200}],
                     first_draw=draw)
    monkeypatch.setattr(svc.store, "finalize", lost)
    assert (await client.sell(settled)).status == 503
    monkeypatch.setattr(svc.store, "finalize", original)
    assert await past_deadline(svc.usecases.janitor).run_once() == 1
    assert (await client.sell(settled)).status == 200  # the retry: replayed, not counted again
    assert await stakes() == [{"picks": 3, "stake": 200}, {"picks": 10, "stake": 500}]
    abandoned = ticket([{"numbers": TEN, "stake": 500}, {"numbers": TEN[:8], "stake": 300}],
                       first_draw=draw)
    fail_second_reserve(svc, monkeypatch)
    assert (await client.sell(abandoned)).status == 503
    monkeypatch.undo()
    monkeypatch.setattr(exposure, "CACHE_S", 0.0)
    assert await past_deadline(svc.usecases.janitor).run_once() == 1
    assert await stakes() == [{"picks": 3, "stake": 200}, {"picks": 10, "stake": 500}]


async def test_a_claim_refused_by_the_close_leaves_an_index_entry_the_janitor_lets_go(
        service: tuple[Service, str], client: Client, redis_db: redis.Redis) -> None:
    """The claim indexes its ticket in the same call whatever it answers: a claim refused by
    the close (nothing claimed) leaves an entry with no ticket behind it, which the janitor
    lets go, settling nothing and answering nothing."""
    svc, _ = service
    draw = await client.current()
    body = ticket([{"numbers": TEN, "stake": 500}], first_draw=draw - 1)
    refused = await client.sell(body)
    assert (refused.status, refused.body["error"]["code"]) == (422, "draw_closed")
    key = ticket_key("fr-retail", body["ticket_id"])
    assert redis_db.zscore(pending_key_of(key), key) is not None
    assert await past_deadline(svc.usecases.janitor).run_once() == 0
    assert redis_db.zscore(pending_key_of(key), key) is None
    assert (await client.get(f"/v1/tickets/{body['ticket_id']}")).status == 404
    assert await client.staked(TEN, draw - 1) == 0
