"""Redis memory per ticket, per (combination, draw) counter with its grid record, and a hot
combination.

    python bench/memory.py [--tickets 20000] [--counters 100000] [--draws 1000]

1. Creates N counters the way a sale does (the reserve function: one grid of a distinct
   8-number combination on one draw, with its record and TTL) and prints the `INFO memory`
   used_memory delta divided by N, with Redis's default `hash-max-listpack-entries` (128)
   and with deploy/redis.conf's 512.
2. Sells one combination in `--draws` consecutive draws (50 accepted sales and 20 refused
   by the cap per draw, as a hot combination at its cap), each draw's keys expiring a
   moment after it is sold, and prints the memory in use after the first 5 draws and after
   all of them: what a draw stored goes with it, so the two stay the same.
3. (First.) Sells `--tickets` tickets of the mix of bench/tickets.lua through a capsvc
   process (capsvc.client, 32 at a time), waits until their decisions are journaled (the
   pending index empty), and prints the `used_memory` delta per ticket, everything the
   sales left in Redis counted, with Redis's default hash limits and with
   deploy/redis.conf's; then MEMORY USAGE by kind of key, and one bucket of ticket records.
   The sizing rule: bytes per ticket x tickets retained (README, "Sizing Redis"). Then
   Redis loses everything (FLUSHALL) and the service puts its journal back: the memory per
   ticket after the restore.
4. (`--layouts N`.) What a ticket record costs by how it is kept, everything else equal: N
   records of the mix's sizes (a packed sale of 36-90 bytes, results of 1-5 grids), each a
   key of its own with a TTL, written straight into Redis with deploy/redis.conf's hash
   limits, as the hash capsvc writes today, without its fingerprint, and as one
   MessagePack string with the fingerprint, without it, and without it with the sale id as
   8 raw bytes: the `used_memory` delta per key, the floor of a record that has a key.
   Then without a key per record: each record a field of one of N / 100, N / 400 or
   N / 2000 bucket hashes (its expiry inside, for a sweep to honour), under hash limits
   that keep such a bucket a listpack and under deploy/redis.conf's, with the Redis CPU of
   a look-up (HGET).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
from run import TOKEN, config_file

from capsvc.client import Client
from capsvc.domain import combination
from capsvc.redis.store import COUNTER_BUCKETS, Store, lua_source, record_field, ticket_key
from capsvc.redis.transport import Coalescer

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository: tests.support
from tests.support.servers import RedisServer
from tests.support.service import ServiceProcess

GAME, CAP, MIN_STAKE = "fdj-keno", 5000, 100
FAR = 10**13  # a close instant far ahead (ms)


async def fill(store: Store, n: int) -> None:
    rng = random.Random(1)
    expire = int(time.time() * 1000) + 86_400_000
    for start in range(0, n, 1000):
        await asyncio.gather(*[
            store.reserve(GAME, combination.encode(sorted(rng.sample(range(1, 71), 8))),
                          record_field(f"{i:016x}", 0), 500, CAP, MIN_STAKE, 4711, [expire], FAR)
            for i in range(start, min(start + 1000, n))
        ])


async def hot(store: Store, client: Any, draws: int) -> tuple[int, int]:
    """Memory after the first 5 draws and after `draws`, the older ones expired."""
    combo = combination.encode([3, 7, 12, 18, 25, 33, 41, 56])
    sales = 0
    after_first = 0
    for draw in range(1, draws + 1):
        expire = int(time.time() * 1000) + 50  # the draw's retention ends just after
        await asyncio.gather(*[
            store.reserve(GAME, combo, record_field(f"{sales + i:016x}", 0), 100, CAP,
                          MIN_STAKE, draw, [expire], FAR)
            for i in range(70)  # 50 fit under the cap, 20 are refused and recorded
        ])
        sales += 70
        if draw == 5:
            await asyncio.sleep(0.1)
            expire_all(client)
            after_first = client.info("memory")["used_memory"]
    await asyncio.sleep(0.1)
    expire_all(client)
    return after_first, client.info("memory")["used_memory"]


def expire_all(client: Any) -> None:
    """Let Redis drop every expired key now (SCAN expires the keys it visits)."""
    for _ in client.scan_iter(count=10_000):
        pass


async def run(server: RedisServer, counters: int, draws: int) -> dict[str, float]:
    client = server.client()
    redis = Coalescer(server.url, timeout_s=30, library=lua_source())
    store = Store(redis)
    await store.load_library()
    before = client.info("memory")["used_memory"]
    await fill(store, counters)
    per_counter = (client.info("memory")["used_memory"] - before) / counters
    encoding = client.object("encoding", next(client.scan_iter("c:*")))
    keys = client.dbsize()
    client.flushall()
    first, last = await hot(store, client, draws)
    await redis.aclose()
    return {"per_counter": per_counter, "keys": keys, "encoding": encoding,
            "hot_first": first, "hot_last": last}


SHIPPED = ("--hash-max-listpack-entries", "512", "--hash-max-listpack-value", "256")
"""deploy/redis.conf's hash limits (and the embedded server's)."""

_pack = msgspec.msgpack.encode
LAYOUTS: dict[str, Callable[[dict[str, Any]], tuple[str, Any]]] = {
    "hash, as written today": lambda r: ("hash", r),
    "hash without the fingerprint": lambda r: ("hash", {k: v for k, v in r.items()
                                                        if k != "fp"}),
    "string, MessagePack": lambda r: ("string", _pack(
        [r["st"], r["fp"], r["at"], r["sid"], r["sale"], False, r["res"]])),
    "string, no fingerprint": lambda r: ("string", _pack(
        [r["st"], r["at"], r["sid"], r["sale"], False, r["res"]])),
    "hash, fingerprint and sale id as raw bytes": lambda r: ("hash", {
        **r, "fp": bytes.fromhex(r["fp"]), "sid": bytes.fromhex(r["sid"])}),
    "hash, 8 bytes of fingerprint, raw sale id": lambda r: ("hash", {
        **r, "fp": bytes.fromhex(r["fp"])[:8], "sid": bytes.fromhex(r["sid"])}),
    "string, no fingerprint, raw id": lambda r: ("string", _pack(
        [r["st"], r["at"], bytes.fromhex(r["sid"]), r["sale"], False, r["res"]])),
}


BUCKETED = {"listpack": SHIPPED,
            "value 128": ("--hash-max-listpack-entries", "512",
                          "--hash-max-listpack-value", "128")}
"""Hash limits under which the bucketed layouts are measured: deploy/redis.conf's (values up
to 256 bytes keep a bucket of at most 512 records a listpack) and the 128 it had before
bucketed records (most buckets then hash tables: a record of the mix is 130-220 bytes)."""


def layouts(n: int) -> dict[str, tuple[float, float | None]]:
    """used_memory per ticket record of the mix's sizes by layout, and µs of Redis CPU a
    look-up (HGET of a bucketed record; None for a key of its own) (see 4. above)."""
    rng = random.Random(1)
    expire = int(time.time() * 1000) + 86_400_000
    records = [{"st": "f", "fp": rng.randbytes(16).hex(), "at": expire - 86_400_000 + i,
                "sid": rng.randbytes(8).hex(), "sale": rng.randbytes(rng.randint(36, 90)),
                "res": "Europe/Paris|" + ";".join(rng.choice(["1", "-", "0:0:300"])
                                                  for _ in range(rng.randint(1, 5)))}
               for i in range(n)]
    out: dict[str, tuple[float, float | None]] = {}
    server = RedisServer(extra=SHIPPED).start()
    try:
        client = server.client()
        for name, layout in LAYOUTS.items():
            client.flushall()
            before = client.info("memory")["used_memory"]
            pipelined(client, (command for i, record in enumerate(records)
                               for command in keyed(ticket_key("fr-retail", f"M1-{i}"),
                                                    *layout(record), expire)))
            out[name] = ((client.info("memory")["used_memory"] - before) / n, None)
    finally:
        server.stop()
    for limits, extra in BUCKETED.items():
        for per_bucket in (100, 400, 2000):
            out[f"bucketed, {per_bucket} a bucket, {limits}"] = bucketed(
                records, expire, per_bucket, extra, rng)
    return out


def keyed(key: str, kind: str, value: Any, expire: int) -> list[tuple[Any, ...]]:
    """The commands that write a record with a key of its own and its TTL."""
    if kind == "hash":
        return [("HSET", key, *(x for pair in value.items() for x in pair)),
                ("PEXPIREAT", key, expire)]
    return [("SET", key, value, "PXAT", expire)]


def pipelined(client: Any, commands: Iterable[tuple[Any, ...]]) -> None:
    """Send `commands`, a thousand to a round trip."""
    pipe = client.pipeline(transaction=False)
    for i, command in enumerate(commands):
        pipe.execute_command(*command)
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()


def bucketed(records: list[dict[str, Any]], expire: int, per_bucket: int,
             extra: tuple[str, ...], rng: random.Random) -> tuple[float, float]:
    """Each record one field (its channel/ticket id) of one of len(records) / per_bucket
    hashes, its value one MessagePack array with the fingerprint and the sale id as raw
    bytes and its expiry inside (no TTL: a sweep would delete what is past it)."""
    n = len(records)
    buckets = max(1, n // per_bucket)

    def place(i: int) -> tuple[str, str]:  # the record's bucket and field
        return f"tb:{{t:{i % 64}}}:{i % buckets}", f"fr-retail/M1-{i}"

    server = RedisServer(extra=extra).start()
    try:
        client = server.client()
        before = client.info("memory")["used_memory"]
        pipelined(client, (("HSET", *place(i), _pack(
            [r["st"], bytes.fromhex(r["fp"]), r["at"], bytes.fromhex(r["sid"]), r["sale"],
             r["res"], expire])) for i, r in enumerate(records)))
        per = (client.info("memory")["used_memory"] - before) / n
        client.config_resetstat()
        pipelined(client, (("HGET", *place(i)) for i in rng.sample(range(n), min(n, 20_000))))
        return per, float(client.info("commandstats")["cmdstat_hget"]["usec_per_call"])
    finally:
        server.stop()


def mix(rng: random.Random, hot_set: list[list[int]], ticket_id: str, draw: int
        ) -> dict[str, Any]:
    """One ticket of bench/tickets.lua's mix: 1-5 grids of 2-10 numbers, a fifth of them
    from a hot set of 20 combinations of 8-10 numbers, 15 % subscriptions."""
    grids = [{"numbers": rng.choice(hot_set) if rng.random() < 0.2
              else rng.sample(range(1, 71), rng.randint(2, 10)),
              "stake": rng.choice([100, 200, 300, 500, 1000])}
             for _ in range(rng.randint(1, 5))]
    r = rng.random()
    draws = 10 if r < 0.05 else 5 if r < 0.10 else 2 if r < 0.15 else 1
    return {"ticket_id": ticket_id, "game": GAME, "first_draw": draw, "draws": draws,
            "grids": grids}


async def sell_mix(url: str, tickets: int, seed: int) -> int:
    """Sells `tickets` tickets of the mix through capsvc.client; their draw."""
    rng = random.Random(seed)
    hot_set = [rng.sample(range(1, 71), rng.randint(8, 10)) for _ in range(20)]
    async with Client(url, TOKEN, deadline_s=60) as c:
        draw = (await c.current_draw(GAME)).draw
        bodies = iter([mix(rng, hot_set, f"M{seed}-{i}", draw) for i in range(tickets)])

        async def seller() -> None:
            for body in bodies:
                await c.sell(body)

        await asyncio.gather(*(seller() for _ in range(32)))
    return draw


def records_in(client: Any) -> int:
    """The ticket records in Redis: the fields of the record buckets, not a bucket's "!"
    (what a sale knew of the bucket's expiry: lua/capsvc.lua, TICKET RECORDS)."""
    return sum(client.hlen(k) - client.hexists(k, "!")
               for k in client.scan_iter("r:*", count=10_000))


def per_ticket(server: RedisServer, tickets: int) -> dict[str, Any]:
    """Redis memory per ticket of the mix sold through the service, everything it leaves in
    Redis counted (ticket records, counters and grid records, aggregates, the pending
    index once the decisions are journaled), and what each kind of key holds; then the
    same once Redis lost everything and the service put its journal back (`restored`: a
    sale made in one call comes back in the steps' form, its decision kept whole)."""
    # bench/run.py's: the token, fdj-keno.
    config = config_file()
    client = server.client()
    client.flushall()
    service = ServiceProcess(config, server.url).start()
    try:
        asyncio.run(sell_mix(service.base_url, 200, seed=0))  # warm: library, feed, caps
        deadline = time.monotonic() + 30
        while any(client.zcard(k) for k in client.scan_iter("p:*")):
            assert time.monotonic() < deadline, "decisions never journaled"
            time.sleep(0.1)
        before = client.info("memory")["used_memory"]
        asyncio.run(sell_mix(service.base_url, tickets, seed=1))
        while any(client.zcard(k) for k in client.scan_iter("p:*")):
            assert time.monotonic() < deadline + 120, "decisions never journaled"
            time.sleep(0.1)
        after = client.info("memory")["used_memory"]
        kinds: dict[str, list[int]] = {}
        for key in client.scan_iter(count=10_000):
            kind = key.split(b":", 1)[0].decode()
            usage = kinds.setdefault(kind, [0, 0])
            usage[0] += 1
            usage[1] += client.memory_usage(key, samples=0) or 0
        one = next(k for k in client.scan_iter("r:*"))
        fields = {f: v for f, v in client.hgetall(one).items() if f != b"!"}
        records = records_in(client)
        # Everything lost (FLUSHALL): the service puts its journal back.
        client.flushall()
        empty = client.info("memory")["used_memory"]
        while records_in(client) < records:
            assert time.monotonic() < deadline + 300, "the journal never put back"
            time.sleep(0.5)
        time.sleep(1)
        restored = client.info("memory")["used_memory"]
        return {"per_ticket": (after - before) / tickets,
                "restored": (restored - empty) / records, "kinds": kinds,
                "record": client.memory_usage(one, samples=0),
                "record_encoding": client.object("encoding", one),
                "record_fields": f"{len(fields)} records of "
                                 f"{min(map(len, fields.values()))}-"
                                 f"{max(map(len, fields.values()))} bytes"}
    finally:
        service.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--counters", type=int, default=100_000)
    parser.add_argument("--draws", type=int, default=1000)
    parser.add_argument("--tickets", type=int, default=20_000,
                        help="tickets of the mix sold through the service (3.); 0: skip")
    parser.add_argument("--limits", default="shipped,defaults",
                        help="Redis hash limits (3.): shipped (deploy/redis.conf's), "
                             "defaults (Redis's), value128 (values up to 128 bytes)")
    parser.add_argument("--layouts", type=int, default=0,
                        help="ticket records written in each layout (4.); 0: skip")
    args = parser.parse_args()
    if args.layouts:
        print(f"{args.layouts} ticket records of the mix's sizes, by layout: used_memory "
              "per record (a key each: deploy/redis.conf's hash limits)")
        for name, (per, lookup) in layouts(args.layouts).items():
            print(f"  {name:44} {per:6.0f} B" + (f"  HGET {lookup:.1f} µs" if lookup else ""))

    limits = {"defaults": ("Redis's defaults", ()),
              "shipped": ("deploy/redis.conf's hash limits", SHIPPED),
              "value128": ("hash-max-listpack-value 128 (the release before's)",
                           BUCKETED["value 128"])}
    for name, extra in (limits[k] for k in args.limits.split(",")):
        if not args.tickets:
            break
        server = RedisServer(extra=extra).start()
        try:
            version = server.client().info("server")["redis_version"]
            r = per_ticket(server, args.tickets)
        finally:
            server.stop()
        print(f"redis {version}, {name}: {args.tickets} tickets "
              f"of the mix sold through capsvc, decisions journaled: used_memory "
              f"{r['per_ticket']:.0f} bytes per ticket; after FLUSHALL and the journal "
              f"put back, {r['restored']:.0f} bytes per ticket")
        total = sum(v[1] for v in r["kinds"].values())
        for kind, (count, used) in sorted(r["kinds"].items(), key=lambda kv: -kv[1][1]):
            print(f"  {kind + ':*':6} {count:7} keys  MEMORY USAGE {used:12,} B  "
                  f"({used / args.tickets:6.0f} B a ticket, {used / total:4.0%})")
        print(f"  a ticket record bucket: {r['record']} B "
              f"({r['record_encoding']!r}), {r['record_fields']}")
    for entries in (128, 512) if args.counters else ():
        server = RedisServer(extra=("--hash-max-listpack-entries", str(entries))).start()
        try:
            version = server.client().info("server")["redis_version"]
            r = asyncio.run(run(server, args.counters, args.draws))
        finally:
            server.stop()
        print(f"redis {version}, hash-max-listpack-entries {entries}: {args.counters} counters "
              f"in {r['keys']} keys ({COUNTER_BUCKETS} buckets, {r['encoding']!r}): "
              f"{r['per_counter']:.0f} bytes per counter with its grid record")
        print(f"  hot combination, 70 sales a draw: used_memory {r['hot_first']:,} B after 5 "
              f"draws, {r['hot_last']:,} B after {args.draws} draws (old draws expired): "
              f"ratio {r['hot_last'] / r['hot_first']:.3f}")


if __name__ == "__main__":
    main()
