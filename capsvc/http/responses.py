"""A JSON answer written as one buffer: status line, headers and body.

aiohttp's `web.Response` builds a header multidict, fills it in `prepare` (content length,
date, server), serialises it and coalesces it with the body: per answer, a dozen objects
and calls that a sale pays for on every request (measured with bench/ab.py: 18-20 µs of
a sale's ~330 µs of server CPU on the 2-CPU machine of docs/performance.md). `Answer`
sends the same bytes — the same headers in
the same order as `web.Response` with `content_type="application/json"` — from a format
string, on the path every sale takes: HTTP/1.1, keep-alive, not a HEAD. Any other request
(HTTP/1.0, `Connection: close`, HEAD) gets the answer through aiohttp's own path, which
knows those cases; so does an answer whose `headers` someone touched.
"""

from __future__ import annotations

import time
from email.utils import formatdate
from http import HTTPStatus

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http import SERVER_SOFTWARE, HttpVersion11

_JSON = "application/json"
_HEAD = (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n%sX-Request-ID: %s\r\n"
         b"Content-Length: %d\r\nDate: %s\r\nServer: " + SERVER_SOFTWARE.encode() + b"\r\n\r\n")
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_date: tuple[int, bytes] = (0, b"")


def http_date() -> bytes:
    """The Date header's value (IMF-fixdate), made once a second."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, formatdate(now, usegmt=True).encode())
    return _date[1]


def header_lines(headers: dict[str, str] | None) -> bytes:
    """`Name: value` lines of headers the service itself sets (never a caller's text)."""
    if not headers:
        return b""
    for name, value in headers.items():
        if "\r" in name or "\n" in name or "\r" in value or "\n" in value:
            raise ValueError(f"a header may not hold a line break: {name!r}: {value!r}")
    return "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1")


class Answer(web.StreamResponse):
    """A JSON body with its status and extra headers, sent as one buffer (see the module)."""

    def __init__(self, body: bytes, status: int = 200,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status=status)
        self.body_bytes = body
        self.extra_headers = headers or {}
        self.extra = header_lines(headers)
        """Header lines between Content-Type and X-Request-ID, as web.Response puts them."""
        self.request_id = ""
        self._sent = False

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        if self._payload_writer is not None or self._eof_sent:
            return self._payload_writer
        if (request.version != HttpVersion11 or not request.keep_alive
                or request.method == "HEAD" or self._headers):
            return await self._prepare_slowly(request)
        writer = request._payload_writer
        self._req = request
        self._payload_writer = writer
        self._keep_alive = True
        self._sent = True
        body = self.body_bytes
        await writer.write(_HEAD % (self._status, _REASONS.get(self._status, b""), self.extra,
                                    self.request_id.encode(), len(body), http_date()) + body)
        return writer

    async def _prepare_slowly(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        """aiohttp's own path, with the same headers."""
        headers = self._headers
        known = dict(headers)
        headers.clear()
        headers["Content-Type"] = _JSON
        headers.update(self.extra_headers)
        if self.request_id:
            headers["X-Request-ID"] = self.request_id
        headers.update(known)
        headers["Content-Length"] = str(len(self.body_bytes))
        return await super().prepare(request)

    async def write_eof(self, data: bytes = b"") -> None:
        await super().write_eof(b"" if self._sent or self._must_be_empty_body
                                else self.body_bytes)

    def __repr__(self) -> str:
        return f"<Answer {self._status} {self.body_bytes[:60]!r}>"


def answer_headers(resp: web.StreamResponse, request_id: str) -> None:
    """Stamp the request id on an answer about to be sent."""
    if type(resp) is Answer:
        resp.request_id = request_id
    elif not resp.prepared:  # a stream has sent its headers (with its id)
        resp.headers["X-Request-ID"] = request_id
