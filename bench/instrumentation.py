"""Cost of capsvc's instrumentation per request, measured in-process (no I/O).

    python bench/instrumentation.py

A sold ticket costs one latency observation (`Metrics.request`) and one decision tally
(`Metrics.decision`); tallies are applied to Prometheus once a second (`Metrics.flush`),
whose cost is spread over every ticket of that second.
"""

from __future__ import annotations

import time
import timeit

from prometheus_client import CollectorRegistry

from capsvc.domain.decisions import Verdict
from capsvc.ops.metrics import Metrics

N = 200_000


def main() -> None:
    metrics = Metrics(CollectorRegistry())
    ticket = Verdict("fdj-keno", "partial", 100, 1, (10,), False, 2)
    request = timeit.timeit(lambda: metrics.request("/v1/tickets", "POST", 200, 0.003),
                            number=N) / N
    decision = timeit.timeit(lambda: metrics.decision(ticket, 1, 0), number=N) / N
    flush = 0.0
    for _ in range(1000):  # a second's tally of this ticket's kind, then one flush
        for _ in range(100):
            metrics.decision(ticket, 1, 0)
        started = time.perf_counter()
        metrics.flush()
        flush += time.perf_counter() - started
    flush /= 1000
    print(f"Metrics.request  {request * 1e6:6.2f} µs per request")
    print(f"Metrics.decision {decision * 1e6:6.2f} µs per ticket (2 grids)")
    print(f"Metrics.flush    {flush * 1e6:6.2f} µs per second of traffic")
    print(f"total            {(request + decision) * 1e6:6.2f} µs per sold ticket")


if __name__ == "__main__":
    main()
