"""A rolling upgrade, both ways, on standalone (one call) and cluster (in steps):
- with `[redis] sale_record = "json"` (while processes of the release before still run),
  the ticket records keep the sale in the JSON that release reads;
- tickets whose records keep the sale in JSON (sold by the release before, or so) are
  replayed, looked up and cancelled by this release, packed or not, as they were sold."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest

from capsvc.config import ConfigError, parse_settings
from capsvc.server import Service
from capsvc.store import ticket_key
from tests.conftest import CONFIG, TEN, Client, ticket


async def test_tickets_kept_in_json_replay_look_up_and_cancel_once_packed(
        service: tuple[Service, str], client: Client, redis_db: Any) -> None:
    svc, _ = service
    draw = await client.current()
    svc.store.packed_sales = False  # [redis] sale_record = "json"
    bodies = [ticket([{"numbers": TEN, "stake": 500}, {"numbers": [1, 2, 3], "stake": 200}],
                     first_draw=draw),
              ticket([{"numbers": TEN[:8], "stake": 300}], draws=2)]
    first = [await client.sell(b) for b in bodies]
    assert [r.status for r in first] == [200, 200]
    for body in bodies:  # what the release before reads
        assert redis_db.hget(ticket_key("fr-retail", body["ticket_id"]), "sale")[:1] == b"["
    svc.store.packed_sales = True  # every process upgraded: packed from now on
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
    packed = ticket([{"numbers": TEN, "stake": 100}], first_draw=draw)
    assert (await client.sell(packed)).status == 200
    assert redis_db.hget(ticket_key("fr-retail", packed["ticket_id"]), "sale")[:1] != b"["


def test_the_setting_and_its_values() -> None:
    doc = tomllib.loads(CONFIG.read_text())
    assert parse_settings(doc).packed_sales
    assert not parse_settings({**doc, "redis": {"sale_record": "json"}}).packed_sales
    with pytest.raises(ConfigError, match=r"redis\.sale_record"):
        parse_settings({**doc, "redis": {"sale_record": "yaml"}})
