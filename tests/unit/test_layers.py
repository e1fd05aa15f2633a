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
    """`import capsvc.client` (the base install, what an integrator installs) loads the
    package root and the client's own modules, nothing else of the service."""
    code = ("import json, sys, capsvc.client; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('capsvc', 'redis', 'hiredis', 'prometheus_client', 'uvloop'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True)
    loaded = json.loads(out.stdout)
    assert loaded == ["capsvc", "capsvc.client", "capsvc.client.api", "capsvc.client.errors",
                      "capsvc.client.models", "capsvc.client.reports"]
