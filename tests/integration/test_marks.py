"""The marks (lua/capsvc.lua, MARKS; capsvc/redis/marks.py) on a real Redis: every call that judges
or reports a decision counts itself in its node's (or slot's) mark and is refused, running
nothing, when the mark is behind what the caller saw; a restore announced refuses every
marked call; and a journal record is stamped with the count Redis gave its calls, so that
what a Redis that went back in time lacks is exactly the records stamped above it, whatever
order the calls reached Redis in (pipelines, a connection left for another, a delayed one).
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_py
from redis.crc import key_slot

from capsvc.domain.errors import Unavailable
from capsvc.journal.lives import lacking, lives_of, made_by
from capsvc.journal.recorder import Recorder
from capsvc.journal.writer import alive, open_journal
from capsvc.recovery.reconciler import Reconciler
from capsvc.redis.cluster import ClusterCoalescer, connect
from capsvc.redis.marks import NODE_MARK, Behind, Marks, Unsettled, mark_of_slot, stamp
from capsvc.redis.replies import Claimed, Pending
from capsvc.redis.store import Store, lua_source, record_bucket_of, ticket_key
from tests.conftest import Client, ticket
from tests.support.faults import FaultProxy, command
from tests.support.servers import RedisCluster, RedisServer
from tests.unit.test_journal import decision, sale

DAY = 86_400_000


class Recorded:
    """A store whose marks report what Redis refused."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.behind: list[tuple[str, str]] = []
        store.marks = Marks("life-a", single_node=store.single_node, node_of=store.node_of,
                            on_behind=lambda mark, found: self.behind.append((mark, found)))

    @property
    def marks(self) -> Marks:
        return self.store.marks


async def opened(url: str) -> Store:
    store = Store(connect(url, timeout_s=2.0, library=lua_source()))
    await store.load_library()
    return store


@pytest.fixture
async def recorded(redis_backend: RedisServer | RedisCluster, redis_db: Any
                   ) -> AsyncIterator[Recorded]:
    store = await opened(redis_backend.url)
    yield Recorded(store)
    await store.redis.aclose()


def mark_of(store: Store, key: str) -> str:
    return NODE_MARK if store.single_node else mark_of_slot(key_slot(key.encode()))


def neighbour(ticket_id: str, n: int = 1) -> str:
    """Another ticket id whose record sits in the same slot as `ticket_id`'s."""
    slot = key_slot(ticket_key("fr", ticket_id).encode())
    found = [f"{ticket_id}-{i}" for i in range(10_000)
             if key_slot(ticket_key("fr", f"{ticket_id}-{i}").encode()) == slot]
    return found[n - 1]


async def claim(store: Store, ticket_id: str) -> Any:
    now = await store.time_ms()
    return await store.claim(ticket_key("fr", ticket_id), b"sale", now + DAY,
                             now + DAY, 60_000)


async def test_a_call_counts_itself_in_the_mark_of_its_node_or_slot(
        recorded: Recorded, redis_db: Any) -> None:
    """Two claims: the mark (in the ticket's slot on a cluster) counts 2, the caller's
    field holds 2, and the process has seen and made 2 there."""
    key = ticket_key("fr", "A-1")
    await claim(recorded.store, "A-1")
    await recorded.store.ticket(key)
    mark = mark_of(recorded.store, key)
    assert redis_db.hgetall(mark) == {b"*": b"2", b"life-a": b"2", b"#life-a": b"2"}
    assert recorded.marks.seen == {mark: 2}
    assert recorded.marks.made == {mark: 2}
    assert redis_db.pttl(mark) > 0


async def test_a_redis_behind_what_the_process_saw_refuses_and_runs_nothing(
        recorded: Recorded, redis_db: Any) -> None:
    """The mark's G lowered (another process's writes lost): the next claim is refused
    with Behind, the restore is asked for, and no ticket is claimed."""
    await claim(recorded.store, "A-1")
    mark = mark_of(recorded.store, ticket_key("fr", "A-1"))
    redis_db.hset(mark, mapping={"*": 0, "life-a": 1})
    recorded.marks.seen[mark] = 5  # the process saw more of it (its watch, others' writes)
    with pytest.raises(Behind):
        await claim(recorded.store, neighbour("A-1"))
    assert recorded.behind == [(mark, "0:1:1")]
    assert redis_db.hget(mark, "*") == b"0"
    redis_db.hset(mark, "*", 5)  # put back as the process saw it: the claim runs now
    assert isinstance(await claim(recorded.store, neighbour("A-1")), Claimed)  # it had not run


async def test_its_own_writes_lost_are_seen_though_others_wrote_since(
        recorded: Recorded, redis_db: Any) -> None:
    """The caller's own field behind its newest write, G ahead (others kept writing after
    a rollback): refused all the same."""
    await claim(recorded.store, "A-1")
    mark = mark_of(recorded.store, ticket_key("fr", "A-1"))
    redis_db.hset(mark, mapping={"*": 100, "life-a": 0})
    with pytest.raises(Behind):
        await claim(recorded.store, neighbour("A-1"))
    assert recorded.behind == [(mark, "100:0:1")]


async def test_an_emptied_redis_refuses_the_next_call(recorded: Recorded, redis_db: Any
                                                      ) -> None:
    """FLUSHALL: the mark is gone with the data; the process's next call is refused (no
    sale is judged on an emptied Redis), though the call's own keys would be new."""
    await claim(recorded.store, "A-1")
    redis_db.flushall()
    with pytest.raises(Behind):
        await claim(recorded.store, neighbour("A-1"))
    assert redis_db.keys("*") == []


async def test_an_announced_restore_refuses_every_marked_call_until_it_ends(
        recorded: Recorded, redis_db: Any) -> None:
    """Another process announces a restore: calls are refused (Unavailable, not Behind: this
    process lost nothing) until the announcement's end, then go through."""
    store = recorded.store
    mark = mark_of(store, ticket_key("fr", "A-1"))
    await store.mark_call("capsvc_announce", mark, [400, "other"])
    with pytest.raises(Unavailable) as refused:
        await claim(store, "A-1")
    assert not isinstance(refused.value, Behind)
    assert recorded.behind == []
    await asyncio.sleep(0.45)
    assert isinstance(await claim(store, "A-1"), Claimed)


async def test_a_restore_that_is_done_ends_its_own_announcement_at_once(
        recorded: Recorded, redis_db: Any) -> None:
    """Two restores announced: the one that is done ends its own at once (the other's
    still refuses every call until it ends too); then calls go through at once, not once
    the last renewal has run out."""
    store = recorded.store
    mark = mark_of(store, ticket_key("fr", "A-1"))
    await store.mark_call("capsvc_announce", mark, [60_000, "a", "tok-a"])
    held = await store.mark_call("capsvc_announce", mark, [30_000, "b", "tok-b"])
    assert held == int(redis_db.hget(mark, "!a"))  # the latest of the two: a's
    assert await store.mark_call("capsvc_announce_end", mark, ["a"]) == int(
        redis_db.hget(mark, "!b"))
    with pytest.raises(Unavailable):
        await claim(store, "A-1")
    assert await store.mark_call("capsvc_announce_end", mark, ["b"]) == 0
    assert not {b"!", b"!a", b"!b"} & set(redis_db.hkeys(mark))
    assert isinstance(await claim(store, "A-1"), Claimed)


async def test_an_announcement_nobody_owns_is_left_to_end_by_itself(
        recorded: Recorded, redis_db: Any) -> None:
    """A restorer's end never shortens an announcement later than its own that no
    restorer's field reaches (written as a test writes it): it holds to its end."""
    store = recorded.store
    mark = mark_of(store, ticket_key("fr", "A-1"))
    await store.mark_call("capsvc_announce", mark, [500, "a", "tok-a"])
    later = int(redis_db.hget(mark, "!")) + 60_000
    redis_db.hset(mark, "!", later)
    assert await store.mark_call("capsvc_announce_end", mark, ["a"]) == later
    with pytest.raises(Unavailable):
        await claim(store, "A-1")


async def test_a_tools_call_is_neither_checked_nor_counted(
        redis_backend: RedisServer | RedisCluster, redis_db: Any) -> None:
    """A store with a tool's marks (a restore, an audit): its calls go through whatever the
    mark says and leave it as it was."""
    store = await opened(redis_backend.url)
    try:
        mark = mark_of(store, ticket_key("fr", "A-1"))
        redis_db.hset(mark, mapping={"*": 7, "!": 2**60})
        assert isinstance(await claim(store, "A-1"), Claimed)
        assert redis_db.hgetall(mark) == {b"*": b"7", b"!": str(2**60).encode()}
    finally:
        await store.redis.aclose()


async def test_mark_restored_raises_fields_and_g_and_never_lowers_them(
        recorded: Recorded, redis_db: Any) -> None:
    """capsvc_mark_restored: each lifetime's field and G raised to what it had written, the
    restore's token taken away."""
    store = recorded.store
    mark = mark_of(store, ticket_key("fr", "A-1"))
    redis_db.hset(mark, mapping={"*": 10, "a": 3, "b": 9})
    await store.mark_call("capsvc_announce", mark, [50, "r", "tok"])
    g = await store.mark_call("capsvc_mark_restored", mark,
                              ["r", "tok", "%tok", 0, "a", 12, "b", 5])
    assert g == 12
    fields = redis_db.hgetall(mark)
    fields.pop(b"!")
    fields.pop(b"!r")
    assert fields == {b"*": b"12", b"a": b"12", b"b": b"9"}


async def test_mark_restored_refuses_once_redis_lost_the_restores_token(
        recorded: Recorded, redis_db: Any) -> None:
    """Redis went back in time (or was emptied) while a restore ran: its token is gone, and
    capsvc_mark_restored refuses (LOST) and writes nothing; a renewal of the announcement
    does not put the token back."""
    store = recorded.store
    mark = mark_of(store, ticket_key("fr", "A-1"))
    await store.mark_call("capsvc_announce", mark, [500, "r", "tok"])
    redis_db.delete(mark)  # what a FLUSHALL or a reload to an older file does to it
    await store.mark_call("capsvc_announce", mark, [500, "r"])
    with pytest.raises(redis_py.ResponseError, match="LOST"):
        await store.mark_call("capsvc_mark_restored", mark, ["r", "tok", "%tok", 0, "a", 12])
    assert redis_db.hget(mark, "a") is None
    assert redis_db.hget(mark, "*") is None


async def test_mark_restored_refuses_once_redis_lost_some_of_the_restores_writes(
        recorded: Recorded, redis_db: Any) -> None:
    """Redis went back to a snapshot taken while a restore ran: the token is there, but not
    every write the restore made through the mark (each counted itself): LOST, nothing
    written; with them all there, the count is taken away with the token."""
    store = recorded.store
    mark = mark_of(store, ticket_key("fr", "A-1"))
    await store.mark_call("capsvc_announce", mark, [500, "r", "tok"])
    redis_db.hset(mark, "%tok", 3)  # what three of the restore's writes left
    with pytest.raises(redis_py.ResponseError, match="LOST"):
        await store.mark_call("capsvc_mark_restored", mark, ["r", "tok", "%tok", 4, "a", 12])
    assert redis_db.hget(mark, "a") is None
    # A mark the restore wrote through without announcing there: its count alone.
    with pytest.raises(redis_py.ResponseError, match="LOST"):
        await store.mark_call("capsvc_mark_restored", mark, ["r", "", "%tok", 4])
    assert await store.mark_call("capsvc_mark_restored", mark,
                                 ["r", "tok", "%tok", 3, "a", 12]) == 12
    assert not {b"%tok", b"^r"} & set(redis_db.hkeys(mark))


# -- which records a Redis that went back in time lacks ---------------------------------------


@pytest.fixture
def debug_redis() -> Any:
    """A redis-server of the test's own that takes DEBUG RELOAD."""
    server = RedisServer(extra=("--enable-debug-command", "yes")).start()
    yield server
    server.stop()


async def test_a_call_never_runs_ahead_of_an_earlier_write_still_in_flight(
        debug_redis: RedisServer, tmp_path: Path) -> None:
    """One process, two connections (a call held on the first, as on a connection that
    stalls): B, sent while A is still on its way, is refused and runs nothing — Redis holds
    fewer of the process's writes than it had sent — and is sent again while A is held, then
    fails (Unsettled: nothing ran), no loss read, no restore asked; so the process's writes
    run, and are stamped, in the order it sent them. Once A has run, B runs; Redis then
    saved between them and went back to that save: what the journal lacks is B's record
    exactly."""
    release = threading.Event()
    with FaultProxy("127.0.0.1", debug_redis.port) as proxy:
        slow = await opened(proxy.url)
        fast = await opened(debug_redis.url)
        journal = open_journal(tmp_path, max_file_bytes=1 << 20, keep_ms=DAY)
        behind: list[tuple[str, str]] = []
        fast.marks = slow.marks = Marks(journal.life, single_node=True,
                                        on_behind=lambda *lost: behind.append(lost))
        recorder = Recorder(journal, lambda: 1)
        proxy.hold_request(command("FCALL", "capsvc_claim"), release)
        db = redis_py.Redis(port=debug_redis.port)

        async def sell(store: Store, ticket_id: str) -> None:
            Marks.begin()
            assert isinstance(await claim(store, ticket_id), Claimed)  # a refused call ran nothing
            s = sale(ticket_id)
            await recorder.sale("answer", "fr", s, "0" * 16, 1, decision(s), 10**13, [5000])

        a = asyncio.get_running_loop().create_task(sell(slow, "A"))
        await asyncio.sleep(0.2)
        with pytest.raises(Unsettled):
            await claim(fast, "B")
        assert behind == []
        release.set()
        await a
        db.save()
        await sell(fast, "B")
        assert slow.marks.made == {NODE_MARK: 2}
        db.execute_command("DEBUG", "RELOAD", "NOSAVE")
        with pytest.raises(Behind):
            await claim(fast, "C")
        assert behind == [(NODE_MARK, "1:1:1")]
        await journal.aclose()
        field = int(db.hget(NODE_MARK, journal.life) or 0)
        assert field == 1
        life = lives_of(tmp_path)[journal.life]
        assert made_by(life) == {NODE_MARK: 2}
        assert [r.ticket for r in lacking(life, {NODE_MARK: field}, 0)] == ["B"]
        await slow.redis.aclose()
        await fast.redis.aclose()
        db.close()


async def test_a_call_ahead_of_an_earlier_write_runs_once_that_write_has(
        debug_redis: RedisServer) -> None:
    """B, sent on a second connection while the process's claim A is held on the first, is
    refused until A has run (Unsettled, nothing ran) and sent again meanwhile: once A is let
    through, B runs, after it. Neither is read as a loss."""
    release = threading.Event()
    with FaultProxy("127.0.0.1", debug_redis.port) as proxy:
        slow = await opened(proxy.url)
        fast = await opened(debug_redis.url)
        behind: list[tuple[str, str]] = []
        fast.marks = slow.marks = Marks("life-a", single_node=True,
                                        on_behind=lambda *lost: behind.append(lost))
        proxy.hold_request(command("FCALL", "capsvc_claim"), release)
        db = redis_py.Redis(port=debug_redis.port)
        try:
            a = asyncio.ensure_future(claim(slow, "A"))
            await asyncio.sleep(0.2)
            b = asyncio.ensure_future(claim(fast, "B"))
            await asyncio.sleep(0.2)  # refused, and sent again, while A is held
            assert not b.done()
            assert db.hget(NODE_MARK, "*") is None  # nothing of B ran
            release.set()
            assert isinstance(await a, Claimed)
            assert isinstance(await b, Claimed)
            # B's number is its last sending's: each was numbered anew
            assert db.hgetall(NODE_MARK) == {
                b"*": b"2", b"life-a": b"2", b"#life-a": str(fast.marks.sent[NODE_MARK]).encode()}
            assert slow.marks.made == {NODE_MARK: 2}
            assert behind == []
        finally:
            release.set()
            await slow.redis.aclose()
            await fast.redis.aclose()
            db.close()


async def test_a_checkpoint_bounds_what_is_read_back(tmp_path: Path) -> None:
    """Records before a checkpoint the Redis covers are not read back; after it, only those
    stamped above the Redis's field; with no field at all, every one."""
    journal = open_journal(tmp_path, max_file_bytes=1 << 20, keep_ms=DAY)
    recorder = Recorder(journal, lambda: 1)
    made: dict[str, int] = {}
    for i in range(1, 7):
        stamp.set({NODE_MARK: i})
        made[NODE_MARK] = i
        s = sale(f"T{i}")
        await recorder.sale("answer", "fr", s, "0" * 16, 1, decision(s), 10**13, [5000])
        if i == 3:
            recorder.checkpoint(made)
    await journal.aclose()
    life = lives_of(tmp_path)[journal.life]
    assert made_by(life) == {NODE_MARK: 6}
    assert [r.ticket for r in lacking(life, {NODE_MARK: 4}, 0)] == ["T5", "T6"]
    assert [r.ticket for r in lacking(life, {NODE_MARK: 2}, 0)] == [
        "T3", "T4", "T5", "T6"]
    assert [r.ticket for r in lacking(life, {}, 0)] == [f"T{i}" for i in range(1, 7)]
    assert [r.ticket for r in lacking(life, {NODE_MARK: 6}, 0)] == []
    assert [r.ticket for r in lacking(life, {NODE_MARK: 2}, 10**14)] == []  # past `until`


async def test_a_cluster_shard_behind_refuses_only_the_calls_of_its_slots(
        redis_cluster: RedisCluster) -> None:
    """On a cluster each slot has its own mark: one slot's mark behind refuses the calls of
    that slot, while a ticket in another slot is claimed."""
    redis_db = redis_cluster.client()
    redis_db.flushall()
    store = await opened(redis_cluster.url)
    try:
        rec = Recorded(store)
        by_slot: dict[int, list[str]] = {}
        i = 0
        while len(by_slot) < 2 or max(len(v) for v in by_slot.values()) < 2:
            by_slot.setdefault(key_slot(ticket_key("fr", f"S-{i}").encode()), []).append(
                f"S-{i}")
            i += 1
        slot_a = next(slot for slot, ids in by_slot.items() if len(ids) >= 2)
        a, a2 = by_slot[slot_a][:2]
        b = next(ids[0] for slot, ids in by_slot.items() if slot != slot_a)
        await claim(store, a)
        await claim(store, b)
        mark = mark_of_slot(slot_a)
        redis_db.hset(mark, "life-a", 0)
        with pytest.raises(Behind):
            await claim(store, a2)
        assert rec.behind == [(mark, "1:0:1")]
        assert isinstance(await claim(store, b), Pending)
    finally:
        await store.redis.aclose()


async def test_a_cluster_primary_behind_refuses_a_slot_the_process_never_used(
        redis_cluster: RedisCluster) -> None:
    """On a cluster each primary counts every marked call it runs: once the process has seen
    a primary's count (a call on one of its slots), that count behind refuses a call on
    another slot of the primary, which the process never used, while a ticket on another
    primary is claimed."""
    redis_db = redis_cluster.client()
    redis_db.flushall()
    store = await opened(redis_cluster.url)
    try:
        rec = Recorded(store)
        by_node: dict[str, dict[int, str]] = {}
        i = 0
        while len(by_node) < 2 or max(len(v) for v in by_node.values()) < 2:
            key = ticket_key("fr", f"N-{i}")
            node = store.node_of(key)
            assert node is not None
            by_node.setdefault(node, {}).setdefault(key_slot(key.encode()), f"N-{i}")
            i += 1
        node = next(n for n, slots in by_node.items() if len(slots) >= 2)
        used, unused = list(by_node[node].values())[:2]
        other = next(next(iter(slots.values())) for n, slots in by_node.items() if n != node)
        await claim(store, used)
        await claim(store, other)
        redis_db.hset(node, "*", 0)
        with pytest.raises(Behind):
            await claim(store, unused)
        assert rec.behind == [(node, "0")]
        assert isinstance(await claim(store, other), Pending)
    finally:
        await store.redis.aclose()



async def test_mark_keep_forgets_lifetimes_gone_for_the_marks_ttl(
        recorded: Recorded, redis_db: Any) -> None:
    """capsvc_mark_keep: the caller noted alive, the mark's TTL renewed, an announcement past
    its end removed, and a lifetime not noted alive for MARK_TTL_MS forgotten."""
    store = recorded.store
    await claim(store, "A-1")
    mark = mark_of(store, ticket_key("fr", "A-1"))
    now = await store.time_ms()
    redis_db.hset(mark, mapping={"old": 3, "@old": now - 9 * DAY, "recent": 4,
                                 "@recent": now - DAY, "!": now - 1})
    redis_db.persist(mark)
    assert await store.mark_call("capsvc_mark_keep", mark, ["life-a"]) == 1
    fields = redis_db.hgetall(mark)
    assert set(fields) == {b"*", b"life-a", b"#life-a", b"@life-a", b"recent", b"@recent"}
    assert redis_db.pttl(mark) > 7 * DAY


async def test_a_lifetime_is_alive_exactly_while_its_process_holds_its_journal(
        tmp_path: Path) -> None:
    """Another process of the directory restores only the lifetimes gone: one whose journal
    is open is alive; once closed, it is gone."""
    journal = open_journal(tmp_path, max_file_bytes=1 << 20, keep_ms=DAY)
    assert alive(tmp_path, journal.life)
    await journal.aclose()
    assert not alive(tmp_path, journal.life)


def test_a_lifetime_killed_is_gone(tmp_path: Path) -> None:
    """A process killed (SIGKILL) with its journal open: its lifetime is gone at once (the
    kernel drops its lock), and its lock file is cleared by whoever finds it so."""
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from capsvc.journal.writer import open_journal; "
        f"j = open_journal({str(tmp_path)!r}, max_file_bytes=1 << 20, keep_ms=1); "
        "print(j.life, flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    life = child.stdout.readline().strip()
    assert alive(tmp_path, life)
    child.kill()
    child.wait()
    assert not alive(tmp_path, life)
    assert not list(tmp_path.glob(".life-*"))


async def test_a_record_made_outside_a_request_is_stamped_with_all_the_process_wrote(
        tmp_path: Path) -> None:
    """A background task's record (no request's calls to go by) carries everything the
    process has written through its marks: never lower than its calls, so a restore that
    must put it back finds it above the Redis's mark."""
    journal = open_journal(tmp_path, max_file_bytes=1 << 20, keep_ms=DAY)
    recorder = Recorder(journal, lambda: 1)
    recorder.marks = Marks(journal.life, single_node=True)
    recorder.marks.made[NODE_MARK] = 41
    stamp.set(None)
    s = sale("BG")
    await recorder.sale("janitor", "fr", s, "0" * 16, 1, decision(s), 10**13, [5000])
    Marks.begin()["x"] = 3
    await recorder.sale("answer", "fr", s, "0" * 16, 1, decision(s), 10**13, [5000])
    await journal.aclose()
    life = lives_of(tmp_path)[journal.life]
    assert [r.marks for r in lacking(life, {}, 0)] == [{NODE_MARK: 41}, {"x": 3}]


async def test_the_watch_reads_every_slots_mark_in_one_call_a_node(
        recorded: Recorded, redis_backend: RedisServer | RedisCluster,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A process's watch reads the mark of every slot it wrote through: one read a node
    (`capsvc_marks_of`), not one a mark, each mark as the one-mark read gives it; a mark of
    a slot the node does not serve (a slot map out of date) fails that node's read, and its
    marks are read one by one."""
    store = recorded.store
    tickets = [f"W-{i}" for i in range(200)]
    for t in tickets:
        assert isinstance(await claim(store, t), Claimed)
    marks = sorted({mark_of(store, ticket_key("fr", t)) for t in tickets})
    lives = ["life-a", "life-b"]
    one_by_one = await asyncio.gather(*[store.mark_state(m, lives) for m in marks])
    primaries = redis_backend.servers if isinstance(redis_backend, RedisCluster) else [
        redis_backend]
    clients = [p.client() for p in primaries]
    for c in clients:
        c.config_resetstat()
    assert await store.mark_states(marks, lives) == one_by_one
    calls = [c.info("commandstats").get("cmdstat_fcall", {}).get("calls", 0)
             for c in clients]
    assert sum(calls) == len(primaries), calls
    assert all(n == 1 for n in calls)
    if isinstance(store.redis, ClusterCoalescer):  # a map out of date: one group, all marks
        monkeypatch.setattr(store.redis, "by_node", lambda keys: [list(keys)])
        assert await store.mark_states(marks, lives) == one_by_one


@pytest.mark.parametrize("redis_backend", ["cluster"], indirect=True)
async def test_a_primary_that_does_not_answer_hides_no_other_primarys_loss(
        service: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The watch reads every primary's count at once: one that cannot be read (down, timing
    out) does not keep it from judging the others — a primary behind what the process saw
    is named; with none behind, the failure is raised, and the watch looks again."""
    svc, _ = service
    store = svc.store
    on_unknown = svc.reconciler.gate.on_unknown
    # A reconciler of its own (another lifetime), not the service's: its watch is not run.
    reconciler = Reconciler(svc.settings, svc.reconciler.url, svc.reconciler.gate,
                            svc.usecases.catalog, svc.metrics,
                            Marks("life-w", single_node=False, node_of=store.node_of),
                            svc.usecases.journal)
    svc.reconciler.gate.on_unknown = on_unknown  # the service's, as it was
    down, behind, _ = await store.nodes()
    read = store.mark_state

    def mark_state(mark: str, lives: list[str]) -> asyncio.Future[Any]:
        if mark == down:
            failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            failed.set_exception(Unavailable(f"{down} does not answer"))
            return failed
        return read(mark, lives)

    monkeypatch.setattr(store, "mark_state", mark_state)
    with pytest.raises(Unavailable):  # nothing behind: no conclusion, looked at again
        await reconciler._look(store, slots=False)
    reconciler.marks.saw_node(behind, 10**12)  # this process saw it far ahead: it went back
    problem = await reconciler._look(store, slots=False)
    assert problem is not None
    assert behind in problem


@pytest.mark.parametrize("redis_backend", ["cluster"], indirect=True)
async def test_a_restore_reads_the_marks_in_one_call_a_node(
        service: Any, client: Client, redis_db: Any, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """A process that wrote through hundreds of a cluster's slots restores after one of
    them lost its writes: it reads the marks, before and after putting back what was lost,
    in one call a node, not one a mark — one round trip a mark, after a process had written
    through ~4,000 slots, held every sale ~25 s. What was lost is put back."""
    svc, _ = service
    rng = random.Random(7)
    for _ in range(5):
        tickets = [ticket([{"numbers": sorted(rng.sample(range(1, 71), 8)), "stake": 200}])
                   for _ in range(64)]
        reply = await client.post("/v1/ticket-batches", {"tickets": tickets})
        assert reply.status == 200
        assert {r["status"] for r in reply.body["results"]} == {200}
    marks = svc.store.marks
    assert len(marks.seen) > 300
    reads: list[str] = []
    one_read = Store.mark_state

    def counted(self: Store, mark: str, lives: list[str]) -> asyncio.Future[Any]:
        reads.append(mark)
        return one_read(self, mark, lives)

    monkeypatch.setattr(Store, "mark_state", counted)
    lost = max(marks.made, key=lambda mark: marks.made[mark])
    made = marks.made[lost]
    redis_db.delete(lost)  # the slot lost its writes, its mark with them
    svc.reconciler.behind(lost, "0:0:0")  # as the next call there, refused, tells it
    await asyncio.wait_for(svc.reconciler.task, 30)
    assert not svc.reconciler.gate.restoring
    assert len(reads) < 10, len(reads)
    assert int(redis_db.hget(lost, marks.life) or 0) >= made


async def test_marked_calls_made_in_the_turn_the_transport_closes_go_out(
        redis_backend: RedisServer | RedisCluster, redis_db: Any) -> None:
    """Marked calls wait for the end of the event loop's turn, to go one call a node: a
    transport closed in the turn they were made in still sends them, and they are
    answered before it disconnects."""
    store = await opened(redis_backend.url)
    store.marks = Marks("life-a", single_node=store.single_node, node_of=store.node_of)
    await claim(store, "warm")  # the cluster's slot map learnt
    now = await store.time_ms()
    calls = [store.claim(ticket_key("fr", f"C-{i}"), b"sale", now + DAY, now + DAY, 60_000)
             for i in range(6)]
    await store.redis.aclose()
    assert all(c.done() for c in calls)
    assert all(isinstance(c.result(), Claimed) for c in calls)


async def test_a_call_that_fails_in_a_joined_call_fails_alone(
        redis_backend: RedisServer | RedisCluster, redis_db: Any) -> None:
    """Two claims of one turn through one mark, in one call of the node: the first fails
    in Redis (its record's bucket is not a hash), and nothing of it is counted; the second,
    behind it, ran ahead of a write the process expected (UNSETTLED), is sent again and
    claims; the mark counts that one write."""
    store = await opened(redis_backend.url)
    store.marks = Marks("life-a", single_node=store.single_node, node_of=store.node_of)
    try:
        broken = ticket_key("fr", "J-1")
        other = next(key for key in (ticket_key("fr", neighbour("J-1", n)) for n in range(1, 20))
                     if record_bucket_of(key) != record_bucket_of(broken))
        redis_db.set(record_bucket_of(broken), "not a hash")
        now = await store.time_ms()
        first, second = (store.claim(key, b"sale", now + DAY, now + DAY, 60_000)
                         for key in (broken, other))
        with pytest.raises(redis_py.ResponseError, match="WRONGTYPE"):
            await first
        assert isinstance(await second, Claimed)
        mark = mark_of(store, other)
        assert redis_db.hget(mark, "life-a") == b"1"
        assert redis_db.hget(mark, "*") == b"1"
    finally:
        await store.redis.aclose()
