"""Sales in one Redis call (standalone Redis, games without player limits) beside sales in
steps: the same tickets, whichever process or protocol answers, and decisions that do not
follow later changes of the configuration."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from zoneinfo import ZoneInfo

import aiohttp
import pytest
import redis

from capsvc.config import Settings
from capsvc.http.server import build
from tests.conftest import TEN, Client, services, start_service, ticket
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
