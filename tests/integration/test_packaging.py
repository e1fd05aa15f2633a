"""The wheel the Dockerfile installs carries the Lua library, the presets and the default
configuration (what the image runs, checked without a Docker engine)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from tests.support.clone import copy_of_clone

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_ships_lua_and_presets(tmp_path: Path) -> None:
    """pip wheel . puts lua/capsvc.lua, both presets, default.toml and every subpackage
    inside the package, and nothing of the test harness."""
    # Built from a copy of the files git knows (a `build/` left by an earlier build in the
    # checkout would otherwise ship modules that no longer exist).
    source = copy_of_clone(tmp_path / "source")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                    str(tmp_path), str(source)], check=True, timeout=300)
    (wheel,) = tmp_path.glob("capsvc-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in ("capsvc/lua/capsvc.lua", "capsvc/presets/fdj-keno-2008.toml",
                     "capsvc/presets/lnm-keno.toml", "capsvc/default.toml", "capsvc/py.typed"):
        assert expected in names, expected
    # Every package of the source tree is in the wheel (the image imports them all).
    for package in (ROOT / "capsvc").rglob("__init__.py"):
        module = package.relative_to(ROOT).as_posix()
        assert module in names, f"{module} is missing from the wheel (pyproject packages)"
    # The test harness (tests/support) is not the product's: nothing of it ships.
    for harness in ("testing.py", "faults.py", "http_faults.py"):
        assert not [n for n in names if n.endswith(f"/{harness}")], harness
    assert not [n for n in names if n.startswith("tests/")]
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "capsvc = capsvc.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_dockerfile_runs_the_service_from_the_environment() -> None:
    """The image runs `capsvc serve` as a non-root user, on the configuration's port, with
    a health check on that same port (`capsvc health` reads it from the configuration)."""
    text = (ROOT / "Dockerfile").read_text()
    assert "USER capsvc" in text
    assert 'CMD ["capsvc", "health"]' in text
    assert 'CMD ["capsvc", "serve", "--host", "0.0.0.0"]' in text
    assert "8080/healthz" not in text
    assert "CAPSVC_CONFIG=" in text
