"""Prometheus metrics of capsvc.

Labels stay bounded: game, status, reason, route template, error kind; never a
combination, ticket, token or player.

The hot path does not touch prometheus-client objects per ticket: decisions are tallied in
a plain dict (one increment per key, no lock: everything runs on the event loop), request
latencies and Redis batches into plain per-bucket counts; all are applied to the Prometheus
metrics in bulk when `/metrics` is scraped and once a second (`flush`). A prometheus-client
observation takes a lock and, with several workers, writes a shared file. The requests in
flight are the exception, kept exact per request: once-a-second samples of several
workers, taken at different instants, add up to more than were ever in flight at once.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from capsvc import __version__
from capsvc.config import GameRules
from capsvc.domain.decisions import Verdict

ERROR_KINDS = ("timeout", "connection", "reply", "readonly", "oom")
"""What `capsvc_redis_errors_total` counts (the transport's failure kinds)."""

_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0,
)
"""Up to past the longest request timeout a configuration is likely to set (5 s by
default): a request that ran into it lands in a bucket of its own, not in +Inf."""
_RESTORE_BUCKETS = (0.1, 0.5, 1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_READ_ATTEMPTS = 5
"""Reads of the multiprocess files before a scrape gives up (see `exposition`)."""
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_JOURNAL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
RESTORED_KINDS = ("sale", "cancel", "void", "stop", "cap", "limit", "stake")


class Metrics:
    """Every metric the service exports, with cached label children and tallies.

    With several worker processes (`PROMETHEUS_MULTIPROC_DIR` set before start, as
    `capsvc serve --workers N` does), values live in the shared directory and `/metrics`
    aggregates every worker: one view.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.tickets = Counter("capsvc_tickets", "Ticket decisions by game and status",
                               ["game", "status"], registry=r)
        self.grids = Counter("capsvc_grids", "Grid decisions by game, status and reason",
                             ["game", "status", "reason"], registry=r)
        self.stake = Counter("capsvc_accepted_stake",
                             "Accepted sales, sum of ticket costs in minor units, by game",
                             ["game"], registry=r)
        self.capped = Counter("capsvc_combinations_capped",
                              "Counters that reached their cap (one per combination and draw)",
                              ["game"], registry=r)
        self.near_cap = Counter("capsvc_near_cap",
                                "Sales that brought a counter to 80 % of its cap", ["game"],
                                registry=r)
        self.cap_rejections = Counter("capsvc_cap_rejections",
                                      "Grids refused by the combination cap, by pick size",
                                      ["game", "picks"], registry=r)
        self.shadow_rejections = Counter(
            "capsvc_shadow_cap_rejections",
            "Grids accepted that the game's shadow cap (shadow_cap_limit) would have refused",
            ["game"], registry=r)
        self.limit_rejections = Counter("capsvc_player_limit_rejections",
                                        "Tickets refused by a player's daily limit", ["game"],
                                        registry=r)
        self.http = Histogram("capsvc_http_request_duration_seconds",
                              "HTTP request duration by route and status",
                              ["route", "method", "status"], buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.redis_errors = Counter("capsvc_redis_errors", "Redis failures by kind", ["kind"],
                                    registry=r)
        # Every worker sees the same failover and the same outage: with several workers
        # these two add up what each saw (a rate > 0 is what an alert asks).
        self.failovers = Counter(
            "capsvc_redis_failovers",
            "Redis failovers seen (another node, or the same one after a demotion, "
            "answering as the primary), each worker counting those it saw", registry=r)
        self.no_primary = Counter(
            "capsvc_redis_no_primary_seconds",
            "Seconds with a needed Redis primary unreachable (no sale can be decided "
            "meanwhile), each worker counting its own", registry=r)
        self.failovers.inc(0)  # exported from the start: an alert's increase() needs it
        self.no_primary.inc(0)
        self.primaries_lost = Gauge(
            "capsvc_redis_primaries_lost",
            "Redis primaries this process needs and cannot reach now (0: every one "
            "answers; no sale on theirs meanwhile), the most of any worker", registry=r,
            multiprocess_mode="livemax")
        self.primaries_lost.set(0)
        worker = os.environ.get("CAPSVC_WORKER", "0")
        self._worker = worker
        self.process_cpu = Counter(
            "capsvc_process_cpu_seconds", "CPU seconds of the worker (user and system)",
            ["worker"], registry=r)
        self.process_rss = Gauge(
            "capsvc_process_resident_memory_bytes", "Resident memory of the worker",
            ["worker"], registry=r, multiprocess_mode="livesum")
        self.process_fds = Gauge(
            "capsvc_process_open_fds", "Open file descriptors of the worker", ["worker"],
            registry=r, multiprocess_mode="livesum")
        self._cpu_seen = 0.0
        self.readiness_changes = Counter(
            "capsvc_readiness_changes",
            "Times the worker's /readyz answer changed (ready to not ready, or back), each "
            "worker counting its own", ["worker"], registry=r)
        self.readiness_changes.labels(worker)
        self._ready: bool | None = None
        """This worker's last /readyz answer (None: none yet)."""
        self.ticket_batch = Histogram("capsvc_ticket_batch_size",
                                      "Tickets per POST /v1/ticket-batches request",
                                      buckets=_BATCH_BUCKETS, registry=r)
        self.redis_batch = Histogram("capsvc_redis_batch_size",
                                     "Commands per coalesced Redis pipeline",
                                     buckets=_BATCH_BUCKETS, registry=r)
        self.redis_latency = Histogram("capsvc_redis_batch_duration_seconds",
                                       "Redis round trip of one coalesced pipeline",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("capsvc_http_requests_in_flight",
                               "Requests being served (scrapes of /metrics not counted)",
                               registry=r, multiprocess_mode="livesum")
        self.feed_drops = Counter("capsvc_feed_dropped",
                                  "Feed subscribers dropped for not reading their events",
                                  ["game"], registry=r)
        self.draw_played = Gauge(
            "capsvc_draw_combinations_played",
            "Combinations of the capped sizes with a stake on the draw on sale now", ["game"],
            registry=r, multiprocess_mode="livemostrecent")
        self.draw_at_cap = Gauge(
            "capsvc_draw_combinations_at_cap",
            "Combinations at their cap on the draw on sale now", ["game"], registry=r,
            multiprocess_mode="livemostrecent")
        self.draw_liability = Gauge(
            "capsvc_draw_top_liability",
            "Top-rank liability of the most exposed combination of the draw on sale now "
            "(minor units; the prize it would pay if drawn)", ["game"], registry=r,
            multiprocess_mode="livemostrecent")
        self.janitor = Counter("capsvc_janitor_settled", "Pending tickets settled by the janitor",
                               registry=r)
        self.swept = Counter(
            "capsvc_janitor_swept_records",
            "Bucketed ticket records past their retention deleted by the janitor's sweep",
            registry=r)
        self.journal_write = Histogram(
            "capsvc_journal_write_duration_seconds",
            "One batch of the journal: from its start to its fdatasync (what a decision's "
            "answer waits for)", buckets=_JOURNAL_BUCKETS, registry=r)
        self.journal_records = Counter("capsvc_journal_records",
                                       "Records written to the journal", registry=r)
        self.journal_bytes = Counter("capsvc_journal_bytes", "Bytes written to the journal",
                                     registry=r)
        self.journal_errors = Counter(
            "capsvc_journal_errors",
            "Journal batches that could not be written (their decisions answered 503)",
            registry=r)
        self.journal_files = Gauge("capsvc_journal_files",
                                   "Journal files in the journal directory", registry=r,
                                   multiprocess_mode="max")
        self.journal_healthy = Gauge(
            "capsvc_journal_writable",
            "1 while the journal's last write succeeded; 0: decisions answer 503", registry=r,
            multiprocess_mode="min")
        self.journal_healthy.set(1)
        self.redis_evicting = Gauge(
            "capsvc_redis_evicting_nodes",
            "Redis nodes this process holds for their maxmemory-policy (not noeviction: "
            "nothing sold on them, not ready)", registry=r, multiprocess_mode="max")
        self.restoring = Gauge(
            "capsvc_journal_restoring",
            "1 while this process restores its journal into a Redis it has not reconciled "
            "(no sale meanwhile)", registry=r, multiprocess_mode="max")
        self.restores = Counter("capsvc_journal_restores",
                                "Restores of the journal into Redis completed", registry=r)
        self.restored = Counter("capsvc_journal_restored",
                                "Journal records that put back into Redis what it had lost",
                                ["kind"], registry=r)
        self.restore_seconds = Histogram("capsvc_journal_restore_duration_seconds",
                                         "Restores of the journal into Redis, by duration",
                                         buckets=_RESTORE_BUCKETS, registry=r)
        self.over_cap = Counter(
            "capsvc_journal_restore_over_cap",
            "Grids a restore counted back past their cap, one per grid and draw (sales "
            "answered, lost by Redis, their room sold again before the restore): an "
            "overshoot to report", ["game"],
            registry=r)
        self.reconcile_differences = Gauge(
            "capsvc_reconcile_differences",
            "Differences found by the last reconciliation of a draw with the sales system's "
            "export, by kind (not_accepted: sold past capsvc; not_sold: accepted, no "
            "receipt; amount; duplicate)", ["game", "kind"], registry=r,
            multiprocess_mode="mostrecent")
        self.reconcile_draw = Gauge(
            "capsvc_reconcile_draw", "The draw the last reconciliation checked", ["game"],
            registry=r, multiprocess_mode="mostrecent")
        self.reconciled_at = Gauge(
            "capsvc_reconcile_timestamp_seconds",
            "When a draw of the game was last reconciled (Unix time)", ["game"], registry=r,
            multiprocess_mode="max")
        self.reports = Counter("capsvc_draw_reports_written",
                               "Draw reports written (once a draw is final)", ["game"],
                               registry=r)
        self.reports_over_cap = Counter(
            "capsvc_draw_reports_over_cap",
            "Draw reports written with a combination over its cap, or a broken journal chain",
            ["game"], registry=r)
        Gauge("capsvc_build_info", "Build information", ["version"], registry=r,
              multiprocess_mode="max").labels(__version__).set(1)
        self._http_children: dict[tuple[str, str, int], Any] = {}
        self._tally: Tally[tuple[str, ...]] = Tally()
        self._latency: dict[tuple[str, str, int], list[float]] = {}
        self._batches: list[list[float]] = [_observations(_BATCH_BUCKETS),
                                             _observations(_LATENCY_BUCKETS)]
        self._lost: set[str] = set()
        """Redis nodes (primaries) this process has lost and not found again."""
        self._lost_mark = 0.0
        """monotonic() up to which the time without a primary has been counted."""

    def declare(self, games: Iterable[GameRules]) -> None:
        """Create every series a dashboard panel or an alert uses, at 0, so that each one
        exists from the start (`rate()` then sees the first increment, and an expression
        over a series not seen yet is not empty)."""
        for kind in ERROR_KINDS:
            self.redis_errors.labels(kind)
        for kind in RESTORED_KINDS:
            self.restored.labels(kind)
        # The 5xx panels and alerts select these before the first failure.
        for route, method in (("/v1/tickets", "POST"), ("/readyz", "GET")):
            self.http.labels(route, method, "503")
        for g in games:
            self.stake.labels(g.id)
            self.capped.labels(g.id)
            self.near_cap.labels(g.id)
            for status in ("accepted", "partial", "rejected"):
                self.tickets.labels(g.id, status)
            self.grids.labels(g.id, "accepted", "")
            for reason in ("combination_capped", "player_limit"):
                self.grids.labels(g.id, "rejected", reason)
            for picks in sorted(g.capped_picks):
                self.cap_rejections.labels(g.id, str(picks))
            if g.daily_limit is not None:
                self.limit_rejections.labels(g.id)
            self.feed_drops.labels(g.id)
            self.over_cap.labels(g.id)
            self.reports.labels(g.id)
            self.reports_over_cap.labels(g.id)
            if g.cap_limit is not None:
                self.shadow_rejections.labels(g.id)
                for gauge in (self.draw_played, self.draw_at_cap, self.draw_liability):
                    gauge.labels(g.id).set(0)

    def request(self, route: str, method: str, status: int, seconds: float) -> None:
        """Tally one request's latency (applied to the histogram by `flush`)."""
        key = (route, method, status)
        counts = self._latency.get(key)
        if counts is None:
            counts = self._latency[key] = _observations(_LATENCY_BUCKETS)
        counts[0] += seconds
        counts[bisect_left(_LATENCY_BUCKETS, seconds) + 1] += 1

    def decision(self, v: Verdict, near_cap: int = 0, sold_out: int = 0,
                 shadowed: int = 0) -> None:
        """Tally a ticket's decision (applied to the counters by `flush`)."""
        tally, game = self._tally, v.game
        tally["t", game, v.status] += 1
        if v.accepted:
            tally["g", game, "accepted", ""] += v.accepted
        if v.limit:
            tally["g", game, "rejected", "player_limit"] += v.grids
            tally["l", game] += 1
        if v.capped:
            tally["g", game, "rejected", "combination_capped"] += len(v.capped)
            for picks in v.capped:
                tally["r", game, str(picks)] += 1
        if v.total_cost:
            tally["s", game] += v.total_cost
        if near_cap:
            tally["n", game] += near_cap
        if sold_out:
            tally["c", game] += sold_out
        if shadowed:
            tally["w", game] += shadowed

    def flush(self) -> None:
        """Apply the tallies to the Prometheus metrics."""
        tally, self._tally = self._tally, Tally()
        counters = {"t": self.tickets, "g": self.grids, "r": self.cap_rejections,
                    "l": self.limit_rejections, "s": self.stake, "n": self.near_cap,
                    "c": self.capped, "w": self.shadow_rejections}
        for (kind, *labels), n in tally.items():
            counters[kind].labels(*labels).inc(n)
        latency, self._latency = self._latency, {}
        for key, counts in latency.items():
            child = self._http_children.get(key)
            if child is None:
                route, method, status = key
                child = self._http_children[key] = self.http.labels(route, method, str(status))
            _apply(child, counts)
        batches = self._batches
        self._batches = [_observations(_BATCH_BUCKETS), _observations(_LATENCY_BUCKETS)]
        _apply(self.redis_batch, batches[0])
        _apply(self.redis_latency, batches[1])
        self._count_lost()
        self._sample_process()

    def _sample_process(self) -> None:
        """This worker's CPU, resident memory and open descriptors (Prometheus's own
        process_* series are not exported with several workers)."""
        times = os.times()
        cpu = times.user + times.system
        self.process_cpu.labels(self._worker).inc(max(cpu - self._cpu_seen, 0.0))
        self._cpu_seen = cpu
        with contextlib.suppress(OSError, ValueError, IndexError):
            pages = int(Path("/proc/self/statm").read_text().split()[1])
            self.process_rss.labels(self._worker).set(pages * os.sysconf("SC_PAGE_SIZE"))
        with contextlib.suppress(OSError):
            self.process_fds.labels(self._worker).set(len(os.listdir("/proc/self/fd")))

    def reconciled(self, game: str, draw: int, differences: dict[str, int],
                   at_s: float) -> None:
        """A draw's reconciliation: its differences by kind."""
        for kind, n in differences.items():
            self.reconcile_differences.labels(game, kind).set(n)
        self.reconcile_draw.labels(game).set(draw)
        self.reconciled_at.labels(game).set(at_s)

    def report_written(self, game: str, flawed: bool) -> None:
        self.reports.labels(game).inc()
        if flawed:
            self.reports_over_cap.labels(game).inc()

    def exposure(self, game: str, played: int, at_cap: int, liability: int) -> None:
        """The current draw's exposure figures of a game (refreshed in the background)."""
        self.draw_played.labels(game).set(played)
        self.draw_at_cap.labels(game).set(at_cap)
        self.draw_liability.labels(game).set(liability)

    def journal_written(self, records: int, size: int, seconds: float) -> None:
        """One journal batch made durable (capsvc.journal.writer.WriteObserver)."""
        self.journal_write.observe(seconds)
        self.journal_records.inc(records)
        self.journal_bytes.inc(size)
        self.journal_healthy.set(1)

    def journal_failed(self) -> None:
        self.journal_errors.inc()
        self.journal_healthy.set(0)

    def restored_into_redis(self, applied: dict[str, int], seconds: float) -> None:
        self.restores.inc()
        self.restore_seconds.observe(seconds)
        for kind, n in applied.items():
            self.restored.labels(kind).inc(n)

    def restored_over_cap(self, game: str, counters: int) -> None:
        self.over_cap.labels(game).inc(counters)

    def feed_dropped(self, game: str) -> None:
        self.feed_drops.labels(game).inc()

    def redis_error(self, kind: str) -> None:
        self.redis_errors.labels(kind).inc()

    def primary(self, node: str, event: str) -> None:
        """A transport's news of a primary (capsvc.redis.transport.PrimaryObserver)."""
        if event == "switched":
            self.failovers.inc()
        if event == "lost":
            if not self._lost:
                self._lost_mark = time.monotonic()
            self._lost.add(node)
        elif node in self._lost:
            self._count_lost()
            self._lost.discard(node)
        self.primaries_lost.set(len(self._lost))

    def _count_lost(self) -> None:
        if self._lost:
            now = time.monotonic()
            self.no_primary.inc(now - self._lost_mark)
            self._lost_mark = now

    def readiness(self, ready: bool) -> None:
        """A /readyz answer of this worker: a change from its last one is counted."""
        if self._ready is not None and ready != self._ready:
            self.readiness_changes.labels(self._worker).inc()
        self._ready = ready

    def batch(self, size: int, seconds: float) -> None:
        """Tally one Redis pipeline: its commands and its round trip."""
        sizes, times = self._batches
        sizes[0] += size
        sizes[bisect_left(_BATCH_BUCKETS, size) + 1] += 1
        times[0] += seconds
        times[bisect_left(_LATENCY_BUCKETS, seconds) + 1] += 1

    def exposition(self) -> bytes:
        self.flush()
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            for _ in range(_READ_ATTEMPTS - 1):
                try:
                    return generate_latest(registry)
                except struct.error:
                    # A worker being started has created its file but not yet sized it:
                    # read again (the file is complete a moment later).
                    time.sleep(0.005)
            return generate_latest(registry)
        return generate_latest(self.registry)


def _observations(buckets: tuple[float, ...]) -> list[float]:
    """Observations tallied for a histogram: their sum, then a count per bucket (the last
    one +Inf), each observation in the first bucket whose bound is not below it."""
    return [0.0] * (len(buckets) + 2)


def _apply(histogram: Any, counts: list[float]) -> None:
    """Add tallied observations to a histogram (or a child of one), as that many
    `observe` calls would. prometheus-client keeps a histogram as a sum and one
    non-cumulative value per bucket (`_sum`, `_buckets`, in the order of its bounds);
    `tests/unit/test_metrics.py` checks this against `observe` itself."""
    if not any(counts[1:]):
        return
    histogram._sum.inc(counts[0])
    for value, n in zip(histogram._buckets, counts[1:], strict=True):
        if n:
            value.inc(n)
