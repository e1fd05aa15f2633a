"""A copy of the checkout as a fresh clone would have it: the files git tracks, and those it
does not ignore, without what earlier builds left (`build/`, `*.egg-info`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def copy_of_clone(into: Path) -> Path:
    """The checkout's files copied under `into`; `into`."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, check=True, capture_output=True, text=True).stdout
    for name in listed.splitlines():
        if (ROOT / name).is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, into / name)
    return into
