"""Availability: combination lookup, batch availability, sold-out list."""

from __future__ import annotations

from tests.conftest import TEN, Client, ticket


async def test_combination_lookup_in_any_order(client: Client) -> None:
    """The lookup takes numbers in any order and reports cap, staked, remaining."""
    draw = await client.current()
    await client.sell(ticket([{"numbers": TEN[:8], "stake": 1000}] * 4))
    numbers = "-".join(str(n) for n in reversed(TEN[:8]))
    reply = await client.get(f"/v1/games/fdj-keno/draws/{draw}/combinations/{numbers}")
    assert reply.status == 200
    assert reply.body == {"numbers": TEN[:8], "draw": draw, "cap": 5000, "staked": 4000,
                          "remaining": 1000, "selectable": True}


async def test_combination_not_selectable_below_smallest_stake(client: Client) -> None:
    """With less room than the smallest stake, a combination is not selectable."""
    draw = await client.current()
    await client.sell(ticket([{"numbers": TEN, "stake": 1000}] * 5))
    reply = await client.get(f"/v1/games/fdj-keno/draws/{draw}/combinations/"
                             + "-".join(map(str, TEN)))
    assert reply.body["remaining"] == 0
    assert reply.body["selectable"] is False


async def test_combination_lookup_rejects_bad_numbers(client: Client) -> None:
    """Numbers out of the matrix, duplicates, or garbage are 422, never 500."""
    draw = await client.current()
    base = f"/v1/games/fdj-keno/draws/{draw}/combinations/"
    assert (await client.get(base + "1-2-3-4-5-6-7-71")).body["error"]["code"] == \
        "number_out_of_range"
    assert (await client.get(base + "1-2-3-4-5-6-7-7")).body["error"]["code"] == \
        "duplicate_numbers"
    assert (await client.get(base + "1-x")).status == 422
    assert (await client.get(base + "1")).body["error"]["code"] == "picks_not_allowed"


async def test_batch_availability_counts_nothing(client: Client) -> None:
    """Batch availability answers per grid and records nothing."""
    draw = await client.current()
    await client.sell(ticket([{"numbers": TEN, "stake": 1000}] * 4 + [
        {"numbers": TEN, "stake": 500}], first_draw=draw + 2))
    reply = await client.post("/v1/games/fdj-keno/availability", {
        "first_draw": draw, "draws": 5,
        "grids": [{"numbers": TEN, "stake": 1000}, {"numbers": TEN, "stake": 500},
                  {"numbers": [1, 2, 3], "stake": 500}],
    })
    assert reply.status == 200
    assert reply.body == {"grids": [
        {"index": 0, "available": False, "draw": draw + 2, "remaining": 500},
        {"index": 1, "available": True},
        {"index": 2, "available": True},
    ]}
    assert await client.staked(TEN, draw) == 0


async def test_batch_availability_reports_first_overflowing_draw(client: Client) -> None:
    """The first draw that would overflow is reported with its room."""
    draw = await client.current()
    await client.sell(ticket([{"numbers": TEN, "stake": 1000}] * 5, first_draw=draw + 1))
    reply = await client.post("/v1/games/fdj-keno/availability", {
        "first_draw": draw, "draws": 2, "grids": [{"numbers": TEN, "stake": 100}]})
    assert reply.body["grids"] == [{"index": 0, "available": False, "draw": draw + 1,
                                    "remaining": 0}]


async def test_batch_availability_validates_like_a_sale(client: Client) -> None:
    """A stake that does not exist is a 422 with its path."""
    reply = await client.post("/v1/games/fdj-keno/availability",
                              {"grids": [{"numbers": TEN, "stake": 700}]})
    assert reply.status == 422
    assert reply.body["error"] == {"code": "stake_not_allowed", "path": "$.grids[0].stake",
                                   "message": reply.body["error"]["message"]}


async def test_sold_out_list(client: Client) -> None:
    """A combination at its cap is listed for its draw; after a cancel it leaves the list."""
    draw = await client.current()
    sellers = [ticket([{"numbers": TEN, "stake": 1000}]) for _ in range(5)]
    for s in sellers:
        await client.sell(s)
    await client.sell(ticket([{"numbers": TEN[:8], "stake": 1000}]))
    reply = await client.get(f"/v1/games/fdj-keno/draws/{draw}/capped")
    assert reply.status == 200
    assert reply.body == {"draw": draw, "combinations": [sorted(TEN)]}
    await client.post(f"/v1/tickets/{sellers[0]['ticket_id']}/cancel")
    reply = await client.get(f"/v1/games/fdj-keno/draws/{draw}/capped")
    assert reply.body == {"draw": draw, "combinations": []}


async def test_batch_availability_of_a_draw_an_admin_stopped_is_draw_closed(
        client: Client) -> None:
    """Availability does not promise what a sale would refuse: a window holding a draw an
    admin stopped is 422 draw_closed, as the sale of that ticket is."""
    draw = await client.current()
    stopped = draw + 2
    assert (await client.post(f"/v1/games/fdj-keno/draws/{stopped}/close",
                              token="admin")).status == 200
    for first, draws in ((stopped, 1), (draw + 1, 2)):
        body = {"first_draw": first, "draws": draws, "grids": [{"numbers": TEN, "stake": 100}]}
        probe = await client.post("/v1/games/fdj-keno/availability", body)
        sale = await client.sell(ticket(body["grids"], first_draw=first, draws=draws))
        assert (probe.status, sale.status) == (422, 422)
        assert probe.body["error"]["code"] == sale.body["error"]["code"] == "draw_closed"
    open_window = {"first_draw": draw, "draws": 2, "grids": [{"numbers": TEN, "stake": 100}]}
    assert (await client.post("/v1/games/fdj-keno/availability", open_window)).status == 200
