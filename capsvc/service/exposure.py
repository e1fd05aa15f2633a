"""A draw's exposure: what is at stake on it, and what its most played combinations would
cost the operator if drawn.

Keno is a fixed-odds game: the operator carries the risk the cap bounds. The figures come
from Redis, for every process alike:
- for the capped sizes, the stake, the combinations played, at their cap and at 80 % of
  it, and the 20 largest counters, from the counters themselves: read-only function calls
  over the draw's 4096 counter buckets, a chunk at a time so that the sales queued
  meanwhile are not held behind them;
- for the other sizes, the base stake accepted, from the draw's aggregates (one small hash
  per ticket slot, added to by each sale and taken back by each cancel, exactly once: see
  lua/capsvc.lua, AGGREGATES).
A computation is kept `CACHE_S` seconds (concurrent requests share it).
"""

from __future__ import annotations

import asyncio
import heapq
import time

from capsvc.client.models import CappedPicks, ExposureOut, PicksStake, TopCombination
from capsvc.domain import combination
from capsvc.domain.calendar import instant
from capsvc.domain.games import Game
from capsvc.redis.clock import RedisClock
from capsvc.redis.store import COUNTER_BUCKETS, Store, replies_of
from capsvc.service.caps import DrawCaps

CACHE_S = 5.0
"""How long a computed exposure is served again."""
CHUNK = 64
"""Counter buckets read per round trip: ~2 ms of Redis time with ~20 combinations a
bucket (a whole draw of 30,000 combinations is ~120 ms: 64 steps), so that the sales
queued meanwhile are not held long behind one call, and a draw's exposure still takes
well under a second on a busy worker."""
TOP = 20


class Exposure:
    """Exposure per draw, computed on demand and kept a few seconds."""

    def __init__(self, store: Store, caps: DrawCaps, clock: RedisClock) -> None:
        self.store = store
        self.caps = caps
        self.clock = clock
        self._cache: dict[tuple[str, int], tuple[float, asyncio.Task[ExposureOut]]] = {}

    async def of(self, game: Game, draw: int) -> ExposureOut:
        game.check_draw(draw)
        key = (game.rules.id, draw)
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is None or now - cached[0] > CACHE_S or (
                cached[1].done() and cached[1].exception() is not None):
            for k in [k for k, (at, _) in self._cache.items() if now - at > CACHE_S]:
                del self._cache[k]
            cached = (now, asyncio.ensure_future(self._compute(game, draw)))
            self._cache[key] = cached
        return await asyncio.shield(cached[1])

    async def _compute(self, game: Game, draw: int) -> ExposureOut:
        rules, gid = game.rules, game.rules.id
        cap, fixed = None, False
        if rules.cap_limit is not None:
            ((cap, fixed),) = await self.caps.in_force(game, draw, 1)
        stakes: dict[int, int] = {}
        for reply in await replies_of(self.store.aggregate_sums(gid, draw)):
            for i in range(0, len(reply), 2):
                picks = int(reply[i])
                stakes[picks] = stakes.get(picks, 0) + int(reply[i + 1])
        capped: dict[int, list[int]] = {}
        top: list[tuple[int, bytes]] = []
        if cap is not None:
            # One node holds every bucket: a call per chunk of them; a cluster: a call per
            # bucket (its own slot), a chunk of calls at a time. Between chunks the sales
            # queued meanwhile go first, and the 20th largest total so far keeps the replies
            # down to what may still enter the top.
            per_call = CHUNK if self.store.single_node else 1  # a cluster: CHUNK calls
            floor = 0
            for start in range(0, COUNTER_BUCKETS, CHUNK):
                end = min(start + CHUNK, COUNTER_BUCKETS)
                replies = await replies_of([
                    self.store.exposure_of(gid, range(b, min(b + per_call, end)), draw, cap,
                                           rules.min_stake, floor)
                    for b in range(start, end, per_call)])
                for stats, largest in replies:
                    for i in range(0, len(stats), 5):
                        row = capped.setdefault(int(stats[i]), [0, 0, 0, 0])
                        for j in range(4):
                            row[j] += int(stats[i + 1 + j])
                    top += [(int(largest[i + 1]), largest[i]) for i in range(0, len(largest), 2)]
                top = heapq.nlargest(TOP, top, key=lambda t: (t[0], [-b for b in t[1]]))
                if len(top) == TOP:
                    floor = top[-1][0] - 1  # ties with the 20th may still displace it
        for picks, row in capped.items():  # the capped sizes' stakes are their counters'
            stakes[picks] = stakes.get(picks, 0) + row[3]
        prizes = dict(rules.top_prizes)
        best = []
        for staked, combo in top:
            prize = prizes.get(len(combo))
            best.append(TopCombination(
                numbers=combination.decode(combo), staked=staked,
                liability=None if prize is None else staked * prize // rules.prize_base_stake))
        liabilities = [t.liability for t in best if t.liability is not None]
        return ExposureOut(
            draw=draw, cap=cap, cap_fixed=fixed,
            computed_at=instant(self.clock.now(), rules.tz),
            stakes=[PicksStake(picks=p, stake=v) for p, v in sorted(stakes.items()) if v],
            capped=[CappedPicks(picks=p, played=r[0], at_cap=r[1], near_cap=r[2], stake=r[3])
                    for p, r in sorted(capped.items())],
            top=best, top_liability=max(liabilities, default=None))

