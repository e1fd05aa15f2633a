"""Scenario d: a Redis Cluster of three primaries with a replica each, capsvc on the
`redis+cluster://` URL in `replicas:1`, sellers selling. A primary killed (SIGKILL; its
replica promoted by the cluster, the killed node restarted as its replica), or a replica
promoted by `CLUSTER FAILOVER`: no sale answered is lost, none beyond the cap."""

from __future__ import annotations

import pytest

from tests.failover.conftest import assert_harness_worked, report
from tests.integration.test_rollback import Ledger, X, _assert_none, _config
from tests.support.failover import cluster_scenario, current_draw
from tests.support.servers import RedisCluster
from tests.support.service import ServiceProcess

pytestmark = pytest.mark.slow


def test_cluster_primary_killed(binary: str, record_property: pytest.RecordProperty) -> None:
    run = cluster_scenario("replicas:1", "kill", binary=binary)
    report(run, record_property)
    assert_harness_worked(run, "kill", "rejoined")
    assert run.audit.lost == {}
    assert run.audit.over_cap == []
    assert run.audit.mismatched == []


def test_cluster_manual_failover(binary: str, record_property: pytest.RecordProperty) -> None:
    run = cluster_scenario("replicas:1", "failover", binary=binary)
    report(run, record_property)
    assert not run.sellers.unexpected, run.sellers.unexpected[:5]
    assert not run.sellers.unanswered, run.sellers.unanswered[:5]
    assert any(s.sent_at > run.sellers.marks["promoted"] for s in run.sellers.acknowledged)
    assert run.audit.lost == {}
    assert run.audit.over_cap == []
    assert run.audit.mismatched == []


def test_sales_go_on_when_the_urls_own_node_is_failed_over(redis7: str) -> None:
    """The primary the `redis+cluster://` URL names killed, its replica promoted: capsvc
    sells again once the cluster serves every slot, without that node coming back (its
    restore asks the nodes it learnt, not only the URL's)."""
    cluster = RedisCluster(replicas=1, binary=redis7).start()
    svc = ServiceProcess(_config(settle="1s"), cluster.url).start()
    try:
        ledger = Ledger(current_draw(svc.base_url) + 1)
        ledger.sell(svc.base_url, X)
        seed = cluster.servers[0]
        assert seed.role() == "master"
        _, replicas = cluster.kill_primary(seed)
        cluster.wait_promoted(replicas)
        ledger.sell(svc.base_url, X)
        _assert_none(ledger.lost())
    finally:
        svc.stop()
        cluster.stop()
