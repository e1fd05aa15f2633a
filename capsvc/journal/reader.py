"""Reading journal files back: their records, and whether their chains hold.

A file is read line by line (memory: one line at a time). A line that does not end with a
newline, at the end of a file, is a torn tail (what a crash leaves): it is reported, never
read as a record (whether it is a break depends on what follows the file: `verify`).
Anything else that does not chain — a line removed, altered, inserted or moved — is a
break, named by file and line. A line of a type this reader does not know (a later
version's) is chained like every other, and skipped.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from capsvc.journal.records import (
    KNOWN_TYPES,
    VERSION,
    Line,
    Open,
    Record,
    SalesRecord,
    chain_decoder,
    line_decoder,
    link_decoder,
    sale_records,
)
from capsvc.journal.writer import journal_files


@dataclass
class FileCheck:
    """What reading one file found."""

    path: Path
    header: Open | None = None
    lines: int = 0
    """Complete lines read (the tail aside)."""
    captured: dict[int, str] = field(default_factory=dict, repr=False)
    """The hash of the lines asked for (the line another file's first line follows)."""
    first_prev: str | None = None
    """The `prev` of the first line (the hash of the line of the file it follows)."""
    last_hash: str | None = None
    tail: str | None = None
    """What the end of the file holds that is not a record (a torn line)."""
    breaks: list[str] = field(default_factory=list)
    digest: hashlib._Hash | None = field(default=None, repr=False)
    """When given, takes the bytes of every complete line read (newlines included): the
    SHA-256 of the file as read."""
    size: int = 0
    """Bytes of the complete lines read."""


def lines_of(path: Path) -> Iterator[tuple[int, bytes, bool]]:
    """(line number, bytes without the newline, whether it ended with a newline)."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if raw.endswith(b"\n"):
                yield n, raw[:-1], True
            else:
                yield n, raw, False


def read(path: Path, check: FileCheck | None = None, *, capture: frozenset[int] = frozenset(),
         wanted: Callable[[Line], bool] | None = None
         ) -> Iterator[tuple[int, Open | Record]]:
    """The records of one file with their line numbers, checking its chain into `check`.
    Lines that break the chain are still yielded when they decode (a reader restoring
    decisions wants every decision; `verify` reports the break). `wanted`: only the records
    whose head it accepts (and the `open` line) are decoded and yielded; the chain is
    checked on every line all the same."""
    check = check if check is not None else FileCheck(path)
    digest = check.digest
    prev: str | None = None
    for n, line, complete in lines_of(path):
        if not complete:
            check.tail = f"line {n}: a torn last line ({len(line)} bytes, no newline)"
            return
        if digest is not None:
            digest.update(line)
            digest.update(b"\n")
        check.size += len(line) + 1
        try:
            head = _head(line)
            skip = n > 1 and (head.type not in KNOWN_TYPES
                              or (wanted is not None and not wanted(head)))
            record = None if skip else line_decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            check.breaks.append(f"line {n}: not a journal record ({e})")
            prev = hashlib.sha256(line).hexdigest()
            if n in capture:
                check.captured[n] = prev
            check.lines = n
            check.last_hash = prev
            continue
        if n == 1:
            check.first_prev = head.prev
            if not isinstance(record, Open):
                check.breaks.append("line 1: the file does not start with its `open` line")
            else:
                check.header = record
                if record.v > VERSION:
                    check.breaks.append(f"line 1: format version {record.v} is newer than "
                                        f"this reader's ({VERSION})")
                if record.file != path.name:
                    check.breaks.append(f"line 1: the file says it is {record.file!r}")
        elif head.prev != prev:
            check.breaks.append(f"line {n}: does not follow line {n - 1} (its prev hash "
                                "differs: a line was removed, altered, inserted or moved)")
        elif isinstance(record, Open) or (record is None and head.type == "open"):
            check.breaks.append(f"line {n}: an `open` line inside the file")
        prev = hashlib.sha256(line).hexdigest()
        if n in capture:
            check.captured[n] = prev
        check.lines = n
        check.last_hash = prev
        if isinstance(record, SalesRecord):
            for sold in sale_records(record):
                if wanted is None or wanted(Line(game=sold.game, first_draw=sold.first_draw,
                                                 draws=sold.draws)):
                    yield n, sold
        elif record is not None:
            yield n, record


def _head(line: bytes) -> Line:
    """A line's head; of a line of a type this reader does not know, its link at least."""
    try:
        return chain_decoder.decode(line)
    except msgspec.ValidationError:
        link = link_decoder.decode(line)
        if link.type in KNOWN_TYPES:
            raise
        return Line(link.prev, link.type)


def records(directory: Path, *, modified_since: float = 0.0
            ) -> Iterator[tuple[Path, int, Open | Record]]:
    """Every record of the directory's files last written at or after `modified_since`
    (host clock, seconds): the files that may hold decisions still retained."""
    for path in journal_files(directory):
        try:
            if os.stat(path).st_mtime < modified_since:
                continue
        except FileNotFoundError:  # pruned meanwhile
            continue
        for n, record in read(path):
            yield path, n, record


BLOCK_BYTES = 4 * 1024 * 1024
"""How much of a file `retained_records` reads at a time."""


def retained_records(directory: Path, *, modified_since: float = 0.0
                     ) -> Iterator[Open | Record | SalesRecord]:
    """The records of the directory's files last written at or after `modified_since`
    (host clock, seconds), for a restore: each file read in blocks and each line decoded
    once, the chain not checked (a restore wants every decision: `read` yields the lines
    that break the chain too), a `sales` line as it is (a restore puts its sales back as
    their call left them). A torn last line and a line that is not a record are passed
    over, as `read` passes them."""
    decode = line_decoder.decode
    for path in journal_files(directory):
        try:
            if os.stat(path).st_mtime < modified_since:
                continue
            f = open(path, "rb")  # noqa: SIM115 (a generator: closed by the with below)
        except FileNotFoundError:  # pruned meanwhile
            continue
        with f:
            rest = b""
            while block := f.read(BLOCK_BYTES):
                lines = (rest + block).split(b"\n")
                rest = lines.pop()  # a line not complete yet (at the end: a torn tail)
                for line in lines:
                    try:
                        yield decode(line)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        continue


def header_of(path: Path) -> Open | None:
    """A file's `open` line, None if it has none."""
    for _, line, complete in lines_of(path):
        if not complete:
            return None
        try:
            record = line_decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        return record if isinstance(record, Open) else None
    return None
