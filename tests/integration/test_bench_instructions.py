"""bench/instructions.py's driver sells what it counts: every ticket of its batches decided
through the product's own wiring (the marks, the journal), journaled, none refused.
Asserts nothing about instructions or time."""

from __future__ import annotations

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
