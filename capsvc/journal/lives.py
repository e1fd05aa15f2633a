"""The process lifetimes of a journal directory, and which of their records a Redis lacks.

Every file names the lifetime that writes it (`open`'s `life`); every record carries the G
of the calls that made it, by mark (`marks`), and the lifetime's checkpoints (`marks`
lines) what it had written through each mark by then (lua/capsvc.lua, MARKS). A Redis
whose field of a lifetime, on every mark, is at least a record's stamp holds the record:
Redis keeps a prefix of each node's history, and the field only grows with the lifetime's
own writes. So what a Redis lacks of a lifetime is found from the end of its files: back to
the newest checkpoint the Redis covers, then forward, keeping the records stamped above
the Redis's fields (or not stamped). A Redis that lost nothing of a lifetime costs the read
of its newest file's end; one that lost everything, a read of its files once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
from msgspec import Struct

from capsvc.journal.reader import header_of
from capsvc.journal.records import Checkpoint, Open, Record, expanded, line_decoder
from capsvc.journal.writer import journal_files

_CHECKPOINT = b'"type":"marks"'


class _Head(Struct, forbid_unknown_fields=False):
    """What tells whether a line needs restoring, without decoding the rest."""

    type: str = ""
    until: int = 0
    marks: dict[str, int] | None = None


_head = msgspec.json.Decoder(_Head).decode
_checkpoint = msgspec.json.Decoder(Checkpoint).decode


def covered(made: dict[str, int], fields: dict[str, int]) -> bool:
    """Whether a Redis whose lifetime fields are `fields` holds what `made` stamps."""
    return all(fields.get(mark, 0) >= g for mark, g in made.items())


@dataclass
class Life:
    """One process lifetime of a directory: its files, oldest first."""

    life: str
    files: list[Path]


def lives_of(directory: Path, *, modified_since: float = 0.0) -> dict[str, Life]:
    """The lifetimes whose files were last written at or after `modified_since` (host
    clock, s): those that may hold decisions still retained."""
    found: dict[str, list[tuple[int, Path]]] = {}
    for path in journal_files(directory):
        try:
            if os.stat(path).st_mtime < modified_since:
                continue
        except FileNotFoundError:
            continue
        header = header_of(path)
        if header is None:
            continue
        found.setdefault(header.life, []).append((header.seq, path))
    return {life: Life(life, [p for _, p in sorted(files)]) for life, files in found.items()}


def made_by(life: Life) -> dict[str, int]:
    """What the lifetime had written through each mark by its newest line: its newest
    checkpoint, raised by the stamps of the records after it."""
    made: dict[str, int] = {}
    for path in reversed(life.files):
        data = _read(path)
        if data is None:
            continue
        at = _newest_checkpoint(data, lambda c: True)
        start = 0
        if at is not None:
            start, checkpoint = at
            made.update(checkpoint.made)
        for line in _complete_lines(data, start):
            head = _decoded_head(line)
            if head is not None and head.marks:
                for mark, g in head.marks.items():
                    if g > made.get(mark, 0):
                        made[mark] = g
        if at is not None:
            return made
    return made


def lacking(life: Life, fields: dict[str, int], now_ms: int) -> Iterator[Record]:
    """The records of `life` still retained at `now_ms` that a Redis whose fields of the
    lifetime are `fields` lacks, in journal order."""
    start_file, start_offset = 0, 0
    if fields:  # else nothing is covered: every file, from its start
        for i in range(len(life.files) - 1, -1, -1):
            data = _read(life.files[i])
            if data is None:
                continue
            at = _newest_checkpoint(data, lambda c: covered(c.made, fields))
            if at is not None:
                start_file, start_offset = i, at[0]
                break
    for i in range(start_file, len(life.files)):
        data = _read(life.files[i])
        if data is None:
            continue
        for line in _complete_lines(data, start_offset if i == start_file else 0):
            head = _decoded_head(line)
            if (head is None or head.type in ("open", "marks") or head.until <= now_ms
                    or (head.marks is not None and covered(head.marks, fields))):
                continue
            for record in expanded(line_decoder.decode(line)):
                if not isinstance(record, Open):
                    yield record


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:  # pruned meanwhile
        return None


def _newest_checkpoint(data: bytes, accept: object) -> tuple[int, Checkpoint] | None:
    """The newest checkpoint line of a file that `accept` takes, with the offset just past
    it; None if there is none."""
    end = len(data)
    while True:
        at = data.rfind(_CHECKPOINT, 0, end)
        if at < 0:
            return None
        begin = data.rfind(b"\n", 0, at) + 1
        stop = data.find(b"\n", at)
        end = begin
        if stop < 0:  # a torn last line
            continue
        try:
            checkpoint = _checkpoint(data[begin:stop])
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if callable(accept) and accept(checkpoint):
            return stop + 1, checkpoint


def _complete_lines(data: bytes, start: int) -> Iterator[bytes]:
    """The complete lines from offset `start` (a torn last line is not one)."""
    end = data.rfind(b"\n") + 1
    if end <= start:
        return
    yield from data[start:end - 1].split(b"\n")


def _decoded_head(line: bytes) -> _Head | None:
    try:
        return _head(line)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
