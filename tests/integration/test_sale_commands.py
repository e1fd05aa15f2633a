"""The Redis commands a one-grid sale issues, pinned: a count read from INFO commandstats
(deterministic, not a time), so that what each sale costs Redis cannot grow unnoticed.

Raise a pinned number only with the reason in the commit that raises it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis

from capsvc.redis.gate import POLICY_S
from tests.conftest import TEN, Client, ticket
from tests.support.servers import RedisServer

ONE_GRID_SALE = {
    # capsvc_sell, reading Redis TIME once: the ticket's record, the grid's counter bucket
    # and record, the expiries of the bucket and of the record's bucket looked at and
    # pushed on, the stops, the call's entry of the unjournaled sales (an HSET; its HDEL
    # once the decision is journaled, a plain command); and the mark (lua/capsvc.lua,
    # MARKS): one HMGET and one HSET of the call
    "fcall": 1, "time": 1, "hget": 2, "hset": 4, "hmget": 2, "pexpiretime": 2,
    "pexpireat": 2, "hincrby": 1, "hdel": 1,
}
"""Commands by name for one sale of one 8-number grid on a standalone Redis, the release of
its call's entry of the unjournaled sales (once the decision is journaled) included."""


def commands(db: redis.Redis) -> dict[str, int]:
    stats: dict[str, Any] = db.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


@pytest.mark.parametrize("redis_backend", ["standalone"], indirect=True)
async def test_a_one_grid_sale_issues_the_pinned_commands(
        service: Any, client: Client, redis_server: RedisServer, standalone_db: redis.Redis
        ) -> None:
    """One 8-number grid sold in one call (standalone): exactly the pinned commands."""
    svc, _ = service
    assert svc.store.single_node
    await client.current()
    warm = await client.sell(ticket([{"numbers": TEN[:8], "stake": 500}]))
    assert warm.status == 200  # the draw's cap is known from here on, as in steady sales
    await asyncio.sleep(0.1)  # its index entry released
    standalone_db.config_resetstat()
    window = time.monotonic()
    reply = await client.sell(ticket([{"numbers": TEN[1:9], "stake": 500}]))
    assert reply.status == 200
    assert reply.body["status"] == "accepted"
    await asyncio.sleep(0.1)
    used = commands(standalone_db)
    window = time.monotonic() - window
    used.pop("config|resetstat", None)
    used.pop("info", None)
    # The connection reads its node's maxmemory-policy every POLICY_S (capsvc.redis.gate),
    # whatever the sales: as many may fall in this window, none is the sale's.
    assert used.pop("config|get", 0) <= window / POLICY_S + 1
    assert used == ONE_GRID_SALE, repr(used)
