"""docs/client.md: every Python example is a complete program that runs, as it is written,
against a real service with the local configuration (`capsvc serve`'s example tokens), and
prints what it says it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import capsvc
from tests.support.service import ServiceProcess, served

DOC = Path(__file__).resolve().parents[2] / "docs" / "client.md"
LOCAL = Path(capsvc.__file__).parent / "default.toml"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def examples() -> list[str]:
    return _BLOCK.findall(DOC.read_text())


@pytest.fixture(scope="module")
def local() -> Iterator[ServiceProcess]:
    with served(str(LOCAL)) as service:
        yield service


def test_the_page_has_its_examples() -> None:
    assert len(examples()) >= 7


@pytest.mark.parametrize("index", range(7))
def test_each_example_runs(index: int, local: ServiceProcess, tmp_path: Path) -> None:
    code = examples()[index]
    script = tmp_path / f"example_{index}.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "CAPSVC_URL": local.base_url})
    assert result.returncode == 0, f"{code}\n--- stderr\n{result.stderr}"
    assert result.stdout.strip(), "an example prints what it shows"
    assert "Traceback" not in result.stderr
