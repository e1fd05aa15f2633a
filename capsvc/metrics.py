"""Prometheus metrics of capsvc.

Labels stay bounded: game, status, reason, route template, error kind; never a
combination, ticket, token or player. Label children are cached so the hot path pays one
dict lookup and one increment per sample.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import generate_latest

from capsvc import __version__
from capsvc.models import TicketOut

_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    """Every metric the service exports, with cached label children."""

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
        self._children: dict[tuple[str, ...], object] = {}

    def request(self, route: str, method: str, status: int, seconds: float) -> None:
        key = ("http", route, method, str(status))
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.http.labels(route, method, str(status))
        child.observe(seconds)  # type: ignore[attr-defined]

    def decision(self, t: TicketOut) -> None:
        key = ("t", t.game, t.status)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.tickets.labels(t.game, t.status)
        child.inc()  # type: ignore[attr-defined]
        for g in t.grids:
            gkey = ("g", t.game, g.status, g.reason or "")
            gchild = self._children.get(gkey)
            if gchild is None:
                gchild = self._children[gkey] = self.grids.labels(t.game, g.status,
                                                                  g.reason or "")
            gchild.inc()  # type: ignore[attr-defined]
        if t.total_cost:
            self.stake.labels(t.game).inc(t.total_cost)

    def redis_error(self, kind: str) -> None:
        self.redis_errors.labels(kind).inc()

    def batch(self, size: int, seconds: float) -> None:
        self.redis_batch.observe(size)
        self.redis_latency.observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
