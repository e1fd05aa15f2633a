"""No key the service writes lives forever."""

from __future__ import annotations

import dataclasses

import aiohttp
import pytest
import redis

from capsvc.config import Settings
from capsvc.domain.errors import Unavailable
from capsvc.http.server import Service, build
from tests.conftest import TEN, Client, start_service, ticket
from tests.support.servers import RedisCluster, RedisServer


async def test_every_key_written_has_a_ttl(
        service: tuple[Service, str], client: Client, redis_db: redis.Redis,
        settings: Settings, redis_backend: RedisServer | RedisCluster,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After sales, rejections, subscriptions, cancels, a stop-sale and a pending ticket,
    every key has an expiry."""
    draw = await client.current()
    for _ in range(6):
        await client.sell(ticket([{"numbers": TEN, "stake": 1000}], draws=2))
    cancelled = ticket([{"numbers": TEN[:8], "stake": 500}])
    await client.sell(cancelled)
    await client.post(f"/v1/tickets/{cancelled['ticket_id']}/cancel")
    await client.post(f"/v1/games/fdj-keno/draws/{draw + 3}/close", token="admin")
    limited = await client.sell(ticket([{"numbers": [1, 2, 3], "stake": 250}],
                                       game="lnm-keno", player_id="P-1"), token="ma")
    assert limited.status == 200

    def down(*args: object, **kwargs: object) -> None:
        raise Unavailable("simulated")

    # A sale in steps (a Redis Cluster's protocol, another process's here) failed between
    # them: this one stays pending.
    steps = build(dataclasses.replace(settings, one_call_sales=False), redis_backend.url)
    runner, url = await start_service(steps)
    try:
        monkeypatch.setattr(steps.store, "reserve", down)
        pending = ticket([{"numbers": TEN[:9], "stake": 250}], game="lnm-keno",
                         player_id="P-2")
        async with aiohttp.ClientSession() as session:
            assert (await Client(session, url).sell(pending, token="ma")).status == 503
    finally:
        await runner.cleanup()
        await steps.redis.aclose()
    keys = list(redis_db.scan_iter(count=1000))
    kinds = {k.split(b":")[0] for k in keys}
    # m: the marks (one hash a node or slot, 8 days past the last process's watch, not a
    # draw's: lua/capsvc.lua, MARKS); n: on a cluster, each primary's count (the same).
    cluster = set() if service[0].store.single_node else {b"n"}
    assert kinds == {b"c", b"r", b"p", b"s", b"x", b"b", b"k", b"f", b"e", b"a", b"m",
                     *cluster}
    forever = [k for k in keys if redis_db.pttl(k) < 0]
    assert forever == []
