"""The HTTP layer: routes, authentication, decoding, error bodies, health and metrics.

It knows nothing of Redis keys: it decodes requests into the msgspec types, asks the
use-cases, and encodes what they return.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import unquote

import msgspec
from aiohttp import web
from redis.exceptions import ResponseError

from capsvc.audit.reconcile import ExportError
from capsvc.audit.report import to_csv, to_json
from capsvc.client.models import (
    ID_PATTERN,
    MAX_DRAW,
    AvailabilityIn,
    ErrorDetail,
    ErrorOut,
    GameOut,
    GamesOut,
    HealthOut,
    LimitIn,
    StakeIn,
    TicketIn,
    TicketResult,
    TicketsOut,
)
from capsvc.config import ID_RE, Channel, GameRules, Settings
from capsvc.domain.errors import (
    NOTHING_CHANGED,
    OUTCOME_UNKNOWN,
    ApiError,
    Unavailable,
    not_found,
    unavailable,
)
from capsvc.domain.games import require_scope
from capsvc.http.openapi import openapi_document, openapi_text
from capsvc.http.responses import Answer, answer_headers
from capsvc.journal.writer import Journal
from capsvc.ops.metrics import Metrics
from capsvc.redis.durability import Durability
from capsvc.redis.gate import Evicting, Gate
from capsvc.redis.marks import Behind, Marks, Restoring
from capsvc.redis.store import Store
from capsvc.redis.transport import OutOfMemory
from capsvc.service.feed import Subscriber
from capsvc.service.tickets import SaleOutcome
from capsvc.wiring import UseCases

log = logging.getLogger(__name__)

T = TypeVar("T")
Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]

_encode = msgspec.json.encode
_OPENAPI = openapi_text(openapi_document()).encode()
_PATH_RE = re.compile(r" - at `(\$[^`]*)`$")
_FIELD_RE = re.compile(r"^Object (?:missing required|contains unknown) field `([^`]+)`")
_ID_MESSAGE = "expected 1-64 characters of [A-Za-z0-9._:-] (no spaces or control characters)"
_ID_MISMATCH = f"Expected `str` matching regex {ID_PATTERN!r}"
_DRAW_RE = re.compile(r"^-?[0-9]+\Z")
_JSON = "application/json"
_REPLAYED = {"Idempotent-Replayed": "true"}
_SHADOWED = {"Capsvc-Shadow": "would_reject"}
STREAM_ROUTE = "/v1/games/{game}/capped/stream"
MAX_EXPORT_BYTES = 64 * 1024 * 1024
"""A sales system's export posted for reconciliation, at most (~2 million tickets)."""
_DECODERS: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def _decoder(kind: type[Any]) -> msgspec.json.Decoder[Any]:
    decoder = _DECODERS.get(kind)
    if decoder is None:
        decoder = _DECODERS[kind] = msgspec.json.Decoder(kind)
    return decoder


def decode_body(body: bytes | msgspec.Raw, kind: type[T]) -> T:
    """Decode a request body into `kind`, mapping msgspec's errors onto the API's."""
    try:
        result: T = _decoder(kind).decode(body)
        return result
    except msgspec.ValidationError as e:
        text = str(e)
        m = _PATH_RE.search(text)
        path = m.group(1) if m else "$"
        message = text[: m.start()] if m else text
        field = _FIELD_RE.match(message)
        if field:  # point at the missing or unknown field itself
            path = f"{path}.{field.group(1)}"
        elif message == _ID_MISMATCH:  # say what an id is rather than show the regex
            message = _ID_MESSAGE
        if path == "$" and message.startswith("Expected `object`"):
            raise ApiError("malformed", "malformed_json", "the body must be a JSON object",
                           None) from e
        raise ApiError("invalid", "invalid_request", message, path) from e
    except msgspec.DecodeError as e:
        raise ApiError("malformed", "malformed_json", f"the body is not valid JSON: {e}",
                       None) from e


class _TicketsSent(msgspec.Struct, forbid_unknown_fields=True):
    """A batch as sent, each ticket to decode on its own (TicketsIn is its schema)."""

    tickets: list[msgspec.Raw]


class _Tickets(msgspec.Struct, forbid_unknown_fields=True):
    """A batch whose every ticket decodes: the usual one, decoded as one array."""

    tickets: list[TicketIn]


def _tickets_sent(body: bytes) -> list[TicketIn | tuple[ApiError, str | None]]:
    """A batch's tickets, each decoded, or what it alone would have been answered with the
    ticket id it names (if any). One decode of the whole array when every ticket is valid;
    else each on its own, so that one bad ticket refuses only itself."""
    try:
        return list(_decoder(_Tickets).decode(body).tickets)
    except msgspec.MsgspecError:
        pass
    items: list[TicketIn | tuple[ApiError, str | None]] = []
    for raw in decode_body(body, _TicketsSent).tickets:
        try:
            items.append(decode_body(raw, TicketIn))
        except ApiError as e:
            items.append((e, _ticket_id_of(raw)))
    return items


def _ticket_id_of(raw: msgspec.Raw) -> str | None:
    """The ticket id of a ticket that does not decode, if it names one (a duplicate id is
    a whole-request error even then)."""
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    tid = value.get("ticket_id") if isinstance(value, dict) else None
    return tid if isinstance(tid, str) else None


STATUS_OF: dict[str, int] = {
    "malformed": 400, "unauthorized": 401, "forbidden": 403, "not_found": 404,
    "method_not_allowed": 405, "conflict": 409, "too_large": 413, "invalid": 422,
    "internal": 500, "unavailable": 503,
}
"""The HTTP status each kind of refusal (capsvc.domain.errors.Kind) is answered with."""


def error_response(err: ApiError, status: int | None = None) -> Answer:
    """The error's answer, with its kind's status (or `status`: an HTTP parse error's)."""
    body = _encode(ErrorOut(ErrorDetail(code=err.code, message=err.message, path=err.path)))
    return Answer(body, status or STATUS_OF[err.kind], err.headers)


def json_response(obj: Any, status: int = 200) -> Answer:
    return Answer(_encode(obj), status)


class Authenticator:
    """Bearer token → channel, comparing sha256 digests in constant time."""

    def __init__(self, channels: tuple[Channel, ...]) -> None:
        self.channels = channels
        self._known: dict[str, Channel] = {}
        """Authorization headers already matched to a channel (at most one per channel: a
        token is only cached once proven, so strangers cannot grow it)."""

    def channel(self, request: web.BaseRequest) -> Channel:
        header = request.headers.get("Authorization", "")
        known = self._known.get(header)
        if known is not None:
            return known
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError("unauthorized", "unauthorized", "missing bearer token",
                           headers={"WWW-Authenticate": "Bearer"})
        # Header bytes that are not UTF-8 arrive as surrogates: hash them as they came.
        digest = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        found: Channel | None = None
        for ch in self.channels:  # no early exit: the time taken does not depend on the match
            if hmac.compare_digest(ch.token_sha256, digest):
                found = ch
        if found is None:
            raise ApiError("unauthorized", "unauthorized", "unknown token",
                           headers={"WWW-Authenticate": "Bearer"})
        if len(self._known) < 4 * len(self.channels):  # "Bearer t", "bearer  t", …: bounded
            self._known[header] = found
        return found


@dataclass
class Health:
    """What /readyz reports, and the requests in flight.

    `draining` turns true on SIGTERM and stays true. `requests` maps each request's task to
    when it started (perf_counter), for the watchdog that enforces the request timeout:
    one check every quarter timeout is far cheaper than a timer per request.
    """

    draining: bool = False
    requests: dict[asyncio.Task[Any], float] = field(default_factory=dict)
    timed_out: set[asyncio.Task[Any]] = field(default_factory=set)

    @property
    def in_flight(self) -> int:
        return len(self.requests)


async def _watchdog(health: Health, timeout_s: float) -> None:
    """Cancel requests running longer than the timeout (the dispatcher answers 503)."""
    while True:
        await asyncio.sleep(timeout_s / 4)
        limit = time.perf_counter() - timeout_s
        for task, started in list(health.requests.items()):
            if started < limit and task not in health.timed_out:
                health.timed_out.add(task)
                task.cancel()


def _draw(request: web.BaseRequest) -> int:
    """The draw number of the path: 1 to MAX_DRAW, else a 404 (no such draw)."""
    text = _param(request, "draw")
    if not _DRAW_RE.fullmatch(text):  # int() would take " 5\n", "5_0", Arabic digits
        raise not_found(f"draw {text!r}")
    if len(text) > 12 or not 1 <= (draw := int(text)) <= MAX_DRAW:
        raise not_found(f"draw {text[:20]}")
    return draw


PARAMS = web.RequestKey("params", dict[str, str])
"""The parameters of the request's path, as the router matched them."""


def _param(request: web.BaseRequest, name: str) -> str:
    return request[PARAMS][name]


def _ticket_id(request: web.BaseRequest) -> str:
    """The ticket id of the path, matched whole like the body's (no trailing newline)."""
    text = _param(request, "ticket_id")
    if not ID_RE.fullmatch(text):
        raise ApiError("invalid", "invalid_request", f"ticket ids: {_ID_MESSAGE}", "ticket_id")
    return text


class Api:
    """Route handlers over the use-cases."""

    def __init__(self, settings: Settings, usecases: UseCases, store: Store, metrics: Metrics,
                 health: Health, durability: Durability, journal: Journal | None = None,
                 gate: Gate | None = None) -> None:
        self.settings = settings
        self.journal = journal
        self.gate = gate
        self.durability = durability
        self.catalog = usecases.catalog
        self.clock = usecases.clock
        self.tickets = usecases.tickets
        self.draws = usecases.draws
        self.availability_of = usecases.availability
        self.players = usecases.players
        self.feed = usecases.feed
        self.exposure_of = usecases.exposure
        self.audit = usecases.audit
        self.feed.on_drop = metrics.feed_dropped
        self.store = store
        self.metrics = metrics
        self.health = health
        self.auth = Authenticator(settings.channels)
        self._games = _encode(GamesOut(
            games=[game_out(g.rules) for g in self.catalog.games.values()]))

    # -- tickets ---------------------------------------------------------------------------

    async def post_ticket(self, request: web.BaseRequest) -> web.StreamResponse:
        channel = self.auth.channel(request)
        ticket = decode_body(await request.read(), TicketIn)
        [outcome] = await self.tickets.sell(channel, [ticket])
        if not isinstance(outcome, SaleOutcome):
            raise outcome
        if outcome.verdict is not None and not outcome.replayed:
            self.metrics.decision(outcome.verdict, outcome.near_cap, outcome.sold_out,
                                  outcome.shadowed)
        if outcome.replayed:
            return Answer(outcome.body, headers=_REPLAYED)
        if outcome.shadowed:
            return Answer(outcome.body, headers=_SHADOWED)
        return Answer(outcome.body)

    async def post_ticket_batch(self, request: web.BaseRequest) -> web.StreamResponse:
        """Several sales, each judged exactly as if sent alone (`Tickets.sell`): one
        result per ticket, in order, with the status and body `post_ticket` would have
        answered for it. Whole-request problems (auth, a token without the `sell` scope, a
        body that is not a list of 1 to `max_batch` tickets, one ticket id twice) answer as
        usual."""
        channel = self.auth.channel(request)
        require_scope(channel, "sell")  # the token's, not a ticket's: the whole request
        items = _tickets_sent(await request.read())
        if not 1 <= len(items) <= self.settings.max_batch:
            raise ApiError("invalid", "invalid_request", f"a batch holds 1 to "
                           f"{self.settings.max_batch} tickets, not {len(items)}", "$.tickets")
        first_at: dict[str, int] = {}
        for i, item in enumerate(items):
            tid = item.ticket_id if isinstance(item, TicketIn) else item[1]
            if tid is None:
                continue
            if tid in first_at:
                raise ApiError("invalid", "invalid_request", f"ticket {tid} is in the batch twice "
                               f"(first at $.tickets[{first_at[tid]}])",
                               f"$.tickets[{i}].ticket_id")
            first_at[tid] = i
        outcomes = iter(await self.tickets.sell(
            channel, [t for t in items if isinstance(t, TicketIn)]))
        results = [self._result(next(outcomes) if isinstance(item, TicketIn) else item[0])
                   for item in items]
        self.metrics.ticket_batch.observe(len(items))
        return Answer(_encode(TicketsOut(results)))

    def _result(self, outcome: SaleOutcome | ApiError | Unavailable) -> TicketResult:
        """One ticket's result in a batch: what `post_ticket` would have answered."""
        if isinstance(outcome, SaleOutcome):
            if outcome.verdict is not None and not outcome.replayed:
                self.metrics.decision(outcome.verdict, outcome.near_cap, outcome.sold_out,
                                      outcome.shadowed)
            return TicketResult(200, msgspec.Raw(outcome.body), outcome.replayed)
        if isinstance(outcome, Unavailable):
            if isinstance(outcome, Evicting):  # said once, by the gate
                cause = EVICTING
            elif isinstance(outcome, OutOfMemory):  # said by the transport
                cause = OUT_OF_MEMORY
            else:
                log.warning("redis unavailable: %s", outcome)
                cause = "Redis could not be reached in time"
            outcome = unavailable(OUTCOME_UNKNOWN.format(cause), self.settings.retry_after_s)
        return TicketResult(STATUS_OF[outcome.kind], msgspec.Raw(_encode(ErrorOut(ErrorDetail(
            code=outcome.code, message=outcome.message, path=outcome.path)))))

    async def get_ticket(self, request: web.BaseRequest) -> web.StreamResponse:
        channel = self.auth.channel(request)
        return Answer(await self.tickets.ticket(channel, _ticket_id(request)))

    async def cancel_ticket(self, request: web.BaseRequest) -> web.StreamResponse:
        channel = self.auth.channel(request)
        return json_response(await self.tickets.cancel(channel, _ticket_id(request)))

    # -- games, draws, availability --------------------------------------------------------

    async def games(self, request: web.BaseRequest) -> web.StreamResponse:
        self.auth.channel(request)
        return Answer(self._games)

    async def current_draw(self, request: web.BaseRequest) -> web.StreamResponse:
        channel = self.auth.channel(request)
        game = self.catalog.game(_param(request, "game"), channel, "sell", "read")
        return json_response(await self.draws.current(game))

    async def draw(self, request: web.BaseRequest) -> web.StreamResponse:
        channel = self.auth.channel(request)
        game = self.catalog.game(_param(request, "game"), channel, "sell", "read", "admin")
        return json_response(await self.draws.draw(game, _draw(request)))

    async def close_draw(self, request: web.BaseRequest) -> web.StreamResponse:
        channel = self.auth.channel(request)
        game = self.catalog.game(_param(request, "game"), channel, "admin")
        return json_response(await self.draws.close(game, _draw(request), channel.id))

    async def combination(self, request: web.BaseRequest) -> web.StreamResponse:
        channel = self.auth.channel(request)
        game = self.catalog.game(_param(request, "game"), channel, "sell", "read")
        return json_response(await self.availability_of.combination(
            game, _draw(request), _param(request, "numbers")))

    async def capped(self, request: web.BaseRequest) -> web.StreamResponse:
        channel = self.auth.channel(request)
        game = self.catalog.game(_param(request, "game"), channel, "sell", "read")
        return json_response(await self.availability_of.sold_out(game, _draw(request)))

    async def exposure(self, request: web.BaseRequest) -> web.StreamResponse:
        channel = self.auth.channel(request)
        game = self.catalog.game(_param(request, "game"), channel, "read", "admin")
        return json_response(await self.exposure_of.of(game, _draw(request)))

    async def report(self, request: web.BaseRequest) -> web.StreamResponse:
        """A draw's report, from the journal (the one written once the draw is final)."""
        channel = self.auth.channel(request)
        game = self.catalog.game(_param(request, "game"), channel, "read", "admin")
        fmt = request.query.get("format", "json")
        if fmt not in ("json", "csv"):
            raise ApiError("invalid", "invalid_request", "format must be json or csv", "format")
        report = await self.audit.report(game, _draw(request))
        if fmt == "csv":
            return web.Response(text=to_csv(report), content_type="text/csv")
        return Answer(to_json(report))

    async def reconcile(self, request: web.BaseRequest) -> web.StreamResponse:
        """The sales system's export of a draw (CSV) against capsvc's decisions."""
        channel = self.auth.channel(request)
        game = self.catalog.game(_param(request, "game"), channel, "admin")
        draw = _draw(request)
        grace_ms = self.settings.audit_grace_ms
        if (grace := request.query.get("grace")) is not None:
            if not grace.isascii() or not grace.isdigit() or len(grace) > 6:
                raise ApiError("invalid", "invalid_request", "grace must be a number of seconds",
                               "grace")
            grace_ms = int(grace) * 1000
        cancel = request.query.get("cancel_abandoned", "false")
        if cancel not in ("true", "false"):
            raise ApiError("invalid", "invalid_request", "cancel_abandoned must be true or false",
                           "cancel_abandoned")
        # An export is larger than a sale and its reading takes longer than a sale's
        # timeout: a limit of its own, no request timeout (admin only).
        self.health.requests.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
        chunks, size = [], 0
        async for chunk in request.content.iter_any():  # to the end of the body
            size += len(chunk)
            if size > MAX_EXPORT_BYTES:
                raise ApiError("too_large", "payload_too_large",
                               f"an export is at most {MAX_EXPORT_BYTES} bytes")
            chunks.append(chunk)
        data = b"".join(chunks)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ApiError("invalid", "invalid_export", f"the export is not UTF-8 ({e})") from None
        try:
            rec = await self.audit.reconcile(game, draw, text, grace_ms=grace_ms,
                                             cancel_abandoned=cancel == "true")
        except ExportError as e:
            raise ApiError("invalid", "invalid_export", str(e)) from None
        return json_response(rec)

    async def capped_stream(self, request: web.BaseRequest) -> web.StreamResponse:
        """The live sold-out feed (server-sent events; see capsvc/service/feed.py)."""
        channel = self.auth.channel(request)
        game = self.catalog.game(_param(request, "game"), channel, "sell", "read")
        only = request.query.get("draw")
        draw: int | None = None
        if only is not None:
            if not _DRAW_RE.fullmatch(only) or len(only) > 12:
                raise ApiError("invalid", "invalid_request", "draw must be a draw number", "draw")
            if not 1 <= (number := int(only)) <= MAX_DRAW:
                raise not_found(f"draw {only}")
            game.check_draw(number)
            draw = number
        sub = Subscriber(draw, request.transport)
        feed = self.feed
        resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no", "X-Request-ID": request_id(request)})
        # A subscription is not a request in flight: no request timeout, not shed. Its start
        # waits its turn (feed.STARTS at a time, each Redis read under Redis's timeout): a
        # crowd resuming after a restart is served in turn, not sent back to reconnect.
        self.health.requests.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
        try:
            first = await feed.open(game, sub, request.headers.get("Last-Event-ID"))
            await resp.prepare(request)
            if request.method == "HEAD":  # the headers a subscription would get, no events
                return resp
            for event in first:
                await resp.write(event.data)
            # From now on the feed writes each event to the connection itself, framed as
            # aiohttp frames this response (chunked on HTTP/1.1).
            sub.chunked = bool(getattr(request.writer, "chunked", True))
            if sub.go_live():
                await sub.ended.wait()  # dropped, gone, or the service is draining
            else:
                feed.drop(game, sub)
        except ConnectionResetError:
            log.debug("a feed subscriber left")
        finally:
            feed.unsubscribe(game, sub)
        return resp

    async def availability(self, request: web.BaseRequest) -> web.StreamResponse:
        channel = self.auth.channel(request)
        game = self.catalog.game(_param(request, "game"), channel, "sell", "read")
        query = decode_body(await request.read(), AvailabilityIn)
        return json_response(await self.availability_of.availability(game, query))

    # -- players ---------------------------------------------------------------------------

    async def player(self, request: web.BaseRequest) -> web.StreamResponse:
        channel = self.auth.channel(request)
        return json_response(await self.players.state(
            channel, _param(request, "player_id"), request.query.get("game")))

    async def player_limit(self, request: web.BaseRequest) -> web.StreamResponse:
        channel = self.auth.channel(request)
        body = decode_body(await request.read(), LimitIn)
        return json_response(await self.players.set_limit(
            channel, _param(request, "player_id"), request.query.get("game"), body))

    async def player_stake(self, request: web.BaseRequest) -> web.StreamResponse:
        channel = self.auth.channel(request)
        body = decode_body(await request.read(), StakeIn)
        return json_response(await self.players.stake(
            channel, _param(request, "player_id"), request.query.get("game"), body))

    # -- operations ------------------------------------------------------------------------

    async def healthz(self, request: web.BaseRequest) -> web.StreamResponse:
        return json_response(HealthOut(status="ok"))

    async def readyz(self, request: web.BaseRequest) -> web.StreamResponse:
        checks = {"draining": self.health.draining, "redis": False, "scripts": False}
        if self.journal is not None:
            checks["journal"] = await self.journal.probe()
        if self.gate is not None:
            if self.gate.reconciles:
                checks["restored"] = not self.gate.restoring
            # Every node used has maxmemory-policy noeviction (each read on its connection).
            checks["noeviction"] = not self.gate.evicting
        if not self.health.draining and checks.get("restored", True):
            try:
                loaded = await self.store.library_loaded()
                checks["redis"] = True
                if not loaded:
                    await self.store.load_library()
                    loaded = await self.store.library_loaded()
                checks["scripts"] = loaded
                if not self.clock.synced:
                    await self.clock.sync()
            except Exception as e:  # Redis down, slow or odd: not ready, never a 500
                log.debug("readiness check failed: %s", e)
        ready = (checks["redis"] and checks["scripts"] and self.clock.synced
                 and not checks["draining"] and checks.get("journal", True)
                 and checks.get("restored", True) and checks.get("noeviction", True))
        self.metrics.readiness(ready)
        return json_response(HealthOut(status="ready" if ready else "not_ready", checks=checks),
                             status=200 if ready else 503)

    async def prometheus(self, request: web.BaseRequest) -> web.StreamResponse:
        return exposition(self.metrics)

    async def openapi(self, request: web.BaseRequest) -> web.StreamResponse:
        return Answer(_OPENAPI)


def game_out(r: GameRules) -> GameOut:
    return GameOut(
        id=r.id, preset=r.preset, description=r.description, currency=r.currency,
        numbers=r.numbers, picks_min=r.picks_min, picks_max=r.picks_max, stakes=list(r.stakes),
        durations=list(r.durations), cap_limit=r.cap_limit,
        shadow_cap_limit=r.shadow_cap_limit, capped_picks=sorted(r.capped_picks),
        daily_limit=r.daily_limit, time_zone=r.time_zone,
        draw_times=[t.strftime("%H:%M:%S" if t.second else "%H:%M") for t in r.draw_times],
        cancel=r.cancel,
        retention_seconds=r.retention_ms // 1000, max_grids=r.max_grids,
        sales_horizon=r.sales_horizon, subscription_accounting=r.subscription_accounting,
        multiplier=r.multiplier, joker_plus_price=r.joker_plus_price,
        top_prizes={str(p): prize for p, prize in r.top_prizes},
        prize_base_stake=r.prize_base_stake,
    )


_NO_PARAMS: dict[str, str] = {}
"""The parameters of a fixed path (shared, never written)."""


class Router:
    """Method and path to a handler, its path parameters and its route template (the
    `route` label of the metrics). Fixed paths are one dict lookup (the sale's among them);
    the others are matched segment by segment, in the order they were added, a literal
    segment before a parameter. A GET route answers HEAD too."""

    def __init__(self) -> None:
        self._fixed: dict[str, dict[str, Handler]] = {}
        self._patterns: list[tuple[tuple[str, ...], str, dict[str, Handler]]] = []
        self.routes: list[tuple[str, str]] = []
        """(method, template) of every route, HEAD aside."""

    def add(self, method: str, template: str, handler: Handler) -> None:
        self.routes.append((method, template))
        methods = {method: handler, **({"HEAD": handler} if method == "GET" else {})}
        if "{" not in template:
            self._fixed.setdefault(template, {}).update(methods)
            return
        segments = tuple(template[1:].split("/"))
        for known, _, handlers in self._patterns:
            if known == segments:
                handlers.update(methods)
                return
        self._patterns.append((segments, template, methods))

    def resolve(self, method: str, path: str
                ) -> tuple[Handler | None, str, dict[str, str], dict[str, Handler]]:
        """(handler, template, parameters, the path's handlers by method) of a raw path
        (percent-encoded as sent): handler None when the path is unknown (template
        "unmatched") or the method is not allowed there."""
        if "%" in path:  # segments decoded one by one: an encoded "/" stays in its segment
            parts = [unquote(p) for p in path[1:].split("/")]
            path = "/" + "/".join(parts)
            handlers = None if any("/" in p for p in parts) else self._fixed.get(path)
        else:
            parts = None
            handlers = self._fixed.get(path)
        template, params = path, _NO_PARAMS
        if handlers is None:
            if parts is None:
                parts = path[1:].split("/")
            for segments, pattern, candidates in self._patterns:
                if len(segments) != len(parts):
                    continue
                found: dict[str, str] = {}
                for segment, part in zip(segments, parts, strict=True):
                    if segment[0] == "{":
                        if not part:
                            break
                        found[segment[1:-1]] = part
                    elif segment != part:
                        break
                else:
                    handlers, template, params = candidates, pattern, found
                    break
            else:
                return None, "unmatched", _NO_PARAMS, {}
        return handlers.get(method), template, params, handlers


EVICTING = "Redis may evict what capsvc writes (its maxmemory-policy): nothing is sold on it"
"""The cause a 503 gives when the gate holds the node for its eviction policy."""
OUT_OF_MEMORY = "Redis is out of memory and refuses writes"
"""The cause a 503 gives when Redis refused a command at maxmemory."""

_CONFIRMED = frozenset({200, 409, 422})
"""The statuses of answers that may rest on state a Redis failover can lose."""
_STATELESS = frozenset({"/v1/games", STREAM_ROUTE})
"""/v1 routes whose answers rest on no Redis state (the configuration), or are no answer
but a stream."""


def _dispatch(api: Api, router: Router) -> Handler:
    """Every request: route, count in flight, shed, time out, map errors to the API's
    format, time the request, stamp X-Request-ID (one function: no middleware chain)."""
    settings, metrics, health = api.settings, api.metrics, api.health
    requests, timed_out = health.requests, health.timed_out
    confirm = api.durability.confirm if api.durability.replicas else None
    stateful = frozenset(t for _, t in router.routes
                         if t.startswith("/v1/") and t not in _STATELESS)
    in_flight = metrics.in_flight  # exact: a once-a-second sample per worker, summed, is not
    gate = api.gate

    def busy(message: str) -> Answer:
        return error_response(unavailable(message, settings.retry_after_s))

    def unknown(request: web.BaseRequest, cause: str) -> Answer:
        """A 503 for a cause that cut the request short: a read changed nothing; any other
        request's outcome is unknown."""
        reads = request.method == "GET" or request.method == "HEAD"
        return busy((NOTHING_CHANGED if reads else OUTCOME_UNKNOWN).format(cause))

    async def dispatch(request: web.BaseRequest) -> web.StreamResponse:
        started = time.perf_counter()
        rid = request_id(request)
        handler, template, params, handlers = router.resolve(request.method,
                                                             request.rel_url.raw_path)
        request[PARAMS] = params
        resp: web.StreamResponse
        if handler is None:
            resp = unrouted(request, template, handlers)
        elif health.in_flight >= settings.max_in_flight:
            resp = busy("too many requests in flight")
        else:
            task = asyncio.current_task()
            assert task is not None
            requests[task] = started
            # Neither a scrape nor a feed subscription counts itself.
            counted = template != "/metrics" and template != STREAM_ROUTE
            if counted:
                in_flight.inc()
            # The marked calls of the request stamp its journal records (capsvc.redis.marks).
            Marks.begin()
            epoch = gate.epoch if gate is not None else 0
            try:
                try:
                    resp = await handler(request)
                except ApiError as e:
                    resp = error_response(e)
                if gate is not None and gate.epoch != epoch and template in stateful:
                    # A restore began while the request ran: what it decided or read may
                    # be among what Redis lost, and the restore may have read the journal
                    # before this request's record reached it.
                    resp = unknown(request, "Redis was found to have lost writes meanwhile")
                if confirm is not None and resp.status in _CONFIRMED and template in stateful:
                    # replicas:N: no answer reports what a failover could take back — a
                    # decision, a replay, a GET, and a refusal (409, 422 draw_closed) that
                    # rests on one — until the replicas have everything it read.
                    await confirm()
            except asyncio.CancelledError:
                if task not in timed_out:  # the client went away, or shutdown: let it go
                    raise
                timed_out.discard(task)
                task.uncancel()
                resp = unknown(request, "the request took too long")
            except ApiError as e:
                resp = error_response(e)
            except (Behind, Restoring) as e:  # refused by Redis before anything ran
                log.info("%s", e, extra={"request_id": rid, "route": template})
                resp = unknown(request, "Redis is being restored from the journal")
            except Evicting:  # held by the gate, nothing sent; said once, by the gate
                resp = unknown(request, EVICTING)
            except OutOfMemory:  # said by the transport, at most once per OOM_LOG_S
                resp = unknown(request, OUT_OF_MEMORY)
            except Unavailable as e:
                log.warning("redis unavailable: %s", e,
                            extra={"request_id": rid, "route": template})
                resp = unknown(request, "Redis could not be reached in time")
            except ResponseError as e:
                # Redis refused a command (out of memory under noeviction, a broken
                # ACL, …): nothing can be assumed recorded, so fail closed.
                log.error("redis refused a command: %s", e,
                          extra={"request_id": rid, "route": template})
                resp = unknown(request, "Redis refused an operation")
            except web.RequestPayloadError as e:  # a body aiohttp cannot decode (bad gzip, …)
                log.warning("unreadable request body: %s", _first_line(e),
                            extra={"request_id": rid, "route": template})
                resp = error_response(ApiError("malformed", "malformed_request",
                                               f"the body cannot be read: {_first_line(e)}"))
            except ConnectionResetError:  # the client left before sending its whole body
                log.info("client went away before its body was read",
                         extra={"request_id": rid, "route": template})
                resp = error_response(ApiError("malformed", "malformed_request",
                                               "the body was cut short"))
            except web.HTTPRequestEntityTooLarge:
                resp = error_response(ApiError(
                    "too_large", "payload_too_large",
                    f"the body is larger than {settings.max_body_bytes} bytes"))
            except Exception:
                log.exception("unhandled error on %s %s", request.method, template,
                              extra={"request_id": rid})
                resp = error_response(ApiError("internal", "internal", "internal error"))
            finally:
                requests.pop(task, None)  # a feed subscription took itself out
                if counted:
                    in_flight.dec()
        metrics.request(template, request.method, resp.status, time.perf_counter() - started)
        answer_headers(resp, rid)
        return resp

    return dispatch


_BYTES_RE = re.compile(r":? *b(['\"]).*", re.DOTALL)
_STATUS_RE = re.compile(r"^[0-9]{3}, message: *")


def _first_line(problem: object) -> str:
    """A parse error in one line, without the bytes aiohttp quotes (they may hold a token:
    nothing of a request's headers goes to the log or back to the client)."""
    lines = [line.strip() for line in str(problem).splitlines()]
    kept = [line for line in lines if line and not line.startswith(("b'", 'b"', "^"))]
    text = _STATUS_RE.sub("", " ".join(kept))
    return _BYTES_RE.sub("", text).rstrip(" :.") or "unparseable"


class Protocol(web.RequestHandler):
    """aiohttp's connection handler, answering HTTP it cannot parse (a NUL byte in a header,
    a broken request line, …) in the API's error format, counted in the request metrics
    under the route `malformed`, with one warning line instead of a traceback. The
    connection is closed after the answer, as aiohttp does."""

    __slots__ = ("metrics",)

    def __init__(self, manager: web.Server, *, metrics: Metrics, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.metrics = metrics

    def log_exception(self, *args: Any, **kw: Any) -> None:
        # After answering a body it could not decode, aiohttp reads the rest of it and
        # meets the same error: already answered (400) and logged by the dispatcher.
        if isinstance(kw.get("exc_info"), web.RequestPayloadError):
            log.debug("the rest of an unreadable body was dropped")
            return
        super().log_exception(*args, **kw)

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:  # not a parse error: aiohttp's own handling (and traceback)
            return super().handle_error(request, status, exc, message)
        what = _first_line(message or exc or "unparseable")
        log.warning("malformed HTTP request from %s: %s", request.remote, what)
        self.metrics.request("malformed", "-", status, 0.0)
        resp = error_response(ApiError("malformed", "malformed_request",
                                       f"the request is not valid HTTP: {what}"), status)
        resp.headers["X-Request-ID"] = request_id(request)
        resp.force_close()
        return resp


_REQUEST_ID_RE = re.compile(r"^[\x21-\x7e]{1,128}\Z")
_request_ids = itertools.count(1)
_ID_PREFIX = f"{os.getpid():x}-{int(time.time()) & 0xFFFFFF:x}-"


def request_id(request: web.BaseRequest) -> str:
    """The caller's X-Request-ID if it is sane (1-128 visible ASCII), else a new one
    (process prefix + counter: unique, and cheaper than a UUID)."""
    given = request.headers.get("X-Request-ID")
    if given is not None and _REQUEST_ID_RE.fullmatch(given):
        return given
    return f"{_ID_PREFIX}{next(_request_ids):x}"


@dataclass
class App:
    """The HTTP side of a service: one handler for every request (aiohttp's low-level
    server calls it), the routes, and the request watchdog to run beside it."""

    handle: Handler
    router: Router
    health: Health
    request_timeout_s: float
    max_body_bytes: int

    async def watchdog(self) -> None:
        await _watchdog(self.health, self.request_timeout_s)


def create_app(settings: Settings, usecases: UseCases, store: Store, metrics: Metrics,
               health: Health, durability: Durability, journal: Journal | None = None,
               gate: Gate | None = None) -> App:
    api = Api(settings, usecases, store, metrics, health, durability, journal, gate)
    router = Router()
    draw = "/v1/games/{game}/draws/{draw}"
    router.add("POST", "/v1/tickets", api.post_ticket)
    router.add("POST", "/v1/ticket-batches", api.post_ticket_batch)
    router.add("GET", "/v1/tickets/{ticket_id}", api.get_ticket)
    router.add("POST", "/v1/tickets/{ticket_id}/cancel", api.cancel_ticket)
    router.add("GET", "/v1/games", api.games)
    router.add("GET", "/v1/games/{game}/draws/current", api.current_draw)
    router.add("GET", draw, api.draw)
    router.add("POST", draw + "/close", api.close_draw)
    router.add("GET", draw + "/combinations/{numbers}", api.combination)
    router.add("GET", draw + "/capped", api.capped)
    router.add("GET", STREAM_ROUTE, api.capped_stream)
    router.add("GET", draw + "/exposure", api.exposure)
    router.add("GET", draw + "/report", api.report)
    router.add("POST", draw + "/reconcile", api.reconcile)
    router.add("POST", "/v1/games/{game}/availability", api.availability)
    router.add("GET", "/v1/players/{player_id}", api.player)
    router.add("PUT", "/v1/players/{player_id}/limit", api.player_limit)
    router.add("POST", "/v1/players/{player_id}/stakes", api.player_stake)
    router.add("GET", "/healthz", api.healthz)
    router.add("GET", "/readyz", api.readyz)
    if settings.metrics_port is None:  # else on a listener of its own (`metrics_handler`)
        router.add("GET", "/metrics", api.prometheus)
    router.add("GET", "/openapi.json", api.openapi)
    return App(_dispatch(api, router), router, health, settings.request_timeout_ms / 1000,
               settings.max_body_bytes)


def exposition(metrics: Metrics) -> web.Response:
    """`GET /metrics`: every process's metrics, in Prometheus's text format."""
    return web.Response(body=metrics.exposition(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def unrouted(request: web.BaseRequest, template: str, handlers: dict[str, Handler]
             ) -> Answer:
    """The answer to a request no route takes (`Router.resolve` found no handler): 404 for
    a path unknown, 405 with `Allow` for a method the path does not take."""
    if template == "unmatched":
        return error_response(ApiError("not_found", "not_found", f"no route {request.path}"))
    return error_response(ApiError(
        "method_not_allowed", "method_not_allowed", f"{request.method} is not allowed here",
        headers={"Allow": ",".join(m for m in handlers if m != "HEAD")}))


def metrics_handler(metrics: Metrics) -> Handler:
    """The metrics listener's only route (`[server] metrics_port`): `GET /metrics` (and
    HEAD); any other path is 404, another method 405, as on the API port. Scrapes are timed
    as on the API port (route `/metrics`)."""
    async def scrape(request: web.BaseRequest) -> web.StreamResponse:
        return exposition(metrics)

    router = Router()
    router.add("GET", "/metrics", scrape)

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        started = time.perf_counter()
        handler, template, _, handlers = router.resolve(request.method,
                                                        request.rel_url.raw_path)
        resp = (unrouted(request, template, handlers) if handler is None
                else await handler(request))
        metrics.request(template, request.method, resp.status, time.perf_counter() - started)
        return resp

    return handle
