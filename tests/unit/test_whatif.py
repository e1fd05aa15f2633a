"""The what-if replay on real journal files (the product's recorder and writer, no Redis):
against a model of the rule on random sequences of sales — caps below, at and above the
live one, ties in one millisecond, subscriptions, cancels, voids, refusals for other
reasons, two hosts' journals interleaved by instant — and its self-check: a grid whose
journaled outcome was altered is named; a journal sold exactly by the rule never is."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capsvc.audit.chart import steps
from capsvc.audit.whatif import Scenario, WhatIf, read_demand, replay, to_csv, to_text
from capsvc.client.models import TicketIn
from capsvc.config import load_settings
from capsvc.domain import combination
from capsvc.domain.decisions import ACCEPTED, REJECTED, Reserved, results_of
from capsvc.domain.games import Game
from capsvc.domain.validator import Sale, validate_ticket
from capsvc.journal.recorder import Recorder
from capsvc.journal.writer import journal_files, open_journal
from tests.decisions import build_decision, player_limit_decision
from tests.journals import LiveCaps

CONFIG = Path(__file__).parent.parent / "capsvc-test.toml"
GAME = Game(load_settings(CONFIG).games["fdj-keno"])
TZ = ZoneInfo("Europe/Paris")
DRAW = 9000
NOW = GAME.calendar.close_ms(DRAW) - 3_600_000
COMBOS = [list(range(1 + k, 9 + k)) for k in range(3)] + [list(range(20, 30))]
"""Few combinations (8 and 10 numbers), so that the caps bind."""
UNCAPPED = [1, 2, 3, 4, 5]


def ticket(ticket_id: str, grids: list[tuple[list[int], int]], first: int, draws: int
           ) -> Sale:
    t = msgspec.convert({"ticket_id": ticket_id, "game": "fdj-keno", "first_draw": first,
                         "draws": draws, "grids": [{"numbers": n, "stake": s}
                                                   for n, s in grids]}, TicketIn)
    return msgspec.structs.replace(validate_ticket(GAME.rules, t), first_draw=first)


@dataclass
class Sold:
    """A sale as the model knows it."""

    sale: Sale
    sid: str
    at: int
    body: bytes
    accepted: set[int]
    place: tuple[int, int]
    """(host, line) of its first record: the journal order."""
    cancelled: bool = False
    refused_by_limit: bool = False


@dataclass
class Draw:
    """A random sequence of sales written to the hosts' journals, with what Redis would have
    answered live (the model: counters per combination and draw, one cap)."""

    cap: int
    hosts: int
    lines: list[list[tuple[str, tuple[Any, ...]]]] = field(default_factory=list)
    sold: list[Sold] = field(default_factory=list)
    held: list[tuple[list[tuple[str, int]], int, int]] = field(default_factory=list)
    """Voids' grids held live: (keys, stake, the action that gives them back)."""

    def __post_init__(self) -> None:
        self.lines = [[] for _ in range(self.hosts)]
        self.live = LiveCaps(self.cap)

    def write(self, host: int, method: str, *args: Any) -> tuple[int, int]:
        self.lines[host].append((method, args))
        return host, len(self.lines[host]) + 1  # line 1 is the file's `open`

    def judge(self, s: Sale) -> list[Reserved | None]:
        return self.live.judge(s)

    def give_back(self, s: Sale, accepted: set[int]) -> None:
        self.live.give_back(s, accepted)


def generate(rng: random.Random, n: int, hosts: int, cap: int, *, ties: bool = True,
             voids: bool = True, cancels: bool = True) -> Draw:
    out = Draw(cap, hosts)
    at = NOW
    for k in range(n):
        at += rng.choice([0, 0, 1, 3]) if ties else rng.randint(1, 3)
        host = rng.randrange(hosts)
        for keys, stake, due in [h for h in out.held if h[2] == k]:
            for key in keys:  # a void's grids given back by the janitor
                out.live.counters[key] -= stake
            out.held.remove((keys, stake, due))
        r = rng.random()
        if cancels and r < 0.1 and any(not s.cancelled for s in out.sold):
            s = rng.choice([s for s in out.sold if not s.cancelled])
            s.cancelled = True
            out.give_back(s.sale, s.accepted)
            released = msgspec.json.decode(s.body)["total_cost"]
            out.write(host, "cancel", "answer", "fr-retail", s.sale, s.sid, s.at, s.body,
                      GAME.expire_at(DRAW + 5), at, released)
            continue
        r2 = rng.random()
        first, draws = ((DRAW, 1) if r2 < 0.7 else (DRAW - 1, 2) if r2 < 0.82
                        else (DRAW - 2, 5) if r2 < 0.9 else (DRAW + 1, 1))
        grids = [(rng.choice(COMBOS) if rng.random() < 0.85 else UNCAPPED,
                  rng.choice([100, 200, 300, 500, 1000])) for _ in range(rng.randint(1, 3))]
        s = ticket(f"T{k}", grids, first, draws)
        sid = f"{rng.getrandbits(64):016x}"
        if voids and r < 0.15:  # claimed, its grids held, never answered
            keys_held = []
            for g in s.grids:
                if g.capped:
                    keys = [(g.combo, first + i) for i in range(draws)]
                    if all(out.live.counters.get(key, 0) + g.stake <= cap for key in keys):
                        for key in keys:
                            out.live.counters[key] = out.live.counters.get(key, 0) + g.stake
                        keys_held.append((keys, g.stake))
            for keys, stake in keys_held:
                out.held.append((keys, stake, k + rng.randint(1, 6)))
            out.write(host, "void", "abandoned", "fr-retail", s, sid, at, GAME.expire_at(DRAW))
            continue
        limited = rng.random() < 0.05
        decision = (player_limit_decision(s) if limited
                    else build_decision("fr-retail", TZ, s, sid, at, out.judge(s)))
        body = msgspec.json.encode(decision)
        caps = [cap] * draws
        place = out.write(host, "sale", "answer", "fr-retail", s, sid, at, body,
                          GAME.expire_at(first + draws - 1), caps)
        accepted = {g.index for g in decision.grids if g.status == "accepted"}
        out.sold.append(Sold(s, sid, at, body, accepted, place, refused_by_limit=limited))
        if rng.random() < 0.1:  # journaled again: a replay, a GET, by either host
            again = out.write(rng.randrange(hosts), "sale", "replay", "fr-retail", s, sid, at,
                              body, GAME.expire_at(first + draws - 1), caps)
            out.sold[-1].place = min(place, again)
    return out


async def _journal(directory: Path, lines: list[tuple[str, tuple[Any, ...]]]) -> None:
    journal = open_journal(directory, max_file_bytes=1 << 30, keep_ms=86_400_000)
    rec = Recorder(journal, lambda: NOW)
    await asyncio.gather(*[getattr(rec, method)(*args) for method, args in lines])
    await journal.aclose()


def write(draw: Draw, root: Path) -> list[Path]:
    dirs = [root / f"host-{h}" for h in range(draw.hosts)]
    for directory, lines in zip(dirs, draw.lines, strict=True):
        asyncio.run(_journal(directory, lines))
    return dirs


def model(draw: Draw, caps: list[int]) -> list[Scenario]:
    """The rule, plainly: the draw's demand in (instant, journal order), each cap apart."""
    demand = []
    for s in draw.sold:
        sale = s.sale
        assert sale.first_draw is not None
        if s.cancelled or s.refused_by_limit or not (
                sale.first_draw <= DRAW < sale.first_draw + sale.draws):
            continue
        for g in sale.grids:
            if g.capped:
                demand.append(((s.at, s.place, g.index), g.combo, g.stake, sale.draws > 1))
    demand.sort(key=lambda d: d[0])
    fixed = any(s.sale.first_draw is not None
                and s.sale.first_draw <= DRAW < s.sale.first_draw + s.sale.draws
                and any(g.capped for g in s.sale.grids) for s in draw.sold)
    in_force = draw.cap if fixed else GAME.rules.cap_limit  # else the configuration's
    prizes = dict(GAME.rules.top_prizes)
    out = []
    for cap in caps:
        totals: dict[str, int] = {}
        acc = ref = sacc = sref = 0
        for _, combo, stake, _ in demand:
            t = totals.setdefault(combo, 0)
            if t + stake <= cap:
                totals[combo] = t + stake
                acc += 1
                sacc += stake
            else:
                ref += 1
                sref += stake
        out.append(Scenario(
            cap=cap, in_force=cap == in_force, grids_accepted=acc, grids_refused=ref,
            stake_accepted=sacc, stake_refused=sref,
            combinations_at_cap=sum(1 for t in totals.values() if cap - t < 100),
            top_stake=max(totals.values(), default=0),
            top_liability=max((t * prizes[len(combination.decode(c))] // 100
                               for c, t in totals.items()), default=None),
            subscription_grids=sum(1 for d in demand if d[3])))
    return out


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 45), hosts=st.sampled_from([1, 2]),
       cap=st.sampled_from([500, 1000, 1500]))
def test_the_replay_is_the_rule_under_every_cap_and_the_live_journal_passes_its_self_check(
        tmp_path_factory: pytest.TempPathFactory, seed: int, n: int, hosts: int, cap: int
        ) -> None:
    draw = generate(random.Random(seed), n, hosts, cap)
    dirs = write(draw, tmp_path_factory.mktemp("whatif"))
    caps = [cap - 300, cap, cap + 500, 0]
    demand = read_demand(dirs, GAME, DRAW)
    assert not demand.breaks
    result = replay(demand, GAME, caps)
    assert result.finding is None, result.finding
    assert result.what.scenarios == model(draw, caps)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 40), pick=st.integers(0, 10**6))
def test_any_single_draw_grid_whose_outcome_was_altered_is_named(
        tmp_path_factory: pytest.TempPathFactory, seed: int, n: int, pick: int) -> None:
    """Instants apart, no voids: the self-check names exactly the grid altered, the first
    whose journaled outcome the rule does not give."""
    draw = generate(random.Random(seed), n, 1, 1000, ties=False, voids=False)
    candidates = [(s, g.index) for s in draw.sold if not s.refused_by_limit
                  and s.sale.draws == 1 and s.sale.first_draw == DRAW
                  for g in s.sale.grids if g.capped]
    if not candidates:
        return
    s, index = candidates[pick % len(candidates)]
    body = msgspec.json.decode(s.body)
    grid = body["grids"][index]
    if grid["status"] == "accepted":
        body["grids"][index] = {"index": index, "numbers": grid["numbers"],
                                "status": "rejected", "reason": "combination_capped",
                                "draw": DRAW, "remaining": 0}
    else:
        body["grids"][index] = {"index": index, "numbers": grid["numbers"],
                                "status": "accepted", "cost": s.sale.grids[index].stake}
    altered = msgspec.json.encode(body)
    for lines in draw.lines:
        for k, (method, args) in enumerate(lines):
            if method in ("sale", "cancel") and args[2] is s.sale:
                lines[k] = (method, (*args[:5], altered, *args[6:]))
    dirs = write(draw, tmp_path_factory.mktemp("altered"))
    result = replay(read_demand(dirs, GAME, DRAW), GAME, [1000])
    assert result.finding is not None
    assert (result.finding.line, result.finding.grid) == (s.place[1], index)
    assert result.finding.accepted == (grid["status"] != "accepted")


def test_ties_in_one_millisecond_go_in_journal_order_and_hosts_in_the_order_given(
        tmp_path: Path) -> None:
    """Two sales of one combination in one millisecond on two hosts, the cap room for one:
    the replay accepts the one read first (the first directory's); live, the other host's
    was judged first, and the self-check takes either order."""
    combo = COMBOS[0]
    draw = Draw(500, 2)
    a, b = ticket("A", [(combo, 500)], DRAW, 1), ticket("B", [(combo, 500)], DRAW, 1)
    ok = build_decision("fr-retail", TZ, b, "b" * 16, NOW, [Reserved(ACCEPTED)])
    no = build_decision("fr-retail", TZ, a, "a" * 16, NOW, [Reserved(REJECTED, room=0)])
    draw.write(0, "sale", "answer", "fr-retail", a, "a" * 16, NOW, msgspec.json.encode(no),
               GAME.expire_at(DRAW), [500])
    draw.write(1, "sale", "answer", "fr-retail", b, "b" * 16, NOW, msgspec.json.encode(ok),
               GAME.expire_at(DRAW), [500])
    dirs = write(draw, tmp_path)
    result = replay(read_demand(dirs, GAME, DRAW), GAME, [500])
    assert result.finding is None
    (s,) = result.what.scenarios
    assert (s.grids_accepted, s.grids_refused, s.stake_accepted) == (1, 1, 500)
    swapped = replay(read_demand(dirs[::-1], GAME, DRAW), GAME, [500])
    assert swapped.finding is None
    # `--journals PARENT`: every host's directory under it, by name (`reports` aside).
    (tmp_path / "reports").mkdir()
    out = capsvc("--config", str(CONFIG), "--game", "fdj-keno", "--draw", str(DRAW),
                 "--journals", str(tmp_path), "--cap", "500", "--format", "json")
    assert out.returncode == 0, out.stderr
    assert msgspec.json.decode(out.stdout, type=WhatIf) == result.what


def test_a_cancel_gives_its_room_back_at_its_instant_and_is_no_demand(tmp_path: Path) -> None:
    """Live: A fills the cap, B is refused, A is cancelled, C takes the room. The replay
    leaves A out (B then fits under the cap in force: the scenario is not the live day),
    and the self-check, which keeps A until its cancel, finds nothing to name."""
    combo = COMBOS[1]
    draw = Draw(1000, 1)
    sales = {t: ticket(t, [(combo, 1000)], DRAW, 1) for t in "ABC"}
    bodies = {
        "A": build_decision("fr-retail", TZ, sales["A"], "a" * 16, NOW, [Reserved(ACCEPTED)]),
        "B": build_decision("fr-retail", TZ, sales["B"], "b" * 16, NOW + 1,
                            [Reserved(REJECTED, room=0)]),
        "C": build_decision("fr-retail", TZ, sales["C"], "c" * 16, NOW + 3,
                            [Reserved(ACCEPTED)])}
    for t, at in (("A", NOW), ("B", NOW + 1)):
        draw.write(0, "sale", "answer", "fr-retail", sales[t], t.lower() * 16, at,
                   msgspec.json.encode(bodies[t]), GAME.expire_at(DRAW), [1000])
    draw.write(0, "cancel", "answer", "fr-retail", sales["A"], "a" * 16, NOW,
               msgspec.json.encode(bodies["A"]), GAME.expire_at(DRAW), NOW + 2, 1000)
    draw.write(0, "sale", "answer", "fr-retail", sales["C"], "c" * 16, NOW + 3,
               msgspec.json.encode(bodies["C"]), GAME.expire_at(DRAW), [1000])
    result = replay(read_demand(write(draw, tmp_path), GAME, DRAW), GAME, [1000, 2000])
    assert result.finding is None
    at_cap, above = result.what.scenarios
    assert (at_cap.grids_accepted, at_cap.grids_refused, at_cap.in_force) == (1, 1, True)
    assert (above.grids_accepted, above.grids_refused, above.top_stake) == (2, 0, 2000)


def test_a_void_claimed_in_a_decisions_millisecond_may_have_held_room_before_it(
        tmp_path: Path) -> None:
    """Live: A takes 500 of 600; in one millisecond a void (host 1) claims 100, then B
    (host 0) is refused. B's line is read before the void's, but the void's line is written
    when it is given back: its claim may precede B, and the self-check takes it as held.
    A void claimed a millisecond after B explains nothing: B is named."""
    combo = COMBOS[0]

    def day(void_at: int) -> list[Path]:
        draw = Draw(600, 2)
        a, b = ticket("A", [(combo, 500)], DRAW, 1), ticket("B", [(combo, 100)], DRAW, 1)
        v = ticket("V", [(combo, 100)], DRAW, 1)
        ok = build_decision("fr-retail", TZ, a, "a" * 16, NOW - 1, [Reserved(ACCEPTED)])
        no = build_decision("fr-retail", TZ, b, "b" * 16, NOW, [Reserved(REJECTED, room=0)])
        draw.write(0, "sale", "answer", "fr-retail", a, "a" * 16, NOW - 1,
                   msgspec.json.encode(ok), GAME.expire_at(DRAW), [600])
        draw.write(0, "sale", "answer", "fr-retail", b, "b" * 16, NOW,
                   msgspec.json.encode(no), GAME.expire_at(DRAW), [600])
        draw.write(1, "void", "abandoned", "fr-retail", v, "v" * 16, void_at,
                   GAME.expire_at(DRAW))
        return write(draw, tmp_path / str(void_at - NOW))

    dirs = day(NOW)
    for order in (dirs, dirs[::-1]):
        result = replay(read_demand(order, GAME, DRAW), GAME, [600])
        assert result.finding is None, result.finding
        (s,) = result.what.scenarios
        # The scenario leaves the void out (no demand): B fits.
        assert (s.grids_accepted, s.grids_refused, s.stake_accepted) == (2, 0, 600)
    late = replay(read_demand(day(NOW + 1), GAME, DRAW), GAME, [600])
    assert late.finding is not None
    assert (late.finding.line, late.finding.accepted, late.finding.counted) == (3, False, 500)


def test_a_sale_cancelled_in_its_own_millisecond_gives_back_after_its_grids(
        tmp_path: Path) -> None:
    """Live: T's first grid fills the cap, its second is refused, T is cancelled in the same
    millisecond; its cancel's line (host 0) is read before its sale's (host 1). The cancel
    gives back after T's grids were judged, wherever its line is. And a sale cancelled in
    the millisecond it was decided gives back no more than it took: S, accepted though A's
    500 stays counted and S asks the whole cap, is named in any order of that millisecond."""
    combo = COMBOS[2]
    draw = Draw(1000, 2)
    t = ticket("T", [(combo, 1000), (combo, 1000)], DRAW, 1)
    body = msgspec.json.encode(build_decision("fr-retail", TZ, t, "t" * 16, NOW,
                                              draw.judge(t)))
    draw.write(1, "sale", "answer", "fr-retail", t, "t" * 16, NOW, body,
               GAME.expire_at(DRAW), [1000])
    draw.write(0, "cancel", "answer", "fr-retail", t, "t" * 16, NOW, body,
               GAME.expire_at(DRAW), NOW, 1000)
    dirs = write(draw, tmp_path / "own")
    for order in (dirs, dirs[::-1]):
        result = replay(read_demand(order, GAME, DRAW), GAME, [1000])
        assert result.finding is None, result.finding

    draw = Draw(1000, 1)
    sales = {k: ticket(k, [(combo, stake)], DRAW, 1)
             for k, stake in (("A", 500), ("R", 500), ("S", 1000))}
    bodies = {k: msgspec.json.encode(build_decision(
        "fr-retail", TZ, sales[k], k.lower() * 16, at, [Reserved(ACCEPTED)]))
        for k, at in (("A", NOW - 1), ("R", NOW), ("S", NOW))}
    for k, at in (("A", NOW - 1), ("R", NOW), ("S", NOW)):
        draw.write(0, "sale", "answer", "fr-retail", sales[k], k.lower() * 16, at, bodies[k],
                   GAME.expire_at(DRAW), [1000])
    draw.write(0, "cancel", "answer", "fr-retail", sales["R"], "r" * 16, NOW, bodies["R"],
               GAME.expire_at(DRAW), NOW, 500)
    result = replay(read_demand(write(draw, tmp_path / "others"), GAME, DRAW), GAME, [1000])
    assert result.finding is not None
    assert (result.finding.line, result.finding.accepted, result.finding.counted) == (
        4, True, 500)


def test_the_figures_a_risk_manager_reads(tmp_path: Path) -> None:
    """Liability by the size's top prize (a 10-number combination under a smaller stake
    can cost the most), combinations at cap (less room than the smallest stake), the
    text table in the game's currency, the CSV a row per cap, the chart's staircase."""
    eight, ten = COMBOS[0], COMBOS[3]
    draw = Draw(5000, 1)
    sales = [ticket("E1", [(eight, 1000)] * 5, DRAW, 1), ticket("X", [(ten, 300)], DRAW, 1),
             ticket("S", [(eight, 200)], DRAW - 1, 2)]
    for k, s in enumerate(sales):
        decision = build_decision("fr-retail", TZ, s, f"{k:016x}", NOW + k, draw.judge(s))
        draw.write(0, "sale", "answer", "fr-retail", s, f"{k:016x}", NOW + k,
                   msgspec.json.encode(decision), GAME.expire_at(DRAW + 1), [5000] * s.draws)
    result = replay(read_demand(write(draw, tmp_path), GAME, DRAW), GAME, [5000, 4950])
    live, lower = result.what.scenarios
    assert (live.grids_accepted, live.grids_refused, live.stake_refused) == (6, 1, 200)
    assert (live.top_stake, live.combinations_at_cap, live.subscription_grids) == (5000, 1, 1)
    # 8 numbers at 50 EUR: 50 x 1,000 EUR; 10 numbers at 3 EUR: 3 x 200,000 EUR.
    assert live.top_liability == 60_000_000
    assert (lower.grids_accepted, lower.stake_accepted, lower.combinations_at_cap) == (6, 4500, 0)
    text = to_text(result, 5000, 100)
    assert "* 50.00 EUR" in text
    assert "49.50 EUR" in text
    assert "600000.00 EUR" in text
    rows = to_csv(result.what).splitlines()
    assert rows[0].startswith("game,draw,currency,cap,in_force,")
    assert rows[1].startswith(f"fdj-keno,{DRAW},EUR,5000,true,6,1,")
    assert steps(result.curves[0]) == ([1, 2, 2, 3], [5000, 5000, 300, 300])
    assert result.curves[1] == Counter({4200: 1, 300: 1})


def capsvc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "capsvc", "whatif", *args],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("form", ["sale", "results"])
def test_the_command_names_an_altered_grid_and_refuses_a_broken_chain(tmp_path: Path,
                                                                     form: str) -> None:
    """One line and exit 1: a grid journaled refused though its combination had room (its
    decision journaled whole or as results: the ticket named either way); a line edited by
    hand (its chain broken) unless --ignore-chain, which replays it and says so."""
    combo = COMBOS[0]
    draw = Draw(1000, 1)
    for k, (stake, reply) in enumerate([(500, ACCEPTED), (300, REJECTED), (500, ACCEPTED)]):
        s = ticket(f"T{k}", [(combo, stake)], DRAW, 1)
        replies = [Reserved(reply, room=500)]
        body = build_decision("fr-retail", TZ, s, f"{k:016x}", NOW + k, replies)
        draw.write(0, "sale", "answer", "fr-retail", s, f"{k:016x}", NOW + k,
                   msgspec.json.encode(body), GAME.expire_at(DRAW), [1000],
                   results_of(GAME.rules.time_zone, replies) if form == "results" else None)
    (directory,) = write(draw, tmp_path / "altered")
    common = ("--config", str(CONFIG), "--game", "fdj-keno", "--draw", str(DRAW),
              "--dir", str(directory), "--cap", "1000")
    out = capsvc(*common)
    assert out.returncode == 1, out.stdout
    assert out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert "ticket T1 of fr-retail" in line
    assert "grid 0 (1-2-3-4-5-6-7-8)" in line
    assert "refused live by the cap" in line
    assert (":3)" if form == "sale" else ":2)") in line  # results: the three in one line

    fine = Draw(1000, 1)
    for k in range(3):
        s = ticket(f"T{k}", [(combo, 500)], DRAW, 1)
        body = build_decision("fr-retail", TZ, s, f"{k:016x}", NOW + k, fine.judge(s))
        fine.write(0, "sale", "answer", "fr-retail", s, f"{k:016x}", NOW + k,
                   msgspec.json.encode(body), GAME.expire_at(DRAW), [1000])
    (directory,) = write(fine, tmp_path / "edited")
    (path,) = journal_files(directory)
    text = path.read_text().replace('"stake":500', '"stake":100', 1)
    path.write_text(text)
    common = ("--config", str(CONFIG), "--game", "fdj-keno", "--draw", str(DRAW),
              "--dir", str(directory), "--cap", "1000", "--format", "json")
    out = capsvc(*common)
    assert out.returncode == 1
    assert out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert "chain is broken" in line
    assert "--ignore-chain" in line
    out = capsvc(*common, "--ignore-chain")
    assert out.returncode == 0, out.stderr
    assert "--ignore-chain" in out.stderr
    what = msgspec.json.decode(out.stdout, type=WhatIf)
    assert what.scenarios[0].stake_accepted == 600


@pytest.mark.parametrize(("args", "says"), [
    (("--cap", "-5"), "--cap '-5': expected an amount in minor units"),
    (("--cap", "12.5"), "--cap '12.5': expected an amount in minor units"),
    (("--cap", "5000", "--game", "nope"), "no game 'nope'"),
    (("--cap", "5000", "--draw", "0"), "no draw 0 of fdj-keno"),
    (("--cap", "5000", "--draw", "12x"), "no draw 12x of fdj-keno"),
    (("--cap", "5000", "--draw", str(DRAW + 1)), f"no sale of fdj-keno draw {DRAW + 1}"),
    (("--cap", "5000", "--journals", "/nonexistent"), "no such directory: /nonexistent"),
])
def test_bad_input_is_one_line_and_a_non_zero_exit(tmp_path: Path, args: tuple[str, ...],
                                                   says: str) -> None:
    draw = Draw(5000, 1)
    s = ticket("T", [(COMBOS[0], 500)], DRAW, 1)
    body = build_decision("fr-retail", TZ, s, "0" * 16, NOW, draw.judge(s))
    draw.write(0, "sale", "answer", "fr-retail", s, "0" * 16, NOW, msgspec.json.encode(body),
               GAME.expire_at(DRAW), [5000])
    (directory,) = write(draw, tmp_path)
    base = {"--config": str(CONFIG), "--game": "fdj-keno", "--draw": str(DRAW),
            "--dir": str(directory)}
    given = dict(zip(args[::2], args[1::2], strict=True))
    if "--journals" in given:
        del base["--dir"]
    merged = [x for k, v in {**base, **given}.items() for x in (k, v)]
    out = capsvc(*merged)
    assert out.returncode == 2, out.stdout
    assert "Traceback" not in out.stderr
    (line,) = out.stderr.splitlines()
    assert says in line


def test_a_chart_needs_the_charts_extra_or_is_drawn_once(tmp_path: Path) -> None:
    draw = Draw(5000, 1)
    s = ticket("T", [(COMBOS[0], 500)], DRAW, 1)
    body = build_decision("fr-retail", TZ, s, "0" * 16, NOW, draw.judge(s))
    draw.write(0, "sale", "answer", "fr-retail", s, "0" * 16, NOW, msgspec.json.encode(body),
               GAME.expire_at(DRAW), [5000])
    (directory,) = write(draw, tmp_path)
    common = ("--config", str(CONFIG), "--game", "fdj-keno", "--draw", str(DRAW),
              "--dir", str(directory), "--cap", "5000", "--cap", "2000")
    chart = tmp_path / "chart.svg"
    pytest.importorskip("matplotlib")
    out = capsvc(*common, "--chart", str(chart))
    assert out.returncode == 0, out.stderr
    svg = chart.read_text()
    assert svg.lstrip().startswith("<?xml")
    assert "cap 50 EUR (in force)" in svg
    again = capsvc(*common, "--chart", str(chart))
    assert again.returncode == 2
    assert "exists" in again.stderr


def test_without_matplotlib_the_chart_names_the_extra(tmp_path: Path) -> None:
    """The command with matplotlib hidden (a module finder that refuses it)."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'matplotlib':\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, _Hide())\n")
    import os

    env = {**os.environ, "PYTHONPATH": f"{hide}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "capsvc", "whatif", "--config", str(CONFIG),
                          "--game", "fdj-keno", "--draw", str(DRAW), "--dir", str(tmp_path),
                          "--cap", "5000", "--chart", str(tmp_path / "c.svg")],
                         capture_output=True, text=True, timeout=60, check=False, env=env)
    assert out.returncode == 2
    (line,) = out.stderr.splitlines()
    assert "pip install 'capsvc[charts]'" in line
