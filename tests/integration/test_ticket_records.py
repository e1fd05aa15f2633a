"""Ticket records in buckets (lua/capsvc.lua, TICKET RECORDS), on a real Redis, standalone
and cluster: what each `[redis] ticket_records` writes and reads, the calls of the release
before (a rolling upgrade), records past their expiry, and the janitor's sweep."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from capsvc.cluster import connect
from capsvc.store import (
    RECORD_BUCKETS,
    TICKET_BUCKETS,
    Store,
    ident_of,
    lua_source,
    pending_key_of,
    record_bucket,
    record_bucket_of,
    ticket_key,
)
from capsvc.testing import RedisCluster, RedisServer
from capsvc.validator import unpack_sale
from tests.conftest import TEN, Client, ticket
from tests.records import TicketRecords

HOUR, DAY = 3_600_000, 86_400_000


def redis_ms(db: Any) -> int:
    sec, usec = db.time()
    return int(sec) * 1000 + int(usec) // 1000


@pytest.fixture
async def stores(redis_backend: RedisServer | RedisCluster, redis_db: redis.Redis
                 ) -> AsyncIterator[dict[str, Store]]:
    """A store of each `ticket_records`, on one Redis (processes configured apart)."""
    coalescer = connect(redis_backend.url, timeout_s=2, library=lua_source())
    out = {mode: Store(coalescer, ticket_records=mode)
           for mode in ("buckets+keys", "buckets", "keys")}
    await out["keys"].load_library()
    yield out
    await coalescer.aclose()


class Older:
    """The calls of the release before bucketed records: capsvc_<step>, KEYS[1] the
    ticket's key (it reads and writes keys only)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def claim(self, key: str, now: int, fp: str = "fp") -> Any:
        return self.store.fcall("capsvc_claim", [key],
                                [fp, b"sale", now + HOUR, now + DAY, 60_000, "ab" * 8])

    def finalize(self, key: str, sid: str) -> Any:
        return self.store.fcall("capsvc_finalize", [key], [sid, b"body"])

    def cancel(self, key: str, now: int) -> Any:
        return self.store.fcall("capsvc_cancel", [key, "s:" + key[2:key.index("}") + 1],
                                                  pending_key_of(key)],
                                [now + HOUR, "g:100", 10, now + DAY])

    def journaled(self, key: str, sid: str, state: bytes) -> Any:
        return self.store.fcall("capsvc_journaled", [pending_key_of(key), key],
                                [key, sid, state])


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
    reply = await store.claim(key, "fp", b"sale", now + HOUR,
                              now + DAY if expire_at is None else expire_at, 60_000)
    assert reply[0] == b"new"
    sid: str = reply[2].decode()
    assert await store.finalize(key, sid, b"body")
    return sid


async def test_each_setting_writes_where_it_says(stores: dict[str, Store], redis_db: redis.Redis
                                                 ) -> None:
    """buckets and buckets+keys write a field of the ticket's bucket (no key of its own, no
    TTL of its own); keys writes the ticket's own hash, as the release before did."""
    now = redis_ms(redis_db)
    for mode, store in stores.items():
        key = ticket_key("ch", f"W-{mode}")
        await sold(store, key, now)
        bucketed = TicketRecords(redis_db, "buckets")
        if mode == "keys":
            assert redis_db.hget(key, "st") == b"f"
            assert redis_db.pexpiretime(key) == now + DAY
            assert bucketed.exists(key) == 0
        else:
            assert redis_db.exists(key) == 0
            assert bucketed.get(key, "st", "body") == [b"f", b"body"]
            assert bucketed.expiry(key) == now + DAY
            assert redis_db.pexpiretime(record_bucket_of(key)) >= now + DAY
        assert (await store.ticket(key))[0:2] == [b"f", b"body"]


async def test_a_sold_ticket_s_record_keeps_its_sale_packed(client: Client,
                                                            redis_db: redis.Redis) -> None:
    """A ticket sold through the service: its record is a field of its bucket (no key of its
    own), and keeps the sale packed (validator.pack_sale), not as JSON."""
    draw = await client.current()
    body = ticket([{"numbers": TEN, "stake": 100}], first_draw=draw)
    assert (await client.sell(body)).status == 200
    key = ticket_key("fr-retail", body["ticket_id"])
    records = TicketRecords(redis_db, "buckets")
    assert redis_db.exists(key) == 0
    assert records.get(key, "st") == b"f"
    sale = records.get(key, "sale")
    assert sale[:1] != b"["
    assert unpack_sale(sale).ticket_id == body["ticket_id"]


async def test_a_record_is_found_whichever_layout_holds_it(stores: dict[str, Store],
                                                             redis_db: redis.Redis) -> None:
    """A ticket sold by a process writing keys is replayed, cancelled and journaled by one
    writing buckets (buckets+keys), and the other way round: never sold a second time."""
    now = redis_ms(redis_db)
    for writer, reader in (("keys", "buckets+keys"), ("buckets+keys", "keys"),
                           ("buckets", "keys"), ("keys", "keys")):
        key = ticket_key("ch", f"F-{writer}-{reader}")
        sid = await sold(stores[writer], key, now)
        other = stores[reader]
        replay = await other.claim(key, "fp", b"sale", now + HOUR, now + DAY, 60_000)
        assert replay[:4] == [b"final", b"body", replay[2], sid.encode()], (writer, reader)
        assert (await other.claim(key, "fp2", b"sale", now + HOUR, now + DAY, 60_000)
                ) == [b"conflict"]
        assert (await other.cancel(key, now + HOUR, "g", 100, 10, now + DAY))[0] == b"k"
        await other.cancelled(key, sid)
        assert (await stores[writer].ticket(key))[0] == b"c"
        await other.journaled(key, sid, b"c")
        assert redis_db.zscore(pending_key_of(key), key) is None


async def test_buckets_reads_keyed_records_until_a_whole_scan_finds_none(
        stores: dict[str, Store], redis_db: redis.Redis) -> None:
    """`buckets` reads keyed records too from its start (Redis unreachable then or not),
    and only buckets once a SCAN of the whole of every primary finds no keyed record: one
    keyed record among 30,000 other keys is found (a first page of SCAN misses it)."""
    now = redis_ms(redis_db)
    key = ticket_key("ch", "B-only")
    await sold(stores["keys"], key, now)
    store = stores["buckets"]
    assert (store.legacy_keys, store.layout_settled) == (True, False)
    pipe = redis_db.pipeline(transaction=False)
    for i in range(30_000):
        pipe.set(f"z:{{z:{i % 1000}}}:{i}", 1, px=HOUR)
    pipe.execute()
    for _ in range(2):
        assert (await store.ticket(key))[0] == b"f"
        assert await store.settle_layout() is False
    redis_db.delete(key)
    assert await store.settle_layout() is True
    assert store.names(key)[0] == [record_bucket_of(key)] * 2  # one key named: buckets only
    redis_db.flushall()


async def test_the_release_before_and_this_one_share_tickets(stores: dict[str, Store],
                                                            redis_db: redis.Redis) -> None:
    """Through a rolling upgrade, processes of the release before call capsvc_<step> with the
    ticket's key; this release, configured `keys`, writes where they read, and reads what
    they wrote."""
    now = redis_ms(redis_db)
    older, keys = Older(stores["keys"]), stores["keys"]
    mine = ticket_key("ch", "U-new")
    sid = await sold(keys, mine, now)
    assert (await older.claim(mine, now))[:2] == [b"final", b"body"]
    assert (await older.cancel(mine, now))[0] == b"k"
    theirs = ticket_key("ch", "U-old")
    claimed = await older.claim(theirs, now)
    assert claimed[0] == b"new"
    their_sid = claimed[2].decode()
    assert await older.finalize(theirs, their_sid) == 1
    replay = await keys.claim(theirs, "fp", b"sale", now + HOUR, now + DAY, 60_000)
    assert replay[:2] == [b"final", b"body"]
    assert (await keys.cancel(theirs, now + HOUR, "g", 100, 10, now + DAY))[0] == b"k"
    await keys.cancelled(theirs, their_sid)
    assert redis_db.hget(theirs, "st") == b"c"
    assert await older.journaled(theirs, their_sid, b"c") == 1
    assert await older.journaled(mine, sid, b"k") == 1


async def test_a_record_past_its_expiry_is_gone_for_every_reader(
        stores: dict[str, Store], redis_db: redis.Redis) -> None:
    """A bucketed record whose expiry (Redis TIME) has passed is absent, as an expired key
    is: the ticket id sells anew (a new sale id), a look-up finds nothing, a cancel is told
    missing; and the sweep deletes it."""
    store = stores["buckets+keys"]
    records = TicketRecords(redis_db, "buckets")
    now = redis_ms(redis_db)
    key = ticket_key("ch", "E-1")
    (neighbour,) = same_bucket(key, 1)
    await sold(store, neighbour, now)  # keeps the bucket (its TTL) past the record's expiry
    now = redis_ms(redis_db)
    sid = await sold(store, key, now, expire_at=now + 1500)
    assert (await store.ticket(key))[0] == b"f"
    await asyncio.sleep(max(0, now + 1600 - redis_ms(redis_db)) / 1000)
    now = redis_ms(redis_db)
    assert records.exists(key) == 1  # still there, but past its expiry
    assert await store.ticket(key) == [None] * 9
    assert await store.cancel(key, now + HOUR, "g", 100, 10, now + DAY) == [b"missing"]
    assert await store.expire(key, 0) == []
    again = await store.claim(key, "other fp", b"sale", now + HOUR, now + DAY, 60_000)
    assert again[0] == b"new"
    assert again[2].decode() != sid
    assert records.expiry(key) == now + DAY


async def test_the_sweep_deletes_what_is_past_its_expiry_and_nothing_else(
        stores: dict[str, Store], redis_db: redis.Redis) -> None:
    """`sweep` pages through a bucket and deletes the records past their expiry; the live
    ones stay, and the bucket keeps a TTL past its newest record's expiry, by a day at most
    (so that the next draws' records seldom push it again)."""
    store = stores["buckets"]
    records = TicketRecords(redis_db, "buckets")
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
    """20 grids on 400 draws name ~9,000 keys in one call (more than Lua's `unpack` takes):
    the ticket's names are taken out of KEYS in place, and the sale is decided."""
    coalescer = connect(redis_server.url, timeout_s=10, library=lua_source())
    store = Store(coalescer)
    try:
        await store.load_library()
        now, draws = redis_ms(standalone_db), 400
        grids = [(bytes(sorted(range(1 + g, 9 + g))).decode(), 100) for g in range(20)]
        expiries = [now + DAY + d for d in range(draws)]
        key = ticket_key("ch", "LONG-1")
        reply = await store.sell(key, "fp", b"sale", now + HOUR, expiries[-1], 60_000, "g",
                                 1000, draws, 5000, 100, grids, expiries, "UTC")
        assert reply[0] == b"new", reply
        assert (await store.ticket(key))[0] == b"f"
    finally:
        await coalescer.aclose()


async def test_a_reshard_in_progress_keeps_buckets_reading_keys(
        redis_cluster: RedisCluster) -> None:
    """On a cluster, primaries are scanned one after the other: a keyed record moved by a
    reshard from one not scanned yet to one already scanned would be seen on neither. While
    a slot is being migrated, or if the owners changed during the scan, the scan does not
    conclude, and a `buckets` process keeps reading keyed records."""
    from tests.integration.test_resharding import half_migrate

    redis_cluster.client().flushall()
    coalescer = connect(redis_cluster.url, timeout_s=5, library=lua_source())
    store = Store(coalescer)
    try:
        slot = key_slot(ticket_key("ch", "M-1").encode())
        half_migrate(redis_cluster, slot)
        assert await store.settle_layout() is False
        assert store.legacy_keys
        clients = [s.client() for s in redis_cluster.servers]
        importing = next(c for c in clients
                         if f"[{slot}-<-" in c.execute_command("CLUSTER", "NODES").decode())
        target = importing.execute_command("CLUSTER", "MYID").decode()
        for c in clients:
            c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target)
        for _ in range(50):  # every node agrees on the new owner
            if all(f"[{slot}-" not in c.execute_command("CLUSTER", "NODES").decode()
                   for c in clients):
                break
            await asyncio.sleep(0.1)
        assert await store.settle_layout() is True
        assert not store.legacy_keys
    finally:
        await coalescer.aclose()
