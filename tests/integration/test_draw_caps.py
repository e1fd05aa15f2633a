"""A draw's cap is fixed by its first sale: a new `cap_limit` applies to draws not sold yet,
never to one already selling, whichever process (and configuration) sells it. And a shadow
cap is judged on every capped grid without refusing any. On standalone Redis (one-call
sales) and on a Redis Cluster (sales in steps)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from capsvc.config import Settings
from tests.conftest import CONFIG, TEN, Client, services, ticket
from tests.support.servers import RedisCluster, RedisServer
from tests.support.service import ServiceProcess

FDJ = 'id = "fdj-keno"\npreset = "fdj-keno-2008"\n'


def config_with(tmp_path: Path, name: str, **fdj: int) -> str:
    """The test configuration with fields of the fdj-keno game overridden."""
    text = CONFIG.read_text()
    assert text.count(FDJ) == 1
    extra = "".join(f"{k} = {v}\n" for k, v in fdj.items())
    path = tmp_path / f"{name}.toml"
    path.write_text(text.replace(FDJ, FDJ + extra))
    return str(path)


def with_fdj(settings: Settings, **fields: Any) -> Settings:
    games = dict(settings.games)
    games["fdj-keno"] = dataclasses.replace(games["fdj-keno"], **fields)
    return dataclasses.replace(settings, games=games)


async def draw_of(client: Client, draw: int) -> dict[str, Any]:
    reply = await client.get(f"/v1/games/fdj-keno/draws/{draw}")
    assert reply.status == 200, reply.body
    body: dict[str, Any] = reply.body
    return body


async def test_a_new_cap_limit_applies_to_draws_not_sold_yet_across_two_runs(
        tmp_path: Path, redis_backend: RedisServer | RedisCluster, redis_db: Any) -> None:
    """Run 1 sells draw D under cap 50 €. Run 2, configured with 30 €, keeps judging D by 50 €
    (and shows it), and fixes 30 € on D+1, which run 1 had not sold. Run 3 raises the cap to
    60 €: neither draw moves."""
    numbers = TEN[:8]
    runs = [(5000, None), (3000, None), (6000, None)]
    async with aiohttp.ClientSession() as session:
        for i, (cap, _) in enumerate(runs):
            svc = ServiceProcess(config_with(tmp_path, f"run{i}", cap_limit=cap),
                                 redis_backend.url).start()
            try:
                client = Client(session, svc.base_url)
                d = await client.current() + 1
                if i == 0:
                    sold = await client.sell(ticket([{"numbers": numbers, "stake": 1000}] * 4,
                                                    first_draw=d))
                    assert sold.status == 200, sold.body
                    assert sold.body["status"] == "accepted", sold.body
                    assert await draw_of(client, d + 1) == {**await draw_of(client, d + 1),
                                                            "cap": 5000, "cap_fixed": False}
                elif i == 1:
                    shown = await draw_of(client, d)
                    assert (shown["cap"], shown["cap_fixed"]) == (5000, True)
                    # D keeps 50 €: 10 € more fit (40 € staked), 10.01 € would not.
                    fits = await client.sell(ticket([{"numbers": numbers, "stake": 1000}],
                                                    first_draw=d))
                    assert fits.body["status"] == "accepted", fits.body
                    # D+1 is sold for the first time under 30 €.
                    over = await client.sell(ticket([{"numbers": numbers, "stake": 1000}] * 4,
                                                    first_draw=d + 1))
                    assert [g["status"] for g in over.body["grids"]] == ["accepted"] * 3 + [
                        "rejected"]
                    assert over.body["grids"][3]["remaining"] == 0
                    shown = await draw_of(client, d + 1)
                    assert (shown["cap"], shown["cap_fixed"]) == (3000, True)
                else:
                    for draw, cap_in_force in ((d, 5000), (d + 1, 3000)):
                        shown = await draw_of(client, draw)
                        assert (shown["cap"], shown["cap_fixed"]) == (cap_in_force, True)
                        # Nothing more fits on either: each is at its own cap.
                        more = await client.sell(ticket([{"numbers": numbers, "stake": 1000}],
                                                        first_draw=draw))
                        assert more.body["status"] == "rejected", more.body
                        assert await client.staked(numbers, draw) == cap_in_force
                        combo = "-".join(map(str, numbers))
                        probe = await client.get(
                            f"/v1/games/fdj-keno/draws/{draw}/combinations/{combo}")
                        assert (probe.body["cap"], probe.body["selectable"]) == (
                            cap_in_force, False)
                    # A draw no sale reached takes the new cap.
                    fresh = await draw_of(client, d + 2)
                    assert (fresh["cap"], fresh["cap_fixed"]) == (6000, False)
            finally:
                svc.stop()


@pytest.fixture
async def two_caps(settings: Settings, redis_backend: RedisServer | RedisCluster, redis_db: Any
                   ) -> AsyncIterator[tuple[Client, Client]]:
    """Two services on one Redis, configured with caps of 50 € and 30 €."""
    variants = [with_fdj(settings, cap_limit=cap) for cap in (5000, 3000)]
    async with services(variants, redis_backend.url) as (high, low):
        yield high, low


async def test_processes_with_different_caps_racing_a_new_draw_judge_it_by_one(
        two_caps: tuple[Client, Client]) -> None:
    """Both processes sell the first grids of a draw at once: whichever fixed the cap, both
    judge by it, and the counter ends at exactly that cap."""
    high, low = two_caps
    d = await high.current() + 3
    numbers = TEN[1:9]
    bodies = [ticket([{"numbers": numbers, "stake": 1000}], first_draw=d) for _ in range(12)]
    replies = await asyncio.gather(*(  # a 503 (Redis slow on a busy machine) sent again
        (high if i % 2 else low).sell_until_decided(b) for i, b in enumerate(bodies)))
    assert [r.status for r in replies] == [200] * len(replies), [r.body for r in replies]
    accepted = sum(1 for r in replies if r.body["status"] == "accepted")
    shown = [await draw_of(c, d) for c in (high, low)]
    assert shown[0] == shown[1]
    assert shown[0]["cap_fixed"] is True
    cap = shown[0]["cap"]
    assert cap in (5000, 3000)
    assert accepted * 1000 == cap == await high.staked(numbers, d)
    rejected = [r.body["grids"][0] for r in replies if r.body["status"] == "rejected"]
    assert all(g["remaining"] == 0 for g in rejected)


async def test_a_subscription_is_judged_by_the_cap_of_each_of_its_draws(
        two_caps: tuple[Client, Client]) -> None:
    """D fixed at 50 € by one process, D+1 at 30 € by the other: a subscription over both
    fits only where each draw's own cap allows, and availability says the same."""
    high, low = two_caps
    d = await high.current() + 4
    numbers = TEN[2:10]
    assert (await high.sell(ticket([{"numbers": TEN[:8], "stake": 100}], first_draw=d))
            ).status == 200  # fixes 50 € on D
    assert (await low.sell(ticket([{"numbers": TEN[:8], "stake": 100}], first_draw=d + 1))
            ).status == 200  # fixes 30 € on D+1
    sub = await low.sell(ticket([{"numbers": numbers, "stake": 1000}] * 3, first_draw=d,
                                draws=2))
    assert sub.body["status"] == "accepted", sub.body  # 30 € on each: D+1 at its cap
    # 10 € more: D (30 of 50 €) has room, D+1 has none.
    more = ticket([{"numbers": numbers, "stake": 1000}], first_draw=d, draws=2)
    for client in (high, low):
        probe = await client.post("/v1/games/fdj-keno/availability", {
            "first_draw": d, "draws": 2, "grids": more["grids"]})
        assert probe.body["grids"][0] == {"index": 0, "available": False, "draw": d + 1,
                                          "remaining": 0}
        alone = await client.post("/v1/games/fdj-keno/availability", {
            "first_draw": d, "grids": more["grids"]})
        assert alone.body["grids"][0]["available"] is True
        capped = await client.get(f"/v1/games/fdj-keno/draws/{d + 1}/capped")
        assert capped.body["combinations"] == [numbers]
        assert (await client.get(f"/v1/games/fdj-keno/draws/{d}/capped")
                ).body["combinations"] == []
    refused = await high.sell(more)
    assert (refused.body["grids"][0]["draw"], refused.body["grids"][0]["remaining"]) == (
        d + 1, 0)
    assert [await high.staked(numbers, x) for x in (d, d + 1)] == [3000, 3000]


@pytest.fixture
async def shadowed(settings: Settings, redis_backend: RedisServer | RedisCluster, redis_db: Any
                   ) -> AsyncIterator[Client]:
    async with services([with_fdj(settings, shadow_cap_limit=3000)], redis_backend.url) as (
            client,):
        yield client


async def shadow_count(client: Client) -> float:
    text = (await client.get("/metrics", token=None)).raw.decode()
    line = next(x for x in text.splitlines()
                if x.startswith('capsvc_shadow_cap_rejections_total{game="fdj-keno"}'))
    return float(line.split()[-1])


async def test_a_shadow_cap_is_judged_on_every_grid_and_refuses_none(
        shadowed: Client) -> None:
    client = shadowed
    d = await client.current() + 1
    numbers = TEN[:8]
    assert await shadow_count(client) == 0
    first = await client.sell(ticket([{"numbers": numbers, "stake": 1000}] * 3, first_draw=d))
    assert first.body["status"] == "accepted"
    assert "Capsvc-Shadow" not in first.headers  # 30 €: up to the shadow cap, not beyond
    # 40 € would pass the 30 € shadow cap: accepted all the same, and said so.
    body = ticket([{"numbers": numbers, "stake": 1000}, {"numbers": TEN[:4], "stake": 200}],
                  first_draw=d)
    second = await client.sell(body)
    assert second.body["status"] == "accepted"
    assert second.headers["Capsvc-Shadow"] == "would_reject"
    replay = await client.sell(body)
    assert replay.raw == second.raw
    assert "Capsvc-Shadow" not in replay.headers
    assert await shadow_count(client) == 1
    # The real cap still refuses what overflows it; the shadow cap counts nothing.
    fill = await client.sell(ticket([{"numbers": numbers, "stake": 1000}] * 2, first_draw=d))
    assert [g["status"] for g in fill.body["grids"]] == ["accepted", "rejected"]
    assert fill.headers["Capsvc-Shadow"] == "would_reject"
    assert await shadow_count(client) == 2
    assert await client.staked(numbers, d) == 5000
    assert (await client.get("/v1/games", token="fr")).body["games"][0][
        "shadow_cap_limit"] == 3000


async def test_a_refused_request_fixes_no_cap(
        two_caps: tuple[Client, Client], redis_db: Any) -> None:
    """A 409 (the id taken by another request) and a 422 (a subscription over a draw an
    admin stopped) fix nothing: the draws are still fixed by their first real sale, by the
    cap of the process that makes it."""
    high, low = two_caps
    d = await high.current() + 5
    taken = ticket([{"numbers": TEN[:8], "stake": 100}], first_draw=d)
    assert (await high.sell(taken)).status == 200
    conflict = await high.sell({**taken, "first_draw": d + 2, "draws": 5})
    assert conflict.status == 409
    assert (await high.post(f"/v1/games/fdj-keno/draws/{d + 10}/close", token="admin")
            ).status == 200
    closed = await high.sell(ticket([{"numbers": TEN[:8], "stake": 100}], first_draw=d + 10,
                                    draws=5))
    assert (closed.status, closed.body["error"]["code"]) == (422, "draw_closed")
    for draw in [*range(d + 2, d + 7), *range(d + 10, d + 15)]:
        assert (await draw_of(low, draw))["cap_fixed"] is False, draw
    assert not [k for k in redis_db.scan_iter("k:*") if not k.endswith(f":{d}".encode())]
    # The first real sale of d+2 is the 30 € process's: its 4th 10 € grid is refused.
    first = await low.sell(ticket([{"numbers": TEN[1:9], "stake": 1000}] * 4, first_draw=d + 2))
    assert [g["status"] for g in first.body["grids"]] == ["accepted"] * 3 + ["rejected"]


async def test_every_sale_journals_the_caps_it_was_judged_by(
        service: Any, client: Client) -> None:
    """The first sale of a draw fixes its cap and the sales after it are judged by the cap
    the process knows: each sale's journal record carries the caps of its draws (a
    subscription's every draw), in batches and alone, whichever protocol sold it."""
    from capsvc.journal.reader import records
    from capsvc.journal.records import SaleRecord

    svc, _ = service
    d = await client.current() + 2
    first = ticket([{"numbers": TEN[:8], "stake": 500}], first_draw=d)
    assert (await client.sell(first)).status == 200
    later = [ticket([{"numbers": TEN[1:9], "stake": 500}], first_draw=d),
             ticket([{"numbers": TEN[2:10], "stake": 500}], first_draw=d, draws=2)]
    batch = await client.post("/v1/ticket-batches", {"tickets": later})
    assert [r["status"] for r in batch.body["results"]] == [200, 200]
    alone = ticket([{"numbers": TEN[:8], "stake": 200}], first_draw=d)
    assert (await client.sell(alone)).status == 200
    # To 80 % of the cap and to the cap: sales with something to report beside results.
    full = [ticket([{"numbers": TEN[:8], "stake": stake}], first_draw=d)
            for stake in (1000, 1000, 1000, 1000, 300)]
    for body in full:
        assert (await client.sell(body)).status == 200
    assert await client.staked(TEN[:8], d) == 5000
    cap = (await draw_of(client, d))["cap"]
    await asyncio.sleep(0.2)
    caps = {r.ticket: r.caps for _, _, r in records(Path(svc.settings.journal_dir))
            if isinstance(r, SaleRecord)}
    assert caps == {first["ticket_id"]: [cap], later[0]["ticket_id"]: [cap],
                    later[1]["ticket_id"]: [cap, cap], alone["ticket_id"]: [cap],
                    **{body["ticket_id"]: [cap] for body in full}}


async def test_a_player_limit_refusal_fixes_no_cap_and_teaches_its_process_none(
        settings: Settings, redis_backend: RedisServer | RedisCluster, redis_db: Any) -> None:
    """The first sale a process makes on a draw is refused by the player's daily limit
    (judged by no cap: it fixes none). Another process, configured with a lower cap, then
    fixes the draw's cap; the first judges its later sales by that cap, not by its own
    configured one, and journals the caps they were judged by."""
    def lnm(cap: int) -> Settings:
        games = dict(settings.games)
        games["lnm-keno"] = dataclasses.replace(games["lnm-keno"], cap_limit=cap,
                                                daily_limit=1000)
        return dataclasses.replace(settings, games=games)

    async with services([lnm(50000), lnm(1000)], redis_backend.url) as (high, low):
        d = await high.current("lnm-keno") + 2
        numbers = TEN[:8]

        def lnm_ticket(stake: int, player: str) -> dict[str, Any]:
            return ticket([{"numbers": numbers, "stake": stake}], game="lnm-keno",
                          first_draw=d, player_id=player)

        refused = await high.sell(lnm_ticket(2500, "P-over"), token="ma")
        assert refused.body["status"] == "rejected", refused.body
        assert (await low.sell(lnm_ticket(1000, "P-low"), token="ma")).body[
            "status"] == "accepted"
        later = await high.sell(lnm_ticket(1000, "P-high"), token="ma")
        assert later.body["status"] == "rejected", later.body
        assert later.body["grids"][0]["remaining"] == 0
        assert await high.staked(numbers, d, "lnm-keno") == 1000
        shown = await high.read(f"/v1/games/lnm-keno/draws/{d}")
        assert (shown.body["cap"], shown.body["cap_fixed"]) == (1000, True)
