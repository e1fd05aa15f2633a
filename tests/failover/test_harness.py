"""The partition proxy itself: a frozen link stays connected and carries nothing; a thaw
delivers what was held; a cut closes the link and the replica connects again."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from tests.support.faults import PartitionProxy
from tests.support.servers import RedisServer


@pytest.fixture
def pair(redis7: str) -> Iterator[tuple[RedisServer, RedisServer, PartitionProxy]]:
    primary = RedisServer(binary=redis7).start()
    proxy = PartitionProxy("127.0.0.1", primary.port).start()
    replica = RedisServer(binary=redis7, replica_of=primary, via=proxy).start()
    yield primary, replica, proxy
    replica.stop()
    proxy.stop()
    primary.stop()


def wait(client: redis.Redis, n: int, ms: int) -> int:
    acked: int = client.execute_command("WAIT", n, ms)  # type: ignore[no-untyped-call]
    return acked


def test_freeze_keeps_the_link_up_and_carries_nothing(
        pair: tuple[RedisServer, RedisServer, PartitionProxy]) -> None:
    primary, replica, proxy = pair
    db = primary.client()
    db.set("k", "before")
    assert wait(db, 1, 1000) == 1
    proxy.freeze()
    db.set("k", "during")
    assert wait(db, 1, 300) == 0
    time.sleep(1.5)  # past a replica's REPLCONF ACK period: nobody notices
    assert db.info("replication")["connected_slaves"] == 1
    assert replica.client().info("replication")["master_link_status"] == "up"
    assert replica.client().get("k") == b"before"
    proxy.thaw()
    assert wait(db, 1, 2000) == 1
    assert replica.client().get("k") == b"during"


def test_cut_drops_the_link_and_the_replica_comes_back(
        pair: tuple[RedisServer, RedisServer, PartitionProxy]) -> None:
    primary, replica, proxy = pair
    proxy.cut()
    primary.client().set("k", "after the cut")
    deadline = time.monotonic() + 10
    while replica.client().get("k") != b"after the cut":
        assert time.monotonic() < deadline, "the replica did not reconnect"
        time.sleep(0.05)
    assert proxy.connections == 1


def test_promote_and_follow(pair: tuple[RedisServer, RedisServer, PartitionProxy]) -> None:
    """The old primary, killed, comes back as the promoted replica's replica, and has its
    data (not what it had written alone during the freeze)."""
    primary, replica, proxy = pair
    proxy.freeze()
    primary.client().set("k", "lost")
    primary.kill()
    replica.promote()
    assert replica.role() == "master"
    replica.client().set("k", "kept")
    primary.follow(replica)
    assert primary.role() == "slave"
    assert wait(replica.client(), 1, 2000) == 1
    assert primary.client().get("k") == b"kept"
