"""schemathesis, every check and every phase (examples, coverage, fuzzing, stateful through
the document's links), against the live service: no 5xx, every response on its schema, no
request that breaks the document accepted, and every request valid by the document that is
refused (422) refused for a reason docs/api.md lists as one JSON Schema cannot say (hooks.py
checks each one's code)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.contract.conftest import HERE
from tests.support.service import ServiceProcess

ROOT = HERE.parent.parent


def test_schemathesis_with_every_check_finds_nothing(contract_service: ServiceProcess,
                                                      tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SCHEMATHESIS_HOOKS": "tests.contract.hooks"}
    result = subprocess.run(
        ["schemathesis", "--config-file", str(HERE / "schemathesis.toml"), "run",
         contract_service.base_url + "/openapi.json", "--checks", "all",
         "--phases", "examples,coverage,fuzzing,stateful",
         "--suppress-health-check", "all", "--seed", "1",
         # A feed subscription never ends: tests/integration/test_feed.py covers it.
         "--exclude-path", "/v1/games/{game}/capped/stream"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "Custom check failed" not in result.stdout
