"""bench/resume.py's retained decisions are what a service would have left: sold through
the product's own sale path, journaled, and held by Redis as their journal says (`capsvc
journal verify --redis`). Asserts nothing about time."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from capsvc.journal.reader import records
from capsvc.journal.records import CancelRecord, SaleRecord
from tests.support.servers import RedisServer

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_resume", REPO / "bench" / "resume.py")
assert spec is not None
assert spec.loader is not None
resume = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = resume  # its dataclasses look their module up
spec.loader.exec_module(resume)


def test_the_retained_decisions_are_journaled_and_in_redis(
        redis_server: RedisServer, standalone_db: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "capsvc-resume.toml"
    config.write_text(resume.config_text("1s"))
    journal = tmp_path / "journal"
    monkeypatch.setenv("CAPSVC_JOURNAL_DIR", str(journal))
    asyncio.run(resume.sell_retained(config, redis_server.url, 300, "T", 0, concurrency=16))
    decisions = [r for _, _, r in records(journal) if isinstance(r, SaleRecord)]
    assert len({r.ticket for r in decisions}) == 300
    assert any(r.via == "lookup" for r in decisions)
    assert any(isinstance(r, CancelRecord) for r in decisions)
    out = subprocess.run([sys.executable, "-m", "capsvc", "journal", "verify", str(journal),
                          "--config", str(config), "--redis-url", redis_server.url],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
