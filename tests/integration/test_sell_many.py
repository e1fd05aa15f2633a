"""Several tickets judged in one pass (`Tickets.sell_many`): each exactly as if it had been
sent alone, in order, none a transaction with another; on a standalone Redis (one call per
ticket) and on a cluster (the steps)."""

from __future__ import annotations

from typing import Any

import msgspec

from capsvc.domain.errors import ApiError
from capsvc.domain.models import TicketIn
from capsvc.http.server import Service
from capsvc.service.tickets import SaleOutcome
from tests.conftest import TEN, Client, ticket


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
    first = await svc.usecases.tickets.sell_many(channel, _tickets(*bodies))
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
    again = await svc.usecases.tickets.sell_many(channel, _tickets(*bodies))
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
