"""A Redis that may evict, or that is full: capsvc sells only on a Redis whose
maxmemory-policy is noeviction (every node, read on every connection), and a Redis at
maxmemory is a 503 and one line, never a traceback, a sale past the cap or a sale lost."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from tests.conftest import CONFIG, TEN, TOKENS, new_id
from tests.support.eviction import eviction_scenario, fill, squeeze
from tests.support.servers import RedisCluster, RedisServer
from tests.support.service import ServiceProcess

WAIT_S = 15.0
"""Longest wait for a state the service reaches by itself (not a speed: a bound)."""


def capsvc(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "capsvc", *args], capture_output=True,
                          text=True, timeout=120, check=False, env=env)


def problem_lines(text: str, policy: str) -> list[str]:
    """The lines of `text` that name `policy` as the node's maxmemory-policy."""
    return [line for line in text.splitlines()
            if f"has maxmemory-policy {policy}:" in line]


def one_line(out: subprocess.CompletedProcess[str]) -> str:
    """A command's only line on stderr (none on stdout but what it printed before)."""
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    return lines[0]


async def status(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as resp:
        return resp.status, await resp.json(content_type=None)


async def sell(session: aiohttp.ClientSession, base: str, numbers: list[int] | None = None
               ) -> tuple[int, Any]:
    body = {"ticket_id": new_id("EV"), "game": "fdj-keno",
            "grids": [{"numbers": numbers or TEN[:8], "stake": 500}]}
    async with session.post(f"{base}/v1/tickets", json=body,
                            headers={"Authorization": f"Bearer {TOKENS['fr']}"}) as resp:
        return resp.status, {**await resp.json(content_type=None), "sent": body}


async def until_ready(session: aiohttp.ClientSession, base: str, ready: bool,
                      **checks: bool) -> None:
    """Until /readyz says `ready`, with `checks` among its checks, within WAIT_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while True:
        code, body = await status(session, f"{base}/readyz")
        if (code == 200) == ready and checks.items() <= body["checks"].items():
            return
        assert loop.time() < deadline, f"/readyz still {code}: {body}"
        await asyncio.sleep(0.1)


def kill_clients(db: redis.Redis) -> None:
    """CLIENT KILL TYPE normal: every client connection but this one (a reconnection)."""
    db.execute_command("CLIENT", "KILL", "TYPE", "normal")  # type: ignore[no-untyped-call]


@pytest.fixture
def lru_redis() -> Iterator[RedisServer]:
    server = RedisServer(extra=("--maxmemory-policy", "allkeys-lru")).start()
    yield server
    server.stop()


async def test_an_evicting_redis_keeps_the_process_not_ready_with_one_line(
        lru_redis: RedisServer) -> None:
    """allkeys-lru: not ready, sales 503, one line (node, setting, fix), check-config too."""
    service = ServiceProcess(str(CONFIG), lru_redis.url).start()
    try:
        async with aiohttp.ClientSession() as session:
            await until_ready(session, service.base_url, ready=False, noeviction=False)
            for _ in range(3):
                code, body = await sell(session, service.base_url)
                assert code == 503, body
            await asyncio.sleep(1.5)  # the policy read again meanwhile: said once still
            assert (await status(session, f"{service.base_url}/readyz"))[0] == 503
    finally:
        service.stop()
    log = service.log.read_text()
    said = problem_lines(log, "allkeys-lru")
    assert len(said) == 1, log
    line = json.loads(said[0])
    assert line["level"] == "error"
    assert f"redis at 127.0.0.1:{lru_redis.port} has maxmemory-policy allkeys-lru" in line[
        "message"]
    assert "set `maxmemory-policy noeviction`" in line["message"]
    assert "Traceback" not in log
    out = capsvc("check-config", str(CONFIG), "--redis-url", lru_redis.url)
    assert out.returncode == 1
    assert one_line(out) == f"capsvc check-config: {line['message']}"


async def test_with_config_disabled_the_policy_is_read_from_info() -> None:
    """CONFIG renamed away: the evicting policy is read from INFO memory, by both."""
    server = RedisServer(extra=("--maxmemory-policy", "volatile-lru",
                                "--rename-command", "CONFIG", "")).start()
    try:
        with pytest.raises(redis.ResponseError, match="unknown command"):
            server.client().config_get("maxmemory-policy")
        service = ServiceProcess(str(CONFIG), server.url).start()
        try:
            async with aiohttp.ClientSession() as session:
                await until_ready(session, service.base_url, ready=False, noeviction=False)
                assert (await sell(session, service.base_url))[0] == 503
        finally:
            service.stop()
        assert len(problem_lines(service.log.read_text(), "volatile-lru")) == 1
        out = capsvc("check-config", str(CONFIG), "--redis-url", server.url)
        assert out.returncode == 1
        assert "has maxmemory-policy volatile-lru" in one_line(out)
    finally:
        server.stop()


async def test_a_policy_switched_on_a_running_redis_holds_sales_until_switched_back() -> None:
    """CONFIG SET allkeys-lru and a reconnection: not ready; set back: ready, nothing lost."""
    server = RedisServer().start()
    db = server.client()
    service = ServiceProcess(str(CONFIG), server.url).start()
    try:
        async with aiohttp.ClientSession() as session:
            base = service.base_url
            await until_ready(session, base, ready=True)
            code, sold = await sell(session, base)
            assert code == 200, sold
            assert sold["status"] == "accepted"
            db.config_set("maxmemory-policy", "allkeys-lru")
            kill_clients(db)
            await until_ready(session, base, ready=False, noeviction=False)
            assert (await sell(session, base, TEN[1:9]))[0] == 503
            db.config_set("maxmemory-policy", "noeviction")
            kill_clients(db)
            await until_ready(session, base, ready=True)
            code, again = await sell(session, base, TEN[1:9])
            assert code == 200, again
            assert again["status"] == "accepted"
            ticket_id = sold["sent"]["ticket_id"]
            async with session.get(f"{base}/v1/tickets/{ticket_id}", headers={
                    "Authorization": f"Bearer {TOKENS['fr']}"}) as resp:
                assert resp.status == 200
                assert (await resp.json())["grids"] == sold["grids"]
    finally:
        service.stop()
        db.close()
        server.stop()
    log = service.log.read_text()
    assert len(problem_lines(log, "allkeys-lru")) == 1, log
    assert "has maxmemory-policy noeviction again" in log
    assert "re-applying the whole journal" in log
    assert "Traceback" not in log


async def test_one_cluster_node_that_may_evict_keeps_the_process_not_ready(
        redis_cluster: RedisCluster) -> None:
    """One cluster node with allkeys-lru: not ready, that node named; set back: ready."""
    node = redis_cluster.primary_nodes()[-1]
    db = node.client()
    db.config_set("maxmemory-policy", "allkeys-lru")
    try:
        service = ServiceProcess(str(CONFIG), redis_cluster.url).start()
        try:
            async with aiohttp.ClientSession() as session:
                await until_ready(session, service.base_url, ready=False, noeviction=False)
                db.config_set("maxmemory-policy", "noeviction")
                await until_ready(session, service.base_url, ready=True)
        finally:
            service.stop()
    finally:
        db.config_set("maxmemory-policy", "noeviction")
        db.close()
    said = problem_lines(service.log.read_text(), "allkeys-lru")
    assert len(said) == 1
    assert f"redis at 127.0.0.1:{node.port} has" in said[0]


async def test_a_full_noeviction_redis_answers_503_and_loses_nothing() -> None:
    """At maxmemory: sales 503, no cap passed, no sale lost, verify one line and exit 1."""
    run = await eviction_scenario("noeviction")
    assert run.ready
    assert "command not allowed when used memory > 'maxmemory'" in run.filler_refused
    assert run.answered == 6 * 25  # six combinations sold to their cap, before Redis filled
    assert run.unavailable == 6 * 4  # the second round: refused out of memory, every try
    assert (run.lost, run.over_cap, run.highest) == (0, 0, 5000)
    code, stderr = run.verify
    assert code == 1
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    assert "is out of memory (maxmemory reached under noeviction)" in lines[0]
    assert "refuses writes: out of memory" in run.log
    assert "Traceback" not in run.log


async def test_keys_evicted_while_switched_are_put_back_before_the_next_sale() -> None:
    """~2,400 keys evicted while switched to allkeys-lru: nothing lost, no cap passed."""
    run = await eviction_scenario("allkeys-lru", switched=True)
    assert run.ready
    assert run.evicted >= 2400
    assert run.answered == 6 * 25  # the first round; the third finds every cap reached
    assert run.unavailable == 6 * 4  # the second round, while the policy could evict
    assert (run.lost, run.over_cap, run.highest) == (0, 0, 5000)
    assert "re-applying the whole journal" in run.log
    assert "Traceback" not in run.log


async def test_a_full_redis_answers_each_sale_503_with_one_log_line_and_counts_them() -> None:
    """At maxmemory: a sale and each sale of a batch 503 (out of memory), one line, counted."""
    server = RedisServer(extra=("--maxmemory", "8mb")).start()
    db = server.client()
    service = ServiceProcess(str(CONFIG), server.url).start()
    try:
        async with aiohttp.ClientSession() as session:
            base = service.base_url
            await until_ready(session, base, ready=True)
            fill(db, 1)
            squeeze(db)
            code, body = await sell(session, base)
            assert code == 503
            assert "out of memory" in body["error"]["message"]
            tickets = [{"ticket_id": new_id("EB"), "game": "fdj-keno",
                        "grids": [{"numbers": TEN[i:i + 8], "stake": 500}]} for i in range(3)]
            async with session.post(f"{base}/v1/ticket-batches", json={"tickets": tickets},
                                    headers={"Authorization": f"Bearer {TOKENS['fr']}"}
                                    ) as resp:
                assert resp.status == 200
                results = (await resp.json())["results"]
            assert [r["status"] for r in results] == [503] * 3
            assert all("out of memory" in r["body"]["error"]["message"] for r in results)
            async with session.get(f"{base}/metrics") as resp:
                metrics = await resp.text()
            refused = [line for line in metrics.splitlines()
                       if line.startswith('capsvc_redis_errors_total{kind="oom"}')]
            # Each refused command counted: the batch's sales were judged in one call.
            assert float(refused[0].split()[-1]) >= 2
    finally:
        service.stop()
        db.close()
        server.stop()
    log = service.log.read_text()
    assert log.count("refuses writes: out of memory") == 1
    assert "Traceback" not in log


LIBRARY = """#!lua name=oomcheck
redis.register_function('two_writes', function(keys, args)
  redis.call('SET', keys[1], '1')
  redis.call('SET', keys[2], string.rep('x', tonumber(args[1])))
  return 1
end)
redis.register_function{function_name = 'read', flags = {'no-writes'},
  callback = function(keys) return redis.call('EXISTS', keys[1]) end}
"""


def test_redis_runs_a_writing_function_whole_or_refuses_it_before_it_runs() -> None:
    """Below maxmemory a writing FCALL runs whole (even past it); above, none of it runs."""
    server = RedisServer(extra=("--maxmemory", "4mb")).start()
    db = server.client()
    try:
        db.function_load(LIBRARY)
        assert db.fcall("two_writes", 2, "a", "b", 5_000_000) == 1
        assert db.exists("a", "b") == 2
        assert int(db.info("memory")["used_memory"]) > 4 * 1024 * 1024
        with pytest.raises(redis.ResponseError, match="used memory > 'maxmemory'"):
            db.fcall("two_writes", 2, "c", "d", 1)
        assert db.exists("c", "d") == 0
        assert db.fcall("read", 1, "a") == 1
    finally:
        db.close()
        server.stop()


@pytest.fixture
def sold_then_stopped(tmp_path: Path
                      ) -> Iterator[tuple[RedisServer, ServiceProcess, int, list[str]]]:
    """A noeviction Redis of 8 MB, a few tickets sold by a service now stopped: the Redis,
    the service (its journal), the draw sold and the tickets' ids."""
    server = RedisServer(extra=("--maxmemory", "8mb")).start()
    service = ServiceProcess(str(CONFIG), server.url).start()

    tickets: list[str] = []

    async def some_sales() -> int:
        async with aiohttp.ClientSession() as session:
            await until_ready(session, service.base_url, ready=True)
            for i in range(5):
                code, body = await sell(session, service.base_url, TEN[i:i + 8])
                assert code == 200, body
                tickets.append(body["ticket_id"])
            draw: int = body["draws"][0]
            return draw

    try:
        draw = asyncio.run(some_sales())
        service.stop()
        yield server, service, draw, tickets
    finally:
        service.stop()
        server.stop()


@pytest.mark.parametrize("fault", ["evicting", "full"])
def test_every_command_on_redis_says_an_evicting_or_full_redis_in_one_line(
        sold_then_stopped: tuple[RedisServer, ServiceProcess, int, list[str]], fault: str,
        tmp_path: Path) -> None:
    """Every command with --redis-url: one line, non-zero exit, no traceback on either."""
    # A report or a reconciliation that only reads is answered by a full Redis: exit 0.
    server, service, draw, tickets = sold_then_stopped
    db = server.client()
    if fault == "evicting":
        db.config_set("maxmemory-policy", "allkeys-lru")
        said = "has maxmemory-policy allkeys-lru"
    else:
        fill(db, 1)
        squeeze(db)
        said = "out of memory"
    db.close()
    journal, url = str(service.journal_dir), server.url
    sold = tmp_path / "sold.csv"
    sold.write_text("channel,ticket_id,total_cost\n"
                    + "".join(f"fr-retail,{t},500\n" for t in tickets))  # balanced
    commands = [
        ("journal", "verify", journal, "--config", str(CONFIG), "--redis-url", url),
        ("journal", "restore", "--config", str(CONFIG), "--redis-url", url, "--dir", journal),
        ("report", "--config", str(CONFIG), "--dir", journal, "--game", "fdj-keno",
         "--draw", str(draw), "--redis-url", url),
        ("reconcile", "--config", str(CONFIG), "--dir", journal, "--game", "fdj-keno",
         "--draw", str(draw), "--sold", str(sold), "--redis-url", url),
    ]
    if fault == "evicting":  # a full Redis that keeps what it has is no configuration error
        commands.append(("check-config", str(CONFIG), "--redis-url", url))
    for command in commands:
        out = capsvc(*command, env=service.env)
        assert "Traceback" not in out.stderr
        if fault == "full" and command[0] in ("report", "reconcile") and not out.returncode:
            continue  # what they read, a full Redis still answers
        assert out.returncode != 0, (command, out.stdout)
        assert said in one_line(out), (command, out.stderr)
