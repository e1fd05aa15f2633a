"""A sale in one call, sent alone through the store's one sale path (capsvc.redis.store,
`Store.sell` of a group of one), for tests and benches that drive the store directly."""

from __future__ import annotations

import asyncio
from typing import Any

from capsvc.redis.replies import Claim
from capsvc.redis.store import Store, record_of


def sell_alone(store: Store, ticket: str, sale: bytes, close_ms: int,
               expire_at: int, stale_after_ms: int, game: str, first_draw: int, draws: int,
               caps: str | int, min_stake: int, grids: list[tuple[str, int]],
               expiries: list[int], time_zone: str, fix_caps: bool = True
               ) -> asyncio.Future[Claim]:
    """One sale queued with the tick's others; its claim."""
    judged = [int(c) for c in str(caps).split("/")[0].split(",")]  # the caps, as a list
    shape = store.shape(game, first_draw, draws, close_ms, expire_at, stale_after_ms, caps,
                        judged, min_stake, time_zone, fix_caps, expiries)
    group = store.sell([store.sale_call(shape, ticket, record_of(ticket), sale, grids)])
    out: asyncio.Future[Claim] = asyncio.get_running_loop().create_future()

    def first(done: asyncio.Future[Any]) -> None:
        if done.cancelled():
            out.cancel()
        elif done.exception() is not None:
            out.set_exception(done.exception())  # type: ignore[arg-type]
        else:
            out.set_result(done.result()[0])

    group.add_done_callback(first)
    return out
