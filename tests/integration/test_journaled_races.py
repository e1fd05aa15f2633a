"""Races around the pending index, each a test: the pending index keeps every
decision Redis holds until a journal has it, whatever races the janitor, replays, cancels,
entries that must wait and short retentions bring; and the reconciliation looks up in
Redis a ticket voided here and sold by another host."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from capsvc.config import Settings, load_settings
from capsvc.domain.errors import Unavailable
from capsvc.http import server as server_module
from capsvc.http.server import Service, build
from capsvc.journal.reader import records
from capsvc.journal.records import StopRecord
from capsvc.redis.store import TICKET_BUCKETS, ticket_key
from tests.conftest import CONFIG, TEN, Client, past_deadline, start_service, ticket
from tests.integration.test_journaled import indexed, journaled
from tests.records import held
from tests.support.servers import redis_ms


def refused(*args: object, **kwargs: object) -> Any:
    raise Unavailable("the journal could not be written")


def slot_of(channel: str, tid: str) -> int:
    return zlib.crc32(f"{channel}/{tid}".encode()) % TICKET_BUCKETS


def ids_in_slot(channel: str, slot: int, n: int, prefix: str) -> list[str]:
    out, i = [], 0
    while len(out) < n:
        if slot_of(channel, f"{prefix}-{i}") == slot:
            out.append(f"{prefix}-{i}")
        i += 1
    return out


async def test_a_cancel_decided_after_a_replay_is_indexed_with_its_decision(
        service: tuple[Service, str], client: Client, redis_db: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A replay of a sale runs while a cancel of it is on its way; the cancel, decided
    after, indexes the ticket in the same call: its release lost, the janitor finishes
    it."""
    svc, _ = service
    draw = await client.current()
    body = ticket([{"numbers": TEN, "stake": 500}], first_draw=draw)
    assert (await client.sell(body)).status == 200
    entered, go = asyncio.Event(), asyncio.Event()
    original_cancel, ledger = svc.store.cancel, svc.usecases.tickets.steps

    async def held_cancel(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        await go.wait()
        return await original_cancel(*args, **kwargs)

    async def lost(*args: object, **kwargs: object) -> None:
        raise Unavailable("the cancel's release never ran")

    monkeypatch.setattr(svc.store, "cancel", held_cancel)
    monkeypatch.setattr(ledger, "give_back", lost)
    cancel = asyncio.create_task(client.post(f"/v1/tickets/{body['ticket_id']}/cancel"))
    await asyncio.wait_for(entered.wait(), 5)
    replay = await client.sell(body)
    assert replay.headers.get("Idempotent-Replayed") == "true"
    await asyncio.sleep(0.1)
    go.set()
    assert (await cancel).status == 503
    monkeypatch.undo()
    assert indexed(redis_db) == 1
    await past_deadline(svc.usecases.janitor).run_once()
    key = ticket_key("fr-retail", body["ticket_id"])
    assert (held(redis_db, key, "st"), await client.staked(TEN, draw)) == (b"c", 0)
    assert ("cancel", "janitor") in journaled(svc, body["ticket_id"])
    assert indexed(redis_db) == 0


@pytest.fixture
async def in_steps(settings: Settings, redis_backend: Any, redis_db: Any
                   ) -> AsyncIterator[tuple[Service, Client]]:
    """The service selling in steps (a Redis Cluster's protocol; `sale_calls = "steps"`
    on one Redis), over the test's Redis, and its client."""
    svc = build(dataclasses.replace(settings, one_call_sales=False), redis_backend.url)
    runner, url = await start_service(svc)
    async with aiohttp.ClientSession() as session:
        yield svc, Client(session, url)
    await runner.cleanup()
    await svc.redis.aclose()


async def test_the_janitor_dropping_a_gone_tickets_entry_leaves_a_new_sales_entry(
        in_steps: tuple[Service, Client], redis_db: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry whose ticket is gone (a sale in steps refused for a closed draw) is being
    dropped by the janitor while a new sale of the id is decided and not journaled: the
    new sale's entry stays, and the janitor journals it."""
    svc, client = in_steps
    draw = await client.current("lnm-keno")
    late = ticket([{"numbers": TEN[:8], "stake": 250}], game="lnm-keno", player_id="P-1",
                  first_draw=draw - 1)
    assert (await client.sell(late, token="ma")).body["error"]["code"] == "draw_closed"
    key = ticket_key("ma-retail", late["ticket_id"])
    assert (held(redis_db, key, "st"), indexed(redis_db)) == (None, 1)
    entered, go = asyncio.Event(), asyncio.Event()
    original = svc.store.journaled

    def delayed(ticket_key_: str, sale_id: str, state: bytes) -> Any:
        async def later() -> Any:
            entered.set()
            await go.wait()
            return await original(ticket_key_, sale_id, state)
        return asyncio.ensure_future(later())

    monkeypatch.setattr(svc.store, "journaled", delayed)
    janitor = asyncio.create_task(past_deadline(svc.usecases.janitor).run_once())
    await asyncio.wait_for(entered.wait(), 5)
    monkeypatch.undo()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(svc.usecases.journal, "sales", refused)
        assert (await client.sell(dict(late, first_draw=draw), token="ma")).status == 503
    assert held(redis_db, key, "st") == b"f"
    go.set()
    await janitor
    await past_deadline(svc.usecases.janitor).run_once()
    assert [via for kind, via in journaled(svc, late["ticket_id"])] == ["janitor"]
    assert indexed(redis_db) == 0


@pytest.mark.parametrize("waiting", [99, 100])
async def test_entries_that_must_wait_do_not_hide_the_rest_of_their_slot(
        waiting: int, service: tuple[Service, str], client: Client, redis_db: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot holds `waiting` entries the janitor cannot settle (a game no longer
    configured) ahead of a decision of a game still configured, not journaled: the
    janitor reaches it and journals it."""
    svc, _ = service
    stuck = ids_in_slot("fr-retail", 0, waiting, "M")
    (victim,) = ids_in_slot("fr-retail", 0, 1, "V")
    fdj = await client.current()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(svc.usecases.journal, "sales", refused)
        for tid in stuck:
            assert (await client.sell(ticket([{"numbers": TEN[:8], "stake": 200}],
                                             ticket_id=tid, game="minute-keno"))).status == 503
        assert (await client.sell(ticket([{"numbers": TEN, "stake": 500}], ticket_id=victim,
                                         first_draw=fdj))).status == 503
    monkeypatch.delitem(svc.usecases.janitor.catalog.games, "minute-keno")
    for _ in range(2):
        await past_deadline(svc.usecases.janitor).run_once()
    assert [via for _, via in journaled(svc, victim)] == ["janitor"]
    assert indexed(redis_db) == waiting


async def test_a_ticket_voided_here_and_sold_on_another_host_is_balanced(
        settings: Settings, redis_backend: Any, redis_db: Any, tmp_path: Path) -> None:
    """Host A's janitor voids an interrupted sale (journaled by A); the retry is sold by
    host B: the reconciliation posted to A finds it in Redis, sold elsewhere: balanced."""
    variants = [dataclasses.replace(settings, journal_dir=str(tmp_path / name),
                                    one_call_sales=False)  # interrupted between steps
                for name in ("pod-a", "pod-b")]
    started = []
    async with aiohttp.ClientSession() as session:
        try:
            clients = []
            for v in variants:
                svc = build(v, redis_backend.url)
                runner, url = await start_service(svc)
                started.append((runner, svc))
                clients.append(Client(session, url))
            a, b = clients
            svc_a = started[0][1]
            draw = await a.current("lnm-keno")
            body = ticket([{"numbers": TEN[:8], "stake": 250}], game="lnm-keno",
                          player_id="P-7", first_draw=draw)

            async def lost(*args: object, **kwargs: object) -> Any:
                raise Unavailable("redis reply lost")

            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(svc_a.usecases.tickets.steps, "reserve_all", lost)
                assert (await a.sell(body, token="ma")).status == 503
            assert await past_deadline(svc_a.usecases.janitor).run_once() == 1
            sold = await b.sell(body, token="ma")
            assert sold.body["status"] == "accepted"
            export = (f"channel,ticket_id,total_cost\nma-retail,{body['ticket_id']},"
                      f"{sold.body['total_cost']}\n")
            rec = await a.post(f"/v1/games/lnm-keno/draws/{draw}/reconcile?grace=0",
                               data=export.encode(), token="admin")
            assert (rec.body["not_accepted"], rec.body["balanced"], rec.body["elsewhere"]) == (
                [], True, 1)
        finally:
            for runner, svc in started:
                await runner.cleanup()
                await svc.redis.aclose()


def with_game(tmp_path: Path, game: str, every: str, extra: str = "") -> Path:
    """The test configuration with a game drawn every `every` seconds all day (UTC), sold by
    the channel that sells minute-keno; `extra`: more of the game's settings."""
    seconds = int(every.removesuffix("s"))
    text = CONFIG.read_text().replace('games = ["fdj-keno", "minute-keno"]',
                                      f'games = ["fdj-keno", "minute-keno", "{game}"]', 1)
    config = tmp_path / "capsvc.toml"
    config.write_text(f'{text}\n[[games]]\nid = "{game}"\npreset = "fdj-keno-2008"\n'
                      f'draw_every = "{every}"\ndraw_from = "00:00"\n'
                      f'draw_until = "23:59:{60 - seconds:02d}"\ntime_zone = "UTC"\n{extra}')
    return config


@pytest.mark.parametrize("redis_backend", ["standalone"], indirect=True)
async def test_a_short_retention_sale_does_not_expire_the_entries_of_its_slot(
        redis_backend: Any, redis_db: Any, tmp_path: Path) -> None:
    """A game kept 1 s after its draws: its sale does not shorten its slot's index, whose
    entry of another game's decision not journaled stays until the janitor journals it."""
    config = with_game(tmp_path, "quick-keno", "4s", 'retention = "1s"\n')
    settings = dataclasses.replace(load_settings(config), journal_dir=str(tmp_path / "j"))
    svc = build(settings, redis_backend.url)
    runner, url = await start_service(svc)
    try:
        async with aiohttp.ClientSession() as session:
            client = Client(session, url)
            fdj = ticket([{"numbers": TEN, "stake": 500}], first_draw=await client.current())
            slot = slot_of("fr-retail", fdj["ticket_id"])
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(svc.usecases.journal, "sales", refused)
                assert (await client.sell(fdj)).status == 503
            tid = next(f"Q-{i}" for i in range(10**6) if slot_of("fr-retail", f"Q-{i}") == slot)
            assert (await client.sell(ticket([{"numbers": TEN[:8], "stake": 200}],
                                              ticket_id=tid, game="quick-keno"))).status == 200
            await asyncio.sleep(6)  # the quick draw's close and its 1 s retention
            await past_deadline(svc.usecases.janitor).run_once()
            assert [via for _, via in journaled(svc, fdj["ticket_id"])] == ["janitor"]
    finally:
        await runner.cleanup()
        await svc.redis.aclose()


async def test_a_stop_whose_answer_was_not_journaled_is_journaled_by_the_report(
        service: tuple[Service, str], client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """An admin's stop made in Redis whose journal write failed (503, not sent again): the
    draw's report shows it stopped, and journals the stop so that the journal alone has it."""
    svc, _ = service
    draw = await client.current()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(svc.usecases.journal, "stop", refused)
        closing = await client.post(f"/v1/games/fdj-keno/draws/{draw}/close", token="admin")
        assert closing.status == 503
    report = await client.get(f"/v1/games/fdj-keno/draws/{draw}/report", token="admin")
    assert report.body["stopped_at"] is not None
    stops = [r for _, _, r in records(Path(svc.settings.journal_dir))
             if isinstance(r, StopRecord) and r.draw == draw]
    assert [(s.channel, s.game) for s in stops] == [("", "fdj-keno")]


@pytest.fixture
def steps_settings(base_settings: Settings, tmp_path: Path) -> Settings:
    """Sales in steps (as on a cluster, or a game with a daily limit)."""
    return dataclasses.replace(base_settings, journal_dir=str(tmp_path / "journal"),
                               one_call_sales=False)


BUSY_MS = 1000
"""How long Redis runs a script ahead of the clock's TIME: the estimate runs ahead by
about half of it."""
_BUSY = ("local t = redis.call('TIME'); local s = t[1] * 1000000 + t[2]; "
         "while true do local n = redis.call('TIME'); "
         "if n[1] * 1000000 + n[2] - s > tonumber(ARGV[1]) * 1000 then break end end return 1")


@pytest.mark.slow
@pytest.mark.parametrize("redis_backend", ["standalone"], indirect=True)
async def test_a_ticket_claimed_just_before_a_close_keeps_its_draw_from_final(
        steps_settings: Settings, redis_backend: Any, redis_db: Any,
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The process's estimate of Redis TIME runs ~500 ms ahead (read while Redis was busy);
    a sale in steps claimed between the estimate's close and the close, not journaled, is
    indexed at Redis TIME, before the close: the draw is not final, its report not written,
    until the janitor journals the sale."""
    # The estimate is read once, here, and kept (no refresh), as between two readings; a
    # Redis timeout that the busy script does not reach.
    monkeypatch.setattr(server_module, "CLOCK_REFRESH_S", 3600.0)
    config = with_game(tmp_path, "ten-keno", "10s")  # the next close at most 10 s away
    settings = dataclasses.replace(load_settings(config), journal_dir=steps_settings.journal_dir,
                                   one_call_sales=False, redis_timeout_ms=5 * BUSY_MS)
    svc = build(settings, redis_backend.url)
    runner, url = await start_service(svc)
    try:
        async with aiohttp.ClientSession() as session:
            client = Client(session, url)
            game = svc.usecases.audit.catalog.get("ten-keno")
            assert game is not None
            clock = svc.usecases.clock
            draw = game.calendar.current(redis_ms(redis_db))
            close = game.calendar.close_ms(draw)
            if close - redis_ms(redis_db) < 3 * BUSY_MS:
                draw += 1
                close = game.calendar.close_ms(draw)
            await asyncio.sleep(max(0, close - redis_ms(redis_db) - 2 * BUSY_MS) / 1000)
            # The clock's TIME queued behind the script on the service's one connection:
            # Redis answers it at the end of a round trip of BUSY_MS or more.
            busy = svc.redis.submit("EVAL", _BUSY, 0, BUSY_MS)
            await clock.sync()
            assert await busy == 1
            ahead = clock.now() - redis_ms(redis_db)
            if ahead <= BUSY_MS // 4:
                pytest.skip(f"precondition: the estimate ahead by more than {BUSY_MS // 4} ms; "
                            f"{ahead} ms (TIME's reply took {BUSY_MS - 2 * ahead} ms or more "
                            "to reach the process: the machine too slow)")
            await asyncio.sleep(max(0, close - redis_ms(redis_db) - ahead // 2) / 1000)
            body = ticket([{"numbers": TEN, "stake": 500}], game="ten-keno",
                          first_draw=draw)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(svc.usecases.journal, "sales", refused)
                before = redis_ms(redis_db)
                sold = await client.sell(body)
                after = redis_ms(redis_db)
            if not close - ahead <= before <= after < close:
                pytest.skip(f"precondition: the sale within the {ahead} ms before the close "
                            f"when the estimate says it has passed; sent {close - before} ms "
                            f"before it, answered {close - after} ms before it (the machine "
                            "too slow)")
            assert sold.status == 503
            key = ticket_key("fr-retail", body["ticket_id"])
            assert int(held(redis_db, key, "at")) < close
            settle = settings.pending_deadline_ms + 2 * settings.janitor_interval_ms
            await asyncio.sleep(max(0, close + settle + 500 - redis_ms(redis_db)) / 1000)
            assert indexed(redis_db) == 1
            assert await svc.usecases.audit.last_final(game) < draw
            await svc.usecases.audit.write_due()
            report = Path(settings.journal_dir) / "reports" / "ten-keno"
            assert not (report / f"{draw}.json").exists()
            await past_deadline(svc.usecases.janitor).run_once()
            assert await svc.usecases.audit.last_final(game) >= draw
            await svc.usecases.audit.write_due()
            written = json.loads((report / f"{draw}.json").read_text())
            assert (written["final"], written["tickets"]["accepted"]) == (True, 1)
    finally:
        await runner.cleanup()
        await svc.redis.aclose()
