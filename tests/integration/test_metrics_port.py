"""`[server] metrics_port` / `--metrics-port`: /metrics on a listener of its own, the view
of every worker, no longer on the API port; a metrics port already taken is one line and a
failure, like the API's."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis

from tests.conftest import CONFIG, Client
from tests.integration.test_workers import samples, sell_through_both, wait_ready
from tests.support.servers import RedisServer, free_port

Served = tuple[subprocess.Popen[bytes], str, str, Path]
"""The supervisor, the API's URL, the metrics listener's URL, the service's log."""


def serve(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    """`capsvc serve ARGS`, a journal directory of its own, its output in a log."""
    log = tmp_path / "capsvc.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "capsvc", "serve", *args],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "CAPSVC_JOURNAL_DIR": str(tmp_path / "journal")})
    return proc, log


def start(redis_url: str, tmp_path: Path, *args: str) -> Served:
    port, metrics_port = free_port(), free_port()
    proc, log = serve(tmp_path, "--config", str(CONFIG), "--redis-url", redis_url, "--port",
                      str(port), "--metrics-port", str(metrics_port), *args)
    return proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}", log


@pytest.fixture
def two_workers(redis_server: RedisServer, standalone_db: redis.Redis, tmp_path: Path
                ) -> Iterator[Served]:
    served = start(redis_server.url, tmp_path, "--workers", "2")
    yield served
    if served[0].poll() is None:
        served[0].kill()
        served[0].wait()


async def test_the_metrics_port_shows_every_worker_and_the_api_port_none(
        two_workers: Served) -> None:
    """Sales spread over two workers add up on the metrics port, whichever worker takes
    the scrape; the API port answers /metrics 404; the metrics port answers nothing but
    /metrics; SIGTERM stops it all, exit 0."""
    proc, url, metrics_url, log = two_workers
    connector = aiohttp.TCPConnector(force_close=True)  # new connections: both workers
    async with aiohttp.ClientSession(connector=connector) as session:
        await wait_ready(session, url, log)
        sold = await sell_through_both(Client(session, url))
        await asyncio.sleep(1.5)  # each worker applies its tallies once a second
        for _ in range(6):
            async with session.get(metrics_url + "/metrics") as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/plain")
                text = await resp.text()
            tickets = samples(text, "capsvc_tickets_total")
            assert tickets[(("game", "fdj-keno"), ("status", "accepted"))] == sold
            workers = {dict(labels)["worker"]
                       for labels in samples(text, "capsvc_process_resident_memory_bytes")}
            assert len(workers) == 2, workers
        for _ in range(4):
            async with session.get(url + "/metrics") as resp:
                assert resp.status == 404
                assert (await resp.json())["error"]["code"] == "not_found"
        async with session.get(metrics_url + "/v1/games") as resp:
            assert resp.status == 404
        async with session.post(metrics_url + "/metrics") as resp:
            assert (resp.status, resp.headers["Allow"]) == (405, "GET")
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 30) == 0


async def test_the_configuration_s_metrics_port(redis_server: RedisServer,
                                                standalone_db: redis.Redis,
                                                tmp_path: Path) -> None:
    """`[server] metrics_port` of the configuration, one process: /metrics there only."""
    metrics_port = free_port()
    config = tmp_path / "metrics.toml"
    config.write_text(f"[server]\nmetrics_port = {metrics_port}\n")
    port = free_port()
    proc, log = serve(tmp_path, "--config", str(CONFIG), "--config", str(config),
                      "--redis-url", redis_server.url, "--port", str(port))
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(200):
                try:
                    async with session.get(f"http://127.0.0.1:{port}/readyz") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(log.read_text()[-3000:])
            async with session.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp:
                assert resp.status == 200
                assert "capsvc_build_info" in await resp.text()
            async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                assert resp.status == 404
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_metrics_port_in_use_is_one_line_and_a_failure(redis_server: RedisServer,
                                                         workers: str) -> None:
    with socket.socket() as stranger:
        stranger.bind(("127.0.0.1", 0))
        stranger.listen()
        taken = stranger.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "capsvc", "serve", "--workers", workers, "--config",
             str(CONFIG), "--redis-url", redis_server.url, "--port", str(free_port()),
             "--metrics-port", str(taken)],
            capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert done.returncode == 1
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert f"port {taken}" in lines[0]
    assert "already in use" in lines[0]
    assert "--metrics-port" in lines[0]


def test_a_metrics_port_equal_to_the_api_port_is_a_configuration_error(
        tmp_path: Path) -> None:
    config = tmp_path / "same.toml"
    config.write_text("[server]\nport = 9100\nmetrics_port = 9100\n")
    done = subprocess.run(
        [sys.executable, "-m", "capsvc", "check-config", "--config", str(CONFIG), "--config",
         str(config)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert f"{config}: server.metrics_port: must differ from server.port (9100)" in done.stderr
    assert "Traceback" not in done.stderr
