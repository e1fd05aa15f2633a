"""The Redis store: key names, the Lua steps, and what their replies mean.

The only module that knows how capsvc's state is laid out in Redis (see lua/capsvc.lua for
the keys and the states of a ticket). Every key carries a hash tag, so the store works
unchanged on Redis Cluster: a combination's counters and holds share a slot, as do a
ticket record and its pending index.

Calls go through a transport (`Coalescer`, or `ClusterCoalescer` per node): `submit`
queues a command into the current tick's pipeline and returns a future, so a caller can
issue several independent steps and await them together without an extra round trip.
"""

from __future__ import annotations

import asyncio
import zlib
from importlib import resources
from typing import Any

from capsvc.coalesce import Transport

LIBRARY = "capsvc"
TICKET_BUCKETS = 64
"""Ticket records are spread over this many hash tags, each with its own pending index."""


def lua_source() -> str:
    return resources.files("capsvc.lua").joinpath("capsvc.lua").read_text("utf-8")


def ticket_tag(bucket: int) -> str:
    """The hash tag of one of the ticket buckets."""
    return f"{{t:{bucket}}}"


def ticket_key(channel: str, ticket_id: str) -> str:
    ident = f"{channel}/{ticket_id}"
    return f"t:{ticket_tag(zlib.crc32(ident.encode()) % TICKET_BUCKETS)}:{ident}"


def channel_of(ticket: str) -> str:
    """The channel of a ticket record's key."""
    return ticket[ticket.index("}:") + 2 :].rsplit("/", 1)[0]


def _tag_of(ticket: str) -> str:
    return ticket[2 : ticket.index("}") + 1]


def pending_key_of(ticket: str) -> str:
    """The pending index in the same slot as the ticket record `ticket`."""
    return "p:" + _tag_of(ticket)


def stop_keys_of(ticket: str, game: str, first_draw: int, draws: int) -> list[str]:
    """The stop-sale copies of a ticket's draws, in the ticket record's slot."""
    prefix = f"s:{_tag_of(ticket)}:{game}:"
    return [f"{prefix}{d}" for d in range(first_draw, first_draw + draws)]


def stop_copy_key(bucket: int, game: str, draw: int) -> str:
    """The stop-sale copy of a draw in one ticket bucket (what `stop_keys_of` names)."""
    return f"s:{ticket_tag(bucket)}:{game}:{draw}"


def pending_key(bucket: int) -> str:
    return f"p:{ticket_tag(bucket)}"


def hold_key(game: str, combo: str) -> str:
    return f"h:{{{game}:{combo}}}"


def counter_keys(game: str, combo: str, first_draw: int, draws: int) -> list[str]:
    prefix = f"c:{{{game}:{combo}}}:"
    return [f"{prefix}{d}" for d in range(first_draw, first_draw + draws)]


def stop_key(game: str, draw: int) -> str:
    return f"s:{{{game}}}:{draw}"


def capped_key(game: str, draw: int) -> str:
    return f"x:{{{game}}}:{draw}"


def holder(channel: str, ticket_id: str, grid: int) -> str:
    return f"{channel}/{ticket_id}/{grid}"


class Store:
    """capsvc's operations on Redis, each one atomic step (a Lua function) or one read."""

    def __init__(self, redis: Transport) -> None:
        self.redis = redis
        self._source = lua_source()

    async def load_library(self) -> None:
        """Install (or replace) the Lua library on every primary; idempotent, safe from
        every process."""
        await self.redis.broadcast("FUNCTION", "LOAD", "REPLACE", self._source)

    async def library_loaded(self) -> bool:
        replies = await self.redis.broadcast("FUNCTION", "LIST", "LIBRARYNAME", LIBRARY)
        return all(bool(r) for r in replies)

    def fcall(self, name: str, keys: list[str], args: list[Any]) -> asyncio.Future[Any]:
        """Queue one FCALL (the transport reloads the library if Redis lost it)."""
        return self.redis.submit("FCALL", name, len(keys), *keys, *args)

    # -- tickets ---------------------------------------------------------------------------

    def claim(
        self, ticket: str, game: str, first_draw: int, draws: int, fingerprint: str,
        sale: bytes, close_ms: int, expire_at: int, stale_after_ms: int,
    ) -> asyncio.Future[Any]:
        keys = [ticket, pending_key_of(ticket), *stop_keys_of(ticket, game, first_draw, draws)]
        return self.fcall(
            "capsvc_claim", keys, [fingerprint, sale, close_ms, expire_at, stale_after_ms]
        )

    def finalize(self, ticket: str, at: int, body: bytes) -> asyncio.Future[Any]:
        return self.fcall("capsvc_finalize", [ticket, pending_key_of(ticket)], [at, body])

    def unclaim(self, ticket: str, at: int) -> asyncio.Future[Any]:
        return self.fcall("capsvc_unclaim", [ticket, pending_key_of(ticket)], [at])

    def expire(self, ticket: str, claimed_before_ms: int) -> asyncio.Future[Any]:
        return self.fcall("capsvc_expire", [ticket, pending_key_of(ticket)], [claimed_before_ms])

    def cancel(self, ticket: str, close_ms: int, released: int) -> asyncio.Future[Any]:
        return self.fcall("capsvc_cancel", [ticket], [close_ms, released])

    def ticket(self, ticket: str) -> asyncio.Future[Any]:
        """[state, body, sale, claim time] of a ticket record (all None when unknown)."""
        return self.redis.submit("HMGET", ticket, "st", "body", "sale", "at")

    def pending(self, bucket: int, claimed_before_ms: int, limit: int) -> asyncio.Future[Any]:
        return self.redis.submit(
            "ZRANGEBYSCORE", pending_key(bucket), "-inf", f"({claimed_before_ms}",
            "LIMIT", 0, limit,
        )

    # -- combinations ----------------------------------------------------------------------

    def reserve(
        self, game: str, combo: str, who: str, stake: int, cap: int, min_stake: int,
        first_draw: int, expire_at: list[int], close_ms: int,
    ) -> asyncio.Future[Any]:
        """Count `stake` on every draw of the grid, or none; `close_ms=0` only reads."""
        keys = [hold_key(game, combo), *counter_keys(game, combo, first_draw, len(expire_at))]
        return self.fcall(
            "capsvc_reserve", keys, [who, stake, cap, close_ms, min_stake, *expire_at]
        )

    def release(
        self, game: str, combo: str, who: str, cap: int, min_stake: int, first_draw: int,
        draws: int,
    ) -> asyncio.Future[Any]:
        keys = [hold_key(game, combo), *counter_keys(game, combo, first_draw, draws)]
        return self.fcall("capsvc_release", keys, [who, cap, min_stake])

    def counters(self, game: str, combo: str, first_draw: int, draws: int) -> asyncio.Future[Any]:
        return self.redis.submit("MGET", *counter_keys(game, combo, first_draw, draws))

    def counters_of(self, game: str, draw: int, combos: list[str]) -> list[asyncio.Future[Any]]:
        """Counters of several combinations for one draw (one GET each: several slots)."""
        return [self.redis.submit("GET", counter_keys(game, c, draw, 1)[0]) for c in combos]

    def mark_sold_out(self, game: str, draw: int, combo: str, expire_at: int) -> None:
        """Add to the draw's sold-out list (advisory; the counters stay the authority)."""
        key = capped_key(game, draw)
        self.redis.send("SADD", key, combo)
        self.redis.send("PEXPIREAT", key, expire_at)

    def unmark_sold_out(self, game: str, draw: int, combo: str) -> None:
        self.redis.send("SREM", capped_key(game, draw), combo)

    def sold_out(self, game: str, draw: int) -> asyncio.Future[Any]:
        return self.redis.submit("SMEMBERS", capped_key(game, draw))

    # -- draws -----------------------------------------------------------------------------

    def stops(self, game: str, first_draw: int, draws: int) -> asyncio.Future[Any]:
        """When sales of each draw were stopped by an admin (ms), or None."""
        return self.redis.submit(
            "MGET", *[stop_key(game, d) for d in range(first_draw, first_draw + draws)]
        )

    async def stop(self, game: str, draw: int, at_ms: int, expire_at: int) -> None:
        """Stop sales of a draw from `at_ms` on (the first stop wins; idempotent).

        The stop is copied into every ticket slot, where the claim checks it atomically;
        the game-wide key, written last, is what status reads see.
        """
        copies = [
            self.redis.submit("SET", stop_copy_key(b, game, draw), at_ms, "NX", "PXAT",
                              expire_at)
            for b in range(TICKET_BUCKETS)
        ]
        for f in copies:
            await f
        await self.redis.submit("SET", stop_key(game, draw), at_ms, "NX", "PXAT", expire_at)


def limit_key(player: str) -> str:
    return f"l:{{pl:{player}}}"


def budget_key(player: str, day: str) -> str:
    return f"b:{{pl:{player}}}:{day}"


def _settle_command(player: str, ref: str, shares: list[tuple[str, int]]) -> tuple[Any, ...]:
    keys = [budget_key(player, day) for day, _ in shares]
    return ("FCALL", "capsvc_settle", len(keys), *keys, ref, *[amount for _, amount in shares])


class PlayerStore:
    """The player-budget steps (games with a daily limit), over the same transport."""

    def __init__(self, store: Store) -> None:
        self.fcall = store.fcall
        self.redis = store.redis

    def reserve(self, player: str, ref: str, regulatory: int, expire_at: int,
                shares: list[tuple[str, int]]) -> asyncio.Future[Any]:
        """Take `shares` ((day, amount) pairs) from the player's budgets, all or nothing;
        `expire_at=0` only reads what `ref` took."""
        keys = [limit_key(player), *[budget_key(player, day) for day, _ in shares]]
        return self.fcall("capsvc_budget", keys, [
            ref, regulatory, expire_at, *[day for day, _ in shares],
            *[amount for _, amount in shares]])

    def settle(self, player: str, ref: str, shares: list[tuple[str, int]]) -> asyncio.Future[Any]:
        """Make `ref` hold exactly `shares` (amount 0: give back); idempotent."""
        return self.redis.submit(*_settle_command(player, ref, shares))

    def settle_later(self, player: str, ref: str, shares: list[tuple[str, int]]) -> None:
        """`settle` without waiting (a lost one is redone by a replay or the janitor)."""
        self.redis.send(*_settle_command(player, ref, shares))

    def set_limit(self, player: str, value: int | None, today: str, tomorrow: str,
                  expire_at: int) -> asyncio.Future[Any]:
        return self.fcall("capsvc_set_limit", [limit_key(player), budget_key(player, today)],
                          ["none" if value is None else value, today, tomorrow, expire_at])

    def state(self, player: str, today: str) -> asyncio.Future[Any]:
        return self.fcall("capsvc_player", [limit_key(player), budget_key(player, today)],
                          [today])
