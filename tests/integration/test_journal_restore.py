"""The journal's restore in bulk (capsvc/recovery/restore.py, lua/capsvc.lua's BULK RESTORE)
on a real Redis, standalone and cluster: it leaves, key by key, what re-applying the records
one at a time leaves (tests/restore_reference.py) on a journal of every kind of record, and
reports the same; twice equals once; a decision Redis still has is not counted again; a
grid counted past its cap is reported; a ticket id held by another sale; records of one
ticket in journal order; games no longer configured; a restore while sales go on."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from capsvc.client.models import TicketIn
from capsvc.config import Settings, load_settings
from capsvc.domain.decisions import ACCEPTED, REJECTED, Reserved, results_of
from capsvc.domain.games import Catalog
from capsvc.domain.validator import Sale, pack_sale, validate_ticket
from capsvc.journal.reader import retained_records
from capsvc.journal.recorder import Recorder
from capsvc.journal.records import (
    Open,
    Record,
    SaleRecord,
    SalesRecord,
    VoidRecord,
    expanded,
    sale_of,
    sold_sale,
)
from capsvc.journal.writer import open_journal
from capsvc.recovery import planner
from capsvc.recovery import restore as restore_module
from capsvc.recovery.planner import Planned, Planner
from capsvc.recovery.restore import Restored, Restorer
from capsvc.redis.cluster import connect
from capsvc.redis.replies import PlayerLimits
from capsvc.redis.store import (
    Store,
    bucket_keys,
    lua_source,
    pending_key_of,
    record_field,
    restore_count,
    restore_release,
    ticket_key,
)
from capsvc.service.steps import aggregate_value
from tests.conftest import TEN, Client, services, ticket
from tests.decisions import build_decision
from tests.journals import write_config, write_journal
from tests.records import TicketRecords, raw_claim
from tests.restore_reference import OneByOne
from tests.support.servers import RedisCluster, RedisServer


@pytest.fixture
async def store(redis_backend: RedisServer | RedisCluster, redis_db: Any
                ) -> AsyncIterator[Store]:
    """A store on the test's emptied Redis, the library loaded."""
    transport = connect(redis_backend.url, timeout_s=10, library=lua_source())
    out = Store(transport)
    await out.load_library()
    yield out
    await transport.aclose()


@pytest.fixture(scope="module")
def journal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Catalog]:
    """A journal of 1,500 decisions of the mixed sales (tests/journals.py) in the files of two
    processes, and its games."""
    root = tmp_path_factory.mktemp("mixed")
    catalog = Catalog(load_settings(write_config(root / "games.toml")).games)
    asyncio.run(write_journal(root / "journal", catalog, 1_500, "mixed", seed=7, files=2))
    return root / "journal", catalog


def records_of(directory: Path) -> list[Open | Record | SalesRecord]:
    """What a restore reads of a journal: a `sales` line as it is."""
    return list(retained_records(directory))


def decisions_of(directory: Path) -> list[Open | Record]:
    """The journal's records, a `sales` line as the `sale` records it stands for."""
    return [one for r in retained_records(directory) for one in expanded(r)]


def snapshot(db: Any) -> dict[bytes, Any]:
    """Every key's type, value and expiry, without what the instant of the restore decides
    (a stream entry's id and `at`, an index's scores), nor a ticket bucket's TTL beyond its
    having one (a day past its newest record's expiry, by the order it met them)."""
    out: dict[bytes, Any] = {}
    for key in db.scan_iter(count=1000):
        kind = db.type(key).decode()
        value: Any = kind
        if kind == "hash":
            value = db.hgetall(key)
        elif kind == "zset":
            value = sorted(db.zrange(key, 0, -1))
        elif kind == "set":
            value = sorted(db.smembers(key))
        elif kind == "string":
            value = db.get(key)
        elif kind == "stream":
            value = sorted(tuple(sorted((k, v) for k, v in e.items() if k != b"at"))
                           for _, e in db.xrange(key))
        expiry = db.pexpiretime(key)
        out[key] = (kind, value, expiry > 0 if key.startswith(b"r:") else expiry)
    return out


def figures(done: Restored) -> tuple[Any, ...]:
    return (done.records, done.applied, done.grids, done.over_cap, done.other_sale,
            done.skipped)


@pytest.mark.parametrize("window", [restore_module.WINDOW, 7])
async def test_bulk_restore_leaves_what_one_record_at_a_time_leaves(
        journal: tuple[Path, Catalog], store: Store, redis_db: Any, window: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a journal of sales (partial, rejected, refused by the player's limit,
    subscriptions), replays, cancels, voids and a ticket id sold again, stops, caps,
    self-limits and stakes, the bulk restore leaves every key as the records re-applied one
    at a time leave it and reports the same, in windows of any size."""
    directory, catalog = journal
    monkeypatch.setattr(restore_module, "WINDOW", window)
    records = records_of(directory)
    await seed(store, redis_db, catalog, records)
    one_by_one = await OneByOne(catalog, store).restore(records)
    expected = snapshot(redis_db)
    redis_db.flushall()
    await seed(store, redis_db, catalog, records)
    bulk = await Restorer(directory, catalog, store).restore(records)
    assert figures(bulk) == figures(one_by_one)
    assert set(bulk.applied) == {"sale", "cancel", "void", "cap", "stop", "limit", "stake"}
    assert bulk.other_sale > 0
    assert snapshot(redis_db) == expected


async def seed(store: Store, db: Any, catalog: Catalog, records: list[Open | Record]
               ) -> None:
    """What a Redis may hold of a journal it is restored into: some of its decisions
    (put back one at a time), some ticket ids held by another sale, and the abandoned claims
    of some voids still pending, their grids counted."""
    sales = [r for r in records if type(r) in (SaleRecord, SalesRecord)]
    await OneByOne(catalog, store).restore(sales[::7])
    tickets = TicketRecords(db)
    for r in sales[3::11]:
        one = r.sales[0] if isinstance(r, SalesRecord) else r
        until = r.until_of(one) if isinstance(r, SalesRecord) else one.until
        tickets.put(ticket_key(r.channel, one.ticket), until, st="f",
                    at=r.at, sid="0" * 16, sale=b"another sale", body=b"{}")
    others = [r for i, r in enumerate(sales)
              if isinstance(r, SalesRecord) and i % 7 and i % 11 != 3]
    for line in others[::13]:
        # A sale in steps whose decision Redis lost after its claim wrote its share of its
        # draws' aggregates: pending, its share there.
        s = line.sales[0]
        game = catalog.games[line.game]
        sale = sold_sale(line, s)
        value = aggregate_value(sale, {g.index for g in sale.grids})
        if value is None or s.res == "P":
            continue
        key = ticket_key(line.channel, s.ticket)
        tickets.put(key, line.until_of(s), st="p", at=line.at_of(s), sid=s.sale,
                    sale=pack_sale(sale))
        first = line.first_of(s)
        for d in range(first, first + s.draws):
            assert await store.aggregate(key, line.game, d, s.sale, value,
                                         game.expire_at(d)) == 1
    for v in [r for r in records if isinstance(r, VoidRecord)][::2]:
        game = catalog.games[v.game]
        sale = sale_of(v)
        tickets.put(ticket_key(v.channel, v.ticket), v.until, st="p", at=v.at,
                    sid=v.sale, sale=pack_sale(sale))
        for g in sale.grids:
            if g.capped:
                await store.reserve(v.game, g.combo, record_field(v.sale, g.index), g.stake,
                                    game.rules.cap_limit or 0, game.rules.min_stake,
                                    v.first_draw, game.expiries(v.first_draw, v.draws),
                                    game.calendar.close_ms(v.first_draw))


class NoProcesses:
    """A process pool that cannot start a process."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def submit(self, *args: Any) -> Any:
        raise OSError("no process can be started here")

    def shutdown(self, **kwargs: Any) -> None:
        pass


@pytest.mark.parametrize(("processes", "workers"), [("started", 1), ("started", 3),
                                                     ("refused", 2)])
async def test_a_journal_planned_in_processes_of_their_own_restores_the_same(
        journal: tuple[Path, Catalog], store: Store, redis_db: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, processes: str, workers: int) -> None:
    """A large journal is read, decoded and planned by processes of their own, piece by
    piece, each taking the next piece (or here, when no process can be started): with
    pieces of a few kilobytes (lines cut across pieces) and a torn last line, the restore
    leaves what planning every record here leaves, and reports the same."""
    directory, catalog = journal
    copy = tmp_path / "journal"
    copy.mkdir()
    for path in directory.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    torn = sorted(copy.glob("*.jsonl"))[-1]
    torn.write_bytes(torn.read_bytes() + b'{"prev":"00","type":"sale","at":1,')
    here = await Restorer(copy, catalog, store).restore(records_of(copy))
    expected = snapshot(redis_db)
    redis_db.flushall()
    monkeypatch.setattr(restore_module, "POOL_BYTES", 0)
    monkeypatch.setattr(restore_module, "planners", lambda: workers)
    monkeypatch.setattr(planner, "CHUNK_BYTES", 7_000)
    if processes == "refused":
        monkeypatch.setattr(planner, "ProcessPoolExecutor", NoProcesses)
    there = await Restorer(copy, catalog, store).run()
    assert figures(there) == figures(here)
    assert snapshot(redis_db) == expected


async def test_restoring_twice_equals_restoring_once(journal: tuple[Path, Catalog],
                                                     store: Store, redis_db: Any) -> None:
    """The second restore of a journal puts nothing back and changes no key."""
    directory, catalog = journal
    first = await Restorer(directory, catalog, store).run()
    assert first.applied
    after = snapshot(redis_db)
    again = await Restorer(directory, catalog, store).run()
    assert again.applied == {}
    assert again.grids == again.over_cap == 0
    assert again.records == first.records
    assert snapshot(redis_db) == after


async def test_a_decision_redis_still_has_is_not_counted_again(
        journal: tuple[Path, Catalog], store: Store, redis_db: Any) -> None:
    """Redis kept the first part of the journal: restoring the whole of it puts back the
    rest only (no grid counted twice), and leaves what a restore into an empty Redis does."""
    directory, catalog = journal
    records = records_of(directory)
    whole = await Restorer(directory, catalog, store).restore(records)
    expected = snapshot(redis_db)
    redis_db.flushall()
    half = len(records) // 2
    kept = await Restorer(directory, catalog, store).restore(records[:half])
    rest = await Restorer(directory, catalog, store).restore(records)
    assert kept.grids + rest.grids == whole.grids
    assert rest.applied["sale"] < whole.applied["sale"]
    assert snapshot(redis_db) == expected


RULES = load_settings(Path(__file__).parents[1] / "capsvc-test.toml").games["fdj-keno"]


def fdj_sale(ticket_id: str, first: int, numbers: list[int], draws: int = 1,
             stake: int = 500) -> Sale:
    t = msgspec.convert({"ticket_id": ticket_id, "game": "fdj-keno", "first_draw": first,
                         "draws": draws, "grids": [{"numbers": numbers, "stake": stake}]},
                        TicketIn)
    return validate_ticket(RULES, t)


async def journaled(directory: Path, entries: list[tuple[str, tuple[Any, ...]]]) -> None:
    """Write records (a Recorder method and its arguments each) into a journal."""
    journal = open_journal(directory, max_file_bytes=1 << 30, keep_ms=86_400_000)
    rec = Recorder(journal, lambda: 1)
    await asyncio.gather(*[getattr(rec, method)(*args) for method, args in entries])
    await journal.aclose()


def sold(s: Sale, sid: str, at: int, until: int, accepted: bool = True
         ) -> tuple[str, tuple[Any, ...]]:
    """A sale record of `s` (its capped grid accepted, or refused by the cap)."""
    first = s.first_draw
    assert first is not None
    replies: list[Reserved | None] = [Reserved(ACCEPTED) if accepted else Reserved(REJECTED)
                                      for _ in s.grids]
    body = msgspec.json.encode(build_decision("fr-retail", RULES.tz, s, sid, at, replies))
    return "sale", ("answer", "fr-retail", s, sid, at, body, until, [RULES.cap_limit] * s.draws)


@pytest.fixture
def fdj(tmp_path: Path) -> tuple[Catalog, int, Path]:
    """The test configuration's games, the first draw of a sale 10 draws on, a journal
    directory."""
    catalog = Catalog(load_settings(Path(__file__).parents[1] / "capsvc-test.toml").games)
    game = catalog.games["fdj-keno"]
    first = game.calendar.current(int(time.time() * 1000)) + 10
    return catalog, first, tmp_path / "journal"


async def test_grids_counted_past_the_cap_are_reported_once_a_grid_and_draw(
        fdj: tuple[Catalog, int, Path], store: Store, redis_db: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    """Another host sold the combination to its cap on both draws before this journal came
    back: its 3 grids (one a subscription of the two draws) are counted all the same, past
    the cap, and reported: 4 (grid, draw) over the cap, each grid logged and passed to
    `on_over_cap`."""
    catalog, first, directory = fdj
    game = catalog.games["fdj-keno"]
    numbers = TEN[:8]
    until = game.expire_at(first + 1)
    now = int(time.time() * 1000)
    other = directory.parent / "other"
    await journaled(other, [sold(fdj_sale(f"B{i}", first, numbers, 2, 1000), f"{i:016x}",
                                 now, until) for i in range(5)])
    await journaled(directory, [
        sold(fdj_sale("A0", first, numbers, 2), "a" * 16, now, until),
        sold(fdj_sale("A1", first, numbers), "b" * 16, now, until),
        sold(fdj_sale("A2", first + 1, numbers), "c" * 16, now, until)])
    full = await Restorer(other, catalog, store).run()
    assert full.over_cap == 0
    reported: list[tuple[str, int]] = []
    with caplog.at_level(logging.WARNING, logger="capsvc.recovery.restore"):
        done = await Restorer(directory, catalog, store,
                              lambda g, n: reported.append((g, n))).run()
    assert done.over_cap == 4
    assert sorted(reported) == [("fdj-keno", 1), ("fdj-keno", 1), ("fdj-keno", 2)]
    assert sum("past the cap" in r.message for r in caplog.records) == 3
    combo = fdj_sale("X", first, numbers).grids[0].combo.encode()
    keys = bucket_keys("fdj-keno", combo.decode(), first, 2)
    assert [int(redis_db.hget(k, combo)) for k in keys] == [6000, 6000]


async def test_a_ticket_id_held_by_another_sale_keeps_it_and_counts_the_journaled_stakes(
        fdj: tuple[Catalog, int, Path], store: Store, redis_db: Any) -> None:
    """Redis holds the ticket id for another sale (claimed again after the loss): its
    record stays as it is, the journaled sale's stake is counted, and it is reported."""
    catalog, first, directory = fdj
    game = catalog.games["fdj-keno"]
    until = game.expire_at(first)
    now = int(time.time() * 1000)
    s = fdj_sale("T1", first, TEN[:8])
    key = ticket_key("fr-retail", "T1")
    claimed = await raw_claim(store, key, b"sale", game.calendar.close_ms(
        first), until, 60_000)
    assert claimed[0] == b"new"
    before = TicketRecords(redis_db).fields(key)
    await journaled(directory, [sold(s, "d" * 16, now, until)])
    done = await Restorer(directory, catalog, store).run()
    assert done.other_sale == 1
    assert done.applied == {"sale": 1}
    assert done.grids == 1
    assert TicketRecords(redis_db).fields(key) == before
    combo = s.grids[0].combo
    assert int(redis_db.hget(bucket_keys("fdj-keno", combo, first, 1)[0], combo)) == 500


@pytest.mark.parametrize("window", [restore_module.WINDOW, 1])
async def test_a_ticket_voided_then_sold_again_ends_with_the_new_sale(
        fdj: tuple[Catalog, int, Path], store: Store, redis_db: Any, window: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Records of one ticket are applied in journal order: an abandoned claim voided, then
    the ticket id sold again, then that sale replayed and cancelled: the ticket ends as the
    second sale cancelled, with nothing counted, whatever the window size."""
    monkeypatch.setattr(restore_module, "WINDOW", window)
    catalog, first, directory = fdj
    game = catalog.games["fdj-keno"]
    until = game.expire_at(first)
    now = int(time.time() * 1000)
    s = fdj_sale("T2", first, TEN[:8])
    sale = sold(s, "f" * 16, now, until)
    body = sale[1][5]
    await journaled(directory, [
        ("void", ("abandoned", "fr-retail", s, "e" * 16, now, until)), sale,
        ("sale", ("replay", *sale[1][1:])),
        ("cancel", ("answer", "fr-retail", s, "f" * 16, now, body, until, now + 5, 500))])
    key = ticket_key("fr-retail", "T2")
    done = await Restorer(directory, catalog, store).run()
    assert done.applied == {"sale": 1, "cancel": 1}
    assert TicketRecords(redis_db).get(key, "st", "sid") == [b"c", b"f" * 16]
    combo = s.grids[0].combo
    assert redis_db.hget(bucket_keys("fdj-keno", combo, first, 1)[0], combo) is None
    assert redis_db.zscore(pending_key_of(key), key) is None


async def test_records_of_games_no_longer_configured_are_passed_over(
        journal: tuple[Path, Catalog], store: Store, redis_db: Any) -> None:
    """A journal restored with one of its two games gone from the configuration: that
    game's records are counted as skipped, and nothing of that game is written."""
    directory, catalog = journal
    fdj_only = Catalog({"fdj-keno": catalog.games["fdj-keno"].rules})
    records = records_of(directory)
    done = await Restorer(directory, fdj_only, store).restore(records)
    gone = sum(len(r.sales) if isinstance(r, SalesRecord) else 1 for r in records
               if not isinstance(r, Open) and r.game == "lnm-keno")
    assert done.skipped == gone > 0
    assert not [k for k in redis_db.scan_iter(count=1000)
                if b"lnm-keno" in k or k.startswith((b"b:", b"l:"))]


async def test_a_restore_while_sales_go_on_counts_nothing_twice(
        redis_backend: RedisServer | RedisCluster, redis_db: Any, settings: Settings,
        tmp_path: Path) -> None:
    """A service sells (and cancels) while its own journal is restored into its Redis,
    again and again: every counter holds exactly the stakes of the journal's standing
    decisions, and a last restore puts nothing back."""
    async def restores(catalog: Catalog, stop: asyncio.Event) -> int:
        transport = connect(redis_backend.url, timeout_s=10, library=lua_source())
        store = Store(transport)
        runs = 0
        try:
            while not stop.is_set():
                await Restorer(Path(settings.journal_dir), catalog, store).run()
                runs += 1
        finally:
            await transport.aclose()
        return runs

    catalog = Catalog(settings.games)
    async with services([settings], redis_backend.url) as (client,):
        draw = await client.current() + 1
        stop = asyncio.Event()
        restoring = asyncio.ensure_future(restores(catalog, stop))

        async def sell(i: int) -> None:
            # A 503 (a Redis call slower than the Redis timeout: the restores compete for
            # Redis, a loaded machine more so) is sent again, as the contract says; a
            # cancel is idempotent.
            numbers = [*TEN[:7], 60 + i % 10]
            reply = await client.sell_until_decided(
                ticket([{"numbers": numbers, "stake": 500}], ticket_id=f"L{i}",
                       first_draw=draw), tries=400)
            assert reply.status == 200, reply.body
            if i % 7 == 0 and reply.body["status"] == "accepted":
                for _ in range(400):
                    cancel = await client.post(f"/v1/tickets/L{i}/cancel")
                    if cancel.status != 503:
                        break
                    await asyncio.sleep(0.05)
                assert cancel.status == 200, cancel.body

        for start in range(0, 120, 20):
            await asyncio.gather(*[sell(i) for i in range(start, start + 20)])
        stop.set()
        assert await restoring > 0
        await check_counters(client, Path(settings.journal_dir), draw)
        transport = connect(redis_backend.url, timeout_s=10, library=lua_source())
        try:
            last = await Restorer(Path(settings.journal_dir), catalog,
                                  Store(transport)).run()
        finally:
            await transport.aclose()
        assert last.applied == {}
        await check_counters(client, Path(settings.journal_dir), draw)


async def check_counters(client: Client, directory: Path, draw: int) -> None:
    """Each combination's counter equals the stakes its journaled decisions still hold."""
    held: dict[tuple[int, ...], int] = {}
    standing: dict[str, tuple[SaleRecord, bool]] = {}
    for r in decisions_of(directory):
        if isinstance(r, SaleRecord):
            cancelled = type(r) is not SaleRecord or standing.get(r.ticket, (r, False))[1]
            standing[r.ticket] = (r, cancelled)
    for r, cancelled in standing.values():
        decision = msgspec.json.decode(r.decision)
        for g in decision["grids"]:
            numbers = tuple(g["numbers"])
            held.setdefault(numbers, 0)
            if g["status"] == "accepted" and not cancelled:
                held[numbers] += r.grids[g["index"]].stake
    for numbers, stake in held.items():
        assert await client.staked(list(numbers), draw) == stake, numbers


async def test_counts_sent_in_one_call_leave_what_the_single_functions_leave(
        fdj: tuple[Catalog, int, Path], store: Store, redis_db: Any) -> None:
    """capsvc_restore_counts, many ops a call: 300 grids counted and given back at random
    over two combinations and three draws (subscriptions of one to three draws, stakes past
    the cap, buckets emptied by a release and made again, grids sealed without a record,
    which puts their bucket's expiry at their draw's, below what it was), and a third
    combination's bucket emptied and made again with nothing after, leave every key as
    capsvc_restore_grid and capsvc_release, one call a grid, leave them, and answer the
    same (a call a combination: a call is of one slot)."""
    catalog, first, _ = fdj
    game = catalog.games["fdj-keno"]
    rules = game.rules
    cap, low = rules.cap_limit or 0, rules.min_stake
    rng = random.Random(5)
    combos = [fdj_sale("C", first, numbers).grids[0].combo
              for numbers in (TEN[:8], [*TEN[:7], 61], [*TEN[:7], 62])]
    seeded = record_field("f" * 16, 0)
    # (kind, combination, draws, record, first draw, stake or the release's expiry)
    ops: list[tuple[str, int, int, bytes, int, int]] = [
        ("r", 2, 2, seeded, first, game.expire_at(first + 1)),  # empties draw 1's bucket
        ("g", 2, 2, record_field("e" * 16, 0), first, 500)]  # which is made again
    for _ in range(300):
        combo, draws = rng.randrange(2), rng.randint(1, 3)
        start = first + rng.randint(0, 3 - draws)
        record = record_field(f"{rng.randrange(40):016x}", 0)
        if rng.random() < 0.6:
            ops.append(("g", combo, draws, record, start, rng.choice([500, 2000])))
        else:
            ops.append(("r", combo, draws, record, start, game.expire_at(start + draws - 1)))

    def seed() -> None:
        """Combination 0 counted on every draw (a record on each), combinations 1 and 2
        on draws 1 and 2 by one subscription; every bucket living 5 s past its draw's
        expiry."""
        redis_db.flushall()
        for d in range(first, first + 3):
            key = bucket_keys("fdj-keno", combos[0], d, 1)[0]
            redis_db.hset(key, mapping={combos[0]: 1500, seeded: 1500})
        for combo in combos[1:]:
            keys = bucket_keys("fdj-keno", combo, first, 2)
            redis_db.hset(keys[0], combo, 500)
            redis_db.hset(keys[1], mapping={combo: 500, seeded: 500})
        for d in range(first, first + 3):
            for combo in combos:
                redis_db.pexpireat(bucket_keys("fdj-keno", combo, d, 1)[0],
                                   game.expire_at(d) + 5000)

    def bulk(op: tuple[str, int, int, bytes, int, int]) -> tuple[list[str], list[Any]]:
        kind, combo, draws, record, start, x = op
        if kind == "g":
            return restore_count("fdj-keno", combos[combo], record, x, cap, low, start,
                                 game.expiries(start, draws))
        return restore_release("fdj-keno", combos[combo], record, cap, low, start, draws, x)

    seed()
    letters = []
    for kind, combo, draws, record, start, x in ops:
        if kind == "g":
            keys, args = bulk((kind, combo, draws, record, start, x))
            reply = await store.fcall("capsvc_restore_grid", keys, args[2:])
            letters.append("0" if reply[0] == 0 else "1" if reply[1:] == [0] else "x")
        else:
            given = await store.release("fdj-keno", combos[combo], record, cap, low, start,
                                        draws, x)
            letters.append("x" if given.stake else "0")
    expected = snapshot(redis_db)
    seed()
    found = [""] * len(ops)
    for combo in range(3):
        mine = [i for i, op in enumerate(ops) if op[1] == combo]
        calls = [bulk(ops[i]) for i in mine]
        keys = [k for keys, _ in calls for k in keys]
        reply = await store.fcall("capsvc_restore_counts", [*keys, store.marks.mark_of(keys[0])],
                                  [*(a for _, args in calls for a in args), ""])
        for i, letter in zip(mine, reply[0].decode(), strict=True):
            found[i] = letter
    assert snapshot(redis_db) == expected
    assert found == letters
    assert set(letters) == {"0", "1", "x"}


async def test_a_restore_leaves_a_redis_as_its_sales_left_it(
        redis_server: RedisServer, standalone_db: Any, settings: Settings) -> None:
    """Sales made in one call (a standalone Redis: single and multi-grid tickets, numbers the
    cap does not count, a subscription, a partial, the player-limited game, a ticket the
    player's limit refused, a batch) and a cancel, then everything lost: the restore of the
    journal puts back every ticket record, counter, grid record, total and budget exactly as
    the sales left them, no bigger (the decisions kept as results, the totals by number of
    picks, as their calls wrote them) — also when another process, which looked every
    ticket up, has its journal restored first."""
    other = dataclasses.replace(settings, journal_dir=settings.journal_dir + "-other")
    async with services([settings, other], redis_server.url) as (client, looker):
        draw = await client.current() + 1
        eight = {"numbers": TEN[:8], "stake": 1000}
        fdj = [ticket([eight], first_draw=draw) for _ in range(3)]
        fdj += [ticket([eight, {"numbers": [1, 2, 3], "stake": 200},
                        {"numbers": [4, 5, 6, 7], "stake": 300, "multiplier": True}],
                       first_draw=draw),
                ticket([eight, {"numbers": [8, 9], "stake": 100}], first_draw=draw),
                ticket([eight, {"numbers": [8, 9], "stake": 100}],  # at the cap: partial
                       first_draw=draw),
                ticket([{"numbers": TEN[1:10], "stake": 200}, {"numbers": [11, 12], "stake": 100}],
                       first_draw=draw, draws=5)]
        statuses = [(await client.sell(body)).body["status"] for body in fdj]
        assert statuses == ["accepted"] * 5 + ["partial", "accepted"]
        assert (await client.post("/v1/ticket-batches", {"tickets": [
            ticket([{"numbers": [20 + k, 30, 40, 50, 61, 62, 63, 64], "stake": 100},
                    {"numbers": [k + 1, 30], "stake": 100}], first_draw=draw)
            for k in range(5)]})).status == 200
        cancel = ticket([{"numbers": [1, 2, 3, 4, 5], "stake": 200}], first_draw=draw)
        assert (await client.sell(cancel)).status == 200
        assert (await client.post(f"/v1/tickets/{cancel['ticket_id']}/cancel")).status == 200
        pid = f"P-{time.monotonic_ns()}"
        assert (await client.request("PUT", f"/v1/players/{pid}/limit?game=lnm-keno",
                                     {"daily": 10000}, token="mt")).status == 200
        lnm = [ticket([{"numbers": TEN[:8], "stake": 2500}, {"numbers": [1, 2], "stake": 1000}],
                      game="lnm-keno", player_id=pid, draws=2),
               ticket([{"numbers": [1, 2, 3], "stake": 250}], game="lnm-keno",
                      player_id=pid),
               ticket([{"numbers": [1, 2, 3], "stake": 2500}], game="lnm-keno",
                      player_id=pid, draws=2)]  # past the self-limit: refused whole
        statuses = [(await client.sell(body, token="mt")).body["status"] for body in lnm]
        assert statuses == ["accepted", "accepted", "rejected"]
        for body in fdj:
            assert (await looker.get(f"/v1/tickets/{body['ticket_id']}")).status == 200
        for body in lnm:
            assert (await looker.get(f"/v1/tickets/{body['ticket_id']}",
                                     token="mt")).status == 200
    sold = data(standalone_db)
    assert any(k.startswith(b"a:") for k in sold)
    assert any(k.startswith(b"b:") for k in sold)
    standalone_db.flushall()
    transport = connect(redis_server.url, timeout_s=10, library=lua_source())
    try:
        store = Store(transport)
        await store.load_library()
        looked = await Restorer(Path(other.journal_dir), Catalog(settings.games),
                                store).run()
        done = await Restorer(Path(settings.journal_dir), Catalog(settings.games),
                              store).run()
    finally:
        await transport.aclose()
    assert looked.applied["sale"] == len(fdj) + len(lnm)
    assert done.applied["limit"] == 1
    assert data(standalone_db) == sold


def data(db: Any) -> dict[bytes, Any]:
    """`snapshot` of the keys that hold decisions and what they took: not the marks, the
    sales not journaled yet, the sold-out feed (events, put back in the order of the
    restore) nor what a process keeps of its own turns; nor the records of what holds
    nothing: a grid refused by the cap (what a request of the sale in steps would read),
    which a restore, putting back what was taken, does not write, and a budget's ref that
    took nothing ("R": refused by the limit when sold; "X": sealed by a restore, which
    gives back everything a sale that took nothing does not hold); nor a record bucket's
    "!", what a sale knew of the bucket's expiry (the expiry itself is compared)."""
    out = {}
    for key, (kind, value, expiry) in snapshot(db).items():
        if key[:2] not in (b"r:", b"c:", b"a:", b"b:", b"l:", b"k:"):
            continue
        if key[:2] == b"r:":
            value = {f: v for f, v in value.items() if f != b"!"}
        if key[:2] in (b"c:", b"b:"):
            value = {f: v for f, v in value.items()
                     if not v.startswith(b"R") and not (key[:2] == b"b:" and v == b"X")}
        out[key] = (kind, value, expiry)
    return out


async def test_a_cancel_put_back_before_its_sale_leaves_the_player_charged_nothing(
        store: Store, redis_db: Any, tmp_path: Path) -> None:
    """A player-limited ticket sold by one process and cancelled by another, both restoring
    at once: the canceller's round that gives the budget back may run after the seller's
    ticket round and before its budget round (the sale's ticket then already cancelled).
    The give-back, finding nothing taken, seals the budget, so that the take put back after
    it charges the player nothing. Here the rounds' budget calls in that order, as the
    journal's records plan them; then both restores whole, in either order."""
    settings = load_settings(Path(__file__).parents[1] / "capsvc-test.toml")
    catalog = Catalog(settings.games)
    game = catalog.games["lnm-keno"]
    first = game.calendar.current(int(time.time() * 1000)) + 2
    sale = validate_ticket(game.rules, msgspec.convert(
        {"ticket_id": "C-1", "game": "lnm-keno", "player_id": "P-C1", "first_draw": first,
         "grids": [{"numbers": TEN[:8], "stake": 1000}, {"numbers": [1, 2], "stake": 500}]},
        TicketIn))
    sid, at = "ab" * 8, int(time.time() * 1000)
    until = game.expire_at(first)
    replies = [Reserved(ACCEPTED), None]
    body = msgspec.json.encode(build_decision("ma-test", game.rules.tz, sale, sid, at, replies))
    await journaled(tmp_path / "seller", [("sale", ("answer", "ma-test", sale, sid, at, body,
                                                     until, [game.rules.cap_limit or 0],
                                                     results_of(game.rules.time_zone,
                                                                replies)))])
    await journaled(tmp_path / "canceller", [("cancel", ("answer", "ma-test", sale, sid, at,
                                                         body, until, at + 5, 1500))])
    day = game.calendar.local_date(at).isoformat()
    budget = f"b:{{pl:P-C1}}:{day}"
    planner = Planner(catalog, 0)
    cancel, sold_ = (planner.chunk(records_of(tmp_path / d)).items[0]
                     for d in ("canceller", "seller"))
    assert isinstance(cancel, Planned)
    assert isinstance(sold_, Planned)
    for op in (cancel.budget, sold_.budget):
        assert op is not None
        calls = store.restore_budgets()
        calls.add(op)
        await calls.send()
    assert int(redis_db.hget(budget, "spent") or 0) == 0
    for order in (("canceller", "seller"), ("seller", "canceller")):
        redis_db.flushall()
        for directory in order:
            await Restorer(tmp_path / directory, catalog, store).run()
        assert int(redis_db.hget(budget, "spent") or 0) == 0, order
        assert await asyncio.gather(*store.counters("lnm-keno", sale.grids[0].combo, first,
                                                    1)) in ([None], [b"0"])
        record = await store.ticket(ticket_key("ma-test", "C-1"))
        assert record is not None
        assert record.state == b"c"


async def test_self_limits_set_in_one_millisecond_come_back_as_the_last_one_set(
        service: tuple[Any, str], settings: Settings, redis_backend: RedisServer | RedisCluster,
        redis_db: Any) -> None:
    """Two self-limits of one player set at one instant of the process's clock (forced):
    Redis sets the second just after the first, the journal says so, and a restore after
    Redis lost everything leaves the second, as it stood, not the first."""
    svc, url = service
    clock = svc.usecases.players.clock
    fixed = clock.now()
    clock.now = lambda: fixed  # type: ignore[method-assign]
    async with aiohttp.ClientSession() as session:
        client = Client(session, url)
        for daily in (30000, 20000):
            assert (await client.request("PUT", "/v1/players/P-T1/limit?game=lnm-keno",
                                         {"daily": daily}, token="mt")).status == 200
        before = (await client.get("/v1/players/P-T1?game=lnm-keno", token="mt")).body
    assert before["self_limit"] == 20000
    limit = redis_db.hgetall("l:{pl:P-T1}")
    redis_db.flushall()
    transport = connect(redis_backend.url, timeout_s=10, library=lua_source())
    try:
        fresh = Store(transport)
        await fresh.load_library()
        await Restorer(Path(settings.journal_dir), Catalog(settings.games), fresh).run()
    finally:
        await transport.aclose()
    assert redis_db.hgetall("l:{pl:P-T1}") == limit


async def test_a_player_at_the_limit_restored_again_is_not_reported_put_back(
        store: Store, redis_db: Any, tmp_path: Path) -> None:
    """A ticket that spent its player's whole self-limit: restored into an empty Redis it is
    put back; restored again, Redis has it (its take recorded, no room left), and nothing
    is reported put back."""
    settings = load_settings(Path(__file__).parents[1] / "capsvc-test.toml")
    catalog = Catalog(settings.games)
    game = catalog.games["lnm-keno"]
    now = int(time.time() * 1000)
    first = game.calendar.current(now) + 2
    sale = validate_ticket(game.rules, msgspec.convert(
        {"ticket_id": "L-1", "game": "lnm-keno", "player_id": "P-L1", "first_draw": first,
         "grids": [{"numbers": [1, 2, 3], "stake": 2500}]}, TicketIn))
    replies: list[Reserved | None] = [None]
    body = msgspec.json.encode(build_decision("ma-test", game.rules.tz, sale, "cd" * 8, now,
                                              replies))
    await journaled(tmp_path / "j", [
        ("limit", ("ma-test", "P-L1", "lnm-keno", 2500, now - 10, now + 86_400_000,
                   PlayerLimits(2500, None, False, None, 0))),
        ("sale", ("answer", "ma-test", sale, "cd" * 8, now, body, game.expire_at(first),
                  None, results_of(game.rules.time_zone, replies)))])
    first_run = await Restorer(tmp_path / "j", catalog, store).run()
    assert first_run.applied == {"sale": 1, "limit": 1}
    day = game.calendar.local_date(now).isoformat()
    assert redis_db.hget(f"b:{{pl:P-L1}}:{day}", "spent") == b"2500"
    assert (await Restorer(tmp_path / "j", catalog, store).run()).applied == {}
