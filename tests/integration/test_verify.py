"""`capsvc journal verify` as an operator runs it, on files the real writer wrote: each
process lifetime's head printed (also when every lifetime is pid 1 of one host), a line
changed up to an anchored head named, a line added to a closed file named."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from capsvc.journal.writer import journal_files, open_journal
from tests.unit.test_journal import append, forged, lines, spread, write

HEAD = re.compile(r"^head \(.*\): (\S+):(\d+):([0-9a-f]{64}) \(life ([0-9a-f]{16}), "
                  r"pod-0/1\)$", re.MULTILINE)


def verify(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "capsvc", "journal", "verify", *args],
                          capture_output=True, text=True, timeout=60, env=dict(os.environ),
                          check=False)


async def container_restarted(directory: Path, sales: tuple[int, ...]) -> list[str]:
    """One lifetime per entry of `sales`, each pid 1 of the same host and writing that many
    sales; their life ids, oldest first."""
    lives = []
    for i, n in enumerate(sales):
        journal = open_journal(directory, max_file_bytes=4096, keep_ms=86_400_000,
                               proc="pod-0/1")
        await write(journal, spread(f"L{i}-", n))
        await journal.aclose()
        lives.append(journal.life)
    return lives


async def test_every_lifetime_of_pid_1_has_its_head_and_an_anchor_names_a_removed_line(
        tmp_path: Path) -> None:
    """Each pid-1 lifetime's head is printed; the newest line removed, --anchor names it."""
    lives = await container_restarted(tmp_path, (30, 12, 3))
    first = verify(str(tmp_path))
    assert first.returncode == 0, first.stdout
    heads = {m[4]: (m[1], int(m[2]), m[3]) for m in HEAD.finditer(first.stdout)}
    assert set(heads) == set(lives)
    for life, (name, line, _) in heads.items():
        newest = max(p for p in journal_files(tmp_path) if life in p.name)
        assert (name, line) == (newest.name, len(lines(newest)))
    name, line, _ = heads[lives[-1]]
    newest = tmp_path / name
    newest.write_bytes(b"".join(lines(newest)[:-1]))
    anchors = [f"--anchor={n}:{ln}:{h}" for n, ln, h in heads.values()]
    assert verify(str(tmp_path)).returncode == 0  # the files alone cannot tell
    out = verify(str(tmp_path), *anchors)
    assert out.returncode == 1, out.stdout
    assert f"chain broken: {newest}: line {line} anchored" in out.stdout
    as_json = json.loads(verify(str(tmp_path), "--format", "json", *anchors).stdout)
    assert as_json["ok"] is False
    assert {h["life"] for h in as_json["heads"]} == set(lives)
    assert {h["proc"] for h in as_json["heads"]} == {"pod-0/1"}


async def test_a_forged_cancel_appended_to_a_closed_file_fails_verify(tmp_path: Path) -> None:
    """A cancel chained after a closed file's last line: exit 1, the file and line named."""
    await container_restarted(tmp_path, (20, 20))
    closed = journal_files(tmp_path)[0]
    n = len(lines(closed))
    append(closed, forged(closed, "cancel"))
    out = verify(str(tmp_path))
    assert out.returncode == 1, out.stdout
    assert f"chain broken: {closed}: line {n + 1}: past the file's end" in out.stdout


def test_an_anchor_that_is_not_one_is_a_usage_error(tmp_path: Path) -> None:
    """`--anchor` takes `file:line:sha256` as verify prints it; anything else exits 2."""
    out = verify(str(tmp_path), "--anchor", "capsvc-x.jsonl:0:abc")
    assert out.returncode == 2
    assert "file:line:sha256" in out.stderr
