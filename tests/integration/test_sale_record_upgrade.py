"""A rolling upgrade, on standalone (one call) and cluster (in steps): a process configured
`buckets` (the default) that finds keyed records at its start reads them too: a ticket sold
before the upgrade is never sold a second time."""

from __future__ import annotations

import dataclasses
import tomllib
from typing import Any

import pytest

from capsvc.config import ConfigError, Settings, parse_settings
from capsvc.store import ticket_key
from tests.conftest import CONFIG, TEN, services, ticket
from tests.records import held


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
