"""What capsvc needs of a Redis it cannot configure, said plainly at start."""

from __future__ import annotations

import logging

import pytest
import redis

from capsvc.http.server import Service, prepare
from capsvc.redis.store import RECORD_VALUE_BYTES


@pytest.mark.parametrize("redis_backend", ["standalone"], indirect=True)
async def test_hash_limits_that_spread_ticket_records_are_named_at_start(
        service: tuple[Service, str], standalone_db: redis.Redis,
        caplog: pytest.LogCaptureFixture) -> None:
    """Redis's default hash-max-listpack-value (64) keeps every bucket of ticket records as a
    hash table: the start says so, with the setting that keeps them compact and what a
    ticket then costs; with that setting, nothing is said."""
    svc, _ = service
    before = standalone_db.config_get("hash-max-listpack-value")["hash-max-listpack-value"]
    try:
        standalone_db.config_set("hash-max-listpack-value", 64)
        with caplog.at_level(logging.WARNING, logger="capsvc"):
            await prepare(svc)
        said = [r.getMessage() for r in caplog.records if "hash-max-listpack-value" in
                r.getMessage()]
        assert len(said) == 1
        assert "hash-max-listpack-value 64" in said[0]
        assert f"at least {RECORD_VALUE_BYTES}" in said[0]
        assert "~345 bytes a ticket" in said[0]
        caplog.clear()
        standalone_db.config_set("hash-max-listpack-value", RECORD_VALUE_BYTES)
        with caplog.at_level(logging.WARNING, logger="capsvc"):
            await prepare(svc)
        assert not [r for r in caplog.records if "hash-max-listpack-value" in r.getMessage()]
        assert await svc.store.record_limits() is None
    finally:
        standalone_db.config_set("hash-max-listpack-value", before)
