"""`Answer` sends what aiohttp's `web.Response` sends, byte for byte, on every kind of
request: HTTP/1.1 kept alive (its own path), HTTP/1.0, `Connection: close`, HEAD (aiohttp's
path), with extra headers, and with a request id; a header value with a line break is
refused before anything is sent."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from capsvc.http.responses import Answer, answer_headers

BODY = b'{"ticket_id":"A-1","status":"accepted"}'


def reference(request: web.BaseRequest) -> web.StreamResponse:
    status = int(request.query.get("status", "200"))
    extra = {"Retry-After": "1"} if status == 503 else {}
    resp = web.Response(body=BODY, status=status, content_type="application/json")
    resp.headers.update(extra)
    resp.headers["X-Request-ID"] = "rid-1"
    return resp


def ours(request: web.BaseRequest) -> web.StreamResponse:
    status = int(request.query.get("status", "200"))
    extra = {"Retry-After": "1"} if status == 503 else None
    resp = Answer(BODY, status, extra)
    answer_headers(resp, "rid-1")
    return resp


@pytest.fixture
async def servers() -> AsyncIterator[dict[str, int]]:
    ports = {}
    runners = []
    for name, make in (("reference", reference), ("answer", ours)):
        async def handler(request: web.BaseRequest, make=make) -> web.StreamResponse:
            return make(request)
        runner = web.ServerRunner(web.Server(handler))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        ports[name] = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield ports
    for runner in runners:
        await runner.cleanup()


async def exchange(port: int, raw: bytes, requests: int = 1) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw * requests)
    await writer.drain()
    out = b""
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), 0.5)
            if not chunk:
                break
            out += chunk
    except TimeoutError:
        pass
    writer.close()
    return re.sub(rb"Date: [^\r]*", b"Date: -", out)


@pytest.mark.parametrize("raw", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /?status=422 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /?status=503 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"GET / HTTP/1.0\r\n\r\n",
    b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
    b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /?status=409 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
])
async def test_the_bytes_are_aiohttps(servers: dict[str, int], raw: bytes) -> None:
    requests = 1 if b"close" in raw or b"HTTP/1.0\r\n\r\n" in raw else 3  # kept alive: three
    got = await exchange(servers["answer"], raw, requests)
    want = await exchange(servers["reference"], raw, requests)
    assert got == want
    assert got.count(b"X-Request-ID: rid-1") == requests


def test_a_line_break_in_a_header_is_refused() -> None:
    with pytest.raises(ValueError, match="line break"):
        Answer(BODY, 503, {"Retry-After": "1\r\nSet-Cookie: x=1"})
    with pytest.raises(ValueError, match="line break"):
        Answer(BODY, 503, {"Retry-After": "1\nX: y"})
