"""Scenario c: three sentinels (quorum 2, down after 1 s) watch a primary and its two
replicas; capsvc (two workers) runs on the `redis+sentinel://` URL in `replicas:1`. The
primary is killed under load; the sentinels promote a replica and capsvc follows the switch
by itself (it is not restarted): sales are answered again within 10 s of the kill (within
5 s of the sentinels' agreeing, when their election takes longer), none answered is lost,
none beyond the cap, and /readyz is 503 while no primary is known, 200 after.

Two replicas, not one: with `replicas:1` a primary whose only replica is promoted has no
replica left, and no sale could be confirmed again until another one joins (a sentinel
turns the old primary, restarted, into a replica only 8 s after it is back)."""

from __future__ import annotations

import pytest

from tests.failover.conftest import assert_harness_worked, report
from tests.support.failover import sentinel_scenario

pytestmark = pytest.mark.slow


def test_sentinel_failover_followed_without_restart(
        binary: str, record_property: pytest.RecordProperty) -> None:
    run = sentinel_scenario("replicas:1", binary=binary, workers=2)
    report(run, record_property)
    assert_harness_worked(run, "kill", "switched")
    resumed = run.resumed_after_s("kill")
    assert resumed is not None
    kill, switched = run.sellers.marks["kill"], run.sellers.marks["switched"]
    # The sentinels' election is theirs: usually 2-4 s here, but a split vote waits twice
    # failover-timeout (10 s) before trying again (CI saw 12.7 s). What capsvc owes is to
    # follow the switch: sales again within 10 s of the kill when the sentinels took at
    # most 5 s, and in any case within 5 s of their agreeing.
    election = switched - kill
    assert resumed <= max(10, election + 5), (
        f"sales resumed {resumed:.1f} s after the kill, the sentinels switched after "
        f"{election:.1f} s")
    assert run.audit.lost == {}
    assert run.audit.over_cap == []
    assert run.audit.mismatched == []

    during = [status for at, status in run.readiness if kill + 0.5 <= at <= switched]
    assert 503 in during, f"/readyz while no primary: {sorted(set(during))}"
    assert set(during) <= {200, 503}, during  # the process answered all along
    after = [status for at, status in run.readiness if at >= kill + resumed]
    assert after, "no readiness sample after the sales resumed"
    assert after[-1] == 200, after[-10:]
    back = next((at for at, status in run.readiness if at > switched and status == 200),
                None)
    assert back is not None, "/readyz never 200 again"
    assert back - kill <= max(10, election + 5), (
        f"/readyz 200 again {back - kill:.1f} s after the kill, the sentinels switched after "
        f"{election:.1f} s")


def test_a_manual_sentinel_failover_loses_no_answered_sale(
        binary: str, record_property: pytest.RecordProperty) -> None:
    """SENTINEL FAILOVER with the old primary alive: its second replica goes on
    acknowledging its writes after the first one is promoted, and would drop them when it
    follows the new primary. capsvc stops using the old primary as soon as the sentinels
    choose the replica to promote: 0 answered lost, 0 over the cap (without that hold,
    ~20 % of the answered sales are lost)."""
    run = sentinel_scenario("replicas:1", "manual", binary=binary, workers=2)
    report(run, record_property)
    assert_harness_worked(run, "kill", "switched")
    assert run.audit.lost == {}
    assert run.audit.over_cap == []
    assert run.audit.mismatched == []
