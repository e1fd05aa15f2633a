"""The audit's pure parts on real journal files (no Redis): a draw's report counts each
sale once whatever was journaled again, cancels take back, the caps are judged from the
decisions alone; the export is read strictly; each kind of difference is found exactly."""

from __future__ import annotations

import asyncio
import csv
import hashlib
import io
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import msgspec
import pytest

from capsvc.audit.history import read_history
from capsvc.audit.reconcile import ExportError, Known, read_export, reconcile
from capsvc.audit.report import NO_ACTIVITY, build, to_csv, to_json
from capsvc.client.models import TicketIn
from capsvc.config import load_settings
from capsvc.domain.decisions import ACCEPTED, REJECTED, Reserved
from capsvc.domain.games import Game
from capsvc.domain.validator import Sale, validate_ticket
from capsvc.journal.recorder import Recorder
from capsvc.journal.writer import Journal, journal_files, open_journal
from tests.decisions import build_decision

CONFIG = Path(__file__).parent.parent / "capsvc-test.toml"
GAME = Game(load_settings(CONFIG).games["fdj-keno"])
TZ = ZoneInfo("Europe/Paris")
DRAW = 9000
HOT = [3, 7, 12, 18, 25, 33, 41, 56]
NOW = GAME.calendar.close_ms(DRAW) - 3_600_000


def sale(ticket_id: str, grids: list[dict[str, Any]], *, first: int = DRAW, draws: int = 1,
         joker: bool = False) -> Sale:
    t = msgspec.convert({"ticket_id": ticket_id, "game": "fdj-keno", "first_draw": first,
                         "draws": draws, "grids": grids, "joker_plus": joker}, TicketIn)
    return msgspec.structs.replace(validate_ticket(GAME.rules, t), first_draw=first)


class Book:
    """Journals decisions as the service does (real Recorder, real Journal)."""

    def __init__(self, directory: Path) -> None:
        self.journal: Journal = open_journal(directory, max_file_bytes=1 << 20,
                                             keep_ms=86_400_000)
        self.rec = Recorder(self.journal, lambda: NOW)
        self.n = 0

    async def sell(self, s: Sale, replies: list[Any], *, channel: str = "fr-retail",
                   cancel: bool = False, replays: int = 0, cap: int = 5000) -> tuple[str, int]:
        """Journal the decision of `s` (its capped grids' reserve `replies`); its sale id
        and total cost."""
        self.n += 1
        sid = f"{self.n:016x}"
        at = NOW + self.n
        body = msgspec.json.encode(build_decision(channel, TZ, s, sid, at, [
            None if r is None else Reserved(r[0], offset=r[1], room=r[2]) if r[0] == REJECTED
            else Reserved(r[0]) for r in replies]))
        until = GAME.expire_at(s.first_draw + s.draws - 1)  # type: ignore[operator]
        waits = [self.rec.sale("answer", channel, s, sid, at, body, until, [cap] * s.draws)]
        waits += [self.rec.sale("lookup", channel, s, sid, at, body, until)
                  for _ in range(replays)]
        total: int = msgspec.json.decode(body)["total_cost"]
        if cancel:
            waits.append(self.rec.cancel("answer", channel, s, sid, at, body, until, at + 5,
                                         total))
        await asyncio.gather(*waits)
        return sid, total

    async def void(self, s: Sale) -> None:
        self.n += 1
        await self.rec.void("abandoned", "fr-retail", s, f"{self.n:016x}", NOW,
                            GAME.expire_at(DRAW))

    async def close(self) -> None:
        await self.journal.aclose()


@pytest.fixture
async def book(tmp_path: Path) -> Any:
    b = Book(tmp_path / "j")
    yield b
    await b.close()


def report_of(directory: Path, draw: int = DRAW) -> Any:
    history = read_history([directory], GAME, range(draw, draw + 1))
    return build(history, GAME, draw, built_ms=NOW, final=False)


async def test_the_report_counts_each_sale_once_by_state_reason_picks_and_channel(
        book: Book, tmp_path: Path) -> None:
    """Replays and look-ups journal a decision again: counted once; a cancel takes its
    grids back; a void counts nothing; rejected grids are counted by reason."""
    eight = {"numbers": HOT, "stake": 500}
    small = {"numbers": [1, 2, 3], "stake": 200, "multiplier": True}
    await book.sell(sale("A", [eight, small], joker=True), [[ACCEPTED], None], replays=2)
    await book.sell(sale("B", [eight, small]), [[REJECTED, 0, 100], None])
    await book.sell(sale("C", [eight]), [[REJECTED, 0, 100]])
    await book.sell(sale("D", [eight]), [[ACCEPTED]], cancel=True)
    await book.sell(sale("E", [small]), [None], channel="pf-retail", replays=1)
    await book.void(sale("F", [eight]))
    r = report_of(tmp_path / "j")
    assert (r.tickets.accepted, r.tickets.partial, r.tickets.rejected, r.tickets.cancelled,
            r.tickets.void) == (2, 1, 1, 1, 1)
    assert (r.grids.accepted, r.grids.cancelled) == (4, 1)
    assert [(x.reason, x.grids) for x in r.grids.rejected] == [("combination_capped", 2)]
    assert [(p.picks, p.grids, p.stake, p.amount) for p in r.by_picks] == [
        (3, 3, 600, 1200), (8, 1, 500, 500)]
    assert [(c.channel, c.tickets, c.stake, c.amount, c.cancelled) for c in r.by_channel] == [
        ("fr-retail", 2, 900, 500 + 400 + 200 + 400, 1), ("pf-retail", 1, 200, 400, 0)]
    assert (r.stake, r.cancelled_stake) == (1100, 500)
    assert r.amount == 500 + 400 + 200 + 400 + 400  # grids (twice with the multiplier), Joker+


async def test_the_report_lists_each_refused_cancelled_and_void_ticket_once(
        book: Book, tmp_path: Path) -> None:
    """Rejected, cancelled and void tickets are listed (accepted ones only counted), each
    once however often journaled, sorted by channel then ticket id, with where its record
    is; the CSV carries the same rows, one field a row, keyed channel/ticket/sale."""
    eight = {"numbers": HOT, "stake": 500}
    small = {"numbers": [1, 2, 3], "stake": 200}
    await book.sell(sale("OK", [eight]), [[ACCEPTED]], replays=1)
    rej_sid, rej_cost = await book.sell(sale("Z-REJ", [eight, small]),
                                        [[REJECTED, 0, 100], [REJECTED, 0, 100]], replays=2)
    can_sid, can_cost = await book.sell(sale("CAN", [eight, small]), [[ACCEPTED], None],
                                        cancel=True)
    await book.sell(sale("A-REJ", [eight]), [[REJECTED, 0, 0]], channel="pf-retail")
    await book.void(sale("VOID", [eight, small]))
    r = report_of(tmp_path / "j")
    lists = r.ticket_lists
    assert [(t.channel, t.ticket_id) for t in lists.rejected] == [
        ("fr-retail", "Z-REJ"), ("pf-retail", "A-REJ")]
    assert len(lists.rejected) == r.tickets.rejected
    rej = lists.rejected[0]
    assert (rej.sale, rej.status, rej.reason, rej.stake, rej.total_cost, rej.grids) == (
        rej_sid, "rejected", "combination_capped", 700, rej_cost, 2)
    (can,) = lists.cancelled
    assert (can.ticket_id, can.sale, can.status, can.stake, can.released) == (
        "CAN", can_sid, "accepted", 700, can_cost)
    assert can.stake == r.cancelled_stake
    assert can.cancelled_at is not None
    assert can.decided_at < can.cancelled_at
    (void,) = lists.void
    assert (void.ticket_id, void.status, void.reason, void.stake, void.total_cost) == (
        "VOID", None, "abandoned", 700, None)
    (path,) = journal_files(tmp_path / "j")
    lines = path.read_text().splitlines()
    assert '"type":"cancel"' in lines[can.line - 1]
    assert '"CAN"' in lines[can.line - 1]
    assert '"type":"void"' in lines[void.line - 1]
    assert '"Z-REJ"' in lines[rej.line - 1]
    assert {t.file for t in (rej, can, void)} == {path.name}
    as_json = msgspec.json.decode(to_json(r))
    assert as_json["report"] == 2
    assert [t["ticket_id"] for t in as_json["ticket_lists"]["rejected"]] == ["Z-REJ", "A-REJ"]
    rows = list(csv.reader(io.StringIO(to_csv(r))))
    assert all(len(row) == 4 for row in rows)
    cells = {(s, k, f): v for s, k, f, v in rows[1:]}
    key = f"fr-retail/CAN/{can_sid}"
    assert cells["cancelled", key, "released"] == str(can_cost)
    assert cells["cancelled", key, "line"] == str(can.line)
    assert cells["void", f"fr-retail/VOID/{void.sale}", "total_cost"] == ""
    assert {k for s, k, _ in cells if s == "rejected"} == {
        f"fr-retail/Z-REJ/{rej_sid}", f"pf-retail/A-REJ/{lists.rejected[1].sale}"}


async def test_caps_reached_and_passed_are_named_and_over_cap_is_empty_when_it_held(
        book: Book, tmp_path: Path) -> None:
    """A total equal to the cap is at_cap; above it (a restore that counted past the cap)
    is over_cap with its excess; the top 20 carry the top-rank liability."""
    for i in range(10):
        await book.sell(sale(f"H{i}", [{"numbers": HOT, "stake": 500}]), [[ACCEPTED]])
    nine = [*HOT, 60]
    await book.sell(sale("N", [{"numbers": nine, "stake": 1000}]), [[ACCEPTED]])
    r = report_of(tmp_path / "j")
    assert [(c.numbers, c.staked) for c in r.at_cap] == [(HOT, 5000)]
    assert r.over_cap == []
    assert [(t.numbers, t.staked, t.liability) for t in r.top] == [
        (HOT, 5000, 5000 * 100000 // 100), (nine, 1000, 1000 * 2000000 // 100)]
    assert r.cap == 5000
    assert r.cap_fixed
    await book.sell(sale("X", [{"numbers": HOT, "stake": 300}]), [[ACCEPTED]])
    over = report_of(tmp_path / "j")
    assert [(c.numbers, c.staked, c.excess) for c in over.over_cap] == [(HOT, 5300, 300)]
    assert over.at_cap == []


def test_a_draw_nobody_played_reports_no_activity(tmp_path: Path) -> None:
    """No journal at all, or one without this draw: "no activity", every count 0, the cap
    of the configuration (not fixed by any sale)."""
    (tmp_path / "j").mkdir()
    r = report_of(tmp_path / "j")
    assert (r.activity, r.summary) == (False, NO_ACTIVITY)
    assert (r.tickets.accepted, r.stake, r.top, r.over_cap) == (0, 0, [], [])
    assert (r.cap, r.cap_fixed) == (5000, False)


async def test_a_subscription_is_in_the_report_of_each_of_its_draws_only(
        book: Book, tmp_path: Path) -> None:
    """A ticket of 5 draws from DRAW counts on DRAW..DRAW+4, with its stake on each."""
    await book.sell(sale("S", [{"numbers": HOT, "stake": 200}], draws=5), [[ACCEPTED]])
    for d in range(DRAW, DRAW + 5):
        r = report_of(tmp_path / "j", d)
        assert (r.tickets.accepted, r.stake, r.top[0].staked) == (1, 200, 200), d
    assert report_of(tmp_path / "j", DRAW + 5).summary == NO_ACTIVITY
    assert report_of(tmp_path / "j", DRAW - 1).summary == NO_ACTIVITY


async def test_a_sale_journaled_by_two_hosts_and_cancelled_in_the_other_file_counts_once(
        tmp_path: Path) -> None:
    """Two journal directories (two hosts): one's replay and the other's cancel of the
    same sale; whichever order they are read in, the sale is cancelled, counted once."""
    s = sale("T", [{"numbers": HOT, "stake": 500}])
    first, second = Book(tmp_path / "a"), Book(tmp_path / "b")
    sid, _ = await first.sell(s, [[ACCEPTED]])
    body = msgspec.json.encode(build_decision("fr-retail", TZ, s, sid, NOW + 1,
                                              [Reserved(ACCEPTED)]))
    await second.rec.cancel("answer", "fr-retail", s, sid, NOW + 1, body,
                            GAME.expire_at(DRAW), NOW + 9, 500)
    await first.close()
    await second.close()
    for dirs in ([tmp_path / "a", tmp_path / "b"], [tmp_path / "b", tmp_path / "a"]):
        r = build(read_history(dirs, GAME, range(DRAW, DRAW + 1)), GAME, DRAW,
                  built_ms=NOW, final=True)
        assert (r.tickets.accepted, r.tickets.cancelled, r.stake) == (0, 1, 0)


async def test_two_hosts_journals_list_every_ticket_once_and_sum_their_counts(
        tmp_path: Path) -> None:
    """Two directories, each a host's decisions, one sale journaled by both (a replay on
    the other host): the report of both lists and counts each ticket once, the sum of
    each host's report less the one journaled twice."""
    eight = {"numbers": HOT, "stake": 500}
    a, b = Book(tmp_path / "a"), Book(tmp_path / "b")
    b.n = 100  # sale ids of their own
    await a.sell(sale("A1", [eight]), [[REJECTED, 0, 0]])
    await a.sell(sale("A2", [eight]), [[ACCEPTED]], cancel=True)
    await a.void(sale("A3", [eight]))
    s = sale("S", [eight])
    sid, _ = await a.sell(s, [[REJECTED, 0, 0]])
    body = msgspec.json.encode(build_decision("fr-retail", TZ, s, sid, NOW + 1,
                                              [Reserved(REJECTED, offset=0, room=0)]))
    await b.rec.sale("lookup", "fr-retail", s, sid, NOW + 1, body, GAME.expire_at(DRAW))
    await b.sell(sale("B1", [eight]), [[REJECTED, 0, 0]])
    await b.sell(sale("B2", [eight]), [[ACCEPTED]], cancel=True)
    await b.void(sale("B3", [eight]))
    await b.sell(sale("B4", [eight]), [[ACCEPTED]])
    await a.close()
    await b.close()
    both = build(read_history([tmp_path / "a", tmp_path / "b"], GAME, range(DRAW, DRAW + 1)),
                 GAME, DRAW, built_ms=NOW, final=True)
    lists = both.ticket_lists
    assert [t.ticket_id for t in lists.rejected] == ["A1", "B1", "S"]
    assert [t.ticket_id for t in lists.cancelled] == ["A2", "B2"]
    assert [t.ticket_id for t in lists.void] == ["A3", "B3"]
    assert (both.tickets.rejected, both.tickets.cancelled, both.tickets.void,
            both.tickets.accepted) == (3, 2, 2, 1)
    one, other = report_of(tmp_path / "a"), report_of(tmp_path / "b")
    assert both.tickets.rejected == one.tickets.rejected + other.tickets.rejected - 1
    assert both.cancelled_stake == one.cancelled_stake + other.cancelled_stake == 1000


async def test_the_report_names_its_files_with_digests_and_a_broken_chain(
        book: Book, tmp_path: Path) -> None:
    """Each file read is named with the SHA-256 of its bytes (sha256sum agrees); a line
    altered breaks the chain and the report says so."""
    await book.sell(sale("A", [{"numbers": HOT, "stake": 500}]), [[ACCEPTED]])
    await book.sell(sale("B", [{"numbers": HOT, "stake": 500}]), [[ACCEPTED]])
    (path,) = journal_files(tmp_path / "j")
    r = report_of(tmp_path / "j")
    (source,) = r.sources
    assert source.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (source.lines, source.bytes) == (len(path.read_bytes().splitlines()),
                                            path.stat().st_size)
    assert r.chain.intact
    path.write_bytes(path.read_bytes().replace(b'"stake":500', b'"stake":400', 1))
    assert not report_of(tmp_path / "j").chain.intact


async def test_the_csv_holds_one_figure_a_row_and_agrees_with_the_json(
        book: Book, tmp_path: Path) -> None:
    """Every row is section,key,field,value; the counts and stakes equal the JSON's."""
    await book.sell(sale("A", [{"numbers": HOT, "stake": 500}]), [[ACCEPTED]])
    r = report_of(tmp_path / "j")
    rows = list(csv.reader(io.StringIO(to_csv(r))))
    assert rows[0] == ["section", "key", "field", "value"]
    assert all(len(row) == 4 for row in rows)
    cells = {(s, k, f): v for s, k, f, v in rows[1:]}
    as_json = msgspec.json.decode(to_json(r))
    assert cells["draw", "", "stake"] == str(as_json["stake"]) == "500"
    assert cells["tickets", "accepted", "count"] == "1"
    assert cells["top", "-".join(map(str, HOT)), "staked"] == "500"


# -- the export --------------------------------------------------------------------------


def test_an_export_with_extra_columns_a_bom_quotes_and_blank_lines_is_read() -> None:
    """Columns in any order, others ignored, a UTF-8 BOM, quoted cells, blank lines."""
    text = ('\ufeffterminal,Ticket_ID,channel,total_cost\r\n"T, 1",A-1,fr-retail,1400\r\n'
            '\r\nT2,A-2,pf-retail,0\r\n')
    lines = read_export(text)
    assert [(x.line, x.channel, x.ticket, x.total_cost) for x in lines] == [
        (2, "fr-retail", "A-1", 1400), (4, "pf-retail", "A-2", 0)]


@pytest.mark.parametrize(("text", "message"), [
    ("", "line 1: the export is empty"),
    ("channel,ticket,total_cost\n", "line 1: the header lacks ticket_id"),
    ("channel,ticket_id,total_cost,channel\n", "line 1: the header names channel more"),
    ("channel,ticket_id,total_cost\nfr-retail,A,14.00\n", "line 2: total_cost '14.00'"),
    ("channel,ticket_id,total_cost\nfr-retail,A,1\nfr-retail,B,-5\n", "line 3: total_cost"),
    ("channel,ticket_id,total_cost\nfr-retail,A b,1\n", "line 2: ticket_id 'A b'"),
    ("channel,ticket_id,total_cost\n,A,1\n", "line 2: channel ''"),
    ("channel,ticket_id,total_cost\nfr-retail,A\n", "line 2: 2 field(s), the header has 3"),
    ('channel,ticket_id,total_cost\nfr-retail,"A\n\nB",1\nx,C,1\n', "line 2: ticket_id"),
    ("channel,ticket_id,total_cost\nfr-retail,A,1\n\nfr-retail,B,1,9\n", "line 4: 4 field"),
])
def test_a_malformed_export_is_refused_naming_its_line(text: str, message: str) -> None:
    """Nothing is compared from an export that cannot be read whole: the error names the
    line of the first problem."""
    with pytest.raises(ExportError) as e:
        read_export(text)
    assert str(e.value).startswith(message), str(e.value)


async def test_each_kind_of_difference_is_found_exactly(book: Book, tmp_path: Path) -> None:
    """Missing (accepted, not sold), extra (sold, unknown), a rejected and a cancelled one
    sold, a wrong amount, another channel's ticket, a duplicate line, a voided one sold,
    and another host's ticket found in Redis: each named once, nothing else."""
    eight = {"numbers": HOT, "stake": 500}
    ok_sid, ok_cost = await book.sell(sale("OK", [eight]), [[ACCEPTED]])
    miss_sid, _ = await book.sell(sale("MISS", [eight]), [[ACCEPTED]])
    await book.sell(sale("AMT", [eight]), [[ACCEPTED]])
    await book.sell(sale("REJ", [eight]), [[REJECTED, 0, 0]])
    await book.sell(sale("CAN", [eight]), [[ACCEPTED]], cancel=True)
    await book.sell(sale("PF", [eight]), [[ACCEPTED]], channel="pf-retail")
    await book.void(sale("VOID", [eight]))
    export = read_export(
        "channel,ticket_id,total_cost\n"
        f"fr-retail,OK,{ok_cost}\n"        # 2 balanced
        "fr-retail,AMT,400\n"              # 3 amount
        "fr-retail,REJ,500\n"              # 4 rejected by capsvc
        "fr-retail,CAN,500\n"              # 5 cancelled in capsvc
        "fr-retail,PF,500\n"               # 6 another channel's ticket
        "fr-retail,NEW,700\n"              # 7 unknown
        f"fr-retail,OK,{ok_cost}\n"        # 8 duplicate of 2
        "fr-retail,VOID,500\n"             # 9 never answered
        "fr-retail,ELSEWHERE,500\n")       # 10 another host's (Redis)
    history = read_history([tmp_path / "j"], GAME, range(DRAW, DRAW + 1))
    known = {("fr-retail", "ELSEWHERE"): Known("e" * 16, "accepted", 500, True, True, False)}
    rec = reconcile(history, DRAW, export, now_ms=NOW + 3_600_000, grace_ms=0, final=True,
                    tz=TZ, known=known)
    assert not rec.balanced
    assert [(d.ticket_id, d.line, d.capsvc) for d in rec.not_accepted] == [
        ("REJ", 4, "rejected"), ("CAN", 5, "cancelled"), ("PF", 6, "unknown"),
        ("NEW", 7, "unknown"), ("VOID", 9, "void")]
    assert [(d.channel, d.ticket_id, d.sale) for d in rec.not_sold] == [
        ("fr-retail", "MISS", miss_sid), ("pf-retail", "PF", f"{6:016x}")]
    assert [(d.ticket_id, d.sold, d.capsvc) for d in rec.amounts] == [("AMT", 400, 500)]
    assert [(d.ticket_id, d.lines) for d in rec.duplicates] == [("OK", [2, 8])]
    assert rec.elsewhere == 1
    assert rec.differences == 5 + 2 + 1 + 1
    assert ok_sid not in {d.sale for d in rec.not_sold}


async def test_a_decision_younger_than_the_grace_is_in_flight_not_a_difference(
        book: Book, tmp_path: Path) -> None:
    """During sales the export lags: a standing decision not in it yet, younger than the
    grace, is counted in flight; older, it is not_sold."""
    await book.sell(sale("YOUNG", [{"numbers": HOT, "stake": 500}]), [[ACCEPTED]])
    history = read_history([tmp_path / "j"], GAME, range(DRAW, DRAW + 1))
    header = read_export("channel,ticket_id,total_cost\n")
    live = reconcile(history, DRAW, header, now_ms=NOW + 10_000, grace_ms=60_000,
                     final=False, tz=TZ)
    assert (live.balanced, live.in_flight, live.not_sold) == (True, 1, [])
    later = reconcile(history, DRAW, header, now_ms=NOW + 120_000, grace_ms=60_000,
                      final=False, tz=TZ)
    assert (later.balanced, later.in_flight, len(later.not_sold)) == (False, 0, 1)


async def test_a_file_read_once_is_skipped_for_draws_it_does_not_hold_until_it_grows(
        book: Book, tmp_path: Path) -> None:
    """With a cache of what files hold, a second read for another draw skips the file;
    once the file has grown (a decision of that draw appended), it is read again."""
    await book.sell(sale("A", [{"numbers": HOT, "stake": 500}]), [[ACCEPTED]])
    spans: dict[str, Any] = {}
    first = read_history([tmp_path / "j"], GAME, range(DRAW, DRAW + 1), spans=spans)
    assert len(first.sources) == 1
    other = read_history([tmp_path / "j"], GAME, range(DRAW + 1, DRAW + 2), spans=spans)
    assert (other.sources, other.sales) == ([], {})
    await book.sell(sale("B", [{"numbers": HOT, "stake": 500}], first=DRAW + 1), [[ACCEPTED]])
    grown = read_history([tmp_path / "j"], GAME, range(DRAW + 1, DRAW + 2), spans=spans)
    assert [s.record.ticket for s in grown.sales.values()] == ["B"]


async def test_the_service_leaves_a_report_file_that_is_not_a_report_and_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A `<draw>.json` cut short (by a copy or a restore) in the service's reports: named in
    an error, left as it is, no CSV made from it, and no exception out of the writer (the
    next draws are written all the same)."""
    import dataclasses

    from capsvc.audit.service import Audit
    from capsvc.domain.games import Catalog

    settings = dataclasses.replace(load_settings(CONFIG), journal_dir=str(tmp_path))
    audit = Audit(settings, Catalog(settings.games), None, None, None, None,  # type: ignore[arg-type]
                  None)  # type: ignore[arg-type]
    cut = audit.path("fdj-keno", DRAW, ".json")
    cut.parent.mkdir(parents=True)
    cut.write_bytes(b'{"format": 2, "game": "fdj-ke')
    await audit._write(GAME, DRAW, None)  # type: ignore[arg-type]
    assert cut.read_bytes() == b'{"format": 2, "game": "fdj-ke'
    assert not audit.path("fdj-keno", DRAW, ".csv").exists()
    assert f"{cut}: not a report" in caplog.text
