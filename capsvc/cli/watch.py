"""`capsvc watch GAME`: a reference subscriber of the live sold-out feed.

An integrator's example as much as a tool. It subscribes to
`GET /v1/games/{game}/capped/stream`, prints each event as one line (its type, id and JSON
data), and when the connection drops it reconnects with `Last-Event-ID`, so that it
resumes after the last event it printed: the service sends what was missed, or a fresh
`snapshot` when it no longer keeps that point. Waits 1, 2, 4… up to 30 s between attempts.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TextIO

import aiohttp

from capsvc.client.api import sse_events

RETRY_MAX_S = 30.0


async def watch(base_url: str, game: str, token: str, draw: int | None = None,
                out: TextIO = sys.stdout, *, forever: bool = True) -> int:
    """Print the game's events until interrupted (or, `forever=False`, until the first
    disconnection). Returns an exit status: 1 when the service refuses the subscription."""
    url = f"{base_url.rstrip('/')}/v1/games/{game}/capped/stream"
    params = {} if draw is None else {"draw": str(draw)}
    last: str | None = None
    delay = 1.0
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=45)  # > heartbeat
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            headers = {"Authorization": f"Bearer {token}"}
            if last is not None:
                headers["Last-Event-ID"] = last
            try:
                async with session.get(url, params=params, headers=headers) as resp:
                    if resp.status != 200:
                        print(f"capsvc watch: {resp.status} {await resp.text()}",
                              file=sys.stderr)
                        if resp.status < 500:
                            return 1
                    else:
                        delay = 1.0
                        async for kind, event_id, data in sse_events(resp.content.iter_any()):
                            print(f"{kind} {event_id} {data}", file=out, flush=True)
                            last = event_id or last
            except (TimeoutError, aiohttp.ClientError) as e:
                print(f"capsvc watch: disconnected ({e or type(e).__name__})", file=sys.stderr)
            if not forever:
                return 0
            print(f"capsvc watch: reconnecting in {delay:.0f} s", file=sys.stderr)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)
