"""A draw's exposure (`GET /v1/games/{game}/draws/{draw}/exposure`), through HTTP on a
standalone Redis (one-call sales) and on a Redis Cluster (sales in steps): stakes by
number of picks, combinations played, at and near their cap, the most played ones and what
they would cost if drawn; cancellations and refusals taken into account."""

from __future__ import annotations

from typing import Any

import pytest

from capsvc.domain.errors import Unavailable
from capsvc.http.server import Service
from capsvc.service import exposure as exposure_module
from tests.conftest import Client, past_deadline, ticket

A, B, C, D = ([1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18, 19],
              [21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [31, 32, 33, 34, 35, 36, 37, 38])


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exposure_module, "CACHE_S", 0.0)  # every request computes


async def exposure(client: Client, draw: int, token: str = "fr") -> dict[str, Any]:
    reply = await client.get(f"/v1/games/fdj-keno/draws/{draw}/exposure", token=token)
    assert reply.status == 200, reply.body
    body: dict[str, Any] = reply.body
    return body


async def test_exposure_of_a_draw(client: Client) -> None:
    d = await client.current() + 1
    sold = [
        await client.sell(ticket([{"numbers": A, "stake": 1000}] * 5, first_draw=d)),
        await client.sell(ticket([{"numbers": B, "stake": 1000}] * 4, first_draw=d)),
        await client.sell(ticket([{"numbers": C, "stake": 500}, {"numbers": A[:3], "stake": 200}],
                                 first_draw=d)),
        await client.sell(ticket([{"numbers": D, "stake": 300}], first_draw=d, draws=2)),
        await client.sell(ticket([{"numbers": A, "stake": 100}], first_draw=d)),  # refused
    ]
    assert [s.body["status"] for s in sold] == ["accepted"] * 4 + ["rejected"]
    got = await exposure(client, d)
    assert (got["draw"], got["cap"], got["cap_fixed"]) == (d, 5000, True)
    assert got["stakes"] == [{"picks": 3, "stake": 200}, {"picks": 8, "stake": 5300},
                             {"picks": 9, "stake": 4000}, {"picks": 10, "stake": 500}]
    assert got["capped"] == [
        {"picks": 8, "played": 2, "at_cap": 1, "near_cap": 1, "stake": 5300},
        {"picks": 9, "played": 1, "at_cap": 0, "near_cap": 1, "stake": 4000},
        {"picks": 10, "played": 1, "at_cap": 0, "near_cap": 0, "stake": 500}]
    # Top-rank liability: staked / 1 EUR x the preset's top prize for the size.
    assert got["top"] == [
        {"numbers": A, "staked": 5000, "liability": 5000 * 100000 // 100},
        {"numbers": B, "staked": 4000, "liability": 4000 * 2000000 // 100},
        {"numbers": C, "staked": 500, "liability": 500 * 20000000 // 100},
        {"numbers": D, "staked": 300, "liability": 300 * 100000 // 100}]
    assert got["top_liability"] == 100_000_000
    # The subscription's second draw, and a draw nobody played.
    second = await exposure(client, d + 1)
    assert second["stakes"] == [{"picks": 8, "stake": 300}]
    assert second["top"] == [{"numbers": D, "staked": 300, "liability": 300_000}]
    empty = await exposure(client, d + 5)
    assert (empty["stakes"], empty["capped"], empty["top"], empty["top_liability"],
            empty["cap_fixed"]) == ([], [], [], None, False)
    # A cancellation takes its stakes out everywhere.
    cancelled = await client.post(f"/v1/tickets/{sold[2].body['ticket_id']}/cancel")
    assert cancelled.status == 200, cancelled.body
    after = await exposure(client, d)
    assert after["stakes"] == [{"picks": 8, "stake": 5300}, {"picks": 9, "stake": 4000}]
    assert [c["picks"] for c in after["capped"]] == [8, 9]
    assert [t["numbers"] for t in after["top"]] == [A, B, D]


async def test_exposure_needs_read_or_admin(client: Client) -> None:
    d = await client.current()
    assert (await client.get(f"/v1/games/fdj-keno/draws/{d}/exposure", token="pf")
            ).status == 403
    assert (await client.get(f"/v1/games/fdj-keno/draws/{d}/exposure", token=None)
            ).status == 401
    assert (await exposure(client, d, token="admin"))["draw"] == d
    assert (await client.get("/v1/games/fdj-keno/draws/0/exposure")).status == 404


async def test_the_top_keeps_the_twenty_largest(client: Client) -> None:
    d = await client.current() + 2
    for i in range(25):  # 25 combinations, staked 100 to 1000 (some share a stake)
        numbers = [i + 1 + k for k in range(8)]
        stake = [100, 200, 300, 500, 1000][i % 5]
        assert (await client.sell(ticket([{"numbers": numbers, "stake": stake}],
                                         first_draw=d))).status == 200
    top = (await exposure(client, d))["top"]
    assert len(top) == 20
    stakes = [t["staked"] for t in top]
    assert stakes == sorted(stakes, reverse=True)
    assert stakes.count(100) == 0
    assert stakes.count(1000) == 5


async def test_a_cancel_the_janitor_finishes_takes_the_ticket_out_once(
        service: tuple[Service, str], client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancel interrupted after its decision (503) is finished by the janitor: the
    ticket's stakes leave the draw's exposure once, whichever way it was sold."""
    svc, _ = service
    d = await client.current() + 1
    sold = await client.sell(ticket([{"numbers": C, "stake": 500},
                                     {"numbers": A[:3], "stake": 200}], first_draw=d))
    assert sold.status == 200
    kept = await client.sell(ticket([{"numbers": A[:4], "stake": 300}], first_draw=d))
    assert kept.status == 200

    async def lost(*args: Any, **kwargs: Any) -> None:
        raise Unavailable("simulated outage")

    monkeypatch.setattr(svc.store, "cancelled", lost)
    assert (await client.post(f"/v1/tickets/{sold.body['ticket_id']}/cancel")).status == 503
    monkeypatch.undo()
    monkeypatch.setattr(exposure_module, "CACHE_S", 0.0)
    janitor = past_deadline(svc.usecases.janitor)
    assert await janitor.run_once() == 1
    assert await janitor.run_once() == 0
    assert (await exposure(client, d))["stakes"] == [{"picks": 4, "stake": 300}]
    again = await client.post(f"/v1/tickets/{sold.body['ticket_id']}/cancel")
    assert again.status == 200
    assert (await exposure(client, d))["stakes"] == [{"picks": 4, "stake": 300}]
