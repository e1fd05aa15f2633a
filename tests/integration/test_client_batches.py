"""capsvc.client's batches of concurrent sales: one caller's problem is nobody else's, and
no decision is dropped.

- a refusal of a batch as a whole (its body above the service's limit, more tickets than
  its `max_batch`) says nothing of its tickets: they are sent again in smaller batches,
  and the client keeps to the limits it learnt; a ticket refused on its own gets its own
  error, the others their decisions;
- a ticket that cannot be sent (not Unicode, a wrong type in a `TicketIn` built by hand) is
  its own `ValidationError`, found before anything is sent;
- a client used without `async with` says so at once; a 500 on a sale is an unknown
  outcome, sent again; a caller cancelled before its sale left withdraws it;
- closing (`aclose()`, `SyncClient.close()`) leaves no task pending or unread.

Against real services (one with the default limits, one with small ones), and a stand-in
HTTP server where the test writes the answers.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web

from capsvc.client import (
    Client,
    GridIn,
    NotFoundError,
    OutcomeUnknown,
    ServiceError,
    SyncClient,
    TicketIn,
    TicketOut,
    UsageError,
    ValidationError,
)
from capsvc.client.api import MAX_BATCH
from capsvc.config import ConfigError, parse_settings
from tests.conftest import CONFIG, TOKENS, ticket
from tests.support.http_faults import HttpFaultProxy, request
from tests.support.service import served

ENDS_S = 30.0
"""What "at once" is bounded by: far below the deadlines of the calls that must end at once
(an hour), far above a loaded machine's delays."""
FOREVER_S = 3600.0
SMALL_LIMITS = """
[server]
max_body_bytes = 16384
max_batch = 16
"""
"""A service whose limits are below the client's defaults (64 KiB, 64 tickets)."""


@pytest.fixture(scope="module")
def live() -> Iterator[str]:
    with served(str(CONFIG)) as service:
        yield service.base_url


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = tmp_path_factory.mktemp("small") / "capsvc.toml"
    config.write_text(CONFIG.read_text().replace("[server]\n", SMALL_LIMITS.lstrip(), 1))
    with served(str(config)) as service:
        yield service.base_url


def twenty_grids(draw: int) -> dict[str, Any]:
    """A valid ticket of 20 grids of 10 numbers (about 1.4 KB), each grid its own."""
    grids = [{"numbers": sorted({(i * 10 + k * 7) % 70 + 1 for k in range(10)}),
              "stake": 100} for i in range(20)]
    return ticket(grids, first_draw=draw)


def small_ticket(draw: int) -> dict[str, Any]:
    return ticket([{"numbers": [1, 2, 3, 4], "stake": 100}], first_draw=draw)


async def decided(c: Client, results: list[Any]) -> None:
    """Each result is a decision, the one the service keeps for its ticket."""
    for r in results:
        assert isinstance(r, TicketOut), r
        assert (await c.ticket(r.ticket_id)).receipt == r.receipt


async def refused_whole(c: Client, status: int) -> float:
    """Batches the service answered `status` as a whole (its request metrics)."""
    assert c._session is not None
    async with c._session.get(c.base_url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("capsvc_http_request_duration_seconds_count{")
               and 'route="/v1/ticket-batches"' in line and f'status="{status}"' in line)


async def test_batches_keep_below_the_body_limit(live: str) -> None:
    """64 concurrent sales of 20-grid tickets (90 KB together, above the 64 KiB limit):
    every one decided, and no request refused as too large (the client sizes its batches
    by bytes as well as by count)."""
    async with Client(live, TOKENS["fr"], batch_linger_s=0.5) as c:
        draw = (await c.current_draw("fdj-keno")).draw
        before = await refused_whole(c, 413)
        results = await asyncio.gather(*[c.sell(twenty_grids(draw)) for _ in range(64)],
                                       return_exceptions=True)
        await decided(c, results)
        assert await refused_whole(c, 413) == before


async def test_a_batch_refused_as_too_large_is_sent_again_in_smaller_ones(small: str) -> None:
    """A service whose body limit (16 KiB) is below the client's: the first batch is
    refused as a whole, its tickets are sent again in batches that fit, each is decided;
    the client keeps to the limit it learnt (the next sales: no refusal)."""
    async with Client(small, TOKENS["fr"], batch_linger_s=0.5) as c:
        draw = (await c.current_draw("fdj-keno")).draw
        results = await c.sell_many([twenty_grids(draw) for _ in range(64)])
        await decided(c, results)
        refused = await refused_whole(c, 413)
        assert refused >= 1
        results = await c.sell_many([twenty_grids(draw) for _ in range(64)])
        await decided(c, results)
        assert await refused_whole(c, 413) == refused


async def test_one_ticket_too_large_is_refused_alone_the_others_decided(small: str) -> None:
    """63 small valid tickets and one of 12 KB that breaks the game's rules: together above
    the service's body limit. The 63 are decided; the large one gets its own refusal."""
    async with Client(small, TOKENS["fr"], batch_linger_s=0.5) as c:
        draw = (await c.current_draw("fdj-keno")).draw
        large = ticket([{"numbers": list(range(10**9, 10**9 + 100)), "stake": 100}] * 10,
                       first_draw=draw)
        assert 10_000 < len(msgspec.json.encode(large)) < 16_384
        results = await c.sell_many([*(small_ticket(draw) for _ in range(63)), large])
        await decided(c, results[:63])
        assert isinstance(results[63], ValidationError)
        assert results[63].status == 422
        with pytest.raises(NotFoundError):
            await c.ticket(large["ticket_id"])


@pytest.mark.parametrize("batch_size", [64, 300])
async def test_more_tickets_than_the_services_max_batch_are_sent_in_smaller_batches(
        small: str, batch_size: int) -> None:
    """A service taking 16 tickets a batch, clients batching 64 (the default) and 300: the
    first batch is refused as a whole, every sale is decided, and the client keeps to at
    most what was taken (the next sales: no refusal)."""
    async with Client(small, TOKENS["fr"], batch_size=batch_size, batch_linger_s=0.5) as c:
        draw = (await c.current_draw("fdj-keno")).draw
        results = await c.sell_many([small_ticket(draw) for _ in range(batch_size)])
        await decided(c, results)
        refused = await refused_whole(c, 422)
        results = await c.sell_many([small_ticket(draw) for _ in range(64)])
        await decided(c, results)
        assert await refused_whole(c, 422) == refused


def test_a_batch_size_no_service_takes_is_refused_at_once() -> None:
    """A batch size above the most any service can be configured to take is a UsageError
    when the client is made; that most is the configuration's."""
    with pytest.raises(UsageError):
        Client("http://127.0.0.1:9", "t", batch_size=MAX_BATCH + 1)
    Client("http://127.0.0.1:9", "t", batch_size=MAX_BATCH)
    doc = {"server": {"max_batch": MAX_BATCH},
           "games": [{"id": "g", "preset": "fdj-keno-2008"}],
           "channels": [{"id": "c", "token_sha256": "0" * 64, "games": ["g"],
                         "scopes": ["sell"]}]}
    assert parse_settings(doc).max_batch == MAX_BATCH
    with pytest.raises(ConfigError):
        parse_settings({**doc, "server": {"max_batch": MAX_BATCH + 1}})


@pytest.mark.parametrize("batch_size", [1, 64])
async def test_a_ticket_that_cannot_be_sent_is_its_own_error_the_others_decided(
        live: str, batch_size: int) -> None:
    """A game with a lone surrogate (UTF-8 cannot carry it) and `TicketIn`s built by hand
    with a value of no JSON type and a stake of the wrong type: each its ValidationError
    with its path, nothing of it sent; the other tickets of the call their decisions."""
    async with Client(live, TOKENS["fr"], batch_size=batch_size) as c:
        draw = (await c.current_draw("fdj-keno")).draw
        good = [small_ticket(draw) for _ in range(3)]
        surrogate = dict(small_ticket(draw), game="fdj-keno\ud800")
        no_json = TicketIn(ticket_id=f"H-{uuid.uuid4().hex[:8]}", game="fdj-keno",
                           grids=[GridIn(numbers=[1, 2, 3, 4], stake=object())])  # type: ignore[arg-type]
        wrong = TicketIn(ticket_id=f"H-{uuid.uuid4().hex[:8]}", game="fdj-keno",
                         grids=[GridIn(numbers=[1, 2, 3, 4], stake="100")])  # type: ignore[arg-type]
        results = await c.sell_many([good[0], surrogate, good[1], no_json, wrong, good[2]])
        await decided(c, [results[0], results[2], results[5]])
        paths = []
        for r in (results[1], results[3], results[4]):
            assert isinstance(r, ValidationError), r
            assert (r.status, r.code) == (422, "invalid_request")
            paths.append(r.path)
        assert paths == ["$.game", "$.grids[0].stake", "$.grids[0].stake"]
        for t in (no_json, wrong):
            with pytest.raises(NotFoundError):
                await c.ticket(t.ticket_id)


Logged = Callable[[], list[str]]


@pytest.fixture
def asyncio_errors(caplog: pytest.LogCaptureFixture) -> Logged:
    """What asyncio has logged (a task's exception never retrieved, a task destroyed while
    pending), once what is left is collected."""
    def logged() -> list[str]:
        gc.collect()
        return [r.getMessage() for r in caplog.records if r.name == "asyncio"]

    return logged


@pytest.mark.parametrize("batch_size", [1, 64])
async def test_a_client_used_without_async_with_says_so_at_once(
        live: str, batch_size: int, asyncio_errors: Logged) -> None:
    """No `async with`: a sale is a UsageError at once (not OutcomeUnknown at its
    deadline), and nothing is left unread in a background task."""
    c = Client(live, TOKENS["fr"], batch_size=batch_size)
    with pytest.raises(UsageError):
        await asyncio.wait_for(c.sell(small_ticket(1), deadline_s=FOREVER_S), ENDS_S)
    results = await asyncio.wait_for(
        c.sell_many([small_ticket(1) for _ in range(3)], deadline_s=FOREVER_S), ENDS_S)
    assert all(isinstance(r, UsageError) for r in results)
    await asyncio.sleep(0)
    assert asyncio_errors() == []


class StandIn:
    """An HTTP server answering what the test's `handler` says, keeping each request's
    path and body."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bytes]] = []
        self.handler: Any = None
        self.url = ""

    async def handle(self, req: web.Request) -> web.StreamResponse:
        self.seen.append((req.path, await req.read()))
        result: web.StreamResponse = await self.handler(req)
        return result


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


DECISION = {"ticket_id": "F-1", "game": "fdj-keno", "status": "accepted", "draws": [1],
            "grids": [{"index": 0, "numbers": [1, 2, 3, 4], "status": "accepted",
                       "cost": 100}],
            "total_cost": 100, "receipt": {"receipt_id": "r", "issued_at": "t"}}
INTERNAL = {"error": {"code": "internal", "message": "internal error", "path": None}}


@pytest.mark.parametrize("batch_size", [1, 64])
async def test_a_500_on_a_sale_is_an_unknown_outcome_sent_again(
        stand_in: StandIn, batch_size: int) -> None:
    """Two 500s, then the decision: the sale is sent again, the same body each time, and
    returns the decision; 500s until the deadline: OutcomeUnknown. A 500 to a request that
    decides nothing is a ServiceError at once."""
    answers = iter([500, 500, 200])

    async def flaky(req: web.Request) -> web.Response:
        status = next(answers, 500)
        return web.json_response(DECISION if status == 200 else INTERNAL, status=status)

    stand_in.handler = flaky
    sale = {"ticket_id": "F-1", "game": "fdj-keno",
            "grids": [{"numbers": [1, 2, 3, 4], "stake": 100}]}
    async with Client(stand_in.url, "t", batch_size=batch_size, backoff_s=0.001) as c:
        sold = await c.sell(sale, deadline_s=FOREVER_S)
        assert sold.status == "accepted"
        assert [p for p, _ in stand_in.seen] == ["/v1/tickets"] * 3
        assert len({b for _, b in stand_in.seen}) == 1
        with pytest.raises(OutcomeUnknown) as unknown:
            await c.sell(sale, deadline_s=0.3)
        assert unknown.value.last == "HTTP 500"
        seen = len(stand_in.seen)
        with pytest.raises(ServiceError):
            await c.current_draw("fdj-keno")
        assert len(stand_in.seen) == seen + 1


async def test_a_caller_cancelled_before_its_sale_left_withdraws_it(live: str) -> None:
    """A sale waiting in the next batch, its caller cancelled: it leaves that batch, and
    nothing of it is sent (the batch leaves full without it: its ticket was never
    counted)."""
    async with Client(live, TOKENS["fr"], batch_size=2, batch_linger_s=FOREVER_S) as c:
        draw = (await c.current_draw("fdj-keno")).draw
        withdrawn = small_ticket(draw)
        selling = asyncio.create_task(c.sell(withdrawn))
        await asyncio.sleep(0)  # its first step: in the next batch, waiting
        assert c._batch
        selling.cancel()
        with pytest.raises(asyncio.CancelledError):
            await selling
        results = await asyncio.wait_for(
            c.sell_many([small_ticket(draw), small_ticket(draw)]), ENDS_S)
        await decided(c, results)
        with pytest.raises(NotFoundError):
            await c.ticket(withdrawn["ticket_id"])


@pytest.mark.parametrize("batch_size", [1, 64])
async def test_a_caller_cancelled_once_its_sale_left_has_an_unknown_outcome(
        live: str, batch_size: int) -> None:
    """A sale sent, its answer late, its caller cancelled: the service decides it all the
    same, in both modes; the same ticket sent again answers that decision (a replay)."""
    host, port = live.removeprefix("http://").split(":")
    with HttpFaultProxy(host, int(port)) as proxy:
        async with Client(proxy.url, TOKENS["fr"], batch_size=batch_size) as c:
            draw = (await c.current_draw("fdj-keno")).draw
            body = small_ticket(draw)
            late = proxy.delay_response(request("POST", "/v1/tickets"), FOREVER_S)
            selling = asyncio.create_task(c.sell(body))
            assert await asyncio.to_thread(late.fired.wait, ENDS_S)  # the service answered
            selling.cancel()
            with pytest.raises(asyncio.CancelledError):
                await selling
            proxy.calm()
            again = await c.sell(body)
            assert again.status == "accepted"
            assert (await c.ticket(body["ticket_id"])).receipt == again.receipt


async def test_closing_with_a_batch_waiting_sends_nothing_and_leaves_nothing_unread(
        stand_in: StandIn, asyncio_errors: Logged) -> None:
    """A sale waiting in the next batch as the client closes, then the caller's session:
    the sale ends (OutcomeUnknown), nothing is sent after the close, and no task is left
    with an exception unread. A session closed by its owner: ClientClosed, nothing sent."""
    stand_in.handler = None  # no request may come
    async with aiohttp.ClientSession() as session:
        c = Client(stand_in.url, "t", session=session, batch_linger_s=0.05)
        selling = asyncio.create_task(c.sell(small_ticket(1), deadline_s=FOREVER_S))
        await asyncio.sleep(0)  # its first step: in the next batch, waiting
        assert c._batch
        await c.aclose()
        with pytest.raises(OutcomeUnknown):
            await asyncio.wait_for(selling, ENDS_S)
    await asyncio.sleep(0.2)  # well past the linger
    assert stand_in.seen == []
    assert asyncio_errors() == []
    async with aiohttp.ClientSession() as session:
        c = Client(stand_in.url, "t", session=session)
    with pytest.raises(UsageError):
        await asyncio.wait_for(c.sell(small_ticket(1), deadline_s=FOREVER_S), ENDS_S)
    assert stand_in.seen == []


def test_closing_the_blocking_client_during_sales_leaves_no_task_behind(
        live: str, asyncio_errors: Logged) -> None:
    """Threads selling without a pause while another closes the client, again and again:
    every sale ends (decided, OutcomeUnknown or ClientClosed) and the client's loop
    closes with no task pending or unread."""
    with SyncClient(live, TOKENS["fr"]) as first:
        draw = first.current_draw("fdj-keno").draw
    for _ in range(20):
        c = SyncClient(live, TOKENS["fr"])
        stop = threading.Event()
        sold = threading.Semaphore(0)
        ends: list[str] = []

        def sell(c: SyncClient = c, stop: threading.Event = stop,
                 sold: threading.Semaphore = sold, ends: list[str] = ends) -> None:
            while not stop.is_set():
                try:
                    c.sell(small_ticket(draw))
                    sold.release()
                except (OutcomeUnknown, UsageError) as e:
                    ends.append(type(e).__name__)

        threads = [threading.Thread(target=sell) for _ in range(8)]
        for t in threads:
            t.start()
        assert sold.acquire(timeout=ENDS_S)  # sales under way
        c.close()
        stop.set()
        for t in threads:
            t.join(ENDS_S)
            assert not t.is_alive()
        assert ends
    assert asyncio_errors() == []
