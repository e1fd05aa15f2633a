"""The Lua library (lua/capsvc.lua) on a real Redis, standalone and cluster, one function at
a time: counting, all-or-nothing, sale fencing, tombstones, ticket states, stops, budgets.

Every instant comes from the test server's clock (Redis TIME), the clock the functions use.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import secrets
import zlib
from collections.abc import AsyncIterator
from datetime import UTC, date, datetime, timedelta
from itertools import chain, combinations
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from capsvc.domain.combination import encode
from capsvc.domain.decisions import REJECTED, Reserved
from capsvc.redis.cluster import ClusterCoalescer, connect
from capsvc.redis.replies import Decided, Refused, Released, Sold, StoppedAt
from capsvc.redis.store import (
    COUNTER_BUCKETS,
    PlayerStore,
    Store,
    aggregate_key,
    bucket_keys,
    budget_key,
    limit_key,
    lua_source,
    pending_key_of,
    record_field,
    stops_key,
    ticket_key,
)
from tests.records import RawPlayers, TicketRecords, raw_cancel, raw_claim, raw_expire
from tests.support.sales import sell_alone
from tests.support.servers import RedisCluster, RedisServer, redis_ms

GAME = "g"
COMBO = encode([3, 7, 12, 18, 25, 33, 41, 56, 60, 70])
OTHER = encode([1, 2, 3])
HASH = encode(range(35, 43))  # its first byte is "#"
CAP, MIN = 5000, 100
FIRST = 100
HOUR, DAY = 3_600_000, 86_400_000
PLAYER, REGULATORY = "P-1", 1000


def new_sale() -> str:
    """A sale id as the claim mints them (16 hex digits)."""
    return secrets.token_hex(8)


async def store_on(url: str) -> AsyncIterator[Store]:
    """A store on `url` with the library loaded, closed afterwards."""
    coalescer = connect(url, timeout_s=2, library=lua_source())
    s = Store(coalescer)
    await s.load_library()
    yield s
    await coalescer.aclose()


@pytest.fixture
async def store(redis_backend: RedisServer | RedisCluster, redis_db: redis.Redis
                ) -> AsyncIterator[Store]:
    async for s in store_on(redis_backend.url):
        yield s


@pytest.fixture
def records(redis_db: redis.Redis) -> TicketRecords:
    return TicketRecords(redis_db)


def call(store: Store, name: str, ticket: str, args: list[Any], keys: tuple[str, ...] = ()
         ) -> Any:
    """FCALL of a ticket's function (capsvc_…) as the store names the ticket."""
    ticket_keys, ticket_args = store.names(ticket)
    return store.fcall(name, [*ticket_keys, *keys], [*ticket_args, *args])


@pytest.fixture
def now(redis_db: redis.Redis) -> int:
    """Redis TIME when the test starts."""
    return redis_ms(redis_db)


class Combos:
    """Reserve and release grids of GAME through the Store; read the counter buckets."""

    def __init__(self, store: Store, db: redis.Redis, now: int) -> None:
        self.store, self.db = store, db
        self.close = now + HOUR
        self.expires = [now + DAY + i * 1000 for i in range(5)]  # draws FIRST, FIRST+1, …

    def reserve(self, sale: str, stake: int, draws: int = 1, first: int = FIRST, grid: int = 0,
                close: int | None = None, combo: str = COMBO) -> Any:
        off = first - FIRST  # the raw reply (the store decodes it: capsvc.redis.replies)
        return self.store.fcall("capsvc_reserve", bucket_keys(GAME, combo, first, draws), [
            record_field(sale, grid), combo, stake, CAP, self.close if close is None else close,
            MIN, *self.expires[off:off + draws]])

    def seal(self, sale: str, draws: int = 1, grid: int = 0, combo: str = COMBO) -> Any:
        return self.reserve(sale, 500, draws, grid=grid, close=0, combo=combo)

    def release(self, sale: str, draws: int = 1, first: int = FIRST, grid: int = 0,
                combo: str = COMBO) -> Any:
        last = first - FIRST + draws - 1  # the record's bucket is the last draw's: its expiry
        return self.store.fcall("capsvc_release", bucket_keys(GAME, combo, first, draws), [
            record_field(sale, grid), combo, CAP, MIN, self.expires[last]])

    def counters(self, draws: int = 3, first: int = FIRST, combo: str = COMBO) -> list[int]:
        return [int(self.db.hget(k, combo) or 0) for k in bucket_keys(GAME, combo, first, draws)]

    def record(self, sale: str, grid: int = 0, first: int = FIRST, combo: str = COMBO,
               draws: int = 1) -> Any:
        """The grid's record, in the bucket of the last of its `draws` draws."""
        return self.db.hget(self.bucket(first + draws - 1, combo), record_field(sale, grid))

    def bucket(self, draw: int = FIRST, combo: str = COMBO) -> str:
        return bucket_keys(GAME, combo, draw, 1)[0]


@pytest.fixture
def combos(store: Store, redis_db: redis.Redis, now: int) -> Combos:
    return Combos(store, redis_db, now)


# -- reserve -------------------------------------------------------------------------------


async def test_reserve_checks_and_increments(combos: Combos) -> None:
    """A stake up to the room is counted; a bigger one is refused with the room, uncounted."""
    a, b, c = new_sale(), new_sale(), new_sale()
    assert await combos.reserve(a, 3000) == [1, 0]
    assert await combos.reserve(b, 2000) == [1, 1, 0]  # crosses 80 %, sold out on draw 0
    assert await combos.reserve(c, 100) == [0, 0, 0]
    assert combos.counters(1) == [5000]
    assert [combos.record(s) for s in (a, b, c)] == [b"3000", b"2000", b"R0:0"]
    d, e, f = new_sale(), new_sale(), new_sale()
    assert await combos.reserve(d, 4600, combo=OTHER) == [1, 1]
    assert await combos.reserve(e, 401, combo=OTHER) == [0, 0, 400]
    assert await combos.reserve(f, 400, combo=OTHER) == [1, 0, 0]  # stake == room: fits
    assert combos.counters(1, combo=OTHER) == [5000]


async def test_near_counts_only_the_crossing_of_80_percent(combos: Combos) -> None:
    """`near` counts only the counters this call brought across 80 % of the cap."""
    assert await combos.reserve(new_sale(), 3900) == [1, 0]
    assert await combos.reserve(new_sale(), 100, draws=2) == [1, 1]  # 4000 on draw 0 only
    assert await combos.reserve(new_sale(), 100) == [1, 0]  # 4100: already past
    assert await combos.reserve(new_sale(), 4000, combo=OTHER) == [1, 1]  # 0 -> exactly 80 %
    three = encode([9, 19, 29])
    assert await combos.reserve(new_sale(), 3500, draws=3, combo=three) == [1, 0]
    assert await combos.reserve(new_sale(), 600, draws=3, combo=three) == [1, 3]
    assert await combos.reserve(new_sale(), 100, draws=3, combo=three) == [1, 0]


async def test_reserve_is_all_or_nothing_across_draws(combos: Combos,
                                                      redis_db: redis.Redis) -> None:
    """One full draw refuses a subscription grid (its offset, room): nothing counted anywhere."""
    full, sale = new_sale(), new_sale()
    assert await combos.reserve(full, 5000, first=FIRST + 1) == [1, 1, 0]
    assert await combos.reserve(sale, 500, draws=3) == [0, 1, 0]
    assert combos.counters() == [0, 5000, 0]
    assert redis_db.exists(combos.bucket(FIRST)) == 0
    assert redis_db.hgetall(combos.bucket(FIRST + 1)) == {COMBO.encode(): b"5000",
                                                          record_field(full, 0): b"5000"}
    assert redis_db.hgetall(combos.bucket(FIRST + 2)) == {record_field(sale, 0): b"R1:0"}
    assert redis_db.pexpiretime(combos.bucket(FIRST + 2)) == combos.expires[2]
    assert await combos.reserve(new_sale(), 4800, first=FIRST + 2, combo=OTHER) == [1, 1]
    late = new_sale()
    assert await combos.reserve(late, 300, draws=3, combo=OTHER) == [0, 2, 200]
    assert combos.counters(combo=OTHER) == [0, 0, 4800]
    assert combos.record(late, draws=3, combo=OTHER) == b"R2:200"


async def test_a_refused_grid_takes_a_zero_counter_away_read_as_zero(
        combos: Combos, redis_db: redis.Redis) -> None:
    """A counter held as "0" (its bucket's only field), under a subscription grid refused on
    a later draw: counted and taken back, it goes, and its bucket with it; every reader
    reads zero, and nothing is left without a TTL."""
    full = new_sale()
    redis_db.hset(combos.bucket(FIRST), COMBO, 0)
    redis_db.pexpireat(combos.bucket(FIRST), combos.expires[0])
    assert await combos.reserve(full, 5000, first=FIRST + 1) == [1, 1, 0]
    late = new_sale()
    assert await combos.reserve(late, 500, draws=2) == [0, 1, 0]
    assert combos.counters(2) == [0, 5000]
    assert redis_db.exists(combos.bucket(FIRST)) == 0
    assert all(redis_db.pexpiretime(k) > 0 for k in redis_db.scan_iter("c:*"))
    assert await combos.reserve(new_sale(), 500) == [1, 0]  # the draw sells on from zero
    assert combos.counters(1) == [500]


async def test_rerun_of_an_accepted_grid_returns_it_and_counts_once(combos: Combos) -> None:
    """A re-run by the same sale answers its acceptance (sold-out offsets now), counts once."""
    sale = new_sale()
    assert await combos.reserve(sale, 500, draws=3) == [1, 0]
    assert await combos.reserve(sale, 500, draws=3) == [1, 0]
    assert combos.counters() == [500, 500, 500]
    assert await combos.reserve(new_sale(), 4500, first=FIRST + 1) == [1, 1, 0]
    assert await combos.reserve(sale, 500, draws=3) == [1, 0, 1]  # draw 1 is sold out now
    assert await combos.reserve(sale, 500, draws=3, close=0) == [1, 0, 1]  # the seal too
    assert combos.counters() == [500, 5000, 500]
    assert combos.record(sale, draws=3) == b"500"


async def test_rerun_of_a_rejected_grid_returns_the_rejection(combos: Combos) -> None:
    """A re-run of a rejected grid answers the recorded offset and room, even once room is back."""
    full, sale = new_sale(), new_sale()
    assert await combos.reserve(full, 4600, first=FIRST + 1) == [1, 1]
    assert await combos.reserve(sale, 500, draws=2) == [0, 1, 400]
    assert await combos.release(full, first=FIRST + 1) == [4600]
    assert await combos.reserve(sale, 500, draws=2) == [0, 1, 400]
    assert await combos.reserve(sale, 500, draws=2, close=0) == [0, 1, 400]
    assert combos.counters() == [0, 0, 0]
    # A cap lowered under the counter: the negative room is recorded and replayed as is.
    assert await combos.reserve(new_sale(), 4000, combo=OTHER) == [1, 1]
    late = record_field(new_sale(), 0)
    lowered = [GAME, OTHER, late, 100, 3000, MIN, FIRST, combos.expires[:1], combos.close]
    assert await combos.store.reserve(*lowered) == Reserved(REJECTED, offset=0, room=-1000)
    assert await combos.store.reserve(*lowered) == Reserved(REJECTED, offset=0, room=-1000)
    assert combos.counters(1, combo=OTHER) == [4000]


async def test_other_sale_of_the_same_ticket_and_grid_counts_separately(
        store: Store, combos: Combos, now: int) -> None:
    """Records are fenced by sale id: a new sale of the same ticket and grid counts on its own."""
    key = ticket_key("ch", "T-fence")
    first = await raw_claim(store, key, b"s", now + HOUR, now + DAY, 60_000)
    sale_a = first[2].decode()
    assert await combos.reserve(sale_a, 500) == [1, 0]
    assert await combos.release(sale_a) == [500]
    assert await call(store, "capsvc_unclaim", key, [sale_a]) == 1
    second = await raw_claim(store, key, b"s", now + HOUR, now + DAY, 60_000)
    sale_b = second[2].decode()
    assert second[0] == b"new"
    assert sale_b != sale_a
    assert await combos.reserve(sale_b, 700) == [1, 0]
    assert await combos.reserve(sale_a, 700) == [-2]  # the old sale stays sealed
    assert await combos.reserve(sale_b, 300, grid=1) == [1, 0]  # another grid of the sale
    assert combos.counters(1) == [1000]
    assert [combos.record(sale_a), combos.record(sale_b), combos.record(sale_b, 1)] == [
        b"X", b"700", b"300"]


async def test_reserve_after_close_counts_nothing(combos: Combos, redis_db: redis.Redis,
                                                  now: int) -> None:
    """Past close_ms (Redis TIME) an unrecorded sale gets {-1}, counts and writes nothing."""
    before = new_sale()
    assert await combos.reserve(before, 500, draws=2) == [1, 0]
    past = now - 1
    late = new_sale()
    assert await combos.reserve(late, 500, draws=2, close=past) == [-1]
    assert await combos.reserve(late, 500, draws=2, combo=OTHER, close=past) == [-1]
    assert combos.record(late, draws=2) is None
    assert redis_db.exists(combos.bucket(combo=OTHER)) == 0
    assert combos.counters(2) == [500, 500]
    assert await combos.reserve(before, 500, draws=2, close=past) == [1, 0]
    assert combos.counters(2) == [500, 500]
    soon = redis_ms(redis_db) + 150
    assert await combos.reserve(new_sale(), 100, close=soon) == [1, 0]
    await asyncio.sleep((soon + 10 - redis_ms(redis_db)) / 1000)
    assert await combos.reserve(new_sale(), 100, close=soon) == [-1]
    assert combos.counters(2) == [600, 500]


async def test_seal_mode_writes_x_and_a_later_reserve_answers_minus_2(
        combos: Combos, redis_db: redis.Redis) -> None:
    """close_ms = 0 seals with "X" (last draw's bucket and TTL): a later reserve gets {-2}."""
    sale = new_sale()
    assert await combos.seal(sale, draws=3) == [-2]
    assert combos.record(sale, draws=3) == b"X"
    assert redis_db.pexpiretime(combos.bucket(FIRST + 2)) == combos.expires[2]
    assert await combos.reserve(sale, 500, draws=3) == [-2]
    assert await combos.seal(sale, draws=3) == [-2]
    assert combos.counters() == [0, 0, 0]
    assert redis_db.exists(combos.bucket(FIRST), combos.bucket(FIRST + 1)) == 0
    assert redis_db.hgetall(combos.bucket(FIRST + 2)) == {record_field(sale, 0): b"X"}
    assert await combos.release(sale, draws=3) == [0]
    assert combos.record(sale, draws=3) == b"X"


async def test_counters_are_fields_of_bucket_hashes_with_each_draws_ttl(
        combos: Combos, redis_db: redis.Redis, records: TicketRecords) -> None:
    """Counters are fields of c:{game:bucket}:draw with each draw's TTL; records never collide."""
    keys = bucket_keys(GAME, COMBO, FIRST, 3)
    bucket = zlib.crc32(COMBO.encode()) % COUNTER_BUCKETS
    assert keys == [f"c:{{{GAME}:{bucket}}}:{FIRST + i}" for i in range(3)]
    assert len({key_slot(k.encode()) for k in keys}) == 1
    a, b = new_sale(), new_sale()
    assert await combos.reserve(a, 500, draws=3) == [1, 0]
    assert await combos.reserve(b, 300) == [1, 0]
    assert [redis_db.type(k) for k in keys] == [b"hash"] * 3
    assert [redis_db.pexpiretime(k) for k in keys] == combos.expires[:3]
    assert combos.counters() == [800, 500, 500]
    assert redis_db.hgetall(keys[0]) == {COMBO.encode(): b"800", record_field(b, 0): b"300"}
    assert redis_db.hgetall(keys[1]) == {COMBO.encode(): b"500"}
    assert redis_db.hgetall(keys[2]) == {COMBO.encode(): b"500", record_field(a, 0): b"500"}
    assert record_field(a, 0)[:1] == b"\0"
    assert len(record_field(a, 0)) == 10
    assert all("\0" not in encode([n]) for n in range(1, 100))
    # Another combination hashed to the same bucket: one hash, separate counters and records.
    twin = next(encode(c) for c in chain(combinations(range(1, 100), 2),
                                         combinations(range(1, 100), 3))
                if zlib.crc32(encode(c).encode()) % COUNTER_BUCKETS == bucket)
    assert bucket_keys(GAME, twin, FIRST, 3) == keys
    assert await combos.reserve(a, 4000, draws=3, grid=1, combo=twin) == [1, 3]
    assert combos.counters() == [800, 500, 500]
    assert combos.counters(combo=twin) == [4000, 4000, 4000]
    assert redis_db.hlen(keys[0]) == 3  # COMBO, twin, b's record
    assert redis_db.hgetall(keys[2]) == {COMBO.encode(): b"500", twin.encode(): b"4000",
                                         record_field(a, 0): b"500", record_field(a, 1): b"4000"}
    assert await combos.release(a, draws=3, grid=1, combo=twin) == [4000]
    assert combos.counters() == [800, 500, 500]
    assert combos.counters(combo=twin) == [0, 0, 0]
    assert combos.record(a, draws=3) == b"500"
    assert combos.record(a, 1, draws=3, combo=twin) == b"X"


async def test_concurrent_reserves_never_pass_the_cap(combos: Combos) -> None:
    """Reserves in one pipeline never pass the cap; copies of one sale's reserve count once."""
    replies = await asyncio.gather(*[combos.reserve(new_sale(), 100, draws=2)
                                     for _ in range(60)])
    assert sum(r[0] == 1 for r in replies) == 50
    assert all(r == [0, 0, 0] for r in replies if r[0] != 1)
    assert combos.counters(2) == [5000, 5000]
    sale = new_sale()
    copies = await asyncio.gather(*[combos.reserve(sale, 300, combo=OTHER) for _ in range(10)])
    assert copies == [[1, 0]] * 10
    assert combos.counters(1, combo=OTHER) == [300]


async def test_release_and_late_reserve_of_a_sale_cannot_both_win(combos: Combos) -> None:
    """A release and a reserve of one sale queued together, either order: nothing counted."""
    for release_first in (False, True):
        sale = new_sale()
        if release_first:  # both queued in the same tick, run by Redis in this order
            released_f = combos.release(sale, draws=3)
            reserved_f = combos.reserve(sale, 500, draws=3)
        else:
            reserved_f = combos.reserve(sale, 500, draws=3)
            released_f = combos.release(sale, draws=3)
        reserved, released = await asyncio.gather(reserved_f, released_f)
        assert [reserved, released] == ([[-2], [0]] if release_first else [[1, 0], [500]])
        assert combos.counters() == [0, 0, 0]
        assert combos.record(sale, draws=3) == b"X"
        assert await combos.reserve(sale, 500, draws=3) == [-2]
        assert combos.counters() == [0, 0, 0]


# -- release -------------------------------------------------------------------------------


async def test_release_gives_back_the_recorded_stake_once_on_every_draw(
        combos: Combos) -> None:
    """Release gives back the recorded stake once on every draw and leaves "X" ({-2} after)."""
    a, b = new_sale(), new_sale()
    assert await combos.reserve(a, 500, draws=3) == [1, 0]
    assert await combos.reserve(b, 300, draws=3) == [1, 0]
    assert await combos.release(a, draws=3) == [500]
    assert await combos.release(a, draws=3) == [0]
    assert combos.counters() == [300, 300, 300]
    assert combos.record(a, draws=3) == b"X"
    assert combos.record(b, draws=3) == b"300"
    assert await combos.reserve(a, 500, draws=3) == [-2]
    assert combos.counters() == [300, 300, 300]


async def test_release_before_reserve_seals_the_sale(combos: Combos,
                                                     redis_db: redis.Redis) -> None:
    """Releasing a sale that never reserved seals it: its late reserve counts nothing ({-2})."""
    sale = new_sale()
    assert await combos.release(sale, draws=3) == [0]
    assert combos.record(sale, draws=3) == b"X"
    assert redis_db.pexpiretime(combos.bucket(FIRST + 2)) == combos.expires[2]
    assert redis_db.exists(combos.bucket(FIRST), combos.bucket(FIRST + 1)) == 0
    assert await combos.reserve(sale, 500, draws=3) == [-2]
    assert combos.counters() == [0, 0, 0]


async def test_release_of_a_rejected_grid_gives_nothing(combos: Combos) -> None:
    """Releasing a rejected grid gives nothing back, and its re-run stays a rejection."""
    full, sale = new_sale(), new_sale()
    assert await combos.reserve(full, 4600) == [1, 1]
    assert await combos.reserve(sale, 500) == [0, 0, 400]
    assert await combos.release(sale) == [0]
    assert combos.counters(1) == [4600]
    assert await combos.reserve(sale, 500) == [0, 0, 400]
    assert combos.counters(1) == [4600]


async def test_release_never_touches_another_sale(combos: Combos) -> None:
    """Releasing sale A (any grid) leaves sale B's record and stake alone."""
    a, b = new_sale(), new_sale()
    assert await combos.reserve(a, 500, draws=2) == [1, 0]
    assert await combos.reserve(b, 700, draws=2) == [1, 0]
    assert await combos.release(a, draws=2, grid=1) == [0]
    assert combos.record(a, draws=2) == b"500"
    assert await combos.release(a, draws=2) == [500]
    assert combos.record(b, draws=2) == b"700"
    assert combos.counters(2) == [700, 700]
    assert await combos.release(b, draws=2) == [700]
    assert combos.counters(2) == [0, 0]


async def test_release_reports_the_draws_leaving_sold_out(combos: Combos) -> None:
    """Release reports exactly the offsets whose counter left the sold-out state."""
    a, b = new_sale(), new_sale()
    assert await combos.reserve(a, 4900, draws=3) == [1, 3]  # room 100 = MIN: not sold out
    assert await combos.reserve(b, 50, draws=2, first=FIRST + 1) == [1, 0, 0, 1]
    assert await combos.release(b, draws=2, first=FIRST + 1) == [50, 0, 1]
    assert await combos.release(a, draws=3) == [4900]


async def test_each_draw_is_judged_by_its_own_cap_and_the_shadow_cap_refuses_none(
        combos: Combos) -> None:
    """Caps given per draw ("C1,C2,…") judge each draw by its own, the last one repeated for
    the draws after it; a shadow cap ("…/S") flags an accepted grid (2) without refusing."""
    store, expires = combos.store, combos.expires

    def reserve(sale: str, stake: int, caps: str | int, draws: int = 3) -> Any:
        return store.fcall("capsvc_reserve", bucket_keys(GAME, COMBO, FIRST, draws), [
            record_field(sale, 0), COMBO, stake, caps, combos.close, MIN, *expires[:draws]])

    # Draws 1 and 2 reach their cap (and 80 % of it), draw 0 neither.
    assert await reserve(new_sale(), 3000, "5000,3000") == [1, 2, 1, 2]
    assert await reserve(new_sale(), 100, "5000,3000,3100") == [0, 1, 0]
    assert await reserve(new_sale(), 100, "5000,3100,3100") == [1, 0, 1, 2]
    assert combos.counters() == [3100, 3100, 3100]
    # The shadow cap: accepted either way, 2 when it would have refused.
    assert await reserve(new_sale(), 900, "5000/4000") == [1, 3]  # 4000: up to the shadow
    assert await reserve(new_sale(), 100, "5000/4000") == [2, 0]  # beyond it
    assert await reserve(new_sale(), 900, "5000/6000") == [1, 0, 0, 1, 2]
    assert await reserve(new_sale(), 100, "5000/1000") == [0, 0, 0]  # the real cap refuses
    assert combos.counters() == [5000, 5000, 5000]
    # A release reports the draws leaving the sold-out state by each draw's cap.
    sale = new_sale()
    assert await reserve(sale, 100, "5100,5200,5100", 3) == [1, 0, 0, 2]
    assert await store.release(GAME, COMBO, record_field(sale, 0), "5100,5200,5100", MIN,
                               FIRST, 3, expires[2]) == Released(100, (0, 2))


async def test_release_deletes_counters_that_reach_zero(combos: Combos,
                                                        redis_db: redis.Redis) -> None:
    """A counter given back to 0 is deleted (the bucket shrinks or goes; tombstones stay)."""
    a, b = new_sale(), new_sale()
    assert await combos.reserve(a, 500, draws=2) == [1, 0]
    assert await combos.reserve(b, 300, combo=OTHER) == [1, 0]
    assert await combos.reserve(b, 200, first=FIRST + 1, grid=1) == [1, 0]
    # COMBO, a's record (its last draw), b's record of grid 1
    assert redis_db.hlen(combos.bucket(FIRST + 1)) == 3
    assert redis_db.hlen(combos.bucket()) == 1
    assert await combos.release(a, draws=2) == [500]
    assert combos.counters(2) == [0, 200]
    assert await combos.release(b, first=FIRST + 1, grid=1) == [200]
    assert redis_db.hexists(combos.bucket(FIRST + 1), COMBO) == 0
    assert redis_db.hlen(combos.bucket(FIRST + 1)) == 2  # only the two tombstones
    assert [combos.record(a, draws=2), combos.record(b, 1, first=FIRST + 1)] == [b"X", b"X"]
    assert redis_db.exists(combos.bucket()) == 0
    assert combos.counters(1, combo=OTHER) == [300]


async def test_a_subscription_record_outlives_its_first_draw(combos: Combos,
                                                             redis_db: redis.Redis) -> None:
    """A 3-draw grid's record is in the third draw's bucket; once the first draw's bucket is
    gone (its expiry), a release still gives the stake back on the other draws once and a late
    reserve of the sale answers {-2}."""
    sale, other = new_sale(), new_sale()
    assert await combos.reserve(sale, 500, draws=3) == [1, 0]
    assert await combos.reserve(other, 300, draws=3) == [1, 0]
    field = record_field(sale, 0)
    assert redis_db.hget(combos.bucket(FIRST + 2), field) == b"500"
    assert redis_db.hexists(combos.bucket(FIRST), field) == 0
    assert redis_db.hexists(combos.bucket(FIRST + 1), field) == 0
    assert redis_db.pexpiretime(combos.bucket(FIRST + 2)) == combos.expires[2]
    assert redis_db.delete(combos.bucket(FIRST)) == 1  # the first draw's expiry
    assert combos.counters() == [0, 800, 800]
    assert await combos.release(sale, draws=3) == [500]
    assert combos.counters() == [0, 300, 300]
    assert await combos.release(sale, draws=3) == [0]
    assert combos.counters() == [0, 300, 300]
    assert combos.record(sale, draws=3) == b"X"
    assert await combos.reserve(sale, 500, draws=3) == [-2]
    assert await combos.seal(sale, draws=3) == [-2]
    assert combos.counters() == [0, 300, 300]
    assert redis_db.exists(combos.bucket(FIRST)) == 0
    assert combos.record(other, draws=3) == b"300"


# -- tickets -------------------------------------------------------------------------------


async def claim(store: Store, key: str, now: int, sale: bytes = b"sale",
                close: int | None = None, stale_after: int = 60_000) -> Any:
    return await raw_claim(store, key, sale, now + HOUR if close is None else close, now + DAY,
                             stale_after)


async def claimed(store: Store, key: str, now: int) -> tuple[int, str]:
    reply = await claim(store, key, now)
    assert reply[0] == b"new"
    return int(reply[1]), reply[2].decode()


async def finalize(store: Store, key: str, sid: str, body: bytes = b"body") -> Any:
    return await call(store, "capsvc_finalize", key, [sid, body])


async def test_claim_new_mints_a_sale_id_at_redis_time(store: Store, redis_db: redis.Redis,
                                                      now: int, records: TicketRecords) -> None:
    """A new claim answers {new, at (Redis TIME, ms), 16-hex sid}; the record has the TTL."""
    key = ticket_key("ch", "T-new")
    t0 = redis_ms(redis_db)
    reply = await claim(store, key, now, sale=b"sale-1")
    t1 = redis_ms(redis_db)
    assert reply[0] == b"new"
    at, sid = reply[1], reply[2].decode()
    assert isinstance(at, int)
    assert t0 <= at <= t1
    assert re.fullmatch("[0-9a-f]{16}", sid)
    assert records.fields(key) == {b"st": b"p", b"at": str(at).encode(),
                                     b"sid": sid.encode(), b"sale": b"sale-1"}
    assert records.expiry(key) == now + DAY
    other = await claim(store, ticket_key("ch", "T-new2"), now)
    assert other[2].decode() != sid


async def test_claim_replays_pending_stale_and_final(store: Store, now: int) -> None:
    """A claim replays {pending}, {stale} and {final, body} even after the close, each with
    the sale the ticket id holds (the caller compares its request with it)."""
    key = ticket_key("ch", "T-replay")
    at, sid = await claimed(store, key, now)
    assert await claim(store, key, now, sale=b"other") == [b"pending", at, sid.encode(),
                                                            b"sale"]
    assert await claim(store, key, now, stale_after=0) == [b"stale", b"sale"]
    assert await finalize(store, key, sid) == 1
    final = await claim(store, key, now, close=now - 1)
    assert final[:2] == [b"final", b"body"]
    assert final[4] == b"sale"


async def test_claim_refuses_after_the_close(store: Store, redis_db: redis.Redis,
                                             now: int, records: TicketRecords) -> None:
    """A ticket whose first draw closed (close_ms in the past) is not claimed at all."""
    key = ticket_key("ch", "T-closed")
    assert await claim(store, key, now, close=now - 1) == [b"closed"]
    assert records.exists(key) == 0


async def test_an_expired_claim_is_stale(store: Store, now: int) -> None:
    """Once the janitor took a pending ticket (x), a replay is told {stale}."""
    key = ticket_key("ch", "T-x")
    await claimed(store, key, now)
    assert (await raw_expire(store, key, 0))[0] == b"x"
    assert await claim(store, key, now) == [b"stale", b"sale"]


async def test_finalize_only_for_its_sale_while_p_or_x(store: Store, redis_db: redis.Redis,
                                                       now: int, records: TicketRecords) -> None:
    """finalize writes only for the ticket's own sale id, in state p or x; never creates a key."""
    key = ticket_key("ch", "T-fin")
    _, sid = await claimed(store, key, now)
    assert await finalize(store, key, new_sale()) == 0
    assert records.get(key, "st") == b"p"
    assert await finalize(store, key, sid) == 1
    assert records.get(key, "st", "body") == [b"f", b"body"]
    assert await finalize(store, key, sid, b"other") == 0
    assert records.get(key, "body") == b"body"
    settled = ticket_key("ch", "T-fin-x")
    _, sid_x = await claimed(store, settled, now)
    assert (await raw_expire(store, settled, 0))[0] == b"x"
    assert await finalize(store, settled, new_sale()) == 0
    assert await finalize(store, settled, sid_x) == 1
    assert records.get(settled, "st") == b"f"
    assert (await raw_cancel(store, settled, now + HOUR, "g", 100, 0, now + DAY))[0] == b"k"
    assert await finalize(store, settled, sid_x, b"other") == 0
    missing = ticket_key("ch", "T-fin-missing")
    assert await finalize(store, missing, sid) == 0
    assert records.exists(missing) == 0


async def test_unclaim_only_for_its_sale_while_p_or_x(store: Store, redis_db: redis.Redis,
                                                      now: int, records: TicketRecords) -> None:
    """unclaim forgets a ticket only for its own sale id, in state p or x (never f, k, c)."""
    key = ticket_key("ch", "T-un")
    _, sid = await claimed(store, key, now)
    assert await call(store, "capsvc_unclaim", key, [new_sale()]) == 0
    assert records.exists(key) == 1
    assert await call(store, "capsvc_unclaim", key, [sid]) == 1
    assert records.exists(key) == 0
    _, sid = await claimed(store, key, now)
    assert (await raw_expire(store, key, 0))[0] == b"x"
    assert await call(store, "capsvc_unclaim", key, [sid]) == 1
    assert records.exists(key) == 0
    _, sid = await claimed(store, key, now)
    assert await finalize(store, key, sid) == 1
    assert await call(store, "capsvc_unclaim", key, [sid]) == 0
    assert records.get(key, "st") == b"f"
    assert (await raw_cancel(store, key, now + HOUR, "g", 100, 0, now + DAY))[0] == b"k"
    assert await call(store, "capsvc_unclaim", key, [sid]) == 0
    assert await call(store, "capsvc_cancelled", key, [sid]) == 1
    assert await call(store, "capsvc_unclaim", key, [sid]) == 0
    assert records.get(key, "st") == b"c"


async def test_expire_hands_due_tickets_to_the_janitor(store: Store, now: int) -> None:
    """expire hands tickets due by Redis TIME to the janitor (x, k, and f or c: a decision
    maybe never journaled); {'wait'} before; else {}."""
    key = ticket_key("ch", "T-exp")
    at, sid = await claimed(store, key, now)
    assert await raw_expire(store, key, HOUR) == [b"wait"]
    assert await claim(store, key, now) == [b"pending", at, sid.encode(), b"sale"]
    due = [b"x", at, sid.encode(), b"sale"]
    assert await raw_expire(store, key, 0) == due
    assert await raw_expire(store, key, HOUR) == due  # an expired ticket stays the janitor's
    assert await finalize(store, key, sid) == 1
    assert await raw_expire(store, key, HOUR) == [b"wait"]
    assert await raw_expire(store, key, 0) == [b"f", at, sid.encode(), b"sale",
                                          b"body", None, None, None]
    k = await raw_cancel(store, key, now + HOUR, "g", 100, 500, now + DAY)
    assert k[0] == b"k"
    assert await raw_expire(store, key, HOUR) == [b"wait"]
    assert await raw_expire(store, key, 0) == [b"k", at, sid.encode(), b"sale",
                                          b"body", str(k[1]).encode(), b"500", None]
    assert await call(store, "capsvc_cancelled", key, [sid]) == 1
    assert await raw_expire(store, key, HOUR) == [b"wait"]
    assert (await raw_expire(store, key, 0))[0] == b"c"
    assert await raw_expire(store, ticket_key("ch", "T-exp-missing"), 0) == []


async def test_cancel_decides_once(store: Store, redis_db: redis.Redis, now: int,
                                   records: TicketRecords) -> None:
    """cancel decides once (k, at Redis TIME, the ticket indexed with it) if open and not
    stopped by an admin (the stop copy in the ticket's slot), then replays k, then c."""
    key = ticket_key("ch", "T-cancel")
    assert await raw_cancel(store, key, now + HOUR, "g", 100, 10, now + DAY) == [b"missing"]
    assert records.exists(key) == 0
    _, sid = await claimed(store, key, now)
    assert await raw_cancel(store, key, now + HOUR, "g", 100, 10, now + DAY) == [b"undecided"]
    assert await finalize(store, key, sid) == 1
    await store.journaled(key, sid, b"f")  # the claim's index entry let go, once journaled
    assert redis_db.zscore(pending_key_of(key), key) is None
    assert await raw_cancel(store, key, now - 1, "g", 100, 10, now + DAY) == [b"closed"]
    assert await store.stop("g", 99, now + DAY) > 0  # copied into every ticket slot
    assert await raw_cancel(store, key, now + HOUR, "g", 99, 10, now + DAY) == [b"closed"]
    assert records.get(key, "st") == b"f"
    t0 = redis_ms(redis_db)
    reply = await raw_cancel(store, key, now + HOUR, "g", 100, 10, now + DAY)
    t1 = redis_ms(redis_db)
    assert reply[0] == b"k"
    assert t0 <= reply[1] <= t1
    ca = reply[1]
    assert reply == [b"k", ca, 10, sid.encode()]
    # Indexed with the decision, for the janitor should its request die.
    assert redis_db.zscore(pending_key_of(key), key) == ca
    again = await raw_cancel(store, key, now - 1, "g", 99, 99, now + DAY)
    assert again == [b"k", ca, 10, sid.encode()]
    assert (await claim(store, key, now))[:2] == [b"final", b"body"]
    assert await call(store, "capsvc_cancelled", key, [sid]) == 1
    assert await raw_cancel(store, key, now - 1, "g", 99, 99, now + DAY) == [b"c", ca, 10]
    assert await raw_cancel(store, key, now + HOUR, "g", 100, 99, now + DAY) == [b"c", ca, 10]
    assert records.get(key, "st", "ca", "rel") == [b"c", str(ca).encode(), b"10"]


async def test_cancelled_only_for_its_sale_while_k(store: Store, redis_db: redis.Redis,
                                                   now: int, records: TicketRecords) -> None:
    """cancelled completes only the cancel of the ticket's own sale id, in state k."""
    key = ticket_key("ch", "T-cancelled")
    _, sid = await claimed(store, key, now)
    assert await call(store, "capsvc_cancelled", key, [sid]) == 0  # pending
    assert await finalize(store, key, sid) == 1
    assert await call(store, "capsvc_cancelled", key, [sid]) == 0  # final, not cancelling
    assert records.get(key, "st") == b"f"
    assert (await raw_cancel(store, key, now + HOUR, "g", 100, 0, now + DAY))[0] == b"k"
    assert await call(store, "capsvc_cancelled", key, [new_sale()]) == 0
    assert records.get(key, "st") == b"k"
    assert await call(store, "capsvc_cancelled", key, [sid]) == 1
    assert records.get(key, "st") == b"c"
    missing = ticket_key("ch", "T-cancelled-missing")
    assert await call(store, "capsvc_cancelled", missing, [sid]) == 0
    assert records.exists(missing) == 0


async def test_a_claim_indexes_its_ticket_in_the_pending_zset_with_a_ttl(
        store: Store, redis_db: redis.Redis, now: int) -> None:
    """A claim first adds its ticket to its slot's pending zset at Redis TIME (the first
    instant kept), with a TTL, in the same call: whatever the claim answers."""
    key = ticket_key("ch", "T-index")
    pending = pending_key_of(key)
    assert key_slot(pending.encode()) == key_slot(key.encode())
    t0 = redis_ms(redis_db)
    assert (await raw_claim(store, key, b"s", now + HOUR, now + DAY, 60_000))[0] == b"new"
    ((member, first),) = redis_db.zrange(pending, 0, -1, withscores=True)
    assert member == key.encode()
    assert t0 <= first <= redis_ms(redis_db)  # Redis TIME
    assert redis_db.pexpiretime(pending) == now + DAY
    assert (await raw_claim(store, key, b"s", now + HOUR, now + HOUR, 60_000))[0] == b"pending"
    assert redis_db.zscore(pending, key) == first
    assert redis_db.pexpiretime(pending) == now + DAY
    other = key.replace("T-index", "T-index-2")  # same hash tag, same zset
    assert (await raw_claim(store, other, b"s", now, now + 2 * DAY, 60_000))[0] == b"closed"
    assert redis_db.zcard(pending) == 2
    assert redis_db.pexpiretime(pending) == now + 2 * DAY


# -- stops ---------------------------------------------------------------------------------


async def test_stop_first_wins_at_redis_time(store: Store, redis_db: redis.Redis,
                                             now: int) -> None:
    """The first stop wins from the millisecond after its Redis TIME; the stops hash expires at
    the latest expiry."""
    t0 = redis_ms(redis_db)
    instant = await store.stop(GAME, FIRST, now + DAY)
    t1 = redis_ms(redis_db)
    assert t0 < instant <= t1 + 1
    await asyncio.sleep(0.01)
    assert await store.stop(GAME, FIRST, now + 2 * DAY) == instant
    assert redis_db.hgetall(stops_key(GAME)) == {str(FIRST).encode():
                                                 f"{instant}:{now + DAY}".encode()}
    assert redis_db.pexpiretime(stops_key(GAME)) == now + DAY
    second = await store.stop(GAME, FIRST + 1, now + 2 * DAY)
    assert second >= instant
    assert redis_db.pexpiretime(stops_key(GAME)) == now + 2 * DAY
    assert await store.stop(GAME, FIRST + 2, now + HOUR) >= second
    assert redis_db.pexpiretime(stops_key(GAME)) == now + 2 * DAY


async def test_stop_prunes_draws_whose_expiry_passed(store: Store, redis_db: redis.Redis,
                                                     now: int) -> None:
    """The next stop deletes the stops of draws whose expiry (Redis TIME) has passed."""
    await store.stop(GAME, FIRST, now + DAY)
    await store.stop(GAME, FIRST + 1, now + 50)
    await asyncio.sleep((now + 60 - redis_ms(redis_db)) / 1000)
    assert redis_ms(redis_db) > now + 50
    assert redis_db.hexists(stops_key(GAME), str(FIRST + 1)) == 1  # until the next stop
    await store.stop(GAME, FIRST + 2, now + DAY)
    assert sorted(redis_db.hkeys(stops_key(GAME))) == [str(FIRST).encode(),
                                                       str(FIRST + 2).encode()]
    assert redis_db.pexpiretime(stops_key(GAME)) == now + DAY


# -- budgets -------------------------------------------------------------------------------


def day_of(ms: int, back: int = 0) -> str:
    return (datetime.fromtimestamp(ms / 1000, UTC).date() - timedelta(days=back)).isoformat()


def tomorrow_of(day: str) -> str:
    return (date.fromisoformat(day) + timedelta(days=1)).isoformat()


@pytest.fixture
def players(store: Store) -> PlayerStore:
    return RawPlayers(store)


def spent(db: redis.Redis, day: str) -> int:
    return int(db.hget(budget_key(PLAYER, day), "spent") or 0)


async def test_budget_take_is_all_or_nothing_over_days(players: PlayerStore,
                                                       redis_db: redis.Redis,
                                                       now: int) -> None:
    """A take over several days charges every day or none (room of the day that refused)."""
    d1, d2 = day_of(now), tomorrow_of(day_of(now))
    exp = now + 3 * DAY
    assert await players.reserve(PLAYER, "other", REGULATORY, exp, [(d2, 900)]) == [1, 100]
    assert await players.reserve(PLAYER, "s1", REGULATORY, exp, [(d1, 300), (d2, 200)]) == [
        0, 100]
    assert (spent(redis_db, d1), spent(redis_db, d2)) == (0, 900)
    assert redis_db.hget(budget_key(PLAYER, d1), "s1") == b"R100"
    assert redis_db.hget(budget_key(PLAYER, d2), "s1") is None
    assert await players.reserve(PLAYER, "s2", REGULATORY, exp, [(d1, 300), (d2, 100)]) == [
        1, 700]
    assert (spent(redis_db, d1), spent(redis_db, d2)) == (300, 1000)
    assert [redis_db.hget(budget_key(PLAYER, d), "s2") for d in (d1, d2)] == [b"300", b"100"]
    assert redis_db.pexpiretime(budget_key(PLAYER, d1)) == exp
    assert redis_db.pexpiretime(budget_key(PLAYER, d2)) == exp


async def test_budget_rerun_answers_the_recorded_outcome(players: PlayerStore,
                                                         redis_db: redis.Redis,
                                                         now: int) -> None:
    """A take re-run by the same ref charges nothing more; a refusal stays a refusal."""
    d1, exp = day_of(now), now + 3 * DAY
    assert await players.reserve(PLAYER, "s", REGULATORY, exp, [(d1, 300)]) == [1, 700]
    assert await players.reserve(PLAYER, "s", REGULATORY, exp, [(d1, 300)]) == [1, 700]
    assert spent(redis_db, d1) == 300
    assert await players.reserve(PLAYER, "big", REGULATORY, exp, [(d1, 800)]) == [0, 700]
    assert await players.settle(PLAYER, "s", [(d1, 0)]) == 300
    assert await players.reserve(PLAYER, "big", REGULATORY, exp, [(d1, 800)]) == [0, 700]
    assert spent(redis_db, d1) == 0


async def test_budget_seal_then_take_answers_minus_2(players: PlayerStore,
                                                     redis_db: redis.Redis, now: int) -> None:
    """A sealed ref ("X") can take nothing ({-2}); sealing a ref that took changes nothing."""
    d1, d2, exp = day_of(now), tomorrow_of(day_of(now)), now + 3 * DAY
    shares = [(d1, 300), (d2, 300)]
    assert await players.reserve(PLAYER, "s", REGULATORY, exp, shares, seal=True) == [-2]
    assert redis_db.hget(budget_key(PLAYER, d1), "s") == b"X"
    assert redis_db.pexpiretime(budget_key(PLAYER, d1)) == exp
    assert await players.reserve(PLAYER, "s", REGULATORY, exp, shares) == [-2]
    assert (spent(redis_db, d1), spent(redis_db, d2)) == (0, 0)
    assert await players.reserve(PLAYER, "t", REGULATORY, exp, shares) == [1, 700]
    assert await players.reserve(PLAYER, "t", REGULATORY, exp, shares, seal=True) == [1, 700]
    assert (spent(redis_db, d1), spent(redis_db, d2)) == (300, 300)


async def test_settle_adjusts_to_the_amounts_and_ignores_r_and_x(players: PlayerStore,
                                                                 redis_db: redis.Redis,
                                                                 now: int) -> None:
    """settle sets a ref's amounts (spent follows), idempotently; R, X, unknown refs untouched."""
    d1, d2, exp = day_of(now), tomorrow_of(day_of(now)), now + 3 * DAY
    assert await players.reserve(PLAYER, "s", REGULATORY, exp, [(d1, 300), (d2, 200)]) == [
        1, 700]
    assert await players.settle(PLAYER, "s", [(d1, 100), (d2, 0)]) == 400
    assert (spent(redis_db, d1), spent(redis_db, d2)) == (100, 0)
    assert [redis_db.hget(budget_key(PLAYER, d), "s") for d in (d1, d2)] == [b"100", b"0"]
    assert await players.settle(PLAYER, "s", [(d1, 100), (d2, 0)]) == 0
    assert (spent(redis_db, d1), spent(redis_db, d2)) == (100, 0)
    assert await players.reserve(PLAYER, "r", REGULATORY, exp, [(d1, 950)]) == [0, 900]
    assert await players.reserve(PLAYER, "x", REGULATORY, exp, [(d1, 1)], seal=True) == [-2]
    for ref, kept in (("r", b"R900"), ("x", b"X")):
        assert await players.settle(PLAYER, ref, [(d1, 0)]) == 0
        assert redis_db.hget(budget_key(PLAYER, d1), ref) == kept
    assert await players.settle(PLAYER, "unknown", [(d1, 0), (d2, 0)]) == 0
    assert redis_db.hexists(budget_key(PLAYER, d1), "unknown") == 0
    assert (spent(redis_db, d1), spent(redis_db, d2)) == (100, 0)


async def test_stake_is_idempotent_over_three_days(players: PlayerStore,
                                                   redis_db: redis.Redis, now: int) -> None:
    """A stake ref recorded 1 or 2 days before answers as recorded and charges today nothing."""
    exp = now + 3 * DAY

    def days(back: int) -> list[str]:
        return [day_of(now, back + n) for n in range(3)]

    assert await players.stake(PLAYER, "a", REGULATORY, exp, days(1), 300) == [1, 700]
    assert await players.stake(PLAYER, "b", REGULATORY, exp, days(2), 200) == [1, 800]
    assert await players.stake(PLAYER, "r", REGULATORY, exp, days(1), 800) == [0, 700]
    assert await players.stake(PLAYER, "a", REGULATORY, exp, days(0), 300) == [1, 1000]
    assert await players.stake(PLAYER, "b", REGULATORY, exp, days(0), 200) == [1, 1000]
    assert await players.stake(PLAYER, "r", REGULATORY, exp, days(0), 800) == [0, 700]
    assert spent(redis_db, day_of(now)) == 0
    assert (spent(redis_db, day_of(now, 1)), spent(redis_db, day_of(now, 2))) == (300, 200)
    assert await players.stake(PLAYER, "c", REGULATORY, exp, days(0), 400) == [1, 600]
    assert await players.stake(PLAYER, "c", REGULATORY, exp, days(0), 400) == [1, 600]
    assert await players.stake(PLAYER, "a", REGULATORY, exp, days(0), 300) == [1, 600]
    assert await players.stake(PLAYER, "d", REGULATORY, exp, days(0), 700) == [0, 600]
    assert spent(redis_db, day_of(now)) == 400
    assert redis_db.pexpiretime(budget_key(PLAYER, day_of(now))) == exp


async def test_set_limit_and_player(players: PlayerStore, redis_db: redis.Redis,
                                    now: int) -> None:
    """A self-limit lowers at once, raises or goes tomorrow; player reports it; takes obey it.
    Each change is set at the caller's instant, or just after the change before (here all
    at one instant): its instant, answered, follows the order of the changes."""
    today, exp = day_of(now), now + 30 * DAY
    tomorrow = tomorrow_of(today)
    t = tomorrow.encode()

    async def set_limit(value: int | None) -> list[Any]:
        reply: list[Any] = await players.set_limit(PLAYER, value, today, tomorrow, exp, now)
        assert redis_db.hget(limit_key(PLAYER), "at") == b"%d" % reply[-1]
        return reply

    assert await players.state(PLAYER, today) == [b"none", b"", b"", 0]
    assert await set_limit(500) == [b"500", b"", b"", 0, now]
    assert redis_db.pexpiretime(limit_key(PLAYER)) == exp
    assert await players.reserve(PLAYER, "s", REGULATORY, now + DAY, [(today, 200)]) == [
        1, 300]
    assert await set_limit(800) == [b"500", b"800", t, 200, now + 1]
    assert await players.state(PLAYER, today) == [b"500", b"800", t, 200]
    assert await players.state(PLAYER, tomorrow) == [b"800", b"", b"", 0]
    assert await players.reserve(PLAYER, "s2", REGULATORY, now + DAY, [(today, 400)]) == [
        0, 300]
    assert await set_limit(300) == [b"300", b"", b"", 200, now + 2]
    assert await set_limit(None) == [b"300", b"none", t, 200, now + 3]
    assert await players.state(PLAYER, today) == [b"300", b"none", t, 200]
    assert await players.state(PLAYER, tomorrow) == [b"none", b"", b"", 0]
    assert await players.reserve(PLAYER, "s3", REGULATORY, now + DAY, [(today, 101)]) == [
        0, 100]
    assert await players.reserve(PLAYER, "s4", REGULATORY, now + DAY, [(tomorrow, 1000)]) == [
        1, 0]
    assert await set_limit(2000) == [b"300", b"2000", t, 200, now + 4]
    assert await players.reserve(PLAYER, "s5", REGULATORY, now + DAY,
                                 [(tomorrow_of(tomorrow), 1001)]) == [0, 1000]


# -- library -------------------------------------------------------------------------------


async def test_library_reloaded_after_function_flush(store: Store, combos: Combos,
                                                     redis_db: redis.Redis) -> None:
    """After FUNCTION FLUSH, calls reload the library (on each primary) and succeed."""
    redis_db.function_flush()
    assert not await store.library_loaded()
    for n in range(1, 31):  # combinations spread over every primary of a cluster
        assert await combos.reserve(new_sale(), 500, combo=encode([n])) == [1, 0]
    assert await store.library_loaded()


async def test_calls_that_find_the_library_gone_load_it_once(
        store: Store, combos: Combos, redis_db: redis.Redis,
        redis_backend: RedisServer | RedisCluster) -> None:
    """Calls in flight together when the library is gone: each is sent again after one
    FUNCTION LOAD a connection, not a load each (a load compiles the whole library: one a
    call kept a node busy past the timeout, and sales after a FUNCTION FLUSH got 503)."""
    for n in range(1, 31):  # a connection to every primary of a cluster
        assert await combos.reserve(new_sale(), 500, combo=encode([n])) == [1, 0]
    redis_db.function_flush()
    primaries = redis_backend.servers if isinstance(redis_backend, RedisCluster) else [
        redis_backend]
    clients = [p.client() for p in primaries]
    for c in clients:
        c.config_resetstat()
    assert await asyncio.gather(*[combos.reserve(new_sale(), 500, combo=encode([n]))
                                  for n in range(1, 31)]) == [[1, 0]] * 30
    loads = [c.info("commandstats").get("cmdstat_function|load", {}).get("calls", 0)
             for c in clients]
    assert loads == [1] * len(primaries)
    for c in clients:
        c.close()


async def test_a_first_load_is_not_a_loss(redis_backend: RedisServer | RedisCluster,
                                         redis_db: redis.Redis, now: int,
                                         caplog: pytest.LogCaptureFixture) -> None:
    """A Redis that never had the library (a first start): the first calls load it with
    an INFO line, no warning. Once it answered, its loss (FUNCTION FLUSH) is a warning."""
    redis_db.function_flush()
    caplog.set_level(logging.INFO, logger="capsvc.redis.transport")
    coalescer = connect(redis_backend.url, timeout_s=2, library=lua_source())
    combos = Combos(Store(coalescer), redis_db, now)

    def said(level: int) -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name == "capsvc.redis.transport" and r.levelno == level]

    try:
        for n in range(1, 31):  # combinations spread over every primary of a cluster
            assert await combos.reserve(new_sale(), 500, combo=encode([n])) == [1, 0]
        assert said(logging.WARNING) == []
        assert any(m.endswith("has no Lua library yet: loading it") for m in said(logging.INFO))
        caplog.clear()
        redis_db.function_flush()
        assert await combos.reserve(new_sale(), 500, combo=encode([1])) == [1, 0]
        assert said(logging.WARNING) == ["redis lost the Lua library: reloading it"]
    finally:
        await coalescer.aclose()


async def test_a_final_settle_seals_the_ref(store: Store, redis_db: redis.Redis,
                                            now: int) -> None:
    """Giving everything back (final) leaves X: a late settle of the same ref (a duplicate
    request's, delayed past a cancel) charges nothing again."""
    players = RawPlayers(store)
    d1 = "2026-03-01"
    assert (await players.reserve(PLAYER, "t", REGULATORY, now + DAY, [(d1, 400)]))[0] == 1
    assert await players.settle(PLAYER, "t", [(d1, 0)], final=True) == 400
    assert redis_db.hget(budget_key(PLAYER, d1), "t") == b"X"
    assert await players.settle(PLAYER, "t", [(d1, 250)]) == 0
    assert redis_db.hget(budget_key(PLAYER, d1), "spent") == b"0"
    assert (await players.reserve(PLAYER, "t", REGULATORY, now + DAY, [(d1, 400)]))[0] == -2


# -- sell: the whole sale in one call (standalone Redis) --------------------------------------

@pytest.fixture
async def one_node(redis_server: RedisServer, standalone_db: redis.Redis
                   ) -> AsyncIterator[Store]:
    async for s in store_on(redis_server.url):
        yield s


async def test_sell_counts_decides_and_replays_in_one_call(
        one_node: Store, standalone_db: redis.Redis) -> None:
    """One call claims, counts every capped grid on every draw (all or nothing per grid),
    marks what reached the cap as sold out, and writes the ticket decided with its results;
    the same call again answers them; another body is a conflict; nothing is pending."""
    db, now = standalone_db, redis_ms(standalone_db)
    records = TicketRecords(db)
    close, expire = now + HOUR, now + DAY
    key = ticket_key("ch", secrets.token_hex(4))
    db.hset(bucket_keys(GAME, COMBO, FIRST + 1, 1)[0], COMBO, CAP - 200)
    # "\0" "4": four numbers, not capped; HASH starts with 35, "#": capped all the same.
    grids = [(COMBO, 300), ("\0" "4", 500), (OTHER, CAP), (HASH, 200)]

    def sell() -> Any:
        return sell_alone(one_node, key, b"{}", close, expire, 60_000, GAME,
                          FIRST, 2, CAP, MIN, grids, [expire, expire], "Europe/Paris")

    new = await sell()
    assert isinstance(new, Sold), new
    at, sid, results = new.at, new.sale_id, new.results.decode()
    # The sale's time zone, then: draw FIRST+1 had 200 left; OTHER filled both draws.
    assert results == "Europe/Paris|0:1:200;-;1;1"
    assert [new.near_cap, new.sold_out] == [2, 2]  # OTHER crossed 80 % and its cap, twice
    assert db.hget(bucket_keys(GAME, COMBO, FIRST, 1)[0], COMBO) is None  # all or nothing
    for draw in (FIRST, FIRST + 1):
        assert db.hget(bucket_keys(GAME, OTHER, draw, 1)[0], OTHER) == str(CAP).encode()
        assert db.hget(bucket_keys(GAME, HASH, draw, 1)[0], HASH) == b"200"
        assert db.smembers(f"x:{{{GAME}}}:{draw}") == {OTHER.encode()}
        assert db.pttl(f"x:{{{GAME}}}:{draw}") > 0
    last = bucket_keys(GAME, OTHER, FIRST + 1, 1)[0]
    assert db.hget(last, record_field(sid, 2)) == str(CAP).encode()
    assert db.hget(bucket_keys(GAME, COMBO, FIRST + 1, 1)[0], record_field(sid, 0)) == b"R1:200"
    assert records.get(key, "st") == b"f"
    assert records.expiry(key) == expire
    for draw in (FIRST, FIRST + 1):  # what the sale accepted of the sizes not capped
        aggregate = aggregate_key(key, GAME, draw)
        assert db.hgetall(aggregate) == {b"4": b"500"}  # the capped sizes: in the counters
        assert db.pexpiretime(aggregate) == expire
    # The feed has OTHER capped on both draws, in the same call.
    events = db.xrange(f"f:{{{GAME}}}")
    assert [(e[b"type"], e[b"draw"], e[b"combo"]) for _, e in events] == [
        (b"capped", str(d).encode(), OTHER.encode()) for d in (FIRST, FIRST + 1)]
    assert db.pttl(f"f:{{{GAME}}}") > 0
    again = await sell()
    assert isinstance(again, Decided), again
    assert again.body is None
    assert [again.at, again.sale_id, (again.results or b"").decode()] == [at, sid, results]
    assert again.sale == b"{}"  # the caller compares its request with the sale held
    # In its call's entry of the unjournaled sales until the caller journals the decision
    # (the janitor does it otherwise); no pending-index entry.
    [(_, entry_at, sold)] = await one_node.unjournaled()
    assert (entry_at, sold) == (at, [(key, sid)])
    assert db.zscore(pending_key_of(key), key) is None


async def test_sell_keys_the_grid_records_by_the_sale_ids_bytes(
        one_node: Store, standalone_db: redis.Redis) -> None:
    """The caller sends the sale id's 8 bytes after its hex (decoding the hex in Lua was an
    eighth of the call): a grid's record is the field `record_field(sid)` that a reserve, a
    release and a cancel look for."""
    db, now = standalone_db, redis_ms(standalone_db)
    key = ticket_key("ch", secrets.token_hex(4))
    new = await sell_alone(one_node, key, b"{}", now + HOUR, now + DAY, 60_000, GAME, FIRST,
                              1, CAP, MIN, [(OTHER, 300), (COMBO, 200)], [now + DAY], "UTC")
    assert isinstance(new, Sold), new
    sid = new.sale_id
    assert db.hget(bucket_keys(GAME, OTHER, FIRST, 1)[0], record_field(sid, 0)) == b"300"
    assert db.hget(bucket_keys(GAME, COMBO, FIRST, 1)[0], record_field(sid, 1)) == b"200"
    # A cancel's release finds that record, and gives the stake back once.
    released = await one_node.release(GAME, COMBO, record_field(sid, 1), CAP, MIN, FIRST, 1,
                                      now + DAY)
    assert released.stake == 200
    again = await one_node.release(GAME, COMBO, record_field(sid, 1), CAP, MIN, FIRST, 1,
                                   now + DAY)
    assert again.stake == 0


async def test_sell_writes_nothing_when_closed_or_stopped(
        one_node: Store, standalone_db: redis.Redis) -> None:
    """Past the close, or with a draw of the ticket stopped by an admin, the call answers so
    and writes nothing at all."""
    db, now = standalone_db, redis_ms(standalone_db)
    key = ticket_key("ch", secrets.token_hex(4))
    before = set(db.scan_iter())
    closed = await sell_alone(one_node, key, b"{}", now - 1, now + DAY, 60_000, GAME, FIRST,
                                 1, CAP, MIN, [(COMBO, 100)], [now + DAY], "UTC")
    assert closed == Refused("closed")
    await one_node.stop(GAME, FIRST + 1, now + DAY)
    before = set(db.scan_iter())
    stopped = await sell_alone(one_node, key, b"{}", now + HOUR, now + DAY, 60_000, GAME,
                                  FIRST, 2, CAP, MIN, [(COMBO, 100)], [now + DAY, now + DAY],
                                  "UTC")
    assert stopped == StoppedAt(1)
    assert set(db.scan_iter()) == before


async def test_aggregates_hold_each_sale_once_and_sum_by_size(
        store: Store, redis_db: redis.Redis, now: int, records: TicketRecords) -> None:
    """A sale's share of a draw is written whole (written again: no change), removed whole,
    and the sum adds the sales up by number of picks; one key per call. A share is written
    only while the ticket holds that sale, not cancelled: a duplicate request still running
    after a cancel does not put the stake back."""
    key = ticket_key("ch", "T-1")
    slot = key[key.index("{") + 1: key.index("}")]
    other = next(k for k in (ticket_key("ch", f"T-1-{i}") for i in range(100_000))
                 if k[k.index("{") + 1: k.index("}")] == slot)  # the same aggregate
    a, b = new_sale(), new_sale()
    records.put(key, now + DAY, st="p", at=now, sid=a, sale=b"sale")
    records.put(other, now + DAY, st="p", at=now, sid=b, sale=b"sale")
    assert await store.aggregate(key, GAME, FIRST, a, "3:200,8:500", now + DAY) == 1
    assert await store.aggregate(key, GAME, FIRST, a, "3:200,8:500", now + DAY) == 1  # again
    assert await store.aggregate(other, GAME, FIRST, b, "8:1000", now + HOUR) == 1
    assert await store.aggregate(key, GAME, FIRST, b, "8:9999", now + DAY) == 0  # not its sale
    aggregate = aggregate_key(key, GAME, FIRST)
    assert aggregate == f"a:{{{slot}}}:{GAME}:{FIRST}"
    assert redis_db.pexpiretime(aggregate) == now + DAY  # never shortened
    sums = await store.fcall("capsvc_aggregate_sum", [aggregate], [])
    assert dict(zip(sums[::2], sums[1::2], strict=True)) == {b"3": 200, b"8": 1500}
    await store.aggregate(key, GAME, FIRST, a, "", 0)  # given back or cancelled
    await store.aggregate(key, GAME, FIRST, a, "", 0)
    sums = await store.fcall("capsvc_aggregate_sum", [aggregate], [])
    assert dict(zip(sums[::2], sums[1::2], strict=True)) == {b"8": 1000}
    records.put(key, now + DAY, st="c", at=now, sid=a, sale=b"sale")
    assert await store.aggregate(key, GAME, FIRST, a, "3:200,8:500", now + DAY) == 0
    sums = await store.fcall("capsvc_aggregate_sum", [aggregate], [])
    assert dict(zip(sums[::2], sums[1::2], strict=True)) == {b"8": 1000}
    redis_db.hincrby(aggregate, "3", 250)  # a total, as a sale in one call adds it
    sums = await store.fcall("capsvc_aggregate_sum", [aggregate], [])
    assert dict(zip(sums[::2], sums[1::2], strict=True)) == {b"8": 1000, b"3": 250}


@pytest.mark.parametrize("map_out_of_date", [False, True])
async def test_journaled_many_lets_go_of_the_entries_still_so_in_one_call(
        store: Store, redis_db: redis.Redis, now: int, monkeypatch: pytest.MonkeyPatch,
        records: TicketRecords, map_out_of_date: bool) -> None:
    """A batch's index entries go in one call a node: those whose ticket still holds the
    decision journaled, or no longer exists; not those that moved on (a cancel decided
    since, another sale of the id). The same as `journaled` one by one, for several indexes
    at once. A cluster's node refusing a name it does not serve (this process's slot map
    out of date: "non local key", nothing removed): each index's entries on their own."""
    if isinstance(store.redis, ClusterCoalescer):
        await store.redis.nodes()  # the slot map known
    node_of = store.node_of
    keys: dict[str, list[str]] = {}
    nodes = {node_of(pending_key_of(ticket_key("ch", f"J-{i}")))
             for i in range(100)}
    for i in itertools.count():
        key = ticket_key("ch", f"J-{i}")
        keys.setdefault(pending_key_of(key), []).append(key)
        full = [v for v in keys.values() if len(v) >= 5]
        if len(full) >= 2 and (len(nodes) == 1 or len(
                {node_of(pending_key_of(v[0])) for v in full}) >= 2):
            break  # on a cluster, indexes on two nodes
    groups = [v[:5] for v in keys.values() if len(v) >= 5]
    for group in groups:
        held = [(b"f", "a1" * 8), (b"c", "b1" * 8), None, (b"f", "c1" * 8), (b"f", "e1" * 8)]
        asked = [(b"f", "a1" * 8), (b"f", "b1" * 8), (b"f", "f1" * 8), (b"f", "d1" * 8),
                 (b"f", "e1" * 8)]
        for key, h in zip(group, held, strict=True):
            redis_db.zadd(pending_key_of(key), {key: now})
            if h is not None:
                records.put(key, now + DAY, st=h[0], sid=h[1])
        for key, (state, sid) in zip(group, asked, strict=True):
            store.journaled_later(key, sid, state)
    calls: list[str] = []
    fcall = store.fcall

    def counted(name: str, keys: list[str], args: list[Any], **options: Any) -> Any:
        calls.append(name)
        return fcall(name, keys, args, **options)

    monkeypatch.setattr(store, "fcall", counted)
    if map_out_of_date and isinstance(store.redis, ClusterCoalescer):
        monkeypatch.setattr(store.redis, "by_node", lambda items, key: [list(items)])
    await asyncio.sleep(0.2)
    for group in groups:
        assert sorted(redis_db.zrange(pending_key_of(group[0]), 0, -1)) == sorted(
            [group[1].encode(), group[3].encode()])
    if store.single_node:
        assert calls == ["capsvc_journaled_many"]  # one call in all
    elif map_out_of_date:  # one refused, then one an index
        assert calls == ["capsvc_journaled_many"] * (1 + len(groups))
    else:  # one a node
        assert calls == ["capsvc_journaled_many"] * len(
            {node_of(pending_key_of(g[0])) for g in groups})

