"""The service as a process: SIGTERM drain, and the command line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest
import redis

from tests.conftest import CONFIG, TEN, Client, ticket
from tests.support.servers import RedisServer, free_port
from tests.support.service import ServiceProcess


def config_with(redis_timeout: str, **server: str) -> str:
    """The test configuration with [server] settings replaced and a Redis timeout."""
    text = CONFIG.read_text()
    lines = "".join(f'{k} = "{v}"\n' for k, v in server.items())
    text = text.replace('[server]\nrequest_timeout = "2s"\ndrain_delay = "300ms"\n',
                        f'[server]\n{lines}\n[redis]\ntimeout = "{redis_timeout}"\n')
    path = Path(tempfile.mkdtemp()) / "capsvc.toml"
    path.write_text(text)
    return str(path)


async def test_sigterm_turns_unready_and_drains(redis_server: RedisServer,
                                                standalone_db: redis.Redis) -> None:
    """On SIGTERM /readyz is 503 at once, the request in flight completes, the process
    exits 0."""
    cfg = config_with("3s", request_timeout="5s", drain_delay="1s")
    svc = ServiceProcess(cfg, redis_server.url, env={"CAPSVC_REDIS_URL": ""}).start()
    try:
        async with aiohttp.ClientSession() as session:
            client = Client(session, svc.base_url)
            assert (await client.get("/readyz", token=None)).status == 200
            body = ticket([{"numbers": TEN, "stake": 500}])
            redis_server.client().execute_command("CLIENT", "PAUSE", 800, "ALL")
            sale = asyncio.create_task(client.sell(body))
            await asyncio.sleep(0.3)
            svc.terminate()
            await asyncio.sleep(0.2)
            ready = await client.get("/readyz", token=None)
            assert ready.status == 503
            assert ready.body["checks"]["draining"] is True
            done = await sale
            assert done.status == 200
            assert done.body["status"] == "accepted"
        assert await asyncio.to_thread(svc.wait, 15) == 0
    finally:
        svc.stop()


def run_cli(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "capsvc", *args], capture_output=True,
                          text=True, timeout=60, cwd=cwd)


def test_check_config_lists_the_games() -> None:
    """check-config accepts the shipped configuration and names its games."""
    result = run_cli("check-config", "--config", str(CONFIG))
    assert result.returncode == 0, result.stderr
    assert "game fdj-keno (fdj-keno-2008)" in result.stdout
    assert "game lnm-keno (lnm-keno)" in result.stdout


def test_check_config_explains_every_error(tmp_path: Path) -> None:
    """Every problem of a bad file is reported with where it is."""
    bad = tmp_path / "bad.toml"
    bad.write_text("""
[[games]]
id = "fdj-keno"
preset = "fdj-keno-2008"
stakes = [100, "two"]
cancel = "sometimes"
time_zone = "Mars/Olympus"

[[games]]
id = "x"
preset = "bingo"

[[channels]]
id = "fr"
token = "secret"
token_sha256 = "abc"
games = ["loto"]
scopes = ["sell", "fly"]
""")
    result = run_cli("check-config", "--config", str(bad))
    assert result.returncode == 2
    for expected in ("games[0].stakes[1]", "games[0].cancel", "games[0].time_zone",
                     "games[1].preset", "channels[0].token:", "channels[0].token_sha256",
                     "channels[0].games[0]", "channels[0].scopes[1]"):
        assert expected in result.stderr, expected
    assert "secret" not in result.stderr


def test_serve_refuses_a_misspelt_key_before_starting_anything(tmp_path: Path) -> None:
    """`[redis] urll = …` (a typo) is an error for `serve` as for `check-config`: the
    service does not quietly start on an embedded store under ./var instead."""
    config = tmp_path / "capsvc.toml"
    config.write_text(CONFIG.read_text().replace("[janitor]\n", '[janitor]\nintervall = "1s"\n')
                      + '\n[redis]\nurll = "redis://10.0.0.1:6379/0"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPSVC_")}
    for command in (["serve", "--config", str(config), "--port", str(free_port())],
                    ["check-config", "--config", str(config)]):
        result = subprocess.run([sys.executable, "-m", "capsvc", *command], cwd=tmp_path,
                                env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, command
        assert "redis.urll: unknown field (did you mean 'url'?)" in result.stderr
        assert "janitor.intervall: unknown field (did you mean 'interval'?)" in result.stderr
    assert not (tmp_path / "var").exists()


def test_serve_with_embedded_redis(tmp_path: Path) -> None:
    """`capsvc serve` with no Redis configured runs on an embedded, persistent server."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPSVC_")}
    proc = subprocess.Popen([sys.executable, "-m", "capsvc", "serve", "--port", str(port)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        async def exercise() -> tuple[int, int]:
            async with aiohttp.ClientSession() as session:
                client = Client(session, f"http://127.0.0.1:{port}")
                for _ in range(100):
                    try:
                        if (await client.get("/readyz", token=None)).status == 200:
                            break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.1)
                sold = await client.sell(ticket(), token="local-fr-retail")
                return sold.status, (await client.get("/readyz", token=None)).status
        assert asyncio.run(exercise()) == (200, 200)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0
    assert (tmp_path / "var" / "redis" / "appendonlydir").is_dir()
    assert not (tmp_path / "var" / "redis" / "redis.sock").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_sent_to_the_process_group_stops_serve_and_its_embedded_redis(
        tmp_path: Path, sig: signal.Signals) -> None:
    """Ctrl-C in a terminal (SIGINT to the foreground process group), or SIGTERM to the
    group (`timeout`, some supervisors): the service drains with its embedded Redis still
    serving, then stops it and exits 0. Nothing happens during the drain: the Redis is
    not taken for dead and started again, and no "new" Redis is restored into."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPSVC_")}
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        # A process group of its own, as a shell gives a command it runs.
        proc = subprocess.Popen([sys.executable, "-m", "capsvc", "serve", "--port", str(port)],
                                cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        async def sell() -> int:
            async with aiohttp.ClientSession() as session:
                client = Client(session, f"http://127.0.0.1:{port}")
                for _ in range(300):
                    try:
                        if (await client.get("/readyz", token=None)).status == 200:
                            break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.1)
                return (await client.sell(ticket(), token="local-fr-retail")).status
        assert asyncio.run(sell()) == 200, log.read_text()
        os.killpg(proc.pid, sig)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    messages = [str(line["message"]) for line in said]
    assert [line for line in said if line["level"] == "error"] == []
    assert messages.count("embedded redis started") == 1
    assert messages[messages.index("draining"):] == ["draining", "stopped"]
    assert not (tmp_path / "var" / "redis" / "redis.sock").exists()  # Redis stopped cleanly


def test_an_embedded_redis_does_not_outlive_a_killed_serve(tmp_path: Path) -> None:
    """Its own process group keeps the embedded Redis out of a signal to capsvc's group;
    a capsvc killed by SIGKILL, which cannot stop it, leaves none running (Linux: the
    server gets SIGTERM when its parent dies)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("a parent's death signal is a Linux call")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPSVC_")}
    proc = subprocess.Popen([sys.executable, "-m", "capsvc", "serve", "--port", str(port)],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)
    sock = tmp_path / "var" / "redis" / "redis.sock"
    server_pid = None
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert proc.poll() is None
            assert time.monotonic() < deadline
            time.sleep(0.1)
        embedded = redis.Redis(unix_socket_path=str(sock), socket_timeout=5)
        server_pid = int(embedded.info("server")["process_id"])
        embedded.close()
        assert os.getpgid(server_pid) != os.getpgid(proc.pid)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 60
        while sock.exists():  # removed by the server as it exits
            assert time.monotonic() < deadline, "the embedded Redis outlived its capsvc"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if server_pid is not None and sock.exists():
            os.kill(server_pid, signal.SIGKILL)  # what the test found left behind
