"""POST /v1/tickets and GET /v1/tickets/{id} through real HTTP on a real Redis."""

from __future__ import annotations

from tests.conftest import TEN, Client, new_id, ticket


async def test_accepts_a_ticket_and_counts_its_capped_grid(client: Client) -> None:
    """An accepted 8-number grid is counted on its draw, with cost and receipt."""
    draw = await client.current()
    reply = await client.sell(ticket([{"numbers": [56, 3, 7, 12, 18, 25, 33, 41], "stake": 500}]))
    assert reply.status == 200, reply.body
    body = reply.body
    assert body["status"] == "accepted"
    assert body["draws"] == [draw]
    assert body["grids"] == [{"index": 0, "numbers": [3, 7, 12, 18, 25, 33, 41, 56],
                              "status": "accepted", "cost": 500}]
    assert body["total_cost"] == 500
    assert body["receipt"]["receipt_id"]
    assert body["receipt"]["issued_at"].endswith(("+01:00", "+02:00"))
    assert "Idempotent-Replayed" not in reply.headers
    assert await client.staked([3, 7, 12, 18, 25, 33, 41, 56], draw) == 500


async def test_uncapped_sizes_are_not_counted(client: Client) -> None:
    """Grids of 2..7 numbers are sold without any counter."""
    draw = await client.current()
    reply = await client.sell(ticket([{"numbers": [1, 2, 3, 4, 5, 6, 7], "stake": 1000}]))
    assert reply.body["status"] == "accepted"
    lookup = await client.get(f"/v1/games/fdj-keno/draws/{draw}/combinations/1-2-3-4-5-6-7")
    assert lookup.body == {"numbers": [1, 2, 3, 4, 5, 6, 7], "draw": draw, "cap": None,
                           "staked": None, "remaining": None, "selectable": True}


async def test_partial_acceptance_when_one_grid_overflows(client: Client) -> None:
    """The grid that would overflow is rejected with its draw and room; the rest goes through."""
    draw = await client.current()
    full = TEN[:9]
    for _ in range(4):  # 4 x 10 EUR = 40 EUR
        assert (await client.sell(ticket([{"numbers": full, "stake": 1000}]))).body[
            "status"] == "accepted"
    reply = await client.sell(ticket([
        {"numbers": full, "stake": 1000},   # 50 EUR: fits exactly
        {"numbers": full, "stake": 100},    # 51 EUR: overflows
        {"numbers": [1, 2], "stake": 200},
    ]))
    body = reply.body
    assert body["status"] == "partial"
    assert [g["status"] for g in body["grids"]] == ["accepted", "rejected", "accepted"]
    assert body["grids"][1] == {"index": 1, "numbers": sorted(full), "status": "rejected",
                                "reason": "combination_capped", "draw": draw, "remaining": 0}
    assert body["total_cost"] == 1200
    assert await client.staked(full, draw) == 5000


async def test_no_receipt_when_every_grid_is_capped(client: Client) -> None:
    """A sale whose every grid is capped is rejected with a null receipt and counts nothing."""
    draw = await client.current()
    for _ in range(5):
        await client.sell(ticket([{"numbers": TEN, "stake": 1000}]))
    reply = await client.sell(ticket([{"numbers": TEN, "stake": 100}]))
    assert reply.status == 200
    assert reply.body["status"] == "rejected"
    assert reply.body["receipt"] is None
    assert reply.body["total_cost"] == 0
    assert await client.staked(TEN, draw) == 5000


async def test_multiplier_and_joker_are_priced_but_not_counted(client: Client) -> None:
    """Only the base stake counts toward the cap; the options change the cost only."""
    draw = await client.current()
    reply = await client.sell(ticket(
        [{"numbers": TEN[:8], "stake": 300, "multiplier": True}], draws=2, joker_plus=True))
    body = reply.body
    assert body["grids"][0]["cost"] == 300 * 2 * 2
    assert body["total_cost"] == 1200 + 200 * 2
    assert await client.staked(TEN[:8], draw) == 300
    assert await client.staked(TEN[:8], draw + 1) == 300


async def test_joker_not_charged_when_nothing_is_accepted(client: Client) -> None:
    """Joker+ is added to total_cost only when at least one grid is accepted."""
    for _ in range(5):
        await client.sell(ticket([{"numbers": TEN, "stake": 1000}]))
    reply = await client.sell(ticket([{"numbers": TEN, "stake": 100}], joker_plus=True))
    assert reply.body["status"] == "rejected"
    assert reply.body["total_cost"] == 0


async def test_subscription_counts_every_draw(client: Client) -> None:
    """A 5-draw subscription counts its stake on each of the five draws."""
    draw = await client.current()
    reply = await client.sell(ticket([{"numbers": TEN[:8], "stake": 200}], draws=5,
                                     first_draw=draw + 1))
    assert reply.body["draws"] == [draw + 1 + i for i in range(5)]
    assert reply.body["total_cost"] == 1000
    for d in range(draw + 1, draw + 6):
        assert await client.staked(TEN[:8], d) == 200
    assert await client.staked(TEN[:8], draw) == 0


async def test_subscription_with_a_full_third_draw_is_rejected_whole(client: Client) -> None:
    """If the third draw is full, the grid is rejected and nothing is counted on any draw."""
    draw = await client.current()
    third = draw + 2
    for _ in range(5):
        await client.sell(ticket([{"numbers": TEN, "stake": 1000}], first_draw=third))
    reply = await client.sell(ticket([{"numbers": TEN, "stake": 100}], first_draw=draw, draws=5))
    grid = reply.body["grids"][0]
    assert reply.body["status"] == "rejected"
    assert (grid["reason"], grid["draw"], grid["remaining"]) == ("combination_capped", third, 0)
    assert [await client.staked(TEN, d) for d in range(draw, draw + 5)] == [0, 0, 5000, 0, 0]


async def test_channels_share_the_counters(client: Client) -> None:
    """France and French Polynesia feed the same counter (the cap is shared)."""
    draw = await client.current()
    await client.sell(ticket([{"numbers": TEN, "stake": 1000}] * 3), token="fr")
    reply = await client.sell(ticket([{"numbers": TEN, "stake": 1000}] * 3), token="pf")
    assert [g["status"] for g in reply.body["grids"]] == ["accepted", "accepted", "rejected"]
    assert await client.staked(TEN, draw) == 5000


async def test_grids_of_one_ticket_on_one_combination_add_up(client: Client) -> None:
    """Two grids of one ticket on the same combination are both counted (in grid order)."""
    draw = await client.current()
    reply = await client.sell(ticket([{"numbers": TEN, "stake": 1000}] * 6))
    assert [g["status"] for g in reply.body["grids"]] == ["accepted"] * 5 + ["rejected"]
    assert await client.staked(TEN, draw) == 5000


async def test_get_ticket_returns_the_stored_decision(client: Client) -> None:
    """GET returns the byte-identical decision; another channel does not see it."""
    body = ticket()
    sold = await client.sell(body)
    got = await client.get(f"/v1/tickets/{body['ticket_id']}")
    assert got.status == 200
    assert got.raw == sold.raw
    assert (await client.get(f"/v1/tickets/{body['ticket_id']}", token="read")).status == 404


async def test_get_unknown_ticket_is_404(client: Client) -> None:
    """An unknown ticket id is a 404 not_found."""
    reply = await client.get(f"/v1/tickets/{new_id()}")
    assert reply.status == 404
    assert reply.body["error"]["code"] == "not_found"


async def test_lnm_ticket_with_player(client: Client) -> None:
    """An LNM subscription costs stake x draws exactly."""
    reply = await client.sell(ticket([{"numbers": list(range(1, 11)), "stake": 250}],
                                     game="lnm-keno", player_id="P-1", draws=20), token="ma")
    assert reply.status == 200, reply.body
    assert reply.body["total_cost"] == 5000
