"""`capsvc journal verify`: are the journal files intact, and did every cap hold?

1. Each file's chain: every line names the SHA-256 of the line before it; a file's first
   line (`open`) names the file it follows (same process, `seq` one less) and the hash of
   that file's last durable line. A removed, altered, inserted or moved line, or a file
   missing between two of one process's files, is a break, named by file and line. A torn
   last line (a crash, a failed write) is a tail: reported, not a break. A process's first
   files may be missing (pruned past `[journal] keep`); a gap after a present file may not.
2. The totals: every (game, draw, combination) total recomputed from the decisions alone
   (one per sale, whichever process or how many times it was journaled; a cancel takes it
   back), against the cap in force on that draw (carried by the decisions). Any over its
   cap is named.
3. With Redis (`--redis`): each total of a draw still retained, against Redis's counter.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import msgspec

from capsvc import combination
from capsvc.games import Catalog
from capsvc.journal.reader import FileCheck, header_of, read
from capsvc.journal.records import CancelRecord, CapRecord, SaleRecord
from capsvc.journal.writer import journal_files
from capsvc.models import TicketOut
from capsvc.store import Store, replies_of, ticket_key

_decision = msgspec.json.Decoder(TicketOut).decode

Total = tuple[str, int, str]
"""(game, draw, combination key)."""


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
    heads: list[str] = field(default_factory=list)
    """The last line of each process's newest file, with its hash: nothing in the files
    names it yet; keep it elsewhere (or ship the files) to anchor it."""

    @property
    def ok(self) -> bool:
        return not self.breaks and not self.over_cap and not self.mismatches


def numbers_of(combo: str) -> str:
    return "-".join(str(n) for n in combination.decode(combo))


def verify(directories: Iterable[Path], keep_ms: int = 90 * 86_400_000) -> Verification:
    """Check `directories` (see the module's docstring); `keep_ms`: the `[journal] keep`
    they were written with (a missing file younger than that cannot have been pruned)."""
    out = Verification()
    counted: set[tuple[str, str, str]] = set()
    cancelled: set[tuple[str, str, str]] = set()
    for directory in directories:
        files = journal_files(directory)
        if not files:
            out.notes.append(f"{directory}: no journal file")
        # The lines other files say they follow: their hashes are kept while reading.
        wanted: dict[str, set[int]] = {}
        for path in files:
            header = header_of(path)
            if header is not None and header.after is not None and header.after_lines:
                wanted.setdefault(header.after, set()).add(header.after_lines)
        for path in files:
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
            if check.tail:
                out.tails.append(f"{path}: {check.tail}")
    _check_sequences(out, keep_ms)
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


def _check_sequences(out: Verification, keep_ms: int) -> None:
    """Each process's files follow one another: none missing after the first present, and
    none missing before it that is too young to have been pruned."""
    by_proc: dict[str, list[FileCheck]] = {}
    for check in out.files:
        if check.header is not None:
            by_proc.setdefault(check.header.proc, []).append(check)
    for proc, checks in by_proc.items():
        checks.sort(key=lambda c: c.header.seq if c.header else 0)
        names = {c.path.name: c for c in checks}
        newest = checks[-1]
        out.heads.append(f"{proc}: {newest.path.name} line {newest.lines} sha256 "
                         f"{newest.last_hash}")
        for i, check in enumerate(checks):
            header = check.header
            assert header is not None
            if header.after is None:
                continue
            before = names.get(header.after)
            opened = opened_at(header.after)
            prunable = opened is None or opened < time.time() - keep_ms / 1000
            if before is None:
                if i == 0 and prunable:
                    out.notes.append(f"{check.path}: follows {header.after}, not present "
                                     "(pruned, or kept elsewhere)")
                else:
                    why = "" if prunable else ", opened within [journal] keep: not pruned"
                    out.breaks.append(f"{check.path}: follows {header.after}, which is "
                                      f"missing (process {proc}{why})")
                continue
            wanted = header.after_lines or 0
            if before.lines < wanted:
                out.breaks.append(f"{check.path}: follows line {wanted} of {header.after}, "
                                  f"which has {before.lines} line(s): lines were removed")
            elif wanted and check.first_prev != before.captured.get(wanted):
                out.breaks.append(f"{check.path}: line 1 does not follow line {wanted} of "
                                  f"{header.after} (its prev hash differs)")


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
        sale_ids = [reply[3] for reply in replies]  # Store.ticket: [st, body, sale, sid, …]
        for (channel, ticket, sale), sid in zip(chunk, sale_ids, strict=True):
            if sid is None:
                out.mismatches.append(f"ticket {ticket} of {channel}: decided in the journal "
                                      f"(sale {sale}), unknown to Redis")
            elif sid.decode() != sale:
                out.mismatches.append(f"ticket {ticket} of {channel}: sale {sale} in the "
                                      f"journal, {sid.decode()} in Redis")
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
