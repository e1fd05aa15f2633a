"""The Redis commands a one-grid sale issues, pinned: a count read from INFO commandstats
(deterministic, not a time), so that what each sale costs Redis cannot grow unnoticed.

Raise a pinned number only with the reason in the commit that raises it.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from typing import Any

import msgspec
import pytest
import redis

from capsvc.client.models import TicketIn
from capsvc.domain.combination import encode
from capsvc.redis.gate import POLICY_S
from capsvc.redis.store import bucket_keys, pending_key_of, record_bucket_of, ticket_key
from capsvc.service.tickets import SaleOutcome
from tests.conftest import TEN, Client, new_id, ticket
from tests.support.faults import functions_of
from tests.support.servers import RedisCluster, RedisServer

ONE_GRID_SALE = {
    # capsvc_sell, reading Redis TIME once: the ticket's record read with its bucket's
    # known expiry (an HMGET) and written, the grid's counter increased (and taken back
    # only past the cap) and its record, the expiries of the counter's bucket and of the
    # record's bucket looked at and pushed on (the record bucket's then noted in it: an
    # HSET), the stops, the call's entry of the unjournaled sales (an HSET; its HDEL once
    # the decision is journaled, a plain command); and the mark (lua/capsvc.lua, MARKS):
    # one HMGET and one HSET of the call
    "fcall": 1, "time": 1, "hset": 5, "hmget": 3, "pexpiretime": 2, "pexpireat": 2,
    "hincrby": 1, "hdel": 1,
}
"""Commands by name for one sale of one 8-number grid on a standalone Redis, into buckets
no sale has used yet, the release of its call's entry of the unjournaled sales (once the
decision is journaled) included."""

ONE_GRID_SALE_STEADY = {
    # As ONE_GRID_SALE, into buckets an earlier sale made: the record bucket's expiry is
    # known from the HMGET of the record (no TTL read, nothing noted), the counter bucket's
    # is read (not pushed on)
    "fcall": 1, "time": 1, "hset": 4, "hmget": 3, "pexpiretime": 1, "hincrby": 1, "hdel": 1,
}
"""Commands by name for one sale of one 8-number grid into buckets earlier sales made, as
nearly every sale of a day's steady sales."""


def commands(db: redis.Redis) -> dict[str, int]:
    stats: dict[str, Any] = db.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


@pytest.mark.parametrize("redis_backend", ["standalone"], indirect=True)
async def test_a_one_grid_sale_issues_the_pinned_commands(
        service: Any, client: Client, redis_server: RedisServer, standalone_db: redis.Redis
        ) -> None:
    """One 8-number grid sold in one call (standalone): exactly the pinned commands."""
    svc, _ = service
    assert svc.store.single_node
    await client.current()
    warm = await client.sell(ticket([{"numbers": TEN[:8], "stake": 500}]))
    assert warm.status == 200  # the draw's cap is known from here on, as in steady sales
    await asyncio.sleep(0.1)  # its index entry released
    used = await sale_commands(client, standalone_db,
                               ticket([{"numbers": TEN[1:9], "stake": 500}]), "fr")
    assert used == ONE_GRID_SALE, repr(used)


@pytest.mark.parametrize("redis_backend", ["standalone"], indirect=True)
async def test_a_one_grid_sale_in_steady_state_issues_the_pinned_commands(
        service: Any, client: Client, standalone_db: redis.Redis) -> None:
    """A one-grid sale into the record bucket and the counter bucket of an earlier sale:
    exactly the pinned commands (two fewer than into new buckets, one fewer than a read of
    each bucket's expiry would cost)."""
    await client.current()
    warm = ticket([{"numbers": TEN[:8], "stake": 500}])
    assert (await client.sell(warm)).status == 200
    await asyncio.sleep(0.1)
    same = neighbour(warm["ticket_id"])
    counter = bucket_keys("fdj-keno", encode(TEN[:8]), 1, 1)[0].split("}")[0]
    numbers = next(c for c in itertools.combinations(range(1, 71), 8)
                   if bucket_keys("fdj-keno", encode(c), 1, 1)[0].split("}")[0] == counter
                   and list(c) != TEN[:8])
    used = await sale_commands(client, standalone_db, ticket(
        [{"numbers": list(numbers), "stake": 500}], ticket_id=same), "fr")
    assert used == ONE_GRID_SALE_STEADY, repr(used)


async def sale_commands(client: Client, db: redis.Redis, body: dict[str, Any], token: str
                        ) -> dict[str, int]:
    """The commands Redis ran for one sale accepted (its call's entry released once it is
    journaled), by name."""
    db.config_resetstat()
    window = time.monotonic()
    reply = await client.sell(body, token=token)
    assert reply.status == 200
    assert reply.body["status"] == "accepted"
    await asyncio.sleep(0.1)
    used = commands(db)
    window = time.monotonic() - window
    used.pop("config|resetstat", None)
    used.pop("info", None)
    # The connection reads its node's maxmemory-policy every POLICY_S (capsvc.redis.gate),
    # whatever the sales: as many may fall in this window, none is the sale's.
    assert used.pop("config|get", 0) <= window / POLICY_S + 1
    return used


BATCH_OF_64 = {"fcall": 1, "time": 1, "hdel": 1}
"""The calls a batch of 64 one-grid tickets costs Redis, whatever its size: one FCALL (of
capsvc_calls, carrying one capsvc_sell; one TIME) and, once their decisions are journaled,
one HDEL of its entry of the unjournaled sales (the other commands are inside the call, a
few a ticket)."""


def _calls(used: dict[str, int]) -> dict[str, int]:
    return {name: used.get(name, 0) for name in BATCH_OF_64}


@pytest.mark.parametrize("redis_backend", ["standalone"], indirect=True)
async def test_a_batch_of_64_is_one_call(
        service: Any, client: Client, standalone_db: redis.Redis) -> None:
    """`POST /v1/ticket-batches` of 64 one-grid tickets: one capsvc_sell, one TIME, one
    HDEL once journaled; and inside it, in steady state (the record and counter buckets of
    an earlier batch), five commands a ticket."""
    await client.current()
    numbers = [sorted({(i * 7 + k * 11) % 70 + 1 for k in range(8)}) for i in range(200)]
    grids = [n for n in numbers if len(n) == 8][:64]
    assert len(grids) == 64
    ids = [new_id() for _ in grids]
    warm = await client.post("/v1/ticket-batches", {"tickets": [
        ticket([{"numbers": g, "stake": 200}], ticket_id=i)
        for g, i in zip(grids, ids, strict=True)]})
    assert [r["status"] for r in warm.body["results"]] == [200] * 64
    await asyncio.sleep(0.1)
    standalone_db.config_resetstat()
    reply = await client.post("/v1/ticket-batches", {"tickets": [
        ticket([{"numbers": g, "stake": 200}], ticket_id=neighbour(i))
        for g, i in zip(grids, ids, strict=True)]})
    assert reply.status == 200
    assert [r["status"] for r in reply.body["results"]] == [200] * 64
    await asyncio.sleep(0.1)
    used = commands(standalone_db)
    assert _calls(used) == BATCH_OF_64, repr(used)
    inside = sum(used.values()) - sum(BATCH_OF_64.values()) - used.get("info", 0) - \
        used.get("config|resetstat", 0) - used.get("config|get", 0)
    # A ticket: its record read (with its bucket's known expiry) and written, its counter
    # increased, its grid's record, the expiry of its counter's bucket looked at (once a
    # call a bucket); the call: the stops, the mark (read, written), the entry of the
    # unjournaled sales.
    assert inside <= 64 * 5 + 4, repr(used)


def neighbour(ticket_id: str) -> str:
    """Another ticket id whose record is in the same bucket as `ticket_id`'s."""
    bucket = record_bucket_of(ticket_key("fr-retail", ticket_id))
    return next(f"{ticket_id}-{n}" for n in range(100_000)
                if record_bucket_of(ticket_key("fr-retail", f"{ticket_id}-{n}")) == bucket)


@pytest.mark.parametrize("redis_backend", ["standalone"], indirect=True)
async def test_the_single_sales_of_one_tick_are_one_call(
        service: Any, client: Client, standalone_db: redis.Redis) -> None:
    """Ten `POST /v1/tickets` of one ticket each, reaching the worker in one event-loop tick
    (the handlers' calls to `Tickets.sell` made together): one capsvc_sell for all ten,
    one HDEL once they are journaled."""
    svc, _ = service
    channel = next(c for c in svc.settings.channels if c.id == "fr-retail")
    await client.current()
    warm = await client.sell(ticket([{"numbers": TEN[:8], "stake": 500}]))
    assert warm.status == 200
    await asyncio.sleep(0.1)
    standalone_db.config_resetstat()
    bodies = [msgspec.convert(ticket([{"numbers": TEN[1 + i % 2:9 + i % 2], "stake": 200}]),
                              TicketIn) for i in range(10)]
    results = await asyncio.gather(*[svc.usecases.tickets.sell(channel, [b]) for b in bodies])
    assert all(isinstance(r, SaleOutcome) for (r,) in results)
    await asyncio.sleep(0.1)
    assert _calls(commands(standalone_db)) == BATCH_OF_64


LIMITED_SALE = {
    **ONE_GRID_SALE,
    # and the player's limit: its self-limit read (HMGET), the day's spent read (HGET),
    # charged (HINCRBY) under the sale's ref (HSET), the day's expiry looked at and set
    "hmget": 4, "hget": 1, "hincrby": 2, "hset": 6, "pexpiretime": 3, "pexpireat": 3,
}
"""Commands by name for one sale of one 8-number grid of a game with player limits (the
player's first of the day), in one call on a standalone Redis."""


@pytest.mark.parametrize("redis_backend", ["standalone"], indirect=True)
async def test_a_one_grid_sale_with_player_limits_issues_the_pinned_commands(
        service: Any, client: Client, standalone_db: redis.Redis) -> None:
    """One 8-number grid of an LNM ticket sold in one call (standalone), its player's limit
    checked and charged in the same call: exactly the pinned commands."""
    await client.current("lnm-keno")
    warm = await client.sell(ticket([{"numbers": TEN[:8], "stake": 500}], game="lnm-keno",
                                    player_id="P-warm"), token="ma")
    assert warm.status == 200, warm.body
    await asyncio.sleep(0.1)
    used = await sale_commands(client, standalone_db, ticket(
        [{"numbers": TEN[1:9], "stake": 500}], game="lnm-keno", player_id="P-pinned"), "ma")
    assert used == LIMITED_SALE, repr(used)


STEPS = ("capsvc_claim", "capsvc_reserve", "capsvc_finalize")
"""The marked calls of a sale in steps (a Redis Cluster's): the claim (the ticket indexed
for the janitor in the same call), the grids' reserves, the decision written. Once it is
journaled, its index entry is released (capsvc_journaled_many, one call a node and turn of
the event loop, whatever the indexes)."""


class Turns:
    """What a process sends a cluster, counted by node: each FCALL, and the marked calls
    each capsvc_calls carries. The replies of every command sent in one turn of the event
    loop are handed back together, in one turn: a batch's tickets then take each step
    together, as on a quiet machine (on a busy one, the nodes' replies to a step may reach
    the loop in different turns, and the next step go in as many calls a node)."""

    def __init__(self, store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.redis = store.redis
        self.fcalls: list[tuple[str, str]] = []
        """Each FCALL: its node (its count key) and function."""
        self.carried: list[tuple[str, list[str]]] = []
        """Each capsvc_calls: its node and the functions it carries."""
        self._turn: list[tuple[asyncio.Future[Any], asyncio.Future[Any]]] | None = None
        for name in ("submit", "submit_partly_declared"):
            monkeypatch.setattr(self.redis, name, self._wrap(getattr(self.redis, name)))

    def _wrap(self, submit: Any) -> Any:
        def sent(*args: Any) -> asyncio.Future[Any]:
            if args[0] == "FCALL":
                node = args[4] if args[1] == "capsvc_calls" else self.redis.node_of(args[3])
                self.fcalls.append((node, args[1]))
                if args[1] == "capsvc_calls":
                    self.carried.append((node, functions_of(args)))
            inner = submit(*args)
            outer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            if self._turn is None:
                self._turn = []
                asyncio.get_running_loop().call_soon(self._close_turn)
            self._turn.append((inner, outer))
            return outer
        return sent

    def _close_turn(self) -> None:
        turn, self._turn = self._turn or [], None

        def hand_back(_: Any) -> None:
            for inner, outer in turn:
                if inner.cancelled():
                    outer.cancel()
                elif inner.exception() is not None:
                    outer.set_exception(inner.exception())  # type: ignore[arg-type]
                else:
                    outer.set_result(inner.result())

        asyncio.gather(*[inner for inner, _ in turn],
                       return_exceptions=True).add_done_callback(hand_back)

    def clear(self) -> None:
        self.fcalls.clear()
        self.carried.clear()

    def by_node(self, nodes: list[str]) -> dict[str, int]:
        return {node: sum(1 for n, _ in self.fcalls if n == node) for node in nodes}

    def steps(self) -> dict[str, list[list[str]]]:
        """By node, the functions each capsvc_calls carried."""
        out: dict[str, list[list[str]]] = {}
        for node, names in self.carried:
            out.setdefault(node, []).append(sorted(set(names)))
        return out


def fcalls_by_node(cluster: RedisCluster, nodes: list[str]) -> dict[str, int]:
    """INFO commandstats' FCALLs of each primary, by its count key."""
    out = {}
    for server in cluster.primary_nodes():
        db = server.client()
        node = next(n for n in nodes if _serves(db, n))
        out[node] = int(db.info("commandstats").get("cmdstat_fcall", {}).get("calls", 0))
        db.close()
    return out


def _serves(db: redis.Redis, key: str) -> bool:
    try:
        db.exists(key)
        return True
    except redis.ResponseError:  # MOVED: another primary's
        return False


@pytest.mark.parametrize("redis_backend", ["cluster"], indirect=True)
async def test_a_cluster_sells_a_batch_in_one_call_a_node_a_step(
        service: Any, client: Client, redis_cluster: RedisCluster,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a Redis Cluster a one-grid ticket is a claim, a reserve and a decision, each a
    marked call. A batch of 64 takes each step for all its tickets at once: one FCALL a
    node a step (capsvc_calls carrying that step of every ticket, or grid, the node
    holds), 64 of each step in all, three FCALLs a node, pinned with the count of FCALLs
    each primary ran (INFO commandstats: counts, not times). Then one release a node and
    turn of the journal (the batch's tickets are in dozens of pending indexes)."""
    svc, _ = service
    store = svc.store
    await client.current()
    warm = await client.sell(ticket([{"numbers": TEN[:8], "stake": 500}]))
    assert warm.status == 200
    await asyncio.sleep(0.2)
    turns = Turns(store, monkeypatch)
    ticks: list[int] = []  # the nodes of each tick's releases
    send_journaled = store._send_journaled

    def tick() -> None:
        ticks.append(len({store.node_of(index) for index, *_ in store._journaled}))
        send_journaled()

    monkeypatch.setattr(store, "_send_journaled", tick)
    alone = await client.sell(ticket([{"numbers": TEN[1:9], "stake": 500}]))
    assert alone.status == 200
    await asyncio.sleep(0.2)
    assert sorted(n for _, names in turns.carried for n in names
                  if n in STEPS) == sorted(STEPS)
    nodes = await store.nodes()
    grids = [sorted(random.Random(i).sample(range(1, 71), 8)) for i in range(64)]
    assert len({tuple(g) for g in grids}) == 64  # none shares a combination: no chain
    tickets = [ticket([{"numbers": g, "stake": 200}]) for g in grids]
    names = [ticket_key("fr-retail", t["ticket_id"]) for t in tickets]
    for db in (s.client() for s in redis_cluster.primary_nodes()):
        db.config_resetstat()
    turns.clear()
    ticks.clear()
    reply = await client.post("/v1/ticket-batches", {"tickets": tickets})
    assert [r["status"] for r in reply.body["results"]] == [200] * 64
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while any(await asyncio.gather(*[store.redis.submit("ZSCORE", pending_key_of(name), name)
                                     for name in names])):  # until every entry is let go
        assert loop.time() < deadline
        await asyncio.sleep(0.05)
    ran = fcalls_by_node(redis_cluster, nodes)
    assert ran == turns.by_node(nodes), (ran, turns.fcalls)  # every FCALL seen
    assert turns.steps() == {node: [["capsvc_claim"], ["capsvc_reserve"], ["capsvc_finalize"]]
                             for node in nodes}, turns.carried
    carried = [n for _, names in turns.carried for n in names]
    assert {name: carried.count(name) for name in STEPS} == dict.fromkeys(STEPS, 64)
    released = sum(1 for _, name in turns.fcalls if name == "capsvc_journaled_many")
    assert released == sum(ticks), (released, ticks)  # one release a node and tick
    # However many pending indexes a tick's entries are in: the batch's 64, let go in one
    # turn (how many turns the journal made them durable in is the machine's), are one
    # call a node.
    turns.clear()
    ticks.clear()
    for name in names:
        store.journaled_later(name, "0" * 16, b"f")
    await asyncio.sleep(0.2)
    indexes = {pending_key_of(name) for name in names}
    assert ticks == [3]
    assert [name for _, name in turns.fcalls] == ["capsvc_journaled_many"] * 3
    assert len(indexes) > 3
