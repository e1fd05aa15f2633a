"""Durability modes on a real primary and a real replica: `replicas:1` answers a sale only
once the replica has it, answers 503 (outcome unknown) when it cannot, and converges on
retry; `default` never sends WAIT."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
import redis

from capsvc.redis.cluster import ClusterCoalescer
from capsvc.redis.embedded import server_binary
from capsvc.redis.transport import Coalescer
from tests.conftest import Client, ticket
from tests.support.servers import RedisCluster, RedisServer
from tests.support.service import ServiceProcess

CONFIG = """
[server]
request_timeout = "2s"
drain_delay = "100ms"

[redis]
durability = "replicas:1"
wait_timeout = "200ms"

[[games]]
id = "fdj-keno"
preset = "fdj-keno-2008"

[[channels]]
id = "fr-retail"            # token t-fr
token_sha256 = "d58a61f7def14e593497565c808f47429d70cedcdc71c2e61888215206ac936b"
games = ["fdj-keno"]
scopes = ["sell", "read"]

[[channels]]
id = "ops"                  # token t-admin
token_sha256 = "c140b9ee332d67f84953aae63edc037a10d217685d2d98161ecb34696eb4e2a4"
games = ["fdj-keno"]
scopes = ["read", "admin"]
"""


def grid(first: int, stake: int = 500) -> list[dict[str, Any]]:
    """One grid of 8 consecutive numbers from `first`: each test its own combination."""
    return [{"numbers": list(range(first, first + 8)), "stake": stake}]


async def in_sync(primary: RedisServer, timeout_s: float = 60.0) -> None:
    """Wait until the primary's replica is online and has everything the primary wrote (a
    replica started again resyncs, and one resumed reads its backlog: on a loaded machine,
    longer than `wait_timeout`)."""
    client = primary.client()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = client.info("replication")
        replica = info.get("slave0")
        if (isinstance(replica, dict) and replica.get("state") == "online"
                and replica.get("offset") == info["master_repl_offset"]):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the replica did not catch up")


def wait_calls(client: redis.Redis) -> int:
    """How many WAIT commands this Redis has run since its stats were reset."""
    stats: dict[str, Any] = client.info("commandstats")
    return int(stats.get("cmdstat_wait", {}).get("calls", 0))


def contents(client: redis.Redis) -> dict[bytes, Any]:
    """Every key of a Redis and its value, whatever its type."""
    readers = {b"string": client.get, b"hash": client.hgetall, b"set": client.smembers,
               b"list": lambda k: client.lrange(k, 0, -1),
               b"zset": lambda k: client.zrange(k, 0, -1, withscores=True)}
    return {key: readers[client.type(key)](key) for key in client.scan_iter(count=1000)}


@pytest.fixture(scope="module")
def primary() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def replica(primary: RedisServer) -> Iterator[RedisServer]:
    server = RedisServer(replica_of=primary).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("durability") / "capsvc.toml"
    path.write_text(CONFIG)
    return str(path)


@pytest.fixture(scope="module")
def services(config: str, primary: RedisServer, replica: RedisServer
             ) -> Iterator[dict[str, str]]:
    """Two processes on the same primary: `replicas:1` (the file) and `default` (the
    CAPSVC_DURABILITY override); their base URLs."""
    started = {
        "replicas": ServiceProcess(config, primary.url).start(),
        "default": ServiceProcess(config, primary.url,
                                  env={"CAPSVC_DURABILITY": "default"}).start(),
    }
    yield {mode: s.base_url for mode, s in started.items()}
    for s in started.values():
        s.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def safe(services: dict[str, str], http: aiohttp.ClientSession) -> Client:
    """A client of the `replicas:1` service."""
    return Client(http, services["replicas"])


@pytest.fixture
def fast(services: dict[str, str], http: aiohttp.ClientSession) -> Client:
    """A client of the `default` service."""
    return Client(http, services["default"])


async def test_sale_is_on_the_replica_when_answered(safe: Client, primary: RedisServer,
                                                    replica: RedisServer) -> None:
    """In replicas:1 mode a 200 means the replica already holds the sale's counters (a 503,
    the replica slower than `wait_timeout` on a loaded machine, is sent again, as the
    contract says)."""
    body = ticket(grid(1))
    reply = await safe.sell_until_decided(body)
    assert reply.status == 200, reply.body
    on_replica, on_primary = contents(replica.client()), contents(primary.client())
    # The watches note their processes alive in the marks ("@<life>") whenever they look:
    # no answer waits for that.
    for data in (on_replica, on_primary):
        for key, value in data.items():
            if key.startswith(b"m:{"):
                data[key] = {f: v for f, v in value.items() if not f.startswith(b"@")}
    assert on_primary
    assert on_replica == on_primary
    assert await safe.staked(body["grids"][0]["numbers"], reply.body["draws"][0]) == 500


async def test_replica_down_is_503_then_the_retry_converges(
        safe: Client, primary: RedisServer, replica: RedisServer) -> None:
    """Without its replica a sale is 503 (outcome unknown); once it is back, the same
    request answers the one recorded decision, counted once."""
    body = ticket(grid(11))
    replica.stop()
    try:
        started = time.monotonic()
        lost = await safe.sell(body)
        assert time.monotonic() - started >= 0.2  # it did wait for the replica
    finally:
        replica.start()
    await in_sync(primary)
    assert lost.status == 503, lost.body
    assert lost.headers["Retry-After"] == "1"
    assert lost.body["error"]["code"] == "unavailable"
    assert "outcome unknown" in lost.body["error"]["message"]
    assert "send the same request again" in lost.body["error"]["message"]
    first = await safe.sell_until_decided(body)
    assert first.status == 200, first.body
    again = await safe.sell_until_decided(body)
    assert again.status == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.body == first.body
    stored = await safe.get(f"/v1/tickets/{body['ticket_id']}")
    assert stored.body == first.body
    assert first.body["status"] == "accepted"
    assert await safe.staked(body["grids"][0]["numbers"], first.body["draws"][0]) == 500


async def test_paused_replica_fails_a_cancel_until_it_resumes(
        safe: Client, primary: RedisServer, replica: RedisServer) -> None:
    """A cancel waits for the replica too; its retry releases the stake once."""
    body = ticket(grid(21))
    sold = await safe.sell_until_decided(body)
    assert sold.status == 200, sold.body
    draw = sold.body["draws"][0]
    assert replica.process is not None
    replica.process.send_signal(signal.SIGSTOP)  # connected, but acknowledges nothing
    try:
        lost = await safe.post(f"/v1/tickets/{body['ticket_id']}/cancel")
    finally:
        replica.process.send_signal(signal.SIGCONT)
    await in_sync(primary)
    assert lost.status == 503, lost.body
    assert "outcome unknown" in lost.body["error"]["message"]
    for _ in range(50):  # a 503 (the replica slower than wait_timeout) is sent again
        done = await safe.post(f"/v1/tickets/{body['ticket_id']}/cancel")
        if done.status != 503:
            break
        await asyncio.sleep(0.05)
    assert done.status == 200, done.body
    assert done.body["released"] == sold.body["total_cost"]
    assert await safe.staked(body["grids"][0]["numbers"], draw) == 0


async def test_default_mode_never_sends_wait(fast: Client, primary: RedisServer,
                                             replica: RedisServer) -> None:
    """In default mode sales and cancels send no WAIT at all."""
    client = primary.client()
    client.config_resetstat()
    body = ticket(grid(31))
    sold = await fast.sell(body)
    assert sold.status == 200, sold.body
    assert (await fast.sell(body)).status == 200  # a replay
    assert await fast.staked(body["grids"][0]["numbers"], sold.body["draws"][0]) == 500
    assert (await fast.post(f"/v1/tickets/{body['ticket_id']}/cancel")).status == 200
    assert wait_calls(client) == 0


async def test_concurrent_sales_all_confirmed(safe: Client, primary: RedisServer,
                                              replica: RedisServer) -> None:
    """30 concurrent sales in replicas:1 mode all answer 200, with at most one WAIT a request
    (one sent again after a 503 — the replica slower than `wait_timeout` on a loaded
    machine, as the contract allows — is another request)."""
    await in_sync(primary)
    client = primary.client()
    client.config_resetstat()
    bodies = [ticket(grid(41, 100)) for _ in range(30)]
    statuses: list[int] = []
    replies = await asyncio.gather(*[safe.sell_until_decided(b, statuses=statuses)
                                     for b in bodies])
    assert [r.status for r in replies] == [200] * 30
    assert 1 <= wait_calls(client) <= len(statuses)
    assert await safe.staked(bodies[0]["grids"][0]["numbers"], replies[0].body["draws"][0]) == 3000


async def test_one_wait_serves_a_tick(primary: RedisServer, replica: RedisServer) -> None:
    """The WAITs asked for in one tick are one command, after every write of the tick."""
    redis_client = primary.client()
    coalescer = Coalescer(primary.url, timeout_s=2)
    await coalescer.call("PING")
    redis_client.config_resetstat()
    writes = [coalescer.submit("INCR", f"durability:{i}") for i in range(10)]
    acks = await asyncio.gather(*[coalescer.wait_replicas(1, 1000) for _ in range(10)])
    assert acks == [1] * 10
    assert await asyncio.gather(*writes) == [1] * 10
    assert wait_calls(redis_client) == 1
    assert replica.client().get("durability:9") == b"1"
    await coalescer.aclose()


async def test_a_blocked_wait_is_not_a_dead_redis(primary: RedisServer,
                                                  replica: RedisServer) -> None:
    """A WAIT longer than the Redis timeout, and the commands behind it, are answered."""
    coalescer = Coalescer(primary.url, timeout_s=0.1)
    await coalescer.call("SET", "durability:blocked", 1)
    assert replica.process is not None
    replica.process.send_signal(signal.SIGSTOP)
    try:
        waiting = asyncio.ensure_future(coalescer.wait_replicas(1, 300))
        await asyncio.sleep(0.02)  # the WAIT goes out in a batch of its own, the GET after
        behind = coalescer.submit("GET", "durability:blocked")
        assert await waiting == 0
        assert await behind == b"1"
    finally:
        replica.process.send_signal(signal.SIGCONT)
    await coalescer.aclose()


async def test_cluster_waits_on_every_primary(redis_cluster: RedisCluster) -> None:
    """On Redis Cluster one WAIT goes to each primary; the answer is the fewest acks (this
    cluster has no replicas: 0)."""
    clients = [s.client() for s in redis_cluster.servers]
    cluster = ClusterCoalescer(redis_cluster.url, timeout_s=2)
    await asyncio.gather(*[cluster.call("SET", f"durability:{i}", i) for i in range(20)])
    for c in clients:
        c.config_resetstat()
    assert await cluster.wait_replicas(1, 10) == 0
    assert [wait_calls(c) for c in clients] == [1] * len(clients)
    await cluster.aclose()


@pytest.fixture(scope="module", params=["redis", "valkey"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[RedisServer, RedisServer]]:
    """A primary and its replica of the Redis the project ships against (Debian's 7.0) and
    of the embedded valkey (8.1), which count a connection's writes for WAIT differently."""
    binary = None if request.param == "redis" else server_binary()
    primary = RedisServer(binary=binary).start()
    replica = RedisServer(binary=binary, replica_of=primary).start()
    yield primary, replica
    replica.stop()
    primary.stop()


@contextlib.contextmanager
def frozen(replica: RedisServer) -> Iterator[None]:
    """The replica stopped: still connected to its primary, acknowledging nothing (what a
    frozen replication link looks like from the primary)."""
    assert replica.process is not None
    replica.process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        replica.process.send_signal(signal.SIGCONT)


async def test_a_read_is_confirmed_only_once_the_replica_has_what_it_saw(
        pair: tuple[RedisServer, RedisServer]) -> None:
    """What one connection read of another's write is confirmed only when the replica has
    that write: a connection that never wrote gets 0 acknowledgements, not a free pass."""
    primary, replica = pair
    writer = Coalescer(primary.url, timeout_s=1)
    reader = Coalescer(primary.url, timeout_s=1)
    assert await reader.call("GET", "durability:seen") is None  # connected, nothing written
    with frozen(replica):
        await writer.call("SET", "durability:seen", "1")
        assert await reader.call("GET", "durability:seen") == b"1"
        assert await reader.wait_replicas(1, 100) == 0
    assert await reader.wait_replicas(1, 1000) == 1
    await writer.aclose()
    await reader.aclose()


async def test_no_answer_reports_what_the_replica_lacks(
        pair: tuple[RedisServer, RedisServer], config: str,
        http: aiohttp.ClientSession) -> None:
    """The issue's case: with the replica frozen, the sale is 503, and so are its GET, its
    replay and its cancel on the selling process and on another one; once the replica has
    it, they all answer the one decision."""
    primary, replica = pair
    one, two = (ServiceProcess(config, primary.url).start() for _ in range(2))
    try:
        a, b = Client(http, one.base_url), Client(http, two.base_url)
        body = ticket(grid(41))
        path = f"/v1/tickets/{body['ticket_id']}"
        with frozen(replica):
            replies = [await a.sell(body), await a.get(path), await b.get(path),
                       await b.sell(body), await b.post(f"{path}/cancel")]
        assert [r.status for r in replies] == [503] * 5, [r.body for r in replies]
        stored = await b.get(path)
        assert stored.status == 200, stored.body
        assert stored.body["status"] == "accepted"
        cancelled = stored.body.pop("cancelled", None)  # the cancel's outcome was unknown
        assert stored.body.pop("state", None) == ("cancelled" if cancelled else None)
        assert (await a.sell(body)).body == stored.body
        staked = await a.staked(body["grids"][0]["numbers"], stored.body["draws"][0])
        assert staked == (0 if cancelled else 500)
    finally:
        one.stop()
        two.stop()


async def test_no_refusal_rests_on_what_the_replica_lacks(
        pair: tuple[RedisServer, RedisServer], config: str,
        http: aiohttp.ClientSession) -> None:
    """A refusal reports a decision too: with the replica frozen, a stop that is on the
    primary alone refuses nothing on another process (503, not 422 draw_closed or 409
    not_cancellable), a ticket id held by an unconfirmed sale is no 409 conflict, and a
    draw is not shown closed; once the replica has it all, they answer as recorded."""
    primary, replica = pair
    one, two = (ServiceProcess(config, primary.url).start() for _ in range(2))
    try:
        a, b = Client(http, one.base_url), Client(http, two.base_url)
        draw = await a.current() + 1
        held = ticket(grid(51), first_draw=draw)
        assert (await a.sell(held)).status == 200
        unconfirmed = ticket(grid(61), first_draw=draw)
        other = {**unconfirmed, "grids": grid(61, stake=1000)}
        with frozen(replica):
            replies = [
                await a.sell(unconfirmed),
                await b.sell(other),
                await a.post(f"/v1/games/fdj-keno/draws/{draw}/close", token="admin"),
                await b.sell(ticket(grid(31), first_draw=draw)),
                await b.post(f"/v1/tickets/{held['ticket_id']}/cancel"),
                await b.get(f"/v1/games/fdj-keno/draws/{draw}", token="admin"),
            ]
        assert [r.status for r in replies] == [503] * len(replies), [r.body for r in replies]
        closed = await b.get(f"/v1/games/fdj-keno/draws/{draw}", token="admin")
        assert closed.body["status"] == "closed"
        refused = await b.sell(ticket(grid(31), first_draw=draw))
        assert (refused.status, refused.body["error"]["code"]) == (422, "draw_closed")
        conflict = await b.sell(other)
        assert (conflict.status, conflict.body["error"]["code"]) == (
            409, "idempotency_conflict")
    finally:
        one.stop()
        two.stop()
