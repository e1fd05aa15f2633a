"""The packages' dependencies point down only (pyproject.toml, [tool.importlinter]), and the
client an integrator installs loads nothing of the server."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_the_import_contracts_hold() -> None:
    lint = shutil.which("lint-imports")
    assert lint is not None, "import-linter is a test dependency (pip install -e .[test])"
    out = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_importing_the_client_loads_nothing_of_the_server() -> None:
    """`import capsvc_client` (its own distribution) loads nothing of the service, and the
    service's name for it, `capsvc.client`, loads only the service's package root."""
    def loaded(module: str) -> list[str]:
        code = (f"import json, sys, {module}; "
                "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
                "('capsvc', 'redis', 'hiredis', 'prometheus_client', 'uvloop'))))")
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, check=True)
        return list(json.loads(out.stdout))

    assert loaded("capsvc_client") == []
    assert loaded("capsvc.client") == ["capsvc", "capsvc.client"]
