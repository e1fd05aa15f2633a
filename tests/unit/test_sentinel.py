"""Sentinel URLs: every documented form is read as meant, and every malformed one is
refused with a message that says what is wrong (for `serve`, `check-config` and the
configuration alike)."""

from __future__ import annotations

import asyncio
import time

import pytest

from capsvc.config import redis_url_problem
from capsvc.domain.errors import Unavailable
from capsvc.redis.transport import Coalescer
from capsvc.urls import SentinelURL, is_sentinel_url, parse_sentinel_url


@pytest.mark.parametrize(("url", "want"), [
    ("redis+sentinel://h1:26379/mymaster",
     SentinelURL((("h1", 26379),), "mymaster")),
    ("redis+sentinel://h1,h2:26380,[::1]:26381/mymaster",
     SentinelURL((("h1", 26379), ("h2", 26380), ("::1", 26381)), "mymaster")),
    ("redis+sentinel://:s%40cret@h1:26379/m?db=3",
     SentinelURL((("h1", 26379),), "m", db=3, password="s@cret")),
    ("redis+sentinel://app:pw@h1:26379/m",
     SentinelURL((("h1", 26379),), "m", username="app", password="pw")),
    ("redis+sentinel://pw@h1/m",
     SentinelURL((("h1", 26379),), "m", password="pw")),
    ("rediss+sentinel://h1:26379/m?sentinel_password=x&sentinel_username=s",
     SentinelURL((("h1", 26379),), "m", tls=True, sentinel_username="s",
                 sentinel_password="x")),
])
def test_documented_forms_are_read_as_meant(url: str, want: SentinelURL) -> None:
    """Addresses (default port 26379, IPv6 in brackets), service, db, TLS, credentials."""
    assert is_sentinel_url(url)
    assert parse_sentinel_url(url) == want
    assert redis_url_problem(url) is None


@pytest.mark.parametrize(("url", "says"), [
    ("redis+sentinel://h1:26379", "service name"),
    ("redis+sentinel://h1:26379/", "service name"),
    ("redis+sentinel://h1:26379/a/b", "service name"),
    ("redis+sentinel://h1:notaport/m", "not a host:port"),
    ("redis+sentinel://h1:26379,,h2/m", "empty sentinel address"),
    ("redis+sentinel://:26379/m", "not a host:port"),
    ("redis+sentinel://h1/m?db=x", "db must be a number"),
    ("redis+sentinel://h1/m?timeout=1", "unknown parameter"),
])
def test_malformed_urls_are_refused_with_the_reason(url: str, says: str) -> None:
    """A bad Sentinel URL is a clear configuration error, never a traceback at start."""
    problem = redis_url_problem(url)
    assert problem is not None
    assert says in problem


def test_other_schemes_are_not_sentinel_urls() -> None:
    """Plain and cluster URLs keep their own parsing; the error names the sentinel form."""
    assert not is_sentinel_url("redis://h1:6379/0")
    assert not is_sentinel_url("redis+cluster://h1:6379")
    problem = redis_url_problem("http://h1")
    assert problem is not None
    assert "redis+sentinel://" in problem


def test_a_refused_url_never_shows_its_password() -> None:
    """The error message of a bad Sentinel URL hides the password it carries."""
    problem = redis_url_problem("redis+sentinel://app:hunter2@h1:26379/?db=1")
    assert problem is not None
    assert "hunter2" not in problem
    assert "app:***@h1:26379" in problem


async def _fake_sentinel(answer: bytes) -> asyncio.Server:
    """A server on loopback that answers every command with `answer` (or never, if empty)."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):
            if answer:
                writer.write(answer)
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


@pytest.mark.parametrize("answer", [
    b":5\r\n",                           # a number, not an address
    b"*2\r\n$9\r\n127.0.0.1\r\n$3\r\nabc\r\n",   # a port that is no number
    b"*1\r\n$9\r\n127.0.0.1\r\n",        # half an address
    b"\x00\xffnot RESP at all\r\n",      # not the protocol
    b"",                                 # silence
])
async def test_a_sentinel_talking_nonsense_is_no_primary_and_no_hang(answer: bytes) -> None:
    """Whatever a sentinel answers, a sale's connection fails with Unavailable (a 503)
    within the timeout, every time: the client is never left stuck on a dead attempt."""
    server = await _fake_sentinel(answer)
    port = server.sockets[0].getsockname()[1]
    c = Coalescer(f"redis+sentinel://127.0.0.1:{port}/mymaster", timeout_s=0.2)
    for _ in range(2):
        started = time.monotonic()
        with pytest.raises(Unavailable):
            await c.call("PING")
        assert time.monotonic() - started < 2
    await c.aclose()
    server.close()


def test_a_sentinel_password_in_the_query_is_hidden_too() -> None:
    """`sentinel_password=` in the query is as secret as the one before the `@`."""
    problem = redis_url_problem("redis+sentinel://h1:26379/s?sentinel_password=hunter2&x=1")
    assert problem is not None
    assert "unknown parameter" in problem
    assert "hunter2" not in problem
