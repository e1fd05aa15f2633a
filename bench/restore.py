"""The journal's restore into an emptied Redis, side by side in one run: an older tree's
restore (one round trip per ticket) against this tree's (bulk calls).

    python bench/restore.py [--decisions 100000 1000000] [--mix one-grid mixed]
                            [--rounds 2] [--old REV] [--ablation] [--compare]
                            [--redis-arg=ARG ...]

For each number of decisions and each mix (tests/journals.py: written by the product's own
recorder and writer, under a temporary directory for the run), a redis-server with
deploy/redis.conf's listpack limits is emptied (FLUSHALL) before each restore, and
`python -m capsvc journal restore` of REV's tree (a git worktree, default `main`) and of
this tree run in turn, round after round. Pinned when `taskset` is there: the restore on
CPU 0, Redis on CPU 1.

Prints, per target: decisions restored a second (the records of decisions still retained,
over the command's wall time, start to end, its Python start included), Redis CPU per
decision (INFO cpu), the restoring process's CPU per decision, and the ratio of this tree
to REV. With --compare, whether both left the same data in Redis (every key's value and
TTL; stream entries and index scores without their instants). With --ablation, where this
tree's time goes (see `ablation`). Asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab import REPO, checkout

from capsvc.config import load_settings
from capsvc.domain.games import Catalog
from capsvc.domain.validator import pack_sale
from capsvc.journal.reader import retained_records
from capsvc.journal.records import Open, SaleRecord, SalesRecord, sold_sale
from capsvc.recovery import restore as restore_module
from capsvc.recovery.planner import Planned, Planner
from capsvc.recovery.restore import Restorer
from capsvc.redis.cluster import connect
from capsvc.redis.store import (
    _NIL,
    _SID_HEAD,
    COUNTER_BUCKETS,
    RECORD_BUCKETS,
    TICKET_BUCKETS,
    Store,
    _mp_head,
    _mp_uint,
    bucket_keys,
    ident_of,
    lua_source,
    record_bucket_of,
    record_field,
    ticket_key,
    ticket_value,
)

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository: tests.support
from tests.journals import MIXES, write_config, write_journal
from tests.support.servers import RedisServer

LISTPACKS = ("--hash-max-listpack-entries", "512", "--hash-max-listpack-value", "256")
"""deploy/redis.conf's: a bucket of ticket records stays a listpack."""


@dataclass
class Run:
    seconds: float
    records: int
    decisions: int
    redis_cpu_s: float
    client_cpu_s: float
    put_back: str
    """What the command said it put back."""


@dataclass
class Target:
    label: str
    tree: Path
    runs: list[Run] = field(default_factory=list)
    snapshot: dict[bytes, Any] | None = None


def redis_cpu(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"] + info["used_cpu_user"])


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def restore(target: Target, redis: RedisServer, config: Path, journal: Path,
            decisions: int) -> Run:
    """Empty Redis, restore the journal with the target's tree, measure."""
    client = redis.client()
    client.flushall()
    env = {**os.environ, "PYTHONPATH": str(target.tree), "PYTHONHASHSEED": "0"}
    command = [sys.executable, "-m", "capsvc", "journal", "restore", "--config", str(config),
               "--redis-url", redis.url, "--dir", str(journal)]
    if shutil.which("taskset"):
        command = ["taskset", "-c", "0", *command]
    cpu, child = redis_cpu(client), children_cpu()
    started = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=target.tree,
                         check=False)
    seconds = time.perf_counter() - started
    if out.returncode != 0:
        raise RuntimeError(f"{target.label}: {out.stderr.strip()}")
    records = int(out.stdout.split(": ", 1)[1].split(" record", 1)[0])
    put_back = out.stdout.splitlines()[1].strip()
    return Run(seconds, records, decisions, redis_cpu(client) - cpu, children_cpu() - child,
               put_back)


def snapshot(client: Any) -> dict[bytes, Any]:
    """Every key's type, value and expiry, without what the instant of the restore
    decides (a stream's entry ids and `at`, an index's scores), nor a ticket bucket's TTL
    beyond its having one (pushed a day past its newest record: by the order it met them)."""
    out: dict[bytes, Any] = {}
    for key in client.scan_iter(count=1000):
        kind = client.type(key).decode()
        value: Any
        if kind == "hash":
            value = client.hgetall(key)
        elif kind == "zset":
            value = sorted(client.zrange(key, 0, -1))
        elif kind == "set":
            value = sorted(client.smembers(key))
        elif kind == "string":
            value = client.get(key)
        elif kind == "stream":
            value = sorted(tuple(sorted((k, v) for k, v in entry.items() if k != b"at"))
                           for _, entry in client.xrange(key))
        else:
            value = kind
        expiry = client.pexpiretime(key)
        out[key] = (kind, value, expiry > 0 if key.startswith(b"r:") else expiry)
    return out


async def ablation(redis: RedisServer, config: Path, journal: Path, decisions: int) -> None:
    """Where a restore's time goes, one part at a time, in this process: Python decoding the
    journal, then planning each record's ops (capsvc.recovery.planner, no Redis); then the
    restore (Restorer.run) with every record planned in the restoring process, and with one
    planning process (forced, whatever the journal's size and the CPUs): decisions a second,
    the restoring process's CPU and Redis's CPU per decision (and, planned here, how much of
    Redis's is the functions' commands and how much their own Lua); then the same with a library
    whose bulk ticket and count calls only read their ops and answer (what the calls cost
    Redis without a command); last, Redis's CPU per decision for plain pipelined commands
    that write the same ticket records, counters and TTLs with nothing compared (the floor
    of any design that writes what a sale wrote), and for every bucket's final state
    computed here beforehand and written whole, one HSET a bucket (the floor of any design
    that writes the plan's buckets whole), and for every key restored from a payload made
    beforehand (RESTORE of each key's DUMP: the floor of any design that sends Redis its
    keys whole, as serialized values); last, the least a restore computes from the decoded
    journal, with the product's encoders and written as lean as CPython allows
    (`leanest`), serialized as RESTORE payloads and loaded, and the ceilings those floors
    put on any restore of this journal on this machine's CPUs."""
    settings = load_settings(config)
    catalog = Catalog(settings.games)
    client = redis.client()
    gc.disable()  # as a restore does
    started = time.process_time()
    lines = list(retained_records(journal))
    decode = time.process_time() - started
    records = [r for r in lines if not isinstance(r, Open)]
    print(f"  python, decoding the journal: {1e6 * decode / decisions:.2f} µs a decision "
          f"({len(lines)} lines)")
    transport = connect(redis.url, timeout_s=30, library=lua_source())
    store = Store(transport)
    await store.load_library()
    try:
        started = time.process_time()
        Planner(catalog, 0).chunk(records)
        plan = time.process_time() - started
        print(f"  python, planning each decision's ops (no Redis): "
              f"{1e6 * plan / decisions:.2f} µs a decision")
        for label, workers in (("planned in the restoring process", 0),
                               ("one planning process", 1)):
            restore_module.POOL_BYTES = -1
            restore_module.planners = lambda workers=workers: workers  # type: ignore[misc]
            client.flushall()
            client.config_resetstat()
            cpu, mine, started = redis_cpu(client), time.process_time(), time.perf_counter()
            await Restorer(journal, catalog, store).run()
            seconds = time.perf_counter() - started
            print(f"  restore, {label}: {decisions / seconds:,.0f}/s; CPU a decision: "
                  f"restoring process {1e6 * (time.process_time() - mine) / decisions:.1f} "
                  f"µs, Redis {1e6 * (redis_cpu(client) - cpu) / decisions:.1f} µs")
            if not workers:
                print(f"  ... {in_functions(client, decisions)}")
        client.function_load(without_commands(lua_source()), replace=True)
        client.flushall()
        cpu, started = redis_cpu(client), time.perf_counter()
        await Restorer(journal, catalog, store).run()
        seconds = time.perf_counter() - started
        print(f"  restore, its calls running no command: {decisions / seconds:,.0f}/s; Redis "
              f"CPU a decision {1e6 * (redis_cpu(client) - cpu) / decisions:.1f} µs")
        await store.load_library()
        client.flushall()
        cpu, started = redis_cpu(client), time.perf_counter()
        await plain_writes(store, catalog, records)
        plain_s, plain_cpu = time.perf_counter() - started, redis_cpu(client) - cpu
        client.flushall()
        buckets = whole_buckets(catalog, records)
        cpu, started = redis_cpu(client), time.perf_counter()
        commands = await write_whole(store, buckets)
        whole_s, whole_cpu = time.perf_counter() - started, redis_cpu(client) - cpu
        dumps = [(key, client.pexpiretime(key), client.dump(key))
                 for key in client.scan_iter(count=1000)]
        version = dumps[0][2][-10:-8]  # the RDB version of this server's payloads
        client.flushall()
        cpu, started = redis_cpu(client), time.perf_counter()
        await restore_whole(store, dumps)
        payload_s, payload_cpu = time.perf_counter() - started, redis_cpu(client) - cpu
    finally:
        await transport.aclose()
    print(f"  redis CPU a decision for plain pipelined writes, nothing compared: "
          f"{1e6 * plain_cpu / decisions:.1f} µs ({decisions / plain_s:,.0f}/s)")
    print(f"  redis CPU a decision for every bucket's final state written whole, planned "
          f"here beforehand (one HSET and one PEXPIREAT a bucket, {commands / decisions:.2f} "
          f"commands a decision, nothing compared or counted): "
          f"{1e6 * whole_cpu / decisions:.1f} µs ({decisions / whole_s:,.0f}/s)")
    print(f"  redis CPU a decision for every key written whole from a payload made beforehand "
          f"(RESTORE of its DUMP: no field inserted one by one, nothing compared): "
          f"{1e6 * payload_cpu / decisions:.1f} µs ({decisions / payload_s:,.0f}/s)")
    gc.disable()
    started = time.process_time()
    wanted = least_fields(records)
    least = time.process_time() - started
    print(f"  python, the least a restore computes from the decoded journal (each one-call "
          f"sale's ticket record and its grids' counter and record fields, by bucket; nothing "
          f"compared, sent or serialized): {1e6 * least / decisions:.2f} µs a decision")
    cpus = len(os.sched_getaffinity(0))
    floor = (decode + least + payload_cpu) / decisions
    print(f"  ceiling on {cpus} CPUs of any restore that decodes this journal in Python and "
          f"sends Redis its keys whole (the three floors above, every CPU busy, nothing else "
          f"spent): {cpus / floor:,.0f}/s")
    started = time.process_time()
    lean = leanest(records)
    lean_s = time.process_time() - started
    assert lean == wanted, "the lean computation must make what the product's encoders make"
    started = time.process_time()
    payloads = restore_payloads(lean, version)
    serialize = time.process_time() - started
    client.flushall()
    transport = connect(redis.url, timeout_s=30, library=lua_source())
    try:
        cpu = redis_cpu(client)
        await restore_whole(Store(transport), [(key.encode(), -1, payload)
                                               for key, payload in payloads])
        loaded = redis_cpu(client) - cpu
    finally:
        await transport.aclose()
    sample = next(iter(lean))
    assert {k if isinstance(k, bytes) else k.encode(): str(v).encode() if isinstance(v, int)
            else v for k, v in lean[sample].items()} == client.hgetall(sample)
    print(f"  python, the same written lean (no sale object built, the journal telling "
          f"whether the first draw was asked): "
          f"{1e6 * lean_s / decisions:.2f} µs a decision; each bucket serialized as a RESTORE "
          f"payload ({crc_source}): {1e6 * serialize / decisions:.2f} µs; Redis RESTOREing "
          f"those (no TTL): {1e6 * loaded / decisions:.2f} µs")
    floor = (decode + lean_s + serialize + loaded) / decisions
    print(f"  ceiling on {cpus} CPUs of the leanest restore of this journal (decoded, "
          f"computed lean, serialized, RESTOREd; every CPU busy, nothing compared, no TTL, "
          f"nothing else spent): {cpus / floor:,.0f}/s")


def in_functions(client: Any, decisions: int) -> str:
    """Where Redis's time went in the functions' calls (INFO commandstats since the last
    reset): their commands, and the rest (the functions' own Lua), a decision."""
    stats = client.info("commandstats")
    fcall = stats.get("cmdstat_fcall", {}).get("usec", 0)
    inner = {name.removeprefix("cmdstat_"): v for name, v in stats.items()
             if name not in ("cmdstat_fcall", "cmdstat_config|resetstat")}
    commands = sum(v["usec"] for v in inner.values())
    calls = sum(v["calls"] for v in inner.values())
    return (f"of it in FCALL {fcall / decisions:.1f} µs: its {calls / decisions:.1f} commands "
            f"{commands / decisions:.1f} µs, the functions' own Lua (arguments, tables, "
            f"redis.call) {(fcall - commands) / decisions:.1f} µs")


NO_COMMANDS = {
    "local function restore_tickets(keys, args)\n": """
  local codes, i = {}, 1
  while i <= #args do
    local op = args[i]
    local sale = op == 's' or op == 'S'
    codes[#codes + 1] = sale and 'w' or op == 'c' and 'k' or 'g'
    i = i + (sale and 6 + 2 * tonumber(args[i + 5]) or op == 'c' and 6 or 4)
  end
  if true then return table.concat(codes) end
""",
    "local function restore_counts(keys, args)\n": """
  local codes, i = {}, 1
  while i <= #args do
    codes[#codes + 1] = args[i] == 'g' and '1' or '0'
    i = i + 7 + (args[i] == 'g' and tonumber(args[i + 1]) or 0)
  end
  if true then return {table.concat(codes), {}} end
""",
}
"""What `without_commands` puts at the top of the bulk functions (after their first line)."""


def without_commands(source: str) -> str:
    """The library with capsvc_restore_tickets and capsvc_restore_counts reading their ops
    and answering as if every ticket were written and every grid counted, running no
    command."""
    for anchor, body in NO_COMMANDS.items():
        if anchor not in source:
            raise SystemExit(f"bench/restore.py: lua/capsvc.lua has no {anchor.strip()!r}")
        source = source.replace(anchor, anchor + body)
    return source


def planned_sales(catalog: Catalog, records: list[Any]) -> list[Planned]:
    """The sales of `records` as the restore plans them (each once, nothing cancelled)."""
    chunk = Planner(catalog, 0).chunk(
        [r for r in records if type(r) in (SaleRecord, SalesRecord)])
    return [item for item in chunk.items if isinstance(item, Planned)]


async def plain_writes(store: Store, catalog: Catalog, records: list[Any]) -> None:
    """What a restored sale writes (its ticket record, each accepted grid's record and
    counters, their TTLs), as plain commands pipelined 8,192 at a time."""
    submit, queued = store.redis.submit, []
    for t in planned_sales(catalog, records):
        game = catalog.games[t.game]
        keys, args = t.step
        queued.append(submit("HSET", keys[0], args[1], args[3]))
        queued.append(submit("PEXPIREAT", keys[0], args[2]))
        for g in (t.sale.grids[i] for i in t.counted):
            buckets = bucket_keys(t.game, g.combo, t.first, t.draws)
            queued.append(submit("HSET", buckets[-1], record_field(t.sale_id, g.index),
                                 g.stake))
            for d, bucket in enumerate(buckets):
                queued.append(submit("HINCRBY", bucket, g.combo, g.stake))
                queued.append(submit("PEXPIREAT", bucket, game.expire_at(t.first + d)))
        if len(queued) > 8192:
            await asyncio.gather(*queued)
            queued = []
    await asyncio.gather(*queued)


def whole_buckets(catalog: Catalog, records: list[Any]
                  ) -> dict[str, tuple[dict[bytes | str, Any], int]]:
    """What the sales of `records` (each once, nothing cancelled) leave, bucket by bucket:
    its fields (ticket records; combinations' totals and grids' records) and expiry."""
    out: dict[str, tuple[dict[bytes | str, Any], int]] = {}

    def put(key: str, field: bytes | str, value: Any, expire_at: int, add: bool = False
            ) -> None:
        fields, expiry = out.get(key) or ({}, 0)
        fields[field] = fields.get(field, 0) + value if add else value
        out[key] = (fields, max(expiry, expire_at))

    for item in planned_sales(catalog, records):
        keys, args = item.step
        put(keys[0], args[1], args[3], args[2] + 86_400_000)
        for gkeys, gargs in item.counts:
            for d, key in enumerate(gkeys):
                put(key, gargs[3], gargs[4], gargs[7 + d], add=True)
            put(gkeys[-1], gargs[2], gargs[4], gargs[6 + len(gkeys)])
    return out


def least_fields(records: list[Any]) -> dict[str, dict[bytes | str, Any]]:
    """What the one-call sales of `records` leave in Redis, bucket by bucket, computed with
    the product's own encoders and nothing else: each ticket record (ticket_value of its
    packed sale and results), each capped grid's counter on each draw and its record."""
    out: dict[str, dict[bytes | str, Any]] = {}
    for line in records:
        if type(line) is not SalesRecord:
            continue
        zone = line.zone
        for s in line.sales:
            sale = sold_sale(line, s)
            key = ticket_key(line.channel, s.ticket)
            out.setdefault(record_bucket_of(key), {})[ident_of(key)] = ticket_value(
                line.until_of(s), b"f", line.at_of(s), s.sale, pack_sale(sale), None,
                results=f"{zone}|{s.res}".encode())
            assert sale.first_draw is not None
            for g in sale.grids:
                if g.capped and g.index in s.accepted:
                    buckets = bucket_keys(line.game, g.combo, sale.first_draw, sale.draws)
                    for bucket in buckets:
                        fields = out.setdefault(bucket, {})
                        fields[g.combo] = fields.get(g.combo, 0) + g.stake
                    out[buckets[-1]][record_field(s.sale, g.index)] = g.stake
    return out


def leanest(records: list[Any]) -> dict[str, dict[bytes | str, Any]]:
    """What `least_fields` computes, written lean: no sale object built, the ticket record
    packed in place. The floor of CPython computing the keys a restore writes from this
    journal."""
    out: dict[str, dict[bytes | str, Any]] = {}
    pack, crc32, fromhex = msgspec.msgpack.encode, zlib.crc32, bytes.fromhex
    for line in records:
        if type(line) is not SalesRecord:
            continue
        game, channel, zone = line.game, line.channel, line.zone
        for s in line.sales:
            first, draws = s.first_draw or line.first_draw, s.draws
            grids = [[bytes(g.numbers), g.stake, (1 if g.multiplier else 0)
                      | (2 if g.capped else 0)] for g in s.grids]
            sale = pack([s.ticket, game, s.player, first if s.asked else -first, draws,
                         s.joker_plus, s.joker_cost, grids])
            ident = f"{channel}/{s.ticket}"
            h = crc32(ident.encode())
            bucket = f"r:{{t:{h % TICKET_BUCKETS}}}:{(h // TICKET_BUCKETS) % RECORD_BUCKETS}"
            res = f"{zone}|{s.res}".encode()
            sid = fromhex(s.sale)
            fields = out.get(bucket)
            if fields is None:
                fields = out[bucket] = {}
            fields[ident] = b"".join((
                _mp_uint(s.until or line.until), b"\xa1f",
                _mp_uint(line.at if s.at is None else s.at),
                _SID_HEAD, sid, _mp_head(len(sale)), sale, _NIL, _mp_head(len(res)), res,
                _NIL, _NIL))
            results = s.res.split(";")
            for i, g in enumerate(s.grids):
                if g.capped and results[i] == "1":
                    combo = "".join(map(chr, g.numbers))
                    prefix = f"c:{{{game}:{crc32(combo.encode()) % COUNTER_BUCKETS}}}:"
                    for d in range(first, first + draws):
                        key = prefix + str(d)
                        f = out.get(key)
                        if f is None:
                            f = out[key] = {}
                        f[combo] = f.get(combo, 0) + g.stake
                    f[b"\0" + sid + bytes((i,))] = g.stake
    return out


def _rdb_length(n: int) -> bytes:
    """An RDB length: 6, 14 or 32 bits."""
    if n < 0x40:
        return bytes((n,))
    if n < 0x4000:
        return bytes((0x40 | n >> 8, n & 0xFF))
    return b"\x80" + n.to_bytes(4, "big")


def restore_payloads(buckets: dict[str, dict[bytes | str, Any]], version: bytes
                     ) -> list[tuple[str, bytes]]:
    """Each bucket as a RESTORE payload: an RDB hash (type 4: its fields and values as
    length-prefixed strings; Redis makes it a listpack when small), the RDB version, the
    CRC-64 of Redis (`crc_source`)."""
    out = []
    length = _rdb_length
    for key, fields in buckets.items():
        parts = [b"\x04", length(len(fields))]
        for field_, value in fields.items():
            f = field_.encode() if isinstance(field_, str) else field_
            v = b"%d" % value if isinstance(value, int) else value
            parts += (length(len(f)), f, length(len(v)), v)
        body = b"".join(parts) + version
        out.append((key, body + crc64(body).to_bytes(8, "little")))
    return out


def _crc64_python(data: bytes) -> int:
    """CRC-64 of Redis (Jones polynomial, reflected), a byte at a time."""
    crc = 0
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc


def _crc_table() -> list[int]:
    table = []
    for n in range(256):
        crc = n
        for _ in range(8):
            crc = (crc >> 1) ^ 0x95AC9329AC4BC9B5 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC_TABLE = _crc_table()
try:  # a CRC-64 in C when installed (pip install anycrc); else Python's, byte by byte
    import anycrc

    crc64 = anycrc.Model("CRC64-REDIS").calc
    crc_source = "CRC-64 by anycrc, in C"
except ImportError:
    crc64 = _crc64_python
    crc_source = "CRC-64 in Python, byte by byte: pip install anycrc for one in C"


async def write_whole(store: Store, buckets: dict[str, tuple[dict[bytes | str, Any], int]]
                      ) -> int:
    """`whole_buckets` written, pipelined 8,192 commands at a time; how many commands."""
    submit, queued, commands = store.redis.submit, [], 0
    for key, (fields, expire_at) in buckets.items():
        flat = [x for pair in fields.items() for x in pair]
        for start in range(0, len(flat), 2_000):
            queued.append(submit("HSET", key, *flat[start:start + 2_000]))
        queued.append(submit("PEXPIREAT", key, expire_at))
        if len(queued) > 8192:
            commands += len(queued)
            await asyncio.gather(*queued)
            queued = []
    commands += len(queued)
    await asyncio.gather(*queued)
    return commands


async def restore_whole(store: Store, dumps: list[tuple[bytes, int, bytes]]) -> None:
    """Every key RESTOREd from its DUMP with its expiry, pipelined 8,192 at a time."""
    submit, queued = store.redis.submit, []
    for key, expire_at, payload in dumps:
        ttl = ("0",) if expire_at < 0 else (expire_at, "ABSTTL")
        queued.append(submit("RESTORE", key, ttl[0], payload, *ttl[1:]))
        if len(queued) > 8192:
            await asyncio.gather(*queued)
            queued = []
    await asyncio.gather(*queued)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--decisions", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--mix", choices=MIXES, nargs="+", default=list(MIXES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--old", default="main", help="the tree to compare with (a commit)")
    parser.add_argument("--ablation", action="store_true")
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--redis-arg", action="append", default=[],
                        help="an argument for redis-server, e.g. --redis-arg=--appendonly "
                             "--redis-arg=no")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="capsvc-bench-restore-"))
    redis = RedisServer(extra=(*LISTPACKS, *args.redis_arg)).start()
    version = redis.client().info("server")["redis_version"]
    if shutil.which("taskset"):
        assert redis.process is not None
        subprocess.run(["taskset", "-pc", "1", str(redis.process.pid)], check=True,
                       capture_output=True)
    (root / "trees").mkdir()
    targets = [Target(args.old, checkout(args.old, root / "trees")), Target("this tree", REPO)]
    results: dict[tuple[int, str], list[Target]] = {}
    try:
        for n in args.decisions:
            for mix in args.mix:
                journal = root / f"{mix}-{n}"
                config = write_config(root / f"{mix}-{n}.toml")
                catalog = Catalog(load_settings(config).games)
                written = asyncio.run(write_journal(journal, catalog, n, mix, files=4))
                print(f"{n:,} decisions, {mix}: {written:,} records", flush=True)
                here = [Target(t.label, t.tree) for t in targets]
                for r in range(args.rounds):
                    for t in here if r % 2 == 0 else here[::-1]:
                        t.runs.append(restore(t, redis, config, journal, n))
                        print(f"  {t.label}: {n / t.runs[-1].seconds:,.0f}/s; "
                              f"{t.runs[-1].put_back}", flush=True)
                        if args.compare and r == 0:
                            t.snapshot = snapshot(redis.client())
                if args.compare:
                    a, b = here[0].snapshot or {}, here[1].snapshot or {}
                    differ = sorted({k.split(b"{")[0].decode() for k in a.keys() | b.keys()
                                     if a.get(k) != b.get(k)})
                    print(f"  the same data in Redis after either restore: {len(a)} keys, "
                          f"{'all equal' if not differ else 'differing: ' + ' '.join(differ)}"
                          " (a feed's events, f:, follow the order records are applied in)")
                if args.ablation:
                    asyncio.run(ablation(redis, config, journal, n))
                results[(n, mix)] = here
                shutil.rmtree(journal, ignore_errors=True)
    finally:
        redis.stop()
        for tree in (root / "trees").iterdir():
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                            str(tree)], capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, redis-server {version} (listpacks as deploy/); "
          f"restore on CPU 0, Redis on CPU 1; {args.rounds} rounds alternating, medians")
    print(f"{'decisions':>10} {'mix':<9} {'target':<10} {'decisions/s':>11} {'s':>7} "
          f"{'redis µs/d':>10} {'client µs/d':>11} {'ratio':>6}")
    for (n, mix), (old, new) in results.items():
        rates = {}
        for t in (old, new):
            rates[t.label] = statistics.median(r.decisions / r.seconds for r in t.runs)
            print(f"{n:>10,} {mix:<9} {t.label[:10]:<10} {rates[t.label]:>11,.0f} "
                  f"{statistics.median(r.seconds for r in t.runs):>7.2f} "
                  f"{statistics.median(1e6 * r.redis_cpu_s / n for r in t.runs):>10.1f} "
                  f"{statistics.median(1e6 * r.client_cpu_s / n for r in t.runs):>11.1f} "
                  f"{rates[t.label] / rates[old.label]:>6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
