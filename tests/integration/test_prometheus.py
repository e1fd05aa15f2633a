"""The real Prometheus scraping a real two-worker capsvc: every dashboard query and every
alert rule of deploy/ evaluates to something, and the gauges and histograms read sensibly.

Prometheus (the Debian `prometheus` binary) scrapes the service every second and evaluates
the shipped alert rules every second, while the test sells tickets that get accepted, cut
by the combination cap, refused by a player's daily limit, and sends requests that fail
with a 4xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
import yaml

from tests.conftest import CONFIG, TOKENS
from tests.integration.test_workers import wait_ready
from tests.support.servers import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "capsvc.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"

TRAFFIC_S = 11.0
"""How long the test sells: about ten scrapes and rule evaluations."""
CLIENTS = 12
"""Concurrent HTTP clients during the traffic: the in-flight gauge never exceeds it."""
SALE = ("/v1/tickets", "POST")

GRAFANA_VARIABLES = {
    "$__rate_interval": "1m", "${__rate_interval}": "1m",
    "$__interval_ms": "1000", "${__interval_ms}": "1000",
    "$__interval": "1s", "${__interval}": "1s",
    "$__range_s": "60", "${__range_s}": "60",
    "$__range_ms": "60000", "${__range_ms}": "60000",
    "$__range": "1m", "${__range}": "1m",
}
"""Grafana's built-in variables, with values that suit a ~15 s test scraped every second."""

COMPARISON_RE = re.compile(r"\s*(?:>=|<=|==|!=|>|<)\s*(?:bool\s+)?-?[0-9][0-9.eE+-]*")
"""A comparison with a number (`> 0.1`), as alert expressions end; label matchers such as
`status!="5"` are never followed by a digit."""
SELECTOR_RE = re.compile(r"\b(capsvc_[a-z_]+(?:\{[^}]*\})?|up\{[^}]*\})")
"""The metric selectors of an expression: every capsvc_* name and `up{…}`, with matchers."""


# -- processes -----------------------------------------------------------------------------


def _stop(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM, then SIGKILL to the process group it leads (its workers) if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout_s)
    try:
        os.killpg(proc.pid, 0)  # the group still exists: some of our processes live on
    except (ProcessLookupError, PermissionError):
        return
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture
def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the prometheus binary is not on PATH (apt-get install prometheus)")
    return binary


@pytest.fixture
def capsvc_workers(standalone_db: redis.Redis, redis_server: RedisServer,
                   tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """`capsvc serve --workers 2` over the test's Redis; its base URL and its log."""
    port = free_port()
    log = tmp_path / "capsvc.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "capsvc", "serve", "--workers", "2", "--config", str(CONFIG),
             "--redis-url", redis_server.url, "--port", str(port)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}", log
    finally:
        _stop(proc, 20)


@pytest.fixture
def prometheus(prometheus_binary: str, capsvc_workers: tuple[str, Path],
               tmp_path: Path) -> Iterator[str]:
    """The real Prometheus scraping the service and evaluating the shipped alert rules
    every second; its base URL."""
    service = capsvc_workers[0].removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                   "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [{"job_name": "capsvc", "metrics_path": "/metrics",
                            "static_configs": [{"targets": [service]}]}],
    }))
    port = free_port()
    with (tmp_path / "prometheus.log").open("wb") as out:
        proc = subprocess.Popen(
            [prometheus_binary, f"--config.file={config}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
            start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc, 10)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # new connections: both workers
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=10)) as s:
        yield s


# -- Prometheus HTTP API -------------------------------------------------------------------


class Prom:
    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = url

    async def api(self, path: str, **params: str) -> Any:
        async with self.session.get(f"{self.url}/api/v1/{path}", params=params) as resp:
            body = await resp.json()
        assert body["status"] == "success", (path, params, body)
        return body["data"]

    async def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's vector (a scalar becomes a one-element vector)."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        data = await self.api("query", **params)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        assert data["resultType"] == "vector", (expr, data)
        result: list[dict[str, Any]] = data["result"]
        return result

    async def value(self, expr: str, at: float | None = None) -> float:
        """The single value of an expression (one series expected)."""
        result = await self.query(expr, at)
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])

    async def wait_ready(self, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                async with self.session.get(f"{self.url}/-/ready",
                                            timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.1)
        raise AssertionError(f"prometheus not ready after {timeout_s}s")

    async def poll(self, expr: str, accept: Any, timeout_s: float) -> float:
        """Query until `accept(value)`; the last value (which the caller asserts on)."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = await self.query(expr)
            value = float(result[0]["value"][1]) if len(result) == 1 else math.nan
            if accept(value) or time.monotonic() > deadline:
                return value
            await asyncio.sleep(0.2)


# -- traffic -------------------------------------------------------------------------------


@dataclass
class Traffic:
    """What the clients sent and what they got."""

    sent: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Requests per (route template, method)."""
    http: Counter[int] = field(default_factory=Counter)
    tickets: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)


def _numbers(rng: random.Random, picks: int, of: int = 70) -> list[int]:
    return sorted(rng.sample(range(1, of + 1), picks))


class Seller:
    """One HTTP client, going round a mix of requests."""

    def __init__(self, session: aiohttp.ClientSession, url: str, traffic: Traffic,
                 name: str) -> None:
        self.session, self.url, self.traffic, self.name = session, url, traffic, name
        self.rng = random.Random(name)
        self.n = 0

    def _id(self) -> str:
        self.n += 1
        return f"P{self.name}-{self.n:06d}"

    async def send(self, method: str, route: str, path: str, *, token: str | None,
                   json_body: Any = None, data: bytes | None = None) -> Any:
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if token is not None:
            headers["Authorization"] = f"Bearer {TOKENS.get(token, token)}"
        while True:
            self.traffic.sent[route, method] += 1
            async with self.session.request(method, self.url + path, json=json_body,
                                            data=data, headers=headers) as resp:
                self.traffic.http[resp.status] += 1
                body = await resp.json(content_type=None)
            if resp.status != 503:
                break
            # Redis slow on a loaded machine: the same request sent again, as the contract
            # says a sales system does.
        if resp.status >= 500:
            self.traffic.errors.append(f"{method} {path}: {resp.status} {body}")
        if route == "/v1/tickets" and resp.status == 200:
            self.traffic.tickets[body["status"]] += 1
            for grid in body["grids"]:
                if grid.get("reason"):
                    self.traffic.reasons[grid["reason"]] += 1
        return body

    async def sell(self, body: dict[str, Any], token: str = "fr") -> Any:
        body = {"ticket_id": self._id(), **body}
        return await self.send("POST", "/v1/tickets", "/v1/tickets", token=token,
                               json_body=body)

    async def heavy(self) -> None:
        """20 grids of 10 numbers over 10 draws: 20 reservations on 10 counters each."""
        await self.sell({"game": "fdj-keno", "draws": 10, "grids": [
            {"numbers": _numbers(self.rng, 10), "stake": 100} for _ in range(20)]})

    async def accepted(self) -> None:
        await self.sell({"game": "fdj-keno", "grids": [
            {"numbers": _numbers(self.rng, self.rng.choice([2, 5, 8])), "stake": 200}]})

    async def hot(self, round_: int) -> None:
        """10 EUR sales on a combination of 8, 9 or 10 numbers shared by a round of 8: the
        4th brings it to 80 %, the 5th to its cap, the next ones are cut (with a fresh grid
        beside every other one: a partial ticket)."""
        picks = (8, 9, 10)[round_ % 3]
        hot = _numbers(random.Random(f"{self.name}-hot-{round_}"), picks)
        grids = [{"numbers": hot, "stake": 1000}]
        if self.n % 2:
            grids.append({"numbers": _numbers(self.rng, 4), "stake": 100})
        await self.sell({"game": "fdj-keno", "grids": grids})

    async def lnm(self, limited: bool) -> None:
        """An LNM sale, by a fresh player or by one whose self-limit (1 dh) it exceeds."""
        player = f"LIM-{self.name}" if limited else self._id()
        await self.sell({"game": "lnm-keno", "player_id": player, "grids": [
            {"numbers": _numbers(self.rng, 5, 80), "stake": 250}]}, token="ma")

    async def client_error(self, kind: int) -> None:
        """422, 401, 400 on the sale route; 404 on a ticket's."""
        if kind == 0:
            await self.sell({"game": "fdj-keno", "grids": [
                {"numbers": _numbers(self.rng, 9), "stake": 700}]})
        elif kind == 1:
            await self.send("POST", "/v1/tickets", "/v1/tickets", token="not-a-token",
                            json_body={"ticket_id": self._id(), "game": "fdj-keno",
                                       "grids": [{"numbers": [1, 2], "stake": 100}]})
        elif kind == 2:
            await self.send("POST", "/v1/tickets", "/v1/tickets", token="fr",
                            data=b'{"ticket_id": "x", "game": ')
        else:
            await self.send("GET", "/v1/tickets/{ticket_id}", f"/v1/tickets/{self._id()}",
                            token="fr")

    async def limit(self) -> None:
        """The self-limit (1 dh a day) of this client's limited LNM player."""
        await self.send("PUT", "/v1/players/{player_id}/limit",
                        f"/v1/players/LIM-{self.name}/limit", token="ma",
                        json_body={"daily": 100})

    async def warm_up(self) -> None:
        """One request of each kind: every (route, method, status) series the traffic will
        move exists before the traffic, so that increase() over the traffic sees it all."""
        await self.limit()
        await self.heavy()
        await self.accepted()
        for _ in range(6):
            await self.hot(-1)
        await self.lnm(limited=False)
        await self.lnm(limited=True)
        for kind in range(4):
            await self.client_error(kind)
        await self.reconcile()

    async def reconcile(self) -> None:
        """The draw on sale reconciled with an export of one ticket it never sold: the
        reconcile series exist (one difference, not_accepted)."""
        async with self.session.get(f"{self.url}/v1/games/fdj-keno/draws/current",
                                    headers={"Authorization": f"Bearer {TOKENS['admin']}"}
                                    ) as resp:
            draw = (await resp.json())["draw"]
        route = "/v1/games/{game}/draws/{draw}/reconcile"
        await self.send("POST", route, f"/v1/games/fdj-keno/draws/{draw}/reconcile",
                        token="admin",
                        data=b"channel,ticket_id,total_cost\nfr-retail,NEVER-SOLD,100\n")

    async def run(self, until: float) -> None:
        await self.limit()
        step = 0
        while time.monotonic() < until:
            kind = step % 8
            if kind == 0:
                await self.heavy()
            elif kind in (1, 5):
                await self.accepted()
            elif kind in (2, 4, 6):
                await self.hot(step // 24)
            elif kind == 3:
                await self.lnm(limited=step % 16 == 3)
            else:
                await self.client_error((step // 8) % 4)
            step += 1


# -- the expressions of deploy/ ------------------------------------------------------------


def dashboard_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target, Grafana variables replaced by values."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = dict(GRAFANA_VARIABLES)
    for var in dashboard.get("templating", {}).get("list", []):
        current = var.get("current", {}).get("value")
        if isinstance(current, list):
            current = current[0] if current else None
        if current in (None, "", "$__all"):
            options = [o["value"] for o in var.get("options", []) if o.get("value") != "$__all"]
            current = options[0] if options else ".*"
        for form in (f"${{{var['name']}}}", f"[[{var['name']}]]", f"${var['name']}"):
            variables[form] = str(current)
    panels = list(dashboard["panels"])
    for panel in list(panels):
        panels.extend(panel.get("panels", []))  # rows may hold panels of their own
    exprs = []
    for panel in panels:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name in sorted(variables, key=len, reverse=True):
                expr = expr.replace(name, variables[name])
            assert "$" not in expr, f"unknown variable in {expr}"
            assert "[[" not in expr, f"unknown variable in {expr}"
            exprs.append((f"panel {panel['title']!r} {target.get('refId', '')}", expr))
    return exprs


def alert_expressions() -> list[tuple[str, str]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [(f"rule {rule.get('alert') or rule.get('record')}", " ".join(rule["expr"].split()))
            for group in groups for rule in group["rules"]]


# -- the test ------------------------------------------------------------------------------


async def test_prometheus_scrapes_every_series_of_the_dashboard_and_the_alerts(
        prometheus: str, capsvc_workers: tuple[str, Path],
        session: aiohttp.ClientSession) -> None:
    """Under mixed sales on two workers, the real Prometheus sees the target up, the shipped
    rules loaded and healthy, every dashboard query and alert expression (and every series
    they select) non-empty, the in-flight gauge between 0 and the number of clients and
    back to 0 when idle, sale latencies under a second whose count matches what was sent,
    and Redis round trips spread over several buckets."""
    url, log = capsvc_workers
    prom = Prom(session, prometheus)
    await wait_ready(session, url, log, timeout_s=30)  # the service may be restarting
    await prom.wait_ready()

    # Warm up (every series the traffic moves exists), then wait for a scrape of it.
    traffic = Traffic()
    sellers = [Seller(session, url, traffic, f"{i:02d}") for i in range(CLIENTS)]
    await sellers[0].warm_up()
    warm_sales = traffic.sent[SALE]
    sales = ('sum(capsvc_http_request_duration_seconds_count'
             '{route="/v1/tickets",method="POST"})')
    base = await prom.poll(sales, lambda v: v == warm_sales, 10)
    assert base == warm_sales, f"Prometheus saw {base} sales, {warm_sales} were sent: {log}"
    await asyncio.sleep(1.2)  # one more scrape at the base level

    started = time.time()
    until = time.monotonic() + TRAFFIC_S
    await asyncio.gather(*(s.run(until) for s in sellers))
    ended = time.time()
    sent = traffic.sent[SALE] - warm_sales
    assert not traffic.errors, traffic.errors[:5]
    for decision in ("accepted", "partial", "rejected"):
        assert traffic.tickets[decision], (decision, traffic.tickets)
    assert traffic.reasons["combination_capped"], traffic.reasons
    assert traffic.reasons["player_limit"], traffic.reasons
    for status in (400, 401, 404, 422):
        assert traffic.http[status], (status, traffic.http)

    problems: list[str] = []

    # In flight: back to 0 once idle, from a scrape taken after the traffic.
    in_flight = "sum(capsvc_http_requests_in_flight)"
    deadline = time.monotonic() + 6
    while True:
        (sample,) = await prom.query(in_flight)
        at, idle = float(sample["value"][0]), float(sample["value"][1])
        if (at > ended + 1.5 and idle == 0) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    if idle != 0:
        problems.append(f"{in_flight} = {idle} while idle (sample at {at - ended:+.1f} s "
                        "from the end of the traffic)")

    # Every sale was scraped: the raw count moved by exactly what was sent.
    total = await prom.poll(sales, lambda v: v == base + sent, 5)
    if total != base + sent:
        problems.append(f"{sales} moved by {total - base}, {sent} sales were sent")

    # Let the rules evaluate over the whole traffic, then check them.
    await asyncio.sleep(1.5)
    now = time.time()
    window = f"{math.ceil(now - started) + 2}s"
    rules = await prom.api("rules")
    expected = {(g["name"], r.get("alert") or r.get("record"))
                for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}
    loaded = {(g["name"], r["name"]): r for g in rules["groups"] for r in g["rules"]}
    assert set(loaded) == expected, (sorted(loaded), sorted(expected))
    for key, rule in loaded.items():
        if rule["health"] != "ok" or rule.get("lastError"):
            problems.append(f"rule {key}: health {rule['health']} {rule.get('lastError')}")
        if not rule.get("lastEvaluation", "").startswith("20"):
            problems.append(f"rule {key} never evaluated")

    # The target is up.
    targets = (await prom.api("targets", state="active"))["activeTargets"]
    assert [t["labels"]["job"] for t in targets] == ["capsvc"], targets
    assert targets[0]["health"] == "up", targets[0]
    assert await prom.value('up{job="capsvc"}') == 1

    # Every dashboard query and alert expression evaluates to something, and so does every
    # series it selects; an alert's own comparison is dropped (it may rightly be empty).
    for where, expr in dashboard_expressions() + alert_expressions():
        if where.startswith("rule"):
            expr = COMPARISON_RE.sub("", expr)
        if not await prom.query(expr, now):
            problems.append(f"{where}: empty result for {expr}")
        for selector in sorted(set(SELECTOR_RE.findall(expr))):
            if not await prom.query(selector, now):
                problems.append(f"{where}: no series {selector}")

    # In flight during the traffic: never negative, never above the number of clients, and
    # not stuck at 0 while they keep requests going (every sample: one a second).
    span = f"[{math.ceil(ended - started)}s:250ms]"
    low = await prom.value(f"min_over_time({in_flight}{span})", ended)
    high = await prom.value(f"max_over_time({in_flight}{span})", ended)
    if not (low >= 0 and 0 < high <= CLIENTS):
        problems.append(f"{in_flight} over the traffic: min {low}, max {high} "
                        f"(expected 0 <= min, 0 < max <= {CLIENTS})")

    # Sale latency: a median under a second, a count that matches the sales sent.
    route = '{route="/v1/tickets",method="POST"}'
    p50 = await prom.value("histogram_quantile(0.5, sum by (le) (increase("
                           f"capsvc_http_request_duration_seconds_bucket{route}[{window}])))", now)
    if not 0 < p50 < 1:
        problems.append(f"sale p50 latency {p50} s over the traffic")
    counted = await prom.value(
        f"sum(increase(capsvc_http_request_duration_seconds_count{route}[{window}]))", now)
    if not 0.8 * sent <= counted <= 1.25 * sent:
        problems.append(f"increase of the sale count over {window}: {counted:.0f}, "
                        f"{sent} sales were sent")

    # Redis round trips: observations in more than one bucket, not all in the first.
    buckets = {float(s["metric"]["le"]): float(s["value"][1]) for s in await prom.query(
        "sum by (le) (capsvc_redis_batch_duration_seconds_bucket)", now)}
    cumulative = [buckets[le] for le in sorted(buckets)]
    counts = [n - below for n, below in zip(cumulative, [0.0, *cumulative], strict=False)]
    if not (buckets and sum(n > 0 for n in counts) > 1 and counts[0] < cumulative[-1]):
        problems.append(f"capsvc_redis_batch_duration_seconds buckets (cumulative): {buckets}")

    print(f"{sent} sales sent in {ended - started:.1f} s ({dict(traffic.tickets)}, "
          f"{dict(traffic.reasons)}, HTTP {dict(traffic.http)}); Prometheus: increase "
          f"{counted:.0f}, p50 {p50 * 1000:.2f} ms, in flight min {low} max {high}, Redis "
          f"round trips per bucket {dict(zip(sorted(buckets), counts, strict=True))}")
    assert not problems, "\n".join(problems)
