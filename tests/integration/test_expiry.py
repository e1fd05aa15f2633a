"""No key the service writes lives forever."""

from __future__ import annotations

import pytest
import redis

from capsvc.domain.errors import Unavailable
from capsvc.http.server import Service
from tests.conftest import TEN, Client, ticket


async def test_every_key_written_has_a_ttl(
        service: tuple[Service, str], client: Client, redis_db: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After sales, rejections, subscriptions, cancels, a stop-sale and a pending ticket,
    every key has an expiry."""
    svc, _ = service
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

    monkeypatch.setattr(svc.store, "reserve", down)
    # A game with player limits sells in steps: this one stays pending.
    pending = ticket([{"numbers": TEN[:9], "stake": 250}], game="lnm-keno", player_id="P-2")
    assert (await client.sell(pending, token="ma")).status == 503
    keys = list(redis_db.scan_iter(count=1000))
    kinds = {k.split(b":")[0] for k in keys}
    # m: the marks (one hash a node or slot, 8 days past the last process's watch, not a
    # draw's: lua/capsvc.lua, MARKS); n: on a cluster, each primary's count (the same).
    cluster = set() if service[0].store.single_node else {b"n"}
    assert kinds == {b"c", b"r", b"p", b"s", b"x", b"b", b"k", b"f", b"e", b"a", b"m",
                     *cluster}
    forever = [k for k in keys if redis_db.pttl(k) < 0]
    assert forever == []
