"""The Lua functions on a real Redis: counting, atomicity, idempotency, expiry, close."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import redis

from capsvc.cluster import connect
from capsvc.store import Store, counter_keys, hold_key, lua_source, pending_key_of, ticket_key
from capsvc.testing import RedisCluster, RedisServer

GAME, COMBO = "g", "01020304050607080910"
CAP, MIN = 5000, 100
FUTURE = int(time.time() * 1000) + 3_600_000
EXPIRES = [FUTURE + 86_400_000 + i for i in range(3)]


@pytest.fixture
async def store(redis_backend: RedisServer | RedisCluster, redis_db: redis.Redis
                ) -> AsyncIterator[Store]:
    coalescer = connect(redis_backend.url, timeout_s=2, library=lua_source())
    s = Store(coalescer)
    await s.load_library()
    yield s
    await coalescer.aclose()


def reserve(store: Store, who: str, stake: int, draws: int = 1, close: int = FUTURE,
            first: int = 100) -> object:
    return store.reserve(GAME, COMBO, who, stake, CAP, MIN, first, EXPIRES[:draws], close)


def counters(db: redis.Redis, draws: int = 3, first: int = 100) -> list[int]:
    return [int(v or 0) for v in db.mget(counter_keys(GAME, COMBO, first, draws))]


async def test_check_and_increment(store: Store, redis_db: redis.Redis) -> None:
    """A stake that fits is counted; one that would pass the cap is refused with the room."""
    assert await reserve(store, "a", 3000) == [1, 0]
    assert await reserve(store, "b", 2000) == [1, 1, 0]  # past 80 %, and sold out on draw 0
    assert await reserve(store, "c", 100) == [0, 0, 0]
    assert counters(redis_db, 1) == [5000]


async def test_near_cap_counts_the_crossing_only(store: Store) -> None:
    """`near` counts a counter when this sale brings it to 80 % of the cap, not after."""
    assert await reserve(store, "a", 3900) == [1, 0]
    assert await reserve(store, "b", 100, draws=2) == [1, 1]  # 4000 on draw 0 only
    assert await reserve(store, "c", 100) == [1, 0]


async def test_all_or_nothing_across_draws(store: Store, redis_db: redis.Redis) -> None:
    """One full draw rejects the grid on every draw and counts nothing anywhere."""
    assert await reserve(store, "full", 5000, first=101) == [1, 1, 0]
    reply = await reserve(store, "sub", 500, draws=3)
    assert reply == [0, 1, 0]
    assert counters(redis_db) == [0, 5000, 0]


async def test_rerun_is_idempotent(store: Store, redis_db: redis.Redis) -> None:
    """The same holder re-run returns the recorded outcome and counts once."""
    assert await reserve(store, "a", 500, draws=3) == [1, 0]
    assert await reserve(store, "a", 500, draws=3) == [1, 0]
    assert counters(redis_db) == [500, 500, 500]
    await reserve(store, "full", 4400, first=100)
    assert await reserve(store, "r", 500) == [0, 0, 100]
    await store.release(GAME, COMBO, "full", CAP, MIN, 100, 1)
    assert await reserve(store, "r", 500) == [0, 0, 100]  # a rejection is remembered
    assert counters(redis_db, 1) == [500]


async def test_release_once(store: Store, redis_db: redis.Redis) -> None:
    """Release gives back exactly the recorded stake, once."""
    await reserve(store, "a", 500, draws=3)
    await reserve(store, "b", 300, draws=3)
    assert (await store.release(GAME, COMBO, "a", CAP, MIN, 100, 3))[0] == 500
    assert await store.release(GAME, COMBO, "a", CAP, MIN, 100, 3) == [0]
    assert counters(redis_db) == [300, 300, 300]
    assert await store.release(GAME, COMBO, "never", CAP, MIN, 100, 3) == [0]


async def test_release_reports_draws_leaving_sold_out(store: Store) -> None:
    """Releasing from a sold-out counter reports the draw that has room again."""
    assert await reserve(store, "a", 4900) == [1, 1]
    assert await reserve(store, "b", 100) == [1, 0, 0]
    assert await store.release(GAME, COMBO, "b", CAP, MIN, 100, 1) == [100, 0]


async def test_ttl_set_on_creation(store: Store, redis_db: redis.Redis) -> None:
    """Counters expire at their draw's close + retention; holds at the last of them."""
    await reserve(store, "a", 500, draws=3)
    keys = counter_keys(GAME, COMBO, 100, 3)
    assert [redis_db.pexpiretime(k) for k in keys] == EXPIRES
    assert redis_db.pexpiretime(hold_key(GAME, COMBO)) == EXPIRES[2]
    await reserve(store, "b", 500, draws=1)
    assert redis_db.pexpiretime(keys[0]) == EXPIRES[0]
    assert redis_db.pexpiretime(hold_key(GAME, COMBO)) == EXPIRES[2]


async def test_closed_draw_counts_nothing(store: Store, redis_db: redis.Redis) -> None:
    """Past the close instant (Redis TIME), nothing is counted; recorded outcomes still read."""
    past = int(time.time() * 1000) - 1000
    assert await reserve(store, "a", 500, close=past) == [-1]
    assert redis_db.dbsize() == 0
    await reserve(store, "b", 500)
    assert await reserve(store, "b", 500, close=0) == [1, 0]
    assert await reserve(store, "c", 500, close=0) == [-1]


async def test_claim_lifecycle(store: Store, redis_db: redis.Redis) -> None:
    """new → pending (same body) / conflict (other body) → final after finalize."""
    key = ticket_key("ch", "T-1")
    expire_at = FUTURE + 1000
    new = await store.claim(key, GAME, 100, 1, "fp1", b"sale", FUTURE, expire_at, 60_000)
    assert new[0] == b"new"
    at = int(new[1])
    assert await store.claim(key, GAME, 100, 1, "fp1", b"sale", FUTURE, expire_at, 60_000) == [
        b"pending", at, b"sale", 0]
    conflict = await store.claim(key, GAME, 100, 1, "fp2", b"x", FUTURE, expire_at, 60_000)
    assert conflict == [b"conflict"]
    assert redis_db.zscore(pending_key_of(key), key) == at
    assert redis_db.pexpiretime(key) == expire_at
    assert redis_db.pexpiretime(pending_key_of(key)) == expire_at
    assert await store.finalize(key, at + 1, b"body") == 0
    assert await store.finalize(key, at, b"body") == 1
    assert await store.claim(key, GAME, 100, 1, "fp1", b"sale", FUTURE, expire_at, 60_000) == [
        b"final", b"body"]
    assert redis_db.zscore(pending_key_of(key), key) is None


async def test_claim_refuses_closed_draw_and_stale_pending(store: Store,
                                                           redis_db: redis.Redis) -> None:
    """No claim once the first draw closed; a pending claim past stale_after is not resumed."""
    past = int(time.time() * 1000) - 1
    key = ticket_key("ch", "T-2")
    assert await store.claim(key, GAME, 100, 1, "fp", b"s", past, FUTURE, 60_000) == [b"closed", -1]
    assert redis_db.exists(key) == 0
    assert (await store.claim(key, GAME, 100, 1, "fp", b"s", FUTURE, FUTURE, 60_000))[0] == b"new"
    assert await store.claim(key, GAME, 100, 1, "fp", b"s", FUTURE, FUTURE, 0) == [b"stale"]


async def test_claim_checks_admin_stops(store: Store, redis_db: redis.Redis) -> None:
    """A stopped draw of the ticket refuses a new claim (with its offset); a pending ticket
    is told it may only read."""
    key = ticket_key("ch", "T-5")
    at = int((await store.claim(key, GAME, 100, 3, "fp", b"s", FUTURE, FUTURE, 60_000))[1])
    await store.stop(GAME, 102, 1, FUTURE)
    assert await store.claim(key, GAME, 100, 3, "fp", b"s", FUTURE, FUTURE, 60_000) == [
        b"pending", at, b"s", 1]
    other = ticket_key("ch", "T-6")
    assert await store.claim(other, GAME, 100, 3, "fp", b"s", FUTURE, FUTURE, 60_000) == [
        b"closed", 2]
    assert redis_db.exists(other) == 0
    assert redis_db.pexpiretime(f"s:{{{GAME}}}:102") == FUTURE


async def test_expire_and_unclaim(store: Store, redis_db: redis.Redis) -> None:
    """The janitor's expire marks an old pending ticket; unclaim forgets it and its index."""
    key = ticket_key("ch", "T-3")
    at = int((await store.claim(key, GAME, 100, 1, "fp", b"s", FUTURE, FUTURE, 60_000))[1])
    assert await store.expire(key, at) == []  # not older than the cutoff
    assert await store.expire(key, at + 1) == [b"x", str(at).encode(), b"s"]
    assert await store.claim(key, GAME, 100, 1, "fp", b"s", FUTURE, FUTURE, 60_000) == [b"stale"]
    await store.unclaim(key, at)
    assert redis_db.exists(key) == 0
    assert redis_db.zcard(pending_key_of(key)) == 0


async def test_cancel_function(store: Store, redis_db: redis.Redis) -> None:
    """cancel: only a final ticket, only before the close; a replay returns the same."""
    key = ticket_key("ch", "T-4")
    assert await store.cancel(key, FUTURE, 10) == [b"missing"]
    at = int((await store.claim(key, GAME, 100, 1, "fp", b"s", FUTURE, FUTURE, 60_000))[1])
    assert await store.cancel(key, FUTURE, 10) == [b"undecided"]
    await store.finalize(key, at, b"body")
    assert await store.cancel(key, int(time.time() * 1000) - 1, 10) == [b"closed"]
    assert await store.cancel(key, FUTURE, 10) == [b"ok", 10]
    assert await store.cancel(key, 0, 99) == [b"ok", 10]


async def test_library_reloaded_after_function_flush(store: Store,
                                                     redis_db: redis.Redis) -> None:
    """If Redis lost the library (FUNCTION FLUSH), calls reload it and succeed (on a
    cluster, each primary as soon as a call reaches it)."""
    redis_db.function_flush()
    assert not await store.library_loaded()
    for combo in range(30):  # combinations spread over every primary of a cluster
        reply = await store.reserve(GAME, f"{combo:02d}", "a", 500, CAP, MIN, 100,
                                    EXPIRES[:1], FUTURE)
        assert reply == [1, 0]
    assert await store.library_loaded()
