"""One Redis Cluster primary going back in time, judged by capsvc processes that never used
its slots, on real processes: a 3-primary cluster (DEBUG enabled), `capsvc serve` over HTTP,
a journal each.

The promise (docs/journal.md, "The bound"): a loss on one node stops every process's judging
on that node, whatever slots the process used before, until the decisions it lost are back.
Host A (or one worker of two) sells combination X to 4,500 of its 5,000 cap; the primary
that holds X goes back to a save made before those sales (`DEBUG RELOAD NOSAVE`: same run id,
same replication id); at once, host B (or the other worker), which never sold anything, sends
ten sales of 500 on X. X must end at the cap, every counter equal to the stakes answered,
every answered decision as answered.

The condition the promise needs is forced, not waited for: the rollback happens only once
the process that will judge has read the node's mark since A's last sale (its watch's
`capsvc_marks_of`, seen on the node's MONITOR from one of that process's connections).
"""

from __future__ import annotations

import http.client
import json
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from capsvc.domain import combination
from capsvc.redis.cluster import slot_of
from capsvc.redis.store import bucket_keys
from tests.integration.test_rollback import (
    CAP,
    STAKE,
    Answer,
    Ledger,
    X,
    _assert_none,
    _config,
    _verify,
)
from tests.support.failover import FAILOVER_GAME, SELLER_TOKEN, current_draw
from tests.support.servers import RedisCluster, RedisServer
from tests.support.service import ServiceProcess

pytestmark = pytest.mark.slow

SOLD = 4500
"""What A sells on X before the rollback: all but one stake of the cap."""
RUSH = 10
"""The sales of STAKE the other process sends at once after the rollback."""


@pytest.fixture
def cluster() -> Iterator[RedisCluster]:
    """A 3-primary cluster of the test's own whose nodes take `DEBUG RELOAD`."""
    c = RedisCluster(extra=("--enable-debug-command", "yes")).start()
    yield c
    c.stop()


def _node_of(cluster: RedisCluster, numbers: Sequence[int], draw: int) -> RedisServer:
    """The primary that holds the counter of `numbers` on `draw`."""
    slot = slot_of(bucket_keys(FAILOVER_GAME, combination.encode(list(numbers)), draw, 1)[0])
    primaries = {s.port: s for s in cluster.primary_nodes()}
    for start, end, primary, *_ in primaries[min(primaries)].client().execute_command(
            "CLUSTER", "SLOTS"):  # type: ignore[no-untyped-call]
        if int(start) <= slot <= int(end):
            return primaries[int(primary[1])]
    raise AssertionError(f"no primary serves slot {slot}")


def _local_ports(pid: int, port: int) -> set[int]:
    """The local ports of `pid`'s TCP connections to `port` on the loopback."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    ports = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[9] in inodes and int(fields[2].split(":")[1], 16) == port:
            ports.add(int(fields[1].split(":")[1], 16))
    return ports


def _watched(node: RedisServer, pids: Sequence[int], timeout_s: float = 60) -> None:
    """Return once every process of `pids` has read `node`'s mark (capsvc_marks_of: its watch)
    after this call began."""
    waiting = set(pids)
    deadline = time.monotonic() + timeout_s
    with node.client().monitor() as monitor:
        for event in monitor.listen():
            if event["command"].startswith("FCALL capsvc_marks") and event["client_port"]:
                port = int(event["client_port"])
                waiting -= {pid for pid in waiting if port in _local_ports(pid, node.port)}
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"processes {sorted(waiting)} never read the mark of "
                                   f"port {node.port} in {timeout_s} s")


def _workers(supervisor: int) -> list[int]:
    """The worker processes of a `capsvc serve --workers N`."""
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    return [int(pid) for pid in children]


def _sell_on_one_connection(ledger: Ledger, url: str, numbers: Sequence[int], count: int
                            ) -> None:
    """`count` sales of STAKE on `numbers`, one after the other on one keep-alive
    connection: one worker takes them all."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        for _ in range(count):
            body = ledger.body(numbers, prefix="A")
            conn.request("POST", "/v1/tickets", body=json.dumps(body),
                         headers={"Authorization": f"Bearer {SELLER_TOKEN}",
                                  "Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
            assert resp.status == 200, (resp.status, raw[:300])
            ledger.sales[body["ticket_id"]] = Answer(url, body, raw)
            assert json.loads(raw)["status"] == "accepted"
    finally:
        conn.close()


def _assert_held(ledger: Ledger, config: str, cluster: RedisCluster, urls: Sequence[str],
                 *journals: Path) -> None:
    """X at the cap and no more, every counter the stakes answered (once the process that
    lost them has put them back), every answer as answered, the journals verified."""
    problems = ledger.over(urls[0], settle_s=10.0)
    problems += ledger.lost()
    _assert_none(problems)
    assert sum(ledger.totals().values()) == CAP
    out = _verify(config, cluster.url, *journals)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_a_host_that_never_used_the_nodes_slots_sells_nothing_past_the_cap(
        cluster: RedisCluster) -> None:
    """Host B, which sold nothing, refuses on a primary that lost host A's sales: X ends at
    the cap, nothing answered is lost."""
    config = _config(settle="1s")
    a = ServiceProcess(config, cluster.url).start()
    b = ServiceProcess(config, cluster.url).start()
    try:
        ledger = Ledger(current_draw(a.base_url) + 1)
        current_draw(b.base_url)  # answered once B has started: it sells, idle
        node = _node_of(cluster, X, ledger.draw)
        node.client().save()
        for _ in range(SOLD // STAKE):
            ledger.sell(a.base_url, X, prefix="A")
        assert b.process is not None
        _watched(node, [b.process.pid])
        node.client().execute_command("DEBUG", "RELOAD", "NOSAVE")  # type: ignore[no-untyped-call]
        ledger.sell_together(b.base_url, [ledger.body(X, prefix="B") for _ in range(RUSH)])

        _assert_held(ledger, config, cluster, [a.base_url, b.base_url],
                     a.journal_dir, b.journal_dir)
    finally:
        a.stop()
        b.stop()


def test_a_worker_that_never_used_the_nodes_slots_sells_nothing_past_the_cap(
        cluster: RedisCluster) -> None:
    """One capsvc of two workers: one sells X on a keep-alive connection, the primary goes
    back, then sales on fresh connections (either worker): X ends at the cap."""
    config = _config(settle="1s")
    svc = ServiceProcess(config, cluster.url, args=("--workers", "2")).start()
    try:
        ledger = Ledger(current_draw(svc.base_url) + 1)
        node = _node_of(cluster, X, ledger.draw)
        node.client().save()
        _sell_on_one_connection(ledger, svc.base_url, X, SOLD // STAKE)
        assert svc.process is not None
        _watched(node, _workers(svc.process.pid))
        node.client().execute_command("DEBUG", "RELOAD", "NOSAVE")  # type: ignore[no-untyped-call]
        ledger.sell_together(svc.base_url, [ledger.body(X, prefix="B") for _ in range(RUSH)])

        _assert_held(ledger, config, cluster, [svc.base_url], svc.journal_dir)
    finally:
        svc.stop()
