"""The journal's writer: one append-only file at a time per process, group commit.

Records appended during one event-loop tick (and while the previous batch is on its way to
disk) make one batch: one `write`, one `fdatasync`, in the writer's own thread, never on
the event loop. Each caller's future resolves once its batch is durable; a batch that
cannot be written fails all of its callers (their answer is a 503: a decision that is not
journaled is not acknowledged).

The chain is made in the writer thread, as lines are written: each line starts with
`"prev"`, the SHA-256 of the line before it in the file. After a failed write the file is
cut back to its durable lines and nothing more goes to it; the next batch opens a new file
whose first line chains to the last of them and says how many there are, so a closed file
ends exactly there.

Each writer is one process lifetime, with an id of its own (`life`): host and pid repeat
(in a container every process may be pid 1), the life id does not. Files:
`capsvc-<UTC time opened>-<host>-<life>-<seq>.jsonl`, so that names sort in time and never
collide. A file is closed past `max_file_bytes` and at each UTC midnight; files whose last
write is older than `keep` are deleted (by whichever process rotates next). What waits for
the disk is bounded (MAX_PENDING_BYTES): beyond it appends are refused (503), memory does
not grow.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

from capsvc.domain.errors import Unavailable
from capsvc.journal.records import VERSION, Checkpoint, Open, Record, SalesRecord, encode

log = logging.getLogger(__name__)

MAX_PENDING_BYTES = 8 * 1024 * 1024
"""Encoded records waiting for the disk, at most: a disk that stalls makes sales wait
(and time out, 503) rather than memory grow."""
SUFFIX = ".jsonl"

WriteObserver = Callable[[int, int, float], None]
"""Called with (records, bytes, seconds from the batch's start to its fdatasync)."""


def _ignore_write(records: int, size: int, seconds: float) -> None:
    pass


def _ignore(*args: object) -> None:
    pass


def process_name() -> str:
    return f"{socket.gethostname()}/{os.getpid()}"


def _life_lock(directory: Path, life: str) -> Path:
    return directory / f".life-{life}.lock"


def hold_life(directory: Path, life: str) -> int:
    """Lock lifetime `life`'s file in `directory` for as long as the process lives (the
    kernel lets go of it when the process dies, however it dies)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(_life_lock(directory, life), os.O_WRONLY | os.O_CREAT, 0o640)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def release_life(directory: Path, life: str, fd: int) -> None:
    with contextlib.suppress(OSError):
        _life_lock(directory, life).unlink()
    with contextlib.suppress(OSError):
        os.close(fd)


def alive(directory: Path, life: str) -> bool:
    """Whether the process of lifetime `life` still runs (holds its lock in `directory`);
    the lock of a lifetime gone is removed."""
    path = _life_lock(directory, life)
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        path.unlink()
    return False


def journal_files(directory: Path) -> list[Path]:
    """The journal files of a directory, oldest first (their names sort in time)."""
    try:
        return sorted(p for p in directory.iterdir()
                      if p.name.startswith("capsvc-") and p.name.endswith(SUFFIX))
    except FileNotFoundError:
        return []


class Journal:
    """Appends records to this process's journal files; see the module's docstring."""

    def __init__(self, directory: str | os.PathLike[str], *, max_file_bytes: int,
                 keep_ms: int, proc: str | None = None,
                 on_write: WriteObserver = _ignore_write,
                 on_error: Callable[[], None] = _ignore,
                 on_files: Callable[[int], None] = _ignore) -> None:
        self.dir = Path(directory)
        self.proc = proc or process_name()
        self.life = os.urandom(8).hex()
        """This process lifetime's identity (16 hex digits, random): its files are one
        chain, and it names the lifetime's field in Redis's marks (lua/capsvc.lua, MARKS).
        Not host/pid, which repeat (PID 1 in a container, every lifetime)."""
        self._alive = hold_life(self.dir, self.life)
        """This lifetime's lock in the directory: held while the process lives, so that
        another process of the directory can tell it from a lifetime gone (`alive`)."""
        self.max_file_bytes = max_file_bytes
        self.keep_s = keep_ms / 1000
        self._on_write, self._on_error, self._on_files = on_write, on_error, on_files
        self.healthy = True
        """The last write succeeded (False: not ready until one does)."""
        self.problem: str | None = None
        # The event loop's side.
        self._bodies: list[bytes] = []
        self._waiters: list[asyncio.Future[None] | None] = []
        """One per record (None: nobody waits for it), and probes' empty ones."""
        self._pending = 0
        self._busy = False
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="capsvc-journal")
        self._idle: asyncio.Future[None] | None = None
        # The writer thread's side.
        self._fd: int | None = None
        self._name: str | None = None
        self._seq = 0
        self._lines = 0
        """Lines of the current file known durable."""
        self._size = 0
        self._last: bytes | None = None
        """Hash (hex, bytes) of the last durable line of the current (or last) file."""
        self._day = ""

    @property
    def current(self) -> str | None:
        """The name of the file being written."""
        return self._name

    # -- the event loop's side ------------------------------------------------------------

    def append(self, record: Record) -> asyncio.Future[None]:
        """Queue a record; the future resolves once it is durable (raises Unavailable if it
        cannot be made so)."""
        body = encode(record)
        if self._pending + len(body) > MAX_PENDING_BYTES:
            raise Unavailable("the journal's disk is not keeping up: decision not journaled")
        loop = self._loop or self._bind()
        fut = loop.create_future()
        self._bodies.append(body)
        self._waiters.append(fut)
        self._pending += len(body)
        if not self._busy and not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._start)
        return fut

    def append_many(self, records: Sequence[Record | SalesRecord]) -> asyncio.Future[None]:
        """Queue records together (one write takes them all): one future, resolved once
        they are all durable (raises Unavailable if they cannot be made so)."""
        bodies = [encode(r) for r in records]
        size = sum(len(b) for b in bodies)
        if self._pending + size > MAX_PENDING_BYTES:
            raise Unavailable("the journal's disk is not keeping up: decision not journaled")
        loop = self._loop or self._bind()
        fut = loop.create_future()
        self._bodies += bodies
        self._waiters += [None] * (len(bodies) - 1)
        self._waiters.append(fut)
        self._pending += size
        if not self._busy and not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._start)
        return fut

    def note(self, record: Record | Checkpoint) -> None:
        """Queue a record nobody waits for (durable with the batch it falls in)."""
        body = encode(record)
        if self._pending + len(body) > MAX_PENDING_BYTES:
            return  # what it records is also in the decisions that rest on it
        self._bodies.append(body)
        self._waiters.append(None)
        self._pending += len(body)
        loop = self._loop or self._bind()
        if not self._busy and not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._start)

    async def probe(self) -> bool:
        """Whether the journal can be written: after a failure, tries an empty batch (a new
        file is opened, the disk synced). For /readyz."""
        if self.healthy or self._busy:
            return self.healthy
        fut = (self._loop or self._bind()).create_future()
        self._waiters.append(fut)
        if not self._scheduled:
            self._scheduled = True
            (self._loop or self._bind()).call_soon(self._start)
        with contextlib.suppress(Unavailable):
            await fut
        return self.healthy

    async def aclose(self) -> None:
        """Write what is queued, then close the file."""
        if self._bodies or self._busy or self._scheduled:
            self._idle = (self._loop or self._bind()).create_future()
            if not self._busy and not self._scheduled:
                self._start()
            with contextlib.suppress(Exception):
                await self._idle
        await asyncio.get_running_loop().run_in_executor(self._executor, self._abandon)
        self._executor.shutdown(wait=True)
        release_life(self.dir, self.life, self._alive)

    def _bind(self) -> asyncio.AbstractEventLoop:
        self._loop = asyncio.get_running_loop()
        return self._loop

    def _start(self) -> None:
        self._scheduled = False
        if self._busy:
            return
        if not self._waiters:
            if self._idle is not None and not self._idle.done():
                self._idle.set_result(None)
            return
        bodies, waiters = self._bodies, self._waiters
        self._bodies, self._waiters = [], []
        self._busy = True
        started = time.perf_counter()
        queued = sum(len(b) for b in bodies)
        done = self._executor.submit(self._write_lines, bodies)
        loop = self._loop or self._bind()
        done.add_done_callback(lambda f: loop.call_soon_threadsafe(
            self._written, waiters, len(bodies), queued, started, f))

    def _written(self, waiters: list[asyncio.Future[None] | None], records: int,
                 queued: int, started: float, done: ThreadFuture[int]) -> None:
        self._busy = False
        self._pending -= queued
        error = done.exception()
        if error is None:
            self._on_write(records, done.result(), time.perf_counter() - started)
            if not self.healthy:
                log.info("the journal is written again", extra={"file": self._name})
            self.healthy, self.problem = True, None
            for w in waiters:
                if w is not None and not w.done():
                    w.set_result(None)
        else:
            self._on_error()
            if self.healthy:
                log.error("the journal cannot be written: sales answer 503 until it can",
                          extra={"dir": str(self.dir), "error": str(error)})
            self.healthy, self.problem = False, str(error)
            failure = Unavailable(f"the decision could not be journaled ({error}): outcome "
                                  "unknown")
            for w in waiters:
                if w is not None and not w.done():
                    w.set_exception(failure)
        if self._bodies or self._waiters:
            self._start()
        elif self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    # -- the writer thread's side ---------------------------------------------------------

    def _write_lines(self, bodies: list[bytes]) -> int:
        """Append the lines of `bodies` and make them durable; the bytes written."""
        if self._fd is None or self._size >= self.max_file_bytes or self._today() != self._day:
            self._rotate()
        fd = self._fd
        assert fd is not None
        last = self._last
        parts = []
        for body in bodies:
            line = b'{"prev":"' + last + b'",' + body[1:] if last is not None else (
                b'{"prev":null,' + body[1:])
            last = hashlib.sha256(line).hexdigest().encode()
            parts.append(line)
        data = b"\n".join(parts) + b"\n" if parts else b""
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fdatasync(fd)
        except OSError:
            self._cut_back(fd)
            self._abandon()
            raise
        self._last = last
        self._lines += len(bodies)
        self._size += len(data)
        return len(data)

    def _today(self) -> str:
        return datetime.now(UTC).strftime("%Y%m%d")

    def _rotate(self) -> None:
        """Close the current file, open the next one (its first line chained to the last
        durable line of the one before), prune what is past `keep`."""
        after, after_lines = self._name, self._lines if self._name else None
        self._abandon()
        self.dir.mkdir(parents=True, exist_ok=True)
        now = datetime.now(UTC)
        host = socket.gethostname().replace("/", "_")
        stamp = now.strftime("%Y%m%dT%H%M%S%fZ")
        name = f"capsvc-{stamp}-{host}-{self.life}-{self._seq:04d}{SUFFIX}"
        fd = os.open(self.dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o640)
        try:
            header = encode(Open(v=VERSION, file=name, proc=self.proc, life=self.life,
                                 seq=self._seq,
                                 opened=now.isoformat(timespec="seconds").replace("+00:00", "Z"),
                                 after=after, after_lines=after_lines))
            last = self._last
            line = (b'{"prev":"' + last + b'",' if last is not None else b'{"prev":null,'
                    ) + header[1:]
            os.write(fd, line + b"\n")
            os.fdatasync(fd)
            dfd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dfd)  # the file's name is durable too
            finally:
                os.close(dfd)
        except OSError:
            os.close(fd)
            # A file without its first line is no journal file: gone, or a disk that stays
            # full would be left with one empty file per failed batch.
            with contextlib.suppress(OSError):
                os.unlink(self.dir / name)
            raise
        self._fd, self._name = fd, name
        self._seq += 1
        self._lines, self._size = 1, len(line) + 1
        self._last = hashlib.sha256(line).hexdigest().encode()
        self._day = now.strftime("%Y%m%d")
        log.info("journal file opened", extra={"file": str(self.dir / name)})
        self._prune()

    def _cut_back(self, fd: int) -> None:
        """After a failed write: the file cut back to its durable lines, where the next
        file's `open` line will say it ends (what the failure left there was never
        acknowledged). If the disk refuses even that, `verify` names those lines."""
        try:
            os.ftruncate(fd, self._size)
            os.fdatasync(fd)
        except OSError as e:
            log.error("a journal file could not be cut back to its durable lines after a "
                      "failed write: verify will name the lines past them",
                      extra={"file": str(self.dir / (self._name or "")),
                             "lines": self._lines, "error": str(e)})

    def _abandon(self) -> None:
        """Close the file: nothing more goes to it."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def _prune(self) -> None:
        cutoff = time.time() - self.keep_s
        files = journal_files(self.dir)
        kept = 0
        for p in files:
            try:
                if p.name != self._name and p.stat().st_mtime < cutoff:
                    p.unlink()
                    log.info("journal file past its keep pruned", extra={"file": str(p)})
                    continue
            except FileNotFoundError:
                continue
            kept += 1
        self._on_files(kept)


def open_journal(directory: str | os.PathLike[str], **kwargs: object) -> Journal:
    """A journal whose first file is open (raises OSError when the directory cannot be
    written: the service does not start without its journal)."""
    journal = Journal(directory, **kwargs)  # type: ignore[arg-type]
    journal._rotate()
    return journal


