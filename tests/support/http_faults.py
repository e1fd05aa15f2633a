"""A fault-injecting HTTP/1.1 proxy between an HTTP client and one server, for tests.

What `faults.FaultProxy` is between a service and Redis, this is between a sales system (or
`capsvc.client`) and the service: it reads each request and each response on a keep-alive
connection, and applies the faults a test asks for to the requests it names — the answer
lost after the service ran the request (the client's connection reset), the answer
delayed past the client's timeout, the connection reset before the request reached the
service. It knows nothing of capsvc's insides: a request is known by its method and path::

    with HttpFaultProxy("127.0.0.1", service.port) as proxy:
        proxy.drop_response(request("POST", "/v1/tickets"))
        client = Client(proxy.url, token)  # the first sale runs; its answer never arrives

A response without a length (the sold-out feed's event stream) is passed on byte for byte,
and the rest of that connection with it. Threaded like `FaultProxy`: every public method is
called from the test's thread.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.support.faults import (
    BackgroundProxy,
    DelayReply,
    DropReply,
    DropRequest,
    HoldRequest,
    Rule,
)

log = logging.getLogger(__name__)

Request = list[bytes]
"""A request as the rules see it: `[method, path]` (the path with its query, undecoded)."""
_HEAD_END = b"\r\n\r\n"
_MAX_HEAD = 65536


def request(method: str, path_prefix: str = "/") -> Callable[[Request], bool]:
    """A predicate: the request's method is `method` and its path starts with `path_prefix`."""
    want_method, want_path = method.upper().encode(), path_prefix.encode()

    def match(req: Request) -> bool:
        return req[0] == want_method and req[1].startswith(want_path)

    return match


@dataclass(eq=False)
class Chaos:
    """Random faults on every matching request, each drawn with its probability from a
    seeded generator (so a failing run can be replayed): the answer dropped, delayed by up
    to `delay_s`, or the connection reset before the request was forwarded."""

    match: Callable[[Request], bool]
    drop: float = 0.0
    delay: float = 0.0
    reset: float = 0.0
    delay_s: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)
        self.counts = {"drop": 0, "delay": 0, "reset": 0}
        """How many of each fault took effect."""

    def draw(self) -> DropReply | DelayReply | DropRequest | None:
        x = self._random.random()
        if x < self.drop:
            self.counts["drop"] += 1
            return DropReply()
        if x < self.drop + self.delay:
            self.counts["delay"] += 1
            return DelayReply(self._random.uniform(0, self.delay_s))
        if x < self.drop + self.delay + self.reset:
            self.counts["reset"] += 1
            return DropRequest()
        return None


class HttpFaultProxy(BackgroundProxy):
    """An HTTP/1.1 proxy to one server on 127.0.0.1, a free port, with faults added at run
    time (every public method is called from the test's thread)."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        super().__init__(upstream_host, upstream_port)
        self._rules: list[Rule] = []
        self._chaos: list[Chaos] = []
        self._lock = threading.Lock()
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._errors: list[Exception] = []
        self.forwarded: list[Request] = []
        """Every request that reached the server, in order."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Close the port and every connection; raise the first error of the proxy itself."""
        super().stop()
        if self._errors:
            raise RuntimeError("the HTTP fault proxy failed") from self._errors[0]

    # -- faults ----------------------------------------------------------------------------

    def drop_response(self, match: Callable[[Request], bool], count: int = 1) -> Rule:
        """The server runs the request; its answer is lost: the client's connection is
        reset once the answer has come back."""
        return self._add(Rule(match, DropReply(), count))

    def delay_response(self, match: Callable[[Request], bool], seconds: float,
                       count: int = 1) -> Rule:
        """The server runs the request at once; its answer reaches the client `seconds`
        later (later than the client waits, if the test wants a timeout)."""
        return self._add(Rule(match, DelayReply(seconds), count))

    def reset_request(self, match: Callable[[Request], bool], count: int = 1) -> Rule:
        """The client's connection is reset before the request reaches the server."""
        return self._add(Rule(match, DropRequest(), count))

    def chaos(self, chaos: Chaos) -> Chaos:
        """Random faults from now on (until `calm()`)."""
        with self._lock:
            self._chaos.append(chaos)
        return chaos

    def calm(self) -> None:
        """No more faults: rules and chaos removed."""
        with self._lock:
            self._rules.clear()
            self._chaos.clear()

    def cut(self) -> None:
        """Reset every connection now (requests already forwarded still run)."""
        self._run(self._cut())

    # -- inside the loop -------------------------------------------------------------------

    def _add(self, rule: Rule) -> Rule:
        with self._lock:
            self._rules.append(rule)
        return rule

    def _fault(self, req: Request) -> tuple[Rule | None, DropReply | DelayReply | DropRequest
                                            | None]:
        with self._lock:
            for rule in self._rules:
                if rule.match(req) and rule.take():
                    if rule.spent:
                        self._rules.remove(rule)
                    assert not isinstance(rule.action, HoldRequest)
                    return rule, rule.action
            for chaos in self._chaos:
                if chaos.match(req):
                    return None, chaos.draw()
        return None, None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                head = await _head(reader)
                if head is None:
                    return
                first = head.split(b"\r\n", 1)[0].split(b" ")
                req: Request = [first[0].upper(), first[1] if len(first) > 1 else b"/"]
                body = await reader.readexactly(_length(head) or 0)
                rule, fault = self._fault(req)
                if isinstance(fault, DropRequest):
                    _fired(rule)
                    writer.transport.abort()
                    return
                if upstream is None:
                    upstream = await asyncio.open_connection(*self.upstream)
                    self._writers.add(upstream[1])
                upstream[1].write(head + body)
                await upstream[1].drain()
                self.forwarded.append(req)
                answer = await _head(upstream[0])
                if answer is None:
                    writer.transport.abort()
                    return
                length = _length(answer)
                if length is None:  # a stream: passed on as it comes, to the end
                    writer.write(answer)
                    await _pump(upstream[0], writer)
                    return
                answer += await upstream[0].readexactly(length)
                if isinstance(fault, DropReply):
                    _fired(rule)
                    writer.transport.abort()
                    return
                if isinstance(fault, DelayReply):
                    _fired(rule)
                    await asyncio.sleep(fault.seconds)
                writer.write(answer)
                await writer.drain()
        except (ConnectionError, OSError, asyncio.IncompleteReadError) as e:
            log.debug("http fault proxy: connection ends: %r", e)
        except Exception as e:  # the proxy's own bug: stop() raises it
            log.exception("http fault proxy: connection failed")
            self._errors.append(e)
        finally:
            for w in (writer, None if upstream is None else upstream[1]):
                if w is not None:
                    self._writers.discard(w)
                    w.transport.abort()
            self._tasks.discard(task)

    async def _cut(self) -> None:
        for w in list(self._writers):
            w.transport.abort()

    async def _shutdown(self) -> None:
        assert self._server is not None
        assert self._loop is not None
        self._server.close()
        await self._cut()  # each connection's task ends on its own, but a delay's sleep
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()


async def _head(reader: asyncio.StreamReader) -> bytes | None:
    """A message's start line and headers, up to and including the blank line; None at the
    end of the stream between messages."""
    try:
        return await reader.readuntil(_HEAD_END)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise


def _length(head: bytes) -> int | None:
    """Content-Length, 0 for a message that has no body by its status, None for one read
    to its end (chunked or unbounded)."""
    lines = head.split(b"\r\n")
    status = lines[0].split(b" ")
    if status[0].startswith(b"HTTP/") and len(status) > 1 and status[1] in (b"204", b"304"):
        return 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    if not status[0].startswith(b"HTTP/"):
        return 0  # a request without a body
    return None


async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    while data := await source.read(65536):
        sink.write(data)
        await sink.drain()


def _fired(rule: Rule | None) -> None:
    if rule is not None:
        rule.fire()
