"""What on-call reads: every log line names its process (and worker), a Redis that cannot
be reached is named by its address, and an embedded Redis that dies is started again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis

from tests.support.servers import RedisServer, free_port
from tests.support.service import ServiceProcess

CONFIG = str(Path(__file__).resolve().parents[1] / "capsvc-test.toml")


def lines(log: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.read_text().splitlines()
            if line.startswith("{")]


def test_every_line_names_its_process_and_its_worker(redis_server: RedisServer) -> None:
    """Two workers: each line carries the pid of the process that wrote it; a worker's
    lines its index too (0 and 1), so that two `capsvc listening` lines can be told apart."""
    service = ServiceProcess(CONFIG, redis_server.url, args=("--workers", "2")).start()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            listening = [line for line in lines(service.log)
                         if "listening" in str(line["message"])]
            if len(listening) >= 2:
                break
            time.sleep(0.1)
        assert {line.get("worker") for line in listening} == {0, 1}
        assert len({line["pid"] for line in listening}) == 2
        assert all(isinstance(line.get("pid"), int) for line in lines(service.log))
    finally:
        service.stop()


def test_a_redis_that_cannot_be_reached_is_named_by_its_address() -> None:
    port = free_port()  # nothing listens there
    service = ServiceProcess(CONFIG, f"redis://127.0.0.1:{port}/0")
    service.start()
    try:
        deadline = time.monotonic() + 20
        said: list[str] = []
        while time.monotonic() < deadline and not said:
            said = [str(line["message"]) for line in lines(service.log)
                    if "cannot connect" in str(line["message"])]
            time.sleep(0.1)
        assert said, service.log.read_text()
        assert f"cannot connect to redis at 127.0.0.1:{port}" in said[0]
    finally:
        service.stop()


@pytest.mark.slow
def test_an_embedded_redis_that_dies_is_started_again(tmp_path: Path) -> None:
    """No Redis configured: the embedded one, killed, is started again from its own
    directory; the service becomes ready again and still holds what it sold."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "CAPSVC_REDIS_URL"}
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "capsvc", "serve", "--config", CONFIG,
                             "--port", str(port)], cwd=tmp_path, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            with urllib.request.urlopen(base + "/readyz", timeout=1) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def wait_ready() -> None:
        deadline = time.monotonic() + 30
        while not ready():
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)

    try:
        wait_ready()
        embedded = redis.Redis(unix_socket_path=str(tmp_path / "var" / "redis" / "redis.sock"))
        os.kill(int(embedded.info("server")["process_id"]), signal.SIGKILL)
        embedded.close()
        time.sleep(1.5)
        wait_ready()
        said = [str(line["message"]) for line in lines(tmp_path / "serve.log")]
        assert "embedded redis exited: starting it again" in said
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
