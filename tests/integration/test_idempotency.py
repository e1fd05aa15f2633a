"""Idempotency per (channel, ticket_id): replays, conflicts, concurrent duplicates."""

from __future__ import annotations

import asyncio

from tests.conftest import TEN, Client, ticket


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
