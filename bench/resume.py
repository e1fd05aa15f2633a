"""Seconds without sales, and decisions restored a second, when Redis changes or loses data
under R retained decisions.

    python bench/resume.py [--tree DIR] [--scenario a b c] [--layout one workers2 hosts2]
                           [--retained 100000 1000000] [--server redis|valkey]
                           [--settle 1s] [--sellers 4] [--json FILE]

Scenarios (each with `capsvc serve` processes that are not restarted, `default` durability):
- a (failover): three sentinels, a primary and two replicas; the primary SIGKILLed, the
  sentinels promote a replica that lost nothing;
- b (lossy failover): the same, the primary's replicas cut off 2 s before the kill (their
  links closed, reconnections refused: RedisServer.cut_replicas): the promoted replica
  lacks the last ~2 s of sales. (Not a PartitionProxy: sentinels re-point a replica that
  follows its primary through a proxy to the primary itself once failover-timeout has
  passed, +fix-slave-config, and the link is no longer the proxy's to freeze.);
- c (emptied): one Redis, `FLUSHALL` in place.
Layouts: one worker (`one`), `--workers 2` (`workers2`, one journal directory), two hosts
(`hosts2`: two `capsvc serve` processes on the same Redis, each with its own journal
directory; R is split between them).

Before each layout's runs, R retained decisions are made once (`sell_retained`, not timed:
the product's own sale path, in processes of their own, into a seed Redis and the layout's
journal directories); each run loads its primary from the seed (REPLICAOF), hard-links the
journal files into directories of its own and starts the services on it, which reconcile
at start (timed apart: "start"). Then steady sellers (tests.support.failover.Sellers: every 503
sent again after 50 ms) sell for a while, the event happens, and once every service has
logged its restore and sales are answered again, a few more seconds.

Prints, per scenario, layout and R:
- election: from the kill to the moment the new primary is known (the first sentinel's
  `+switch-master`), a and b;
- resumed: from the moment the new primary is known (a, b) or the loss (c, FLUSHALL
  answered) to the first sale answered 200 after the outage (the end of the longest gap
  between answered sales that ends after the event);
- no sales: the longest gap between answered sales the sellers saw (for a and b it holds
  the sentinels' election);
- early: sales answered after the loss (b: the new primary known, c: FLUSHALL) before
  every journal directory was back in Redis, to attempts sent after it: judged on a Redis
  that lacked decisions (b and c);
- restore: what the services logged (capsvc.recovery.reconciler; `summarize_restores`):
  the longest restore's own seconds (reading and writing back), records read (once a
  journal directory, however many workers read it), records that put something back, and
  records read a second over that time; then each process's own lines;
- load: the machine's load average at the event.
Asserts nothing about time. `--tree DIR` runs another checkout (its `capsvc`, for this
process and for every process it starts): the same script measures before and after.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

# The harness (tests.support) comes from this repository whatever `--tree` names: its
# package is bound before that checkout, which may have none, comes first on sys.path.
sys.path.append(str(Path(__file__).resolve().parents[1]))
importlib.import_module("tests")


def _tree_from_argv() -> Path | None:
    """`--tree DIR`, applied before anything of capsvc is imported."""
    for i, arg in enumerate(sys.argv):
        if arg == "--tree" and i + 1 < len(sys.argv):
            return Path(sys.argv[i + 1]).resolve()
        if arg.startswith("--tree="):
            return Path(arg.split("=", 1)[1]).resolve()
    return None


TREE = _tree_from_argv()
if TREE is not None:
    import os as _os

    sys.path.insert(0, str(TREE))
    _os.environ["PYTHONPATH"] = str(TREE)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from contextlib import ExitStack  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from datetime import datetime  # noqa: E402
from typing import Any  # noqa: E402

import capsvc  # noqa: E402
from tests.support.failover import (  # noqa: E402
    FAILOVER_GAME,
    SELLER_TOKEN,
    Sellers,
    current_draw,
)
from tests.support.servers import (  # noqa: E402
    RedisSentinels,
    RedisServer,
    server_version,
    valkey_binary,
)
from tests.support.service import ServiceProcess  # noqa: E402

SCENARIOS = {"a": "failover", "b": "lossy failover", "c": "emptied"}
BULK_GAME = "fdj-keno"
BULK_CHANNEL = "fr-retail"
BULK_TOKEN = "resume-bulk"
CUT_S = 2.0


@dataclass(frozen=True)
class Layout:
    name: str
    label: str
    hosts: int
    workers: int


LAYOUTS = {"one": Layout("one", "1 worker", 1, 1),
           "workers2": Layout("workers2", "--workers 2", 1, 2),
           "hosts2": Layout("hosts2", "2 hosts", 2, 1)}


def config_text(settle: str) -> str:
    """The services' configuration: the failover harness's timeouts (a dead primary is a
    503 within a fraction of a second), the steady sellers' game and channel
    (tests.support.failover's FAILOVER_GAME, cap 2,000) and the bulk game of the retained
    decisions (FDJ Keno as configured by default)."""

    def digest(token: str) -> str:
        import hashlib
        return hashlib.sha256(token.encode()).hexdigest()

    return f"""\
[redis]
durability = "default"
timeout = "250ms"
wait_timeout = "200ms"

[server]
request_timeout = "2s"
drain_delay = "100ms"

[janitor]
pending_deadline = "10s"
interval = "1s"

[journal]
settle = "{settle}"

[[games]]
id = "{FAILOVER_GAME}"
preset = "fdj-keno-2008"
cap_limit = 2000

[[games]]
id = "{BULK_GAME}"
preset = "fdj-keno-2008"

[[channels]]
id = "failover-seller"
token_sha256 = "{digest(SELLER_TOKEN)}"
games = ["{FAILOVER_GAME}"]
scopes = ["sell", "read"]

[[channels]]
id = "{BULK_CHANNEL}"
token_sha256 = "{digest(BULK_TOKEN)}"
games = ["{BULK_GAME}"]
scopes = ["sell", "read"]
"""


# -- the retained decisions -----------------------------------------------------------------
#
# Made by the product's own sale path (capsvc.http.server.build: the use-cases, their Redis
# calls, the Recorder and the journal's writer; everything but HTTP), so that whatever a
# sale writes — in Redis and in its journal record — is written as the service would.
# What this relies on: capsvc.http.server.build and prepare, UseCases.tickets.sell / ticket /
# cancel. A tree where those change: adapt `sell_retained` only.

STAKES = (100, 200, 300, 500, 1000)


def mix_ticket(rng: random.Random, hot: list[list[int]], ticket_id: str, first_draw: int
               ) -> dict[str, Any]:
    """A ticket of bench/tickets.lua's mix: 1-5 grids of 2-10 numbers (a fifth from a hot
    set of 20 combinations that reach their cap), some subscriptions (2, 5, 10 draws)."""
    grids = []
    for _ in range(rng.randint(1, 5)):
        numbers = (rng.choice(hot) if rng.random() < 0.2
                   else sorted(rng.sample(range(1, 71), rng.randint(2, 10))))
        grids.append({"numbers": numbers, "stake": rng.choice(STAKES)})
    r = rng.random()
    draws = 10 if r < 0.05 else 5 if r < 0.10 else 2 if r < 0.15 else 1
    return {"ticket_id": ticket_id, "game": BULK_GAME, "first_draw": first_draw,
            "draws": draws, "grids": grids}


async def sell_retained(config: Path, redis_url: str, count: int, prefix: str, seed: int,
                        concurrency: int = 256) -> None:
    """Sell `count` tickets of the mix on the next 10 draws, as one service process would
    (its journal directory: CAPSVC_JOURNAL_DIR), `concurrency` at a time; a tenth of them
    looked up once more (journaled again, `lookup`), a fiftieth cancelled. A call that
    times out is sent again (Redis's timeout is 10 s here: the machine is busy)."""
    import dataclasses

    import msgspec

    from capsvc.client.models import TicketIn
    from capsvc.config import load_settings
    from capsvc.domain.errors import ApiError, Unavailable
    from capsvc.http.server import build, prepare
    from capsvc.redis.marks import Marks

    settings = dataclasses.replace(load_settings(config), redis_timeout_ms=10_000)
    svc = build(settings, redis_url)
    await prepare(svc)
    channel = next(c for c in settings.channels if c.id == BULK_CHANNEL)
    tickets = svc.usecases.tickets
    game = svc.usecases.catalog.games[BULK_GAME]
    current = game.calendar.current(svc.usecases.clock.now())
    hot_rng = random.Random(7)  # the same hot set in every process
    hot = [sorted(hot_rng.sample(range(1, 71), hot_rng.randint(8, 10))) for _ in range(20)]
    numbers = iter(range(count))

    async def seller(k: int) -> None:
        rng = random.Random(seed * 100_003 + k)
        for i in numbers:
            body = mix_ticket(rng, hot, f"{prefix}-{i}", current + 1 + rng.randrange(10))
            t = msgspec.convert(body, TicketIn)
            for attempt in range(10):
                try:
                    Marks.begin()  # as every request does (capsvc.http.app): its records stamped
                    [out] = await tickets.sell(channel, [t])
                    if isinstance(out, Exception):
                        raise out
                    if i % 10 == 0:
                        Marks.begin()
                        await tickets.ticket(channel, t.ticket_id)
                    if i % 50 == 0 and b'"status":"rejected"' not in out.body:
                        Marks.begin()
                        await tickets.cancel(channel, t.ticket_id)
                    break
                except (ApiError, Unavailable) as e:
                    if (isinstance(e, ApiError) and e.status < 500) or attempt == 9:
                        raise
                    await asyncio.sleep(0.1)

    try:
        await asyncio.gather(*[seller(k) for k in range(concurrency)])
    finally:
        if svc.journal is not None:
            svc.usecases.journal.checkpoint(svc.store.marks.made)  # as a process that stops
            await svc.journal.aclose()
        await svc.redis.aclose()


# -- Redis: the seed, the topologies --------------------------------------------------------


def _server(directory: Path, **kwargs: Any) -> RedisServer:
    directory.mkdir(parents=True, exist_ok=True)
    return RedisServer(str(directory), **kwargs)


def remove(path: Path) -> None:
    """A directory and what is in it, again after a moment if something (a Redis's AOF
    rewrite finishing after its server stopped) wrote in it meanwhile."""
    for _ in range(5):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(0.5)


def _info(server: RedisServer, section: str = "replication") -> dict[str, Any]:
    return dict(server.client().info(section))


def _until(predicate: Any, timeout_s: float, what: str, every_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(every_s)


def load_from(seed: RedisServer, primary: RedisServer, replicas: int,
              timeout_s: float = 1800) -> None:
    """Give `primary` the seed's data: REPLICAOF the seed, then REPLICAOF NO ONE; its own
    replicas (connected already) resynchronise from it, and are waited for."""
    c = primary.client()
    c.execute_command("REPLICAOF", "127.0.0.1", str(seed.port))

    def synced() -> bool:
        try:
            i = _info(primary)
        except Exception:  # busy loading
            return False
        return i.get("master_link_status") == "up" and not int(i.get("master_sync_in_progress", 0))

    _until(synced, timeout_s, "the primary's copy of the seed", 0.2)
    c.execute_command("REPLICAOF", "NO", "ONE")
    _until(lambda: primary.role() == "master", 30, "the primary's promotion")

    def replicas_caught_up() -> bool:
        try:
            c.set("bench:resume:loaded", 1)
            return int(c.execute_command("WAIT", replicas, 1000)) >= replicas
        except Exception:
            return False

    if replicas:
        _until(replicas_caught_up, timeout_s, "the replicas' copies", 0.2)
    c.delete("bench:resume:loaded")


@dataclass
class Topology:
    url: str
    primary: RedisServer
    sentinels: RedisSentinels | None = None


def topology(scenario: str, binary: str, seed: RedisServer, root: Path, stack: ExitStack
             ) -> Topology:
    """c: one Redis; a and b: a primary, two replicas and three sentinels. Loaded from the
    seed."""
    primary = _server(root / "primary", binary=binary).start()
    stack.callback(primary.stop)
    if scenario == "c":
        load_from(seed, primary, 0)
        return Topology(primary.url, primary)
    for i in range(2):
        replica = _server(root / f"replica-{i}", binary=binary, replica_of=primary).start()
        stack.callback(replica.stop)
    load_from(seed, primary, 2)
    sentinels = RedisSentinels(primary, binary=binary).start()
    stack.callback(sentinels.stop)
    for d in sentinels.dirs:
        stack.callback(shutil.rmtree, d, True)
    return Topology(sentinels.url(), primary, sentinels)


class SwitchWatcher:
    """When the first sentinel announces `+switch-master` (time.monotonic())."""

    def __init__(self, sentinels: RedisSentinels) -> None:
        self.sentinels = sentinels
        self.at: float | None = None
        self.done = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> SwitchWatcher:
        subscribed = []
        for i in range(len(self.sentinels.ports)):
            pubsub = self.sentinels.client(i).pubsub()
            pubsub.subscribe("+switch-master")
            for _ in range(30):  # until the subscription is confirmed
                if pubsub.get_message(timeout=1.0) is not None:
                    break
            subscribed.append(pubsub)
        for pubsub in subscribed:
            t = threading.Thread(target=self._listen, args=(pubsub,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _listen(self, pubsub: Any) -> None:
        while not self._stop.is_set():
            try:
                message = pubsub.get_message(timeout=0.2)
            except Exception:
                return
            if message is not None and message.get("type") == "message":
                now = time.monotonic()
                if self.at is None or now < self.at:
                    self.at = now
                self.done.set()
        pubsub.close()

    def wait(self, old_port: int, timeout_s: float = 60) -> float:
        """The instant the new primary was known (falls back on polling the sentinels)."""
        if not self.done.wait(timeout_s):
            self.sentinels.wait_failover(old_port, 1)
            self.at = time.monotonic()
        self._stop.set()
        assert self.at is not None
        return self.at


# -- the services and what they log ---------------------------------------------------------

WALL_OFFSET = time.time() - time.monotonic()
RESTORE_LOGGER = "capsvc.recovery.reconciler"


def log_lines(service: ServiceProcess) -> list[dict[str, Any]]:
    """The service's JSON log lines (every worker's), each with `t`, its time.monotonic()."""
    out = []
    try:
        text = service.log.read_text(errors="replace")
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            entry = json.loads(line)
            entry["t"] = datetime.fromisoformat(entry["time"]).timestamp() - WALL_OFFSET
        except (ValueError, KeyError, TypeError):
            continue
        out.append(entry)
    return out


def restore_done(entry: dict[str, Any]) -> bool:
    """A line saying a restore (or a reconciliation that found nothing to do) is done."""
    return entry.get("logger") == RESTORE_LOGGER and "reconciled" in entry.get("message", "")


def listening(entry: dict[str, Any]) -> bool:
    return entry.get("message") == "capsvc listening"


def start_services(layout: Layout, config: Path, url: str, dirs: list[Path],
                   stack: ExitStack, timeout_s: float = 3600) -> tuple[list[ServiceProcess],
                                                                       float]:
    """The layout's services, and how long they took to listen with their restore done."""
    args = ("--workers", str(layout.workers)) if layout.workers > 1 else ()
    t0 = time.monotonic()
    services = []
    for d in dirs:
        s = ServiceProcess(str(config), url, env={"CAPSVC_JOURNAL_DIR": str(d)}, args=args)
        services.append(s.start())
        stack.callback(s.stop)

    def up() -> bool:
        for s in services:
            assert s.process is not None
            if s.process.poll() is not None:
                raise RuntimeError(f"capsvc exited at start: {s.log.read_text()[-2000:]}")
        # A process listens once its restore is done or has taken 120 s (capsvc.http.server's
        # prepare): both are waited for.
        return all(sum(map(listening, lines)) >= layout.workers
                   and sum(map(restore_done, lines)) >= layout.workers
                   for lines in map(log_lines, services))

    _until(up, timeout_s, "the services' start", 0.2)
    return services, time.monotonic() - t0


def link_copy(src: Path, dst: Path) -> None:
    """A journal directory's copy: its files hard-linked (a process never writes another
    process's file; the checkpoint is replaced, not rewritten), else copied."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.is_dir():
            shutil.copytree(p, dst / p.name)
            continue
        try:
            os.link(p, dst / p.name)
        except OSError:
            shutil.copy2(p, dst / p.name)


# -- one layout's data, one run --------------------------------------------------------------


@dataclass
class Data:
    """A layout's retained decisions: in the seed Redis and its journal directories."""

    seed: RedisServer
    dirs: list[Path]
    count: int
    seconds: float


def generate(layout: Layout, count: int, binary: str, config: Path, root: Path) -> Data:
    """R decisions for `layout`: one selling process per journal writer the layout has (a
    worker or a host), each a share of R."""
    seed = _server(root / "seed", binary=binary).start()
    writers = layout.hosts * layout.workers
    dirs = [root / f"journal-{h}" for h in range(layout.hosts)]
    t0 = time.monotonic()
    procs = []
    for k in range(writers):
        share = count // writers + (1 if k < count % writers else 0)
        env = {**os.environ, "CAPSVC_JOURNAL_DIR": str(dirs[k % layout.hosts])}
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "generate", "--config", str(config), "--redis-url",
             seed.url, "--count", str(share), "--prefix", f"R{k}", "--seed", str(k)],
            env=env, stdin=subprocess.DEVNULL))
    try:
        failed = [p.wait() for p in procs]
        if any(failed):
            raise RuntimeError(f"generation failed: exit statuses {failed}")
    except BaseException:  # interrupted too: nothing left running
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        seed.stop()
        raise
    return Data(seed, dirs, count, time.monotonic() - t0)


@dataclass
class Run:
    scenario: str
    layout: str
    retained: int
    start_s: float = 0.0
    election_s: float | None = None
    resumed_s: float | None = None
    longest_gap_s: float = 0.0
    early: int | None = None
    at_risk: int | None = None
    restore_s: float | None = None
    read: int = 0
    put_back: int = 0
    rate: float | None = None
    acknowledged: int = 0
    load: float | None = None
    """The machine's load average (1 min) at the event: others' work slows a restore."""
    logs: list[str] = field(default_factory=list)
    error: str | None = None


def outage(times: list[float], event: float, started: float) -> tuple[float, float] | None:
    """The longest gap between answered sales (`times`, sorted) that ends after `event`."""
    edges = [started, *times]
    gaps = [(a, b) for a, b in itertools.pairwise(edges) if b > event]
    return max(gaps, key=lambda g: g[1] - g[0]) if gaps else None


def waiting(entry: dict[str, Any]) -> bool:
    """A line saying a process has done its restore and waits for others' before selling."""
    return (entry.get("logger") == RESTORE_LOGGER
            and "waiting for other processes" in entry.get("message", ""))


def summarize_restores(services: list[ServiceProcess], since: float, run: Run) -> float | None:
    """Fill `run`'s restore figures from the services' logs after `since`; when every
    journal directory was back in Redis (time.monotonic()).

    A restore's duration is the `seconds` its process logs (reading the journal and writing
    back; a failed attempt before it, the wait for other processes and `[journal] settle`
    are not in it). A directory is back at the first line of its service saying that a
    process is done or waits for the others (each process checks every record)."""
    durations, back = [], None
    for h, s in enumerate(services):
        name = f"host {h}" if len(services) > 1 else "service"
        read = 0  # the workers of one service read the same directory: counted once
        done = []
        for e in log_lines(s):
            if e["t"] < since or e.get("logger") != RESTORE_LOGGER:
                continue
            extra = {k: v for k, v in e.items()
                     if k not in ("time", "level", "logger", "message", "t")}
            run.logs.append(f"{name} +{e['t'] - since:6.2f} s {e['level']}: {e['message']}"
                            + (f" {json.dumps(extra)}" if extra else ""))
            if waiting(e):
                done.append(e["t"])
            if not restore_done(e):
                continue
            done.append(e["t"])
            read = max(read, int(e.get("records", 0) or 0))
            put_back = e.get("put_back") or {}
            run.put_back += sum(put_back.values()) if isinstance(put_back, dict) else 0
            if isinstance(e.get("seconds"), int | float):
                durations.append(float(e["seconds"]))
        run.read += read
        if done:
            back = min(done) if back is None else max(back, min(done))
    if durations:
        run.restore_s = max(durations)
        run.rate = run.read / run.restore_s if run.restore_s > 0 and run.read else None
    return back


def one_run(scenario: str, layout: Layout, data: Data, binary: str, config: Path,
            args: argparse.Namespace, root: Path) -> Run:
    run = Run(scenario, layout.label, data.count)
    with ExitStack() as stack:
        topo = topology(scenario, binary, data.seed, root, stack)
        dirs = []
        for h, d in enumerate(data.dirs):
            dirs.append(root / f"run-journal-{h}")
            link_copy(d, dirs[-1])
        services, run.start_s = start_services(layout, config, topo.url, dirs, stack)
        urls = [s.base_url for s in services]
        draw = current_draw(urls[0], timeout_s=120)
        sellers = Sellers(urls, [draw + 1 + i for i in range(30)], count=args.sellers,
                          retry_pause_s=0.05, give_up_s=3600, seed=1)
        stack.callback(sellers.stop, 0)
        sellers.start()
        sellers.wait_acknowledged(1, 120)
        time.sleep(args.warmup)
        if scenario == "c":
            sellers.mark("flush")
            topo.primary.client().flushall()
            event = loss = sellers.mark("loss")
            first_mark = sellers.marks["flush"]
        else:
            assert topo.sentinels is not None
            watcher = SwitchWatcher(topo.sentinels).start()
            old = topo.primary.port
            if scenario == "b":
                topo.primary.cut_replicas()
                sellers.mark("cut")
                time.sleep(CUT_S)
            topo.primary.kill()
            kill = sellers.mark("kill")
            event = loss = sellers.marks["known"] = watcher.wait(old)
            run.election_s = event - kill
            first_mark = sellers.marks.get("cut", kill)
        run.load = os.getloadavg()[0]
        wait_recovered(services, sellers, first_mark, event, args.timeout)
        time.sleep(args.after)
        sellers.stop(60)
        times = sorted(s.at for s in sellers.acknowledged if s.at <= sellers.stopped_at)
        gap = outage(times, event, sellers.started_at)
        if gap is not None:
            run.resumed_s = gap[1] - event
        run.longest_gap_s = sellers.longest_gap()
        run.acknowledged = len(sellers.acknowledged)
        back = summarize_restores(services, first_mark, run)
        if scenario in ("b", "c") and back is not None:
            run.early = sum(1 for s in sellers.acknowledged if s.sent_at >= loss and s.at < back)
        if scenario == "b":
            run.at_risk = sellers.sent_and_acknowledged_between("cut", "kill")
    return run


def wait_recovered(services: list[ServiceProcess], sellers: Sellers, since: float,
                   event: float, timeout_s: float, grace_s: float = 15) -> None:
    """Until every service has logged a restore done after `since` and a sale was answered
    after the last of them; or, if none logs one within `grace_s` of the event, until sales
    are answered (a process that had nothing to restore may say nothing)."""
    deadline = event + timeout_s
    while time.monotonic() < deadline:
        ends = [[e["t"] for e in log_lines(s) if e["t"] >= since and restore_done(e)]
                for s in services]
        now = time.monotonic()
        answered = [a.at for a in sellers.acknowledged[-50:]]
        if all(ends):
            if any(a > max(max(e) for e in ends) for a in answered):
                return
        elif now > event + grace_s and any(a > now - 0.5 for a in answered):
            return
        time.sleep(0.1)
    print(f"  (not recovered after {timeout_s:.0f} s)", file=sys.stderr)


# -- the report ------------------------------------------------------------------------------

COLUMNS = (("scenario", 16), ("layout", 11), ("R", 9), ("start s", 8), ("election", 8),
           ("resumed", 8), ("no sales", 8), ("early", 5), ("restore s", 9), ("read", 9),
           ("put back", 8), ("/s", 8), ("load", 5))


def row(run: Run) -> str:
    def f(x: float | None, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    name = f"{run.scenario} {SCENARIOS[run.scenario]}"
    if run.error:
        return f"{name:<16} {run.layout:<11} {run.retained:>9,} failed: {run.error}"[:200]
    cells = (name, run.layout, f"{run.retained:,}", f(run.start_s, ".1f"),
             f(run.election_s), f(run.resumed_s), f(run.longest_gap_s),
             "-" if run.early is None else str(run.early), f(run.restore_s),
             f"{run.read:,}", f"{run.put_back:,}", f(run.rate, ",.0f"), f(run.load, ".1f"))
    return " ".join(c.ljust(w) if i < 2 else c.rjust(w)
                    for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS, strict=True)))


def tree_label() -> str:
    root = Path(capsvc.__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, check=True).stdout.strip()
        branch = subprocess.run(["git", "-C", str(root), "rev-parse", "--abbrev-ref", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return str(root)
    return f"{root} ({branch} {rev})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", help="the checkout whose capsvc runs (default: the one "
                        "importable: PYTHONPATH)")
    parser.add_argument("--scenario", nargs="+", choices=list(SCENARIOS), default=["a", "b", "c"])
    parser.add_argument("--layout", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--retained", nargs="+", type=int, default=[100_000],
                        help="R, the retained decisions (default 100000)")
    parser.add_argument("--server", choices=("redis", "valkey"), default="redis")
    parser.add_argument("--settle", default="1s", help="[journal] settle (default: 1s, the "
                        "service's default)")
    parser.add_argument("--sellers", type=int, default=4)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--after", type=float, default=2.0,
                        help="seconds of sales after the recovery")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds to wait for the recovery")
    parser.add_argument("--json", help="write the figures there too")
    args = parser.parse_args()
    if args.server == "redis":
        binary = shutil.which("redis-server")
        if binary is None:
            print("redis-server not found", file=sys.stderr)
            return 1
    else:
        binary = valkey_binary()

    print(f"tree: {tree_label()}")
    print(f"server: {server_version(binary)}; [journal] settle = {args.settle}; "
          f"{args.sellers} steady sellers; durability default")
    header = " ".join(n.ljust(w) if i < 2 else n.rjust(w)
                      for i, (n, w) in enumerate(COLUMNS))
    print(header)
    print("-" * len(header), flush=True)
    runs: list[Run] = []
    base = Path(tempfile.mkdtemp(prefix="capsvc-bench-resume-"))
    config = base / "capsvc-resume.toml"
    config.write_text(config_text(args.settle))
    try:
        for count in args.retained:
            for name in args.layout:
                layout = LAYOUTS[name]
                data_root = base / f"data-{name}-{count}"
                try:
                    data = generate(layout, count, binary, config, data_root)
                except Exception as e:
                    print(f"generation of {count:,} for {layout.label} failed: {e!r}",
                          flush=True)
                    continue
                print(f"  ({layout.label}: {count:,} decisions made in {data.seconds:.0f} s, "
                      "not timed)", flush=True)
                try:
                    for scenario in args.scenario:
                        root = base / f"run-{scenario}-{name}-{count}"
                        try:
                            run = one_run(scenario, layout, data, binary, config, args, root)
                        except Exception as e:  # a broken run is reported, the others run
                            run = Run(scenario, layout.label, count, error=repr(e))
                        finally:
                            remove(root)
                        runs.append(run)
                        print(row(run), flush=True)
                finally:
                    data.seed.stop()
                    remove(data_root)
    finally:
        remove(base)
    print()
    print("start s: the services' start (their restore at start), not part of the figures;")
    print("election: kill -> new primary known; resumed: known (a, b) or FLUSHALL (c) -> "
          "first 200 after the outage;")
    print("no sales: longest gap between answered sales; early: 200s after the loss before "
          "every journal was back;")
    print("restore s, read, put back: the services' logs (restore s: the longest restore's "
          "own seconds; read: once a journal directory); /s: read a second;")
    print(f"load: the load average at the event ({os.cpu_count()} CPUs).")
    for run in runs:
        if run.logs:
            risk = ("" if run.at_risk is None
                    else f", {run.at_risk} sale(s) answered while the replicas were cut off")
            print(f"\n{run.scenario} {SCENARIOS[run.scenario]}, {run.layout}, "
                  f"R = {run.retained:,}{risk}:")
            for line in run.logs[:12]:
                print(f"  {line}"[:240])
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"tree": tree_label(), "server": server_version(binary), "settle": args.settle,
             "runs": [vars(r) for r in runs]}, indent=1))
    return 0


def generate_main(argv: list[str]) -> int:
    """`resume.py generate`: one process's share of the retained decisions."""
    parser = argparse.ArgumentParser(prog="resume.py generate")
    parser.add_argument("--config", required=True)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop
        uvloop.install()
    asyncio.run(sell_retained(Path(args.config), args.redis_url, args.count, args.prefix,
                              args.seed))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "generate":
        sys.exit(generate_main(sys.argv[2:]))
    sys.exit(main())
