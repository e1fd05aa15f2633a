"""Durability modes: when an answer that reports a decision may be sent.

`default`: as soon as Redis has run the writes, i.e. they are in the primary's memory (and
in its AOF within `appendfsync`'s delay). A host crash or a failover to a replica that had
not yet received them loses those accepted stakes.

`replicas:N`: every answer that reports a decision — a sale's first answer, its replay,
`GET` of a ticket, a cancel and its replay, an admin stop, a player's limit or stake — is
sent only once N replicas have everything Redis had run when the decision was read or
made: Redis `WAIT N wait_timeout` behind a fence write of the same connection
(capsvc.redis.transport: the WAITs of a tick are one command, after every write queued before it).
The fence makes it independent of how a Redis version counts a connection's writes: a
replay or a GET reads a decision another connection (another process, or this one before a
reconnection) wrote, and a read alone may not raise what WAIT waits for. Fewer than N
acknowledgements in time means the outcome is unknown: the decision is on the primary and
may or may not survive it, so the answer is 503 and the client sends the same request
again, which converges to the one recorded decision (or finds none, after a failover that
lost it: then the sale is judged anew).

What `replicas:N` does not cover: a replica acknowledges receipt, not an fsync of its own
AOF; and WAIT does not make Redis refuse a write (a decision answered 503 may still be on
the primary, and survive it).
"""

from __future__ import annotations

import logging

from redis.exceptions import ResponseError

from capsvc.domain.errors import Unavailable, unavailable
from capsvc.redis.transport import Transport

log = logging.getLogger(__name__)


class Durability:
    """What a sale or a cancellation waits for before it is answered."""

    def __init__(self, redis: Transport, replicas: int, wait_timeout_ms: int,
                 retry_after_s: int) -> None:
        self.redis = redis
        self.replicas = replicas
        """0: default mode, no extra step."""
        self.wait_timeout_ms = wait_timeout_ms
        self.retry_after_s = retry_after_s
        self._confirming = True
        """False during an outage, so that it is logged once, not once per request."""

    async def confirm(self) -> None:
        """Return once the writes issued so far are on enough replicas; else raise 503."""
        if not self.replicas:
            return
        try:
            acked = await self.redis.wait_replicas(self.replicas, self.wait_timeout_ms)
        except (Unavailable, ResponseError) as e:
            # What went before the WAIT may have run: an unknown outcome, not "nothing
            # recorded" (the dispatcher's answer to Unavailable).
            log.debug("WAIT failed: %s", e)
            acked = -1
        if acked >= self.replicas:
            if not self._confirming:
                log.info("replicas acknowledge writes again")
                self._confirming = True
            return
        if self._confirming:
            log.warning("fewer than %d replica(s) acknowledged writes within %d ms (got %d): "
                        "sales and cancellations answer 503 until they do", self.replicas,
                        self.wait_timeout_ms, max(acked, 0))
            self._confirming = False
        raise unavailable(
            f"outcome unknown: the operation may have been recorded, but fewer than "
            f"{self.replicas} replica(s) confirmed it within {self.wait_timeout_ms} ms; send "
            "the same request again (it converges to one decision), or GET "
            "/v1/tickets/{ticket_id} to see what was recorded", self.retry_after_s)
