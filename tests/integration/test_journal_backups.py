"""Redis given back an older copy of its own data — a backup loaded through replication, an
older RDB file reloaded in place, a backup restored key by key while the service was
stopped — against real redis-server and real `capsvc serve` processes over HTTP.

Each test asserts the guaranteed behaviour (API.md, "What an answer promises": whatever
Redis later loses — a restart from an older file, a restored backup — the process that
reported a decision puts it back before it judges another sale): the ticket answered after
the copy was taken is found, and the combination is not sold past its cap.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import CONFIG
from tests.integration.test_journal_redis_loss import (
    EIGHT,
    FDJ_CAP,
    _current,
    _fdj,
    _sell,
    _staked,
    _until_answer,
)
from tests.support.servers import RedisServer, backup_keys, restore_keys
from tests.support.service import ServiceProcess

pytestmark = pytest.mark.slow


def _get(url: str, ticket: str) -> int:
    status, _ = _until_answer(url, "GET", f"/v1/tickets/{ticket}")
    return status


def _sell_to_cap(url: str, draw: int) -> int:
    """Sell the combination until refused; the stakes answered accepted."""
    accepted = 0
    for _ in range(FDJ_CAP // 500 + 2):
        status, body = _sell(url, _fdj(draw))
        assert status == 200, body
        if body["status"] == "accepted":
            accepted += 500
    return accepted


@pytest.fixture
def debug_redis() -> Iterator[RedisServer]:
    server = RedisServer(extra=("--enable-debug-command", "yes")).start()
    yield server
    server.stop()


# -- 1. a backup given back by replication: new replid, same connection -------------------

def test_backup_loaded_through_replication_is_restored(debug_redis: RedisServer) -> None:
    """An operator gives the service's Redis an older copy of its data the way Redis allows
    without a restart: `REPLICAOF <server holding the backup>`, full sync, `REPLICAOF NO
    ONE`. The Redis keeps its run_id, but its master_replid changes. The service is paused
    a moment meanwhile (a GC pause, a starved CPU), so that none of its writes lands in the
    replica phase, and it keeps its connection: nothing but the data tells it what
    happened.

    Expected: the loss is noticed and restored before the next sale; the answered ticket is
    found by GET and the cap holds."""
    backup = RedisServer().start()
    svc = ServiceProcess(str(CONFIG), debug_redis.url).start()
    try:
        draw = _current(svc.base_url)
        first = _fdj(draw)
        assert _sell(svc.base_url, first)[1]["status"] == "accepted"
        backup.follow(debug_redis)
        backup.promote()  # the backup: what the Redis held after `first`
        second = _fdj(draw)
        status, body = _sell(svc.base_url, second)
        assert status == 200, body
        assert body["status"] == "accepted", body
        c = debug_redis.client()
        before = c.info("replication")["master_replid"]
        assert svc.process is not None
        svc.process.send_signal(signal.SIGSTOP)
        try:
            c.execute_command("REPLICAOF", "127.0.0.1", str(backup.port))
            deadline = time.monotonic() + 10
            while not debug_redis.in_sync():
                assert time.monotonic() < deadline
                time.sleep(0.01)
            c.execute_command("REPLICAOF", "NO", "ONE")
        finally:
            svc.process.send_signal(signal.SIGCONT)
        assert c.info("replication")["master_replid"] != before  # another identity
        time.sleep(1.0)  # several watch periods
        assert _get(svc.base_url, second["ticket_id"]) == 200, (
            "a ticket answered accepted is gone: the Redis, given back an older copy (new "
            "replication id), was never restored")
        sold = 1000 + _sell_to_cap(svc.base_url, draw)
        assert _staked(svc.base_url, EIGHT, draw) <= FDJ_CAP
        assert sold <= FDJ_CAP, f"{sold} accepted on a cap of {FDJ_CAP}"
    finally:
        svc.stop()
        backup.stop()


# -- 2. a reload from an older file: same identity, only the data went back --------------

def test_reload_from_an_older_file_is_restored(debug_redis: RedisServer) -> None:
    """`DEBUG RELOAD NOSAVE`: Redis reloads its RDB file (saved after the first sale) in
    place, losing what was written since; run_id and master_replid are unchanged.

    Expected (What an answer promises: "a restart from an older file, a restored backup"):
    the answered ticket is put back before the next sale, and the cap is not sold again."""
    svc = ServiceProcess(str(CONFIG), debug_redis.url).start()
    try:
        draw = _current(svc.base_url)
        assert _sell(svc.base_url, _fdj(draw))[1]["status"] == "accepted"
        c = debug_redis.client()
        c.save()
        second = _fdj(draw)
        status, body = _sell(svc.base_url, second)
        assert status == 200, body
        assert body["status"] == "accepted", body
        c.execute_command("DEBUG", "RELOAD", "NOSAVE")
        time.sleep(1.0)
        assert _get(svc.base_url, second["ticket_id"]) == 200, (
            "a ticket answered accepted is gone after Redis reloaded an older file")
        sold = 1000 + _sell_to_cap(svc.base_url, draw)
        assert sold <= FDJ_CAP, f"{sold} accepted on a cap of {FDJ_CAP}"
    finally:
        svc.stop()


# -- 3. a restart on a Redis given back a backup of itself ---------------------------------

def _dump_all(server: RedisServer) -> list[tuple[bytes, int, bytes]]:
    return backup_keys(server.client())


def _restore_all(server: RedisServer, keys: list[tuple[bytes, int, Any]]) -> None:
    restore_keys(server.client(), keys)


def test_restart_after_a_backup_restored_in_place_restores() -> None:
    """The service is stopped; the operator gives its Redis back yesterday's backup in
    place (FLUSHALL, then every key of a DUMP taken after the first sale RESTOREd — what
    key-copying backup tools do). The service starts again on its own journal directory,
    on a Redis with the same identity as when it stopped.

    Expected: the start restores what Redis lost (the journal holds it) before selling; the
    ticket answered after the backup is found, and the cap is not sold again."""
    server = RedisServer().start()
    svc = ServiceProcess(str(CONFIG), server.url).start()
    again: ServiceProcess | None = None
    try:
        draw = _current(svc.base_url)
        assert _sell(svc.base_url, _fdj(draw))[1]["status"] == "accepted"
        saved = _dump_all(server)
        second = _fdj(draw)
        status, body = _sell(svc.base_url, second)
        assert status == 200, body
        assert body["status"] == "accepted", body
        svc.stop()
        _restore_all(server, saved)
        again = ServiceProcess(str(CONFIG), server.url,
                               env={"CAPSVC_JOURNAL_DIR": str(svc.journal_dir)}).start()
        assert _get(again.base_url, second["ticket_id"]) == 200, (
            "a ticket answered accepted is gone: the start skipped the restore "
            f"({(again.log.read_text()[-600:])})")
        sold = 1000 + _sell_to_cap(again.base_url, draw)
        assert sold <= FDJ_CAP, f"{sold} accepted on a cap of {FDJ_CAP}"
    finally:
        if again is not None:
            again.stop()
        svc.stop()
        server.stop()
