"""The journal on its own (real files, no Redis): group commit, rotation, the chain, and
`verify` finding every kind of tampering by file and line, a torn tail not taken for one,
and the caps recomputed from the decisions alone."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from capsvc.client.models import TicketIn
from capsvc.config import load_settings
from capsvc.domain.decisions import ACCEPTED, REJECTED, Reserved, results_of
from capsvc.domain.errors import Unavailable
from capsvc.domain.validator import Sale, validate_ticket
from capsvc.journal import writer as writer_module
from capsvc.journal.reader import records
from capsvc.journal.recorder import Recorder
from capsvc.journal.records import SaleRecord
from capsvc.journal.verify import verify
from capsvc.journal.writer import Journal, journal_files, open_journal
from tests.decisions import build_decision

CONFIG = Path(__file__).parent.parent / "capsvc-test.toml"
RULES = load_settings(CONFIG).games["fdj-keno"]
HOT = [3, 7, 12, 18, 25, 33, 41, 56]


def sale(ticket_id: str, stake: int = 500, numbers: list[int] = HOT, draws: int = 1) -> Sale:
    t = msgspec.convert({"ticket_id": ticket_id, "game": "fdj-keno", "first_draw": 100,
                         "draws": draws, "grids": [{"numbers": numbers, "stake": stake}]},
                        TicketIn)
    return msgspec.structs.replace(validate_ticket(RULES, t), first_draw=100)


def spread(prefix: str, n: int) -> list[Sale]:
    """`n` sales of 500 on as many combinations: no cap is reached."""
    return [sale(f"{prefix}{i}", numbers=[*range(1, 8), 8 + i]) for i in range(n)]


def decision(s: Sale, accepted: bool = True) -> bytes:
    grid: dict[str, Any] = {"index": 0, "numbers": sorted(s.grids[0].numbers),
                            "status": "accepted" if accepted else "rejected"}
    return json.dumps({"ticket_id": s.ticket_id, "game": s.game,
                       "status": "accepted" if accepted else "rejected",
                       "draws": list(range(100, 100 + s.draws)), "grids": [grid],
                       "total_cost": s.grids[0].cost if accepted else 0,
                       "receipt": None}).encode()


async def write(journal: Journal, sales: list[Sale], *, cancel: set[str] = frozenset(),
                replay: bool = False) -> None:
    rec = Recorder(journal, lambda: 1)
    for i, s in enumerate(sales):
        sid = f"{i:016x}"
        waits = [rec.sale("answer", "fr-retail", s, sid, 1000 + i, decision(s), 10**13,
                          [5000] * s.draws)]
        if replay:
            waits.append(rec.sale("replay", "fr-retail", s, sid, 1000 + i, decision(s),
                                  10**13))
        if s.ticket_id in cancel:
            waits.append(rec.cancel("answer", "fr-retail", s, sid, 1000 + i, decision(s),
                                    10**13, 2000 + i, s.grids[0].cost))
        await asyncio.gather(*waits)


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


async def test_group_commit_one_batch_per_tick_and_each_caller_waits_for_its_own(
        tmp_path: Path) -> None:
    """Records of one tick are one batch, and every caller's record is in the file."""
    batches: list[int] = []
    journal = open_journal(tmp_path, max_file_bytes=1 << 20, keep_ms=86_400_000,
                           on_write=lambda records, size, s: batches.append(records))
    await write(journal, spread("T", 50))
    rec = Recorder(journal, lambda: 1)
    # 40 decisions in one tick: one batch, one fdatasync.
    await asyncio.gather(*[rec.sale("answer", "fr-retail", u, f"{i:016x}", 1, decision(u),
                                    10**13) for i, u in enumerate(spread("U", 40))])
    await journal.aclose()
    assert batches[-1] == 40
    (path,) = journal_files(tmp_path)
    assert len(lines(path)) == 1 + 50 + 40
    out = verify([tmp_path])
    assert out.ok
    assert not out.tails
    assert out.decisions == 90


async def test_files_rotate_chained_to_one_another(tmp_path: Path) -> None:
    """Rotated files name the file they follow, in seq order, and verify finds them intact."""
    journal = open_journal(tmp_path, max_file_bytes=4096, keep_ms=86_400_000)
    await write(journal, spread("T", 40))
    await journal.aclose()
    files = journal_files(tmp_path)
    assert len(files) > 3
    headers = [json.loads(lines(p)[0]) for p in files]
    assert [h["seq"] for h in headers] == list(range(len(files)))
    assert all(h["after"] == p.name for h, p in zip(headers[1:], files, strict=False))
    out = verify([tmp_path])
    assert out.ok, out.breaks
    assert out.decisions == 40


@pytest.mark.parametrize("how", ["altered", "removed", "swapped", "inserted"])
async def test_verify_names_the_file_and_line_of_any_tampering(tmp_path: Path, how: str
                                                               ) -> None:
    """A line altered, removed, swapped or inserted is a break named by file and line."""
    journal = open_journal(tmp_path, max_file_bytes=1 << 20, keep_ms=86_400_000)
    await write(journal, [sale(f"T{i}") for i in range(10)])
    await journal.aclose()
    (path,) = journal_files(tmp_path)
    content = lines(path)
    if how == "altered":  # a stake lowered in line 5: still valid JSON, still a record
        content[4] = content[4].replace(b'"stake":500', b'"stake":200')
    elif how == "removed":
        del content[4]
    elif how == "swapped":
        content[4], content[5] = content[5], content[4]
    else:
        content.insert(4, content[8])
    path.write_bytes(b"".join(content))
    out = verify([tmp_path])
    assert not out.ok
    assert any(str(path) in b and "line 5" in b for b in out.breaks), out.breaks


async def test_a_torn_last_line_is_a_tail_not_a_break(tmp_path: Path) -> None:
    """A torn last line of the newest file is a crash's tail: reported, no break, not read."""
    journal = open_journal(tmp_path, max_file_bytes=1 << 20, keep_ms=86_400_000)
    await write(journal, [sale(f"T{i}") for i in range(5)])
    await journal.aclose()
    (path,) = journal_files(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data + data.splitlines(keepends=True)[-1][:37])  # a crash mid-write
    out = verify([tmp_path])
    assert out.ok, out.breaks
    assert out.tails
    assert "line 7" in out.tails[0]
    assert out.decisions == 5


async def test_a_missing_file_is_a_break_unless_it_is_a_beginning_old_enough_to_be_pruned(
        tmp_path: Path) -> None:
    """A missing file is a break, unless it is a beginning old enough to have been pruned."""
    journal = open_journal(tmp_path, max_file_bytes=4096, keep_ms=86_400_000)
    await write(journal, spread("T", 40))
    await journal.aclose()
    files = journal_files(tmp_path)
    files[0].unlink()
    # Opened a moment ago: it cannot have been pruned past a keep of 90 days...
    assert any(files[0].name in b and "not pruned" in b for b in verify([tmp_path]).breaks)
    # ...but it may have been past a keep of 0 (nothing left before it: a beginning).
    assert verify([tmp_path], keep_ms=0).ok
    files[2].unlink()
    out = verify([tmp_path])
    assert any(files[2].name in b and "missing" in b for b in out.breaks), out.breaks


async def test_verify_recomputes_the_totals_and_names_a_combination_over_its_cap(
        tmp_path: Path) -> None:
    """Totals come from the decisions alone (a replay once, a cancel back); over a cap, named."""
    journal = open_journal(tmp_path, max_file_bytes=1 << 20, keep_ms=86_400_000)
    # 12 x 500 on one combination (cap 5000): 1000 over; a replay counts once; a cancel
    # gives its stake back.
    await write(journal, [sale(f"T{i}") for i in range(12)], replay=True)
    out = verify([tmp_path])
    assert out.over_cap
    assert "6000 staked, over its cap of 5000" in out.over_cap[0]
    await write(journal, [sale(f"C{i}") for i in range(1)], cancel={"C0"})
    await journal.aclose()
    out = verify([tmp_path])
    assert out.decisions == 13
    assert "6000 staked" in out.over_cap[0]


async def one_batch(journal: Journal, sales: list[Sale]) -> None:
    """Journal `sales` in one tick: one batch, one write."""
    rec = Recorder(journal, lambda: 1)
    await asyncio.gather(*[rec.sale("answer", "fr-retail", s, f"{i:016x}", 1, decision(s),
                                    10**13) for i, s in enumerate(sales)])


def half_then_enospc(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next write puts its first line and half of the rest on the disk, then fails with
    ENOSPC (as a disk that fills up mid-batch does)."""
    real_write = os.write
    calls = {"n": 0}

    def full_disk(fd: int, data: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            first = bytes(data).index(b"\n") + 1
            real_write(fd, bytes(data[: first + (len(data) - first) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(writer_module.os, "write", full_disk)


async def test_a_failed_write_fails_its_callers_and_the_next_file_chains_after_what_held(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed batch fails its callers; its file is cut back to where the next file says."""
    failures: list[int] = []
    journal = open_journal(tmp_path, max_file_bytes=1 << 20, keep_ms=86_400_000,
                           on_error=lambda: failures.append(1))
    await write(journal, [sale(f"T{i}") for i in range(3)])
    half_then_enospc(monkeypatch)
    with pytest.raises(Unavailable):
        await one_batch(journal, spread("LOST", 3))
    assert failures
    assert not journal.healthy
    assert await journal.probe()
    await write(journal, [sale("AFTER")])
    await journal.aclose()
    files = journal_files(tmp_path)
    assert len(files) == 2
    assert len(lines(files[0])) == 4
    assert files[0].read_bytes().endswith(b"\n")
    second = json.loads(lines(files[1])[0])
    assert second["after"] == files[0].name
    assert second["after_lines"] == 4
    out = verify([tmp_path])
    assert out.ok, out.breaks
    assert not out.tails
    assert out.decisions == 4


async def test_a_failed_file_the_disk_will_not_cut_back_is_named_past_its_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed file the disk will not cut back: verify names its lines past the next's open."""
    journal = open_journal(tmp_path, max_file_bytes=1 << 20, keep_ms=86_400_000)
    await write(journal, [sale(f"T{i}") for i in range(3)])
    half_then_enospc(monkeypatch)

    def refuse(fd: int, length: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(writer_module.os, "ftruncate", refuse)
    with pytest.raises(Unavailable):
        await one_batch(journal, spread("LOST", 3))
    await write(journal, [sale("AFTER")])
    await journal.aclose()
    first = journal_files(tmp_path)[0]
    out = verify([tmp_path])
    assert not out.ok
    assert any(b.startswith(f"{first}: line 5: past the file's end") for b in out.breaks), (
        out.breaks)
    assert any(b.startswith(f"{first}: line ") and "a torn last line" in b
               for b in out.breaks), out.breaks


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def chained(path: Path, record: dict[str, Any]) -> bytes:
    """`record` as the line that follows the last line of `path` (its `prev` the hash of
    that line): what a forger who can write the file would append."""
    last = lines(path)[-1].rstrip(b"\n")
    return json.dumps({"prev": hashlib.sha256(last).hexdigest(), **record},
                      separators=(",", ":")).encode() + b"\n"


def forged(path: Path, kind: str) -> bytes:
    """A line that chains after `path`'s last line: a cancel of the file's last sale, a
    new sale (of the same grids), or a torn line."""
    last = json.loads(lines(path)[-1])
    del last["prev"]
    if kind == "cancel":
        return chained(path, {**last, "type": "cancel", "cancelled_at": last["at"] + 1,
                              "released": 500})
    if kind == "sale":
        return chained(path, {**last, "ticket": "FORGED", "sale": "f" * 16})
    return chained(path, last)[:40]


@pytest.mark.parametrize("kind", ["cancel", "sale", "torn"])
async def test_a_line_appended_to_a_rotated_file_is_a_break(tmp_path: Path, kind: str
                                                            ) -> None:
    """A forged cancel, sale or torn line after a closed file's end is a break by file, line."""
    journal = open_journal(tmp_path, max_file_bytes=2048, keep_ms=86_400_000)
    await write(journal, [sale(f"T{i}") for i in range(9)])
    await journal.aclose()
    files = journal_files(tmp_path)
    assert len(files) > 2
    before = verify([tmp_path])
    assert before.ok, before.breaks
    closed = files[1]
    n = len(lines(closed))
    append(closed, forged(closed, kind))
    out = verify([tmp_path])
    assert not out.ok
    assert any(b.startswith(f"{closed}: line {n + 1}: ") and files[2].name in b
               for b in out.breaks), out.breaks
    assert not out.tails
    if kind == "cancel":
        assert sum(out.totals.values()) == sum(before.totals.values()) - 500
    elif kind == "sale":
        assert out.decisions == before.decisions + 1


async def lifetime(directory: Path, prefix: str, n: int) -> Journal:
    """A process lifetime that writes `n` sales and stops; every lifetime is pid 1 of the
    same host (a container restarted)."""
    journal = open_journal(directory, max_file_bytes=4096, keep_ms=86_400_000,
                           proc="pod-0/1")
    await write(journal, spread(prefix, n))
    await journal.aclose()
    return journal


async def test_each_lifetime_of_one_host_and_pid_is_a_chain_of_its_own_with_its_head(
        tmp_path: Path) -> None:
    """Two lifetimes of one host/pid are two chains, each head its own newest file's end."""
    first = await lifetime(tmp_path, "A", 30)
    second = await lifetime(tmp_path, "B", 5)
    assert first.life != second.life
    files = journal_files(tmp_path)
    by_life = {life: [p for p in files if json.loads(lines(p)[0])["life"] == life]
               for life in (first.life, second.life)}
    assert all(life in p.name for life, ps in by_life.items() for p in ps)
    assert len(by_life[first.life]) > len(by_life[second.life])
    out = verify([tmp_path])
    assert out.ok, out.breaks
    heads = {h.life: h.anchor for h in out.heads}
    assert heads.keys() == {first.life, second.life}
    for life, ps in by_life.items():
        newest = ps[-1]
        assert heads[life].file == newest.name
        assert heads[life].line == len(lines(newest))
        assert heads[life].sha256 == hashlib.sha256(lines(newest)[-1][:-1]).hexdigest()


@pytest.mark.parametrize("how", ["removed", "altered"])
async def test_the_newest_lifetimes_newest_line_changed_is_named_against_its_head(
        tmp_path: Path, how: str) -> None:
    """The newest lifetime's last line removed or altered: named given the printed heads."""
    await lifetime(tmp_path, "A", 30)
    second = await lifetime(tmp_path, "B", 5)
    heads = verify([tmp_path]).heads
    (head,) = [h.anchor for h in heads if h.life == second.life]
    newest = tmp_path / head.file
    content = lines(newest)
    if how == "removed":
        newest.write_bytes(b"".join(content[:-1]))
    else:
        newest.write_bytes(b"".join(content[:-1])
                           + content[-1].replace(b'"stake":500', b'"stake":100'))
    assert verify([tmp_path]).ok  # nothing in the files names the newest line...
    out = verify([tmp_path], anchors=[a.anchor for a in heads])
    assert not out.ok  # ...its head does
    assert [b for b in out.breaks if b.startswith(f"{newest}: line {head.line}")], out.breaks


async def test_a_file_forged_into_a_lifetime_beside_one_of_its_files_is_a_break(
        tmp_path: Path) -> None:
    """A second file of one lifetime's seq (a fork of its chain) is a break."""
    journal = open_journal(tmp_path, max_file_bytes=4096, keep_ms=86_400_000)
    await write(journal, spread("T", 20))
    await journal.aclose()
    files = journal_files(tmp_path)
    copy = files[1].name.replace(journal.life, journal.life + "-x")
    data = files[1].read_bytes().replace(files[1].name.encode(), copy.encode())
    (tmp_path / copy).write_bytes(data)
    out = verify([tmp_path])
    assert any("seq 1 of lifetime" in b and "again" in b for b in out.breaks), out.breaks


async def test_a_line_of_an_unknown_type_is_chained_and_skipped_by_readers(
        tmp_path: Path) -> None:
    """A line of an unknown type is chained, no break, skipped by readers; altered, named."""
    journal = open_journal(tmp_path, max_file_bytes=1 << 20, keep_ms=86_400_000)
    await write(journal, [sale("T0")])
    await journal.aclose()
    (path,) = journal_files(tmp_path)
    last = json.loads(lines(path)[-1])
    del last["prev"]
    append(path, chained(path, {"type": "marks", "at": 1}))
    append(path, chained(path, {"type": "marks", "draws": ["not", "an", "int"], "at": 2}))
    append(path, chained(path, {**last, "ticket": "T1"}))
    out = verify([tmp_path])
    assert out.ok, out.breaks
    assert out.records == 3
    assert out.decisions == 2
    assert [type(r).__name__ for _, _, r in records(tmp_path)] == [
        "Open", "SaleRecord", "SaleRecord"]
    path.write_bytes(path.read_bytes().replace(b'"an"', b'"a"'))
    assert any(f"{path}: line 5: does not follow line 4" in b
               for b in verify([tmp_path]).breaks)


async def test_first_answers_of_one_tick_share_a_line_each_with_its_own_instant(
        tmp_path: Path) -> None:
    """First answers journaled as results in one event-loop tick (sales decided apart, at
    other instants, through other calls: a cluster's steps) are one `sales` line a channel,
    game and way: their stamp and what they share once, each sale's instant its own; read
    back, each is the `sale` record it stands for, its body as answered."""
    journal = open_journal(tmp_path, max_file_bytes=1 << 20, keep_ms=86_400_000)
    rec = Recorder(journal, lambda: 1)
    sold = spread("S", 30)
    bodies = {}
    waits = []
    for i, s in enumerate(sold):
        at = 1_000 + 7 * i
        replies = [Reserved(ACCEPTED if i % 3 else REJECTED, room=100)]
        body = msgspec.json.encode(build_decision("fr-retail", RULES.tz, s, f"{i:016x}", at,
                                                  replies))
        bodies[s.ticket_id] = (at, body)
        waits.append(rec.sale("answer", "fr-retail", s, f"{i:016x}", at, body, 10**13,
                              [5000], results_of(RULES.time_zone, replies)))
    waits.append(rec.sale("replay", "fr-retail", sold[0], f"{0:016x}", bodies["S0"][0],
                          bodies["S0"][1], 10**13, None,
                          results_of(RULES.time_zone, [Reserved(REJECTED, room=100)])))
    await asyncio.gather(*waits)
    await journal.aclose()
    (path,) = journal_files(tmp_path)
    assert [json.loads(line)["type"] for line in lines(path)] == ["open", "sales", "sales"]
    read = [r for _, _, r in records(tmp_path) if isinstance(r, SaleRecord)]
    assert [(r.via, r.ticket) for r in read] == [("answer", s.ticket_id) for s in sold] + [
        ("replay", "S0")]
    for r in read:
        assert (r.at, bytes(r.decision)) == bodies[r.ticket]
    assert verify([tmp_path]).ok


async def test_a_sales_line_says_once_what_its_sales_share(tmp_path: Path) -> None:
    """A `sales` line says once what its sales share — the first draw, `until` (of each
    draw its sales end on), the cap of every draw — and each sale only what is its own (a
    draw played once, the default, is not said either); read back, every sale is the
    `sale` record it stands for, whatever it shared: another first draw, a subscription,
    another `until`, a draw at another cap, no cap recorded, no capped grid."""
    journal = open_journal(tmp_path, max_file_bytes=1 << 20, keep_ms=86_400_000)
    rec = Recorder(journal, lambda: 1)
    small = msgspec.convert({"ticket_id": "U", "game": "fdj-keno", "first_draw": 100,
                             "grids": [{"numbers": [1, 2, 3], "stake": 500}]}, TicketIn)
    top = 10**13 + 2
    cases: list[tuple[Sale, int, list[int] | None]] = [
        (sale("A"), top, [5000]),
        (sale("B", numbers=[*range(2, 10)]), top, [5000]),
        (msgspec.structs.replace(sale("C", numbers=[*range(3, 11)]), first_draw=101),
         top, [5000]),
        (sale("D", numbers=[*range(4, 12)], draws=2), top - 1, [5000, 5000]),
        (sale("E", numbers=[*range(5, 13)], draws=2), top - 1, [5000, 4000]),
        (sale("F", numbers=[*range(6, 14)]), top - 2, [4000]),
        (sale("G", numbers=[*range(7, 15)]), top, None),
        (validate_ticket(RULES, small), top, [5000]),
    ]
    wanted, decisions = {}, []
    for i, (s, until, caps) in enumerate(cases):
        assert s.first_draw is not None
        replies = [None if not g.capped else Reserved(ACCEPTED) for g in s.grids]
        wanted[s.ticket_id] = (s.first_draw, s.draws, until,
                               caps if any(g.capped for g in s.grids) else None)
        decisions.append(("answer", "fr-retail", s, f"{i:016x}", 1_000, b"", until, caps, None,
                          results_of(RULES.time_zone, replies)))
    # Another channel's line: sales ending on two draws, each draw's until said once.
    for i, (s, until) in enumerate([(sale("X"), 10**12), (sale("Y", draws=2), 10**12 + 7),
                                    (sale("Z", numbers=[*range(9, 17)]), 10**12)]):
        wanted[s.ticket_id] = (100, s.draws, until, [5000] * s.draws)
        decisions.append(("answer", "other", s, f"{i + 50:016x}", 1_000, b"", until,
                          [5000] * s.draws, None, results_of(RULES.time_zone, [None])))
    await rec.sales(decisions)
    await journal.aclose()
    (path,) = journal_files(tmp_path)
    line, other = [json.loads(x) for x in lines(path) if b'"sales"' in x]
    assert (other["until"], other["untils"]) == (10**12 + 7, [10**12, 10**12 + 7])
    assert [set(s) - {"ticket", "sale", "asked", "grids", "res"} for s in other["sales"]] == [
        set(), {"draws"}, set()]
    assert (line["first_draw"], line["draws"], line["until"], line["cap"]) == (
        100, 2, top, 5000)
    own = {s["ticket"]: set(s) - {"ticket", "sale", "asked", "grids", "res"}
           for s in line["sales"]}
    assert own == {"A": set(), "B": set(), "C": {"first_draw"}, "D": {"draws", "until"},
                   "E": {"draws", "until", "caps"}, "F": {"until", "caps"}, "G": {"caps"},
                   "U": set()}
    read = [r for _, _, r in records(tmp_path) if isinstance(r, SaleRecord)]
    assert {r.ticket: (r.first_draw, r.draws, r.until, r.caps) for r in read} == wanted
    assert verify([tmp_path]).ok
