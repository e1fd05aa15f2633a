"""A fault-injecting TCP proxy between a Redis client and a real Redis, for tests.

The only module that knows which reply answers which command on a connection: it reads the
RESP commands going to Redis (hiredis) and the replies coming back (in order, so the n-th
reply answers the n-th command, pipelined or not), and applies the faults a test asks for to
the commands it names: a reply delayed or lost after Redis ran the command, a command lost
before Redis saw it, a command held until the test lets it go. It knows nothing of capsvc:
point any client, such as a `capsvc serve` process (`ServiceProcess(redis_url=proxy.url)`),
at `proxy.url`.

It runs its own event loop in a background thread, so synchronous tests drive it::

    with FaultProxy("127.0.0.1", redis_server.port) as proxy:
        rule = proxy.drop_reply(command("FCALL", "capsvc_reserve"))
        ...  # the service's reserve runs in Redis; its reply is lost with the connection
        assert rule.fired.wait(5)

Not for connections in RESP2 pub/sub mode, whose messages answer no command.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import hiredis

log = logging.getLogger(__name__)

Command = list[bytes]
"""A command as sent: its name and arguments, undecoded (`[b"SET", b"k", b"v"]`)."""
Predicate = Callable[[Command], bool]
_Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]

_CHUNK = 65536
_LINGER_S = 2.0
"""How long a closed connection's commands already sent get to run in Redis before the
proxy hangs up on it too."""
_INCOMPLETE = object()
_encode: Callable[[tuple[Any, ...]], bytes] = hiredis.pack_command


def command(name: str, *args: str | bytes) -> Predicate:
    """A predicate: the command is `name` (in any case) and its first arguments are `args`;
    or, for an `FCALL` of a marked function, an FCALL of capsvc_calls carries a call that
    reads so (`marked_calls`)."""
    want_name = name.upper().encode()
    want = [a.encode() if isinstance(a, str) else a for a in args]

    def match(cmd: Command) -> bool:
        if cmd[0].upper() != want_name:
            return False
        if cmd[1:1 + len(want)] == want:
            return True
        return want_name == b"FCALL" and any(c[1:1 + len(want)] == want
                                             for c in marked_calls(cmd))

    return match


def functions_of(command: tuple[Any, ...]) -> list[str]:
    """The functions an FCALL, as a transport is given it, runs: its own, or those a call of
    capsvc_calls carries."""
    if command[0] != "FCALL":
        return []
    if command[1] != "capsvc_calls":
        return [command[1]]
    raw = [a if isinstance(a, bytes) else str(a).encode() for a in command]
    return [c[1].decode() for c in marked_calls(raw)]


def marked_calls(cmd: Command) -> list[Command]:
    """The marked calls an FCALL of capsvc_calls carries (lua/capsvc.lua, calls), each as
    the FCALL of its function alone would read: its keys (its mark last), its arguments,
    then the node, the life and what the caller saw."""
    if cmd[0].upper() != b"FCALL" or cmd[1] != b"capsvc_calls":
        return []
    node, life = cmd[4], cmd[5]
    out, i = [], 7
    while i < len(cmd):
        nk = int(cmd[i + 1])
        keys = cmd[i + 2:i + 2 + nk]
        i += 2 + nk
        na = int(cmd[i])
        out.append([b"FCALL", cmd[i - 2 - nk], cmd[i - 1 - nk], *keys, *cmd[i + 1:i + 1 + na],
                    node, life, cmd[i + 1 + na]])
        i += na + 2
    return out


def _matches(match: Predicate, cmd: Command) -> bool:
    try:
        return match(cmd)
    except IndexError:  # a predicate looking at cmd[1] of a one-word command: no match
        return False


@dataclass(frozen=True)
class DelayReply:
    seconds: float


@dataclass(frozen=True)
class DropReply:
    pass


@dataclass(frozen=True)
class DropRequest:
    pass


@dataclass(frozen=True)
class HoldRequest:
    release: threading.Event


Action = DelayReply | DropReply | DropRequest | HoldRequest


@dataclass(eq=False)
class Rule:
    """A fault for the next `count` commands that `match`.

    `hits` counts, and `fired` is set, when the fault takes effect: a delayed or dropped
    reply when it has come back from Redis (so Redis has run the command), a dropped request
    when it is discarded, a held request when the hold starts.
    """

    match: Predicate
    action: Action
    count: int
    hits: int = 0
    fired: threading.Event = field(default_factory=threading.Event)
    _left: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._left = self.count

    def take(self) -> bool:
        """One match fewer left; False when none was left (call with the owner's lock)."""
        if self._left <= 0:
            return False
        self._left -= 1
        return True

    @property
    def spent(self) -> bool:
        return self._left <= 0

    def fire(self) -> None:
        self.hits += 1
        self.fired.set()


def _reply_end(buf: bytearray, pos: int) -> int | None:
    """Where the RESP2/RESP3 value starting at `pos` ends; None if `buf` holds only part of it.

    hiredis parses replies but does not say where one ends in the stream, and a reply must be
    forwarded byte for byte (re-encoding would lose RESP3 types), hence this framer.
    """
    eol = buf.find(b"\r\n", pos)
    if eol < 0:
        return None
    kind, end = buf[pos], eol + 2
    if kind in b"$!=":  # bulk string, bulk error, verbatim string: a length, then the bytes
        size = int(buf[pos + 1:eol])
        if size < 0:  # RESP2's null bulk string
            return end
        return end + size + 2 if len(buf) >= end + size + 2 else None
    if kind in b"*~>%|":  # array, set, push: `size` values; map, attribute: `size` pairs
        size = int(buf[pos + 1:eol]) * (2 if kind in b"%|" else 1)
        for _ in range(max(size, 0)):  # -1: RESP2's null array
            next_end = _reply_end(buf, end)
            if next_end is None:
                return None
            end = next_end
        if kind == ord("|"):  # an attribute annotates the value after it: one reply
            return _reply_end(buf, end)
        return end
    return end  # one-line values: + - : _ , # (


async def _until_set(event: threading.Event) -> None:
    # A threading.Event cannot be awaited, and a thread blocked on it could outlive stop():
    # polling keeps the wait cancellable.
    while not event.is_set():  # noqa: ASYNC110 (the event is the test thread's)
        await asyncio.sleep(0.005)


class _Link:
    """One client connection and its own connection to Redis."""

    def __init__(self, proxy: FaultProxy, client: _Stream, upstream: _Stream) -> None:
        self.proxy = proxy
        self.client_r, self.client_w = client
        self.upstream_r, self.upstream_w = upstream
        self.awaiting: deque[Rule | None] = deque()
        """Per command sent to Redis and not yet answered, its reply-side rule, if any."""
        self.pumps: list[asyncio.Task[bool]] = []

    async def run(self) -> None:
        requests = asyncio.create_task(self._requests())
        replies = asyncio.create_task(self._replies())
        self.pumps = [requests, replies]
        try:
            await asyncio.wait(self.pumps, return_when=asyncio.FIRST_COMPLETED)
            if requests.done() and not requests.cancelled() and requests.result():
                # The client has said all it will say: Redis answers it all, then hangs up.
                self.upstream_w.write_eof()
                await asyncio.wait([replies])
        finally:
            self.kill()
            await asyncio.wait(self.pumps)  # cancelled pumps let go of the streams first
            await self._linger()

    def kill(self) -> None:
        """Close the client's connection now; stop both directions."""
        for pump in self.pumps:
            pump.cancel()
        self.client_w.close()

    async def _linger(self) -> None:
        # Closing a socket that holds unread replies sends a reset, which may make Redis drop
        # commands it has received but not read yet: half-close, and hang up once Redis has
        # answered all it got (bounded), so what was sent runs.
        try:
            with contextlib.suppress(OSError, TimeoutError):
                self.upstream_w.write_eof()  # a no-op if done already
                async with asyncio.timeout(_LINGER_S):
                    while await self.upstream_r.read(_CHUNK):
                        pass
        finally:
            self.upstream_w.close()

    async def _requests(self) -> bool:
        """Client to Redis, command by command; False when the connection is to end."""
        parser = hiredis.Reader(notEnoughData=_INCOMPLETE)
        try:
            while data := await self.client_r.read(_CHUNK):
                parser.feed(data)
                while (cmd := parser.gets()) is not _INCOMPLETE:
                    if not isinstance(cmd, list):
                        log.debug("fault proxy: not a command: %r", cmd)
                        return False
                    if cmd and not await self._forward(cmd):  # Redis skips an empty array
                        return False                          # and sends it no reply
                await self.upstream_w.drain()
        except (ConnectionError, hiredis.ProtocolError) as e:  # inline commands included
            log.debug("fault proxy: client connection ends: %r", e)
            return False
        return True

    async def _forward(self, cmd: Command) -> bool:
        rule = self.proxy._claim(cmd)
        action = rule.action if rule is not None else None
        if isinstance(action, HoldRequest):
            assert rule is not None
            rule.fire()
            await _until_set(action.release)
        if isinstance(action, DropRequest):
            assert rule is not None
            rule.fire()
            return False
        await self.proxy._flowing()
        self.awaiting.append(rule if isinstance(action, DelayReply | DropReply) else None)
        self.upstream_w.write(_encode(tuple(cmd)))
        self.proxy._record(cmd)
        return True

    async def _replies(self) -> bool:
        """Redis to client, reply by reply; returns when the connection is to end."""
        buf = bytearray()
        try:
            while data := await self.upstream_r.read(_CHUNK):
                buf += data
                pos = 0
                while (end := _reply_end(buf, pos)) is not None:
                    if not await self._deliver(bytes(buf[pos:end])):
                        return False
                    pos = end
                del buf[:pos]
                await self.client_w.drain()
        except ConnectionError as e:
            log.debug("fault proxy: connection ends: %r", e)
        return False

    async def _deliver(self, reply: bytes) -> bool:
        # A RESP3 push is out of band: it answers no command.
        rule = self.awaiting.popleft() if reply[:1] != b">" and self.awaiting else None
        if rule is not None:
            rule.fire()
            if isinstance(rule.action, DropReply):
                return False
            if isinstance(rule.action, DelayReply):
                await asyncio.sleep(rule.action.seconds)
        await self.proxy._flowing()
        self.client_w.write(reply)
        return True


class BackgroundProxy:
    """A proxy on 127.0.0.1, a free port, whose connections live in an event loop of its
    own in a background thread, so that a synchronous test drives it: every public method
    is called from the test's thread. Subclasses say how to listen and how to shut down."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._open: asyncio.Event | None = None
        """Set while traffic flows (cleared by a pause or a freeze)."""
        self.port = 0
        """Known once started."""

    def start(self) -> Self:
        assert self._loop is None, f"{type(self).__name__} already started"
        # Bound here, in the caller's thread: the port is known, and a failure raised, at once.
        sock = socket.create_server(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name=f"{type(self).__name__}-{self.port}", daemon=True)
        self._thread.start()
        self._run(self._listen(sock))
        return self

    def stop(self) -> None:
        """Close the listening port and every connection; end the thread."""
        if self._loop is None or self._thread is None:
            return
        self._run(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _run(self, coro: Coroutine[Any, Any, None]) -> None:
        assert self._loop is not None, f"{type(self).__name__} is not started"
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(15)

    async def _listen(self, sock: socket.socket) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._server = await asyncio.start_server(self._serve, sock=sock)

    async def _set_open(self, flowing: bool) -> None:
        assert self._open is not None
        if flowing:
            self._open.set()
        else:
            self._open.clear()

    async def _flowing(self) -> None:
        """Until traffic may flow (a pause or a freeze may come between wake-up and
        running: looked at again)."""
        assert self._open is not None
        while not self._open.is_set():
            await self._open.wait()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def _shutdown(self) -> None:
        raise NotImplementedError


class FaultProxy(BackgroundProxy):
    """A TCP proxy to one Redis on 127.0.0.1, a free port, with faults added at run time.

    Every public method is called from the test's thread; the proxy's connections live in an
    event loop of their own in a background thread.
    """

    def __init__(self, upstream_host: str, upstream_port: int, *,
                 log_size: int = 10_000) -> None:
        super().__init__(upstream_host, upstream_port)
        self._rules: list[Rule] = []
        self._lock = threading.Lock()
        self._seen: deque[Command] = deque(maxlen=log_size)
        self._seen_cond = threading.Condition()
        self._links: set[_Link] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._errors: list[Exception] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        """Close the listening port and every connection; end the thread. Raises the first
        error the proxy itself met, if any."""
        super().stop()
        if self._errors:
            raise RuntimeError("the fault proxy failed") from self._errors[0]

    # -- faults ----------------------------------------------------------------------------

    def delay_reply(self, match: Predicate, seconds: float, count: int = 1) -> Rule:
        """Redis runs the command at once; its reply, and every later one on that connection
        (replies keep their order), reach the client `seconds` after it came back."""
        return self._add(Rule(match, DelayReply(seconds), count))

    def drop_reply(self, match: Predicate, count: int = 1) -> Rule:
        """Redis runs the command; its reply is lost with the client's connection, which
        closes there (replies before it are delivered)."""
        return self._add(Rule(match, DropReply(), count))

    def drop_request(self, match: Predicate, count: int = 1) -> Rule:
        """The command, and what follows it in the client's stream, never reach Redis; the
        client's connection closes (commands before it do run)."""
        return self._add(Rule(match, DropRequest(), count))

    def hold_request(self, match: Predicate, release: threading.Event,
                     count: int = 1) -> Rule:
        """The command, and what follows it on that connection, wait until `release` is set,
        then go to Redis."""
        return self._add(Rule(match, HoldRequest(release), count))

    def remove(self, rule: Rule) -> None:
        """The rule applies to no further command (one already caught keeps its fault)."""
        with self._lock:
            rule._left = 0
            if rule in self._rules:
                self._rules.remove(rule)

    def pause(self) -> None:
        """Stop all traffic, both ways, on every connection, until resume()."""
        self._run(self._set_open(False))

    def resume(self) -> None:
        self._run(self._set_open(True))

    def cut(self) -> None:
        """Close every client connection now (what Redis has received still runs)."""
        self._run(self._cut())

    # -- the log ---------------------------------------------------------------------------

    @property
    def commands(self) -> list[Command]:
        """The commands sent to Redis so far, in order, on every connection (the latest
        `log_size`)."""
        with self._seen_cond:
            return list(self._seen)

    def wait_for(self, match: Predicate, timeout: float = 5.0) -> Command:
        """The first logged command that matches, once one has been sent to Redis (sent,
        not yet necessarily run); TimeoutError if none is within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._seen_cond:
            while True:
                for cmd in self._seen:
                    if _matches(match, cmd):
                        return cmd
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no matching command within {timeout}s")
                self._seen_cond.wait(left)

    # -- inside the loop -------------------------------------------------------------------

    def _add(self, rule: Rule) -> Rule:
        with self._lock:
            self._rules.append(rule)
        return rule

    def _claim(self, cmd: Command) -> Rule | None:
        """The first rule with matches left that matches `cmd`, now one match fewer."""
        with self._lock:
            rules = list(self._rules)
        for rule in rules:  # the test's predicates run outside the lock: they may be slow
            if _matches(rule.match, cmd):
                with self._lock:
                    if rule.take():
                        if rule.spent and rule in self._rules:
                            self._rules.remove(rule)
                        return rule
        return None

    def _record(self, cmd: Command) -> None:
        with self._seen_cond:
            self._seen.append(cmd)
            self._seen_cond.notify_all()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            try:
                upstream = await asyncio.open_connection(*self.upstream)
            except OSError as e:
                log.warning("fault proxy: cannot reach redis at %s:%s: %s", *self.upstream, e)
                writer.close()
                return
            link = _Link(self, (reader, writer), upstream)
            if self._closing:  # accepted just before stop(): never served
                writer.close()
                upstream[1].close()
                return
            self._links.add(link)
            try:
                await link.run()
            finally:
                self._links.discard(link)
        except Exception as e:  # the proxy's own bug: stop() raises it, for no test to miss
            log.exception("fault proxy: connection failed")
            self._errors.append(e)
        finally:
            self._tasks.discard(task)

    async def _cut(self) -> None:
        for link in list(self._links):
            link.kill()

    async def _shutdown(self) -> None:
        assert self._server is not None
        assert self._loop is not None
        self._closing = True
        self._server.close()
        await self._cut()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()
        await self._loop.shutdown_default_executor()  # getaddrinfo's threads, if any


class PartitionProxy(BackgroundProxy):
    """A plain TCP proxy to one server on 127.0.0.1, a free port, that can be partitioned.

    Bytes are forwarded as they come, both ways, with no parsing: put it between a replica
    and its primary (`RedisServer(replica_of=primary, via=proxy)`) and the replication
    stream goes through it. `freeze()` is a network partition: nothing flows either way,
    yet every TCP connection stays up, so the primary still counts the replica as connected
    and the replica still believes in its primary; a connection opened meanwhile is accepted
    but not carried on until `thaw()`. What was read before or during the freeze is delivered
    after the thaw, as TCP would retransmit it once the partition heals. `cut()` closes every
    connection at once. Threaded like FaultProxy: every public method is called from the
    test's thread::

        with PartitionProxy("127.0.0.1", primary.port) as proxy:
            replica = RedisServer(replica_of=primary, via=proxy).start()
            proxy.freeze()  # WAIT 1 on the primary now times out
    """

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        super().__init__(upstream_host, upstream_port)
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pumps: set[asyncio.Task[None]] = set()
        self._frozen = False
        self._closing = False

    @property
    def frozen(self) -> bool:
        return self._frozen

    @property
    def connections(self) -> int:
        """Connections carried now (each counts its two sides once)."""
        return len(self._writers) // 2

    # -- the partition ---------------------------------------------------------------------

    def freeze(self) -> None:
        """Stop every byte, both ways, on every connection; close none."""
        self._frozen = True
        self._run(self._set_open(False))

    def thaw(self) -> None:
        """Let the bytes flow again, those held by the freeze first."""
        self._frozen = False
        self._run(self._set_open(True))

    def cut(self) -> None:
        """Close every connection now, both sides (new ones are still accepted)."""
        self._run(self._cut())

    def retarget(self, host: str, port: int) -> None:
        """Carry new connections to another server (as a DNS name or a virtual IP moved to
        a promoted replica would); the connections already carried are left as they are
        (`cut()` them to move everyone)."""
        self.upstream = (host, port)

    # -- inside the loop -------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        upstream_w: asyncio.StreamWriter | None = None
        try:
            await self._flowing()  # a partition lets no connection through either
            if self._closing:
                return
            try:
                upstream_r, upstream_w = await asyncio.open_connection(*self.upstream)
            except OSError as e:
                log.debug("partition proxy: cannot reach %s:%s: %s", *self.upstream, e)
                return
            self._writers.add(upstream_w)
            pumps = [asyncio.create_task(self._pump(reader, upstream_w)),
                     asyncio.create_task(self._pump(upstream_r, writer))]
            self._pumps.update(pumps)
            try:
                await asyncio.gather(*pumps, return_exceptions=True)
            finally:
                self._pumps.difference_update(pumps)
        finally:
            for w in (writer, upstream_w):
                if w is not None:
                    self._writers.discard(w)
                    w.close()
            self._tasks.discard(task)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        """One direction, byte for byte; passes the end of the stream on (half-close)."""
        try:
            while True:
                await self._flowing()
                data = await source.read(_CHUNK)
                if not data:
                    break
                await self._flowing()  # read just before a freeze: held until the thaw
                sink.write(data)
                await sink.drain()
            await self._flowing()
            if sink.can_write_eof():
                sink.write_eof()
        except (ConnectionError, OSError) as e:
            log.debug("partition proxy: connection ends: %r", e)
            sink.transport.abort()

    async def _cut(self) -> None:
        for w in list(self._writers):
            w.transport.abort()

    async def _shutdown(self) -> None:
        assert self._server is not None
        assert self._loop is not None
        self._closing = True
        self._server.close()
        await self._cut()
        for pump in list(self._pumps):  # frozen ones too
            pump.cancel()
        await self._set_open(True)  # connections held before reaching upstream: let go
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

