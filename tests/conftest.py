"""Shared fixtures: a real redis-server per session, the service on real HTTP per test."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import hypothesis
import pytest
import redis

from capsvc.config import Settings, load_settings
from capsvc.http.server import Service, Serving, build, prepare, start_serving
from capsvc.ops.workers import listen
from capsvc.service.janitor import Janitor
from tests.support.servers import RedisCluster, RedisServer
from tests.support.service import ServiceProcess

# No property test has a wall-clock deadline, nor fails when drawing its examples is slow:
# how long an example takes is the machine's load, not what a test proves.
hypothesis.settings.register_profile(
    "capsvc", deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile("capsvc")

CONFIG = Path(__file__).parent / "capsvc-test.toml"
TOKENS = {"fr": "t-fr", "pf": "t-pf", "read": "t-read", "admin": "t-admin", "ma": "t-ma",
          "mt": "t-mt"}
TEN = [3, 7, 12, 18, 25, 33, 41, 56, 60, 70]
_ids = itertools.count(1)


class _Ahead:
    """A clock a second ahead of another (the janitor's cutoff: see `past_deadline`)."""

    def __init__(self, clock: Any) -> None:
        self._clock = clock

    def now(self) -> int:
        return int(self._clock.now()) + 1000


def past_deadline(janitor: Janitor) -> Janitor:
    """A janitor as it acts once the deadline has passed. Time is Redis TIME, which a test
    cannot move: the deadline is moved to now instead (the functions decide by Redis TIME),
    and the cutoff it pages the index by is taken a second ahead, since the process's
    estimate of Redis TIME may lag an entry made a millisecond ago by about a round trip."""
    later = copy.copy(janitor)
    later.deadline_ms = 0
    later.clock = _Ahead(janitor.clock)  # type: ignore[assignment]
    return later


def new_id(prefix: str = "T") -> str:
    return f"{prefix}-{next(_ids):06d}"


def ticket(grids: list[dict[str, Any]] | None = None, **fields: Any) -> dict[str, Any]:
    """A valid FDJ ticket body; keyword arguments override or add fields."""
    body: dict[str, Any] = {
        "ticket_id": new_id(),
        "game": "fdj-keno",
        "grids": grids if grids is not None else [{"numbers": TEN[:8], "stake": 500}],
    }
    body.update(fields)
    return body


@dataclass
class Reply:
    status: int
    headers: Any
    body: Any
    raw: bytes


class Client:
    """An HTTP client of the service under test, speaking as one channel's token."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self.session = session
        self.base_url = base_url

    async def request(self, method: str, path: str, json: Any = None, *, data: Any = None,
                      token: str | None = "fr", headers: dict[str, str] | None = None) -> Reply:
        h = dict(headers or {})
        if token is not None:
            h["Authorization"] = f"Bearer {TOKENS.get(token, token)}"
        async with self.session.request(method, self.base_url + path, json=json, data=data,
                                        headers=h) as resp:
            raw = await resp.read()
            ctype = resp.headers.get("Content-Type", "")
            body = await resp.json() if ctype.startswith("application/json") else raw
            return Reply(resp.status, resp.headers, body, raw)

    async def get(self, path: str, **kw: Any) -> Reply:
        return await self.request("GET", path, **kw)

    async def post(self, path: str, json: Any = None, **kw: Any) -> Reply:
        return await self.request("POST", path, json, **kw)

    async def sell(self, body: dict[str, Any], token: str = "fr") -> Reply:
        return await self.post("/v1/tickets", body, token=token)

    async def sell_until_decided(self, body: dict[str, Any], *, tries: int = 50,
                                 pause_s: float = 0.05, statuses: list[int] | None = None
                                 ) -> Reply:
        """The same sale sent again while it is answered 503 (as the contract says; the
        pause a shortened Retry-After), at most `tries` times: the last reply. Every
        status answered goes to `statuses`."""
        for attempt in range(tries):
            if attempt:
                await asyncio.sleep(pause_s)
            reply = await self.sell(body)
            if statuses is not None:
                statuses.append(reply.status)
            if reply.status != 503:
                break
        return reply

    async def read(self, path: str, *, tries: int = 100, pause_s: float = 0.05) -> Reply:
        """`GET path` as admin, sent again while it answers 503 (nothing was changed: a
        Redis call slower than the Redis timeout, on a loaded machine), at most `tries`
        times: the last reply."""
        for attempt in range(tries):
            if attempt:
                await asyncio.sleep(pause_s)
            reply = await self.get(path, token="admin")
            if reply.status != 503:
                break
        return reply

    async def current(self, game: str = "fdj-keno") -> int:
        reply = await self.read(f"/v1/games/{game}/draws/current")
        assert reply.status == 200, reply.body
        draw: int = reply.body["draw"]
        return draw

    async def staked(self, numbers: list[int], draw: int, game: str = "fdj-keno") -> int:
        path = f"/v1/games/{game}/draws/{draw}/combinations/{'-'.join(map(str, numbers))}"
        reply = await self.read(path)
        assert reply.status == 200, reply.body
        staked: int = reply.body["staked"]
        return staked


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    cluster = RedisCluster().start()
    yield cluster
    cluster.stop()


@pytest.fixture(params=["standalone", "cluster"])
def redis_backend(request: pytest.FixtureRequest) -> RedisServer | RedisCluster:
    """Each test that uses it runs on a standalone Redis and on a 3-primary Redis Cluster."""
    fixture = "redis_server" if request.param == "standalone" else "redis_cluster"
    backend: RedisServer | RedisCluster = request.getfixturevalue(fixture)
    return backend


@pytest.fixture
def redis_db(redis_backend: RedisServer | RedisCluster) -> Iterator[Any]:
    """A client of the test's Redis (standalone or cluster), emptied; functions stay."""
    client = redis_backend.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def standalone_db(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """The session's standalone Redis, emptied, for tests that need one node."""
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def base_settings() -> Settings:
    return load_settings(CONFIG)


@pytest.fixture
def settings(base_settings: Settings, tmp_path: Path) -> Settings:
    """The test configuration, with a journal directory of the test's own (a service
    restores its journal directory at start: another test's decisions must not come back)."""
    return dataclasses.replace(base_settings, journal_dir=str(tmp_path / "journal"))


@pytest.fixture
def two_services(redis_backend: RedisServer | RedisCluster, redis_db: Any) -> Iterator[list[str]]:
    """Two `capsvc serve` processes over the test's Redis; their base URLs."""
    services = [ServiceProcess(str(CONFIG), redis_backend.url).start() for _ in range(2)]
    yield [s.base_url for s in services]
    for s in services:
        s.stop()


@asynccontextmanager
async def services(variants: list[Settings], redis_url: str) -> AsyncIterator[list[Client]]:
    """One service in this process per settings, on one Redis, each with its client."""
    started = []
    async with aiohttp.ClientSession() as session:
        try:
            clients = []
            for variant in variants:
                svc = build(variant, redis_url)
                runner, url = await start_service(svc)
                started.append((runner, svc))
                clients.append(Client(session, url))
            yield clients
        finally:
            for runner, svc in started:
                await runner.cleanup()
                await svc.redis.aclose()


async def start_service(svc: Service) -> tuple[Serving, str]:
    await prepare(svc)
    sock = listen("127.0.0.1", 0)
    runner = await start_serving(svc, sock)  # as `capsvc serve` does
    return runner, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
async def service(settings: Settings, redis_backend: RedisServer | RedisCluster,
                  redis_db: Any) -> AsyncIterator[tuple[Service, str]]:
    """The service in this process, on a real port, over the test's Redis."""
    svc = build(settings, redis_backend.url)
    runner, url = await start_service(svc)
    yield svc, url
    await runner.cleanup()
    await svc.redis.aclose()


@pytest.fixture
async def client(service: tuple[Service, str]) -> AsyncIterator[Client]:
    async with aiohttp.ClientSession() as session:
        yield Client(session, service[1])
