"""A rolling upgrade, both ways, on standalone (one call) and cluster (in steps):
- with `[redis] sale_record = "json"` and `ticket_records = "keys"` (while processes of the
  release before still run), the ticket records are keys keeping the sale in the JSON that
  release reads;
- tickets whose records keep the sale in JSON, a key each (sold by the release before, or
  so) are replayed, looked up and cancelled by this release, as they were sold;
- a process configured `buckets` (the default) that finds keyed records at its start reads
  them too: a ticket sold before the upgrade is never sold a second time."""

from __future__ import annotations

import dataclasses
import tomllib
from typing import Any

import pytest

from capsvc.config import ConfigError, Settings, parse_settings
from capsvc.server import Service
from capsvc.store import ticket_key
from tests.conftest import CONFIG, TEN, Client, services, ticket
from tests.records import held


async def test_tickets_kept_in_json_replay_look_up_and_cancel_once_packed(
        service: tuple[Service, str], client: Client, redis_db: Any) -> None:
    svc, _ = service
    draw = await client.current()
    # The release before: [redis] sale_record = "json", ticket_records = "keys".
    svc.store.packed_sales, svc.store.bucketed = False, False
    assert svc.store.names("t:{t:1}:c/t")[0][0] == "t:{t:1}:c/t"  # written as keys
    bodies = [ticket([{"numbers": TEN, "stake": 500}, {"numbers": [1, 2, 3], "stake": 200}],
                     first_draw=draw),
              ticket([{"numbers": TEN[:8], "stake": 300}], draws=2)]
    first = [await client.sell(b) for b in bodies]
    assert [r.status for r in first] == [200, 200]
    for body in bodies:  # what the release before reads
        assert redis_db.hget(ticket_key("fr-retail", body["ticket_id"]), "sale")[:1] == b"["
    # Every process upgraded: packed, into buckets, keys read too (ticket_records =
    # "buckets+keys") until the keyed records' retention has passed.
    svc.store.packed_sales, svc.store.bucketed, svc.store.legacy_keys = True, True, True
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
    assert held(redis_db, ticket_key("fr-retail", packed["ticket_id"]), "sale")[:1] != b"["


def test_the_setting_and_its_values() -> None:
    doc = tomllib.loads(CONFIG.read_text())
    assert parse_settings(doc).packed_sales
    assert not parse_settings({**doc, "redis": {"sale_record": "json"}}).packed_sales
    with pytest.raises(ConfigError, match=r"redis\.sale_record"):
        parse_settings({**doc, "redis": {"sale_record": "yaml"}})


async def test_a_process_set_to_buckets_too_early_still_finds_the_keyed_tickets(
        settings: Settings, redis_backend: Any, redis_db: Any) -> None:
    """Upgraded straight to `ticket_records = "buckets"` while tickets sold as keys are
    retained: the process finds such records when it starts, reads them too (and logs
    so), and replays and cancels them; new tickets go into buckets. (Journal off: restoring
    a journal would also put those decisions back, into buckets.)"""
    settings = dataclasses.replace(settings, journal_enabled=False)
    before = dataclasses.replace(settings, ticket_records="keys")
    async with services([before], redis_backend.url) as (old,):
        draw = await old.current()
        bodies = [ticket([{"numbers": TEN[:8], "stake": 500}], first_draw=draw)
                  for _ in range(3)]
        sold = [await old.sell(b) for b in bodies]
        assert [r.status for r in sold] == [200] * 3
    async with services([settings], redis_backend.url) as (new,):
        for body, first in zip(bodies, sold, strict=True):
            replay = await new.sell(body)
            assert (replay.status, replay.body) == (200, first.body)
            assert replay.headers["Idempotent-Replayed"] == "true"
        assert await new.staked(TEN[:8], draw) == 1500
        cancelled = await new.post(f"/v1/tickets/{bodies[0]['ticket_id']}/cancel")
        assert (cancelled.status, cancelled.body["released"]) == (200, 500)
        assert await new.staked(TEN[:8], draw) == 1000
        fresh = ticket([{"numbers": TEN[:8], "stake": 100}], first_draw=draw)
        assert (await new.sell(fresh)).status == 200
        assert redis_db.exists(ticket_key("fr-retail", fresh["ticket_id"])) == 0
        assert held(redis_db, ticket_key("fr-retail", fresh["ticket_id"]), "st") == b"f"


def test_the_ticket_records_setting_and_its_values() -> None:
    doc = tomllib.loads(CONFIG.read_text())
    assert parse_settings(doc).ticket_records == "buckets"
    for value in ("buckets", "buckets+keys", "keys"):
        assert parse_settings({**doc, "redis": {"ticket_records": value}}
                              ).ticket_records == value
    with pytest.raises(ConfigError, match=r"redis\.ticket_records"):
        parse_settings({**doc, "redis": {"ticket_records": "hash"}})
