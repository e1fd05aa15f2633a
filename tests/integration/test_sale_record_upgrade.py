"""A rolling upgrade: tickets whose records keep the sale in the JSON of the releases
before (validator.unpack_sale reads both) are replayed, looked up and cancelled by this
release as they were sold, on standalone (one call) and cluster (in steps)."""

from __future__ import annotations

import msgspec
import pytest

from capsvc import tickets as tickets_module
from capsvc.server import Service
from tests.conftest import TEN, Client, ticket


async def test_tickets_sold_before_the_upgrade_replay_look_up_and_cancel(
        service: tuple[Service, str], client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    draw = await client.current()
    monkeypatch.setattr(tickets_module, "pack_sale",  # as the release before did
                        lambda sale, asked=None: msgspec.json.encode(sale))
    bodies = [ticket([{"numbers": TEN, "stake": 500}, {"numbers": [1, 2, 3], "stake": 200}],
                     first_draw=draw),
              ticket([{"numbers": TEN[:8], "stake": 300}], draws=2)]
    first = [await client.sell(b) for b in bodies]
    assert [r.status for r in first] == [200, 200]
    monkeypatch.undo()  # this release
    for body, sold in zip(bodies, first, strict=True):
        replay = await client.sell(body)
        assert (replay.status, replay.body) == (200, sold.body)
        assert replay.headers["Idempotent-Replayed"] == "true"
        looked_up = await client.get(f"/v1/tickets/{body['ticket_id']}")
        assert looked_up.body == sold.body
    cancelled = await client.post(f"/v1/tickets/{bodies[0]['ticket_id']}/cancel")
    assert (cancelled.status, cancelled.body["released"]) == (200, 700)
    assert await client.staked(TEN, draw) == 0
    conflict = await client.sell(dict(bodies[1], draws=1))
    assert conflict.status == 409
