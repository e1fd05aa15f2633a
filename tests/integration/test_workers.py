"""`capsvc serve --workers 2`: one port, one metrics view, one drain."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from capsvc.ops.workers import Restarts, listen, supervise
from tests.conftest import CONFIG, TEN, Client, ticket
from tests.support.servers import RedisCluster, RedisServer, free_port


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name}


@pytest.fixture
def workers(redis_backend: RedisServer | RedisCluster, redis_db: redis.Redis,
            tmp_path: Path) -> Iterator[
        tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    with (tmp_path / "workers.log").open("wb") as log:
        # A journal directory of its own: not var/journal of the clone, where every run
        # would add decisions for the next one's service to restore before it sells.
        proc = subprocess.Popen([sys.executable, "-m", "capsvc", "serve", "--workers", "2",
                                 "--config", str(CONFIG), "--redis-url", redis_backend.url,
                                 "--port", str(port)], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT,
                                env={**os.environ,
                                     "CAPSVC_JOURNAL_DIR": str(tmp_path / "journal")})
    yield proc, f"http://127.0.0.1:{port}"
    if proc.poll() is None:
        proc.kill()
        proc.wait()


async def sell_through_both(client: Client) -> int:
    """Sales on new connections until both workers have answered some: how many (the
    workers take connections in turn)."""
    served_by: set[str] = set()
    sold = 0
    while len(served_by) < 2 and sold < 400:
        replies = await asyncio.gather(*[
            client.sell(ticket([{"numbers": TEN[:4], "stake": 100}])) for _ in range(20)])
        assert {r.status for r in replies} == {200}
        sold += len(replies)
        # generated request ids start with the worker's pid
        served_by |= {r.headers["X-Request-ID"].split("-")[0] for r in replies}
    assert len(served_by) == 2
    return sold


async def wait_ready(session: aiohttp.ClientSession, url: str, log: Path | None = None,
                     timeout_s: float = 20) -> None:
    """Until two different workers have answered /readyz (generated request ids start
    with the worker's pid); else fail with the end of the service's `log`. A connection
    the listening socket took before a worker was up to read it may wait: each probe gives
    up after 2 s and the next one is made (a loaded run saw one wait out the session's 10 s)."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with session.get(url + "/readyz",
                                   timeout=aiohttp.ClientTimeout(total=2)) as resp:
                if resp.status == 200:
                    seen.add(resp.headers["X-Request-ID"].split("-")[0])
        except (aiohttp.ClientError, TimeoutError):
            pass
        if len(seen) == 2:
            return
        await asyncio.sleep(0.05)
    output = "" if log is None else (await asyncio.to_thread(log.read_text))[-3000:]
    raise AssertionError(f"workers not ready ({seen}): {output}")


async def test_two_workers_one_view_one_drain(
        workers: tuple[subprocess.Popen[bytes], str]) -> None:
    """Sales spread over two workers add up in /metrics whichever worker answers; SIGTERM
    drains both and the supervisor exits 0."""
    proc, url = workers
    connector = aiohttp.TCPConnector(force_close=True)  # new connections: both workers
    async with aiohttp.ClientSession(connector=connector) as session:
        await wait_ready(session, url)
        client = Client(session, url)
        sold = await sell_through_both(client)
        await asyncio.sleep(1.5)  # each worker applies its tallies once a second
        for _ in range(6):
            text = (await client.get("/metrics", token=None)).raw.decode()
            tickets = samples(text, "capsvc_tickets_total")
            assert tickets[(("game", "fdj-keno"), ("status", "accepted"))] == sold
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 30) == 0


async def test_an_idle_pair_of_workers_reports_no_request_in_flight(
        workers: tuple[subprocess.Popen[bytes], str]) -> None:
    """In-flight requests are each worker's own, summed over the live ones (scrapes not
    counted): idle, the view says 0, whichever worker answers."""
    _, url = workers
    connector = aiohttp.TCPConnector(force_close=True)  # new connections: both workers
    async with aiohttp.ClientSession(connector=connector) as session:
        await wait_ready(session, url)
        await asyncio.sleep(1.5)  # every worker publishes its count once a second
        for _ in range(4):
            async with session.get(url + "/metrics") as resp:
                text = await resp.text()
            assert sum(samples(text, "capsvc_http_requests_in_flight").values()) == 0


def run_capsvc(*args: str, cwd: Path | None = None, log: Path | None = None,
               safe_path: bool = False) -> subprocess.Popen[bytes]:
    """`capsvc serve ARGS` in the background, its output in `log`."""
    python = [sys.executable, "-P"] if safe_path else [sys.executable]
    journal = tempfile.mkdtemp(prefix="capsvc-workers-journal-")  # see `workers`
    with (log or Path(os.devnull)).open("wb") as out:
        return subprocess.Popen([*python, "-m", "capsvc", "serve", *args], cwd=cwd,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "CAPSVC_JOURNAL_DIR": journal})


async def test_workers_start_whatever_the_current_directory_holds(
        redis_server: RedisServer, standalone_db: redis.Redis, tmp_path: Path) -> None:
    """A `capsvc/` folder in the current directory that is not the package (the clone's
    parent directory, say) does not replace the package in the workers."""
    bogus = tmp_path / "capsvc"
    bogus.mkdir()
    (bogus / "__init__.py").write_text("raise ImportError('not the capsvc package')\n")
    port = free_port()
    # The supervisor itself is started with -P, as the `capsvc` console script would be.
    proc = run_capsvc("--workers", "2", "--config", str(CONFIG), "--redis-url",
                      redis_server.url, "--port", str(port), cwd=tmp_path, safe_path=True)
    try:
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True)) as session:
            await wait_ready(session, f"http://127.0.0.1:{port}")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("holder", ["reuseport", "plain"])
def test_a_port_in_use_is_one_line_and_a_failure(
        redis_server: RedisServer, workers: str, holder: str) -> None:
    """Whatever listens on the port (even a socket that would share it with SO_REUSEPORT),
    `capsvc serve` says so in one line and exits non-zero, never sharing the port."""
    with socket.socket() as stranger:
        if holder == "reuseport":
            stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        stranger.bind(("127.0.0.1", 0))
        stranger.listen()
        port = stranger.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "capsvc", "serve", "--workers", workers, "--config",
             str(CONFIG), "--redis-url", redis_server.url, "--port", str(port)],
            capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert done.returncode == 1
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert f"port {port}" in lines[0]
    assert "already in use" in lines[0]
    assert "--port" in lines[0]


async def test_a_second_capsvc_on_the_same_port_is_refused(
        workers: tuple[subprocess.Popen[bytes], str], redis_server: RedisServer) -> None:
    """Two instances never split the traffic of one port (and so never split a cap)."""
    proc, url = workers
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        await wait_ready(s, url)
    port = url.rsplit(":", 1)[1]
    for n in ("1", "2"):
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "capsvc", "serve", "--workers", n,
                             "--config", str(CONFIG), "--port", port],
            capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        assert done.returncode == 1
        assert "already in use" in done.stderr
    assert proc.poll() is None


def test_the_supervisor_gives_up_on_a_worker_that_keeps_dying_at_start(
        tmp_path: Path) -> None:
    """Restarts of a worker that dies young come after a doubling delay; after
    `give_up_after` of them in a row the supervisor exits 1 (no endless crash loop)."""
    starts = tmp_path / "starts"
    command = [sys.executable, "-c",
               f"import time; open({str(starts)!r}, 'a').write(f'{{time.monotonic()}}\\n');"
               " raise SystemExit(3)"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        rc = supervise(command, 1, sock, Restarts(first_delay_s=0.1, give_up_after=4))
    assert rc == 1
    times = [float(t) for t in starts.read_text().split()]
    assert len(times) == 4  # the first start and three restarts
    gaps = [b - a for a, b in itertools.pairwise(times)]
    for gap, delay in zip(gaps, (0.1, 0.2, 0.4), strict=True):
        assert gap >= delay  # never sooner than the backoff


def test_a_worker_that_dies_after_a_good_run_is_restarted_at_once(tmp_path: Path) -> None:
    """Only deaths at start (before a worker says it listens) count toward giving up: a
    worker that started and died is restarted without delay, however many times."""
    starts = tmp_path / "starts"
    command = [sys.executable, "-c",
               "from capsvc.ops.workers import announce_started; import time;"
               f" open({str(starts)!r}, 'a').write('x\\n'); announce_started(); time.sleep(0.3)"]
    wanted = 2 * (2 + 2)  # each worker started more times than give_up_after allows
    done = threading.Event()

    def stop_once_started_enough() -> None:
        """SIGTERM to the supervisor once the workers have started `wanted` times (however
        long that takes on this machine), or after a minute whatever they did."""
        deadline = time.monotonic() + 60
        while not done.is_set() and time.monotonic() < deadline:
            if starts.exists() and len(starts.read_text().split()) >= wanted:
                break
            time.sleep(0.02)
        if not done.is_set():
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_once_started_enough, daemon=True).start()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        rc = supervise(command, 2, sock, Restarts(give_up_after=2))
    done.set()
    assert rc == 0  # not given up: deaths after a start do not count
    assert len(starts.read_text().split()) >= wanted


async def test_serve_exits_non_zero_when_restarted_workers_cannot_start(
        redis_server: RedisServer, standalone_db: redis.Redis, tmp_path: Path) -> None:
    """The configuration file disappears under a running service and a worker crashes:
    its replacements cannot start; the supervisor retries with backoff, then stops the
    other worker and exits 1, so systemd or Kubernetes sees a failed service."""
    config = tmp_path / "capsvc.toml"
    config.write_text(CONFIG.read_text())
    port = free_port()
    log = tmp_path / "serve.log"
    proc = run_capsvc("--workers", "2", "--config", str(config), "--redis-url",
                      redis_server.url, "--port", str(port), log=log)
    try:
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True)) as session:
            await wait_ready(session, f"http://127.0.0.1:{port}")
            async with session.get(f"http://127.0.0.1:{port}/readyz") as resp:
                worker = int(resp.headers["X-Request-ID"].split("-")[0], 16)  # its pid
        config.unlink()
        os.kill(worker, signal.SIGKILL)
        assert await asyncio.to_thread(proc.wait, 60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert text.count("worker exited: restarting it") == 5  # the crash, then 4 at start
    assert "a worker keeps dying at start: giving up" in text


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_workers_do_not_outlive_a_killed_supervisor(
        workers: tuple[subprocess.Popen[bytes], str]) -> None:
    """SIGKILL of the supervisor: its workers drain and exit by themselves, and the port
    is free again (no orphan keeps serving it)."""
    proc, url = workers
    pids: set[int] = set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        await wait_ready(s, url)
        while len(pids) < 2:
            async with s.get(url + "/readyz") as resp:
                pids.add(int(resp.headers["X-Request-ID"].split("-")[0], 16))
    proc.kill()
    proc.wait()
    for _ in range(200):
        if not any(_alive(pid) for pid in pids):
            break
        await asyncio.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)
    port = int(url.rsplit(":", 1)[1])
    listen("127.0.0.1", port).close()  # nobody listens there any more


def _children(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return {int(p) for p in path.read_text().split()} if path.exists() else set()


async def test_a_sigterm_while_a_worker_is_being_replaced_stops_everything(
        workers: tuple[subprocess.Popen[bytes], str]) -> None:
    """SIGTERM that lands while the supervisor starts a replacement worker still stops
    every worker, the new one included, and the supervisor exits."""
    proc, url = workers
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        await wait_ready(s, url)
    first = _children(proc.pid)
    os.kill(next(iter(first)), signal.SIGKILL)
    for _ in range(2000):  # as soon as the replacement exists
        if _children(proc.pid) - first:
            break
        await asyncio.sleep(0.001)
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 30) in (0, 1)
    assert not any(_alive(pid) for pid in _children(proc.pid) | first)


async def test_a_drained_worker_leaves_its_last_decisions_in_the_counters(
        workers: tuple[subprocess.Popen[bytes], str]) -> None:
    """Decisions tallied in the second before a worker drains are in the counters after it
    is gone (its replacement serves the view)."""
    proc, url = workers
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        await wait_ready(s, url)
        client = Client(s, url)
        replies = await asyncio.gather(*[
            client.sell(ticket([{"numbers": TEN[:4], "stake": 100}])) for _ in range(30)])
        assert {r.status for r in replies} == {200}
        for pid in _children(proc.pid):  # at once: well within the one-second flush
            os.kill(pid, signal.SIGTERM)
        await wait_ready(s, url)
        text = (await client.get("/metrics", token=None)).raw.decode()
    tickets = samples(text, "capsvc_tickets_total")
    assert tickets[(("game", "fdj-keno"), ("status", "accepted"))] == 30


@pytest.mark.parametrize("args", [["--port", "70000"], ["--port", "-1"],
                                  ["--port", "99999999999999999999"], ["--workers", "0"],
                                  ["--host", ".."], ["--redis-url", "redis://h:notaport"]])
def test_bad_command_line_values_are_one_line(args: list[str]) -> None:
    """No value of --port, --workers, --host or --redis-url gives a traceback or a port
    other than the one asked."""
    done = subprocess.run([sys.executable, "-m", "capsvc", "serve", "--config", str(CONFIG),
                           "--port", "0", *args], capture_output=True, text=True, timeout=30,
                          stdin=subprocess.DEVNULL)
    assert done.returncode in (1, 2)
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(("capsvc", "usage", "capsvc serve"))


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_stop_during_the_start_drains_what_was_accepted(
        redis_server: RedisServer, standalone_db: redis.Redis, workers: str) -> None:
    """SIGTERM as soon as the port accepts (before any handler of the server is in place):
    the request already sent is answered and the exit status is 0 (a worker starts with
    the stop signals blocked until it can remember them)."""
    port = free_port()
    proc = run_capsvc("--workers", workers, "--config", str(CONFIG), "--redis-url",
                      redis_server.url, "--port", str(port))
    try:
        for _ in range(1000):
            try:
                conn = socket.create_connection(("127.0.0.1", port), timeout=0.05)
                break
            except OSError:
                time.sleep(0.01)
        else:
            raise AssertionError("the port never accepted")
        with conn:
            conn.settimeout(30)
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            proc.send_signal(signal.SIGTERM)
            answer = b""
            while chunk := conn.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_workers_are_not_given_the_redis_password_on_their_command_line(
        tmp_path: Path) -> None:
    """With --workers N the Redis URL, password included, reaches the workers in their
    environment, never in their command line (readable by any local user through ps)."""
    server = RedisServer().start()
    server.client().config_set("requirepass", "s3cr3t-pw")
    port = free_port()
    proc = run_capsvc("--workers", "2", "--config", str(CONFIG), "--redis-url",
                      f"redis://:s3cr3t-pw@127.0.0.1:{server.port}/0", "--port", str(port),
                      log=tmp_path / "log")
    try:
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            await wait_ready(s, url, tmp_path / "log")
            reply = await Client(s, url).sell(ticket())
            assert reply.status == 200, reply.body  # the workers did authenticate
        children = _children(proc.pid)
        assert len(children) == 2
        for pid in children:
            line = await asyncio.to_thread(Path(f"/proc/{pid}/cmdline").read_bytes)
            assert b"s3cr3t-pw" not in line
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 30)
        server.stop()
