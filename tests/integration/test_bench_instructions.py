"""bench/instructions.py's driver sells what it counts: every ticket of its batches decided
through the product's own wiring (the marks, the journal), journaled, none refused.
Asserts nothing about instructions or time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from capsvc.journal.reader import records
from capsvc.journal.records import SaleRecord
from tests.support.servers import RedisServer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from run import config_file  # noqa: E402


def test_the_driver_sells_every_ticket_and_journals_it(redis_server: RedisServer,
                                                        standalone_db: Any) -> None:
    config = config_file(redis=f'url = "{redis_server.url}"')
    subprocess.run([sys.executable, str(REPO / "bench" / "instructions.py"), "--drive",
                    redis_server.url, config, "3", "16", "T"], cwd=REPO, check=True,
                   timeout=120)
    journal = Path(config).parent / "journal"
    sold = [r.ticket for _, _, r in records(journal) if isinstance(r, SaleRecord)]
    assert sorted(sold) == sorted(f"T-{b}-{i}" for b in range(3) for i in range(16))


def test_the_steady_state_has_a_ticket_in_every_record_bucket(
        redis_server: RedisServer, standalone_db: Any, tmp_path: Path) -> None:
    """`--redis`'s steady state: before the counted batches, every record bucket holds a
    ticket (its TTL set), and only then is the server's instrumentation turned on."""
    from capsvc.redis.store import RECORD_BUCKETS, TICKET_BUCKETS

    tool = tmp_path / "callgrind_control"  # valgrind's, as the driver would find it
    tool.write_text(f"#!/bin/sh\necho \"$@\" $(redis-cli -p {redis_server.port} "
                    "--scan --pattern 'r:*' | wc -l) > \"$0.called\"\n")
    tool.chmod(0o755)
    config = config_file(redis=f'url = "{redis_server.url}"')
    subprocess.run([sys.executable, str(REPO / "bench" / "instructions.py"), "--drive",
                    redis_server.url, config, "1", "16", "T", "4242"], cwd=REPO, check=True,
                   timeout=300, env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert (tmp_path / "callgrind_control.called").read_text().split() == [
        "-i", "on", "4242", str(TICKET_BUCKETS * RECORD_BUCKETS)]
    buckets = list(standalone_db.scan_iter("r:*", count=10_000))
    assert len(buckets) == TICKET_BUCKETS * RECORD_BUCKETS
    assert all(standalone_db.pttl(b) > 0 for b in buckets[:100])
