"""Durability modes: when a sale or a cancellation may be answered.

`default`: as soon as Redis has run the writes, i.e. they are in the primary's memory (and
in its AOF within `appendfsync`'s delay). A host crash or a failover to a replica that had
not yet received them loses those accepted stakes.

`replicas:N`: after the writes, Redis `WAIT N wait_timeout` on the same connection(s)
(capsvc.coalesce: every WAIT of a tick is one command that follows every write queued
before it). Fewer than N acknowledgements in time means the outcome is unknown: the writes
are on the primary and may or may not survive it, so the answer is 503 and the client
sends the same request again, which converges to the one recorded decision.

What `replicas:N` does not cover: WAIT counts the writes of its own connection, so the
replay of a decision recorded through another connection (another worker process, or before
a reconnection) is confirmed only as far as this connection has written; and a replica
acknowledges receipt, not an fsync of its own AOF.
"""

from __future__ import annotations

import logging

from redis.exceptions import ResponseError

from capsvc.coalesce import Transport
from capsvc.errors import Unavailable, unavailable

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
