"""Ticket records in buckets (lua/capsvc.lua, TICKET RECORDS), on a real Redis, standalone
and cluster: where a record is written, records past their expiry, and the janitor's
sweep."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis

from capsvc.domain.validator import unpack_sale
from capsvc.redis.cluster import connect
from capsvc.redis.replies import Sold
from capsvc.redis.store import (
    RECORD_BUCKETS,
    TICKET_BUCKETS,
    Store,
    ident_of,
    lua_source,
    record_bucket,
    record_bucket_of,
    ticket_key,
    ticket_value,
)
from tests.conftest import TEN, Client, ticket
from tests.records import (
    TicketRecords,
    raw_cancel,
    raw_claim,
    raw_expire,
    raw_ticket,
    unpack,
)
from tests.support.sales import sell_alone
from tests.support.servers import RedisCluster, RedisServer, redis_ms

HOUR, DAY = 3_600_000, 86_400_000


@pytest.fixture
async def store(redis_backend: RedisServer | RedisCluster, redis_db: redis.Redis
                ) -> AsyncIterator[Store]:
    coalescer = connect(redis_backend.url, timeout_s=2, library=lua_source())
    out = Store(coalescer)
    await out.load_library()
    yield out
    await coalescer.aclose()


def same_bucket(key: str, count: int) -> list[str]:
    """`count` other tickets whose records share `key`'s bucket."""
    out: list[str] = []
    n = 0
    while len(out) < count:
        n += 1
        other = ticket_key("ch", f"{ident_of(key)}-{n}")
        if record_bucket_of(other) == record_bucket_of(key):
            out.append(other)
    return out


async def sold(store: Store, key: str, now: int, expire_at: int | None = None) -> str:
    """A ticket claimed and decided through `store`; its sale id."""
    reply = await raw_claim(store, key, b"sale", now + HOUR,
                              now + DAY if expire_at is None else expire_at, 60_000)
    assert reply[0] == b"new"
    sid: str = reply[2].decode()
    assert await store.finalize(key, sid, b"body")
    return sid


async def test_a_record_is_a_field_of_its_bucket(store: Store, redis_db: redis.Redis
                                                 ) -> None:
    """A ticket's record is a field of its bucket (no key of its own, no TTL of its own)."""
    now = redis_ms(redis_db)
    key = ticket_key("ch", "W-1")
    await sold(store, key, now)
    records = TicketRecords(redis_db)
    assert redis_db.exists(key) == 0
    assert records.get(key, "st", "body") == [b"f", b"body"]
    assert records.expiry(key) == now + DAY
    assert redis_db.pexpiretime(record_bucket_of(key)) >= now + DAY
    assert (await raw_ticket(store, key))[0:2] == [b"f", b"body"]


async def test_a_record_rewritten_at_its_expiry_reads_no_ttl_and_its_bucket_outlives_it(
        store: Store, redis_backend: RedisServer | RedisCluster, redis_db: redis.Redis
        ) -> None:
    """A decision rewrites its ticket's record without reading its bucket's TTL when the
    record's expiry does not change: the bucket outlives every record it holds (each write
    of a record pushed it past that record's expiry, nothing shortens it). A record written
    with a later expiry in the same bucket pushes it."""
    now = redis_ms(redis_db)
    key = ticket_key("ch", "TTL-1")
    reply = await raw_claim(store, key, b"sale", now + HOUR, now + DAY, 60_000)
    servers = (redis_backend.servers if isinstance(redis_backend, RedisCluster)
               else [redis_backend])
    clients = [s.client() for s in servers]
    for c in clients:
        c.config_resetstat()
    assert await store.finalize(key, reply[2].decode(), b"body")
    reads = [c.info("commandstats").get("cmdstat_pexpiretime", {}).get("calls", 0)
             for c in clients]
    assert reads == [0] * len(clients)
    bucket = record_bucket_of(key)
    assert redis_db.pexpiretime(bucket) >= now + DAY
    await sold(store, same_bucket(key, 1)[0], now, now + 3 * DAY)
    assert redis_db.pexpiretime(bucket) >= now + 3 * DAY


async def test_a_sold_ticket_s_record_keeps_its_sale_packed(client: Client,
                                                            redis_db: redis.Redis) -> None:
    """A ticket sold through the service: its record is a field of its bucket (no key of its
    own), and keeps the sale packed (validator.pack_sale), not as JSON."""
    draw = await client.current()
    body = ticket([{"numbers": TEN, "stake": 100}], first_draw=draw)
    assert (await client.sell(body)).status == 200
    key = ticket_key("fr-retail", body["ticket_id"])
    records = TicketRecords(redis_db)
    assert redis_db.exists(key) == 0
    assert records.get(key, "st") == b"f"
    sale = records.get(key, "sale")
    assert sale[:1] != b"["
    assert unpack_sale(sale).ticket_id == body["ticket_id"]


async def test_a_record_keeps_the_sale_id_and_instant_in_binary(
        service: Any, client: Client, redis_db: redis.Redis) -> None:
    """A sold ticket's record keeps its sale id as its 8 bytes and its instant as an
    integer, byte for byte as the restore builds it (capsvc.redis.store.ticket_value); the
    functions that read it give the sale id in hex, and a replay answers the same body."""
    svc, _ = service
    draw = await client.current()
    body = ticket([{"numbers": TEN, "stake": 100}], first_draw=draw)
    sold = await client.sell(body)
    assert sold.status == 200
    key = ticket_key("fr-retail", body["ticket_id"])
    raw = redis_db.hget(record_bucket_of(key), ident_of(key))
    assert raw is not None
    expiry, st, at, sid, sale, decision, results, ca, rel = unpack(raw)
    assert isinstance(at, int)
    assert len(sid) == 8
    assert (st, ca, rel) == (b"f", None, None)
    assert ticket_value(expiry, st, at, sid.hex(), sale, decision, results=results) == raw
    record = await svc.store.ticket(key)
    assert (record.sale_id, record.at) == (sid.hex(), at)
    replay = await client.sell(body)
    assert replay.status == 200
    assert replay.raw == sold.raw


async def test_a_record_past_its_expiry_is_gone_for_every_reader(
        store: Store, redis_db: redis.Redis) -> None:
    """A record whose expiry (Redis TIME) has passed is absent, as an expired key is: the
    ticket id sells anew (a new sale id), a look-up finds nothing, a cancel is told missing;
    and the sweep deletes it."""
    records = TicketRecords(redis_db)
    now = redis_ms(redis_db)
    key = ticket_key("ch", "E-1")
    (neighbour,) = same_bucket(key, 1)
    await sold(store, neighbour, now)  # keeps the bucket (its TTL) past the record's expiry
    now = redis_ms(redis_db)
    sid = await sold(store, key, now, expire_at=now + 1500)
    assert (await raw_ticket(store, key))[0] == b"f"
    await asyncio.sleep(max(0, now + 1600 - redis_ms(redis_db)) / 1000)
    now = redis_ms(redis_db)
    assert records.exists(key) == 1  # still there, but past its expiry
    assert await raw_ticket(store, key) == [None] * 8
    assert await raw_cancel(store, key, now + HOUR, "g", 100, 10, now + DAY) == [b"missing"]
    assert await raw_expire(store, key, 0) == []
    again = await raw_claim(store, key, b"sale", now + HOUR, now + DAY, 60_000)
    assert again[0] == b"new"
    assert again[2].decode() != sid
    assert records.expiry(key) == now + DAY


async def test_the_sweep_deletes_what_is_past_its_expiry_and_nothing_else(
        store: Store, redis_db: redis.Redis) -> None:
    """`sweep` pages through a bucket and deletes the records past their expiry; the live
    ones stay, and the bucket keeps a TTL past its newest record's expiry, by a day at most
    (so that the next draws' records seldom push it again)."""
    records = TicketRecords(redis_db)
    same = same_bucket(ticket_key("ch", "S"), 20)
    bucket = record_bucket_of(same[0])
    now = redis_ms(redis_db)
    old, live = same[:12], same[12:]
    await asyncio.gather(*[sold(store, key, now, expire_at=now + 1000) for key in old],
                         *[sold(store, key, now, expire_at=now + DAY) for key in live])
    assert now + DAY <= redis_db.pexpiretime(bucket) <= now + DAY + DAY
    await asyncio.sleep(max(0, now + 1100 - redis_ms(redis_db)) / 1000)
    cursor, deleted = b"", 0
    while cursor != b"0":
        cursor, gone = await store.sweep(bucket, cursor or b"0", 5)
        deleted += gone
    assert deleted == len(old)
    assert [records.exists(k) for k in old] == [0] * len(old)
    assert [records.get(k, "st") for k in live] == [b"f"] * len(live)
    assert sorted(redis_db.hkeys(bucket)) == sorted(ident_of(k).encode() for k in live)


async def test_every_record_bucket_is_in_its_tickets_slot(redis_db: redis.Redis) -> None:
    """A bucket shares its tickets' hash tag (their slot, their pending index's node), and
    the janitor's list of buckets is the buckets tickets go to."""
    names = {record_bucket(s, b) for s in range(TICKET_BUCKETS) for b in range(RECORD_BUCKETS)}
    assert len(names) == TICKET_BUCKETS * RECORD_BUCKETS
    for i in range(2000):
        key = ticket_key(f"ch{i % 3}", f"K-{i}")
        bucket = record_bucket_of(key)
        assert bucket in names
        assert bucket[2:bucket.index("}") + 1] == key[2:key.index("}") + 1]


async def test_a_sale_of_thousands_of_keys_is_one_call(redis_server: RedisServer,
                                                       standalone_db: redis.Redis) -> None:
    """20 grids on 400 draws name ~9,000 keys in one call (more than Lua's `unpack` takes),
    and the sale is decided."""
    coalescer = connect(redis_server.url, timeout_s=10, library=lua_source())
    store = Store(coalescer)
    try:
        await store.load_library()
        now, draws = redis_ms(standalone_db), 400
        grids = [(bytes(sorted(range(1 + g, 9 + g))).decode(), 100) for g in range(20)]
        expiries = [now + DAY + d for d in range(draws)]
        key = ticket_key("ch", "LONG-1")
        reply = await sell_alone(store, key, b"sale", now + HOUR, expiries[-1], 60_000, "g",
                                 1000, draws, 5000, 100, grids, expiries, "UTC")
        assert isinstance(reply, Sold), reply
        assert (await raw_ticket(store, key))[0] == b"f"
    finally:
        await coalescer.aclose()
