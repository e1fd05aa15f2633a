"""The failover metrics: a failover is counted once per switch, and the time without a
primary runs only while a needed primary is lost (once however many are lost at a time)."""

from __future__ import annotations

import time

import pytest

from capsvc.ops.metrics import Metrics


def seconds(m: Metrics) -> float:
    m.flush()
    return float(m.no_primary._value.get())


def test_time_without_a_primary_runs_only_while_it_is_lost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Lost at t=0, found at t=2: 2 s counted; nothing more afterwards."""
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    m = Metrics()
    m.primary("sentinel:capsvc", "lost")
    now[0] = 101.0
    assert seconds(m) == pytest.approx(1.0)
    now[0] = 102.0
    m.primary("sentinel:capsvc", "switched")
    now[0] = 110.0
    assert seconds(m) == pytest.approx(2.0)
    assert m.failovers._value.get() == 1


def test_two_nodes_lost_at_once_count_the_time_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two cluster primaries lost over the same second count one second; a node forgotten
    (gone from the slot map) stops the clock like one found again."""
    now = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    m = Metrics()
    m.primary("a:1", "lost")
    m.primary("b:2", "lost")
    now[0] = 1.0
    m.primary("a:1", "up")
    now[0] = 3.0
    m.primary("b:2", "forgotten")
    now[0] = 9.0
    assert seconds(m) == pytest.approx(3.0)
    assert m.failovers._value.get() == 0


def test_the_primaries_lost_now_are_a_gauge() -> None:
    """capsvc_redis_primaries_lost is the number of primaries lost and not found again:
    what an alert reads as the state of now (no rate window to fill or to empty)."""
    m = Metrics()
    lost = m.primaries_lost._value
    assert lost.get() == 0
    m.primary("a:1", "lost")
    m.primary("b:2", "lost")
    assert lost.get() == 2
    m.primary("a:1", "up")
    assert lost.get() == 1
    m.primary("b:2", "forgotten")
    assert lost.get() == 0


def test_readiness_changes_count_each_change_of_the_answer() -> None:
    """One outage (ready, unready while it lasts, ready again) is two changes, whatever the
    number of probes; the first answer is no change."""
    m = Metrics()
    for ready in (False, True, True, False, False, False, True, True):
        m.readiness(ready)
    assert m.readiness_changes.labels("0")._value.get() == 3
