"""The contract tests' service: a `capsvc serve` process on a Redis of its own, with the
configuration of this folder (one channel, token t-all, that may do everything)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from capsvc.testing import RedisServer, ServiceProcess

HERE = Path(__file__).parent
CONFIG = HERE / "capsvc.toml"
TOKEN = "t-all"


@pytest.fixture(scope="module")
def contract_service() -> Iterator[ServiceProcess]:
    redis = RedisServer().start()
    service = ServiceProcess(str(CONFIG), redis.url).start()
    yield service
    service.stop()
    redis.stop()
