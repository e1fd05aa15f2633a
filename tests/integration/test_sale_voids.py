"""A sale in steps that does not stand is journaled as a void, whatever ends it: an admin's
stop, its draw closing between its claim and its grids, the janitor. Without the void on
the record, a Redis that went back to a moment the claim was still pending would have the
janitor decide a sale its request answered `draw_closed`, and the restore could not tell."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from capsvc.config import Settings
from capsvc.http.server import Service, build
from capsvc.journal.reader import records
from capsvc.journal.records import VoidRecord
from tests.conftest import TEN, Client, start_service, ticket
from tests.integration.test_journaled import indexed
from tests.support.servers import RedisCluster, RedisServer


@pytest.fixture
async def in_steps(settings: Settings, redis_backend: RedisServer | RedisCluster,
                   redis_db: Any) -> AsyncIterator[tuple[Service, str]]:
    """The service in this process selling in steps (claim, then the grids), on a
    standalone Redis and on a cluster."""
    svc = build(dataclasses.replace(settings, one_call_sales=False), redis_backend.url)
    runner, url = await start_service(svc)
    yield svc, url
    await runner.cleanup()
    await svc.redis.aclose()


def voids(svc: Service, ticket_id: str) -> list[str]:
    return [r.why for _, _, r in records(Path(svc.settings.journal_dir))
            if isinstance(r, VoidRecord) and r.ticket == ticket_id]


async def test_a_sale_whose_draw_closes_before_its_grids_is_journaled_void(
        in_steps: tuple[Service, str], redis_db: Any, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """The draw closes between the claim and the reserves (Redis TIME past the close when
    the grids are judged): the answer is 422 draw_closed, nothing stays counted or claimed,
    and the journal holds the sale's void (`closed`)."""
    svc, url = in_steps
    ledger = svc.usecases.tickets.steps
    reserve_all = ledger.reserve_all

    async def after_the_close(game: Any, sale: Any, sale_id: str, close_ms: int) -> Any:
        # 1 ms after the epoch: every draw is closed by Redis TIME when the grids are judged.
        return await reserve_all(game, sale, sale_id, 1 if close_ms else 0)

    monkeypatch.setattr(ledger, "reserve_all", after_the_close)
    async with aiohttp.ClientSession() as session:
        client = Client(session, url)
        draw = await client.current()
        body = ticket([{"numbers": TEN[:8], "stake": 500}], first_draw=draw)
        reply = await client.sell(body)
        assert reply.status == 422, reply.body
        assert reply.body["error"]["code"] == "draw_closed"
        monkeypatch.undo()
        assert (await client.get(f"/v1/tickets/{body['ticket_id']}")).status == 404
        assert await client.staked(TEN[:8], draw) == 0
    assert voids(svc, body["ticket_id"]) == ["closed"]
    assert indexed(redis_db) == 0
