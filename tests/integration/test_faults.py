"""tests.support.faults.FaultProxy over a real redis-server: traffic passes unchanged,
replies stay matched to their commands, and each fault does what it says, checked on Redis
itself."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.conftest import CONFIG, TOKENS, ticket
from tests.support.faults import FaultProxy, command
from tests.support.servers import RedisServer
from tests.support.service import ServiceProcess


@pytest.fixture
def proxy(redis_server: RedisServer, standalone_db: redis.Redis) -> Iterator[FaultProxy]:
    """A proxy to the session's Redis, emptied."""
    with FaultProxy("127.0.0.1", redis_server.port) as p:
        yield p


def through(proxy: FaultProxy, **kw: Any) -> redis.Redis:
    """A redis-py client of the proxy that does not retry (a retry would hide the fault)."""
    return redis.Redis.from_url(proxy.url, retry=Retry(NoBackoff(), 0), **kw)


def raw(proxy: FaultProxy) -> socket.socket:
    """A bare RESP2 connection to the proxy, for byte-exact pipelines."""
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def resp(*commands: tuple[str, ...]) -> bytes:
    out = b""
    for cmd in commands:
        out += f"*{len(cmd)}\r\n".encode()
        for arg in cmd:
            out += f"${len(arg.encode())}\r\n{arg}\r\n".encode()
    return out


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_plain_commands_pass_through(proxy: FaultProxy) -> None:
    """Strings, counters, lists, hashes, nulls and error replies come back as from Redis."""
    r = through(proxy)
    assert r.set("k", "v") is True
    assert r.get("k") == b"v"
    assert r.get("missing") is None
    assert r.incrby("n", 5) == 5
    assert r.rpush("l", "a", "b", "c") == 3
    assert r.lrange("l", 0, -1) == [b"a", b"b", b"c"]
    assert r.hset("h", mapping={"f": "1", "g": "2"}) == 2
    assert r.hgetall("h") == {b"f": b"1", b"g": b"2"}
    with pytest.raises(redis.ResponseError):
        r.incr("k")
    assert r.ping() is True


def test_pipelined_replies_stay_matched(proxy: FaultProxy, standalone_db: redis.Redis) -> None:
    """A 600-command pipeline with values large enough to span many reads, nulls and errors,
    and a delayed reply in its middle, gets every reply in its place."""
    r = through(proxy)
    pipe = r.pipeline(transaction=False)
    expected: list[Any] = []
    for i in range(200):
        value = "x" * (i * 1000)
        pipe.set(f"k{i}", value)
        pipe.get(f"k{i}" if i % 10 else f"absent{i}")
        pipe.strlen(f"k{i}")
        expected += [True, value.encode() if i % 10 else None, len(value)]
    pipe.incr("k150")  # an error reply: not an integer
    rule = proxy.delay_reply(command("GET", "k77"), 0.2)
    *replies, error = pipe.execute(raise_on_error=False)
    assert replies == expected
    assert isinstance(error, redis.ResponseError)
    assert rule.hits == 1
    assert standalone_db.strlen("k199") == 199_000


def test_a_command_split_across_writes_is_recognised(
        proxy: FaultProxy, standalone_db: redis.Redis) -> None:
    """A command sent a few bytes at a time is still parsed, matched and forwarded whole."""
    rule = proxy.drop_reply(command("SET", "split"))
    data = resp(("SET", "split", "value"))
    with raw(proxy) as sock:
        for i in range(0, len(data), 3):
            sock.sendall(data[i:i + 3])
            time.sleep(0.005)
        assert read_until_closed(sock) == b""
    assert rule.fired.is_set()
    assert standalone_db.get("split") == b"value"


def test_drop_reply_delivers_the_replies_before_it(
        proxy: FaultProxy, standalone_db: redis.Redis) -> None:
    """In one pipelined write, the replies before the dropped one arrive, none after it, and
    Redis ran every command."""
    proxy.drop_reply(command("GET", "x"))
    with raw(proxy) as sock:
        sock.sendall(resp(*[("INCR", "c")] * 3, ("GET", "x"), *[("INCR", "c")] * 2))
        assert read_until_closed(sock) == b":1\r\n:2\r\n:3\r\n"
    eventually(lambda: standalone_db.get("c") == b"5")


def test_delay_reply_times_out_the_client_after_redis_ran_it(
        proxy: FaultProxy, standalone_db: redis.Redis) -> None:
    """A reply delayed past the client's timeout: the client times out, the write is in
    Redis (outcome unknown to the client)."""
    rule = proxy.delay_reply(command("SET", "slow"), 600)
    r = through(proxy, socket_timeout=0.3)
    started = time.monotonic()
    with pytest.raises(redis.TimeoutError):
        r.set("slow", "written")
    assert time.monotonic() - started < 60  # the client's timeout, not the delay's end
    assert rule.fired.is_set()
    assert standalone_db.get("slow") == b"written"


def test_drop_reply_loses_the_reply_but_the_command_ran(
        proxy: FaultProxy, standalone_db: redis.Redis) -> None:
    """The client loses its connection without a reply; Redis counted the increment once;
    the rule is spent, so the next call goes through."""
    rule = proxy.drop_reply(command("INCRBY", "n"))
    r = through(proxy)
    with pytest.raises(redis.ConnectionError):
        r.incrby("n", 1)
    assert rule.hits == 1
    assert standalone_db.get("n") == b"1"
    assert r.incrby("n", 1) == 2


def test_count_and_remove(proxy: FaultProxy, standalone_db: redis.Redis) -> None:
    """A rule applies to its next `count` matches only; a removed rule to none."""
    twice = proxy.drop_request(command("INCRBY", "n"), count=2)
    r = through(proxy)
    for _ in range(2):
        with pytest.raises(redis.ConnectionError):
            r.incrby("n", 1)
    assert r.incrby("n", 1) == 1
    assert twice.hits == 2
    removed = proxy.drop_request(command("INCRBY", "n"))
    proxy.remove(removed)
    assert r.incrby("n", 1) == 2
    assert removed.hits == 0
    assert standalone_db.get("n") == b"2"


def test_drop_request_never_reaches_redis(
        proxy: FaultProxy, standalone_db: redis.Redis) -> None:
    """The dropped command and what follows it in the write do not run; what precedes it
    does; the client's connection is closed."""
    rule = proxy.drop_request(command("SET", "k"))
    with raw(proxy) as sock:
        sock.sendall(resp(("INCR", "before"), ("SET", "k", "v"), ("INCR", "after")))
        assert read_until_closed(sock) in (b"", b":1\r\n")
    assert rule.fired.is_set()
    eventually(lambda: standalone_db.get("before") == b"1")
    assert standalone_db.exists("k", "after") == 0
    r = through(proxy)
    assert r.ping() is True
    proxy.drop_request(command("SET", "k2"))
    with pytest.raises(redis.ConnectionError):
        r.set("k2", "v")
    assert standalone_db.exists("k2") == 0


def test_hold_request_lets_another_client_act_first(
        proxy: FaultProxy, standalone_db: redis.Redis) -> None:
    """A held write waits for the event while a second client's write to the same key runs;
    once released it runs last."""
    release = threading.Event()
    rule = proxy.hold_request(command("SET", "k", "first"), release)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(through(proxy).set, "k", "first")
        assert rule.fired.wait(5)
        assert through(proxy).set("k", "second") is True
        assert standalone_db.get("k") == b"second"
        assert not held.done()
        release.set()
        assert held.result(5) is True
    assert standalone_db.get("k") == b"first"
    sets = [cmd for cmd in proxy.commands if cmd[0] == b"SET"]
    assert sets == [[b"SET", b"k", b"second"], [b"SET", b"k", b"first"]]


def test_the_log_and_wait_for(redis_server: RedisServer, standalone_db: redis.Redis) -> None:
    """wait_for returns once the command has gone to Redis, or raises TimeoutError; the log
    keeps the latest `log_size` commands."""
    with FaultProxy("127.0.0.1", redis_server.port, log_size=3) as proxy:
        r = through(proxy)
        timer = threading.Timer(0.2, r.set, ("marker", "1"))
        timer.start()
        assert proxy.wait_for(command("SET", "marker")) == [b"SET", b"marker", b"1"]
        timer.join()
        with pytest.raises(TimeoutError):
            proxy.wait_for(command("SET", "never"), timeout=0.2)
        for i in range(5):
            r.incr(f"c{i}")
        assert proxy.commands == [[b"INCRBY", f"c{i}".encode(), b"1"] for i in (2, 3, 4)]


def test_pause_stops_traffic_until_resume(proxy: FaultProxy) -> None:
    """While paused, a call waits; after resume it completes."""
    r = through(proxy)
    assert r.ping() is True
    proxy.pause()
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(r.set, "k", "v")
        time.sleep(0.3)
        assert not call.done()
        proxy.resume()
        assert call.result(5) is True


def test_cut_closes_every_client_connection(proxy: FaultProxy) -> None:
    """After cut(), every client connection reads end of stream; new ones still work."""
    socks = [raw(proxy) for _ in range(3)]
    for sock in socks:
        sock.sendall(resp(("PING",)))
        assert sock.recv(100) == b"+PONG\r\n"
    proxy.cut()
    for sock in socks:
        assert read_until_closed(sock) == b""
        sock.close()
    assert through(proxy).ping() is True


def test_stop_is_clean_with_faults_in_flight(redis_server: RedisServer) -> None:
    """stop() returns promptly with a held request and a delayed reply in flight, leaves no
    thread behind and frees the port."""
    before = set(threading.enumerate())
    proxy = FaultProxy("127.0.0.1", redis_server.port).start()
    proxy.hold_request(command("GET", "held"), threading.Event())
    proxy.delay_reply(command("GET", "slow"), 3600)
    held, slow = raw(proxy), raw(proxy)
    held.sendall(resp(("GET", "held")))
    slow.sendall(resp(("GET", "slow")))
    proxy.wait_for(command("GET", "slow"))
    started = time.monotonic()
    proxy.stop()
    assert time.monotonic() - started < 60  # not the delay's end, an hour away
    assert read_until_closed(held) == b""
    assert read_until_closed(slow) == b""
    held.close()
    slow.close()
    assert set(threading.enumerate()) <= before
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=1)


def test_a_service_process_talks_to_redis_through_the_proxy(proxy: FaultProxy) -> None:
    """`capsvc serve` pointed at proxy.url sells a ticket; its Lua calls pass the proxy."""
    service = ServiceProcess(str(CONFIG), proxy.url).start()
    try:
        request = urllib.request.Request(
            service.base_url + "/v1/tickets", data=json.dumps(ticket()).encode(),
            headers={"Authorization": f"Bearer {TOKENS['fr']}",
                     "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert reply.status == 200
            assert json.loads(reply.read())["status"] == "accepted"
    finally:
        service.stop()
    assert proxy.wait_for(lambda cmd: cmd[0].upper() == b"FCALL")
