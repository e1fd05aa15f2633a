"""Ticket records read and written by tests (lua/capsvc.lua, TICKET RECORDS): each a field
of a bucket hash."""

from __future__ import annotations

import os
import struct
from typing import Any

import redis

from capsvc.redis.store import (
    PlayerStore,
    Store,
    budget_key,
    ident_of,
    limit_key,
    pending_key_of,
    record_bucket_of,
    stop_copy_of,
)

NAMES = ("st", "at", "sid", "sale", "body", "res", "ca", "rel")


def unpack(raw: bytes) -> list[Any]:
    """The MessagePack objects, one after the other, of a bucketed record: what Redis's
    cmsgpack writes for it (nil, booleans, integers, doubles, strings as raw bytes)."""
    out: list[Any] = []
    i = 0
    while i < len(raw):
        b = raw[i]
        i += 1
        if b <= 0x7F:
            out.append(b)
        elif 0xA0 <= b <= 0xBF or b in (0xD9, 0xDA, 0xDB):
            size_bytes = {0xD9: 1, 0xDA: 2, 0xDB: 4}.get(b, 0)
            n = b & 0x1F if not size_bytes else int.from_bytes(raw[i:i + size_bytes], "big")
            i += size_bytes
            out.append(raw[i:i + n])
            i += n
        elif b == 0xC0:
            out.append(None)
        elif b in (0xC2, 0xC3):
            out.append(b == 0xC3)
        elif b >= 0xE0:
            out.append(b - 0x100)
        elif b in (0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD1, 0xD2, 0xD3):
            n = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}[b]
            out.append(int.from_bytes(raw[i:i + n], "big", signed=b >= 0xD0))
            i += n
        elif b == 0xCB:
            out.append(struct.unpack(">d", raw[i:i + 8])[0])
            i += 8
        else:
            raise ValueError(f"not what cmsgpack writes: 0x{b:02x}")
    return out


def pack(values: list[Any]) -> bytes:
    """`unpack`'s inverse, for what a test writes (None, integers, strings, bytes)."""
    out = b""
    for v in values:
        if v is None:
            out += b"\xc0"
        elif isinstance(v, int):
            out += b"\xd3" + v.to_bytes(8, "big", signed=True)
        else:
            data = v if isinstance(v, bytes) else str(v).encode()
            out += b"\xdb" + len(data).to_bytes(4, "big") + data
    return out


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


class TicketRecords:
    """What a ticket record holds."""

    def __init__(self, db: redis.Redis) -> None:
        self.db = db

    def _value(self, ticket: str) -> tuple[int, dict[bytes, bytes]] | None:
        raw = self.db.hget(record_bucket_of(ticket), ident_of(ticket))
        if raw is None:
            return None
        expiry, *values = unpack(raw)
        values[2] = values[2].hex().encode()  # the sale id, kept as its 8 bytes
        return expiry, {n.encode(): _bytes(v) for n, v in zip(NAMES, values, strict=True)
                        if v is not None}

    def fields(self, ticket: str) -> dict[bytes, bytes]:
        """The record's fields ({} when there is none; an expired one is still shown)."""
        value = self._value(ticket)
        return {} if value is None else value[1]

    def get(self, ticket: str, *names: str) -> Any:
        """One field (None when absent), or a list of them."""
        fields = self.fields(ticket)
        got = [fields.get(n.encode()) for n in names]
        return got[0] if len(names) == 1 else got

    def exists(self, ticket: str) -> int:
        return 1 if self.fields(ticket) else 0

    def expiry(self, ticket: str) -> int:
        """The instant (ms) the record is kept until; -2 when there is none."""
        value = self._value(ticket)
        return -2 if value is None else value[0]

    def put(self, ticket: str, expire_at: int, **fields: Any) -> None:
        """Write a record (for states no call leads to)."""
        values = [fields.get(n) for n in NAMES]
        if values[2] is not None:  # the sale id, kept as its 8 bytes
            values[2] = bytes.fromhex(values[2] if isinstance(values[2], str)
                                      else values[2].decode())
        packed = pack([expire_at, *values])
        self.db.hset(record_bucket_of(ticket), ident_of(ticket), packed)


def held(db: redis.Redis, ticket: str, name: str) -> bytes | None:
    """One field of a ticket's record (None when absent)."""
    value: bytes | None = TicketRecords(db).get(ticket, name)
    return value


# -- the Lua functions' raw replies (lua/capsvc.lua), for the tests of the Lua itself; the
# store decodes them (capsvc.redis.replies) -----------------------------------------------

def raw_claim(store: Store, key: str, sale: bytes, close_ms: int, expire_at: int,
              stale_after_ms: int) -> Any:
    keys, args = store.names(key)
    return store.fcall("capsvc_claim", [*keys, pending_key_of(key)], [
        *args, sale, close_ms, expire_at, stale_after_ms, os.urandom(8).hex()])


def raw_ticket(store: Store, key: str) -> Any:
    keys, args = store.names(key)
    return store.fcall("capsvc_ticket", keys, args)


def raw_expire(store: Store, key: str, deadline_ms: int) -> Any:
    keys, args = store.names(key)
    return store.fcall("capsvc_expire", keys, [*args, deadline_ms])


def raw_cancel(store: Store, key: str, close_ms: int, game: str, first_draw: int,
               released: int, expire_at: int) -> Any:
    keys, args = store.names(key)
    return store.fcall("capsvc_cancel", [*keys, stop_copy_of(key), pending_key_of(key)],
                       [*args, close_ms, f"{game}:{first_draw}", released, expire_at])


class RawPlayers(PlayerStore):
    """The player-budget steps answering the Lua's raw replies (the store decodes them:
    capsvc.redis.replies), for the tests of the Lua itself."""

    def reserve(self, player: str, ref: str, regulatory: int, expire_at: int,  # type: ignore[override]
                shares: list[tuple[str, int]], *, seal: bool = False, restore: bool = False
                ) -> Any:
        keys = [limit_key(player), *[budget_key(player, day) for day, _ in shares]]
        mode = "seal" if seal else "restore" if restore else "take"
        return self.fcall("capsvc_budget", keys, [
            ref, regulatory, expire_at, mode,
            *[day for day, _ in shares], *[amount for _, amount in shares]])

    def stake(self, player: str, ref: str, regulatory: int, expire_at: int,  # type: ignore[override]
              days: list[str], amount: int) -> Any:
        keys = [limit_key(player), *[budget_key(player, day) for day in days]]
        return self.fcall("capsvc_stake", keys, [ref, regulatory, expire_at, days[0], amount])

    def set_limit(self, player: str, value: int | None, today: str,  # type: ignore[override]
                  tomorrow: str, expire_at: int, at: int) -> Any:
        return self.fcall("capsvc_set_limit", [limit_key(player), budget_key(player, today)],
                          ["none" if value is None else value, today, tomorrow, expire_at, at])

    def state(self, player: str, today: str) -> Any:  # type: ignore[override]
        return self.fcall("capsvc_player", [limit_key(player), budget_key(player, today)],
                          [today])
