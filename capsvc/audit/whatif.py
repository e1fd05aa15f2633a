"""What a draw would have looked like under other caps: its capped grids replayed from the
journal, in the order their decisions were made, under each cap asked.

**The demand** is every grid of a capped size on the draw that the journal holds with a
decision of the cap: accepted live, or refused live by the cap (`combination_capped`,
on this draw or another of its subscription: its asked stake is demand too). Left out:
the grids of cancelled sales and of voids (never answered), and grids refused for another
reason (a player's limit, …). A subscription's grid is judged on this draw alone.

**The order** is the decisions': Redis's instant of each (`at`), then journal order (the
directories in the order given, each one's files oldest first, line by line). Under a cap
C a grid is accepted when what is already accepted on its combination plus its stake fits
C: the live rule.

**The self-check.** Under the cap in force, the live counter is replayed as Redis kept it:
every grid accepted live counts from its decision (a subscription's included), a cancelled
sale's grids until its cancel, a void's grids may have been held from its claim (before
any decision of its millisecond, wherever its line is) until it was given back (how long,
the journal does not say). Every single-draw grid's live outcome must be what
the rule gives on that counter; when several sales of one combination share a millisecond
(two processes), either order is taken as possible. A grid whose outcome no order explains
is a finding: the journal and the rule disagree. With no cancelled sale and no
subscription refused for another draw, that replay is the scenario of the cap in force.

**Memory.** The files are read once, a line at a time; of each capped grid of the draw one
integer (its combination, instant, sale and place, packed so that sorting them orders
every combination's grids) and a few bytes. Then the grids are replayed combination by
combination: what is kept is the current combination's totals and, per cap, how many
combinations ended at each total (the chart's curve).
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from msgspec import Struct

from capsvc.audit.history import CLOCK_MARGIN_MS, first_sale_ms
from capsvc.audit.report import csv_cell
from capsvc.domain.games import Game
from capsvc.domain.money import amount
from capsvc.journal.reader import FileCheck, lines_of, read
from capsvc.journal.records import (
    CancelRecord,
    CapRecord,
    Line,
    SaleRecord,
    SalesRecord,
    VoidRecord,
)
from capsvc.journal.writer import journal_files

CAPPED = "combination_capped"
"""The reason of a grid the cap refused."""


class Scenario(Struct):
    """The draw under one cap (amounts in minor units)."""

    cap: int
    in_force: bool
    """This cap is the one that was in force for the draw."""
    grids_accepted: int
    grids_refused: int
    stake_accepted: int
    stake_refused: int
    combinations_at_cap: int
    """Combinations played with no room left for the game's smallest stake."""
    top_stake: int
    """The most accepted on one combination."""
    top_liability: int | None
    """The largest top-rank prize one combination's accepted stakes could cost, over every
    combination (its stake divided by `prize_base_stake`, times `top_prizes` of its size,
    as the exposure reckons it); null when the game has no top prize for the capped sizes."""
    subscription_grids: int
    """Grids of the demand that a subscription plays (judged on this draw alone)."""


class WhatIf(Struct):
    """`capsvc whatif --format json`."""

    game: str
    draw: int
    currency: str
    scenarios: list[Scenario]


# -- reading the journal -------------------------------------------------------------------

class _Outcome(Struct, forbid_unknown_fields=False):
    status: str
    reason: str | None = None


class _Decision(Struct, forbid_unknown_fields=False):
    """What the replay needs of a decision: each grid's outcome."""

    grids: list[_Outcome] = []
    reason: str | None = None


_decision = msgspec.json.Decoder(_Decision).decode

# An event's sort key, most significant first: combination (a bit per number), instant
# (Redis ms), the sale (32 bits of a hash: tells sales apart within one millisecond of one
# combination), grid index, kind, place (the event's index in reading order).
_PLACE_BITS = 32
_KIND_SHIFT = _PLACE_BITS
_GRID_SHIFT = _KIND_SHIFT + 2
_SALE_SHIFT = _GRID_SHIFT + 8
_AT_SHIFT = _SALE_SHIFT + 32
_COMBO_SHIFT = _AT_SHIFT + 44
_PLACE = (1 << _PLACE_BITS) - 1
_IDENTITY = (1 << (_AT_SHIFT - _KIND_SHIFT)) - 1
_SALE = (1 << 32) - 1
_MAX_AT = 1 << 44

GRID, RELEASE, VOID = 0, 1, 2
"""An event's kind: a grid's decision; a cancelled grid giving its stake back (at the
cancel's instant); a void's grid (perhaps held live until given back)."""
ACCEPTED, SUBSCRIPTION, CANCELLED = 1, 2, 4
"""An event's flags: accepted live; of a ticket of several draws; of a sale cancelled."""


@dataclass
class Demand:
    """What the journal holds of one draw's capped grids (see the module's docstring)."""

    game: str
    draw: int
    keys: list[int] = field(default_factory=list)
    stakes: array[int] = field(default_factory=lambda: array("q"))
    flags: array[int] = field(default_factory=lambda: array("B"))
    files: list[Path] = field(default_factory=list)
    file_of: array[int] = field(default_factory=lambda: array("I"))
    line_of: array[int] = field(default_factory=lambda: array("I"))
    cap: int | None = None
    """The cap in force on the draw, as its decisions (or a `cap` record) carry it; the
    game's configured cap when none of them was read."""
    sales: int = 0
    """Records of sales, cancels and voids of the draw read (any grid)."""
    breaks: list[str] = field(default_factory=list)
    """Lines that do not chain (`capsvc journal verify` tells more)."""
    tails: list[str] = field(default_factory=list)
    """Torn last lines: what a crash leaves, not a break."""

    def add(self, kind: int, combo: int, at: int, sale: int, grid: int, stake: int,
            flags: int, file: int, line: int) -> None:
        place = len(self.stakes)
        self.keys.append((((((combo << 44 | at) << 32 | sale) << 8 | grid) << 2 | kind)
                          << _PLACE_BITS) | place)
        self.stakes.append(stake)
        self.flags.append(flags)
        self.file_of.append(file)
        self.line_of.append(line)


def read_demand(directories: Iterable[Path], game: Game, draw: int) -> Demand:
    """The capped grids of `game`'s `draw` in every file of `directories` that can hold a
    decision of it (as `capsvc report` chooses them), each line's chain checked."""
    gid = game.rules.id
    out = Demand(gid, draw)
    since_s = (first_sale_ms(game, draw) - CLOCK_MARGIN_MS) / 1000

    def wanted(head: Line) -> bool:
        if head.game != gid:
            return False
        if head.draw is not None:
            return head.draw == draw
        first = head.first_draw
        return first is not None and first <= draw < first + (head.draws or 0)

    for directory in directories:
        for path in journal_files(directory):
            try:
                if os.stat(path).st_mtime < since_s:
                    continue
                _read_file(out, path, wanted)
            except FileNotFoundError:  # pruned meanwhile
                continue
    if out.cap is None:
        out.cap = game.rules.cap_limit
    return out


def _read_file(out: Demand, path: Path, wanted: Callable[[Line], bool]) -> None:
    draw = out.draw
    check = FileCheck(path)
    file = len(out.files)
    out.files.append(path)
    for n, record in read(path, check, wanted=wanted):
        if isinstance(record, SaleRecord):
            out.sales += 1
            if out.cap is None and record.caps and len(record.caps) > draw - record.first_draw:
                out.cap = record.caps[draw - record.first_draw]
            _sale(out, record, file, n)
        elif isinstance(record, VoidRecord):
            out.sales += 1
            sale = _sale_hash(record.channel, record.ticket, record.sale)
            flags = SUBSCRIPTION if record.draws > 1 else 0
            for i, grid in enumerate(record.grids):
                if grid.capped:
                    out.add(VOID, _combo(grid.numbers), _instant(record.at), sale, i,
                            grid.stake, flags, file, n)
        elif isinstance(record, CapRecord) and out.cap is None:
            out.cap = record.cap
    out.breaks += [f"{path}: {b}" for b in check.breaks]
    if check.tail:
        out.tails.append(f"{path}: {check.tail}")


def _sale(out: Demand, r: SaleRecord, file: int, line: int) -> None:
    """The capped grids of a sale's (or a cancel's) record, with the cancel's releases."""
    grids = r.grids
    capped = [i for i, grid in enumerate(grids) if grid.capped]
    if not capped:
        return
    try:
        decision = _decision(r.decision)
        outcomes = [decision.grids[i] for i in capped]
    except (msgspec.DecodeError, msgspec.ValidationError, IndexError):
        out.breaks.append(f"{out.files[file]}: line {line}: its decision is not one")
        return
    cancel = isinstance(r, CancelRecord)
    sale = _sale_hash(r.channel, r.ticket, r.sale)
    base = (SUBSCRIPTION if r.draws > 1 else 0) | (CANCELLED if cancel else 0)
    at = _instant(r.at)
    for i, outcome in zip(capped, outcomes, strict=True):
        grid = grids[i]
        accepted = outcome.status == "accepted"
        if not accepted and (outcome.reason or decision.reason) != CAPPED:
            continue  # refused for another reason: not demand
        combo = _combo(grid.numbers)
        out.add(GRID, combo, at, sale, i, grid.stake, base | (ACCEPTED if accepted else 0),
                file, line)
        if cancel and accepted:
            assert isinstance(r, CancelRecord)
            out.add(RELEASE, combo, _instant(r.cancelled_at), sale, i, grid.stake, base,
                    file, line)


def _combo(numbers: Sequence[int]) -> int:
    mask = 0
    for n in numbers:
        mask |= 1 << n
    return mask


def _instant(at: int) -> int:
    return min(max(at, 0), _MAX_AT - 1)


def _sale_hash(channel: str, ticket: str, sale: str) -> int:
    """Tells two sales apart within one millisecond of one combination (a collision there
    would merge two sales of the same instant and combination: 1 in 2^32)."""
    digest = hashlib.blake2b(f"{channel}\0{ticket}\0{sale}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & _SALE


# -- the replay ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Finding:
    """A single-draw grid whose live outcome the rule does not give under the cap in
    force: the journal and the replay disagree."""

    file: Path
    line: int
    grid: int
    numbers: list[int]
    accepted: bool
    """Its live outcome."""
    counted: int
    """What the live counter held before it (the bound that contradicts its outcome)."""
    stake: int
    at: int

    def describe(self, cap: int, currency: str, differing: int) -> str:
        ticket = _ticket_at(self.file, self.line, self.grid, self.numbers, self.at) or "?"
        numbers = "-".join(map(str, self.numbers))
        if self.accepted:
            why = (f"was accepted live, but {amount(self.counted, currency)} was already "
                   f"accepted on its combination: {amount(self.stake, currency)} more does "
                   f"not fit the cap in force, {amount(cap, currency)}")
        else:
            why = (f"was refused live by the cap, but at most {amount(self.counted, currency)} "
                   f"was accepted on its combination: {amount(self.stake, currency)} more "
                   f"fits the cap in force, {amount(cap, currency)}")
        more = f" ({differing} grid(s) differ)" if differing > 1 else ""
        return (f"the journal and the replay disagree{more}: ticket {ticket}, grid "
                f"{self.grid} ({numbers}) {why} ({self.file.name}:{self.line})")


def _ticket_at(path: Path, line: int, grid: int, numbers: list[int], at: int) -> str | None:
    """"<ticket> of <channel> (sale <id>)" of the sale at `line` of `path` (of a `sales`
    line, the first of instant `at` whose grid `grid` has `numbers`), None when there is
    none."""
    for n, raw, _ in lines_of(path):
        if n != line:
            continue
        try:
            record = msgspec.json.decode(raw, type=SaleRecord | CancelRecord | SalesRecord)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        if isinstance(record, SalesRecord):
            for s in record.sales:
                if (record.at_of(s) == at and grid < len(s.grids)
                        and sorted(s.grids[grid].numbers) == numbers):
                    return f"{s.ticket} of {record.channel} (sale {s.sale})"
            return None
        return f"{record.ticket} of {record.channel} (sale {record.sale})"
    return None


@dataclass
class Replay:
    """The scenarios, each cap's curve (combinations by accepted stake: total -> how many),
    and the self-check's verdict."""

    what: WhatIf
    curves: list[Counter[int]]
    finding: Finding | None = None
    differing: int = 0
    """Single-draw grids whose live outcome the rule does not give."""
    combinations: int = 0
    """Combinations of the demand."""


def replay(demand: Demand, game: Game, caps: Sequence[int]) -> Replay:
    """`demand` under each of `caps` (see the module's docstring), and the self-check under
    the cap in force."""
    rules = game.rules
    in_force = demand.cap
    n_caps = len(caps)
    accepted = [0] * n_caps
    refused = [0] * n_caps
    stake_accepted = [0] * n_caps
    stake_refused = [0] * n_caps
    curves: list[Counter[int]] = [Counter() for _ in caps]
    top_by_picks: list[dict[int, int]] = [{} for _ in caps]
    subscriptions = 0
    combinations = 0
    finding: tuple[int, int, int, bool] | None = None  # (at, place, counted, accepted)
    differing = 0
    stakes, flags = demand.stakes, demand.flags
    keys = demand.keys
    keys.sort()
    total = len(keys)
    i = 0
    while i < total:
        combo = keys[i] >> _COMBO_SHIFT
        totals = [0] * n_caps
        low = high = 0  # the live counter: held for sure; perhaps held (voids)
        demanded = False
        while i < total and keys[i] >> _COMBO_SHIFT == combo:
            # One millisecond of one combination: its events, each once (a decision
            # journaled again, a sale's record and its cancel's), in journal order.
            moment = keys[i] >> _AT_SHIFT
            items: list[list[int]] = []  # [place, kind, sale, flags]
            last = -1
            while i < total and (key := keys[i]) >> _AT_SHIFT == moment:
                identity = (key >> _KIND_SHIFT) & _IDENTITY
                place = key & _PLACE
                if identity == last:
                    items[-1][3] |= flags[place]
                else:
                    items.append([place, identity & 3, (identity >> 10) & _SALE,
                                  flags[place]])
                    last = identity
                i += 1
            decided = {it[2] for it in items if it[1] == GRID}
            if decided:
                items = [it for it in items if it[1] != VOID or it[2] not in decided]
            # A cancel follows its sale's decision: its releases after every grid.
            items.sort(key=lambda it: (it[1] == RELEASE, it[0]))
            several = len({it[2] for it in items if it[1] != VOID}) > 1
            # A void's claim may precede every decision of its millisecond, whatever its
            # line's place (it is journaled when given back): perhaps held from the start.
            high += sum(stakes[it[0]] for it in items if it[1] == VOID)
            low0 = high0 = everyone = 0
            held: dict[int, int] = {}
            own: dict[int, int] = {}
            if several:  # either order possible: the bounds of every order
                # A sale decided and cancelled in it gives back no more than it took.
                low0 = low - sum(stakes[it[0]] for it in items
                                 if it[1] == RELEASE and it[2] not in decided)
                high0 = high
                for it in items:
                    if it[1] == GRID and it[3] & ACCEPTED:
                        held[it[2]] = held.get(it[2], 0) + stakes[it[0]]
                everyone = sum(held.values())
            for place, kind, sale, flag in items:
                stake = stakes[place]
                if kind == RELEASE:
                    low -= stake
                    high -= stake
                    continue
                if kind == VOID:
                    continue  # counted in `high` above
                live = bool(flag & ACCEPTED)
                if not flag & SUBSCRIPTION and in_force is not None:
                    if several:
                        mine = own.get(sale, 0)
                        least = low0 + mine
                        most = high0 + everyone - held.get(sale, 0) + mine
                    else:
                        least, most = low, high
                    wrong = (least + stake > in_force) if live else (most + stake <= in_force)
                    if wrong:
                        differing += 1
                        at = moment & (_MAX_AT - 1)
                        if finding is None or (at, place) < finding[:2]:
                            finding = (at, place, least if live else most, live)
                if live:
                    low += stake
                    high += stake
                    if several:
                        own[sale] = own.get(sale, 0) + stake
                if flag & CANCELLED:
                    continue
                demanded = True
                if flag & SUBSCRIPTION:
                    subscriptions += 1
                for c in range(n_caps):
                    if totals[c] + stake <= caps[c]:
                        totals[c] += stake
                        accepted[c] += 1
                        stake_accepted[c] += stake
                    else:
                        refused[c] += 1
                        stake_refused[c] += stake
        if demanded:
            combinations += 1
            picks = combo.bit_count()
            for c in range(n_caps):
                curves[c][totals[c]] += 1
                tops = top_by_picks[c]
                if totals[c] > tops.get(picks, -1):
                    tops[picks] = totals[c]
    prizes = dict(rules.top_prizes)
    scenarios = []
    for c, cap in enumerate(caps):
        liabilities = [top * prizes[p] // rules.prize_base_stake
                       for p, top in top_by_picks[c].items() if p in prizes]
        scenarios.append(Scenario(
            cap=cap, in_force=cap == in_force, grids_accepted=accepted[c],
            grids_refused=refused[c], stake_accepted=stake_accepted[c],
            stake_refused=stake_refused[c],
            combinations_at_cap=sum(n for t, n in curves[c].items()
                                    if cap - t < rules.min_stake),
            top_stake=max(curves[c], default=0),
            top_liability=max(liabilities, default=None),
            subscription_grids=subscriptions))
    out = Replay(WhatIf(rules.id, demand.draw, rules.currency, scenarios), curves,
                 differing=differing, combinations=combinations)
    if finding is not None:
        at, place, counted, live = finding
        key = next(k for k in keys if k & _PLACE == place)
        grid = (key >> _GRID_SHIFT) & 0xFF
        numbers = _numbers(key >> _COMBO_SHIFT)
        out.finding = Finding(demand.files[demand.file_of[place]], demand.line_of[place],
                              grid, numbers, live, counted, stakes[place], at)
    return out


def _numbers(combo: int) -> list[int]:
    return [n for n in range(combo.bit_length()) if combo >> n & 1]


# -- renderings ----------------------------------------------------------------------------

encode_json = msgspec.json.Encoder().encode

FIELDS = tuple(Scenario.__struct_fields__)


def to_json(what: WhatIf) -> bytes:
    return msgspec.json.format(encode_json(what), indent=2) + b"\n"


def to_csv(what: WhatIf) -> str:
    """A row per cap: `game,draw,currency` then the scenario's fields (minor units)."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["game", "draw", "currency", *FIELDS])
    for s in what.scenarios:
        w.writerow([what.game, what.draw, what.currency,
                    *(csv_cell(getattr(s, name)) for name in FIELDS)])
    return out.getvalue()


def to_text(replay: Replay, in_force: int | None, min_stake: int) -> str:
    """The table a risk manager reads: a row per cap, amounts in the game's currency."""
    what = replay.what
    cur = what.currency
    s0 = what.scenarios[0]
    grids = s0.grids_accepted + s0.grids_refused
    asked = s0.stake_accepted + s0.stake_refused
    force = "none fixed" if in_force is None else amount(in_force, cur)
    lines = [
        f"{what.game} draw {what.draw}, cap in force {force}",
        f"demand: {grids:,} capped grid(s) asking {amount(asked, cur)} on "
        f"{replay.combinations:,} combination(s); {s0.subscription_grids:,} of the grids "
        "by subscriptions, judged on this draw alone",
        "",
    ]
    head = ("cap", "grids accepted", "grids refused", "stake accepted", "stake refused",
            "refused %", "at cap", "top stake", "top liability")
    rows = []
    for s in what.scenarios:
        share = 100 * s.stake_refused / asked if asked else 0.0
        rows.append((("* " if s.in_force else "") + amount(s.cap, cur),
                     f"{s.grids_accepted:,}", f"{s.grids_refused:,}",
                     amount(s.stake_accepted, cur), amount(s.stake_refused, cur),
                     f"{share:.1f} %", f"{s.combinations_at_cap:,}",
                     amount(s.top_stake, cur),
                     "-" if s.top_liability is None else amount(s.top_liability, cur)))
    widths = [max(len(r[k]) for r in (head, *rows)) for k in range(len(head))]
    for r in (head, *rows):
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)))
    lines += ["",
              "* the cap in force. Refused %: the share of the stake asked that the cap refuses.",
              f"At cap: combinations with less room than the smallest stake "
              f"({amount(min_stake, cur)}).",
              "Top liability: the largest top-rank prize one combination's accepted stakes "
              "could cost."]
    return "\n".join(lines) + "\n"
