"""Games and draws: listing, current draw, draw status, admin stop-sale."""

from __future__ import annotations

from datetime import datetime

from tests.conftest import TEN, Client, ticket


async def test_games_list_their_rules(client: Client) -> None:
    """GET /v1/games lists every game with matrix, stakes, cap, limits and policies."""
    reply = await client.get("/v1/games")
    games = {g["id"]: g for g in reply.body["games"]}
    fdj, lnm = games["fdj-keno"], games["lnm-keno"]
    assert (fdj["numbers"], fdj["stakes"], fdj["cap_limit"], fdj["capped_picks"]) == (
        70, [100, 200, 300, 500, 1000], 5000, [8, 9, 10])
    assert fdj["draw_times"] == ["13:00", "20:00"]
    assert (lnm["numbers"], lnm["stakes"], lnm["daily_limit"], lnm["durations"]) == (
        80, [250, 500, 1000, 2500], 4000000, [1, 2, 5, 10, 20])
    assert lnm["multiplier"] is False
    assert lnm["joker_plus_price"] is None


async def test_current_draw_closes_in_the_future(client: Client) -> None:
    """The current draw is open and closes at a future instant with an offset."""
    reply = await client.get("/v1/games/fdj-keno/draws/current")
    closes = datetime.fromisoformat(reply.body["closes_at"])
    assert closes.tzinfo is not None
    assert closes.timestamp() > datetime.now().timestamp()
    draw = await client.get(f"/v1/games/fdj-keno/draws/{reply.body['draw']}")
    assert draw.body == {"draw": reply.body["draw"], "closes_at": reply.body["closes_at"],
                         "status": "open", "cap": 5000, "cap_fixed": False}
    past = await client.get(f"/v1/games/fdj-keno/draws/{reply.body['draw'] - 1}")
    assert past.body["status"] == "closed"


async def test_admin_close_stops_sales_at_once(client: Client) -> None:
    """After POST …/close, the draw is closed and a sale on it is 422 draw_closed."""
    draw = await client.current()
    target = draw + 1
    reply = await client.post(f"/v1/games/fdj-keno/draws/{target}/close", token="admin")
    assert reply.status == 200
    assert reply.body["status"] == "closed"
    assert (await client.get(f"/v1/games/fdj-keno/draws/{target}")).body["status"] == "closed"
    sale = await client.sell(ticket([{"numbers": TEN, "stake": 100}], first_draw=target))
    assert sale.status == 422
    assert sale.body["error"]["code"] == "draw_closed"
    assert await client.staked(TEN, target) == 0
    sub = await client.sell(ticket([{"numbers": TEN, "stake": 100}], first_draw=draw, draws=2))
    assert sub.body["error"]["code"] == "draw_closed"
    assert await client.staked(TEN, draw) == 0
    again = await client.sell(ticket([{"numbers": TEN, "stake": 100}], first_draw=draw))
    assert again.status == 200


async def test_close_answers_the_draw_as_its_look_up_does(client: Client) -> None:
    """The close's answer is the draw as GET answers it once closed: the cap in force and
    whether a sale fixed it (a sale fixed it here), not a cap unknown."""
    target = await client.current() + 1
    assert (await client.sell(ticket([{"numbers": TEN, "stake": 100}], first_draw=target))
            ).status == 200
    reply = await client.post(f"/v1/games/fdj-keno/draws/{target}/close", token="admin")
    assert reply.status == 200
    assert (reply.body["cap"], reply.body["cap_fixed"]) == (5000, True)
    assert reply.body == (await client.get(f"/v1/games/fdj-keno/draws/{target}")).body
    unsold = target + 1
    reply = await client.post(f"/v1/games/fdj-keno/draws/{unsold}/close", token="admin")
    assert reply.body == (await client.get(f"/v1/games/fdj-keno/draws/{unsold}")).body
    assert (reply.body["cap"], reply.body["cap_fixed"]) == (5000, False)


async def test_admin_close_of_current_draw_moves_the_default(client: Client) -> None:
    """With the current draw stopped, a ticket without first_draw goes to the next one."""
    draw = await client.current()
    await client.post(f"/v1/games/fdj-keno/draws/{draw}/close", token="admin")
    assert await client.current() == draw + 1
    reply = await client.sell(ticket([{"numbers": TEN, "stake": 100}]))
    assert reply.status == 200, reply.body
    assert reply.body["draws"] == [draw + 1]


async def test_close_needs_admin_scope(client: Client) -> None:
    """A seller may not stop sales."""
    draw = await client.current()
    reply = await client.post(f"/v1/games/fdj-keno/draws/{draw}/close", token="fr")
    assert reply.status == 403
    assert reply.body["error"]["code"] == "forbidden"


async def test_past_and_future_draws(client: Client) -> None:
    """A past draw is draw_closed; one beyond the horizon is draw_not_on_sale."""
    draw = await client.current()
    past = await client.sell(ticket(first_draw=draw - 1))
    assert (past.status, past.body["error"]["code"]) == (422, "draw_closed")
    far = await client.sell(ticket(first_draw=draw + 31))
    assert (far.status, far.body["error"]["code"]) == (422, "draw_not_on_sale")
    edge = await client.sell(ticket(first_draw=draw + 30))
    assert edge.status == 200


async def test_unknown_draw_and_game(client: Client) -> None:
    """Draw numbers below 1 and unknown games are 404."""
    assert (await client.get("/v1/games/fdj-keno/draws/0")).status == 404
    assert (await client.get("/v1/games/fdj-keno/draws/abc")).status == 404
    reply = await client.get("/v1/games/nope/draws/current")
    assert (reply.status, reply.body["error"]["code"]) == (404, "not_found")


async def test_draws_beyond_the_calendar_are_404(client: Client) -> None:
    """Draw numbers past the last one the calendar can date (year 9999) are not found."""
    for draw in (5878449, 10**9, 10**12):
        for path in (f"/v1/games/fdj-keno/draws/{draw}",
                     f"/v1/games/fdj-keno/draws/{draw}/capped",
                     f"/v1/games/fdj-keno/draws/{draw}/combinations/1-2-3"):
            assert (await client.get(path)).status == 404, path
        reply = await client.post(f"/v1/games/fdj-keno/draws/{draw}/close", token="admin")
        assert reply.status == 404
