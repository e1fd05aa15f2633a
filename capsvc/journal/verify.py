"""`capsvc journal verify`: are the journal files intact, and did every cap hold?

1. Each lifetime's chain: every line names the SHA-256 of the line before it; a file's
   first line (`open`) names the file it follows (same lifetime, `seq` one less), how many
   lines that file has and the hash of the last of them. A removed, altered, inserted or
   moved line, a line after the end the next file names, or a file missing between two of
   one lifetime's files, is a break, named by file and line. A torn last line of a
   lifetime's newest file is a crash's tail: reported, not a break. A lifetime's first
   files may be missing (pruned past `[journal] keep`); a gap after a present file may not.
   The end of each lifetime's chain, its head, is printed: anchored elsewhere and given back
   (`anchors`), the lines up to it are checked too.
2. The totals: every (game, draw, combination) total recomputed from the decisions alone
   (one per sale, whichever process or how many times it was journaled; a cancel takes it
   back), against the cap in force on that draw (carried by the decisions). Any over its
   cap is named.
3. With Redis (`--redis`): each total of a draw still retained, against Redis's counter.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import msgspec

from capsvc.client.models import TicketOut
from capsvc.domain import combination
from capsvc.domain.games import Catalog
from capsvc.journal.reader import FileCheck, header_of, read
from capsvc.journal.records import CancelRecord, CapRecord, Open, SaleRecord
from capsvc.journal.writer import journal_files
from capsvc.redis.store import Store, replies_of, ticket_key

_decision = msgspec.json.Decoder(TicketOut).decode

_ANCHOR = re.compile(r"([^:/]+):([1-9][0-9]*):([0-9a-fA-F]{64})")

Total = tuple[str, int, str]
"""(game, draw, combination key)."""


@dataclass(frozen=True)
class Anchor:
    """A line written down elsewhere: `file:line:sha256`."""

    file: str
    line: int
    sha256: str

    @classmethod
    def parse(cls, text: str) -> Anchor:
        """Raises ValueError unless `text` is `file:line:sha256`."""
        match = _ANCHOR.fullmatch(text)
        if match is None:
            raise ValueError(f"not file:line:sha256: {text!r}")
        return cls(match[1], int(match[2]), match[3].lower())

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.sha256}"


@dataclass(frozen=True)
class Head:
    """The end of a lifetime's chain: the last line of its newest file."""

    life: str
    proc: str
    anchor: Anchor

    def __str__(self) -> str:
        return f"{self.anchor} (life {self.life}, {self.proc})"


@dataclass
class Verification:
    files: list[FileCheck] = field(default_factory=list)
    breaks: list[str] = field(default_factory=list)
    tails: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    decisions: int = 0
    """Sales (and cancels) counted, one per sale."""
    records: int = 0
    totals: dict[Total, int] = field(default_factory=dict)
    caps: dict[tuple[str, int], int] = field(default_factory=dict)
    tickets: dict[tuple[str, str], tuple[str, str, int]] = field(default_factory=dict)
    """(channel, ticket id) -> (sale id, game, last draw) of each decision, the last
    journaled: checked against Redis's ticket records (`compare_with_redis`)."""
    until: dict[tuple[str, int], int] = field(default_factory=dict)
    """The latest expiry (Redis ms) of a decision on each (game, draw)."""
    over_cap: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    heads: list[Head] = field(default_factory=list)
    """The last line of each lifetime's newest file: nothing in the files names it; keep
    it elsewhere to anchor it."""

    @property
    def ok(self) -> bool:
        return not self.breaks and not self.over_cap and not self.mismatches


def numbers_of(combo: str) -> str:
    return "-".join(str(n) for n in combination.decode(combo))


def verify(directories: Iterable[Path], keep_ms: int = 90 * 86_400_000,
           anchors: Iterable[Anchor] = ()) -> Verification:
    """Check `directories` (see the module's docstring); `keep_ms`: the `[journal] keep`
    they were written with (a missing file younger than that cannot have been pruned);
    `anchors`: heads printed by an earlier `verify`, which must still be there."""
    out = Verification()
    anchors = list(anchors)
    counted: set[tuple[str, str, str]] = set()
    cancelled: set[tuple[str, str, str]] = set()
    paths: list[Path] = []
    for directory in directories:
        files = journal_files(directory)
        if not files:
            out.notes.append(f"{directory}: no journal file")
        paths += files
    # The lines other files say they follow, and the anchored ones: their hashes are kept
    # while reading.
    wanted: dict[str, set[int]] = {}
    for anchor in anchors:
        wanted.setdefault(anchor.file, set()).add(anchor.line)
    for path in paths:
        header = header_of(path)
        if header is not None and header.after is not None and header.after_lines:
            wanted.setdefault(header.after, set()).add(header.after_lines)
    for path in paths:
        check = FileCheck(path)
        capture = frozenset(wanted.get(path.name, ()))
        for n, record in read(path, check, capture=capture):
            out.records += 1
            if isinstance(record, SaleRecord):
                try:
                    _decision_of(out, record, counted, cancelled)
                except msgspec.ValidationError as e:
                    check.breaks.append(f"line {n}: its decision is not one ({e})")
            elif isinstance(record, CapRecord):
                out.caps.setdefault((record.game, record.draw), record.cap)
        out.files.append(check)
        out.breaks += [f"{path}: {b}" for b in check.breaks]
    _check_lifetimes(out, keep_ms)
    _check_anchors(out, anchors, keep_ms)
    for (game, draw, combo), total in sorted(out.totals.items()):
        cap = out.caps.get((game, draw))
        if cap is not None and total > cap:
            out.over_cap.append(f"{game} draw {draw}: {numbers_of(combo)} has {total} staked, "
                                f"over its cap of {cap}")
    return out


def _decision_of(out: Verification, r: SaleRecord, counted: set[tuple[str, str, str]],
                 cancelled: set[tuple[str, str, str]]) -> None:
    key = (r.channel, r.ticket, r.sale)
    out.tickets[r.channel, r.ticket] = (r.sale, r.game, r.first_draw + r.draws - 1)
    if r.caps:
        for i, cap in enumerate(r.caps):
            out.caps.setdefault((r.game, r.first_draw + i), cap)
    for d in range(r.first_draw, r.first_draw + r.draws):
        out.until[r.game, d] = max(out.until.get((r.game, d), 0), r.until)
    cancel = isinstance(r, CancelRecord)
    if key in cancelled or (key in counted and not cancel):
        return
    sign = 0
    if cancel:
        cancelled.add(key)
        if key in counted:
            sign = -1  # counted by an earlier record of the sale: taken back
    else:
        counted.add(key)
        out.decisions += 1
        sign = 1
    if not sign:
        return
    decision = _decision(r.decision)
    for grid, outcome in zip(r.grids, decision.grids, strict=False):
        if not grid.capped or outcome.status != "accepted":
            continue
        combo = combination.encode(grid.numbers)
        for d in range(r.first_draw, r.first_draw + r.draws):
            k = (r.game, d, combo)
            out.totals[k] = out.totals.get(k, 0) + sign * grid.stake


def opened_at(name: str) -> float | None:
    """When a journal file was opened, from its name (seconds since the epoch)."""
    try:
        stamp = name.split("-", 2)[1]
        return datetime.strptime(stamp, "%Y%m%dT%H%M%S%fZ").replace(tzinfo=UTC).timestamp()
    except (IndexError, ValueError):
        return None


def _prunable(name: str, keep_ms: int) -> bool:
    """Whether a file of that name can be gone past `keep` (its name says when it opened)."""
    opened = opened_at(name)
    return opened is None or opened < time.time() - keep_ms / 1000


def _check_lifetimes(out: Verification, keep_ms: int) -> None:
    """Each lifetime's files are one chain: each follows the one before (seq one less) from
    its exact end, none is missing after the first present, none missing before it is too
    young to have been pruned; a torn line ends only a lifetime's newest file."""
    by_life: dict[str, list[tuple[Open, FileCheck]]] = {}
    for check in out.files:
        if check.header is not None:
            by_life.setdefault(check.header.life, []).append((check.header, check))
        elif check.tail:  # torn in its first line: a crash as the file opened
            out.tails.append(f"{check.path}: {check.tail}")
    for life, files in by_life.items():
        files.sort(key=lambda f: f[0].seq)
        header, newest = files[-1]
        out.heads.append(Head(life, header.proc, Anchor(newest.path.name, newest.lines,
                                                        newest.last_hash or "")))
        if newest.tail:
            out.tails.append(f"{newest.path}: {newest.tail}")
        names = {check.path.name: (header, check) for header, check in files}
        for i, (header, check) in enumerate(files):
            if i and files[i - 1][0].seq == header.seq:
                out.breaks.append(f"{check.path}: seq {header.seq} of lifetime {life} "
                                  f"again (also {files[i - 1][1].path.name})")
            if header.after is None:
                if header.seq:
                    out.breaks.append(f"{check.path}: seq {header.seq} of lifetime {life} "
                                      "follows no file")
                continue
            before = names.get(header.after)
            if before is None:
                prunable = _prunable(header.after, keep_ms)
                if i == 0 and prunable:
                    out.notes.append(f"{check.path}: follows {header.after}, not present "
                                     "(pruned, or kept elsewhere)")
                else:
                    why = "" if prunable else ", opened within [journal] keep: not pruned"
                    out.breaks.append(f"{check.path}: follows {header.after}, which is "
                                      f"missing (lifetime {life}, {header.proc}{why})")
                continue
            if before[0].seq != header.seq - 1:
                out.breaks.append(f"{check.path}: seq {header.seq} follows {header.after}, "
                                  f"of seq {before[0].seq}")
            _check_end(out, before[1], check, header.after_lines or 0)


def _check_end(out: Verification, before: FileCheck, check: FileCheck, lines: int) -> None:
    """`before` ends with its line `lines`, the line `check`'s first line follows."""
    follows = f"{check.path.name} follows its line {lines}"
    if before.lines < lines:
        out.breaks.append(f"{check.path}: follows line {lines} of {before.path.name}, "
                          f"which has {before.lines} line(s): lines were removed")
        return
    if before.lines > lines:
        out.breaks.append(f"{before.path}: line {lines + 1}: past the file's end "
                          f"({follows}): {before.lines - lines} line(s) added to a closed "
                          "file")
    if before.tail:
        out.breaks.append(f"{before.path}: {before.tail}, past the file's end ({follows})")
    if lines and check.first_prev != before.captured.get(lines):
        out.breaks.append(f"{check.path}: line 1 does not follow line {lines} of "
                          f"{before.path.name} (its prev hash differs)")


def _check_anchors(out: Verification, anchors: list[Anchor], keep_ms: int) -> None:
    """Each anchored line is still there, unchanged (and so is every line before it: the
    chain names them)."""
    by_name = {check.path.name: check for check in out.files}
    for anchor in anchors:
        check = by_name.get(anchor.file)
        if check is None:
            if _prunable(anchor.file, keep_ms):
                out.notes.append(f"anchored {anchor.file}: not present (pruned, or kept "
                                 "elsewhere)")
            else:
                out.breaks.append(f"anchored {anchor.file}: missing (opened within "
                                  "[journal] keep: not pruned)")
        elif check.lines < anchor.line:
            out.breaks.append(f"{check.path}: line {anchor.line} anchored, the file has "
                              f"{check.lines} line(s): lines were removed")
        elif check.captured.get(anchor.line) != anchor.sha256:
            out.breaks.append(f"{check.path}: line {anchor.line}: not the anchored line (its "
                              "sha256 differs: it, or a line before it, was altered, removed "
                              "or inserted)")


async def compare_with_redis(out: Verification, store: Store, catalog: Catalog) -> int:
    """Each ticket and each total of a draw still retained against Redis: the ticket record
    holds the journaled sale, the counter the journal's total (differences go to
    `out.mismatches`); returns how many tickets and totals were compared."""
    now = await store.time_ms()
    retained = [(channel, ticket, sale) for (channel, ticket), (sale, game_id, last)
                in out.tickets.items()
                if (game := catalog.get(game_id)) is not None and game.expire_at(last) > now]
    for i in range(0, len(retained), 1000):
        chunk = retained[i:i + 1000]
        replies = await replies_of([store.ticket(ticket_key(c, t)) for c, t, _ in chunk])
        for (channel, ticket, sale), record in zip(chunk, replies, strict=True):
            if record is None:
                out.mismatches.append(f"ticket {ticket} of {channel}: decided in the journal "
                                      f"(sale {sale}), unknown to Redis")
            elif record.sale_id != sale:
                out.mismatches.append(f"ticket {ticket} of {channel}: sale {sale} in the "
                                      f"journal, {record.sale_id} in Redis")
    by_draw: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for (game_id, draw, combo), total in out.totals.items():
        game = catalog.get(game_id)
        if game is None or game.expire_at(draw) <= now:
            continue
        by_draw.setdefault((game_id, draw), []).append((combo, total))
    compared = 0
    for (game_id, draw), items in sorted(by_draw.items()):
        replies = await replies_of(store.counters_of(game_id, draw, [c for c, _ in items]))
        for (combo, total), reply in zip(items, replies, strict=True):
            compared += 1
            counted = int(reply or 0)
            if counted != total:
                out.mismatches.append(
                    f"{game_id} draw {draw}: {numbers_of(combo)}: the journal has {total}, "
                    f"Redis {counted}")
    return compared + len(retained)
