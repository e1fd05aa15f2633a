"""Runs the service: wires store, use-cases and HTTP, serves until SIGTERM, then drains.

On SIGTERM (or SIGINT) readiness turns false at once; the listener stays open for
`drain_delay` so load balancers see it, then closes; requests in flight finish; the
background Redis writes are flushed; the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from capsvc.audit.reconcile import counts
from capsvc.config import Settings
from capsvc.domain.errors import Unavailable
from capsvc.http.app import App, Health, Protocol, create_app, metrics_handler
from capsvc.journal.writer import Journal, open_journal
from capsvc.ops.metrics import Metrics
from capsvc.ops.workers import BACKLOG, announce_started, stop_requested
from capsvc.recovery.reconciler import Reconciler
from capsvc.redis.cluster import connect
from capsvc.redis.durability import Durability
from capsvc.redis.gate import Evicting, Gate
from capsvc.redis.marks import Marks
from capsvc.redis.store import Store, lua_source
from capsvc.redis.transport import Transport
from capsvc.service.feed import Feed
from capsvc.service.janitor import Janitor
from capsvc.wiring import UseCases, build_usecases

log = logging.getLogger(__name__)

CLOCK_REFRESH_S = 5.0
"""How often the Redis clock is read again (between readings the monotonic clock runs)."""


async def _every(what: str, interval_s: float, step: Callable[[], Awaitable[object]], *,
                 at_start: bool = False) -> None:
    """Run `step` every `interval_s` (first at once with `at_start`), forever; a Redis
    outage is logged once, not at every turn."""
    reachable = True
    if not at_start:
        await asyncio.sleep(interval_s)
    while True:
        try:
            await step()
            reachable = True
        except Evicting:
            reachable = False  # said once, by the gate
        except Unavailable as e:
            if reachable:
                log.warning("%s: redis unavailable: %s", what, e)
            reachable = False
        except Exception:
            log.exception("%s failed", what)
        await asyncio.sleep(interval_s)


async def _settle(janitor: Janitor, metrics: Metrics) -> None:
    """Settle tickets left pending past the deadline (one janitor's round)."""
    settled = await janitor.run_once()
    if settled:
        metrics.janitor.inc(settled)
    swept = await janitor.sweep()
    if swept:
        metrics.swept.inc(swept)


EXPOSURE_GAUGES_S = 30.0
"""How often the exposure gauges of the draws on sale are refreshed (by one process of all
those on the Redis: a draw of 100,000 combinations is ~0.5 s of Redis time to read)."""


async def _exposure_gauges(usecases: UseCases, metrics: Metrics, store: Store) -> None:
    """The exposure gauges of each capped game's draw on sale: computed by the process that
    takes the game's turn first (the gauges export the most recent value of the live
    processes)."""
    for game in usecases.catalog.games.values():
        if game.rules.cap_limit is None:
            continue
        if not await store.take_turn(f"exposure-gauges:{game.rules.id}",
                                     int(EXPOSURE_GAUGES_S * 1000) - 500):
            continue
        draw = await usecases.draws.current_draw(game)
        out = await usecases.exposure.of(game, draw)
        metrics.exposure(game.rules.id, sum(c.played for c in out.capped),
                         sum(c.at_cap for c in out.capped), out.top_liability or 0)


async def _flush_metrics(metrics: Metrics) -> None:
    """Apply the hot path's tallies to the Prometheus counters once a second (also done on
    every scrape), so that a worker that never serves /metrics is seen too."""
    while True:
        await asyncio.sleep(1)
        metrics.flush()


class _Site(web.SockSite):
    """The application on the listening socket, each connection served by `Protocol`."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, metrics: Metrics,
                 access_log: logging.Logger | None) -> None:
        super().__init__(runner, sock, backlog=BACKLOG)
        self._metrics = metrics
        self._access_log = access_log

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None

        def connection() -> Protocol:
            return Protocol(server, loop=loop, metrics=self._metrics,
                            access_log=self._access_log)

        self._server = await loop.create_server(connection, sock=self._sock,
                                                backlog=self._backlog)


@dataclass
class Service:
    """Everything one service process is made of, wired together."""

    settings: Settings
    redis: Transport
    store: Store
    usecases: UseCases
    metrics: Metrics
    health: Health
    app: App
    journal: Journal | None = None
    reconciler: Reconciler | None = None


def build(settings: Settings, redis_url: str) -> Service:
    metrics = Metrics()
    metrics.declare(settings.games.values())
    journal = None
    # Every connection's handshake reads its node's eviction policy (and, with the journal,
    # its identity): nothing goes to a node that may evict what capsvc writes.
    gate = Gate(reconciles=settings.journal_enabled)
    gate.on_evicting = metrics.redis_evicting.set
    if settings.journal_enabled:
        journal = open_journal(settings.journal_dir,
                               max_file_bytes=settings.journal_max_file_bytes,
                               keep_ms=settings.journal_keep_ms,
                               on_write=metrics.journal_written, on_error=metrics.journal_failed,
                               on_files=metrics.journal_files.set)
    else:
        log.warning("the journal is off ([journal] enabled = false): decisions Redis loses "
                    "are not restored, and nothing outlives Redis's retention")
    redis = connect(redis_url, timeout_s=settings.redis_timeout_ms / 1000,
                    on_batch=metrics.batch, on_error=metrics.redis_error,
                    on_primary=metrics.primary, library=lua_source(), gate=gate)
    store = Store(redis)
    if journal is not None:
        store.marks = Marks(journal.life, single_node=store.single_node,
                            node_of=store.node_of)
    usecases = build_usecases(settings, store, journal=journal)
    usecases.journal.marks = store.marks
    usecases.audit.on_report = metrics.report_written
    usecases.audit.on_reconciled = lambda rec: metrics.reconciled(
        rec.game, rec.draw, counts(rec), usecases.clock.now() / 1000)
    health = Health()
    durability = Durability(redis, settings.durability_replicas, settings.wait_timeout_ms,
                            settings.retry_after_s)
    reconciler = (Reconciler(settings, redis_url, gate, usecases.catalog, metrics,
                             store.marks, usecases.journal)
                  if journal is not None else None)
    app = create_app(settings, usecases, store, metrics, health, durability, journal, gate)
    return Service(settings, redis, store, usecases, metrics, health, app, journal, reconciler)


async def prepare(svc: Service, wait_s: float = 120.0) -> None:
    """Before serving: restore the journal into the Redis (nothing is sold before), load the
    Lua library, read the Redis clock. The restore is waited for until it is done or has
    failed once (a Redis that does not answer yet is then waited for in the background,
    the process not ready), `wait_s` at most."""
    if svc.reconciler is not None:
        if svc.reconciler.task is None:  # else started already (and maybe done)
            svc.reconciler.start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(svc.reconciler.attempted.wait(), wait_s)
    await svc.store.load_library()
    await svc.usecases.clock.sync()
    if (why := await svc.store.record_limits()) is not None:
        log.warning("%s", why)


class Serving:
    """A service serving on its socket: `cleanup` stops the listener, lets the requests in
    flight finish and stops the request watchdog."""

    def __init__(self, runner: web.ServerRunner, watchdog: asyncio.Task[None], feed: Feed
                 ) -> None:
        self.runner = runner
        self._watchdog = watchdog
        self.feed = feed

    async def cleanup(self) -> None:
        await self.feed.close()
        await self.runner.cleanup()
        self._watchdog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._watchdog


async def start_serving(svc: Service, sock: socket.socket) -> Serving:
    """Serve `svc` on a listening socket (until the returned Serving is cleaned up), on
    aiohttp's low-level server: every request goes to one handler (`App.handle`)."""
    loop = asyncio.get_running_loop()
    max_body = svc.app.max_body_bytes

    def request(message: Any, payload: Any, protocol: Any, writer: Any, task: Any
                ) -> web.BaseRequest:
        return web.BaseRequest(message, payload, protocol, writer, task, loop,
                               client_max_size=max_body)

    server = web.Server(svc.app.handle, request_factory=request)
    runner = web.ServerRunner(server,
                              shutdown_timeout=svc.settings.request_timeout_ms / 1000 + 1)
    await runner.setup()
    access_log = logging.getLogger("capsvc.access") if svc.settings.access_log else None
    await _Site(runner, sock, svc.metrics, access_log).start()
    return Serving(runner, asyncio.create_task(svc.app.watchdog()), svc.usecases.feed)


async def start_metrics(metrics: Metrics, sock: socket.socket) -> web.ServerRunner:
    """Serve `/metrics` alone on a listening socket of its own (`[server] metrics_port`),
    until the returned runner is cleaned up."""
    runner = web.ServerRunner(web.Server(metrics_handler(metrics), access_log=None),
                              shutdown_timeout=1.0)
    await runner.setup()
    await web.SockSite(runner, sock, backlog=BACKLOG).start()
    return runner


async def serve(settings: Settings, redis_url: str, sock: socket.socket,
                metrics_sock: socket.socket | None = None) -> None:
    """Serve on a listening socket until SIGTERM/SIGINT, then drain and return; `/metrics`
    on `metrics_sock` when given (and then not on `sock`: `settings.metrics_port` set)."""
    svc = build(settings, redis_url)
    redis, store, usecases, metrics, health = (
        svc.redis, svc.store, svc.usecases, svc.metrics, svc.health)
    try:
        await prepare(svc)
    except Evicting:
        pass  # said once, by the gate: not ready until the node keeps what it is given
    except Unavailable as e:
        log.warning("redis not reachable at start (%s): not ready until it is", e)
    background = [
        asyncio.create_task(usecases.clock.run(CLOCK_REFRESH_S)),
        asyncio.create_task(_every("janitor", settings.janitor_interval_ms / 1000,
                                   lambda: _settle(usecases.janitor, metrics))),
        asyncio.create_task(_flush_metrics(metrics)),
        asyncio.create_task(_every("exposure gauges", EXPOSURE_GAUGES_S,
                                   lambda: _exposure_gauges(usecases, metrics, store),
                                   at_start=True)),
    ]
    if svc.reconciler is not None:
        background.append(asyncio.create_task(svc.reconciler.watch(store)))
    if svc.journal is not None and settings.audit_reports:
        # Each draw's report once final (one process of the journal directory at a time).
        background.append(asyncio.create_task(_every(
            "draw reports", settings.audit_interval_ms / 1000, usecases.audit.write_due)))
    runner = await start_serving(svc, sock)
    scrapes = None if metrics_sock is None else await start_metrics(metrics, metrics_sock)
    # Everything allocated so far lives as long as the process: keep it out of the cyclic
    # collector's way, and let the young generation grow before a collection (the hot path
    # allocates many short-lived, acyclic objects).
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    announce_started()
    host, port = sock.getsockname()[:2]
    listening = {"host": host, "port": port, "games": list(settings.games)}
    if metrics_sock is not None:
        listening["metrics_port"] = metrics_sock.getsockname()[1]
    log.info("capsvc listening", extra=listening)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if stop_requested():  # during the start: drain now (what was accepted is served)
        stop.set()
    await stop.wait()
    health.draining = True
    log.info("draining", extra={"in_flight": health.in_flight})
    await asyncio.sleep(settings.drain_delay_ms / 1000)
    for task in background:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await usecases.feed.close()  # feed subscriptions end: they would hold the drain
    await runner.cleanup()
    if scrapes is not None:
        await scrapes.cleanup()
    metrics.flush()  # the decisions of the last second count too
    await redis.aclose()
    if svc.reconciler is not None and svc.reconciler.task is not None:
        svc.reconciler.task.cancel()
    if svc.journal is not None:
        # The last checkpoint: the next start reads no further back in this lifetime's files.
        usecases.journal.checkpoint(store.marks.made)
        await svc.journal.aclose()
    log.info("stopped")
