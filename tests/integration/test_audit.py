"""Each draw balanced and on the record, on real processes and a real Redis:
the service writes a draw's report once final, equal to Redis's counters while the draw is
retained and to what the sellers were answered, after a run with faults between the
service and Redis, cancels, retries and a worker killed; after the retention, the same
report from the journal alone; the reconciliation finds every difference of an export,
refuses a malformed one naming its line with nothing cancelled, and cancels the abandoned
tickets it can."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import requests

from capsvc.redis.store import UNJOURNALED, ticket_key
from tests.records import held
from tests.support.failover import HttpClient, Sellers
from tests.support.faults import FaultProxy, command
from tests.support.servers import RedisCluster, RedisServer
from tests.support.service import ServiceProcess

pytestmark = pytest.mark.slow

SELLER, OPS, PF = "audit-seller", "audit-ops", "audit-pf"
GAME = "quick-keno"
"""A draw every 4 s, kept 10 s after its close: closes and retentions pass in a test."""
SLOW = "slow-keno"
"""FDJ's calendar: its draw on sale stays open for the whole test (cancellable)."""
OTHER = "other-keno"
"""Another game on FDJ's calendar: the same draw numbers as SLOW's."""
HOT = ((3, 7, 12, 18, 25, 33, 41, 56), (1, 2, 3, 4, 5, 6, 7, 8),
       (10, 20, 30, 40, 50, 60, 65, 70))
DRAW_S = 4.0
RETENTION_S = 10.0
FINAL_S = 2.0 + 2 * 0.5
"""A draw is final this long after its close: pending_deadline + twice the janitor interval."""


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


CONFIG = f"""\
[redis]
timeout = "250ms"

[server]
request_timeout = "1s"
drain_delay = "100ms"

[janitor]
pending_deadline = "2s"
interval = "500ms"

[journal]
settle = "0s"

[audit]
interval = "300ms"

[[games]]
id = "{GAME}"
preset = "fdj-keno-2008"
cap_limit = 2000
draw_every = "4s"
draw_from = "00:00"
draw_until = "23:59:56"
time_zone = "UTC"
retention = "10s"

[[games]]
id = "{SLOW}"
preset = "fdj-keno-2008"

[[games]]
id = "{OTHER}"
preset = "fdj-keno-2008"

[[channels]]
id = "fr-retail"
token_sha256 = "{_digest(SELLER)}"
games = ["{GAME}", "{SLOW}", "{OTHER}"]
scopes = ["sell", "read"]

[[channels]]
id = "pf-retail"
token_sha256 = "{_digest(PF)}"
games = ["{GAME}", "{SLOW}", "{OTHER}"]
scopes = ["sell"]

[[channels]]
id = "ops"
token_sha256 = "{_digest(OPS)}"
games = ["{GAME}", "{SLOW}", "{OTHER}"]
scopes = ["read", "admin"]
"""


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "audit.toml"
    path.write_text(CONFIG)
    return str(path)


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


def capsvc(*args: str, journal: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The command line; `journal`: the [journal] dir it writes to (its cancels)."""
    env = {**os.environ, **({"CAPSVC_JOURNAL_DIR": str(journal)} if journal else {})}
    return subprocess.run([sys.executable, "-m", "capsvc", *args], capture_output=True,
                          text=True, timeout=120, check=False, env=env)


def call(base: str, method: str, path: str, token: str = OPS, body: Any = None,
         retry: bool = True) -> tuple[int, Any]:
    """A request sent until it is answered (a 503 or a broken connection: again, unless
    not `retry`: a terminal that gives up)."""
    client = HttpClient(3.0)
    try:
        for _ in range(100):
            try:
                status, answer = client.request(base, method, path, token=token, body=body)
            except OSError:
                status, answer = 0, None
            if not retry or status not in (0, 503):
                return status, answer
            time.sleep(0.1)
    finally:
        client.close()
    raise AssertionError(f"{method} {path}: no answer")


def current(base: str, game: str = GAME) -> tuple[int, float]:
    """The draw on sale and the seconds left before it closes."""
    _, body = call(base, "GET", f"/v1/games/{game}/draws/current")
    left = datetime.fromisoformat(body["closes_at"]).timestamp() - time.time()
    return int(body["draw"]), left


def staked(base: str, numbers: tuple[int, ...], draw: int, game: str = GAME) -> int:
    status, body = call(base, "GET", f"/v1/games/{game}/draws/{draw}/combinations/"
                        + "-".join(map(str, numbers)))
    assert status == 200, body
    return int(body["staked"])


def wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} was not written"
        time.sleep(0.1)


def comparable(report: dict[str, Any]) -> dict[str, Any]:
    """A report without what depends on when and how it was built."""
    return {k: v for k, v in report.items()
            if k not in ("built_at", "final", "redis", "sources", "chain")}


class Cancels:
    """Cancels acknowledged sales while the sellers run (every 3rd one), retrying 503s."""

    def __init__(self, base: str, sellers: Sellers) -> None:
        self.base = base
        self.sellers = sellers
        self.cancelled: set[str] = set()
        self.refused: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Cancels:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        done = 0
        while not self._stop.wait(0.05):
            sales = self.sellers.acknowledged[done:]
            for sale in sales[::3]:
                status, _ = call(self.base, "POST", f"/v1/tickets/{sale.ticket_id}/cancel",
                                    token=SELLER)
                (self.cancelled if status == 200 else self.refused).add(sale.ticket_id)
            done += len(sales)


@pytest.fixture(params=["standalone", "cluster"])
def backend(request: pytest.FixtureRequest) -> Iterator[tuple[str, FaultProxy | None]]:
    """A Redis of the test's own: standalone behind a fault proxy (one call a sale), or a
    3-primary cluster (sales in steps, the janitor settling the interrupted ones)."""
    if request.param == "cluster":
        cluster = RedisCluster().start()
        yield cluster.url, None
        cluster.stop()
        return
    server = RedisServer().start()
    with FaultProxy("127.0.0.1", server.port) as proxy:
        yield proxy.url, proxy
    server.stop()


def test_reports_after_chaos_equal_redis_and_the_sellers_then_the_journal_alone(
        config: str, backend: tuple[str, FaultProxy | None]) -> None:
    """Sales with Redis replies lost (faults between the service and Redis, standalone),
    retries, cancels, a worker killed: each draw's report, written by the service once
    final, has the sellers' answered decisions and cancels, and Redis's counters; after the
    draw's retention, when Redis has forgotten it, `capsvc report` gives the same from the
    journal alone. A subscription is in the report of each of its draws; a draw nobody
    played says "no activity"."""
    url, proxy = backend
    service = ServiceProcess(config, url, args=("--workers", "2")).start()
    try:
        base = service.base_url
        draw, left = current(base)
        if left < 2.0:  # not a draw about to close: the test's plan needs the next
            time.sleep(left + 0.2)
            draw, left = current(base)
        draws = [draw + 2, draw + 3]
        quiet = draw + 1
        status, sub = call(base, "POST", "/v1/tickets", token=SELLER, body={
            "ticket_id": "SUB-1", "game": GAME, "first_draw": draw + 2, "draws": 2,
            "grids": [{"numbers": list(HOT[2]), "stake": 100}]})
        assert (status, sub["status"]) == (200, "accepted")
        if proxy is not None:  # replies lost after Redis ran them: 503s, retried
            proxy.drop_reply(command("FCALL", "capsvc_sell"), count=15)
            proxy.drop_reply(command("FCALL", "capsvc_cancel"), count=3)
        sellers = Sellers([base], draws, game=GAME, combinations=HOT, token=SELLER,
                          count=6, stakes=(100, 200, 500), max_grids=2,
                          retry_pause_s=0.05, seed=7)
        with sellers, Cancels(base, sellers) as cancels:
            sellers.wait_acknowledged(20)
            worker = _a_worker(service)
            os.kill(worker, signal.SIGKILL)
            time.sleep(1.0)
        assert sellers.unexpected == []
        assert sellers.unanswered == []
        reports = service.journal_dir / "reports" / GAME
        for d in [quiet, *draws]:
            wait_for(reports / f"{d}.csv", 4 * DRAW_S + FINAL_S + 10)
        written = {d: json.loads((reports / f"{d}.json").read_text())
                   for d in [quiet, *draws]}
        assert written[quiet]["summary"] == "no activity"
        assert not written[quiet]["activity"]
        for d in draws:
            report = written[d]
            answered = [s for s in sellers.acknowledged if s.request["first_draw"] == d]
            standing = [s for s in answered if s.decision["status"] != "rejected"
                        and s.ticket_id not in cancels.cancelled]
            assert report["final"]
            assert report["redis"]["complete"], report["redis"]
            assert report["over_cap"] == []
            assert report["tickets"]["accepted"] + report["tickets"]["partial"] == (
                len(standing) + 1)  # the subscription
            assert report["tickets"]["cancelled"] == len(
                [s for s in answered if s.ticket_id in cancels.cancelled])
            assert report["tickets"]["rejected"] == len(
                [s for s in answered if s.decision["status"] == "rejected"])
            expected: dict[tuple[int, ...], int] = {HOT[2]: 100}
            for s in standing:
                for grid, out in zip(s.request["grids"], s.decision["grids"], strict=True):
                    if out["status"] == "accepted":
                        key = tuple(sorted(grid["numbers"]))
                        expected[key] = expected.get(key, 0) + grid["stake"]
            top = {tuple(t["numbers"]): t["staked"] for t in report["top"]}
            assert top == expected
            for combo in HOT:  # Redis's counters while the draw is retained
                assert staked(base, combo, d) == expected.get(combo, 0)
        assert cancels.cancelled
        # Past the retention: Redis forgets the draws; the journal alone reports them.
        last_close = _close_of(base, draws[-1])
        time.sleep(max(0.0, last_close + RETENTION_S + 1 - time.time()))
        for d in draws:
            assert staked(base, HOT[2], d) == 0
            assert call(base, "GET", "/v1/tickets/SUB-1", token=SELLER)[0] == 404
            again = capsvc("report", "--config", config, "--dir",
                           str(service.journal_dir), "--game", GAME, "--draw", str(d))
            assert again.returncode == 0, again.stderr
            assert comparable(json.loads(again.stdout)) == comparable(written[d])
        # Written once: the files are those of the first writing, no temporary left.
        assert [p.name for p in reports.parent.rglob(".*")] == [".lock"]
        assert json.loads((reports / f"{draws[0]}.json").read_text()) == written[draws[0]]
    finally:
        service.stop()


def _a_worker(service: ServiceProcess) -> int:
    assert service.process is not None
    out = subprocess.run(["pgrep", "-P", str(service.process.pid)], capture_output=True,
                         text=True, check=True)
    return int(out.stdout.split()[0])


def _close_of(base: str, draw: int, game: str = GAME) -> float:
    _, body = call(base, "GET", f"/v1/games/{game}/draws/{draw}")
    return datetime.fromisoformat(body["closes_at"]).timestamp()


def test_reconcile_finds_each_difference_refuses_a_malformed_export_and_cancels_abandoned(
        config: str, redis: RedisServer, tmp_path: Path) -> None:
    """An export with a ticket missing, an unknown one, a wrong amount, another channel's
    ticket, a duplicate line: each named, exit 1, the HTTP endpoint agrees and sets the
    metric; a malformed line: exit 2 naming it, nothing cancelled; with
    --cancel-abandoned, the tickets never sold are cancelled where they still can be, the
    others said; once the export matches, exit 0."""
    service = ServiceProcess(config, redis.url).start()
    try:
        base = service.base_url
        draw, _ = current(base, SLOW)

        def sell(tid: str, token: str = SELLER, **extra: Any) -> dict[str, Any]:
            body = {"ticket_id": tid, "game": SLOW, "first_draw": draw,
                    "grids": [{"numbers": list(HOT[0]), "stake": 500}], **extra}
            status, answer = call(base, "POST", "/v1/tickets", token=token, body=body)
            assert status == 200, answer
            return dict(answer)

        costs = {t: sell(t)["total_cost"] for t in ("R1", "R2", "R3", "GONE")}
        sell("PF1", token=PF)
        rows = ["channel,ticket_id,total_cost,terminal",
                f"fr-retail,R1,{costs['R1']},T1",
                f"fr-retail,R2,{costs['R2'] + 100},T2",      # wrong amount
                f"fr-retail,R3,{costs['R3']},T3",
                f"fr-retail,R3,{costs['R3']},T3",            # duplicate line
                "fr-retail,NEVER,500,T4",                    # sold past capsvc
                "fr-retail,PF1,500,T5"]                      # pf-retail's ticket
        export = tmp_path / "sold.csv"
        export.write_text("\n".join(rows) + "\n")
        args = ("reconcile", "--config", config, "--dir", str(service.journal_dir),
                "--game", SLOW, "--draw", str(draw), "--sold", str(export))
        out = capsvc(*args, "--format", "json")
        assert out.returncode == 1, out.stderr
        rec = json.loads(out.stdout)
        assert [(d["ticket_id"], d["line"], d["capsvc"]) for d in rec["not_accepted"]] == [
            ("NEVER", 6, "unknown"), ("PF1", 7, "unknown")]
        assert [(d["channel"], d["ticket_id"]) for d in rec["not_sold"]] == [
            ("fr-retail", "GONE"), ("pf-retail", "PF1")]
        assert [(d["ticket_id"], d["sold"], d["capsvc"]) for d in rec["amounts"]] == [
            ("R2", costs["R2"] + 100, costs["R2"])]
        assert [(d["ticket_id"], d["lines"]) for d in rec["duplicates"]] == [("R3", [4, 5])]
        human = capsvc(*args)
        assert "NOT BALANCED (6 difference(s))" in human.stdout
        assert "fr-retail GONE" in human.stdout
        # The HTTP endpoint: the same differences, and the metric says so.
        resp = requests.post(f"{base}/v1/games/{SLOW}/draws/{draw}/reconcile?grace=0",
                             data=export.read_bytes(), timeout=30,
                             headers={"Authorization": f"Bearer {OPS}",
                                      "Content-Type": "text/csv"})
        assert resp.status_code == 200, resp.text
        assert {k: v for k, v in resp.json().items() if k != "checked_at"} == {
            k: v for k, v in rec.items() if k != "checked_at"}
        metrics = requests.get(f"{base}/metrics", timeout=10).text
        assert f'capsvc_reconcile_differences{{game="{SLOW}",kind="not_sold"}} 2.0' in metrics
        assert f'capsvc_reconcile_draw{{game="{SLOW}"}} {float(draw)}' in metrics
        # A malformed line: named, exit 2, nothing cancelled.
        bad = tmp_path / "bad.csv"
        bad.write_text("\n".join([*rows[:3], "fr-retail,R4,12.50,T9"]) + "\n")
        refused = capsvc(*args[:-1], str(bad), "--cancel-abandoned", "--redis-url", redis.url,
                         journal=service.journal_dir)
        assert refused.returncode == 2
        assert "line 4: total_cost '12.50'" in refused.stderr
        assert "cancelled" not in call(base, "GET", "/v1/tickets/GONE", token=SELLER)[1]
        resp = requests.post(f"{base}/v1/games/{SLOW}/draws/{draw}/reconcile",
                             data=bad.read_bytes(), timeout=30,
                             headers={"Authorization": f"Bearer {OPS}"})
        assert resp.status_code == 422
        assert resp.json()["error"]["code"] == "invalid_export"
        assert "line 4" in resp.json()["error"]["message"]
        # --cancel-abandoned: GONE and PF1 cancelled (journaled, released).
        fixed = tmp_path / "fixed.csv"
        fixed.write_text("\n".join([rows[0], rows[1], f"fr-retail,R2,{costs['R2']},T2",
                                    rows[3]]) + "\n")
        cancel_args = (*args[:-1], str(fixed), "--cancel-abandoned", "--redis-url", redis.url)
        done = capsvc(*cancel_args, "--format", "json", journal=service.journal_dir)
        assert done.returncode == 0, done.stdout + done.stderr
        cancelled = json.loads(done.stdout)["not_sold"]
        assert [(d["ticket_id"], d["cancel"]) for d in cancelled] == [
            ("GONE", "cancelled: 500 released"), ("PF1", "cancelled: 500 released")]
        assert call(base, "GET", "/v1/tickets/GONE", token=SELLER)[1]["cancelled"][
            "released"] == 500
        balanced = capsvc(*args[:-1], str(fixed))
        assert balanced.returncode == 0, balanced.stdout
        assert "BALANCED" in balanced.stdout
        # A ticket never sold whose draw has closed cannot be cancelled any more: said.
        quick, _ = current(base)
        status, late = call(base, "POST", "/v1/tickets", token=SELLER, body={
            "ticket_id": "LATE", "game": GAME, "first_draw": quick + 1,
            "grids": [{"numbers": list(HOT[1]), "stake": 100}]})
        assert status == 200, late
        time.sleep(max(0.0, _close_of(base, quick + 1) - time.time() + 0.3))
        header = tmp_path / "none.csv"
        header.write_text("channel,ticket_id,total_cost\n")
        stuck = capsvc("reconcile", "--config", config, "--dir", str(service.journal_dir),
                       "--game", GAME, "--draw", str(quick + 1), "--sold", str(header),
                       "--cancel-abandoned", "--redis-url", redis.url, "--format", "json",
                       journal=service.journal_dir)
        assert stuck.returncode == 1, stuck.stderr
        (item,) = json.loads(stuck.stdout)["not_sold"]
        assert item["ticket_id"] == "LATE"
        assert item["cancel"] == f"not cancelled: draw {quick + 1} is closed: ticket LATE stands"
    finally:
        service.stop()


# -- reports and reconciliations at their edges -----------------------------------------


def _sell(base: str, tid: str, game: str, draw: int, numbers: tuple[int, ...] = HOT[0],
          *, retry: bool = True) -> tuple[int, Any]:
    return call(base, "POST", "/v1/tickets", token=SELLER, retry=retry, body={
        "ticket_id": tid, "game": game, "first_draw": draw,
        "grids": [{"numbers": list(numbers), "stake": 500}]})


def _kill(service: ServiceProcess) -> None:
    """SIGKILL the service and its workers: a host lost."""
    assert service.process is not None
    kids = subprocess.run(["pgrep", "-P", str(service.process.pid)], capture_output=True,
                          text=True, check=False).stdout
    for pid in [service.process.pid, *map(int, kids.split())]:
        os.kill(pid, signal.SIGKILL)
    service.process.wait(10)
    service.process = None


def test_the_reconcile_route_reads_the_whole_export_however_it_arrives(
        config: str, redis: RedisServer) -> None:
    """An export streamed in pieces (chunked, 440 KB) and one whose Content-Length body
    comes in two writes cut at a line: read whole, the figures those of the file, and a
    ticket after the cut is not taken for abandoned (cancel_abandoned cancels nothing)."""
    service = ServiceProcess(config, redis.url).start()
    try:
        base = service.base_url
        draw, _ = current(base, SLOW)
        costs = {t: _sell(base, t, SLOW, draw)[1]["total_cost"] for t in ("A", "B")}
        rows = ["channel,ticket_id,total_cost", *(f"fr-retail,N{i:06d},500"
                                                  for i in range(20000)),
                f"fr-retail,A,{costs['A']}", f"fr-retail,B,{costs['B']}"]
        data = ("\n".join(rows) + "\n").encode()

        def pieces() -> Iterator[bytes]:
            for i in range(0, len(data), 65536):
                yield data[i:i + 65536]
                time.sleep(0.02)

        resp = requests.post(f"{base}/v1/games/{SLOW}/draws/{draw}/reconcile?grace=0",
                             data=pieces(), timeout=60,
                             headers={"Authorization": f"Bearer {OPS}"})
        assert resp.status_code == 200, resp.text[:300]
        assert resp.json()["sold"] == {"tickets": 20002, "amount": 500 * 20000 + 1000}
        assert resp.json()["not_sold"] == []
        first = f"channel,ticket_id,total_cost\nfr-retail,A,{costs['A']}\n".encode()
        second = f"fr-retail,B,{costs['B']}\n".encode()
        conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=30)
        conn.putrequest("POST", f"/v1/games/{SLOW}/draws/{draw}/reconcile"
                        "?grace=0&cancel_abandoned=true")
        conn.putheader("Authorization", f"Bearer {OPS}")
        conn.putheader("Content-Length", str(len(first) + len(second)))
        conn.endheaders()
        conn.send(first)
        time.sleep(0.3)
        conn.send(second)
        resp2 = conn.getresponse()
        body = json.loads(resp2.read())
        conn.close()
        assert (resp2.status, body["balanced"], body["not_sold"]) == (200, True, []), body
        assert "cancelled" not in call(base, "GET", "/v1/tickets/B", token=SELLER)[1]
    finally:
        service.stop()


def test_a_sale_whose_answer_was_lost_is_journaled_by_the_janitor_and_reconciled(
        config: str, redis: RedisServer, tmp_path: Path) -> None:
    """A sale decided in Redis whose reply was lost, never retried (the terminal gave up):
    the janitor journals it within its deadline, so the reconciliation names it not_sold
    and --cancel-abandoned gives its stake back."""
    with FaultProxy("127.0.0.1", redis.port) as proxy:
        service = ServiceProcess(config, proxy.url).start()
        try:
            base = service.base_url
            draw, _ = current(base, SLOW)
            status, a = _sell(base, "A", SLOW, draw)
            assert status == 200
            rule = proxy.drop_reply(command("FCALL", "capsvc_sell"))
            status, _ = _sell(base, "B", SLOW, draw, retry=False)
            assert rule.fired.wait(5)
            assert status in (0, 503)
            time.sleep(2.0 + 2 * 0.5 + 0.5)  # the janitor's deadline and a round
            assert staked(base, HOT[0], draw, SLOW) == 1000
            export = tmp_path / "sold.csv"
            export.write_text(f"channel,ticket_id,total_cost\nfr-retail,A,{a['total_cost']}\n")
            out = capsvc("reconcile", "--config", config, "--dir", str(service.journal_dir),
                         "--game", SLOW, "--draw", str(draw), "--sold", str(export),
                         "--redis-url", redis.url, "--cancel-abandoned", "--format", "json",
                         journal=service.journal_dir)
            rec = json.loads(out.stdout)
            assert [(d["ticket_id"], d["cancel"]) for d in rec["not_sold"]] == [
                ("B", "cancelled: 500 released")], rec
            assert staked(base, HOT[0], draw, SLOW) == 500
        finally:
            service.stop()


def test_a_written_report_waits_for_decisions_not_journaled_yet(
        config: str, redis: RedisServer) -> None:
    """A sale whose reply was lost, and a cancel whose last step's reply was lost, on a
    draw that then becomes final: the written report counts the sale standing and the
    cancelled ticket cancelled, as Redis and GET have them (the janitor journals both
    before the report is written)."""
    with FaultProxy("127.0.0.1", redis.port) as proxy:
        service = ServiceProcess(config, proxy.url).start()
        try:
            base = service.base_url
            draw, _ = current(base)
            d = draw + 2
            status, _ = _sell(base, "C1", GAME, d, HOT[1])
            assert status == 200
            rule = proxy.drop_reply(command("FCALL", "capsvc_cancelled"))
            status, _ = call(base, "POST", "/v1/tickets/C1/cancel", token=SELLER,
                             retry=False)
            assert rule.fired.wait(5)
            rule = proxy.drop_reply(command("FCALL", "capsvc_sell"))
            status, _ = _sell(base, "LOST", GAME, d, HOT[2], retry=False)
            assert rule.fired.wait(5)
            assert status in (0, 503)
            reports = service.journal_dir / "reports" / GAME
            wait_for(reports / f"{d}.csv", 30)
            written = json.loads((reports / f"{d}.json").read_text())
            assert "cancelled" in call(base, "GET", "/v1/tickets/C1", token=SELLER)[1]
            assert call(base, "GET", "/v1/tickets/LOST", token=SELLER)[1]["status"] == (
                "accepted")
            assert (written["tickets"]["accepted"], written["tickets"]["cancelled"]) == (1, 1)
            assert written["redis"]["complete"], written["redis"]
        finally:
            service.stop()


def test_reports_written_after_a_restart_wait_for_the_janitor(
        config: str, redis: RedisServer, tmp_path: Path) -> None:
    """A cancel decided in Redis whose reply was lost, the host killed before its janitor's
    deadline, restarted once the draw is final: the report it writes counts the ticket
    cancelled (the janitor finishes and journals the cancel first)."""
    env = {"CAPSVC_JOURNAL_DIR": str(tmp_path / "journal")}
    with FaultProxy("127.0.0.1", redis.port) as proxy:
        service = ServiceProcess(config, proxy.url, env=env).start()
        try:
            draw, _ = current(service.base_url)
            d = draw + 2
            assert _sell(service.base_url, "C1", GAME, d, HOT[1])[0] == 200
            close = _close_of(service.base_url, d)
            rule = proxy.drop_reply(command("FCALL", "capsvc_cancel"))
            call(service.base_url, "POST", "/v1/tickets/C1/cancel", token=SELLER, retry=False)
            assert rule.fired.wait(5)
            _kill(service)
        finally:
            service.stop()
        time.sleep(max(0.0, close + FINAL_S + 1.0 - time.time()))
        service = ServiceProcess(config, proxy.url, env=env).start()
        try:
            reports = tmp_path / "journal" / "reports" / GAME
            wait_for(reports / f"{d}.csv", 20)
            written = json.loads((reports / f"{d}.json").read_text())
            assert "cancelled" in call(service.base_url, "GET", "/v1/tickets/C1",
                                       token=SELLER)[1]
            assert (written["tickets"]["accepted"], written["tickets"]["cancelled"]) == (0, 1)
        finally:
            service.stop()


def test_a_ticket_of_another_game_is_not_accepted_for_this_one(
        config: str, redis: RedisServer, tmp_path: Path) -> None:
    """A ticket sold on another game whose draws share the numbers, listed in this game's
    export: not_accepted (other_game), not balanced, by the route and the command."""
    service = ServiceProcess(config, redis.url).start()
    try:
        base = service.base_url
        draw, _ = current(base, SLOW)
        assert current(base, OTHER)[0] == draw
        status, x = _sell(base, "X", OTHER, draw)
        assert status == 200
        export = tmp_path / "sold.csv"
        export.write_text(f"channel,ticket_id,total_cost\nfr-retail,X,{x['total_cost']}\n")
        resp = requests.post(f"{base}/v1/games/{SLOW}/draws/{draw}/reconcile?grace=0",
                             data=export.read_bytes(), timeout=30,
                             headers={"Authorization": f"Bearer {OPS}"})
        assert [(d["ticket_id"], d["capsvc"]) for d in resp.json()["not_accepted"]] == [
            ("X", "other_game")]
        cli = capsvc("reconcile", "--config", config, "--dir", str(service.journal_dir),
                     "--game", SLOW, "--draw", str(draw), "--sold", str(export),
                     "--redis-url", redis.url, "--format", "json")
        assert cli.returncode == 1, cli.stdout
    finally:
        service.stop()


def test_a_ticket_id_sold_twice_is_a_sale_without_receipt_in_the_reconciliation(
        config: str, redis: RedisServer, tmp_path: Path) -> None:
    """Redis loses its data while host A (which answered T) is down; T's retry on host B is
    a new sale; A's restore puts its own back: T is counted twice. The report of both
    journals counts two standing sales, the reconciliation (T exported once) the same two,
    and names the one without a receipt not_sold."""
    ja, jb = tmp_path / "ja", tmp_path / "jb"
    a = ServiceProcess(config, redis.url, env={"CAPSVC_JOURNAL_DIR": str(ja)}).start()
    b = ServiceProcess(config, redis.url, env={"CAPSVC_JOURNAL_DIR": str(jb)}).start()
    try:
        draw, _ = current(a.base_url, SLOW)
        status, first = _sell(a.base_url, "T", SLOW, draw)
        assert status == 200
        a.stop()
        redis.client().flushall()
        time.sleep(1.0)  # B notices and restores its own (empty) journal
        assert _sell(b.base_url, "T", SLOW, draw)[0] == 200
        a = ServiceProcess(config, redis.url, env={"CAPSVC_JOURNAL_DIR": str(ja)}).start()
        assert staked(a.base_url, HOT[0], draw, SLOW) == 1000
        dirs = ("--dir", str(ja), "--dir", str(jb))
        report = json.loads(capsvc("report", "--config", config, *dirs, "--game", SLOW,
                                   "--draw", str(draw)).stdout)
        export = tmp_path / "sold.csv"
        export.write_text(f"channel,ticket_id,total_cost\nfr-retail,T,{first['total_cost']}\n")
        out = capsvc("reconcile", "--config", config, *dirs, "--game", SLOW, "--draw",
                     str(draw), "--sold", str(export), "--format", "json")
        rec = json.loads(out.stdout)
        assert (report["stake"], report["tickets"]["accepted"]) == (1000, 2)
        assert rec["capsvc"]["tickets"] == 2
        assert [d["ticket_id"] for d in rec["not_sold"]] == ["T"]
        assert out.returncode == 1
    finally:
        a.stop()
        b.stop()


def test_report_out_into_a_missing_directory_is_a_usage_error(
        config: str, tmp_path: Path) -> None:
    """--out into a directory that does not exist: one line, exit 2 (exit 1 means a cap
    passed or a chain broken)."""
    (tmp_path / "j").mkdir()
    out = capsvc("report", "--config", config, "--dir", str(tmp_path / "j"), "--game", GAME,
                 "--draw", "5", "--out", str(tmp_path / "nope" / "r.json"))
    assert out.returncode == 2
    assert out.stderr.startswith("capsvc report: --out ")
    assert len(out.stderr.splitlines()) == 1


# -- decisions that reach the journal late; the commands' usage errors ------------------


def test_a_late_removal_of_a_sales_entry_leaves_a_cancel_decided_meanwhile_indexed(
        config: str, redis: RedisServer) -> None:
    """Process A answers a sale, its removal of the sale's entry of the unjournaled sales
    held on the way; the cashier's cancel through B is decided (indexing the ticket) and
    its reply lost; A's removal lands: the cancel's entry stays, so the janitor finishes
    the cancel."""
    db = redis.client()
    with FaultProxy("127.0.0.1", redis.port) as proxy_a, \
            FaultProxy("127.0.0.1", redis.port) as proxy_b:
        a = ServiceProcess(config, proxy_a.url).start()
        b = ServiceProcess(config, proxy_b.url).start()
        try:
            draw, _ = current(a.base_url, SLOW)
            release = threading.Event()
            removal = proxy_a.hold_request(command("HDEL", UNJOURNALED), release)
            assert _sell(a.base_url, "Z-1", SLOW, draw)[0] == 200
            assert removal.fired.wait(5)
            lost = proxy_b.drop_reply(command("FCALL", "capsvc_cancel"))
            status, _ = call(b.base_url, "POST", "/v1/tickets/Z-1/cancel", token=SELLER,
                             retry=False)
            assert lost.fired.wait(5)
            assert status == 503
            key = ticket_key("fr-retail", "Z-1")
            assert held(db, key, "st") == b"k"
            release.set()
            time.sleep(2.0 + 4 * 0.5 + 1.0)  # the deadline and a few janitor rounds
            assert held(db, key, "st") == b"c"
            assert staked(a.base_url, HOT[0], draw, SLOW) == 0
        finally:
            a.stop()
            b.stop()


def test_a_report_waits_for_a_decision_whose_cancel_was_refused_after_a_stop(
        config: str, redis: RedisServer) -> None:
    """A sale's reply lost (never retried), its draw then stopped, the cashier's cancel
    refused: the report of the draw, written once final, has the sale Redis counts."""
    with FaultProxy("127.0.0.1", redis.port) as proxy:
        service = ServiceProcess(config, proxy.url).start()
        try:
            base = service.base_url
            draw, left = current(base)
            if left < 2.5:
                time.sleep(left + 0.2)
                draw, _ = current(base)
            lost = proxy.drop_reply(command("FCALL", "capsvc_sell"))
            status, _ = _sell(base, "R-1", GAME, draw, retry=False)
            assert lost.fired.wait(5)
            assert status == 503
            assert call(base, "POST", f"/v1/games/{GAME}/draws/{draw}/close")[0] == 200
            assert call(base, "POST", "/v1/tickets/R-1/cancel", token=SELLER,
                        retry=False)[0] == 409
            path = service.journal_dir / "reports" / GAME / f"{draw}.json"
            wait_for(path, DRAW_S + FINAL_S + 10)
            report = json.loads(path.read_text())
            assert (report["final"], report["tickets"]["accepted"], report["stake"]) == (
                True, 1, 500)
            assert report["redis"]["complete"]
        finally:
            service.stop()


def test_a_decision_of_a_game_no_longer_configured_is_journaled_once_it_is_again(
        redis: RedisServer, tmp_path: Path) -> None:
    """A sale decided but not journaled (reply lost, the process killed), the service
    restarted without its game: the ticket waits, indexed; configured again, the janitor
    journals it."""
    full, reduced = tmp_path / "full.toml", tmp_path / "reduced.toml"
    full.write_text(CONFIG)
    block = f'[[games]]\nid = "{OTHER}"\npreset = "fdj-keno-2008"\n\n'
    reduced.write_text(CONFIG.replace(block, "").replace(f', "{OTHER}"', ""))
    env = {"CAPSVC_JOURNAL_DIR": str(tmp_path / "journal")}
    with FaultProxy("127.0.0.1", redis.port) as proxy:
        first = ServiceProcess(str(full), proxy.url, env=env).start()
        try:
            draw, _ = current(first.base_url, OTHER)
            lost = proxy.drop_reply(command("FCALL", "capsvc_sell"))
            status, _ = _sell(first.base_url, "G-1", OTHER, draw, retry=False)
            assert lost.fired.wait(5)
            assert status == 503
            _kill(first)
        finally:
            first.stop()
    for config in (reduced, full):
        service = ServiceProcess(str(config), redis.url, env=env).start()
        time.sleep(2.0 + 4 * 0.5 + 1.0)  # the janitor's deadline and a few rounds
        service.stop()
        text = "".join(p.read_text() for p in (tmp_path / "journal").glob("*.jsonl"))
        assert ('"G-1"' in text) == (config == full), config


def test_cancel_abandoned_never_cancels_a_ticket_the_export_lists(
        config: str, redis: RedisServer, tmp_path: Path) -> None:
    """A ticket id sold twice (host A down while Redis lost its data, the retry judged
    anew by B), listed once in the export: the line stands for the sale Redis holds, the
    other is not_sold but listed, and --cancel-abandoned cancels neither."""
    db = redis.client()
    a = ServiceProcess(config, redis.url, env={"CAPSVC_JOURNAL_DIR": str(tmp_path / "a")})
    a.start()
    try:
        draw, _ = current(a.base_url, SLOW)
        assert _sell(a.base_url, "X-1", SLOW, draw)[0] == 200
    finally:
        a.stop()
    db.flushall()
    b = ServiceProcess(config, redis.url,
                       env={"CAPSVC_JOURNAL_DIR": str(tmp_path / "b")}).start()
    try:
        assert _sell(b.base_url, "X-1", SLOW, draw)[0] == 200
        sale_id = held(db, ticket_key("fr-retail", "X-1"), "sid").decode()
        export = tmp_path / "sold.csv"
        export.write_text("channel,ticket_id,total_cost\nfr-retail,X-1,500\n")
        out = capsvc("reconcile", "--config", config, "--game", SLOW, "--draw", str(draw),
                     "--sold", str(export), "--dir", str(tmp_path / "a"), "--dir",
                     str(tmp_path / "b"), "--redis-url", redis.url, "--cancel-abandoned",
                     "--format", "json", journal=tmp_path / "ops")
        (item,) = json.loads(out.stdout)["not_sold"]
        assert item["sale"] != sale_id
        assert item["listed"]
        assert item["cancel"].startswith("not cancelled: the export lists this ticket id")
        assert out.returncode == 1
        assert held(db, ticket_key("fr-retail", "X-1"), "st") == b"f"
    finally:
        b.stop()


def test_an_unreachable_redis_is_a_usage_error_of_report_and_reconcile(
        config: str, tmp_path: Path) -> None:
    """--redis to a Redis that does not answer: one line naming it, exit 2 (never exit 1,
    which says a cap passed or the draw is not balanced)."""
    (tmp_path / "j").mkdir()
    sold = tmp_path / "sold.csv"
    sold.write_text("channel,ticket_id,total_cost\n")
    common = ("--config", config, "--dir", str(tmp_path / "j"), "--game", GAME, "--draw", "5",
              "--redis-url", "redis://127.0.0.1:1/0")
    for out in (capsvc("report", *common), capsvc("reconcile", *common, "--sold", str(sold))):
        assert out.returncode == 2, out.stderr
        assert "redis: " in out.stderr
        assert len(out.stderr.splitlines()) == 1
