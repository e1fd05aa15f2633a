"""`capsvc journal ship`: a copy is always whole lines of its file. A shipper killed in the
middle of a write leaves part of a line; the next pass cuts it back and copies it whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from capsvc.journal import ship


def journal(tmp_path: Path, lines: int) -> Path:
    source = tmp_path / "journal"
    source.mkdir()
    body = b"".join(b'{"n":%d,"pad":"%s"}\n' % (i, b"x" * (i % 50)) for i in range(lines))
    (source / "capsvc-20261203T000000Z-0-life.jsonl").write_bytes(body)
    return source


def test_a_copy_torn_in_the_middle_of_a_line_is_made_whole_by_the_next_pass(
        tmp_path: Path) -> None:
    source = journal(tmp_path, 2000)
    (file,) = source.iterdir()
    whole = file.read_bytes()
    copies = tmp_path / "copy"
    copies.mkdir()
    torn = whole[:len(whole) // 2 + 7]  # what a write cut short by SIGKILL leaves
    assert not torn.endswith(b"\n")
    (copies / file.name).write_bytes(torn)
    ship.ship_once(source, copies)
    assert (copies / file.name).read_bytes() == whole


def test_a_pass_writes_whole_lines_in_every_write(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each write ends a line (chunks end at a newline), so a pass stopped between two
    writes leaves a copy of whole lines."""
    source = journal(tmp_path, 3000)
    monkeypatch.setattr(ship, "CHUNK", 1000)
    written: list[bytes] = []
    real_write = ship.os.write

    def write(fd: int, data: bytes) -> int:
        written.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(ship.os, "write", write)
    ship.ship_once(source, tmp_path / "copy")
    assert len(written) > 10
    assert all(chunk.endswith(b"\n") for chunk in written)
