"""Idempotency per (channel, ticket_id): replays, conflicts, concurrent duplicates."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import msgspec

from capsvc.client.models import TicketIn
from capsvc.config import GameRules, Settings
from capsvc.domain.validator import pack_sale, validate_ticket
from capsvc.redis.store import ticket_key
from tests.conftest import TEN, Client, services, ticket
from tests.records import TicketRecords
from tests.support.servers import RedisCluster, RedisServer


def with_game(settings: Settings, rules: GameRules) -> Settings:
    return dataclasses.replace(settings, games={**settings.games, rules.id: rules})


async def test_replay_returns_identical_body_with_header(client: Client) -> None:
    """A replay answers the same status and bytes, with Idempotent-Replayed: true."""
    body = ticket([{"numbers": TEN[:8], "stake": 500}], draws=2)
    first = await client.sell(body)
    second = await client.sell(body)
    assert second.status == first.status == 200
    assert second.raw == first.raw
    assert second.headers["Idempotent-Replayed"] == "true"
    assert await client.staked(TEN[:8], first.body["draws"][0]) == 500


async def test_replay_with_reordered_numbers_and_explicit_defaults(client: Client) -> None:
    """Number order and explicit default values do not make a different request."""
    body = ticket([{"numbers": TEN[:8], "stake": 500}])
    first = await client.sell(body)
    same = dict(body, draws=1, joker_plus=False,
                grids=[{"numbers": TEN[:8][::-1], "stake": 500, "multiplier": False}])
    replay = await client.sell(same)
    assert replay.status == 200
    assert replay.raw == first.raw


async def test_rejection_is_replayed_unchanged(client: Client) -> None:
    """A rejected decision stays rejected on replay, even after room was freed."""
    sellers = [ticket([{"numbers": TEN, "stake": 1000}]) for _ in range(5)]
    for s in sellers:
        await client.sell(s)
    late = ticket([{"numbers": TEN, "stake": 100}])
    rejected = await client.sell(late)
    assert rejected.body["status"] == "rejected"
    assert (await client.post(f"/v1/tickets/{sellers[0]['ticket_id']}/cancel")).status == 200
    replay = await client.sell(late)
    assert replay.raw == rejected.raw


async def test_same_id_with_another_body_is_a_conflict(client: Client) -> None:
    """The same ticket id with a different request: 409 and nothing counted."""
    body = ticket([{"numbers": TEN[:8], "stake": 500}])
    first = await client.sell(body)
    other = dict(body, grids=[{"numbers": TEN[:8], "stake": 1000}])
    reply = await client.sell(other)
    assert reply.status == 409
    assert reply.body["error"]["code"] == "idempotency_conflict"
    assert reply.body["error"]["path"] == "$.ticket_id"
    assert await client.staked(TEN[:8], first.body["draws"][0]) == 500


async def test_ticket_ids_are_per_channel(client: Client) -> None:
    """Two channels may use the same ticket id independently."""
    body = ticket([{"numbers": TEN[:8], "stake": 500}])
    a = await client.sell(body, token="fr")
    b = await client.sell(body, token="pf")
    assert a.status == b.status == 200
    assert "Idempotent-Replayed" not in b.headers
    assert await client.staked(TEN[:8], a.body["draws"][0]) == 1000


async def test_twenty_concurrent_duplicates_count_once(client: Client) -> None:
    """20 concurrent copies of one ticket: one counting, 20 identical answers."""
    body = ticket([{"numbers": TEN, "stake": 300}, {"numbers": TEN[:9], "stake": 200}], draws=2)
    replies = await asyncio.gather(*[client.sell(body) for _ in range(20)])
    assert {r.status for r in replies} == {200}
    assert len({r.raw for r in replies}) == 1
    fresh = [r for r in replies if "Idempotent-Replayed" not in r.headers]
    assert len(fresh) == 1
    draw = replies[0].body["draws"][0]
    assert await client.staked(TEN, draw) == 300
    assert await client.staked(TEN, draw + 1) == 300
    assert await client.staked(TEN[:9], draw) == 200


async def test_replay_after_the_draw_closed_returns_the_decision(client: Client) -> None:
    """Once its draw is closed, the same ticket (explicit first draw) still gets its
    decision back, byte for byte, while a new ticket for that draw is refused."""
    draw = await client.current()
    body = ticket([{"numbers": TEN[:8], "stake": 500}], first_draw=draw)
    sold = await client.sell(body)
    closed = await client.post(f"/v1/games/fdj-keno/draws/{draw}/close", token="admin")
    assert closed.status == 200
    replay = await client.sell(body)
    assert (replay.status, replay.raw) == (200, sold.raw)
    assert replay.headers["Idempotent-Replayed"] == "true"
    late = await client.sell(ticket([{"numbers": TEN[:8], "stake": 500}], first_draw=draw))
    assert (late.status, late.body["error"]["code"]) == (422, "draw_closed")


async def test_a_retry_finds_its_decision_after_the_configuration_changed(
        settings: Settings, redis_backend: RedisServer | RedisCluster, redis_db: Any) -> None:
    """A sale answered (its answer lost, say), then the service restarted with rules that
    would refuse it: fewer stakes, durations, grids and horizon, no multiplier, the game no
    longer sold by the channel. The same request gets the recorded decision (200, replayed);
    another body on the id is 409; a new ticket is judged by the new rules."""
    fdj = settings.games["fdj-keno"]
    narrowed = with_game(settings, dataclasses.replace(
        fdj, stakes=(100, 200), durations=(1,), max_grids=1, sales_horizon=0, multiplier=False))
    channels = tuple(dataclasses.replace(c, games=frozenset(c.games - {"fdj-keno"}))
                     if c.id == "pf-retail" else c for c in settings.channels)
    narrowed = dataclasses.replace(narrowed, channels=channels)
    async with services([settings], redis_backend.url) as (client,):
        d = await client.current() + 2
        bodies = [
            ticket([{"numbers": TEN[:8], "stake": 1000, "multiplier": True}] * 2,
                   first_draw=d, draws=2),
            ticket([{"numbers": TEN[1:9], "stake": 500}]),
        ]
        first = [await client.sell(b, token="pf") for b in bodies]
        assert [r.status for r in first] == [200, 200]
    async with services([narrowed], redis_backend.url) as (client,):
        for body, before in zip(bodies, first, strict=True):
            permuted = [{**g, "numbers": g["numbers"][::-1]} for g in body["grids"]]
            again = await client.sell({**body, "grids": permuted}, token="pf")
            assert (again.status, again.raw) == (200, before.raw)
            assert again.headers["Idempotent-Replayed"] == "true"
        other = await client.sell({**bodies[1], "draws": 2}, token="pf")
        assert (other.status, other.body["error"]["code"]) == (409, "idempotency_conflict")
        new = await client.sell(ticket([{"numbers": TEN[:8], "stake": 500}]), token="fr")
        assert (new.status, new.body["error"]["code"]) == (422, "stake_not_allowed")
        assert (await client.sell(ticket([{"numbers": TEN[:8], "stake": 100}]),
                                  token="pf")).status == 403


async def test_an_id_held_by_another_request_s_unfinished_sale_is_a_conflict(
        client: Client, redis_db: Any, settings: Settings) -> None:
    """A ticket id whose sale (of another request) was claimed and not decided — still
    running, or left to the janitor — answers 409 to a different request (the record keeps
    the sale, whose fingerprint is compared), and 503 to the same request while it is
    settled."""
    rules = settings.games["fdj-keno"]
    records = TicketRecords(redis_db)
    draw = await client.current() + 1
    for age, same in ((0, False), (3_600_000, False), (3_600_000, True)):
        body = ticket([{"numbers": TEN[:8], "stake": 500}], first_draw=draw)
        held = body if same else dict(body, grids=[{"numbers": TEN[:8], "stake": 1000}])
        sale = validate_ticket(rules, msgspec.convert(held, TicketIn))
        now = int(time.time() * 1000)
        records.put(ticket_key("fr-retail", body["ticket_id"]), now + 86_400_000, st="p",
                    at=str(now - age).encode(), sid=b"0" * 16, sale=pack_sale(sale))
        reply = await client.sell(body)
        assert reply.status == (503 if same else 409), (age, same, reply.body)
        if not same:
            assert reply.body["error"]["code"] == "idempotency_conflict"
    assert await client.staked(TEN[:8], draw) == 0
