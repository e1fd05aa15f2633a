"""Writes requirements.lock: the image's dependencies (constraints.txt's pins) with the
sha256 of each file pip may install for them, which the Dockerfile installs with
`--require-hashes`.

    python deploy/lock.py [--platform manylinux2014_x86_64 ...]

Every pinned distribution of constraints.txt is downloaded as a wheel for CPython 3.11 on
each platform given (default: the image's, linux x86_64) from the index pip is configured
with, and hashed. Run it after changing constraints.txt, in the same commit;
tests/integration/test_distributions.py checks that the two agree.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADER = """\
# The image's dependencies (Dockerfile: pip install --require-hashes), pinned as constraints.txt
# pins them, each with the sha256 of the wheels pip may install for CPython 3.11 on {platforms}.
# Written by `python deploy/lock.py`; do not edit by hand.
"""


def pinned() -> list[tuple[str, str]]:
    out = []
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out.append((name, version))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--platform", action="append",
                        help="a wheel platform tag (default: manylinux2014_x86_64)")
    args = parser.parse_args()
    platforms = args.platform or ["manylinux2014_x86_64"]
    lines = [HEADER.format(platforms=", ".join(platforms))]
    with tempfile.TemporaryDirectory() as tmp:
        for name, version in pinned():
            hashes = set()
            for platform in platforms:
                where = Path(tmp) / f"{name}-{platform}"
                subprocess.run(
                    [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                     "--only-binary=:all:", "--platform", platform, "--python-version", "3.11",
                     "--implementation", "cp", "--abi", "cp311", "--dest", str(where),
                     f"{name}=={version}"], check=True)
                hashes |= {hashlib.sha256(f.read_bytes()).hexdigest() for f in where.iterdir()}
            lines.append(f"{name}=={version} \\\n" + " \\\n".join(
                f"    --hash=sha256:{h}" for h in sorted(hashes)) + "\n")
    (ROOT / "requirements.lock").write_text("".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
