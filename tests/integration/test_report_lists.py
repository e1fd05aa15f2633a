"""A draw's report lists its refused, cancelled and void tickets one by one, on real
processes, a real Redis and real journals: by `capsvc report` and by the HTTP route, in
JSON and in CSV; over two service processes' journal directories at once, each ticket once;
`capsvc report --all-final` writes each final draw's report over every host's journal once
and leaves a report that exists alone; `capsvc journal ship` keeps a copy whole, and a copy
behind holds the draws it may lack."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.integration.test_audit import (
    CONFIG,
    FINAL_S,
    GAME,
    HOT,
    OPS,
    PF,
    SELLER,
    SLOW,
    _close_of,
    call,
    capsvc,
    current,
    staked,
)
from tests.support.servers import RedisServer
from tests.support.service import ServiceProcess

pytestmark = pytest.mark.slow

STEPS = CONFIG.replace('[redis]\n', '[redis]\nsale_calls = "steps"\n', 1).replace(
    f'id = "{SLOW}"\npreset = "fdj-keno-2008"\n',
    f'id = "{SLOW}"\npreset = "fdj-keno-2008"\ncap_limit = 1000\n', 1)
"""Sales in steps (a sale claimed after a stop is journaled void); SLOW capped at 1000."""


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "steps.toml"
    path.write_text(STEPS)
    return str(path)


@pytest.fixture
def redis() -> Any:
    server = RedisServer().start()
    yield server
    server.stop()


def sell(base: str, tid: str, game: str, draw: int, numbers: tuple[int, ...],
         token: str = SELLER) -> tuple[int, Any]:
    return call(base, "POST", "/v1/tickets", token=token, retry=False, body={
        "ticket_id": tid, "game": game, "first_draw": draw,
        "grids": [{"numbers": list(numbers), "stake": 500}]})


def listed(report: dict[str, Any], kind: str) -> list[tuple[str, str]]:
    return [(t["channel"], t["ticket_id"]) for t in report["ticket_lists"][kind]]


def csv_lists(text: str) -> dict[str, dict[str, dict[str, str]]]:
    """The CSV's listed tickets: section -> key -> field -> value."""
    out: dict[str, dict[str, dict[str, str]]] = {}
    for section, key, name, value in list(csv.reader(io.StringIO(text)))[1:]:
        if section in ("rejected", "cancelled", "void"):
            out.setdefault(section, {}).setdefault(key, {})[name] = value
    return out


def test_the_report_lists_rejected_cancelled_and_void_tickets_by_cli_and_http(
        config: str, redis: RedisServer) -> None:
    """Two sales fill a combination's cap, a third is refused, one is cancelled, one is
    claimed after the draw's stop (void): the report (CLI and HTTP, JSON and CSV) lists
    exactly those three, with the journal file and line of each record, and the figures
    the HTTP answer and the command agree on."""
    service = ServiceProcess(config, redis.url).start()
    try:
        base = service.base_url
        draw, _ = current(base, SLOW)
        for tid in ("OK-1", "OK-2"):
            assert sell(base, tid, SLOW, draw, HOT[0])[1]["status"] == "accepted"
        status, refused = sell(base, "REJ", SLOW, draw, HOT[0])
        assert (status, refused["status"]) == (200, "rejected")
        status, cancelled = sell(base, "CAN", SLOW, draw, HOT[1], token=PF)
        assert status == 200
        assert call(base, "POST", "/v1/tickets/CAN/cancel", token=PF)[0] == 200
        assert call(base, "POST", f"/v1/games/{SLOW}/draws/{draw}/close")[0] == 200
        status, _ = sell(base, "VOID", SLOW, draw, HOT[2])
        assert status != 200
        args = ("report", "--config", config, "--dir", str(service.journal_dir), "--game",
                SLOW, "--draw", str(draw))
        out = capsvc(*args)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert report["report"] == 2
        assert listed(report, "rejected") == [("fr-retail", "REJ")]
        assert listed(report, "cancelled") == [("pf-retail", "CAN")]
        assert listed(report, "void") == [("fr-retail", "VOID")]
        (rej,) = report["ticket_lists"]["rejected"]
        (can,) = report["ticket_lists"]["cancelled"]
        (void,) = report["ticket_lists"]["void"]
        assert (rej["status"], rej["reason"], rej["stake"], rej["total_cost"]) == (
            "rejected", "combination_capped", 500, refused["total_cost"])
        assert (can["status"], can["stake"], can["released"], can["total_cost"]) == (
            "accepted", 500, cancelled["total_cost"], cancelled["total_cost"])
        assert can["cancelled_at"] >= can["decided_at"]
        assert (void["status"], void["reason"], void["total_cost"]) == (None, "stopped", None)
        for ticket, kind in ((rej, "sale"), (can, "cancel"), (void, "void")):
            lines = (service.journal_dir / ticket["file"]).read_text().splitlines()
            record = json.loads(lines[ticket["line"] - 1])
            if record["type"] == "sales":  # sales made together: the ticket is one of them
                (record,) = [{**s, "type": "sale"} for s in record["sales"]
                             if s["ticket"] == ticket["ticket_id"]]
            assert (record["type"], record["ticket"]) == (kind, ticket["ticket_id"])
        assert (report["tickets"]["accepted"], report["tickets"]["rejected"],
                report["tickets"]["cancelled"], report["tickets"]["void"]) == (2, 1, 1, 1)
        # The CSV of the command: one field a row per listed ticket, keyed channel/id/sale.
        text = capsvc(*args, "--format", "csv").stdout
        lists = csv_lists(text)
        assert lists["cancelled"][f"pf-retail/CAN/{can['sale']}"]["released"] == str(
            can["released"])
        assert lists["void"][f"fr-retail/VOID/{void['sale']}"]["reason"] == "stopped"
        assert set(lists["rejected"]) == {f"fr-retail/REJ/{rej['sale']}"}
        # The HTTP route: the same lists, in JSON and in CSV.
        headers = {"Authorization": f"Bearer {OPS}"}
        path = f"{base}/v1/games/{SLOW}/draws/{draw}/report"
        answer = requests.get(path, headers=headers, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["ticket_lists"] == report["ticket_lists"]
        as_csv = requests.get(path + "?format=csv", headers=headers, timeout=30)
        assert as_csv.status_code == 200
        assert csv_lists(as_csv.text) == lists
    finally:
        service.stop()


def test_two_processes_journals_give_one_report_and_all_final_writes_it_once(
        config: str, redis: RedisServer, tmp_path: Path) -> None:
    """Two service processes, each with its own journal directory under one parent, sell
    one draw (a ticket sold on one and cancelled through the other, a refusal read again
    through the other): `capsvc report --all-final --journals PARENT`, once the draw is
    final, writes its report once over both directories — the tickets of both, each once,
    the stake Redis counted — and every other final draw's; run again it writes nothing
    and leaves the files as they were."""
    parent = tmp_path / "journals"
    a = ServiceProcess(config, redis.url, env={"CAPSVC_JOURNAL_DIR": str(parent / "pod-0")})
    b = ServiceProcess(config, redis.url, env={"CAPSVC_JOURNAL_DIR": str(parent / "pod-1")})
    a.start()
    b.start()
    try:
        draw, left = current(a.base_url)
        d = draw + 1 if left > 1.5 else draw + 2
        for i, svc in enumerate((a, b, a, b)):
            assert sell(svc.base_url, f"OK-{i}", GAME, d, HOT[0])[1]["status"] == "accepted"
        assert sell(a.base_url, "A-REJ", GAME, d, HOT[0])[1]["status"] == "rejected"
        assert sell(b.base_url, "B-REJ", GAME, d, HOT[0])[1]["status"] == "rejected"
        assert call(b.base_url, "GET", "/v1/tickets/A-REJ", token=SELLER)[0] == 200
        assert sell(b.base_url, "B-CAN", GAME, d, HOT[1])[0] == 200
        assert call(a.base_url, "POST", "/v1/tickets/B-CAN/cancel", token=SELLER)[0] == 200
        expected_stake = staked(a.base_url, HOT[0], d) + staked(a.base_url, HOT[1], d)
        assert expected_stake == 2000
        time.sleep(max(0.0, _close_of(a.base_url, d) + FINAL_S + 0.5 - time.time()))
    finally:
        a.stop()
        b.stop()
    args = ("report", "--config", config, "--all-final", "--journals", str(parent),
            "--game", GAME)
    first = capsvc(*args)
    assert first.returncode == 0, first.stdout + first.stderr
    reports = parent / "reports" / GAME
    report = json.loads((reports / f"{d}.json").read_text())
    assert report["final"]
    assert {s["directory"] for s in report["sources"]} == {str(parent / "pod-0"),
                                                          str(parent / "pod-1")}
    assert listed(report, "rejected") == [("fr-retail", "A-REJ"), ("fr-retail", "B-REJ")]
    assert listed(report, "cancelled") == [("fr-retail", "B-CAN")]
    assert (report["tickets"]["accepted"], report["tickets"]["rejected"],
            report["tickets"]["cancelled"]) == (4, 2, 1)
    assert report["stake"] == expected_stake
    # The per-directory reports: each host's part; together, each ticket once.
    parts = [json.loads(capsvc("report", "--config", config, "--dir", str(parent / p),
                               "--game", GAME, "--draw", str(d)).stdout)
             for p in ("pod-0", "pod-1")]
    # B-CAN's sale is in pod-1's journal, its cancel in pod-0's: pod-1 alone counts it.
    assert [p["stake"] for p in parts] == [1000, 1500]
    assert listed(parts[0], "cancelled") == [("fr-retail", "B-CAN")]
    assert listed(parts[1], "cancelled") == []
    rejected = [t for p in parts for t in listed(p, "rejected")]
    assert sorted(set(rejected)) == listed(report, "rejected")
    assert len(rejected) == 3  # A-REJ read again through B: journaled by both
    # Every final draw since the journals began has its report, once.
    written = sorted(int(p.stem) for p in reports.glob("*.json"))
    assert d in written
    assert written == list(range(written[0], written[-1] + 1))
    assert sorted(int(p.stem) for p in reports.glob("*.csv")) == written
    assert f"{len(written)} report(s) written" in first.stdout
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in reports.iterdir()}
    again = capsvc(*args)
    assert again.returncode == 0, again.stderr
    # Run again: every report there already, none written again; only a draw final since
    # the first run (one every 4 s: how many, the machine's pace decides) is new.
    counts = re.search(r"(\d+) report\(s\) written, (\d+) already there", again.stdout)
    assert counts is not None, again.stdout
    assert int(counts[2]) == len(written)
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in reports.iterdir()}
    assert {name: v for name, v in after.items() if name in before} == before
    new = {int(name.split(".")[0]) for name in after.keys() - before.keys()}
    assert len(new) == int(counts[1])
    assert all(draw > written[-1] for draw in new)
    assert [p.name for p in parent.joinpath("reports").rglob(".*")] == [".lock"]

    # The reconciliation reads every host's journal the same way: one for the deployment.
    export = parent / "sold.csv"
    export.write_text("channel,ticket_id,total_cost\n")
    each = capsvc("reconcile", "--config", config, "--game", GAME, "--draw", str(d), "--sold",
                  str(export), "--format", "json", "--dir", str(parent / "pod-0"), "--dir",
                  str(parent / "pod-1"))
    under = capsvc("reconcile", "--config", config, "--game", GAME, "--draw", str(d),
                   "--sold", str(export), "--format", "json", "--journals", str(parent))
    assert under.returncode == each.returncode == 1, under.stderr
    def found(out: str) -> dict[str, object]:
        return {k: v for k, v in json.loads(out).items() if k != "checked_at"}

    assert found(under.stdout) == found(each.stdout)
    assert "B-CAN" not in under.stdout
    assert "A-REJ" not in under.stdout
    assert len(json.loads(under.stdout)["not_sold"]) == 4

    # A report file that is not one (cut short by a copy or a restore: capsvc writes whole
    # files) is named and left alone; every other draw is written all the same.
    other = parent / "other-reports"
    (other / GAME).mkdir(parents=True)
    cut = (reports / f"{written[0]}.json").read_bytes()
    (other / GAME / f"{written[0]}.json").write_bytes(cut[:len(cut) // 2])
    damaged = capsvc("report", "--config", config, "--all-final", "--journals", str(parent),
                     "--game", GAME, "--reports", str(other))
    assert damaged.returncode == 1, damaged.stdout + damaged.stderr
    assert f"{written[0]}.json: not a report" in damaged.stderr
    assert "Traceback" not in damaged.stderr
    assert (other / GAME / f"{written[0]}.json").read_bytes() == cut[:len(cut) // 2]
    made = {int(p.stem) for p in (other / GAME).glob("*.csv")}
    assert written[0] not in made
    assert set(written[1:]) <= made  # and any draw final since the first run


def test_a_shipped_copy_is_whole_and_a_copy_behind_holds_its_draws(
        config: str, redis: RedisServer, tmp_path: Path) -> None:
    """`capsvc journal ship` copies a live journal's complete lines; stopped (SIGTERM) it
    makes a last pass and marks the copy whole. A copy whose `.shipped` is behind holds
    back the draws it may lack: `--all-final` writes none of them and says so."""
    journal = tmp_path / "journal"
    service = ServiceProcess(config, redis.url, env={"CAPSVC_JOURNAL_DIR": str(journal)})
    service.start()
    copies = tmp_path / "copies"
    env = {**os.environ, "CAPSVC_JOURNAL_DIR": str(journal)}
    shipper = subprocess.Popen(
        [sys.executable, "-m", "capsvc", "journal", "ship", "--config", config, "--to",
         str(copies / "pod-0"), "--every", "200ms"], env=env)
    try:
        draw, _ = current(service.base_url)
        assert sell(service.base_url, "S-1", GAME, draw + 2, HOT[0])[0] == 200
        shipped = copies / "pod-0" / ".shipped"
        deadline = time.monotonic() + 60  # the shipper's start and first pass
        while not shipped.exists():
            assert time.monotonic() < deadline, "the shipper never passed"
            time.sleep(0.05)
        mark = json.loads(shipped.read_text())
        assert not mark.get("ended", False)
    finally:
        service.stop()
        shipper.send_signal(signal.SIGTERM)
        assert shipper.wait(30) == 0
    assert json.loads((copies / "pod-0" / ".shipped").read_text())["ended"] is True
    originals = sorted(p.name for p in journal.glob("capsvc-*.jsonl"))
    assert sorted(p.name for p in (copies / "pod-0").glob("capsvc-*.jsonl")) == originals
    for name in originals:
        assert (copies / "pod-0" / name).read_bytes() == (journal / name).read_bytes()
    # A copy behind: its shipper last passed a minute and a half ago, still running.
    behind = copies / "pod-1"
    behind.mkdir()
    at = int(time.time() * 1000) - 90_000
    (behind / ".shipped").write_text(json.dumps({"at": at, "ended": False}))
    out = capsvc("report", "--config", config, "--all-final", "--journals", str(copies),
                 "--game", GAME)
    assert out.returncode == 0, out.stderr
    assert f"waiting for {behind}: shipped until" in out.stdout
    assert not (copies / "reports" / GAME / f"{draw + 2}.json").exists()
    # Bad input: a clear error, nothing written.
    for bad in (("--all-final", "--draw", "5"), ("--game", GAME),
                ("--all-final", "--journals", str(tmp_path / "none"))):
        refused = capsvc("report", "--config", config, *bad)
        assert refused.returncode == 2, refused.stdout
        assert refused.stderr.startswith("capsvc report: ")
