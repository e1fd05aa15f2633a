"""capsvc.client at its edges: odd ids and paths, answers that are not the service's, event
streams cut anywhere, Retry-After in any form, a deadline used to its end, and closing the
client while a sale or a feed is in flight.

Against the real service where the fault is the service's own behaviour (ids "." and "..");
against a stand-in HTTP server where it plays what sits between a sales system and capsvc
(a proxy's HTML page, a stream cut in the middle of an event, an answer that never comes).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from capsvc.client import (
    AuthError,
    Client,
    NotFoundError,
    OutcomeUnknown,
    SyncClient,
    Unavailable,
    ValidationError,
)
from capsvc.client.api import sse_events
from tests.conftest import CONFIG, TEN, TOKENS, ticket
from tests.support.http_faults import HttpFaultProxy, request
from tests.support.service import ServiceProcess, served

ENDS_S = 30.0
"""What "at once" is bounded by: far below the deadlines and silences the tests close
the client during (an hour), far above a loaded machine's delays."""
FOREVER_S = 3600.0
SALE = {"ticket_id": "R-1", "game": "fdj-keno", "grids": [{"numbers": TEN, "stake": 500}]}


@pytest.fixture(scope="module")
def live() -> Iterator[ServiceProcess]:
    with served(str(CONFIG)) as service:
        yield service


async def test_ids_dot_and_dotdot_are_ids_not_path_steps(live: ServiceProcess) -> None:
    """"." and ".." are valid ticket and player ids: a sale whose answers were all lost is
    then looked up (decided, not "never counted"), and cancelled, by that id."""
    with HttpFaultProxy("127.0.0.1", live.port) as proxy:
        async with Client(proxy.url, TOKENS["fr"], backoff_s=0.01) as c, \
                Client(live.base_url, TOKENS["fr"]) as look:
            draw = (await look.current_draw("fdj-keno")).draw
            for ticket_id in ("..", "."):
                proxy.drop_response(request("POST", "/v1/tickets"), count=1000)
                with pytest.raises(OutcomeUnknown):
                    await c.sell(ticket([{"numbers": TEN, "stake": 200}], first_draw=draw,
                                        ticket_id=ticket_id), deadline_s=0.5)
                proxy.calm()
                assert (await c.ticket(ticket_id)).status == "accepted"
                assert (await c.cancel(ticket_id)).released == 200
    async with Client(live.base_url, TOKENS["ma"]) as c:
        assert (await c.set_limit("..", 1000)).player_id == ".."
        assert (await c.record_stake("..", "..", "loto", 100)).remaining == 900
        assert (await c.player("..")).spent == 100


class StandIn:
    """An HTTP server whose answers a test writes (`handler`), counting requests."""

    def __init__(self) -> None:
        self.requests = 0
        self.handler: Any = None
        self.url = ""
        self.counted = asyncio.Condition()

    async def handle(self, req: web.Request) -> web.StreamResponse:
        async with self.counted:
            self.requests += 1
            self.counted.notify_all()
        result: web.StreamResponse = await self.handler(req)
        return result


async def arrived(stand_in: StandIn, n: int) -> None:
    """Until the stand-in has received `n` requests (fails after ENDS_S: a hang)."""
    async with asyncio.timeout(ENDS_S), stand_in.counted:
        await stand_in.counted.wait_for(lambda: stand_in.requests >= n)


@pytest.fixture
async def stand_in() -> AsyncIterator[StandIn]:
    s = StandIn()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", s.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    s.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    yield s
    await runner.cleanup()


async def test_a_200_that_is_not_the_services_answer_is_an_unknown_outcome(
        stand_in: StandIn) -> None:
    """A proxy's HTML page, an empty body, a body of another shape, with a 200: not a
    decision. The sale is sent again until the deadline (OutcomeUnknown), a look-up is
    Unavailable; a 403 page from a proxy is an AuthError: none leaks msgspec's errors."""
    bodies = iter([b"<html>maintenance</html>", b"", b'{"hello": 1}'] * 100)

    async def page(req: web.Request) -> web.Response:
        return web.Response(body=next(bodies), content_type="text/html")

    stand_in.handler = page
    async with Client(stand_in.url, "t", backoff_s=0.01, deadline_s=0.5) as c:
        with pytest.raises(OutcomeUnknown) as unknown:
            await c.sell(SALE, deadline_s=0.5)
        assert "unreadable" in unknown.value.last
        assert stand_in.requests > 3
        with pytest.raises(Unavailable):
            await c.current_draw("fdj-keno")

    async def forbidden(req: web.Request) -> web.Response:
        return web.Response(status=403, body=b"<html>denied</html>", content_type="text/html")

    stand_in.handler = forbidden
    async with Client(stand_in.url, "t") as c:
        with pytest.raises(AuthError) as denied:
            await anext(c.capped_events("fdj-keno"))
        assert denied.value.code == "unexpected"


async def test_the_feed_takes_a_snapshot_line_of_megabytes_and_resumes_after_a_cut_event(
        stand_in: StandIn) -> None:
    """A snapshot of 2 MB on one `data:` line (thousands of combinations at their cap) is
    one event; an event cut in the middle by a dropped connection is not yielded: the
    iterator reconnects after the last whole event, with its id."""
    big = '{"draws": [{"draw": 1, "combinations": [' + ",".join(
        ["[1,2,3,4,5,6,7,8]"] * 120_000) + "]}]}"
    seen: list[str | None] = []

    async def stream(req: web.Request) -> web.StreamResponse:
        seen.append(req.headers.get("Last-Event-ID"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        if len(seen) == 1:
            await resp.write(f"event: snapshot\nid: 1-0\ndata: {big}\n\n".encode())
            await resp.write(b'event: capped\nid: 2-0\ndata: {"draw": 1, "numb')
            req.transport.close()  # type: ignore[union-attr]
            return resp
        await resp.write(b'event: capped\nid: 2-0\ndata: {"draw": 1, "numbers": [1]}\n\n')
        await asyncio.sleep(30)
        return resp

    stand_in.handler = stream
    async with Client(stand_in.url, "t", backoff_s=0.01) as c:
        events = c.capped_events("fdj-keno")
        first = await asyncio.wait_for(anext(events), 10)
        second = await asyncio.wait_for(anext(events), 10)
        await events.aclose()
    assert (first.kind, len(first.data["draws"][0]["combinations"])) == ("snapshot", 120_000)
    assert (second.kind, second.id, second.data["numbers"]) == ("capped", "2-0", [1])
    assert seen == [None, "1-0"]


async def test_sse_events_of_chunks_cut_anywhere() -> None:
    """The same events whatever the chunks' boundaries; a last event without its blank
    line (the connection cut) is not yielded; several data lines are joined."""
    text = (b": heartbeat\n\nevent: a\nid: 1-0\ndata: {\"x\": 1}\n\n"
            b"event: b\r\nid: 2-0\r\ndata: [1,\r\ndata: 2]\r\n\r\nevent: c\nid: 3-0\ndata: {")

    async def chunks(size: int) -> AsyncIterator[bytes]:
        for i in range(0, len(text), size):
            yield text[i:i + size]

    for size in (1, 2, 7, len(text)):
        got = [e async for e in sse_events(chunks(size))]
        assert got == [("a", "1-0", '{"x": 1}'), ("b", "2-0", "[1,\n2]")], size


async def test_a_callers_session_that_raises_for_status_still_gets_typed_errors_once(
        stand_in: StandIn) -> None:
    async def refuse(req: web.Request) -> web.Response:
        return web.json_response({"error": {"code": "stake_not_allowed", "message": "no",
                                            "path": "$.grids[0].stake"}}, status=422)

    stand_in.handler = refuse
    async with aiohttp.ClientSession(raise_for_status=True) as session:
        c = Client(stand_in.url, "t", session=session)
        with pytest.raises(ValidationError):
            await c.sell(SALE, deadline_s=2)
        assert stand_in.requests == 1

        async def missing(req: web.Request) -> web.Response:
            return web.json_response({"error": {"code": "not_found", "message": "no",
                                                "path": None}}, status=404)

        stand_in.handler = missing
        with pytest.raises(NotFoundError):
            await c.ticket("NEVER", deadline_s=2)


async def never_answer(req: web.Request) -> web.Response:
    await asyncio.sleep(FOREVER_S)
    return web.Response()


async def test_closing_the_client_ends_a_sale_in_flight_with_outcome_unknown(
        stand_in: StandIn) -> None:
    """aclose() while a sale waits for its answer: OutcomeUnknown at once (the sale may
    have been counted), not a RuntimeError; a sale after the close is refused unsent."""
    stand_in.handler = never_answer
    async with Client(stand_in.url, "t") as c:
        selling = asyncio.create_task(c.sell(SALE, deadline_s=FOREVER_S))
        await arrived(stand_in, 1)
        await c.aclose()
        with pytest.raises(OutcomeUnknown) as unknown:
            await asyncio.wait_for(selling, ENDS_S)
        assert "closed" in unknown.value.last
        with pytest.raises(RuntimeError):
            await c.sell(SALE)


async def test_closing_the_blocking_client_ends_another_threads_sale(stand_in: StandIn
                                                                     ) -> None:
    """SyncClient.close() while another thread sells: that thread gets OutcomeUnknown and
    ends; close() returns. (The stand-in serves from this test's loop: the blocking parts
    run in threads.)"""
    stand_in.handler = never_answer
    outcome: list[BaseException] = []
    c = SyncClient(stand_in.url, "t")

    def sell() -> None:
        try:
            c.sell(SALE, deadline_s=FOREVER_S)
        except BaseException as e:
            outcome.append(e)

    seller = threading.Thread(target=sell)
    seller.start()
    await arrived(stand_in, 1)
    await asyncio.to_thread(c.close)
    await asyncio.to_thread(seller.join, ENDS_S)
    assert not seller.is_alive()
    assert len(outcome) == 1
    assert isinstance(outcome[0], OutcomeUnknown)


async def test_the_deadline_is_used_to_its_end(stand_in: StandIn) -> None:
    """Every connection refused at once: the client keeps trying until the deadline (not
    a jittered pause short of it), and not much past it."""
    async with Client("http://127.0.0.1:9", "t", backoff_s=0.2, max_backoff_s=2) as c:
        for deadline in (1.0, 3.0):
            started = time.monotonic()
            with pytest.raises(OutcomeUnknown):
                await c.sell(SALE, deadline_s=deadline)
            elapsed = time.monotonic() - started
            assert deadline - 0.1 <= elapsed <= deadline + 0.2, (deadline, elapsed)


# -- answers half read, closing from other threads, headers and paths ---------------------


async def half_an_answer(req: web.Request) -> web.StreamResponse:
    """The status and headers, part of the body, then nothing."""
    resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json",
                                                   "Content-Length": "1000"})
    await resp.prepare(req)
    await resp.write(b'{"ticket_id": "R-1", ')
    await asyncio.sleep(FOREVER_S)
    return resp


async def snapshot_then_silence(req: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(req)
    await resp.write(b'event: snapshot\nid: 0-0\ndata: {"draws": []}\n\n')
    await asyncio.sleep(FOREVER_S)
    return resp


async def ends_at_once(stand_in: StandIn, n: int, c: Client, waiting: asyncio.Task[Any],
                       error: type[BaseException]) -> None:
    """Close `c` while `waiting` is blocked on it (the stand-in's `n`th request, answered in
    part, then silent for an hour): `waiting` ends with `error`, at once."""
    await arrived(stand_in, n)
    await c.aclose()
    with pytest.raises(error):
        await asyncio.wait_for(waiting, ENDS_S)


async def test_closing_ends_a_sale_reading_its_answer_and_a_feed_at_once(
        stand_in: StandIn) -> None:
    """aclose() while a sale's answer is half read: OutcomeUnknown at once; while a feed
    iterator waits for its next event: the iterator ends."""
    stand_in.handler = half_an_answer
    async with Client(stand_in.url, "t", timeout_s=FOREVER_S) as c:
        selling = asyncio.create_task(c.sell(SALE, deadline_s=FOREVER_S))
        await ends_at_once(stand_in, 1, c, selling, OutcomeUnknown)
    stand_in.handler = snapshot_then_silence
    async with Client(stand_in.url, "t") as c:
        events = c.capped_events("fdj-keno")
        assert (await anext(events)).kind == "snapshot"
        waiting = asyncio.create_task(anext(events))
        await ends_at_once(stand_in, 2, c, waiting, StopAsyncIteration)


async def test_a_feed_asked_for_its_next_event_after_the_close_ends(stand_in: StandIn
                                                                    ) -> None:
    """The next event asked of a feed iterator once aclose() has run: the iterator ends
    (StopAsyncIteration), as for one waiting during the close, not a RuntimeError."""
    stand_in.handler = snapshot_then_silence
    async with Client(stand_in.url, "t") as c:
        events = c.capped_events("fdj-keno")
        assert (await anext(events)).kind == "snapshot"
        await c.aclose()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(events), ENDS_S)


async def test_closing_the_blocking_client_ends_a_half_read_sale_and_a_feed_in_threads(
        stand_in: StandIn) -> None:
    """SyncClient.close() while one thread reads half an answer and another waits for the
    feed's next event: both end at once, with OutcomeUnknown and the feed's end."""
    got: list[Any] = []
    c = SyncClient(stand_in.url, "t", timeout_s=FOREVER_S)

    def sell() -> None:
        try:
            c.sell(SALE, deadline_s=FOREVER_S)
        except OutcomeUnknown as e:
            got.append(e)

    def follow() -> None:
        try:
            for event in c.capped_events("fdj-keno"):
                got.append(event.kind)
        except Exception as e:
            got.append(e)

    async def route(req: web.Request) -> web.StreamResponse:
        return await (snapshot_then_silence(req) if "stream" in req.path
                      else half_an_answer(req))

    stand_in.handler = route
    threads = [threading.Thread(target=sell), threading.Thread(target=follow)]
    for t in threads:
        t.start()
    await arrived(stand_in, 2)
    deadline = time.monotonic() + ENDS_S
    while "snapshot" not in got:  # the feed's thread has read the snapshot
        assert time.monotonic() < deadline, "no snapshot read"
        await asyncio.sleep(0.01)
    await asyncio.to_thread(c.close)
    for t in threads:
        await asyncio.to_thread(t.join, ENDS_S)
    assert not any(t.is_alive() for t in threads)
    assert sorted(map(str, (type(g).__name__ if not isinstance(g, str) else g for g in got))
                  ) == ["OutcomeUnknown", "snapshot"]
    with pytest.raises(RuntimeError):
        c.sell(SALE)


async def test_two_threads_closing_at_once_both_return(stand_in: StandIn) -> None:
    """Two threads close a SyncClient while a third sells: all three return."""
    stand_in.handler = never_answer
    for sent in range(1, 6):
        c = SyncClient(stand_in.url, "t")
        seller = threading.Thread(target=lambda c=c: _quietly(c.sell, SALE))
        seller.start()
        await arrived(stand_in, sent)
        closers = [threading.Thread(target=c.close) for _ in range(2)]
        for t in closers:
            t.start()
        for t in [*closers, seller]:
            await asyncio.to_thread(t.join, ENDS_S)
        assert not any(t.is_alive() for t in [*closers, seller])


def _quietly(call: Any, *args: Any) -> None:
    with contextlib.suppress(OutcomeUnknown):
        call(*args)


async def test_retry_after_of_any_form_is_read_or_ignored_never_an_error(
        stand_in: StandIn) -> None:
    from capsvc.client.api import _retry_after

    assert _retry_after("3") == 3.0
    assert _retry_after("²") == _retry_after("1.5") == _retry_after("soon") == 0.0
    assert 8 < _retry_after(time.strftime("%a, %d %b %Y %H:%M:%S GMT",
                                          time.gmtime(time.time() + 10))) <= 10
    assert _retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0

    async def busy(req: web.Request) -> web.Response:
        return web.json_response({"error": {"code": "unavailable", "message": "busy",
                                            "path": None}},
                                 status=503, headers={"Retry-After": "²"})

    stand_in.handler = busy
    async with Client(stand_in.url, "t", backoff_s=0.01) as c:
        with pytest.raises(OutcomeUnknown):
            await c.sell(SALE, deadline_s=0.3)
        assert stand_in.requests > 1
        with pytest.raises(ValueError, match="deadline_s"):
            await c.sell(SALE, deadline_s=0)
        requests = stand_in.requests
        with pytest.raises(OutcomeUnknown) as once:
            await c.sell(SALE, deadline_s=0.01)  # time for one attempt only: it is made
        assert (once.value.attempts, stand_in.requests) == (1, requests + 1)


async def test_an_encoded_slash_stays_in_its_segment(live: ServiceProcess) -> None:
    """GET /v1/tickets/X%2Fcancel is the ticket "X/cancel" (an invalid id: 422), not the
    cancel route of X; a lone surrogate is refused before anything is sent."""
    async with Client(live.base_url, TOKENS["fr"]) as c:
        with pytest.raises(ValidationError) as bad:
            await c.ticket("X/cancel")
        assert (bad.value.status, bad.value.code) == (422, "invalid_request")
        with pytest.raises(ValidationError):
            await c.ticket("\ud800")


async def test_sse_events_with_cr_line_ends_and_a_bom() -> None:
    for text in (b'event: a\rid: 1-0\rdata: {}\r\r',
                 b'\xef\xbb\xbfevent: a\nid: 1-0\ndata: {}\n\n',
                 b'\xef\xbb\xbfevent: a\r\nid: 1-0\r\ndata: {}\r\n\r\n'):
        for size in (1, 2, 5, len(text)):
            async def chunks(text: bytes = text, size: int = size) -> AsyncIterator[bytes]:
                for i in range(0, len(text), size):
                    yield text[i:i + size]

            assert [e async for e in sse_events(chunks())] == [("a", "1-0", "{}")], (text, size)
