"""The failures the journal exists for, in `default` durability (bench/failover.py's rows):
a Redis that loses what it answered, and capsvc restoring it before the next sale.

- a primary and its replica, the replication link frozen 2 s (TCP up), the primary killed,
  the replica promoted: capsvc restarted on it, or not restarted (its Redis address now
  leads to the promoted replica);
- a Redis Cluster whose shard's replica is cut off 2 s before its primary is killed, then
  promoted (on that shard, the answered sales of those 2 s are gone).

Every scenario must first put answered sales at risk (answered during the freeze or the
cut, which the new primary never received); then every answered ticket is found with its
decision and every counter is the sum of the accepted stakes answered, within the cap: 0
lost, 0 over the cap. What the same runs lose without the journal is measured by
`python bench/failover.py --scenario partition partition-redirect cluster-lag`.
"""

from __future__ import annotations

import pytest

from tests.failover.conftest import assert_harness_worked, report
from tests.support.failover import FailoverRun, cluster_scenario, partition_scenario

pytestmark = pytest.mark.slow


def assert_restored(run: FailoverRun) -> None:
    assert run.audit.lost == {}, f"{len(run.audit.lost)} answered ticket(s) lost"
    assert run.audit.over_cap == []
    assert run.audit.mismatched == []


@pytest.mark.parametrize("how", ["restart", "redirect"])
def test_default_durability_failover_loses_no_answered_sale_with_the_journal(
        binary: str, how: str, record_property: pytest.RecordProperty) -> None:
    run = partition_scenario("default", binary=binary, how=how)
    report(run, record_property)
    assert_harness_worked(run, "freeze", "restarted")
    assert run.sellers.sent_and_acknowledged_between("freeze", "kill") > 0, \
        "no sale was answered while the replica could not have it: nothing was at risk"
    assert_restored(run)


def test_cluster_shard_losing_writes_is_restored(
        redis7: str, record_property: pytest.RecordProperty) -> None:
    """On redis 7.0 (the standalone scenarios run on valkey 8.1 too). No answered ticket
    lost, no stake answered and not counted, nothing over the cap. A counter may hold more
    than the stakes answered: a sale answered 503 whose ticket's shard lost its claim while
    the counter's shard kept its stake is sold anew by its retry, and the first stake holds
    room for nothing until the draw's retention ends (docs/durability.md, Redis Cluster)."""
    run = cluster_scenario("default", binary=redis7, lag_s=2.0)
    report(run, record_property)
    assert_harness_worked(run, "lag", "rejoined")
    assert run.sellers.sent_and_acknowledged_between("lag", "kill") > 0
    assert run.audit.lost == {}, f"{len(run.audit.lost)} answered ticket(s) lost"
    assert run.audit.undercounted == []
    assert run.audit.over_cap == []
