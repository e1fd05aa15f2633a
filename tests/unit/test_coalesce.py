"""The coalescer: RESP encoding, one write per tick, replies in order, failures.

Runs against fakeredis's TCP server: fast, no redis-server needed.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import hiredis
import pytest
from fakeredis import TcpFakeServer
from redis.exceptions import ResponseError

from capsvc.domain.errors import Unavailable
from capsvc.redis.cluster import ClusterCoalescer, slot_of
from capsvc.redis.store import Store
from capsvc.redis.transport import FLUSH_EVERY, Coalescer, encode_command
from tests.support.servers import free_port


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    port = free_port()
    server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"redis://127.0.0.1:{port}/0"
    server.shutdown()


def test_encode_command() -> None:
    """str, bytes and int arguments are encoded as RESP bulk strings."""
    assert encode_command(("SET", b"k", 12)) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n12\r\n"
    assert encode_command(("GET", "é")) == b"*2\r\n$3\r\nGET\r\n$2\r\n\xc3\xa9\r\n"


async def test_one_tick_is_written_as_it_fills(fake_url: str) -> None:
    """50 commands submitted in one tick travel in batches of FLUSH_EVERY (written as they
    fill, so that Redis works while the loop goes on), the rest at the end of the tick;
    replies come back in order."""
    batches: list[int] = []
    c = Coalescer(fake_url, timeout_s=2, on_batch=lambda size, s: batches.append(size))
    await c.call("DEL", "k")
    batches.clear()
    futures = [c.submit("INCRBY", "k", 1) for _ in range(50)]
    assert [await f for f in futures] == list(range(1, 51))
    assert batches == [FLUSH_EVERY] * (50 // FLUSH_EVERY) + [50 % FLUSH_EVERY]
    await c.aclose()


async def test_error_reply_fails_only_its_command(fake_url: str) -> None:
    """An error reply fails its own future; the others of the batch get their replies."""
    c = Coalescer(fake_url, timeout_s=2)
    ok1 = c.submit("SET", "a", "x")
    bad = c.submit("INCR", "a")
    ok2 = c.submit("GET", "a")
    assert await ok1 == b"OK"
    with pytest.raises(ResponseError):
        await bad
    assert await ok2 == b"x"
    await c.aclose()


async def test_background_writes_are_delivered_on_close(fake_url: str) -> None:
    """send() needs no waiting; aclose() still delivers it."""
    c = Coalescer(fake_url, timeout_s=2)
    c.send("SET", "bg", "1")
    await c.aclose()
    reader = Coalescer(fake_url, timeout_s=2)
    assert await reader.call("GET", "bg") == b"1"
    await reader.aclose()


async def test_a_close_during_the_handshake_still_delivers_what_was_sent(
        fake_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The handshake's replies leave nothing in flight before the connection has sent the
    queue: a close waiting then must go on waiting for the queue, not disconnect."""
    handshake = Coalescer._handshake

    async def slow_to_resume(self: Coalescer) -> None:
        await handshake(self)
        await asyncio.sleep(0.05)  # the connection's task resumes after the close's

    monkeypatch.setattr(Coalescer, "_handshake", slow_to_resume)
    c = Coalescer(fake_url, timeout_s=2)
    c.send("SET", "during-handshake", "1")
    await c.aclose()
    monkeypatch.setattr(Coalescer, "_handshake", handshake)
    reader = Coalescer(fake_url, timeout_s=2)
    assert await reader.call("GET", "during-handshake") == b"1"
    await reader.aclose()


async def test_unreachable_redis_is_unavailable() -> None:
    """Nothing listening: every queued command fails with Unavailable, kind "connection"."""
    errors: list[str] = []
    c = Coalescer(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5, on_error=errors.append)
    futures = [c.submit("PING") for _ in range(3)]
    for f in futures:
        with pytest.raises(Unavailable):
            await f
    assert errors == ["connection"]


async def test_silent_redis_times_out() -> None:
    """A peer that accepts but never answers: the batch fails with Unavailable after the
    timeout, kind "timeout"."""
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    errors: list[str] = []
    c = Coalescer(f"redis://127.0.0.1:{port}/0", timeout_s=0.2, on_error=errors.append)
    with pytest.raises(Unavailable):
        await c.call("PING")
    assert errors == ["timeout"]
    server.close()


async def test_a_connect_timeout_after_its_handshake_s_deadline_is_one_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The handshake's command fails past its deadline, then the connect's own timeout
    fires before the handshake resumes (both timers due in one turn of a busy loop): one
    failure reported, not two."""
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    errors: list[str] = []
    c = Coalescer(f"redis://127.0.0.1:{port}/0", timeout_s=0.2, on_error=errors.append)

    async def late_handshake() -> None:
        c._fail("timeout", Unavailable("redis did not answer within 0.2s"))
        raise TimeoutError

    monkeypatch.setattr(c, "_handshake", late_handshake)
    with pytest.raises(Unavailable):
        await c.call("PING")
    assert errors == ["timeout"]
    server.close()



Script = Callable[[list[bytes], int], bytes]
"""What a scripted server answers to a command, given its own port."""


async def _scripted(script: Script, at: int = 0) -> tuple[asyncio.Server, int]:
    """A server on loopback (port `at`, any free one by default) answering each command as
    `script` says; it and its port."""
    port = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        parser = hiredis.Reader()
        while data := await reader.read(65536):
            parser.feed(data)
            while (cmd := parser.gets()) is not False:
                writer.write(script(cmd, port))
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", at)
    port = server.sockets[0].getsockname()[1]
    return server, port


@pytest.mark.parametrize("reply", [b"-LOADING Redis is loading the dataset in memory\r\n",
                                   b"-MASTERDOWN Link with MASTER is down\r\n",
                                   b"-BUSY Redis is busy running a script\r\n"])
async def test_a_redis_not_serving_yet_is_unavailable(reply: bytes) -> None:
    """LOADING, MASTERDOWN, BUSY: nothing ran and Redis may serve it shortly: the command
    fails with Unavailable (a 503 with Retry-After), not as a refusal (an error log)."""
    def script(cmd: list[bytes], port: int) -> bytes:
        return b"*1\r\n$6\r\nmaster\r\n" if cmd[0].upper() == b"ROLE" else reply

    server, port = await _scripted(script)
    c = Coalescer(f"redis://127.0.0.1:{port}/0", timeout_s=1)
    with pytest.raises(Unavailable):
        await c.call("FCALL", "capsvc_sell", 0)
    await c.aclose()
    server.close()


async def test_a_cluster_still_down_after_its_retries_is_unavailable() -> None:
    """CLUSTERDOWN on every try (a failover under way): once the retries are spent the
    command fails with Unavailable, not with the cluster's refusal."""
    def script(cmd: list[bytes], port: int) -> bytes:
        if cmd[0].upper() == b"CLUSTER":  # every slot on this node
            return b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n" % port
        return b"-CLUSTERDOWN The cluster is down\r\n"

    server, port = await _scripted(script)
    c = ClusterCoalescer(f"redis+cluster://127.0.0.1:{port}", timeout_s=1)
    with pytest.raises(Unavailable):
        await c.call("GET", "k")
    await c.aclose()
    server.close()


async def test_a_moved_connects_to_its_node_out_of_its_backoff() -> None:
    """A MOVED names the node that serves the slot now: that node's coalescer, backing off
    after failed attempts (the node was down, its replica is promoted in its place),
    connects at once instead of answering from its pause."""
    b_port = free_port()
    maps = 0

    def a_script(cmd: list[bytes], port: int) -> bytes:
        nonlocal maps
        if cmd[0].upper() == b"CLUSTER":  # every slot here, then slot k on b
            maps += 1
            if maps == 1:
                return b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n" % port
            k = slot_of("k")
            return (b"*3\r\n*3\r\n:0\r\n:%d\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n" % (k - 1, port)
                    + b"*3\r\n:%d\r\n:%d\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n" % (k, k, b_port)
                    + b"*3\r\n:%d\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n" % (k + 1, port))
        return b"-MOVED %d 127.0.0.1:%d\r\n" % (slot_of("k"), b_port)

    a_server, a_port = await _scripted(a_script)
    c = ClusterCoalescer(f"redis+cluster://127.0.0.1:{a_port}", timeout_s=1)
    b = c._node(("127.0.0.1", b_port))
    with pytest.raises(Unavailable):  # b is down: a failed attempt
        await b.call("GET", "k")
    b._failed_attempts, b._next_attempt = 6, asyncio.get_running_loop().time() + 60
    with pytest.raises(Unavailable):  # in its pause: answered at once, no attempt
        await b.call("GET", "k")
    b_server, _ = await _scripted(  # the slot map as a has it now; v for the rest
        lambda cmd, port: a_script(cmd, a_port) if cmd[0].upper() == b"CLUSTER"
        else b"$1\r\nv\r\n", b_port)
    assert await c.call("GET", "k") == b"v"
    await c.aclose()
    a_server.close()
    b_server.close()


async def test_each_command_failed_by_one_outage_raises_an_error_of_its_own() -> None:
    """Redis unreachable: the commands of each turn fail with the same failure, each with
    an exception of its own. One instance raised from every await gathered every one's
    frames in its traceback, growing (and keeping those frames alive) as long as the
    outage lasted."""
    c = Coalescer(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    depths = []
    for _ in range(20):
        futures = [c.submit("PING") for _ in range(3)]
        for f in futures:
            try:
                await f
            except Unavailable as e:
                depths.append(len(traceback.extract_tb(e.__traceback__)))
    assert len(depths) == 60
    assert max(depths) == min(depths)
    await c.aclose()


async def test_the_marks_read_of_every_node_is_retrieved_when_one_fails() -> None:
    """The watch reads the marks one call a node; two nodes fail: the first failure is
    raised, the other is retrieved too (asyncio logged it, "Future exception was never
    retrieved", as an error)."""
    loop = asyncio.get_running_loop()
    unretrieved: list[Any] = []
    loop.set_exception_handler(lambda _, context: unretrieved.append(context))
    store = Store(Coalescer(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5))
    reads = []
    for node in ("a", "b"):
        read: asyncio.Future[Any] = loop.create_future()
        read.set_exception(Unavailable(f"node {node} is down"))
        reads.append(([f"m:{{{node}}}"], read))
    with pytest.raises(Unavailable, match="node a"):
        await store._mark_states(["m:{a}", "m:{b}"], ["life"], reads)
    del reads, read
    gc.collect()
    await asyncio.sleep(0)
    loop.set_exception_handler(None)
    assert unretrieved == []
