"""Concurrent sales never lose an update nor pass the cap, in one process or across two."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp

from tests.conftest import TEN, Client, new_id, ticket


async def test_sixty_concurrent_sales_of_one_combination(client: Client) -> None:
    """60 concurrent 3 EUR sales of one 10-number combination: exactly 16 fit in 50 EUR."""
    draw = await client.current()
    replies = await asyncio.gather(*[
        client.sell(ticket([{"numbers": TEN, "stake": 300}])) for _ in range(60)])
    statuses = [r.body["status"] for r in replies]
    assert statuses.count("accepted") == 16
    assert statuses.count("rejected") == 44
    assert await client.staked(TEN, draw) == 4800


async def test_two_processes_keep_the_invariant(two_services: list[str]) -> None:
    """Hundreds of mixed sales and cancels through two processes: counter == accepted -
    released <= cap, for every combination and draw."""
    rng = random.Random(7)
    combos = [TEN, TEN[:9], TEN[:8], [1, 2, 3, 4, 5, 6, 7, 8]]
    stakes = [100, 200, 300, 500, 1000]
    async with aiohttp.ClientSession() as session:
        clients = [Client(session, url) for url in two_services]
        draw = await clients[0].current()
        bodies: list[dict[str, Any]] = []
        for _ in range(400):
            grids = [{"numbers": rng.choice(combos), "stake": rng.choice(stakes)}
                     for _ in range(rng.randint(1, 3))]
            bodies.append(ticket(grids, first_draw=draw, draws=rng.choice([1, 1, 2])))
        replies = await asyncio.gather(*[
            clients[i % 2].sell(b) for i, b in enumerate(bodies)])
        assert {r.status for r in replies} == {200}
        accepted = [(b, r.body) for b, r in zip(bodies, replies, strict=True)
                    if r.body["status"] != "rejected"]
        cancelled = accepted[::5]
        cancels = await asyncio.gather(*[
            clients[i % 2].post(f"/v1/tickets/{b['ticket_id']}/cancel")
            for i, (b, _) in enumerate(cancelled)] + [
            clients[(i + 1) % 2].post(f"/v1/tickets/{b['ticket_id']}/cancel")
            for i, (b, _) in enumerate(cancelled)])
        assert {c.status for c in cancels} == {200}
        gone = {b["ticket_id"] for b, _ in cancelled}
        expected: dict[tuple[str, int], int] = {}
        for body, decision in accepted:
            if body["ticket_id"] in gone:
                continue
            for grid in decision["grids"]:
                if grid["status"] == "accepted":
                    for d in decision["draws"]:
                        key = ("-".join(map(str, grid["numbers"])), d)
                        expected[key] = expected.get(key, 0) + body["grids"][grid["index"]][
                            "stake"]
        for combo in combos:
            for d in (draw, draw + 1):
                staked = await clients[1].staked(combo, d)
                assert staked == expected.get(("-".join(map(str, sorted(combo))), d), 0)
                assert staked <= 5000
        assert any(r.body["status"] in ("partial", "rejected") for r in replies)


async def test_duplicates_across_two_processes_count_once(two_services: list[str]) -> None:
    """The same ticket sent 10 times to each of two processes is counted once."""
    body = ticket([{"numbers": TEN, "stake": 500}], ticket_id=new_id("DUP"))
    async with aiohttp.ClientSession() as session:
        clients = [Client(session, url) for url in two_services]
        replies = await asyncio.gather(*[clients[i % 2].sell(body) for i in range(20)])
        assert len({r.raw for r in replies}) == 1
        assert await clients[0].staked(TEN, replies[0].body["draws"][0]) == 500
