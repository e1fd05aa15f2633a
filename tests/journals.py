"""Journals of N decisions, written by the product's own recorder and writer, for the
restore's tests and bench (bench/restore.py): no service, no Redis, each decision made by the
functions a sale makes it with (validation, the decision's body), against caps kept here.

`one-grid`: every ticket one capped grid of 8-10 numbers, an allowed stake, one draw (the
one-grid sale mix), each sold in one call (a `sales` line, as on a standalone Redis).
`mixed`: 1-5 grids of 2-10 numbers, a hot set of combinations driven to their cap (partial
and rejected decisions), 15 % subscriptions, the player-limited game (budgets, a ticket
refused by the player's limit), half of the sales in one call and half in steps (`sale`
lines, as on a cluster), replays, cancels (of tickets just sold), voids (some followed by a
new sale of the same ticket id), stops, caps, self-limits and other games' stakes.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from capsvc.client.models import TicketIn
from capsvc.config import GameRules
from capsvc.domain.decisions import ACCEPTED, REJECTED, Reserved, budget_plan, render, results_of
from capsvc.domain.games import Catalog, Game
from capsvc.domain.validator import Sale, validate_ticket
from capsvc.journal.recorder import Recorder
from capsvc.journal.writer import open_journal
from capsvc.redis.replies import PlayerLimits
from tests.decisions import build_decision, player_limit_decision

CONFIG = """
[[games]]
id = "fdj-keno"
preset = "fdj-keno-2008"

[[games]]
id = "lnm-keno"
preset = "lnm-keno"

[[channels]]
id = "fr-retail"
token_sha256 = "d58a61f7def14e593497565c808f47429d70cedcdc71c2e61888215206ac936b"
games = ["fdj-keno", "lnm-keno"]
scopes = ["sell", "read", "admin"]
"""
"""The games a generated journal's decisions are of (its channel's token is `t-fr`)."""
MIXES = ("one-grid", "mixed")
BATCH = 4096
"""Records appended before waiting for them (the writer's bound on what waits is 8 MiB)."""


def write_config(path: Path) -> Path:
    path.write_text(CONFIG)
    return path


class _Model:
    """What the sales generated so far hold: each game's counters (its cap's live rule) and
    the caps fixed."""

    def __init__(self, caps: dict[str, int]) -> None:
        self.live = {game: LiveCaps(cap) for game, cap in caps.items()}
        self.caps_seen: set[tuple[str, int]] = set()

    def judge(self, sale: Sale) -> list[Reserved | None]:
        """Reserve replies as Redis would give them (None: not capped)."""
        return self.live[sale.game].judge(sale)

    def give_back(self, sale: Sale, accepted: set[int]) -> None:
        self.live[sale.game].give_back(sale, accepted)


class _Tickets:
    """Seeded ticket bodies of one mix."""

    def __init__(self, rng: random.Random, mix: str, catalog: Catalog) -> None:
        self.rng = rng
        self.mix = mix
        self.catalog = catalog
        self.hot = {gid: [self._numbers(g.rules, rng.randint(8, 10)) for _ in range(20)]
                    for gid, g in catalog.games.items()}

    def _numbers(self, rules: GameRules, picks: int) -> list[int]:
        return self.rng.sample(range(1, rules.numbers + 1), picks)

    def body(self, n: int, game: Game, first_draw: int) -> dict[str, Any]:
        rng, rules = self.rng, game.rules
        if self.mix == "one-grid":
            grids = [{"numbers": self._numbers(rules, rng.randint(8, 10)),
                      "stake": rng.choice(rules.stakes)}]
            draws = 1
        else:
            grids = []
            for _ in range(rng.randint(1, 5)):
                numbers = (rng.choice(self.hot[rules.id]) if rng.random() < 0.2
                           else self._numbers(rules, rng.randint(2, 10)))
                grids.append({"numbers": numbers, "stake": rng.choice(rules.stakes)})
            r = rng.random()
            draws = 10 if r < 0.05 else 5 if r < 0.10 else 2 if r < 0.15 else 1
        body: dict[str, Any] = {"ticket_id": f"G-{n}", "game": rules.id, "grids": grids,
                                "first_draw": first_draw, "draws": draws}
        if rules.daily_limit is not None:
            body["player_id"] = f"P-{rng.randrange(20_000)}"
        return body


def decisions(catalog: Catalog, n: int, mix: str, seed: int, now_ms: int
              ) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """(Recorder method, arguments) of `n` decisions of `mix` (see the module's
    docstring), with the cap records, replays, cancels and the rest the mix has."""
    rng = random.Random(seed)
    tickets = _Tickets(rng, mix, catalog)
    games = [catalog.games["fdj-keno"]] + ([catalog.games["lnm-keno"]] if mix == "mixed"
                                           else [])
    model = _Model({g.rules.id: g.rules.cap_limit or 0 for g in games})
    current = {g.rules.id: g.calendar.current(now_ms) for g in games}
    sold: list[tuple[Game, Sale, str, int, bytes, set[int]]] = []
    made = 0
    i = 0
    while made < n:
        i += 1
        at = now_ms - (n - made)  # one a millisecond, the newest now
        game = games[0] if len(games) == 1 or rng.random() < 0.7 else games[1]
        rules = game.rules
        first = current[rules.id] + rng.randint(1, rules.sales_horizon - 10)
        sale = validate_ticket(rules, msgspec.convert(tickets.body(i, game, first),
                                                      TicketIn))
        sale = msgspec.structs.replace(sale, first_draw=first)
        sid = f"{rng.getrandbits(64):016x}"
        until = game.expire_at(first + sale.draws - 1)
        if mix == "mixed" and rng.random() < 0.005:  # abandoned before its decision
            yield "void", ("abandoned", "fr-retail", sale, sid, at, until)
            made += 1
            if rng.random() < 0.8:
                continue
            sid = f"{rng.getrandbits(64):016x}"  # the ticket id sold again: another sale
        capped = any(g.capped for g in sale.grids)
        for d in range(first, first + sale.draws):
            if capped and (rules.id, d) not in model.caps_seen:
                model.caps_seen.add((rules.id, d))
                yield "cap", (rules.id, d, rules.cap_limit, game.expire_at(d))
        replies: list[Reserved | None] | None = None
        if rules.daily_limit is not None and rng.random() < 0.02:
            out = player_limit_decision(sale)
        else:
            replies = model.judge(sale)
            out = build_decision("fr-retail", rules.tz, sale, sid, at, replies)
        body = msgspec.json.encode(out)
        caps = [rules.cap_limit or 0] * sale.draws
        if mix == "mixed" and rng.random() < 0.5:  # sold in steps (a cluster's sales)
            yield "sale", ("answer", "fr-retail", sale, sid, at, body, until, caps)
        else:  # sold in one call, as a standalone Redis sells: a `sales` line
            results = results_of(rules.time_zone, replies)
            assert render("fr-retail", sale, sid, at, results)[0] == body
            yield "sale", ("answer", "fr-retail", sale, sid, at, body, until, caps, results)
        made += 1
        accepted = {g.index for g in out.grids if g.status == "accepted"}
        if mix != "mixed":
            continue
        sold.append((game, sale, sid, at, body, accepted))
        r = rng.random()
        if r < 0.05:  # a replay, a GET: the same decision again
            yield "sale", ("replay", "fr-retail", sale, sid, at, body, until, caps)
        elif r < 0.07 and sold:  # a cancel of one of the last tickets sold
            g, s, ssid, sat, sbody, acc = sold.pop(rng.randrange(max(0, len(sold) - 100),
                                                                 len(sold)))
            if acc and s.draws == 1:
                model.give_back(s, acc)
                released = msgspec.json.decode(sbody)["total_cost"]
                yield "cancel", ("answer", "fr-retail", s, ssid, sat, sbody,
                                 g.expire_at(s.first_draw or 0), at, released)
        elif r < 0.072:
            player = f"P-{rng.randrange(20_000)}"
            daily = rng.choice([100_000, 500_000, None])
            yield "limit", ("fr-retail", player, "lnm-keno", daily, at, at + 2 * 86_400_000,
                            PlayerLimits(daily, None, False, None, 0))
        elif r < 0.08:
            lnm = catalog.games["lnm-keno"]
            plan = budget_plan("fr-retail", lnm.rules, lnm.calendar, sale, sid, at, until)
            day = plan.purchase_day if plan else lnm.calendar.local_date(at).isoformat()
            yield "stake", ("fr-retail", f"P-{rng.randrange(20_000)}", "lnm-keno",
                            f"loto-{i}", rng.choice([200, 500, 700]), day, True, 0, at,
                            at + 2 * 86_400_000)
        elif r < 0.082:
            d = current[rules.id] + rng.randint(rules.sales_horizon - 9, rules.sales_horizon)
            yield "stop", ("fr-retail", rules.id, d, at, game.expire_at(d))
            if rng.random() < 0.1:  # reported again (another process journals it too)
                yield "stop", ("fr-retail", rules.id, d, at, game.expire_at(d))


async def write_journal(directory: Path, catalog: Catalog, n: int, mix: str = "one-grid",
                        seed: int = 1, now_ms: int | None = None, files: int = 1) -> int:
    """Write `n` decisions of `mix` into `directory` (`files`: processes writing one file
    each, the decisions dealt round-robin); returns the records written."""
    now = now_ms if now_ms is not None else int(time.time() * 1000)
    journals = [open_journal(directory, max_file_bytes=1 << 40, keep_ms=90 * 86_400_000,
                             proc=f"gen/{k}") for k in range(files)]
    recorders = [Recorder(j, lambda: now) for j in journals]
    waiting: list[asyncio.Future[None]] = []
    written = 0
    for k, (method, args) in enumerate(decisions(catalog, n, mix, seed, now)):
        rec = recorders[k % files]
        if method == "cap":
            rec.cap(*args)
        else:
            waiting.append(getattr(rec, method)(*args))
        written += 1
        if len(waiting) >= BATCH:
            await asyncio.gather(*waiting)
            waiting = []
    await asyncio.gather(*waiting)
    for j in journals:
        await j.aclose()
    return written


class LiveCaps:
    """The live rule: counters per (combination, draw), one cap."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.counters: dict[tuple[str, int], int] = {}

    def judge(self, sale: Sale) -> list[Reserved | None]:
        first = sale.first_draw
        assert first is not None
        replies: list[Reserved | None] = []
        for g in sale.grids:
            if not g.capped:
                replies.append(None)
                continue
            keys = [(g.combo, first + i) for i in range(sale.draws)]
            over = next((i for i, k in enumerate(keys)
                         if self.counters.get(k, 0) + g.stake > self.cap), None)
            if over is None:
                for k in keys:
                    self.counters[k] = self.counters.get(k, 0) + g.stake
                replies.append(Reserved(ACCEPTED))
            else:
                replies.append(Reserved(REJECTED, offset=over,
                                        room=self.cap - self.counters.get(keys[over], 0)))
        return replies

    def give_back(self, sale: Sale, accepted: set[int]) -> None:
        first = sale.first_draw
        assert first is not None
        for g in sale.grids:
            if g.capped and g.index in accepted:
                for i in range(sale.draws):
                    self.counters[(g.combo, first + i)] -= g.stake
