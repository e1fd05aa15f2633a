"""Sales in one Redis call (standalone Redis, games without player limits) beside sales in
steps: the same tickets, whichever process or protocol answers, and decisions that do not
follow later changes of the configuration; the sales of a tick, several to a call."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any
from zoneinfo import ZoneInfo

import aiohttp
import pytest
import redis

from capsvc.config import Settings
from capsvc.domain.calendar import DrawCalendar
from capsvc.http.server import build
from capsvc.redis.clock import RedisClock
from capsvc.redis.replies import Sold
from capsvc.redis.store import (
    SALES_PER_CALL,
    Store,
    lua_source,
    stops_key,
    ticket_key,
    ticket_names,
)
from capsvc.redis.transport import Coalescer
from capsvc.service.steps import SaleSteps
from tests.conftest import TEN, Client, services, start_service, ticket
from tests.support.faults import functions_of
from tests.support.sales import sell_alone
from tests.support.servers import RedisServer


@pytest.fixture
async def pair(settings: Settings, redis_server: RedisServer, standalone_db: redis.Redis
               ) -> AsyncIterator[tuple[Client, Client]]:
    """Two services on one standalone Redis: one sells in one call, the other in steps."""
    variants = [dataclasses.replace(settings, one_call_sales=one_call)
                for one_call in (True, False)]
    async with services(variants, redis_server.url) as (one, steps):
        yield one, steps


async def test_a_ticket_answers_the_same_whichever_protocol_replays_it(
        pair: tuple[Client, Client]) -> None:
    """Sold in one call, replayed, read and cancelled by a process selling in steps (and
    the other way round): one body, byte for byte, counted once, given back once."""
    one, steps = pair
    draw = await one.current()
    for seller, other in ((one, steps), (steps, one)):
        body = ticket([{"numbers": TEN[:8], "stake": 500}, {"numbers": TEN[:3], "stake": 200}])
        first = await seller.sell(body)
        assert first.status == 200
        replay = await other.sell(body)
        assert (replay.status, replay.raw) == (200, first.raw)
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert (await other.get(f"/v1/tickets/{body['ticket_id']}")).raw == first.raw
        cancel = await other.post(f"/v1/tickets/{body['ticket_id']}/cancel")
        assert cancel.body["released"] == 700
        assert (await seller.sell(body)).raw == first.raw  # a replay after the cancel
        assert await one.staked(TEN[:8], draw) == 0


async def test_a_decision_does_not_follow_a_new_time_zone_or_a_removed_game(
        settings: Settings, redis_server: RedisServer, standalone_db: redis.Redis) -> None:
    """The receipt's time is rendered in the zone of the sale: a service restarted with
    another time zone for the game, or without the game, still answers the first body."""
    game = settings.games["fdj-keno"]
    london = dataclasses.replace(settings, games={
        **settings.games, "fdj-keno": dataclasses.replace(
            game, time_zone="Europe/London", tz=ZoneInfo("Europe/London"))})
    body = ticket([{"numbers": TEN[:8], "stake": 500}])
    async with aiohttp.ClientSession() as session:
        svc = build(london, redis_server.url)
        runner, url = await start_service(svc)
        first = await Client(session, url).sell(body)
        assert first.status == 200
        await runner.cleanup()
        await svc.redis.aclose()
        without = dataclasses.replace(settings, games={
            k: v for k, v in settings.games.items() if k != "fdj-keno"})
        for later in (settings, without):
            svc = build(later, redis_server.url)
            runner, url = await start_service(svc)
            got = await Client(session, url).get(f"/v1/tickets/{body['ticket_id']}")
            assert (got.status, got.raw) == (200, first.raw)
            await runner.cleanup()
            await svc.redis.aclose()


async def test_a_defaulted_ticket_moves_past_any_run_of_stopped_draws(
        pair: tuple[Client, Client]) -> None:
    """With the next four draws stopped by an admin, a ticket without first_draw is sold
    on the first open draw after them, in one call or in steps."""
    one, steps = pair
    draw = await one.current()
    for d in range(draw, draw + 4):
        assert (await one.post(f"/v1/games/fdj-keno/draws/{d}/close", token="admin")).status \
            == 200
    for seller in (one, steps):
        sold = await seller.sell(ticket([{"numbers": TEN[:8], "stake": 100}]))
        assert sold.status == 200, sold.body
        assert sold.body["draws"] == [draw + 4]


async def test_a_full_call_of_sales_leaves_at_once_the_rest_at_the_tick_s_end(
        redis_server: RedisServer, standalone_db: redis.Redis) -> None:
    """Sales queued in one tick go SALES_PER_CALL a call: a full call is handed to the
    transport as soon as it is full, so that Redis works on it while the tick prepares the
    next ones (queued behind thousands of sales, its answer would be timed from behind
    all of them); the rest go at the end of the tick. Each sale gets its own reply."""
    redis_db = Coalescer(redis_server.url, timeout_s=5, library=lua_source())
    store = Store(redis_db)
    await store.load_library()
    submit, sent = redis_db.submit, []

    def watched(*command: Any) -> Any:
        sent.extend(functions_of(command))
        return submit(*command)

    redis_db.submit = watched  # type: ignore[method-assign]
    far = int(time.time() * 1000) + 86_400_000
    replies = []
    for i in range(SALES_PER_CALL + 3):
        replies.append(sell_alone(store,
            ticket_key("t", f"F-{i}"), b"sale", far, far, 60_000, "g", 7, 1,
            5000, 100, [("\x01\x02\x03\x04\x05\x06\x07" + chr(8 + i % 60), 100)], [far],
            "UTC", fix_caps=False))
        assert sent.count("capsvc_sell") == (1 if i + 1 >= SALES_PER_CALL else 0)
    claims = await asyncio.gather(*replies)
    assert sent.count("capsvc_sell") == 2
    assert [type(c).__name__ for c in claims] == ["Sold"] * (SALES_PER_CALL + 3)
    assert len({c.sale_id for c in claims if isinstance(c, Sold)}) == SALES_PER_CALL + 3
    await redis_db.aclose()


async def test_a_sale_run_in_the_millisecond_of_a_close_just_before_it_is_before_its_instant(
        redis_server: RedisServer, standalone_db: redis.Redis) -> None:
    """A one-call sale and an admin's close of its draw, Redis running the sale first, most
    often in the same millisecond: the sale stands, so the close's instant is after the
    sale's (a sale that stands was claimed strictly before its draw's close)."""
    redis_db = Coalescer(redis_server.url, timeout_s=5, library=lua_source())
    store = Store(redis_db)
    await store.load_library()
    far = int(time.time() * 1000) + 86_400_000
    for draw in range(1, 31):
        sold = sell_alone(store, ticket_key("t", f"S-{draw}"), b"sale", far, far,
                          60_000, "g", draw, 1, 5000, 100,
                          [("\x01\x02\x03\x04\x05\x06\x07\x08", 100)], [far], "UTC",
                          fix_caps=False)
        stops: list[asyncio.Future[Any]] = []
        # After the sale in the same pipeline: the close runs right behind it.
        redis_db.before_flush(lambda draw=draw, stops=stops: stops.append(
            store.fcall("capsvc_stop", [stops_key("g")], [draw, far])))
        claim = await sold
        assert isinstance(claim, Sold)
        assert int(await stops[0]) > claim.at
    await redis_db.aclose()


async def test_a_call_s_entry_stays_while_a_sale_of_it_is_not_journaled(
        redis_server: RedisServer, standalone_db: redis.Redis) -> None:
    """Two requests' sales in one call of `capsvc_sell`, the first request gone before the
    reply (its future cancelled): the second's sale journaled leaves the call's entry of
    the unjournaled sales in place, naming both, so that the janitor journals the first."""
    redis_db = Coalescer(redis_server.url, timeout_s=5, library=lua_source())
    store = Store(redis_db)
    await store.load_library()
    far = int(time.time() * 1000) + 86_400_000

    def call(i: int) -> Any:
        shape = store.shape("g", 7, 1, far, far, 60_000, 5000, [5000], 100, "UTC", False, [far])
        return store.sale_call(shape, *ticket_names("t", f"G-{i}"), b"sale",
                               [("\x01\x02\x03\x04\x05\x06\x07" + chr(8 + i), 100)])

    gone = store.sell([call(1)])
    kept = store.sell([call(2)])
    gone.cancel()
    [claim] = await kept
    assert isinstance(claim, Sold)
    store.journaled_sale(claim)
    await redis_db.submit("PING")  # behind an HDEL the release would have sent
    [(_, _, sold)] = await store.unjournaled()
    assert sorted(t for t, _ in sold) == sorted([ticket_key("t", "G-1"), ticket_key("t", "G-2")])
    await redis_db.aclose()


async def test_a_player_s_budget_is_left_the_same_by_either_protocol(
        pair: tuple[Client, Client], standalone_db: redis.Redis) -> None:
    """The player's limit in one call leaves what the ledger's steps leave: the same
    decisions (subscriptions, a grid refused by the cap that costs the player nothing, a
    ticket refused whole by the limit, a draw-day subscription of another game), the same days
    charged under the same kinds of record, and a cancel by the other protocol that gives
    back exactly what was taken."""
    one, steps = pair
    lnm = {"game": "lnm-keno"}
    outcomes: list[list[Any]] = []
    for seller, other, top in ((one, steps, list(range(21, 29))),
                               (steps, one, list(range(31, 39)))):
        pid = f"P-{seller is one}-{time.monotonic_ns()}"
        filler = [{"numbers": [k + 1 for k in range(10, 18)], "stake": 2500}]
        bodies = []
        for body in (
            ticket(filler * 1, player_id=pid, **lnm),
            ticket([{"numbers": [3, 9], "stake": 500}], player_id=pid, draws=5, **lnm),
            ticket([{"numbers": [3, 9, 11], "stake": 250}], player_id=pid, **lnm),
            ticket([{"numbers": [4, 8], "stake": 1000}], player_id=pid, draws=2,
                   game="lnm-day"),
        ):
            bodies.append(body)
        sold = [await seller.sell(body, token="mt") for body in bodies]
        # The combination filled to its cap by another player, then a ticket of this player
        # whose capped grid is refused: only its other grid costs the player.
        for _ in range(20):
            assert (await seller.sell(ticket([{"numbers": top, "stake": 2500}],
                                              player_id=f"{pid}-x", **lnm),
                                      token="mt")).body["status"] == "accepted"
        bodies.append(ticket(
            [{"numbers": top, "stake": 250}, {"numbers": [1, 2], "stake": 250}],
            player_id=pid, **lnm))
        assert (await seller.request("PUT", f"/v1/players/{pid}/limit?game=lnm-keno",
                                     {"daily": 9000},
                                     token="mt")).status == 200
        bodies.append(ticket([{"numbers": [5, 6], "stake": 2500}], player_id=pid, draws=5,
                             **lnm))
        cancel = await other.post(f"/v1/tickets/{sold[0].body['ticket_id']}/cancel",
                                  token="mt")
        assert (cancel.status, cancel.body.get("released")) == (200, 2500), cancel.body
        sold += [await seller.sell(body, token="mt") for body in bodies[len(sold):]]
        for body, reply in zip(bodies, sold, strict=True):
            assert reply.status == 200, reply.body
            assert (await other.sell(body, token="mt")).raw == reply.raw
        day = (await other.get(f"/v1/players/{pid}?game=lnm-keno", token="mt")).body
        ledgers = sorted(
            [*sorted(v.decode()[0] if not v.decode()[0].isdigit() else v.decode()
                     for f, v in standalone_db.hgetall(k).items() if f != b"spent"),
             f"spent={standalone_db.hget(k, 'spent')}"]
            for k in standalone_db.scan_iter(f"b:{{pl:{pid}}}:*"))
        outcomes.append([
            [(r.body["status"], r.body.get("reason"), r.body["total_cost"],
              [(g["status"], g.get("reason")) for g in r.body["grids"]]) for r in sold],
            day["spent"], ledgers])
    assert outcomes[0] == outcomes[1]
    decisions = outcomes[0][0]
    assert [d[:3] for d in decisions] == [
        ("accepted", None, 2500), ("accepted", None, 2500), ("accepted", None, 250),
        ("accepted", None, 2000), ("partial", None, 250), ("rejected", "player_limit", 0)]


def stale_days(monkeypatch: pytest.MonkeyPatch, plans: int) -> Iterator[int]:
    """The next `plans` plans of a player's budget name the day before (forced); the
    iterator returned is spent once they have been made."""
    real = DrawCalendar.local_day
    stale = iter(range(plans))

    def local_day(calendar: DrawCalendar, now_ms: int) -> tuple[str, int, int]:
        day, start, end = real(calendar, now_ms)
        if next(stale, None) is None:
            return day, start, end
        yesterday = real(calendar, start - 1)
        return yesterday[0], yesterday[1], start

    monkeypatch.setattr(DrawCalendar, "local_day", local_day)
    return stale


async def test_a_sale_judged_on_another_day_than_its_budget_was_planned_for_is_planned_again(
        pair: tuple[Client, Client], standalone_db: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The process plans a player's budget for the purchase day of Redis's time as it
    estimates it; Redis judges at its own instant. Forced here (the first two plans name
    the day before): the call writes nothing for them, the first is planned again and
    sold, and the second, behind it in the same batch, is judged after it — so the limit
    holds in the batch's order: the first accepted, the second refused."""
    one, _ = pair
    stale = stale_days(monkeypatch, 2)
    pid = f"P-day-{time.monotonic_ns()}"
    assert (await one.request("PUT", f"/v1/players/{pid}/limit?game=lnm-keno",
                              {"daily": 3000}, token="mt")).status == 200
    batch = [ticket([{"numbers": [3, 9], "stake": 2500}], player_id=pid, game="lnm-keno"),
             ticket([{"numbers": [4, 9], "stake": 1000}], player_id=pid, game="lnm-keno")]
    reply = await one.post("/v1/ticket-batches", {"tickets": batch}, token="mt")
    assert reply.status == 200, reply.body
    assert [(r["status"], r["body"]["status"]) for r in reply.body["results"]] == [
        (200, "accepted"), (200, "rejected")]
    assert reply.body["results"][1]["body"]["reason"] == "player_limit"
    assert next(stale, None) is None  # both plans were stale
    days = [k.decode() for k in standalone_db.scan_iter(f"b:{{pl:{pid}}}:*")]
    assert len(days) == 1, days  # nothing written on the day before
    assert standalone_db.hget(days[0], "spent") == b"2500"


async def test_a_request_cut_over_two_calls_is_judged_in_order_when_a_sale_moves_on(
        pair: tuple[Client, Client], monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of 65 tickets goes to Redis in two calls (64, then 1). Its first ticket's
    budget is planned for the day before (forced): Redis does not judge it, nor the
    batch's later tickets — those of the second call included, which read what the first
    call stopped — until it has been planned again and judged. So the limit holds in the
    batch's order: the first ticket of the player accepted, the last refused."""
    one, _ = pair
    stale = stale_days(monkeypatch, 1)
    pid = f"P-cut-{time.monotonic_ns()}"
    assert (await one.request("PUT", f"/v1/players/{pid}/limit?game=lnm-keno",
                              {"daily": 2500}, token="mt")).status == 200
    mine = [{"numbers": [3, 9], "stake": 2500}]
    batch = [ticket(mine, player_id=pid, game="lnm-keno"),
             *(ticket([{"numbers": [4, 9], "stake": 250}], player_id=f"{pid}-{i}",
                      game="lnm-keno") for i in range(63)),
             ticket(mine, player_id=pid, game="lnm-keno")]
    assert SALES_PER_CALL == 64
    reply = await one.post("/v1/ticket-batches", {"tickets": batch}, token="mt")
    assert reply.status == 200, reply.body
    results = reply.body["results"]
    assert next(stale, None) is None  # the first plan was stale
    assert [r["status"] for r in results] == [200] * 65
    assert (results[0]["body"]["status"], results[-1]["body"]["status"]) == (
        "accepted", "rejected")
    assert results[-1]["body"]["reason"] == "player_limit"
    assert {r["body"]["status"] for r in results[1:-1]} == {"accepted"}


async def test_a_sale_judged_on_another_day_is_planned_again_for_redis_s_day(
        pair: tuple[Client, Client], standalone_db: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The process's estimate of Redis's clock lags (forced: a second behind, frozen) over
    a day's end (forced: the day ends now): each plan it makes names the day before. The
    call that refuses the plan says when Redis judged it, and the sale is planned again
    for that instant's day and sold, not refused until its attempts run out."""
    one, _ = pair
    sec, usec = standalone_db.time()
    midnight = int(sec) * 1000 + int(usec) // 1000
    real = DrawCalendar.local_day

    def local_day(calendar: DrawCalendar, now_ms: int) -> tuple[str, int, int]:
        day, start, end = real(calendar, now_ms)
        if now_ms >= midnight:
            return day, start, end
        yesterday = real(calendar, start - 1)
        return yesterday[0], yesterday[1], midnight

    monkeypatch.setattr(DrawCalendar, "local_day", local_day)
    monkeypatch.setattr(RedisClock, "now", lambda self: midnight - 1000)
    pid = f"P-lag-{time.monotonic_ns()}"
    body = ticket([{"numbers": [3, 9], "stake": 500}], player_id=pid, game="lnm-keno")
    reply = await one.sell(body, token="mt")
    assert (reply.status, reply.body.get("status")) == (200, "accepted"), reply.body
    days = [k.decode() for k in standalone_db.scan_iter(f"b:{{pl:{pid}}}:*")]
    assert len(days) == 1, days
    assert standalone_db.hget(days[0], "spent") == b"500"


async def test_a_batch_sold_in_steps_is_judged_in_order_for_one_player(
        pair: tuple[Client, Client], monkeypatch: pytest.MonkeyPatch) -> None:
    """In steps (a Redis Cluster's protocol) the tickets of a batch that share a player are
    judged one after the other, in the order sent, whichever's steps Redis would run first
    (forced: the first ticket's budget step is held back): the first fits the limit and is
    accepted, the second no longer fits."""
    _, steps = pair
    original = SaleSteps.take_budget
    held = iter(range(1))

    def take_budget(self: SaleSteps, plan: Any, *, seal: bool = False) -> Any:
        if next(held, None) is None:
            return original(self, plan, seal=seal)

        async def later() -> Any:
            await asyncio.sleep(0.3)
            return await original(self, plan, seal=seal)
        return asyncio.ensure_future(later())

    monkeypatch.setattr(SaleSteps, "take_budget", take_budget)
    pid = f"P-order-{time.monotonic_ns()}"
    assert (await steps.request("PUT", f"/v1/players/{pid}/limit?game=lnm-keno",
                                {"daily": 4000}, token="mt")).status == 200
    batch = [ticket([{"numbers": [3, 9], "stake": 2500}], player_id=pid, game="lnm-keno"),
             ticket([{"numbers": [4, 9], "stake": 2500}], player_id=pid, game="lnm-keno")]
    reply = await steps.post("/v1/ticket-batches", {"tickets": batch}, token="mt")
    assert reply.status == 200, reply.body
    assert next(held, None) is None  # the first ticket's budget step was held back
    assert [r["body"]["status"] for r in reply.body["results"]] == ["accepted", "rejected"]
