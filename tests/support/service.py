"""`capsvc serve` in a process of its own, for tests and benchmarks: `ServiceProcess` on a
free port (`python -m capsvc`: the capsvc that the child's sys.path finds, the working
directory's first), and `served`, one on a Redis of its own.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from capsvc.redis.embedded import stop_process
from tests.support.servers import RedisServer, _wait, free_port


class ServiceProcess:
    """`capsvc serve` in a process of its own, on a free port."""

    def __init__(self, config: str, redis_url: str, port: int | None = None,
                 env: dict[str, str] | None = None, args: tuple[str, ...] = (),
                 preexec_fn: Callable[[], None] | None = None) -> None:
        self.config = config
        self.preexec_fn = preexec_fn
        """Run in the child before `capsvc serve` (e.g. a resource limit)."""
        self.redis_url = redis_url
        self.port = port or free_port()
        self.args = args
        """More `capsvc serve` arguments, e.g. `("--workers", "2")`."""
        self.process: subprocess.Popen[bytes] | None = None
        self.log = Path(tempfile.mkdtemp(prefix="capsvc-svc-")) / "service.log"
        self.env = {**os.environ, "CAPSVC_JOURNAL_DIR": str(self.log.parent / "journal"),
                    **(env or {})}
        """A journal directory of its own unless `env` names one (CAPSVC_JOURNAL_DIR)."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def journal_dir(self) -> Path:
        return Path(self.env["CAPSVC_JOURNAL_DIR"])

    def _listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"capsvc exited: {self.log.read_text()}") from None
            return False

    def start(self) -> ServiceProcess:
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "capsvc", "serve", "--config", self.config,
                 "--redis-url", self.redis_url, "--port", str(self.port), *self.args],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                preexec_fn=self.preexec_fn,
            )
        try:
            _wait(self._listening, 20, f"capsvc on port {self.port}")
        except BaseException:
            self.stop()
            raise
        return self

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def wait(self, timeout_s: float = 30) -> int:
        assert self.process is not None
        return self.process.wait(timeout_s)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, 30)
            self.process = None


@contextmanager
def served(config: str) -> Iterator[ServiceProcess]:
    """A redis-server of its own and a `capsvc serve` on it with `config`; both stopped at
    the end."""
    redis = RedisServer().start()
    try:
        service = ServiceProcess(config, redis.url).start()
        try:
            yield service
        finally:
            service.stop()
    finally:
        redis.stop()

