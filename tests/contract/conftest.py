"""The contract tests' service: a `capsvc serve` process on a Redis of its own, with the
configuration of this folder (one channel, token t-all, that may do everything)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.service import ServiceProcess, served

HERE = Path(__file__).parent
CONFIG = HERE / "capsvc.toml"
TOKEN = "t-all"


@pytest.fixture(scope="module")
def contract_service() -> Iterator[ServiceProcess]:
    with served(str(CONFIG)) as service:
        yield service
