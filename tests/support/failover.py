"""Failovers under sales, for tests/failover and bench/failover.py.

`Sellers` sell over HTTP as a sales system must (every 503 sent again, same ticket id and
body), `audit` checks what they were answered against the surviving service, and
`partition_scenario`, `sentinel_scenario` and `cluster_scenario` run the scenarios (the
servers they use: tests.support.servers; the frozen link: tests.support.faults).
"""

from __future__ import annotations

import hashlib
import http.client
import itertools
import json
import os
import random
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from tests.support.faults import PartitionProxy
from tests.support.servers import (
    RedisCluster,
    RedisSentinels,
    RedisServer,
    _wait,
    server_version,
)
from tests.support.service import ServiceProcess

# -- failover: sellers, an audit, the scenarios ----------------------------------------------
#
# Shared by tests/failover and bench/failover.py. Sellers sell over HTTP the way a sales
# system must (every 503, timeout and broken connection is sent again, same ticket id, same
# body, until a decision comes) and keep every decision they were answered; after the
# failover, `audit` asks the surviving service for each of them and for every counter.

SELLER_TOKEN = "failover-seller"
"""Bearer token of the sales channel of `failover_config` (sell and read)."""
OPS_TOKEN = "failover-ops"
"""Bearer token of its operations channel (read and admin)."""
FAILOVER_GAME = "hot-keno"
FAILOVER_CAP = 2000
"""The cap of `FAILOVER_GAME` (20 €): a few sales bring a combination to it."""
HOT_COMBINATIONS: tuple[tuple[int, ...], ...] = (
    (3, 7, 12, 18, 25, 33, 41, 56),
    (1, 2, 3, 4, 5, 6, 7, 8),
    (10, 20, 30, 40, 50, 60, 65, 70),
    (5, 15, 25, 35, 45, 55, 62, 69, 70),
)
"""The hot set the sellers play: combinations of 8 and 9 numbers, all capped."""


def failover_config(durability: str = "default", *, cap: int = FAILOVER_CAP,
                    journal: bool = True) -> str:
    """A `capsvc serve` configuration (TOML text) for failover runs: the game
    `FAILOVER_GAME` (FDJ rules, a cap of `cap`), channels for `SELLER_TOKEN` and
    `OPS_TOKEN`, the given `[redis] durability`, short timeouts so that a dead primary is a
    503 within a fraction of a second; `journal=False` turns the journal off."""

    def digest(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    return f"""\
[redis]
durability = "{durability}"
timeout = "250ms"
wait_timeout = "200ms"

[server]
request_timeout = "2s"
drain_delay = "100ms"

[janitor]
pending_deadline = "10s"
interval = "1s"

[journal]
enabled = {"true" if journal else "false"}
settle = "0s"     # one capsvc (its workers share a journal): no other host to wait for

[[games]]
id = "{FAILOVER_GAME}"
preset = "fdj-keno-2008"
cap_limit = {cap}

[[channels]]
id = "failover-seller"
token_sha256 = "{digest(SELLER_TOKEN)}"
games = ["{FAILOVER_GAME}"]
scopes = ["sell", "read"]

[[channels]]
id = "failover-ops"
token_sha256 = "{digest(OPS_TOKEN)}"
games = ["{FAILOVER_GAME}"]
scopes = ["read", "admin"]
"""


def write_failover_config(directory: str | os.PathLike[str], durability: str = "default",
                          *, cap: int = FAILOVER_CAP, journal: bool = True) -> str:
    """`failover_config` written to `directory`/capsvc-failover.toml; its path."""
    path = Path(directory) / "capsvc-failover.toml"
    path.write_text(failover_config(durability, cap=cap, journal=journal))
    return str(path)


Transport = (OSError, http.client.HTTPException, ValueError)
"""What a request may raise instead of answering: refused, reset, timed out, cut short,
not JSON."""


class HttpClient:
    """Blocking JSON-over-HTTP client for one thread: one keep-alive connection per base
    URL, dropped on any transport error (the next request opens a new one)."""

    def __init__(self, timeout_s: float = 3.0) -> None:
        self.timeout_s = timeout_s
        self._conns: dict[str, http.client.HTTPConnection] = {}

    def request(self, base_url: str, method: str, path: str, *, token: str | None = None,
                body: Any = None) -> tuple[int, Any]:
        """The status and the decoded JSON body (None if empty); raises `Transport`."""
        conn = self._conns.get(base_url)
        if conn is None:
            u = urlsplit(base_url)
            conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80,
                                              timeout=self.timeout_s)
            self._conns[base_url] = conn
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body),
                         headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            if resp.will_close:
                self._drop(base_url)
            return resp.status, json.loads(raw) if raw else None
        except BaseException:
            self._drop(base_url)
            raise

    def _drop(self, base_url: str) -> None:
        conn = self._conns.pop(base_url, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for url in list(self._conns):
            self._drop(url)


def current_draw(base_url: str, game: str = FAILOVER_GAME, token: str = SELLER_TOKEN,
                 timeout_s: float = 10) -> int:
    """The draw on sale, asked of the service (retried while it answers 503)."""
    client = HttpClient()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status, body = client.request(base_url, "GET", f"/v1/games/{game}/draws/current",
                                          token=token)
            if status == 200:
                return int(body["draw"])
        except Transport:
            status = 0
        if time.monotonic() > deadline:
            raise TimeoutError(f"no current draw from {base_url} (last status {status})")
        time.sleep(0.1)


@dataclass(frozen=True)
class Sale:
    """A decision a seller was answered: a 200 to `POST /v1/tickets`."""

    ticket_id: str
    request: dict[str, Any]
    decision: dict[str, Any]
    sent_at: float
    """When the attempt that got the 200 was sent (time.monotonic())."""
    at: float
    """When the 200 came (time.monotonic())."""
    tries: int


def combination_key(numbers: Sequence[int]) -> str:
    """A combination as capsvc's path segment names it: ascending numbers joined by -."""
    return "-".join(str(n) for n in sorted(numbers))


class Sellers:
    """`count` concurrent sellers, each a thread selling one ticket after another on a hot
    set (every `combinations` on every `draws`, 1 to `max_grids` grids, random stakes), over
    HTTP. The k-th draw is played with weight 1/(k+1)^`skew`: the first draws reach their
    cap within a second, the last ones still have room when the failover comes.

    Each ticket is sent until it gets a decision: every 503, 500, timeout and connection
    error is answered by the same request again (same ticket id, same body), after
    `retry_pause_s`, rotating over `urls`, for up to `give_up_s`. The pause is shorter than
    the `Retry-After: 1` a 503 carries, so that the gaps measured are the service's, not
    the client's. Every 200 is kept (`acknowledged`); any other answer is `unexpected` (a
    bug of the harness or of the service). `mark(name)` notes when something happened, for
    `longest_gap` and `resumed_after`.
    """

    def __init__(self, urls: Sequence[str], draws: Sequence[int], *,
                 game: str = FAILOVER_GAME,
                 combinations: Sequence[Sequence[int]] = HOT_COMBINATIONS,
                 token: str = SELLER_TOKEN, count: int = 8,
                 stakes: Sequence[int] = (100, 200, 500, 1000), max_grids: int = 2,
                 skew: float = 1.0, pause_s: float = 0.02, retry_pause_s: float = 0.1,
                 timeout_s: float = 3.0, give_up_s: float = 60.0, seed: int = 0) -> None:
        self.urls = list(urls)
        self.draws = list(draws)
        self.game = game
        self.combinations = [tuple(sorted(c)) for c in combinations]
        self.token = token
        self.count = count
        self.stakes = tuple(stakes)
        self.max_grids = min(max_grids, len(self.combinations))
        self.weights = [1 / (k + 1) ** skew for k in range(len(self.draws))]
        self.pause_s = pause_s
        self.retry_pause_s = retry_pause_s
        self.timeout_s = timeout_s
        self.give_up_s = give_up_s
        self.seed = seed
        self.prefix = f"F{random.Random().getrandbits(32):08x}"
        self.acknowledged: list[Sale] = []
        self.requests: dict[str, dict[str, Any]] = {}
        """Every ticket sent at least once, by id."""
        self.unanswered: list[str] = []
        """Tickets given up after `give_up_s` (or abandoned by stop()) with no decision."""
        self.unexpected: list[tuple[str, int, Any]] = []
        self.retries = 0
        self.marks: dict[str, float] = {}
        self.started_at = 0.0
        self.stopped_at = 0.0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._abandon = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> Sellers:
        self.started_at = time.monotonic()
        self._threads = [threading.Thread(target=self._seller, args=(i,), daemon=True,
                                          name=f"seller-{i}") for i in range(self.count)]
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout_s: float = 60) -> None:
        """No new ticket; wait for each seller's ticket in progress to get its decision
        (at most `timeout_s`, then they are abandoned: `unanswered`). Once: a second call
        changes nothing."""
        if self._stopping.is_set():
            return
        self.stopped_at = time.monotonic()
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._abandon.set()
        for t in self._threads:
            t.join(10)

    def __enter__(self) -> Sellers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def mark(self, name: str) -> float:
        """Note that `name` happens now; the instant (time.monotonic())."""
        at = self.marks[name] = time.monotonic()
        return at

    def wait_acknowledged(self, n: int, timeout_s: float = 30) -> None:
        """Until at least `n` decisions have been answered in all."""
        _wait(lambda: len(self.acknowledged) >= n, timeout_s, f"{n} acknowledged sales")

    def longest_gap(self) -> float:
        """The longest time without an acknowledged sale, seconds, between the start and
        the stop (the stop, not the last answer: answers that never come make a gap)."""
        times = sorted(s.at for s in self.acknowledged if s.at <= self.stopped_at)
        edges = [self.started_at, *times, self.stopped_at or time.monotonic()]
        return max(b - a for a, b in itertools.pairwise(edges))

    def resumed_after(self, mark: str) -> float | None:
        """Seconds from `mark` to the first 200 to an attempt sent after it (None: never):
        how long after a failure started the sales went again."""
        at = self.marks[mark]
        later = [s.at for s in self.acknowledged if s.sent_at >= at]
        return min(later) - at if later else None

    def acknowledged_between(self, start: str, end: str) -> int:
        """Decisions answered between two marks."""
        t0, t1 = self.marks[start], self.marks[end]
        return sum(t0 <= s.at < t1 for s in self.acknowledged)

    def sent_and_acknowledged_between(self, start: str, end: str) -> int:
        """Decisions answered between two marks to attempts sent after the first: what was
        decided and confirmed in that interval (an answer that comes just after a mark may
        have been confirmed just before it)."""
        t0, t1 = self.marks[start], self.marks[end]
        return sum(s.sent_at >= t0 and s.at < t1 for s in self.acknowledged)

    # -- inside the threads ----------------------------------------------------------------

    def _ticket(self, rng: random.Random, ticket_id: str) -> dict[str, Any]:
        combos = rng.sample(self.combinations, rng.randint(1, self.max_grids))
        draw = rng.choices(self.draws, self.weights)[0]
        return {"ticket_id": ticket_id, "game": self.game, "first_draw": draw,
                "grids": [{"numbers": list(c), "stake": rng.choice(self.stakes)}
                          for c in combos]}

    def _seller(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        client = HttpClient(self.timeout_s)
        n = 0
        try:
            while not self._stopping.is_set():
                n += 1
                self._sell(client, i, self._ticket(rng, f"{self.prefix}-{i}-{n}"))
                self._stopping.wait(self.pause_s)
        finally:
            client.close()

    def _sell(self, client: HttpClient, i: int, body: dict[str, Any]) -> None:
        tid = body["ticket_id"]
        with self._lock:
            self.requests[tid] = body
        first = time.monotonic()
        tries = 0
        while True:
            url = self.urls[(i + tries) % len(self.urls)]
            tries += 1
            sent = time.monotonic()
            try:
                status, answer = client.request(url, "POST", "/v1/tickets", token=self.token,
                                                body=body)
            except Transport:
                status, answer = 0, None
            if status == 200 and isinstance(answer, dict):
                with self._lock:
                    self.acknowledged.append(Sale(tid, body, answer, sent, time.monotonic(),
                                                  tries))
                return
            if status not in (0, 500, 503):
                with self._lock:
                    self.unexpected.append((tid, status, answer))
                return
            with self._lock:
                self.retries += 1
            if time.monotonic() - first > self.give_up_s or self._abandon.is_set():
                with self._lock:
                    self.unanswered.append(tid)
                return
            self._abandon.wait(self.retry_pause_s)


@dataclass
class Audit:
    """What the surviving service holds of what the sellers were answered."""

    acknowledged: int
    """Decisions the sellers were answered (200)."""
    lost: dict[str, str] = field(default_factory=dict)
    """Acknowledged tickets the service does not show with the same decision: ticket id ->
    what `GET /v1/tickets/{id}` answered (a status, or "changed")."""
    counters: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    """(combination, draw) -> (staked on the service, accepted stakes acknowledged)."""
    cap: int | None = None
    unreadable: list[tuple[str, int]] = field(default_factory=list)
    """Counters the service would not tell (status)."""

    @property
    def mismatched(self) -> list[tuple[str, int]]:
        """Counters that are not the sum of the acknowledged accepted stakes."""
        return [k for k, (staked, acked) in self.counters.items() if staked != acked]

    @property
    def undercounted(self) -> list[tuple[str, int]]:
        """Counters below the acknowledged accepted stakes: a stake answered and not counted
        (the loss that lets the cap be passed)."""
        return [k for k, (staked, acked) in self.counters.items() if staked < acked]

    @property
    def over_cap(self) -> list[tuple[str, int]]:
        """(combination, draw) sold beyond the cap: counted there, or acknowledged as
        accepted to the sellers (a sale answered, lost in a failover, then sold again)."""
        if self.cap is None:
            return []
        return [k for k, (staked, acked) in self.counters.items()
                if max(staked, acked) > self.cap]


def audit(base_url: str, sellers: Sellers, *, timeout_s: float = 30,
          threads: int = 8) -> Audit:
    """Ask `base_url` for every ticket the sellers were answered (found, same decision?)
    and for every counter of their hot set (staked = acknowledged accepted stakes ≤ cap?).
    503s are asked again until `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    local = threading.local()

    def get(path: str) -> tuple[int, Any]:
        client: HttpClient | None = getattr(local, "client", None)
        if client is None:
            client = local.client = HttpClient()
        while True:
            try:
                status, body = client.request(base_url, "GET", path, token=sellers.token)
            except Transport:
                status, body = 0, None
            if status not in (0, 500, 503) or time.monotonic() > deadline:
                return status, body
            time.sleep(0.05)

    def check(sale: Sale) -> tuple[str, str | None]:
        status, body = get(f"/v1/tickets/{quote(sale.ticket_id)}")
        if status != 200:
            return sale.ticket_id, str(status)
        if not isinstance(body, dict):
            return sale.ticket_id, "not a decision"
        body.pop("cancelled", None)
        body.pop("state", None)
        return sale.ticket_id, None if body == sale.decision else "changed"

    acked: dict[tuple[str, int], int] = {
        (combination_key(c), d): 0 for c in sellers.combinations for d in sellers.draws}
    for sale in sellers.acknowledged:
        draw = int(sale.request["first_draw"])
        for g in sale.decision["grids"]:
            if g["status"] == "accepted":
                key = (combination_key(g["numbers"]), draw)
                acked[key] = acked.get(key, 0) + int(sale.request["grids"][g["index"]]["stake"])

    result = Audit(acknowledged=len(sellers.acknowledged))
    with ThreadPoolExecutor(threads) as pool:
        for tid, problem in pool.map(check, list(sellers.acknowledged)):
            if problem is not None:
                result.lost[tid] = problem
        paths = {k: f"/v1/games/{sellers.game}/draws/{k[1]}/combinations/{k[0]}"
                 for k in acked}
        for key, (status, body) in zip(paths, pool.map(get, paths.values()), strict=True):
            if status != 200:
                result.unreadable.append((key[0], status))
                continue
            result.cap = body["cap"]
            result.counters[key] = (int(body["staked"] or 0), acked[key])
    return result


class ReadinessProbe:
    """`GET /readyz` every `interval_s` in a thread; `samples` are (time.monotonic(),
    status), status 0 when no answer came."""

    def __init__(self, base_url: str, interval_s: float = 0.1) -> None:
        self.base_url = base_url
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ReadinessProbe:
        self._thread = threading.Thread(target=self._run, daemon=True, name="readyz")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(10)

    def between(self, start: float, end: float) -> list[int]:
        """The statuses seen from `start` to `end` (time.monotonic())."""
        return [status for at, status in self.samples if start <= at <= end]

    def _run(self) -> None:
        client = HttpClient(timeout_s=1.0)
        while not self._stopping.is_set():
            try:
                status, _ = client.request(self.base_url, "GET", "/readyz")
            except Transport:
                status = 0
            self.samples.append((time.monotonic(), status))
            self._stopping.wait(self.interval_s)
        client.close()


@dataclass
class FailoverRun:
    """One failover scenario's run: the sellers (what they were answered, when), the
    audit of the surviving service, and for the sentinel scenario its readiness."""

    scenario: str
    durability: str
    binary: str
    sellers: Sellers
    audit: Audit
    readiness: list[tuple[float, int]] = field(default_factory=list)
    service_restarted: bool = False

    @property
    def lost(self) -> int:
        return len(self.audit.lost)

    @property
    def over_cap(self) -> int:
        return len(self.audit.over_cap)

    @property
    def longest_gap_s(self) -> float:
        return self.sellers.longest_gap()

    def resumed_after_s(self, mark: str = "kill") -> float | None:
        return self.sellers.resumed_after(mark)

    def summary(self) -> dict[str, Any]:
        """The figures of the run, for a report."""
        return {
            "scenario": self.scenario, "durability": self.durability,
            "server": server_version(self.binary),
            "acknowledged": self.audit.acknowledged, "lost": self.lost,
            "over_cap": self.over_cap, "mismatched": len(self.audit.mismatched),
            "longest_gap_s": round(self.longest_gap_s, 2),
            "retries": self.sellers.retries, "unanswered": len(self.sellers.unanswered),
            "unexpected": len(self.sellers.unexpected),
        }


@contextmanager
def _stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def _sell_around(service: ServiceProcess, stack: ExitStack, *, sellers: int, n_draws: int,
                 seed: int, urls: Sequence[str] | None = None) -> Sellers:
    draw = current_draw(service.base_url)
    # The draw on sale may close during the run: sell the next ones.
    crowd = Sellers(list(urls or [service.base_url]),
                    [draw + 1 + i for i in range(n_draws)], count=sellers, seed=seed)
    stack.callback(crowd.stop, 0)
    return crowd.start()


def partitioned_pair(stack: ExitStack, binary: str | None = None
                     ) -> tuple[RedisServer, PartitionProxy, RedisServer]:
    """A primary and its replica replicating through a PartitionProxy, stopped with
    `stack`."""
    primary = RedisServer(binary=binary).start()
    stack.callback(primary.stop)
    proxy = PartitionProxy("127.0.0.1", primary.port).start()
    stack.callback(proxy.stop)
    replica = RedisServer(binary=binary, replica_of=primary, via=proxy).start()
    stack.callback(replica.stop)
    return primary, proxy, replica


def partition_scenario(durability: str, *, binary: str | None = None, warmup_s: float = 1.5,
                       freeze_s: float = 2.0, after_s: float = 2.0, sellers: int = 8,
                       n_draws: int = 30, seed: int = 0, how: str = "restart",
                       journal: bool = True) -> FailoverRun:
    """Scenarios a and b: a primary and one replica linked through a PartitionProxy,
    capsvc on the primary, sellers selling. The link freezes `freeze_s` before the primary
    is killed (SIGKILL); the replica is promoted (REPLICAOF NO ONE), and the killed primary
    comes back as the new primary's replica (so that `replicas:1` can confirm again). Sales
    go on for `after_s`, then the audit. `how`: "restart", capsvc is restarted on the
    promoted replica (same port, same journal directory); "redirect", capsvc is not
    restarted: it reaches Redis through an address (a proxy) that now leads to the promoted
    replica, as a DNS name or a virtual IP moved over would. `journal=False`: capsvc runs
    with `[journal] enabled = false` (what the journal is measured against).

    Marks: "freeze", "kill", "promoted", "restarted" (capsvc on the new primary, or its
    address moved), "rejoined" (the old primary is its replica)."""
    if how not in ("restart", "redirect"):
        raise ValueError(f"how is 'restart' or 'redirect', not {how!r}")
    with _stack() as stack:
        tmp = tempfile.mkdtemp(prefix="capsvc-failover-")
        config = write_failover_config(tmp, durability, journal=journal)
        env = {"CAPSVC_JOURNAL_DIR": str(Path(tmp) / "journal")}
        primary, proxy, replica = partitioned_pair(stack, binary)
        front: PartitionProxy | None = None
        url = primary.url
        if how == "redirect":
            front = PartitionProxy("127.0.0.1", primary.port).start()
            stack.callback(front.stop)
            url = f"redis://127.0.0.1:{front.port}/0"
        services = [ServiceProcess(config, url, env=env).start()]
        stack.callback(lambda: services[-1].stop())
        crowd = _sell_around(services[0], stack, sellers=sellers, n_draws=n_draws, seed=seed)
        crowd.wait_acknowledged(1)
        time.sleep(warmup_s)
        proxy.freeze()
        crowd.mark("freeze")
        time.sleep(freeze_s)
        primary.kill()
        crowd.mark("kill")
        replica.promote()
        crowd.mark("promoted")
        if front is not None:
            front.retarget("127.0.0.1", replica.port)
            front.cut()
        else:
            services[0].stop()
            services.append(ServiceProcess(config, replica.url, port=services[0].port,
                                           env=env).start())
        crowd.mark("restarted")
        primary.follow(replica)
        crowd.mark("rejoined")
        time.sleep(after_s)
        crowd.stop()
        result = audit(services[-1].base_url, crowd)
        name = "partition" if how == "restart" else "partition-redirect"
        return FailoverRun(name, durability, primary.binary, crowd, result,
                           service_restarted=front is None)


def sentinel_scenario(durability: str, how: str = "kill", *, binary: str | None = None,
                      replicas: int = 2, warmup_s: float = 1.5, after_s: float = 3.0,
                      sellers: int = 8, n_draws: int = 30, workers: int = 2, seed: int = 0,
                      failover_timeout_s: float = 30, journal: bool = True) -> FailoverRun:
    """Scenario c: a primary and `replicas` replicas under 3 sentinels (quorum 2, down
    after 1 s); capsvc (`--workers`) on the `redis+sentinel://` URL, sellers selling and a
    readiness probe. `how`: "kill", the primary is killed (SIGKILL); "manual", `SENTINEL
    FAILOVER` while it stays up (it becomes a replica of the promoted one; meanwhile the
    other replica still acknowledges its writes). The sentinels promote a replica; capsvc
    is not restarted: it must follow the switch itself. Sales go on for `after_s` after the
    sentinels agree on the new primary, then the audit.

    Two replicas by default: with `replicas:1`, a primary with one replica has none left
    once it is promoted, and no sale could be confirmed until another replica joins.

    Marks: "kill", "switched" (every sentinel names the new primary)."""
    with _stack() as stack:
        tmp = tempfile.mkdtemp(prefix="capsvc-failover-")
        config = write_failover_config(tmp, durability, journal=journal)
        primary = RedisServer(binary=binary).start()
        stack.callback(primary.stop)
        for _ in range(replicas):
            stack.callback(RedisServer(binary=binary, replica_of=primary).start().stop)
        sentinels = RedisSentinels(primary, binary=binary).start()
        stack.callback(sentinels.stop)
        args = ("--workers", str(workers)) if workers > 1 else ()
        service = ServiceProcess(config, sentinels.url(), args=args).start()
        stack.callback(service.stop)
        probe = ReadinessProbe(service.base_url).start()
        stack.callback(probe.stop)
        crowd = _sell_around(service, stack, sellers=sellers, n_draws=n_draws, seed=seed)
        crowd.wait_acknowledged(1)
        time.sleep(warmup_s)
        old = primary.port
        if how == "kill":
            primary.kill()
        else:
            sentinels.client().execute_command(  # type: ignore[no-untyped-call]
                "SENTINEL", "FAILOVER", sentinels.service)
        crowd.mark("kill")
        sentinels.wait_failover(old, failover_timeout_s)
        crowd.mark("switched")
        time.sleep(after_s)
        crowd.stop()
        probe.stop()
        result = audit(service.base_url, crowd)
        name = "sentinel" if how == "kill" else "sentinel-manual"
        run = FailoverRun(name, durability, primary.binary, crowd, result,
                          readiness=list(probe.samples))
        assert service.process is not None
        if service.process.poll() is not None:
            raise RuntimeError(f"capsvc exited during the failover: {service.log.read_text()}")
        return run


def cluster_scenario(durability: str, how: str = "kill", *, binary: str | None = None,
                     warmup_s: float = 1.5, after_s: float = 2.0, sellers: int = 8,
                     n_draws: int = 30, seed: int = 0, lag_s: float = 0.0,
                     journal: bool = True) -> FailoverRun:
    """Scenario d: a Redis Cluster of 3 primaries with a replica each, capsvc on the
    `redis+cluster://` URL, sellers selling. `how="kill"`: a primary is killed (SIGKILL),
    the cluster promotes its replica, then the killed node is restarted and rejoins as the
    new primary's replica (so that `replicas:1` can confirm on that shard again).
    `how="failover"`: `CLUSTER FAILOVER` on a replica. Then `after_s` more of sales and the
    audit.

    `lag_s` (kill only): the victim's replica is cut off (`RedisServer.cut_replicas`) that
    long before the kill, so that the shard loses what it was answered meanwhile (what
    `default` durability risks); it is promoted all the same.

    Marks: "lag" (lag_s), "kill" (or "failover"), "promoted", "rejoined" (kill only)."""
    if how not in ("kill", "failover"):
        raise ValueError(f"how is 'kill' or 'failover', not {how!r}")
    with _stack() as stack:
        tmp = tempfile.mkdtemp(prefix="capsvc-failover-")
        config = write_failover_config(tmp, durability, journal=journal)
        cluster = RedisCluster(primaries=3, replicas=1, binary=binary).start()
        stack.callback(cluster.stop)
        service = ServiceProcess(config, cluster.url).start()
        stack.callback(service.stop)
        crowd = _sell_around(service, stack, sellers=sellers, n_draws=n_draws, seed=seed)
        crowd.wait_acknowledged(1)
        time.sleep(warmup_s)
        if how == "kill":
            victim = cluster.primary_nodes()[-1]
            successors = cluster.replicas_of(victim)  # asked before the victim refuses us
            if lag_s:
                victim.cut_replicas()
                crowd.mark("lag")
                time.sleep(lag_s)
            victim.kill()
            crowd.mark("kill")
            cluster.wait_promoted(successors)
            crowd.mark("promoted")
            cluster.restart(victim)
            cluster.wait_ok()
            crowd.mark("rejoined")
        else:
            crowd.mark("failover")
            cluster.failover()
            crowd.mark("promoted")
        time.sleep(after_s)
        crowd.stop()
        result = audit(service.base_url, crowd)
        return FailoverRun(f"cluster-{how}", durability, cluster.servers[0].binary, crowd,
                           result)

