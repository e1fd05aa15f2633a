"""docs/client.md and the README: every Python example is a complete program that runs, as
it is written, in a virtual environment holding only what docs/client.md's install command
installs (run as the page says, in a copy of the clone), against a real service with the
local configuration (`capsvc serve`'s example tokens), and prints what it says it prints."""

from __future__ import annotations

import os
import re
import subprocess
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

import capsvc
from tests.support.clone import copy_of_clone
from tests.support.service import ServiceProcess, served

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "client.md"
README = ROOT / "README.md"
LOCAL = Path(capsvc.__file__).parent / "default.toml"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_INSTALL = re.compile(r"^## Install\n.*?^```sh\n(.*?)^```", re.S | re.M)


def examples() -> list[tuple[str, str]]:
    return [(f"client.md#{i}", code) for i, code in enumerate(_BLOCK.findall(DOC.read_text()))
            ] + [(f"README.md#{i}", code)
                 for i, code in enumerate(_BLOCK.findall(README.read_text()))]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}


@pytest.fixture(scope="module")
def local() -> Iterator[ServiceProcess]:
    with served(str(LOCAL)) as service:
        yield service


@pytest.fixture(scope="module")
def integrator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a fresh virtual environment in which docs/client.md's install command
    ran, as written, in a copy of the clone's files."""
    where = tmp_path_factory.mktemp("integrator")
    clone = copy_of_clone(where / "clone")
    venv.create(where / "venv", with_pip=True)
    (install,) = _INSTALL.findall(DOC.read_text())
    commands = [line for line in install.splitlines() if line.strip()]
    assert commands == ["pip install -c constraints.txt ."]
    bin_dir = where / "venv" / "bin"
    for command in commands:
        result = subprocess.run(command, shell=True, cwd=clone, capture_output=True, text=True,
                                timeout=600, env={**_env(), "PATH": f"{bin_dir}:/usr/bin:/bin"})
        assert result.returncode == 0, result.stderr[-3000:]
    return bin_dir / "python"


def test_the_pages_have_their_examples() -> None:
    assert len([n for n, _ in examples() if n.startswith("client.md")]) >= 7
    assert [n for n, _ in examples() if n.startswith("README.md")]


def test_the_install_is_the_client_alone(integrator: Path) -> None:
    frozen = subprocess.run([integrator, "-m", "pip", "freeze"], capture_output=True,
                            text=True, check=True, env=_env()).stdout.lower()
    assert "aiohttp==" in frozen
    assert "msgspec==" in frozen
    assert "redis==" not in frozen
    assert "prometheus" not in frozen


@pytest.mark.parametrize("name", [n for n, _ in examples()])
def test_each_example_runs(name: str, local: ServiceProcess, integrator: Path,
                           tmp_path: Path) -> None:
    code = dict(examples())[name]
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run([integrator, str(script)], capture_output=True, text=True,
                            timeout=60, cwd=tmp_path,
                            env={**_env(), "CAPSVC_URL": local.base_url})
    assert result.returncode == 0, f"{code}\n--- stderr\n{result.stderr}"
    assert result.stdout.strip(), "an example prints what it shows"
    assert "Traceback" not in result.stderr
