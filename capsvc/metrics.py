"""Prometheus metrics of capsvc.

Labels stay bounded: game, status, reason, route template, error kind; never a
combination, ticket, token or player.

The hot path does not touch prometheus-client objects per ticket: decisions are tallied in
plain dicts (one increment per key, no lock: everything runs on the event loop) and applied
to the Prometheus counters in bulk when `/metrics` is scraped and once a second. Request
latency is observed directly (one cached histogram child per route and status).
"""

from __future__ import annotations

from collections import Counter as Tally
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import generate_latest

from capsvc import __version__
from capsvc.models import TicketOut

_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    """Every metric the service exports, with cached label children and tallies."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.tickets = Counter("capsvc_tickets", "Ticket decisions by game and status",
                               ["game", "status"], registry=r)
        self.grids = Counter("capsvc_grids", "Grid decisions by game, status and reason",
                             ["game", "status", "reason"], registry=r)
        self.stake = Counter("capsvc_accepted_stake", "Accepted cost in minor units, by game",
                             ["game"], registry=r)
        self.http = Histogram("capsvc_http_request_duration_seconds",
                              "HTTP request duration by route and status",
                              ["route", "method", "status"], buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.redis_errors = Counter("capsvc_redis_errors", "Redis failures by kind", ["kind"],
                                    registry=r)
        self.redis_batch = Histogram("capsvc_redis_batch_size",
                                     "Commands per coalesced Redis pipeline",
                                     buckets=_BATCH_BUCKETS, registry=r)
        self.redis_latency = Histogram("capsvc_redis_batch_duration_seconds",
                                       "Duration of one coalesced Redis pipeline",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("capsvc_http_requests_in_flight", "Requests being served",
                               registry=r)
        self.janitor = Counter("capsvc_janitor_settled", "Pending tickets settled by the janitor",
                               registry=r)
        Info("capsvc_build", "Build information", registry=r).info({"version": __version__})
        self._http_children: dict[tuple[str, str, int], Any] = {}
        self._tickets: Tally[tuple[str, str]] = Tally()
        self._grids: Tally[tuple[str, str, str]] = Tally()
        self._stake: Tally[str] = Tally()

    def request(self, route: str, method: str, status: int, seconds: float) -> None:
        key = (route, method, status)
        child = self._http_children.get(key)
        if child is None:
            child = self._http_children[key] = self.http.labels(route, method, str(status))
        child.observe(seconds)

    def decision(self, t: TicketOut) -> None:
        """Tally a ticket's decision (applied to the counters by `flush`)."""
        self._tickets[t.game, t.status] += 1
        grids = self._grids
        for g in t.grids:
            grids[t.game, g.status, g.reason or ""] += 1
        if t.total_cost:
            self._stake[t.game] += t.total_cost

    def flush(self) -> None:
        """Apply the tallies to the Prometheus counters."""
        tickets, self._tickets = self._tickets, Tally()
        grids, self._grids = self._grids, Tally()
        stake, self._stake = self._stake, Tally()
        for (game, status), n in tickets.items():
            self.tickets.labels(game, status).inc(n)
        for (game, status, reason), n in grids.items():
            self.grids.labels(game, status, reason).inc(n)
        for game, amount in stake.items():
            self.stake.labels(game).inc(amount)

    def redis_error(self, kind: str) -> None:
        self.redis_errors.labels(kind).inc()

    def batch(self, size: int, seconds: float) -> None:
        self.redis_batch.observe(size)
        self.redis_latency.observe(seconds)

    def exposition(self) -> bytes:
        self.flush()
        return generate_latest(self.registry)
