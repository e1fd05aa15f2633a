"""Several tickets judged in one pass (`Tickets.sell_many`): each exactly as if it had been
sent alone, in order, none a transaction with another; on a standalone Redis (one call per
ticket) and on a cluster (the steps)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
import redis

from capsvc.client.models import TicketIn
from capsvc.domain.errors import ApiError
from capsvc.http.server import Service
from capsvc.service.tickets import SaleOutcome
from tests.conftest import TEN, Client, ticket
from tests.support.faults import functions_of


def _tickets(*bodies: dict[str, Any]) -> list[TicketIn]:
    return [msgspec.convert(b, TicketIn) for b in bodies]


async def test_each_ticket_is_judged_as_if_sent_alone(
        service: tuple[Service, str], client: Client) -> None:
    """A combination at 4,500 of 5,000: a ticket elsewhere, one that breaks a rule, one
    the cap refuses there (1,000), one that fits there (500; whichever of the two runs
    first, the refusal stands): four results in order, the refused ones changing nothing
    for the others; sent again, each answers what it answered (a replay), and POST
    /v1/tickets of each answers the same body."""
    svc, _ = service
    channel = next(c for c in svc.settings.channels if c.id == "fr-retail")
    draw = await client.current()
    eight, other = TEN[:8], TEN[2:]
    for stake in (1000, 1000, 1000, 1000, 500):
        filled = await client.sell(ticket([{"numbers": eight, "stake": stake}],
                                          first_draw=draw))
        assert filled.status == 200
    bodies = [ticket([{"numbers": other, "stake": 300}], first_draw=draw),
              ticket([{"numbers": eight, "stake": 123}], first_draw=draw),
              ticket([{"numbers": eight, "stake": 1000}], first_draw=draw),
              ticket([{"numbers": eight, "stake": 500}], first_draw=draw)]
    first = await svc.usecases.tickets.sell(channel, _tickets(*bodies))
    assert [type(r) for r in first] == [SaleOutcome, ApiError, SaleOutcome, SaleOutcome]
    sold, refused, capped, fits = first
    assert isinstance(refused, ApiError)
    assert refused.code == "stake_not_allowed"
    assert isinstance(sold, SaleOutcome)
    assert isinstance(capped, SaleOutcome)
    assert isinstance(fits, SaleOutcome)
    assert [msgspec.json.decode(r.body)["status"] for r in (sold, capped, fits)] == [
        "accepted", "rejected", "accepted"]
    assert await client.staked(eight, draw) == 5000
    assert await client.staked(other, draw) == 300
    again = await svc.usecases.tickets.sell(channel, _tickets(*bodies))
    for before, after in zip(first, again, strict=True):
        if isinstance(before, SaleOutcome):
            assert isinstance(after, SaleOutcome)
            assert after.replayed
            assert after.body == before.body
        else:
            assert isinstance(after, ApiError)
            assert after.code == before.code
    for body, result in zip(bodies, first, strict=True):
        if isinstance(result, SaleOutcome):
            alone = await client.sell(body)
            assert alone.status == 200
            assert alone.raw == result.body
    assert await client.staked(eight, draw) == 5000


@pytest.mark.parametrize("redis_backend", ["standalone"], indirect=True)
async def test_on_one_node_the_tickets_of_a_tick_are_one_call_judged_in_order(
        service: tuple[Service, str], client: Client, standalone_db: redis.Redis) -> None:
    """On a standalone Redis the tickets of one pass are judged by one call (capsvc_sell
    takes a batch), each as if it were a call of its own, in order: the same ticket id a
    second time is a replay of the first's decision, a stake on a combination meets the
    counter the tickets before it left, a stopped draw refuses only its ticket."""
    svc, _ = service
    assert svc.store.single_node
    channel = next(c for c in svc.settings.channels if c.id == "fr-retail")
    draw = await client.current()
    await client.sell(ticket([{"numbers": TEN[:8], "stake": 500}], first_draw=draw))  # warm
    stopped = draw + 1
    assert (await client.post(f"/v1/games/fdj-keno/draws/{stopped}/close",
                             token="admin")).status == 200
    eight = TEN[1:9]
    for _ in range(4):  # 4,000 of 5,000
        await client.sell(ticket([{"numbers": eight, "stake": 1000}], first_draw=draw))
    first = ticket([{"numbers": eight, "stake": 1000}], first_draw=draw)
    bodies = [first,
              ticket([{"numbers": eight, "stake": 1000}], first_draw=draw),
              first,
              ticket([{"numbers": eight, "stake": 1000}], first_draw=draw),
              ticket([{"numbers": TEN[2:], "stake": 500}], first_draw=stopped)]
    await asyncio.sleep(0.1)  # the warm sale's index entry let go
    submit, sent = svc.store.redis.submit, []

    def watched(*command: Any, **options: Any) -> Any:
        sent.extend(functions_of(command))
        return submit(*command, **options)

    svc.store.redis.submit = watched  # type: ignore[method-assign]
    try:
        results = await svc.usecases.tickets.sell(channel, _tickets(*bodies))
    finally:
        svc.store.redis.submit = submit  # type: ignore[method-assign]
    assert sent.count("capsvc_sell") == 1
    sold, capped, replay, fits, closed = results
    assert isinstance(sold, SaleOutcome)
    assert not sold.replayed
    assert isinstance(replay, SaleOutcome)
    assert replay.replayed
    assert replay.body == sold.body
    assert isinstance(capped, SaleOutcome)
    assert isinstance(fits, SaleOutcome)
    assert [msgspec.json.decode(r.body)["status"] for r in (sold, capped, fits)] == [
        "accepted", "rejected", "rejected"]
    assert isinstance(closed, ApiError)
    assert closed.code == "draw_closed"
    assert await client.staked(eight, draw) == 5000
    await asyncio.sleep(0.1)
    assert sum(standalone_db.zcard(f"p:{{t:{b}}}") for b in range(64)) == 0  # all journaled
