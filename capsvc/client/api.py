"""`Client` and `SyncClient`: every route of the API as a typed method (see the package's
docstring for the retry rules)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import email.utils
import functools
import inspect
import random
import re
import threading
import time
import uuid
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
    Sequence,
)
from dataclasses import dataclass
from typing import (
    Any,
    Concatenate,
    Generic,
    ParamSpec,
    TypedDict,
    TypeVar,
    Unpack,
    overload,
)
from urllib.parse import quote

import aiohttp
import msgspec
import yarl

from capsvc.client.errors import (
    AnswerError,
    CapsvcError,
    ClientClosed,
    OutcomeUnknown,
    Unavailable,
    UsageError,
    ValidationError,
    error_for,
)
from capsvc.client.models import (
    AvailabilityIn,
    AvailabilityOut,
    CancelOut,
    CappedOut,
    CombinationOut,
    CurrentDrawOut,
    DrawOut,
    ErrorOut,
    GamesOut,
    LimitIn,
    PlayerOut,
    StakeIn,
    StakeOut,
    TicketIn,
    TicketOut,
)
from capsvc.client.reports import DrawReport

T = TypeVar("T")
P = ParamSpec("P")

_NOT_ENTERED = "use the client as `async with Client(…) as client`: nothing was sent"
_CLOSING = "capsvc.client: closed"
"""The message of the cancellation aclose() sends to the calls in flight."""
_FEED_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=45)
"""A feed's connection: no end, but a heartbeat every 15 s (45 s without one: dead)."""
_CLOSE_S = 5.0
"""How long a closing SyncClient waits for its calls in flight to end."""
_LAST_ATTEMPT_S = 0.05
"""Less time than this left before the deadline: no attempt is worth starting."""
RETRIED = frozenset({502, 503, 504})
"""Statuses after which the outcome is unknown and the same request is sent again."""
_UNDECIDED = RETRIED | {500}
"""The same for a request that decides (a sale, a cancel, a stake): a 500 on it is a bug of
the service that may have struck after the decision, so its outcome is unknown too."""
MAX_BATCH = 8192
"""The most tickets any service takes in one batch (its `[server] max_batch` is at most
this): a larger `batch_size` is refused at once."""
_BODY_BYTES = 64 * 1024
"""The body limit of a service unless its configuration says otherwise (`[server]
max_body_bytes`): a batch's body stays within it until a refusal says the service's is
lower."""
_FRAME = len(b'{"tickets":[]}')
"""A batch's body but its tickets (and the commas between them)."""
_error = msgspec.json.Decoder(ErrorOut).decode


@dataclass(frozen=True, slots=True)
class FeedEvent:
    """One event of the sold-out feed."""

    kind: str
    """snapshot, capped, reopened or closed."""
    id: str
    """Its id: what `Last-Event-ID` resumes after."""
    data: Any
    """Its JSON data (docs/api.md, the feed)."""


class _Closed(Exception):
    """The client was closed while a call waited on the service."""


class _Retry(Exception):
    """An attempt that got no decision: wait, then send the same request again."""

    def __init__(self, what: str, after_s: float = 0.0) -> None:
        super().__init__(what)
        self.what = what
        self.after_s = after_s


class Client:
    """capsvc over HTTP, async (aiohttp): `async with Client(url, token) as c: …`."""

    def __init__(self, base_url: str, token: str, *, timeout_s: float = 5.0,
                 deadline_s: float = 30.0, backoff_s: float = 0.05, max_backoff_s: float = 2.0,
                 connections: int = 100, session: aiohttp.ClientSession | None = None,
                 batch_size: int = 64, batch_linger_s: float = 0.001) -> None:
        if not 1 <= batch_size <= MAX_BATCH or batch_linger_s < 0:
            raise UsageError(f"batch_size must be 1 to {MAX_BATCH} (no service takes more "
                             f"tickets at once), and batch_linger_s not negative")
        self.base_url = base_url.rstrip("/")
        self.batch_size = batch_size
        """The most tickets of concurrent `sell` calls sent in one POST /v1/ticket-batches
        (1: each sale on its own, POST /v1/tickets). A sale that no other joined within the
        linger goes alone, as POST /v1/tickets."""
        self.batch_linger_s = batch_linger_s
        """How long the first sale of a batch waits for others to join it (at most 1 ms
        by default: a lone sale is that much later, concurrent ones share a request)."""
        self._batch: list[_Queued] = []
        self._batch_bytes = _FRAME
        """The body the next batch would be sent with, in bytes."""
        self._batch_timer: asyncio.TimerHandle | None = None
        self._max_tickets = batch_size
        """The most tickets a batch is sent with: `batch_size`, lowered when the service
        refuses a batch for its number of tickets (its `max_batch` is lower)."""
        self._max_bytes = _BODY_BYTES
        """The largest body a batch is sent with, lowered when the service refuses one as
        too large (its body limit is lower)."""
        self.timeout_s = timeout_s
        """One attempt's timeout (a timeout is an unknown outcome: sent again)."""
        self.deadline_s = deadline_s
        """How long `sell` and `cancel` keep trying, unless the call says otherwise."""
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._headers = {"Authorization": f"Bearer {token}"}
        self._connections = connections
        self._session = session
        self._own_session = session is None
        self._closed = asyncio.Event()
        """Set by aclose(): calls in flight stop (a decision's is then OutcomeUnknown)."""
        self._calls: set[asyncio.Task[Any]] = set()
        """The tasks waiting on the service in one of this client's calls right now."""
        self._batches: set[asyncio.Task[None]] = set()
        """Batches sent and not answered yet."""

    async def __aenter__(self) -> Client:
        self._closed = asyncio.Event()  # bound to the loop it is used in
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._connections))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the client: calls in flight end at once (a sale or a cancel whose outcome
        is then unknown raises OutcomeUnknown), and the pool, if the client made it."""
        self._closed.set()
        if self._batch_timer is not None:
            self._batch_timer.cancel()
            self._batch_timer = None
        queued, self._batch, self._batch_bytes = self._batch, [], _FRAME
        _fail(queued, _Retry("the client was closed"))  # never sent
        for task in self._calls - {asyncio.current_task()}:
            task.cancel(_CLOSING)
        for batch in self._batches:  # their sales' calls end above
            batch.cancel()
        if self._session is not None and self._own_session:
            await self._session.close()
            self._session = None

    @contextlib.contextmanager
    def _in_flight(self) -> Iterator[None]:
        """While the calling task waits on the service: aclose() cancels it, and that
        cancellation (none other) comes out as `_Closed`; so does a wait begun once
        aclose() has run (a feed's next event asked after the close)."""
        if self._closed.is_set():
            raise _Closed
        task = asyncio.current_task()
        assert task is not None
        self._calls.add(task)
        try:
            yield
        except asyncio.CancelledError as e:
            if e.args == (_CLOSING,) and self._closed.is_set():
                task.uncancel()
                raise _Closed from None
            raise
        finally:
            self._calls.discard(task)

    # -- tickets -------------------------------------------------------------------------

    async def sell(self, ticket: TicketIn | dict[str, Any], *, deadline_s: float | None = None,
                   request_id: str | None = None) -> TicketOut:
        """Sell a ticket: its decision (accepted, partial or rejected, each grid's reason),
        or a typed error for a 4xx; `OutcomeUnknown` if no decision came in time. A ticket
        the service would refuse for its form (a wrong type, a text that is not Unicode) is
        the `ValidationError` it would answer, and nothing is sent."""
        t, body = _ticket(ticket)
        return await self._until_decided(
            t.ticket_id, "POST", "/v1/tickets", TicketOut, body, deadline_s, request_id,
            functools.partial(self._batched, t.ticket_id) if self.batch_size > 1 else None)

    async def sell_many(self, tickets: Sequence[TicketIn | dict[str, Any]], *,
                        deadline_s: float | None = None
                        ) -> list[TicketOut | CapsvcError]:
        """Sell several tickets at once (in batches of `batch_size`): each one's decision,
        typed error or OutcomeUnknown, in order, each retried on its own as `sell` is (a
        ticket that cannot be sent has its `ValidationError`, the others their decisions)."""
        results = await asyncio.gather(*[self.sell(t, deadline_s=deadline_s) for t in tickets],
                                       return_exceptions=True)
        out: list[TicketOut | CapsvcError] = []
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, CapsvcError):
                raise r
            out.append(r)
        return out

    # -- batches of concurrent sales -------------------------------------------------------

    async def _batched(self, ticket_id: str, body: bytes, timeout_s: float, request_id: str
                       ) -> _Exchanged:
        """One attempt of a sale, as a ticket of the next POST /v1/ticket-batches: what the
        service answered for it (the status and body POST /v1/tickets would have). An
        attempt that ends before its batch has left (its caller cancelled, its timeout) is
        withdrawn from it: that ticket is not sent."""
        loop = asyncio.get_running_loop()
        if any(tid == ticket_id for tid, _, _, _ in self._batch):
            self._send_batch()  # a ticket id once a batch: the batch before goes first
        if self._batch and self._batch_bytes + len(body) + 1 > self._max_bytes:
            self._send_batch()  # it would not fit: the batch goes as it is
        answer: asyncio.Future[_Exchanged] = loop.create_future()
        # Retrieved even when this attempt gave up waiting (its timeout, the client closed).
        answer.add_done_callback(lambda f: f.cancelled() or f.exception())
        queued = (ticket_id, body, request_id, answer)
        self._batch.append(queued)
        self._batch_bytes += len(body) + (len(self._batch) > 1)
        if len(self._batch) >= self._max_tickets or self._batch_bytes >= self._max_bytes:
            self._send_batch()
        elif self._batch_timer is None:
            self._batch_timer = loop.call_later(self.batch_linger_s, self._send_batch)
        try:
            return await asyncio.wait_for(asyncio.shield(answer), timeout_s)
        except TimeoutError:
            self._withdraw(queued)
            raise _Retry("timed out") from None
        except asyncio.CancelledError:
            self._withdraw(queued)
            raise

    def _withdraw(self, queued: _Queued) -> None:
        """An attempt no one waits for any more: out of the next batch if it is still there,
        and out of a batch sent again after a refusal of the whole request."""
        queued[3].cancel()
        if queued in self._batch:
            self._batch.remove(queued)
            self._batch_bytes = _FRAME + sum(len(b) + 1 for _, b, _, _ in self._batch) - (
                1 if self._batch else 0)
            if not self._batch and self._batch_timer is not None:
                self._batch_timer.cancel()
                self._batch_timer = None

    def _send_batch(self) -> None:
        if self._batch_timer is not None:
            self._batch_timer.cancel()
            self._batch_timer = None
        batch, self._batch, self._batch_bytes = self._batch, [], _FRAME
        if not batch:
            return
        if self._closed.is_set():  # the callers end as the close says
            _fail(batch, _Retry("the client was closed"))
            return
        task = asyncio.get_running_loop().create_task(self._post_batch(batch))
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

    async def _post_batch(self, batch: list[_Queued]) -> None:
        """Send the batch: each ticket's future gets its result, or the failure of the
        request that carried it."""
        try:
            await self._deliver(batch)
        except asyncio.CancelledError:
            _fail(batch, _Retry("the client was closed"))
            raise

    async def _deliver(self, batch: list[_Queued]) -> None:
        """Send these tickets, and give each its result; the failure of a whole request (a
        broken connection, a timeout, a 503) is each of its tickets' (each sent again by its
        call). A refusal of a batch as a whole (too large, too many tickets) says nothing of
        its tickets: they are sent again at once, in smaller batches, down to one ticket a
        request (POST /v1/tickets, whose answer is that ticket's own), but for those whose
        callers stopped waiting (nothing of theirs was counted)."""
        batch = [q for q in batch if not q[3].done()]  # withdrawn since it was made up
        if not batch:
            return
        try:
            results = await self._results(batch)
        except _Retry as e:
            _fail(batch, e)
            return
        except (msgspec.DecodeError, msgspec.ValidationError):
            _fail(batch, _Retry("a batch's unreadable answer"))
            return
        except Exception as e:  # the client used as it cannot be (no session), or a bug:
            _fail(batch, e)   # each call raises it at once, none waits for its deadline
            return
        if results is None:
            waiting = [q for q in batch if not q[3].done()]
            await asyncio.gather(*[self._deliver(part) for part in self._parts(waiting)])
            return
        for (_, _, _, answer), result in zip(batch, results, strict=True):
            if not answer.done():
                answer.set_result(result)

    async def _results(self, batch: list[_Queued]) -> list[_Exchanged] | None:
        """What the service answered for each ticket of the batch: a lone ticket as POST
        /v1/tickets (with its attempt's request id), several as POST /v1/ticket-batches;
        None when the service refused the batch as a whole for what it is (a 4xx but the
        token's 401 and 403, which are every ticket's answer): what it says of the
        service's limits is learnt."""
        if len(batch) == 1:
            _, body, request_id, _ = batch[0]
            return [await self._exchange("POST", "/v1/tickets", body, self.timeout_s,
                                         request_id)]
        body = b'{"tickets":[' + b",".join(b for _, b, _, _ in batch) + b"]}"
        whole = await self._exchange(
            "POST", "/v1/ticket-batches", body, self.timeout_s, uuid.uuid4().hex)
        if 400 <= whole.status < 500 and whole.status not in (401, 403):
            if whole.status == 413:  # the service's body limit is below this body
                self._max_bytes = min(self._max_bytes, max(len(body) // 2, 1))
            elif whole.status == 422 and _failure(whole.status, whole.raw).path == "$.tickets":
                # Not a list of 1 to max_batch tickets: its max_batch is below this count.
                self._max_tickets = min(self._max_tickets, max(len(batch) // 2, 1))
            return None
        if whole.status != 200:  # the whole request answered as each ticket would be
            return [whole] * len(batch)
        items = _batch_decoder.decode(whole.raw).results
        if len(items) != len(batch):
            raise _Retry("a batch answered with another number of results")
        return [_Exchanged(r.status, bytes(r.body), whole.retry_after) for r in items]

    def _parts(self, batch: list[_Queued]) -> list[list[_Queued]]:
        """A refused batch's tickets in smaller batches: within the limits learnt, and in
        two halves at least."""
        parts: list[list[_Queued]] = []
        part: list[_Queued] = []
        size = _FRAME
        for queued in batch:
            if part and (len(part) >= self._max_tickets
                         or size + len(queued[1]) + 1 > self._max_bytes):
                parts.append(part)
                part, size = [], _FRAME
            part.append(queued)
            size += len(queued[1]) + 1
        if part:
            parts.append(part)
        if len(parts) == 1 and len(batch) > 1:
            half = len(batch) // 2
            return [batch[:half], batch[half:]]
        return parts

    async def ticket(self, ticket_id: str, *, deadline_s: float | None = None,
                     request_id: str | None = None) -> TicketOut:
        """The decision stored for a ticket of this channel (with `cancelled` once it is)."""
        return await self._until_decided(ticket_id, "GET", f"/v1/tickets/{_seg(ticket_id)}",
                                         TicketOut, None, deadline_s, request_id)

    async def cancel(self, ticket_id: str, *, deadline_s: float | None = None,
                     request_id: str | None = None) -> CancelOut:
        """Cancel a ticket (released exactly once, however many times it is sent)."""
        return await self._until_decided(
            ticket_id, "POST", f"/v1/tickets/{_seg(ticket_id)}/cancel", CancelOut, None,
            deadline_s, request_id)

    # -- games, draws, availability --------------------------------------------------------

    async def games(self) -> GamesOut:
        return await self._read("GET", "/v1/games", GamesOut)

    async def current_draw(self, game: str) -> CurrentDrawOut:
        return await self._read("GET", f"/v1/games/{_seg(game)}/draws/current", CurrentDrawOut)

    async def draw(self, game: str, draw: int) -> DrawOut:
        return await self._read("GET", f"/v1/games/{_seg(game)}/draws/{int(draw)}", DrawOut)

    async def combination(self, game: str, draw: int, numbers: list[int]) -> CombinationOut:
        """How much a combination has staked on a draw, and whether it can still be played."""
        joined = "-".join(str(int(n)) for n in numbers)
        return await self._read(
            "GET", f"/v1/games/{_seg(game)}/draws/{int(draw)}/combinations/{joined}",
            CombinationOut)

    async def availability(self, game: str, request: AvailabilityIn | dict[str, Any]
                           ) -> AvailabilityOut:
        """Whether grids could be sold (advisory: counts nothing)."""
        r = _as(request, AvailabilityIn)
        return await self._read("POST", f"/v1/games/{_seg(game)}/availability",
                                AvailabilityOut, msgspec.json.encode(r))

    async def capped(self, game: str, draw: int) -> CappedOut:
        """The combinations at their cap on a draw (the sold-out list)."""
        return await self._read("GET", f"/v1/games/{_seg(game)}/draws/{int(draw)}/capped",
                                CappedOut)

    async def capped_events(self, game: str, *, draw: int | None = None,
                            last_event_id: str | None = None, max_pause_s: float = 30.0
                            ) -> AsyncGenerator[FeedEvent, None]:
        """The live sold-out feed (`snapshot`, then `capped`, `reopened`, `closed` events),
        for ever: a dropped connection or a restarted service is reconnected to with
        `Last-Event-ID`, so the events resume after the last one yielded (the service sends
        what was missed, or a fresh `snapshot` when it no longer keeps that point). A 4xx
        raises its error."""
        session = self._session
        if session is None:
            raise UsageError("use the client as `async with Client(…) as client`")
        query = "" if draw is None else f"?draw={int(draw)}"
        url = yarl.URL(f"{self.base_url}/v1/games/{_seg(game)}/capped/stream{query}",
                       encoded=True)
        last, pause = last_event_id, self.backoff_s
        while not self._closed.is_set():
            events = self._feed(session, url, last)
            try:
                while True:
                    with self._in_flight():
                        event = await anext(events)
                    pause = self.backoff_s
                    last = event.id or last
                    yield event
            except (StopAsyncIteration, TimeoutError, aiohttp.ClientError,
                    msgspec.DecodeError):
                pass  # the end, a cut, a stall, an event not the service's: resume
            except _Closed:
                return
            finally:
                await events.aclose()
            try:
                with self._in_flight():
                    await asyncio.sleep(random.uniform(0, pause))
            except _Closed:
                return
            pause = min(pause * 2, max_pause_s)

    async def _feed(self, session: aiohttp.ClientSession, url: yarl.URL, last: str | None
                    ) -> AsyncGenerator[FeedEvent, None]:
        """The events of one connection to the feed, from after `last`."""
        headers = dict(self._headers)
        if last is not None:
            headers["Last-Event-ID"] = last
        async with session.get(url, headers=headers, timeout=_FEED_TIMEOUT,
                               raise_for_status=False) as resp:
            if 400 <= resp.status < 500:
                raise _failure(resp.status, await resp.read())
            if resp.status == 200:
                async for kind, event_id, data in sse_events(resp.content.iter_any()):
                    yield FeedEvent(kind, event_id, msgspec.json.decode(data))

    # -- players (games with player limits) ------------------------------------------------

    async def player(self, player_id: str, *, game: str | None = None) -> PlayerOut:
        """The player's day: spent, limits, remaining (`game`: when the channel uses
        several games with player limits)."""
        return await self._read("GET", f"/v1/players/{_seg(player_id)}{_game(game)}",
                                PlayerOut)

    async def set_limit(self, player_id: str, daily: int | None, *, game: str | None = None
                        ) -> PlayerOut:
        """Set (or remove, None) the player's own daily limit: lowering applies at once,
        raising or removing from the next day."""
        return await self._read("PUT", f"/v1/players/{_seg(player_id)}/limit{_game(game)}",
                                PlayerOut, msgspec.json.encode(LimitIn(daily=daily)))

    async def record_stake(self, player_id: str, ref: str, game: str, amount: int, *,
                           limited_game: str | None = None) -> StakeOut:
        """A stake played on another game, against the same daily budget (idempotent by
        `ref`: sent again on an unknown outcome like a sale)."""
        return await self._until_decided(
            ref, "POST", f"/v1/players/{_seg(player_id)}/stakes{_game(limited_game)}",
            StakeOut, msgspec.json.encode(StakeIn(ref=ref, game=game, amount=amount)),
            None, None)

    # -- audit ---------------------------------------------------------------------------

    async def report(self, game: str, draw: int) -> DrawReport:
        """The draw's report (scope read or admin; the one written once the draw is final)."""
        return await self._read("GET", f"/v1/games/{_seg(game)}/draws/{int(draw)}/report",
                                DrawReport)

    # -- the protocol ----------------------------------------------------------------------

    async def _read(self, method: str, path: str, kind: type[T], body: bytes | None = None
                    ) -> T:
        """A request that decides nothing: sent again on a 503 or a broken connection
        within the default deadline, like the others; no answer by then is `Unavailable`."""
        return await self._until_decided(None, method, path, kind, body, None, None)

    async def _until_decided(self, ticket_id: str | None, method: str, path: str, kind: type[T],
                             body: bytes | None, deadline_s: float | None,
                             request_id: str | None, batched: _Batched | None = None) -> T:
        budget = self.deadline_s if deadline_s is None else deadline_s
        if not budget > 0:
            raise UsageError(f"deadline_s must be positive, got {budget}")
        if self._session is None and not self._closed.is_set():
            raise UsageError(_NOT_ENTERED)
        undecided = RETRIED if ticket_id is None else _UNDECIDED
        deadline = time.monotonic() + budget
        attempts, pause, last = 0, self.backoff_s, "no attempt"
        # One id for every attempt of the call: the service's logs show them together.
        request_id = request_id or uuid.uuid4().hex
        while True:
            left = deadline - time.monotonic()
            if self._closed.is_set() and attempts == 0:
                raise ClientClosed("the client is closed: nothing was sent")
            if attempts and (left < _LAST_ATTEMPT_S or self._closed.is_set()):
                if self._closed.is_set():
                    last = f"the client was closed (after: {last})"
                raise _unknown(ticket_id, method, path, attempts, last, request_id)
            attempts += 1
            try:
                with self._in_flight():
                    timeout_s = min(self.timeout_s, max(left, 0.001))
                    if batched is not None and body is not None:
                        answer = await batched(body, timeout_s, request_id)
                    else:
                        answer = await self._exchange(method, path, body, timeout_s,
                                                      request_id)
                    return _judged(answer, kind, undecided)
            except _Closed:
                last = f"the client was closed (during attempt {attempts})"
                raise _unknown(ticket_id, method, path, attempts, last, request_id) from None
            except _Retry as again:
                last = again.what
                left = deadline - time.monotonic()
                if again.after_s >= left:  # the service asks for more time than is left
                    raise _unknown(ticket_id, method, path, attempts, last, request_id) from None
                # Full jitter, but never past the point where one more attempt still fits.
                wait = max(again.after_s, min(random.uniform(0, pause),
                                              left - _LAST_ATTEMPT_S))
                pause = min(pause * 2, self.max_backoff_s)
                if wait > 0:
                    with contextlib.suppress(TimeoutError, _Closed), self._in_flight():
                        await asyncio.sleep(wait)

    async def _exchange(self, method: str, path: str, body: bytes | None, timeout_s: float,
                        request_id: str) -> _Exchanged:
        """One request: its status, body and Retry-After; `_Retry` when nothing came."""
        session = self._session
        if session is None or session.closed:
            if self._closed.is_set():
                raise _Retry("the client was closed")
            if session is None:
                raise UsageError(_NOT_ENTERED)
            raise ClientClosed("the client's session is closed: nothing was sent")
        headers = dict(self._headers)
        if body is not None:
            headers["Content-Type"] = "application/json"
        headers["X-Request-ID"] = request_id
        try:
            # The path as encoded here (yarl would resolve an id "." or ".." away), and no
            # raise_for_status of a caller's session: every status is read below.
            async with session.request(
                    method, yarl.URL(self.base_url + path, encoded=True), data=body,
                    headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s),
                    raise_for_status=False) as resp:
                raw = await resp.read()
                status = resp.status
                retry_after = resp.headers.get("Retry-After", "")
        except TimeoutError:
            raise _Retry("timed out") from None
        except aiohttp.ClientError as e:
            raise _Retry(f"connection: {type(e).__name__}") from None
        return _Exchanged(status, raw, retry_after)


@dataclass(frozen=True, slots=True)
class _Exchanged:
    """What the service answered a request (or, in a batch, for one ticket of it)."""

    status: int
    raw: bytes
    retry_after: str


_Batched = Callable[[bytes, float, str], Awaitable[_Exchanged]]


class _BatchResult(msgspec.Struct):
    status: int
    body: msgspec.Raw


class _BatchOut(msgspec.Struct):
    results: list[_BatchResult]


_batch_decoder = msgspec.json.Decoder(_BatchOut)
_Queued = tuple[str, bytes, str, "asyncio.Future[_Exchanged]"]
"""A sale waiting in the next batch: its ticket id, its body, its attempt's request id, its
result."""


def _fail(batch: list[_Queued], failure: Exception) -> None:
    """Each sale of a batch still waiting: the batch's failure (each is sent again)."""
    for _, _, _, answer in batch:
        if not answer.done():
            answer.set_exception(failure)


def _judged(answer: _Exchanged, kind: type[T], undecided: frozenset[int] = RETRIED) -> T:
    """The decision an answer carries; `_Retry` when its outcome is unknown (a status of
    `undecided`); the typed error of a refusal."""
    status, raw = answer.status, answer.raw
    if status < 300:
        try:
            return msgspec.json.decode(raw, type=kind)
        except (msgspec.DecodeError, msgspec.ValidationError):
            # Not the service's answer (a proxy's page, a cut body): nothing known.
            raise _Retry(f"HTTP {status} with an unreadable body") from None
    if status in undecided:
        raise _Retry(f"HTTP {status}", _retry_after(answer.retry_after))
    failure = _failure(status, raw)
    if failure.code == "ticket_pending":  # interrupted half-way: the janitor decides it
        raise _Retry("HTTP 409 ticket_pending", 0.0)
    raise failure


def _failure(status: int, raw: bytes) -> AnswerError:
    """The typed error of a status and its body (the service's error, or whatever a proxy
    answered instead)."""
    try:
        err = _error(raw).error
        code, message, where = err.code, err.message, err.path
    except (msgspec.DecodeError, msgspec.ValidationError):
        code, message, where = "unexpected", raw[:200].decode(errors="replace"), None
    return error_for(status, code, message, where)


_BOM = b"\xef\xbb\xbf"
_LINE_END = re.compile(rb"\r\n|\r|\n")


async def sse_events(chunks: AsyncIterable[bytes]) -> AsyncIterator[tuple[str, str, str]]:
    """(event type, id, data) of each event of a server-sent event stream, from its bytes
    as they come (lines of any length), each once complete: at the blank line that ends
    it, so an event cut by a broken connection is never yielded. Comments (the feed's
    heartbeat) are skipped; an event's data lines are joined by newlines."""
    buffer, first = b"", True
    kind, event_id = "", ""
    data: list[str] = []
    async for chunk in _then_none(chunks):
        buffer += chunk or b""
        if first:
            if chunk is not None and len(buffer) < 3 and _BOM.startswith(buffer):
                continue
            buffer, first = buffer.removeprefix(_BOM), False
        # A CR at the end may be the first half of a CRLF: kept for the next chunk, if any.
        end = len(buffer) - 1 if buffer.endswith(b"\r") and chunk is not None else len(buffer)
        *lines, rest = _LINE_END.split(buffer[:end])
        buffer = rest + buffer[end:]
        for raw in lines:
            line = raw.decode(errors="replace")
            if not line:
                if kind and data:
                    yield kind, event_id, "\n".join(data)
                kind, event_id, data = "", "", []
            elif line.startswith("event:"):
                kind = line[6:].removeprefix(" ")
            elif line.startswith("id:"):
                event_id = line[3:].removeprefix(" ")
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))


async def _then_none(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes | None]:
    """The chunks, then None: the end of the stream."""
    async for chunk in chunks:
        yield chunk
    yield None


def _seg(text: str) -> str:
    """A path segment, percent-encoded, dots too (an id "." or ".." stays an id)."""
    try:
        return quote(text, safe="").replace(".", "%2E")
    except UnicodeEncodeError:  # a lone surrogate: no such id, game or player
        raise ValidationError(422, "invalid_request", f"{text!r} is not valid text",
                              None) from None


_DELAY_SECONDS = re.compile(r"[0-9]{1,9}")


def _retry_after(value: str) -> float:
    """Seconds a Retry-After asks for: delay-seconds or an HTTP date; 0 when absent or
    unreadable (a proxy's)."""
    value = value.strip()
    if _DELAY_SECONDS.fullmatch(value):
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return 0.0
    if when.tzinfo is None:
        return 0.0
    return max(0.0, when.timestamp() - time.time())


def _game(game: str | None) -> str:
    return "" if game is None else f"?game={_seg(game)}"


def _as(value: Any, kind: type[T]) -> T:
    """A request of `kind`, from itself or a dict of its fields; a dict that does not make
    one is the `ValidationError` the service would answer (nothing is sent)."""
    if isinstance(value, kind):
        return value
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as e:
        message, _, where = str(e).partition(" - at `")
        raise ValidationError(422, "invalid_request", message, where.rstrip("`") or "$"
                              ) from None


def _ticket(value: TicketIn | dict[str, Any]) -> tuple[TicketIn, bytes]:
    """The ticket and the body it is sent as; one that is not a request the service could
    read (a wrong type, even in a `TicketIn` built by hand; a text with a lone surrogate,
    which UTF-8 cannot carry) is the `ValidationError` the service would answer, and
    nothing is sent."""
    t = _as(value, TicketIn)
    try:
        body = msgspec.json.encode(t)
    except (UnicodeEncodeError, TypeError):  # then found, with its path (not walked before:
        odd = _not_json(t, "$")               # a ticket that encodes costs nothing more)
        where, what = odd or ("$", "Expected a JSON value")
        raise ValidationError(422, "invalid_request", what, where) from None
    if value is t:  # built by hand: its fields were never checked
        try:
            msgspec.json.decode(body, type=TicketIn)
        except msgspec.ValidationError as e:
            message, _, where = str(e).partition(" - at `")
            raise ValidationError(422, "invalid_request", message, where.rstrip("`") or "$"
                                  ) from None
    return t, body


def _not_json(value: Any, path: str) -> tuple[str, str] | None:
    """The path of the first value that has no JSON form, and why; None if there is none."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return path, "Expected text, got a lone surrogate (not Unicode)"
        return None
    if value is None or isinstance(value, bool | int | float):
        return None
    items: Iterable[tuple[str, Any]]
    if isinstance(value, msgspec.Struct):
        items = ((f".{f}", getattr(value, f)) for f in value.__struct_fields__)
    elif isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return path, "Expected an object with text keys"
        items = ((f".{k}", v) for k, v in value.items())
    elif isinstance(value, list | tuple):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        return path, f"Expected a JSON value, got `{type(value).__name__}`"
    for step, item in items:
        found = _not_json(item, path + step)
        if found is not None:
            return found
    return None


def _unknown(ticket_id: str | None, method: str, path: str, attempts: int, last: str,
             request_id: str) -> Unavailable:
    if ticket_id is None:
        return Unavailable(f"{method} {path}: no answer after {attempts} attempt(s) ({last})",
                           attempts, last, request_id)
    return OutcomeUnknown(ticket_id, attempts, last, request_id)


class _Blocking(Generic[P, T]):
    """A `SyncClient` method: the `Client` method of the same name, run to its end in the
    client's loop (typed as the async one, without the `await`)."""

    def __init__(self, method: Callable[Concatenate[Client, P], Coroutine[Any, Any, T]]
                 ) -> None:
        self.__doc__ = method.__doc__
        self._name = method.__name__

    @overload
    def __get__(self, obj: None, owner: type[SyncClient]) -> _Blocking[P, T]: ...
    @overload
    def __get__(self, obj: SyncClient, owner: type[SyncClient]) -> Callable[P, T]: ...

    def __get__(self, obj: SyncClient | None, owner: type[SyncClient]
                ) -> _Blocking[P, T] | Callable[P, T]:
        if obj is None:
            return self
        method: Callable[P, Coroutine[Any, Any, T]] = getattr(obj._client, self._name)
        run = obj._run

        def call(*args: P.args, **kwargs: P.kwargs) -> T:
            return run(method(*args, **kwargs))

        call.__doc__ = self.__doc__
        return call


class ClientOptions(TypedDict, total=False):
    """`Client`'s options but its session (their defaults are `Client`'s), as `SyncClient`
    takes them: checked by name and type."""

    timeout_s: float
    deadline_s: float
    backoff_s: float
    max_backoff_s: float
    connections: int
    batch_size: int
    batch_linger_s: float


class SyncClient:
    """The same methods as `Client`, blocking (for scripts): one event loop in a thread of
    its own, one connection pool. `with SyncClient(url, token) as c: c.sell({...})`."""

    def __init__(self, base_url: str, token: str, **options: Unpack[ClientOptions]) -> None:
        """The options are `Client`'s (but its own aiohttp session: the client runs in a
        loop of its own)."""
        self._closing = threading.Lock()
        """Held by close(), so that it runs once whoever calls it."""
        self._lock = threading.Lock()
        self._stopping = False
        self._pending: set[concurrent.futures.Future[Any]] = set()
        """Calls submitted to the loop and not yet answered."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                         name="capsvc-client")
        self._thread.start()
        self._client = Client(base_url, token, **options)
        self._run(self._client.__aenter__())

    def _run(self, step: Awaitable[T]) -> T:
        with self._lock:
            if self._loop.is_closed() or self._stopping:
                if inspect.iscoroutine(step):
                    step.close()  # never to run
                raise ClientClosed("the client is closed: nothing was sent")
            future = asyncio.run_coroutine_threadsafe(_awaited(step), self._loop)
            self._pending.add(future)
        try:
            return future.result()
        finally:
            with self._lock:
                self._pending.discard(future)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the client: calls in flight in other threads end (a sale's or a cancel's
        with OutcomeUnknown), then the loop and its thread. Once, whoever calls it."""
        with self._closing:
            if self._loop.is_closed():
                return
            with self._lock:  # from now on, nothing more is sent to the loop
                self._stopping = True
            # After every call already sent to the loop: each ends there (at once, or
            # cancelled), so that none is left pending or unread when the loop closes.
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result()
            with self._lock:
                stranded = list(self._pending)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()
            for future in stranded:  # submitted as the loop stopped: never to run
                if not future.done():
                    future.set_exception(ClientClosed("the client was closed"))

    async def _shutdown(self) -> None:
        await self._client.aclose()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if others:  # they see the client closed at once; the slowest, cancelled
            _, stuck = await asyncio.wait(others, timeout=_CLOSE_S)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)

    sell = _Blocking(Client.sell)
    sell_many = _Blocking(Client.sell_many)
    ticket = _Blocking(Client.ticket)
    cancel = _Blocking(Client.cancel)
    games = _Blocking(Client.games)
    current_draw = _Blocking(Client.current_draw)
    draw = _Blocking(Client.draw)
    combination = _Blocking(Client.combination)
    availability = _Blocking(Client.availability)
    capped = _Blocking(Client.capped)
    player = _Blocking(Client.player)
    set_limit = _Blocking(Client.set_limit)
    record_stake = _Blocking(Client.record_stake)
    report = _Blocking(Client.report)

    def capped_events(self, game: str, *, draw: int | None = None,
                      last_event_id: str | None = None) -> Iterator[FeedEvent]:
        """The sold-out feed, blocking: each event as it comes (see `Client.capped_events`);
        closing the generator closes the stream."""
        events = self._client.capped_events(game, draw=draw, last_event_id=last_event_id)
        try:
            while True:
                try:
                    event = self._run(anext(events))
                except StopAsyncIteration:  # the client was closed
                    return
                yield event
        finally:
            with contextlib.suppress(RuntimeError):  # the client closed: nothing to close
                self._run(events.aclose())


async def _awaited(step: Awaitable[T]) -> T:
    return await step
