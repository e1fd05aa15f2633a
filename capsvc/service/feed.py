"""The live sold-out feed: what terminals subscribe to instead of polling `…/capped`.

THE EVENTS live in Redis, in one stream per game (`f:{<game>}`, lua/capsvc.lua, FEED),
written atomically with what they report: `capped` by the call that brought a combination
to its cap (the one-call sale, or the sold-out mark a sale in steps writes before its
decision), `reopened` after a cancellation gave room back below the smallest stake,
`closed` when a draw stops selling (an admin's stop, or its close by the calendar, written
once by whichever process notices it first). So a sale answered as having capped a
combination is on the feed even if its process dies right after answering, and on a
Redis Cluster every process reads the same stream. The stream keeps the last
`STREAM_LENGTH` events and expires with the last draw it reported.

EACH PROCESS reads each game's stream once, while it has subscribers (a non-blocking
XREAD on the shared pipelined connection every `POLL_S`), and writes every event, framed
once, straight to each subscriber's connection: no task wakes up per subscriber and event.
A subscriber that does not read falls behind; once more than `WRITE_BUFFER_LIMIT` bytes
wait for it in the process, it is dropped (a log line, `capsvc_feed_dropped_total`) and its
connection closed, never buffered without limit: it reconnects with `Last-Event-ID` and
resumes.

RESUMING. Event ids are the stream's entry ids, increasing. A subscriber that reconnects
with `Last-Event-ID` gets every event after it, when the stream still holds it; otherwise
(or without the header) it starts with a `snapshot` event: every combination at its cap,
for every draw on sale, as of the snapshot's id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from redis.exceptions import ResponseError

from capsvc.domain import combination
from capsvc.domain.calendar import instant
from capsvc.domain.errors import unavailable
from capsvc.domain.games import Game
from capsvc.redis.clock import RedisClock
from capsvc.redis.store import Store
from capsvc.service.availability import Availability
from capsvc.service.draws import Draws

log = logging.getLogger(__name__)

POLL_S = 0.02
"""How often a process reads a stream it has subscribers for."""
READ_COUNT = 1000
"""Events read per poll at most."""
QUEUE_EVENTS = 1024
"""Events a subscriber may receive while its snapshot or backlog is being written (beyond,
it is dropped)."""
WRITE_BUFFER_LIMIT = 256 * 1024
"""Bytes waiting in the process for a subscriber (beyond what its socket holds) before it
is dropped."""
BACKLOG_EVENTS = 2_000
"""Events a resuming subscriber may have missed; further behind, it gets a snapshot."""
BACKLOG_PAGE = 250
"""Events read per round trip for a resuming subscriber (the connection is shared with the
sales: no reply of megabytes on it)."""
STARTS = 4
"""Subscriptions a process starts at once (snapshots and backlogs read from Redis); the
others wait their turn, so that a crowd reconnecting does not crowd out the sales."""
HEARTBEAT_S = 15.0
STREAM_LENGTH = 100_000
"""Events a stream keeps (approximately: Redis trims whole nodes)."""

_ID_RE = re.compile(r"^[0-9]{1,20}-[0-9]{1,20}\Z")
_ID_MAX = 2**64 - 1
_encode = msgspec.json.encode


def parse_id(text: str | None) -> tuple[int, int] | None:
    """A stream entry id ("<ms>-<seq>") as a comparable pair, or None if it is not one."""
    if text is None or not _ID_RE.match(text):
        return None
    ms, seq = (int(part) for part in text.split("-"))
    # Beyond what Redis takes as the start of a range after it: not an id it gave.
    if ms > _ID_MAX or seq >= _ID_MAX:
        return None
    return ms, seq


@dataclass(slots=True)
class Event:
    """One event as sent: its id (comparable), the draw it is about, its SSE bytes, and
    the same as one HTTP/1.1 chunk (framed once for every subscriber)."""

    key: tuple[int, int]
    draw: int
    data: bytes
    chunk: bytes = b""

    def __post_init__(self) -> None:
        self.chunk = b"%x\r\n%s\r\n" % (len(self.data), self.data)


@dataclass(eq=False)
class Subscriber:
    """One connection on the feed: the draw it follows (None: all), its transport, the id
    it has everything up to, and whether the response is chunked (HTTP/1.1).

    While its start (snapshot or backlog) is written, live events wait in `pending`; then
    `go_live` sends them and every later event is written at once by `deliver`."""

    draw: int | None
    transport: asyncio.Transport | None = None
    chunked: bool = True
    sent: tuple[int, int] = (0, 0)
    pending: list[Event] | None = field(default_factory=list)
    dropped: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    def deliver(self, event: Event) -> bool:
        """Send an event (or keep it while the start is written). False when the
        subscriber cannot take it: too far behind, or gone."""
        if self.pending is not None:
            if len(self.pending) >= QUEUE_EVENTS:
                return False
            self.pending.append(event)
            return True
        if event is not HEARTBEAT and event.key <= self.sent:
            return True  # already in its start
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        if transport.get_write_buffer_size() > WRITE_BUFFER_LIMIT:
            return False
        transport.write(event.chunk if self.chunked else event.data)
        if event is not HEARTBEAT:
            self.sent = event.key
        return True

    def go_live(self) -> bool:
        """The start is written: send what came meanwhile, then every event as it comes."""
        pending, self.pending = self.pending or [], None
        return all(self.deliver(e) for e in pending)

    def end(self, *, abort: bool) -> None:
        """End the connection; `abort`: close it now, whatever it has not read."""
        self.ended.set()
        if abort and self.transport is not None:
            self.transport.abort()


HEARTBEAT = Event((0, 0), 0, b": heartbeat\n\n")
"""A comment line every HEARTBEAT_S: proxies keep the connection, clients see it alive."""


def frame(kind: str, event_id: str, payload: Any) -> bytes:
    """One server-sent event."""
    return (f"event: {kind}\nid: {event_id}\ndata: ".encode() + _encode(payload) + b"\n\n")


class _GameFeed:
    """The readers of one game's stream in this process."""

    def __init__(self, feed: Feed, game: Game) -> None:
        self.feed = feed
        self.game = game
        self.subscribers: set[Subscriber] = set()
        self.last_id = "0-0"
        self.task: asyncio.Task[None] | None = None

    def event(self, entry_id: bytes, fields: list[bytes]) -> Event:
        values = dict(zip(fields[::2], fields[1::2], strict=True))
        kind = values[b"type"].decode()
        draw = int(values[b"draw"])
        at = instant(int(values[b"at"]), self.game.rules.tz)
        payload: dict[str, Any] = {"draw": draw}
        if b"combo" in values:
            payload["numbers"] = combination.decode(values[b"combo"])
        payload["at"] = at
        text = entry_id.decode()
        key = parse_id(text)
        assert key is not None
        return Event(key, draw, frame(kind, text, payload))

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self.task = None

    async def _run(self) -> None:
        store, gid = self.feed.store, self.game.rules.id
        loop = asyncio.get_running_loop()
        beat = loop.time() + HEARTBEAT_S
        while self.subscribers:
            pause = POLL_S
            try:
                reply = await store.read_feed(gid, self.last_id, READ_COUNT)
                for _, entries in reply or ():
                    for entry_id, fields in entries:
                        self.last_id = entry_id.decode()
                        event = self.parse(entry_id, fields)
                        if event is not None:
                            self.publish(event)
                self.feed.check_closes(self.game)
            except Exception as e:  # Redis away: subscribers keep their connection
                log.warning("feed of %s not readable: %s", gid, e)
                pause = 1.0
            if loop.time() >= beat:  # heartbeats go on while Redis is away
                beat = loop.time() + HEARTBEAT_S
                self.publish(HEARTBEAT)
            await asyncio.sleep(pause)

    def parse(self, entry_id: bytes, fields: list[bytes]) -> Event | None:
        """The event of a stream entry; None (and a warning) for an entry that is not one
        (written by something else than capsvc's functions): it is skipped."""
        try:
            return self.event(entry_id, fields)
        except (KeyError, ValueError, TypeError, IndexError) as e:
            log.warning("feed of %s: entry %s skipped, not an event: %r", self.game.rules.id,
                        entry_id, e)
            return None

    def publish(self, event: Event) -> None:
        for sub in list(self.subscribers):
            if sub.draw is not None and event.draw and sub.draw != event.draw:
                continue
            if not sub.deliver(event):
                self.drop(sub)

    def drop(self, sub: Subscriber) -> None:
        """Drop a subscriber that cannot take an event: one gone quietly; one that does
        not read, counted and logged."""
        self.subscribers.discard(sub)
        transport = sub.transport
        if transport is not None and not transport.is_closing():
            sub.dropped = True
            self.feed.on_drop(self.game.rules.id)
            log.warning("feed subscriber of %s dropped: it does not read its events "
                        "(%d bytes waiting)", self.game.rules.id,
                        transport.get_write_buffer_size())
        sub.end(abort=True)


class Feed:
    """Every game's feed in this process."""

    def __init__(self, store: Store, clock: RedisClock, draws: Draws,
                 availability: Availability) -> None:
        self.store = store
        self.clock = clock
        self.draws = draws
        self.availability = availability
        self.on_drop: Callable[[str], None] = lambda game: None
        """Called with the game when a subscriber is dropped (the metrics count it)."""
        self.closed = False
        self.starts = asyncio.Semaphore(STARTS)
        """Taken while a subscription's start is read (see STARTS)."""
        self._games: dict[str, _GameFeed] = {}
        self._announced: dict[str, int] = {}
        self._closing: set[asyncio.Task[Any]] = set()

    async def last_id(self, game: str) -> str:
        """The id of the newest event of a game's stream ("0-0" when it has none)."""
        newest = await self.store.newest_feed_entry(game)
        return newest[0][0].decode() if newest else "0-0"

    async def open(self, game: Game, sub: Subscriber, last: str | None) -> list[Event]:
        """Subscribe `sub` to the game's feed, and what it starts with: the events after
        `last` (its Last-Event-ID) while the stream still holds them, else a snapshot of
        every combination at its cap on the draws on sale. Events that come meanwhile wait
        for `Subscriber.go_live`; those up to where the start stands are not sent again.
        A 503 once the feed is closed (the service drains)."""
        newest = await self.last_id(game.rules.id)
        # The events the reader published before this subscriber joined are not kept for
        # it: a snapshot stands for them (it is read after), so its id is the later of the
        # newest event and the reader's position.
        position = self.reader_position(game)
        if position is not None and (parse_id(position) or (0, 0)) > (parse_id(newest)
                                                                    or (0, 0)):
            newest = position
        # Subscribed before reading what came before: whatever is appended from now on is
        # either in what is read below or kept for it (and skipped if it was sent).
        self.subscribe(game, sub, newest)
        async with self.starts:
            first, sub.sent = await self._start(game, sub, last, newest)
        if self.closed:  # the service began to drain meanwhile
            raise unavailable("the service is stopping: subscribe to another instance", 1)
        return first

    async def _start(self, game: Game, sub: Subscriber, last: str | None, newest: str
                     ) -> tuple[list[Event], tuple[int, int]]:
        """The events a subscription starts with, and the id it then has everything up to."""
        after = parse_id(last)
        if after is not None:
            events = await self.backlog(game, last or "", after, parse_id(newest) or (0, 0),
                                        sub.draw)
            if events is not None:
                return events, max([after, *(e.key for e in events)])
        current = await self.draws.current_draw(game)
        draws = ([sub.draw] if sub.draw is not None else
                 list(range(current, current + game.rules.sales_horizon + 1)))
        lists = await asyncio.gather(*(self.availability.sold_out(game, d) for d in draws))
        snapshot = {"draws": [{"draw": c.draw, "combinations": c.combinations}
                              for c in lists if c.combinations or sub.draw is not None],
                    "at": instant(self.clock.now(), game.rules.tz)}
        key = parse_id(newest) or (0, 0)
        return [Event(key, 0, frame("snapshot", newest, snapshot))], key

    async def _never_trimmed(self, gid: str) -> bool:
        """Whether the game's stream still holds every entry ever added to it (so the
        point "0-0", a snapshot's taken while the stream was empty, lost nothing). Redis
        7's `entries-added` against `length`; False where Redis does not say."""
        try:
            reply = await self.store.feed_info(gid)
        except ResponseError:
            return False
        pairs = reply if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2],
                                                               strict=True))
        added, length = pairs.get(b"entries-added"), pairs.get(b"length")
        return added is not None and added == length

    async def backlog(self, game: Game, last: str, after: tuple[int, int],
                      newest: tuple[int, int], draw: int | None) -> list[Event] | None:
        """The events after `last` for a subscriber resuming, or None to start afresh: the
        stream no longer holds that point (trimmed, expired), or never held it (an id
        beyond its newest), or the subscriber is more than BACKLOG_EVENTS behind."""
        gid = game.rules.id
        if after > newest:
            return None
        oldest = await self.store.oldest_feed_entry(gid)
        if not oldest:  # nothing kept: nothing was missed only if nothing came since `last`
            return [] if after == newest else None
        if (parse_id(oldest[0][0].decode()) or (0, 0)) > after and not (
                after == (0, 0) and await self._never_trimmed(gid)):
            # Older than what the stream holds: trimmed away, or never issued by it; but
            # "0-0" is a snapshot's of a stream then empty, and if nothing was trimmed since,
            # everything after it is still there.
            return None
        gf = self._games.get(gid) or _GameFeed(self, game)
        events: list[Event] = []
        cursor, scanned = last, 0
        while True:
            try:
                entries = await self.store.feed_range(gid, cursor, BACKLOG_PAGE)
            except ResponseError:  # an id Redis does not take: start afresh
                return None
            for entry_id, fields in entries:
                event = gf.parse(entry_id, fields)
                if event is not None and (draw is None or event.draw == draw):
                    events.append(event)
            scanned += len(entries)
            if scanned > BACKLOG_EVENTS:  # counted in entries read, whatever `draw` keeps
                return None
            if len(entries) < BACKLOG_PAGE:
                return events
            cursor = entries[-1][0].decode()

    def subscribe(self, game: Game, sub: Subscriber, after: str) -> None:
        """Add a subscriber; the reader starts (after `after`) if it is not running. Once
        the feed is closed (the service drains), a 503."""
        if self.closed:
            raise unavailable("the service is stopping: subscribe to another instance", 1)
        gf = self._games.get(game.rules.id)
        if gf is None:
            gf = self._games[game.rules.id] = _GameFeed(self, game)
        gf.subscribers.add(sub)
        if gf.task is None:
            gf.last_id = after
            gf.task = asyncio.create_task(gf.run())

    def unsubscribe(self, game: Game, sub: Subscriber) -> None:
        gf = self._games.get(game.rules.id)
        if gf is not None:
            gf.subscribers.discard(sub)

    def drop(self, game: Game, sub: Subscriber) -> None:
        gf = self._games.get(game.rules.id)
        if gf is not None:
            gf.drop(sub)

    def reader_position(self, game: Game) -> str | None:
        gf = self._games.get(game.rules.id)
        return None if gf is None or gf.task is None else gf.last_id

    def check_closes(self, game: Game) -> None:
        """Announce, once for all processes, the draws the calendar has closed since the
        last look (the stream's `closed` events)."""
        gid = game.rules.id
        current = game.calendar.current(self.clock.now())
        # The first look announces the last close too, in case no process was reading
        # when it happened (announcing is idempotent).
        last = self._announced.get(gid, current - 1)
        self._announced[gid] = current
        if current <= last:
            return
        for draw in range(last, current):
            task = asyncio.create_task(self.announce_closed(game, draw))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def announce_closed(self, game: Game, draw: int) -> None:
        try:
            await self.store.feed_closed(game.rules.id, draw, game.expire_at(draw))
        except Exception as e:  # the next process to look announces it
            log.warning("closing draw %d of %s not announced: %s", draw, game.rules.id, e)

    async def close(self) -> None:
        """End every subscription (a drain) and take no new one: each connection gets its
        end and closes; one that has not read what it was sent is closed at once."""
        self.closed = True
        for gf in self._games.values():
            for sub in list(gf.subscribers):
                transport = sub.transport
                sub.end(abort=transport is not None and transport.get_write_buffer_size() > 0)
            gf.subscribers.clear()
            if gf.task is not None:
                gf.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await gf.task
