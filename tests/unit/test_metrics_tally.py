"""The hot path tallies latencies and Redis batches in plain numbers and applies them in
bulk (`Metrics.flush`): the exposition must be what as many
prometheus-client `observe` calls would have given, bucket bounds included."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest

from capsvc.ops import metrics as m
from capsvc.ops.metrics import Metrics


def samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, ...], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(registry).decode()
    return {(s.name, *sorted(s.labels.items())): s.value  # type: ignore[misc]
            for f in text_string_to_metric_families(text) if f.name == name
            for s in f.samples if not s.name.endswith("_created")}


bounds = st.sampled_from(m._LATENCY_BUCKETS)
latencies = st.lists(st.one_of(bounds, st.floats(0, 5), bounds.map(lambda b: b * 1.0000001)),
                     max_size=60)


@given(latencies, st.lists(st.integers(1, 2000), max_size=20))
def test_tallied_observations_expose_as_observe_would(seconds: list[float],
                                                      sizes: list[int]) -> None:
    tallied = Metrics()
    reference = CollectorRegistry()
    http = Histogram("capsvc_http_request_duration_seconds", "x", ["route", "method", "status"],
                     buckets=m._LATENCY_BUCKETS, registry=reference)
    batch = Histogram("capsvc_redis_batch_size", "x", buckets=m._BATCH_BUCKETS,
                      registry=reference)
    for i, s in enumerate(seconds):
        status = 200 if i % 3 else 503
        tallied.request("/v1/tickets", "POST", status, s)
        http.labels("/v1/tickets", "POST", str(status)).observe(s)
    for size in sizes:
        tallied.batch(size, 0.001)
        batch.observe(size)
    tallied.flush()
    tallied.flush()  # a second flush adds nothing
    for name in ("capsvc_http_request_duration_seconds", "capsvc_redis_batch_size"):
        got, want = samples(tallied.registry, name), samples(reference, name)
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert abs(got[key] - value) < 1e-9 * max(1.0, abs(value)), key

