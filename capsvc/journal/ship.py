"""Copies of a journal directory, kept up to date: `capsvc journal ship`.

A journal file is only ever appended to, so a copy is brought up to date by appending what
the file has beyond it, complete lines only (a line being written is copied once it ends).
After each pass the copy's `.shipped` says until when (the host's clock, ms) everything
the directory held is in the copy, and `ended` once the shipper stopped for good (its
process stopping: a last pass first). A reader of the copies (`capsvc report --all-final`)
waits for a copy whose `.shipped` is behind the draw it would report.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec

from capsvc.journal.writer import journal_files

MARK = ".shipped"
CHUNK = 4 * 1024 * 1024


class Shipped(msgspec.Struct):
    at: int
    """Everything the journal directory held at this instant (host clock, ms) is copied."""
    ended: bool = False
    """The shipper stopped for good after a last pass: the copy is whole."""


class ShipError(Exception):
    """A copy that is not a prefix of its file (bigger than it): left alone, named."""


def ship_once(source: Path, dest: Path) -> tuple[int, list[str]]:
    """One pass: append to each copy in `dest` the complete lines its file in `source` has
    beyond it; the bytes copied, and the files that could not be (a copy longer than its
    file)."""
    dest.mkdir(parents=True, exist_ok=True)
    copied = 0
    problems: list[str] = []
    for path in journal_files(source):
        target = dest / path.name
        have = _whole_lines(target)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if have > size:
                    problems.append(f"{target}: {have} bytes, longer than {path} ({size})")
                    continue
                if have == size:
                    continue
                f.seek(have)
                data = f.read(size - have)
        except FileNotFoundError:  # pruned meanwhile
            continue
        end = data.rfind(b"\n") + 1
        if not end:
            continue  # no complete line yet
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        try:
            start = 0
            while start < end:  # each write ends a line: a pass cut short leaves whole ones
                stop = data.rfind(b"\n", start, min(end, start + CHUNK)) + 1 or end
                start += os.write(fd, data[start:stop])
            os.fsync(fd)
        finally:
            os.close(fd)
        copied += end
    return copied, problems


def _whole_lines(copy: Path) -> int:
    """The copy's size, once cut back to its last complete line: a shipper killed in the
    middle of a write leaves part of a line, which the next pass copies again whole."""
    try:
        size = copy.stat().st_size
    except FileNotFoundError:
        return 0
    if size == 0:
        return 0
    with open(copy, "rb+") as f:
        keep = size
        while keep > 0:  # back to the last newline, however long the torn part
            back = min(keep, CHUNK)
            f.seek(keep - back)
            tail = f.read(back)
            if (cut := tail.rfind(b"\n")) >= 0:
                keep = keep - back + cut + 1
                break
            keep -= back
        if keep < size:
            f.truncate(keep)
            os.fsync(f.fileno())
        return keep


def mark(dest: Path, shipped: Shipped) -> None:
    """Write `dest/.shipped` (replaced atomically)."""
    tmp = dest / f"{MARK}.{os.getpid()}.tmp"
    tmp.write_bytes(msgspec.json.encode(shipped))
    os.replace(tmp, dest / MARK)


def ship(source: Path, dest: Path, *, ended: bool = False) -> tuple[int, list[str]]:
    """A pass, then the mark: everything `source` held when the pass began is copied."""
    began = int(time.time() * 1000)
    out = ship_once(source, dest)
    if not out[1]:
        mark(dest, Shipped(began, ended))
    return out


def shipped_until(directory: Path) -> int | None:
    """Until when (host clock, ms) a copy is known whole; None: whole (no `.shipped`: not
    a shipped copy, or its shipper ended)."""
    try:
        shipped = msgspec.json.decode((directory / MARK).read_bytes(), type=Shipped)
    except FileNotFoundError:
        return None
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 0  # unreadable: known whole until nothing
    return None if shipped.ended else shipped.at
