"""Player daily limits: budgets taken before the grids, given back, self-limits, stakes."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import redis

from tests.conftest import TEN, Client, new_id, ticket

TWO = [5, 9]


def lnm(grids: list[dict[str, Any]], player: str = "P-1", **fields: Any) -> dict[str, Any]:
    return ticket(grids, game="lnm-keno", player_id=player, **fields)


async def player(client: Client, player_id: str, **query: str) -> dict[str, Any]:
    path = f"/v1/players/{player_id}" + "".join(f"?{k}={v}" for k, v in query.items())
    reply = await client.get(path, token="mt" if query else "ma")
    assert reply.status == 200, reply.body
    body: dict[str, Any] = reply.body
    return body


async def test_a_sale_spends_the_budget(client: Client) -> None:
    """An accepted LNM ticket adds its cost to the player's day."""
    pid = new_id("P")
    before = await player(client, pid)
    assert before["spent"] == 0
    assert before["limit"] == before["remaining"] == 4_000_000
    assert before["self_limit"] is None
    reply = await client.sell(lnm([{"numbers": TWO, "stake": 2500}], pid, draws=5), token="ma")
    assert reply.body["total_cost"] == 12500
    after = await player(client, pid)
    assert (after["spent"], after["remaining"]) == (12500, 4_000_000 - 12500)


async def test_ticket_over_the_limit_is_rejected_whole(client: Client) -> None:
    """A ticket that does not fit is rejected with reason player_limit; nothing counted."""
    pid = new_id("P")
    limited = await client.request("PUT", f"/v1/players/{pid}/limit", {"daily": 3000},
                                   token="ma")
    assert limited.status == 200, limited.body
    draw = await client.current("lnm-keno")
    reply = await client.sell(lnm([{"numbers": TEN, "stake": 2500},
                                   {"numbers": TWO, "stake": 1000}], pid), token="ma")
    body = reply.body
    assert reply.status == 200
    assert (body["status"], body["reason"], body["receipt"], body["total_cost"]) == (
        "rejected", "player_limit", None, 0)
    assert {g["reason"] for g in body["grids"]} == {"player_limit"}
    assert await client.staked(TEN, draw, game="lnm-keno") == 0
    assert (await player(client, pid))["spent"] == 0
    fits = await client.sell(lnm([{"numbers": TEN, "stake": 2500}], pid), token="ma")
    assert fits.body["status"] == "accepted"
    assert (await player(client, pid))["remaining"] == 500


async def test_cap_rejected_grids_give_their_cost_back(client: Client) -> None:
    """Grids refused by the combination cap do not use the player's budget."""
    draw = await client.current("lnm-keno")
    for _ in range(20):  # 20 x 25 dh = 500 dh: the combination is full
        await client.sell(lnm([{"numbers": TEN, "stake": 2500}], new_id("Q")), token="ma")
    pid = new_id("P")
    reply = await client.sell(lnm([{"numbers": TEN, "stake": 2500},
                                   {"numbers": TWO, "stake": 500}], pid), token="ma")
    assert reply.body["status"] == "partial"
    assert reply.body["total_cost"] == 500
    assert await client.staked(TEN, draw, game="lnm-keno") == 50000
    for _ in range(2):  # settling is asynchronous: wait for it
        await asyncio.sleep(0.05)
    assert (await player(client, pid))["spent"] == 500


async def test_cancel_gives_the_budget_back_once(client: Client) -> None:
    """A cancelled single-draw ticket returns its cost to the budget, once."""
    pid = new_id("P")
    body = lnm([{"numbers": TEN, "stake": 1000}], pid,
               first_draw=await client.current("lnm-keno") + 1)
    await client.sell(body, token="ma")
    await client.sell(lnm([{"numbers": TWO, "stake": 250}], pid), token="ma")
    assert (await player(client, pid))["spent"] == 1250
    for _ in range(2):
        reply = await client.post(f"/v1/tickets/{body['ticket_id']}/cancel", token="ma")
        assert reply.status == 200
    assert (await player(client, pid))["spent"] == 250


async def test_self_limit_lowering_and_raising(client: Client) -> None:
    """Lowering applies at once; raising and removing wait for the next day; never above
    the regulatory limit."""
    pid = new_id("P")
    low = await client.request("PUT", f"/v1/players/{pid}/limit", {"daily": 100000},
                               token="ma")
    assert (low.body["self_limit"], low.body["remaining"]) == (100000, 100000)
    raised = await client.request("PUT", f"/v1/players/{pid}/limit", {"daily": 200000},
                                  token="ma")
    assert raised.body["self_limit"] == 100000
    assert raised.body["pending_self_limit"] == 200000
    assert raised.body["pending_from"] > raised.body["day"]
    removed = await client.request("PUT", f"/v1/players/{pid}/limit", {"daily": None},
                                   token="ma")
    assert removed.body["self_limit"] == 100000
    assert removed.body["pending_self_limit"] is None
    assert removed.body["pending_from"] == raised.body["pending_from"]
    lower = await client.request("PUT", f"/v1/players/{pid}/limit", {"daily": 5000},
                                 token="ma")
    assert (lower.body["self_limit"], lower.body["pending_from"]) == (5000, None)
    too_high = await client.request("PUT", f"/v1/players/{pid}/limit",
                                    {"daily": 4_000_001}, token="ma")
    assert too_high.status == 422
    assert (too_high.body["error"]["code"], too_high.body["error"]["path"]) == (
        "limit_too_high", "$.daily")


async def test_stakes_from_other_games(client: Client) -> None:
    """Other games' stakes share the budget, idempotent by ref; one that does not fit is
    rejected."""
    pid = new_id("P")
    await client.request("PUT", f"/v1/players/{pid}/limit", {"daily": 1000}, token="ma")
    path = f"/v1/players/{pid}/stakes"
    first = await client.post(path, {"ref": "loto-998", "game": "loto", "amount": 600},
                              token="ma")
    assert first.body == {"status": "accepted", "remaining": 400}
    again = await client.post(path, {"ref": "loto-998", "game": "loto", "amount": 600},
                              token="ma")
    assert again.body["status"] == "accepted"
    assert (await player(client, pid))["spent"] == 600
    big = await client.post(path, {"ref": "loto-999", "game": "loto", "amount": 500},
                            token="ma")
    assert big.body == {"status": "rejected", "remaining": 400}
    ticket_reply = await client.sell(lnm([{"numbers": TWO, "stake": 500}], pid), token="ma")
    assert ticket_reply.body["reason"] == "player_limit"


async def test_player_errors(client: Client) -> None:
    """Bad player ids, unlimited games, missing scope."""
    assert (await client.get("/v1/players/P%20X", token="ma")).status == 422
    reply = await client.get("/v1/players/P-1?game=fdj-keno", token="admin")
    assert (reply.status, reply.body["error"]["code"]) == (422, "no_player_limits")
    no_limits = await client.get("/v1/players/P-1", token="fr")  # FDJ only: no limits
    assert (no_limits.status, no_limits.body["error"]["code"]) == (422, "no_player_limits")
    two = await client.get("/v1/players/P-1", token="mt")  # two limited games: name one
    assert (two.status, two.body["error"]["code"]) == (422, "invalid_request")
    bad = await client.request("PUT", "/v1/players/P-1/limit", {"daily": -1}, token="ma")
    assert (bad.status, bad.body["error"]["path"]) == (422, "$.daily")


async def test_draw_day_subscription_spans_midnight(client: Client,
                                                   redis_db: redis.Redis) -> None:
    """draw_day: a subscription on a 23:50 and the next 00:10 draw charges each draw's share
    on its own day."""
    pid = new_id("P")
    first = await client.current("lnm-day")
    closes = [(await client.get(f"/v1/games/lnm-day/draws/{d}", token="mt")).body["closes_at"]
              for d in (first, first + 1)]
    if closes[0][11:16] != "23:50":
        first += 1
        closes = [closes[1], (await client.get(f"/v1/games/lnm-day/draws/{first + 1}",
                                               token="mt")).body["closes_at"]]
    reply = await client.sell(ticket([{"numbers": TWO, "stake": 2500}], game="lnm-day",
                                     player_id=pid, first_draw=first, draws=2), token="mt")
    assert reply.body["status"] == "accepted", reply.body
    days = [c[:10] for c in closes]
    assert days[0] != days[1]
    for day in days:
        assert redis_db.hget(f"b:{{pl:{pid}}}:{day}", "spent") == b"2500"


async def test_two_processes_never_pass_the_daily_limit(two_services: list[str]) -> None:
    """60 concurrent tickets of one player through two processes stop at the limit."""
    pid = new_id("P")
    async with aiohttp.ClientSession() as session:
        clients = [Client(session, url) for url in two_services]
        await clients[0].request("PUT", f"/v1/players/{pid}/limit", {"daily": 10000},
                                 token="ma")
        replies = await asyncio.gather(*[
            clients[i % 2].sell(lnm([{"numbers": [i % 70 + 1, 80], "stake": 1000}], pid),
                                token="ma")
            for i in range(60)])
        accepted = [r for r in replies if r.body["status"] == "accepted"]
        assert len(accepted) == 10
        assert all(r.body.get("reason") == "player_limit" for r in replies
                   if r.body["status"] == "rejected")
        state = await player(clients[1], pid)
        assert (state["spent"], state["remaining"]) == (10000, 0)
