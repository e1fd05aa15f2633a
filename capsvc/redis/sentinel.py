"""Redis Sentinel: which node is the primary of a service now, and when that changes.

The only module that speaks to sentinels. `capsvc.redis.transport` asks `Sentinels.locate()` for
the primary's address before every connection (and checks `ROLE` on the node itself, as
the Sentinel client protocol asks: a sentinel's answer can be stale), and runs
`Sentinels.watch()` to hear `+switch-master` as soon as a failover is decided, so that no
command goes on to a demoted node. It knows nothing of capsvc's keys or steps.

The URL is the one the `limits` library and redis-py's Sentinel support use::

    redis+sentinel://[user:password@]host:port[,host:port…]/service_name[?db=N]
    rediss+sentinel://…      (TLS to the sentinels and to the primary)

The credentials are the data nodes'; sentinels that need their own are given
`sentinel_username` / `sentinel_password` in the query.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from typing import Any, Protocol

import hiredis
from redis.exceptions import ResponseError

from capsvc.domain.errors import Unavailable
from capsvc.urls import (
    Address,
    SentinelURL,
)

log = logging.getLogger(__name__)

_WATCH_RETRY_S = 0.5
"""Pause before the switch watcher tries the next sentinel after losing one."""

def _tls(on: bool) -> ssl.SSLContext | None:
    return ssl.create_default_context() if on else None


class _Conversation:
    """One plain connection to a sentinel: commands in, replies out (hiredis)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.parser = hiredis.Reader(replyError=ResponseError)

    async def reply(self) -> Any:
        while (reply := self.parser.gets()) is False:
            data = await self.reader.read(65536)
            if not data:
                raise ConnectionResetError("the sentinel closed the connection")
            self.parser.feed(data)
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    async def ask(self, *args: Any) -> Any:
        self.writer.write(hiredis.pack_command(args))
        return await self.reply()

    def close(self) -> None:
        self.writer.close()


class Sentinels:
    """The sentinels of one service: where its primary is, and a watch on its switches."""

    def __init__(self, url: SentinelURL, timeout_s: float) -> None:
        self.url = url
        self._order = list(url.sentinels)
        """Sentinels in the order they are asked: the last one that answered first."""
        self._timeout = timeout_s

    async def _open(self, address: Address) -> _Conversation:
        reader, writer = await asyncio.open_connection(*address, ssl=_tls(self.url.tls))
        talk = _Conversation(reader, writer)
        u = self.url
        if u.sentinel_password is not None:
            auth = (u.sentinel_password,) if u.sentinel_username is None else (
                u.sentinel_username, u.sentinel_password)
            await talk.ask("AUTH", *auth)
        return talk

    async def locate(self) -> Address:
        """The primary's address as the first sentinel that knows the service says; raises
        Unavailable when none does (no primary known: the caller answers 503)."""
        problems = []
        for address in list(self._order):
            talk = None
            try:
                async with asyncio.timeout(self._timeout):
                    talk = await self._open(address)
                    reply = await talk.ask("SENTINEL", "GET-MASTER-ADDR-BY-NAME",
                                           self.url.service)
                if not reply:
                    problems.append(f"{address[0]}:{address[1]}: does not know "
                                    f"{self.url.service!r}")
                    continue
                primary = _address(reply)
            except Exception as e:  # a sentinel down, slow, refusing or talking nonsense
                problems.append(f"{address[0]}:{address[1]}: {e or type(e).__name__}")
                continue
            finally:
                if talk is not None:
                    talk.close()
            self._order.remove(address)
            self._order.insert(0, address)  # the client protocol: ask it first next time
            return primary
        raise Unavailable(f"no sentinel gives a primary for {self.url.service!r}: "
                          + "; ".join(problems))

    async def watch(self, events: FailoverEvents) -> None:
        """Forever: listen to every sentinel (a failover's early steps are announced by
        its leader alone, and each sentinel announces the switch when it learns it) and
        tell `events` of this service's failovers."""
        await asyncio.gather(*(self._listen(address, events) for address in self._order))

    async def _listen(self, address: Address, events: FailoverEvents) -> None:
        while True:
            talk = None
            try:
                async with asyncio.timeout(self._timeout):
                    talk = await self._open(address)
                    await talk.ask("SUBSCRIBE", *_CHANNELS)
                while True:
                    message = await talk.reply()
                    if message[0] == b"message":
                        self._tell(events, message[1].decode(), message[2].decode())
            except asyncio.CancelledError:
                raise
            except Exception as e:  # down, gone, or talking nonsense: try it again later
                log.debug("sentinel %s:%s: %r", *address, e)
            finally:
                if talk is not None:
                    with contextlib.suppress(Exception):
                        talk.close()
            await asyncio.sleep(_WATCH_RETRY_S)

    def _tell(self, events: FailoverEvents, channel: str, payload: str) -> None:
        words = payload.split(" ")
        if channel == "+switch-master":
            name, _old_host, _old_port, host, port = words
            if name == self.url.service:
                events.switched(_address([host.encode(), port.encode()]))
            return
        # "<type> <name> <ip> <port> @ <master> <master ip> <master port>" (a replica), or
        # "master <name> <ip> <port>" (the failover's own primary).
        master = words[5] if len(words) >= 8 and words[4] == "@" else words[1]
        if master != self.url.service:
            return
        if channel in _STARTING:
            events.starting()
        else:
            events.aborted()


class FailoverEvents(Protocol):
    """What a failover's listener is told (capsvc.redis.transport acts on it)."""

    def starting(self) -> None:
        """A replica was chosen to be promoted: from now on the old primary's answers can
        be lost with it (another replica may still acknowledge writes the promoted one
        never gets): stop using it."""

    def switched(self, address: Address) -> None:
        """The sentinels name this primary now."""

    def aborted(self) -> None:
        """The failover was given up: the old primary stays."""


_STARTING = ("+selected-slave", "+failover-state-send-slaveof-noone", "+promoted-slave")
_CHANNELS = ("+switch-master", *_STARTING, "-failover-abort-not-elected",
             "-failover-abort-no-good-slave", "-failover-abort-slave-timeout",
             "+failover-end-for-timeout")


def _address(reply: Any) -> Address:
    """A primary's address as a sentinel gives it (`[host, port]`); ValueError if it is
    not one."""
    if not (isinstance(reply, list) and len(reply) == 2
            and all(isinstance(part, bytes) for part in reply)):
        raise ValueError(f"not an address: {reply!r:.80}")
    host, port = reply[0].decode("utf-8", "replace"), int(reply[1])
    if not host or not 0 < port < 65536:
        raise ValueError(f"not an address: {reply!r:.80}")
    return host, port
