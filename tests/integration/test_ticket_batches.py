"""`POST /v1/ticket-batches` (API.md): several sales in one request, each judged exactly as
if it had been sent alone, one result per ticket in order; whole-request problems answered
as usual. On a standalone Redis (one call per ticket) and a cluster (the steps)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from capsvc.client.models import TicketIn
from capsvc.config import Settings
from capsvc.domain import combination
from capsvc.domain.errors import Unavailable
from capsvc.http.server import Service, build
from capsvc.journal.reader import records
from capsvc.journal.records import SaleRecord
from capsvc.redis.cluster import slot_of
from capsvc.redis.marks import NODE_MARK, mark_of_slot
from capsvc.redis.store import bucket_keys, ticket_key
from capsvc.service.tickets import SaleOutcome, Tickets
from tests.conftest import TEN, Client, start_service, ticket
from tests.support.faults import functions_of

BATCHES = "/v1/ticket-batches"


async def test_each_result_is_what_the_ticket_alone_would_have_been_answered(
        client: Client) -> None:
    """A sale, a rule broken, a schema broken, one refused by the cap, one that fits: five
    results in order with the single route's statuses and bodies; the batch sent again
    answers the decisions as replays, byte for byte as POST /v1/tickets does."""
    draw = await client.current()
    eight, other = TEN[:8], TEN[2:]
    for stake in (1000, 1000, 1000, 1000, 500):
        assert (await client.sell(ticket([{"numbers": eight, "stake": stake}],
                                         first_draw=draw))).status == 200
    tickets: list[dict[str, Any]] = [
        ticket([{"numbers": other, "stake": 300}], first_draw=draw),
        ticket([{"numbers": eight, "stake": 123}], first_draw=draw),
        {"ticket_id": "B-schema", "game": "fdj-keno", "grids": "none"},
        ticket([{"numbers": eight, "stake": 1000}], first_draw=draw),
        ticket([{"numbers": eight, "stake": 500}], first_draw=draw),
    ]
    reply = await client.post(BATCHES, {"tickets": tickets})
    assert reply.status == 200, reply.body
    results = reply.body["results"]
    assert [r["status"] for r in results] == [200, 422, 422, 200, 200]
    assert results[1]["body"]["error"]["code"] == "stake_not_allowed"
    assert results[1]["body"]["error"]["path"] == "$.grids[0].stake"
    assert results[2]["body"]["error"]["code"] == "invalid_request"
    assert "replayed" not in results[1]
    assert [results[i]["body"]["status"] for i in (0, 3, 4)] == [
        "accepted", "rejected", "accepted"]
    assert [results[i]["replayed"] for i in (0, 3, 4)] == [False, False, False]
    assert await client.staked(eight, draw) == 5000
    assert await client.staked(other, draw) == 300

    again = await client.post(BATCHES, {"tickets": tickets})
    assert [r["status"] for r in again.body["results"]] == [200, 422, 422, 200, 200]
    for i in (0, 3, 4):
        assert again.body["results"][i]["replayed"] is True
        assert again.body["results"][i]["body"] == results[i]["body"]
        alone = await client.sell(tickets[i])
        assert alone.status == 200
        assert alone.headers.get("Idempotent-Replayed") == "true"
        assert json.loads(alone.raw) == results[i]["body"]
    assert await client.staked(eight, draw) == 5000


async def test_whole_request_problems_answer_as_usual(client: Client) -> None:
    """No token: 401; not JSON: 400; an empty list, or more than max_batch: 422 on
    $.tickets; one ticket id twice: 422 naming the second; nothing sold."""
    draw = await client.current()
    one = ticket([{"numbers": TEN[:8], "stake": 500}], first_draw=draw)
    assert (await client.post(BATCHES, {"tickets": [one]}, token=None)).status == 401
    bad = await client.request("POST", BATCHES, data=b"{not json",
                               headers={"Content-Type": "application/json"})
    assert bad.status == 400
    empty = await client.post(BATCHES, {"tickets": []})
    assert (empty.status, empty.body["error"]["path"]) == (422, "$.tickets")
    many = await client.post(BATCHES, {"tickets": [
        ticket([{"numbers": TEN[:8], "stake": 100}], first_draw=draw) for _ in range(257)]})
    assert many.status in (413, 422)  # the body's size limit may come first
    twice = await client.post(BATCHES, {"tickets": [one, dict(one)]})
    assert twice.status == 422
    assert twice.body["error"]["path"] == "$.tickets[1].ticket_id"
    assert (await client.get(f"/v1/tickets/{one['ticket_id']}")).status == 404
    assert await client.staked(TEN[:8], draw) == 0


async def test_a_token_without_the_sell_scope_is_refused_for_the_whole_batch(
        client: Client) -> None:
    """A token that may read but not sell: 403 for the request, as on every other route
    (the scope is the token's, not a ticket's); nothing sold."""
    draw = await client.current()
    tickets = [ticket([{"numbers": TEN[:8], "stake": 100}], first_draw=draw)
               for _ in range(2)]
    reply = await client.post(BATCHES, {"tickets": tickets}, token="read")
    assert (reply.status, reply.body["error"]["code"]) == (403, "forbidden")
    assert await client.staked(TEN[:8], draw) == 0


async def test_a_batch_counts_its_tickets_and_its_size_in_the_metrics(client: Client) -> None:
    """capsvc_tickets_total counts each ticket decided, as for single sales; the batch's
    size goes to capsvc_ticket_batch_size."""
    draw = await client.current()
    tickets = [ticket([{"numbers": TEN[i:i + 8], "stake": 100}], first_draw=draw)
               for i in range(3)]
    assert (await client.post(BATCHES, {"tickets": tickets})).status == 200
    metrics = (await client.get("/metrics", token=None)).raw.decode()
    assert "capsvc_ticket_batch_size_count" in metrics
    counted = [line for line in metrics.splitlines()
               if line.startswith('capsvc_tickets_total{game="fdj-keno",status="accepted"}')]
    assert counted
    assert float(counted[0].split()[-1]) >= 3


async def test_a_batch_is_journaled_as_answered_in_one_line(
        service: tuple[Service, str], client: Client) -> None:
    """Tickets of every shape sold together (accepted, refused by the cap, partial, not
    capped, with the multiplier, with Joker+, a subscription): the journal gives back each
    decision byte for byte as answered; on a standalone Redis (one call) they are one
    `sales` line."""
    svc, _ = service
    channel = next(c for c in svc.settings.channels if c.id == "fr-retail")
    draw = await client.current()
    eight, nine = TEN[:8], TEN[:9]
    for stake in (1000, 1000, 1000, 1000, 500, 300):  # 4,800 of 5,000
        assert (await client.sell(ticket([{"numbers": eight, "stake": stake}],
                                         first_draw=draw))).status == 200
    bodies = [
        ticket([{"numbers": TEN[2:], "stake": 300}], first_draw=draw),
        ticket([{"numbers": eight, "stake": 500}], first_draw=draw),
        ticket([{"numbers": eight, "stake": 300}, {"numbers": nine, "stake": 200,
                                                   "multiplier": True}], first_draw=draw),
        ticket([{"numbers": [1, 2, 3], "stake": 200}, {"numbers": nine, "stake": 100}],
               first_draw=draw, joker_plus=True),
        ticket([{"numbers": TEN[1:9], "stake": 100}], first_draw=draw, draws=5),
        ticket([{"numbers": [5, 6, 7, 8], "stake": 100}], ticket_id="a.b:c-_1",
               first_draw=draw),
    ]
    before = {name: len(lines) for name, lines in _lines(Path(svc.settings.journal_dir)).items()}
    outcomes = await svc.usecases.tickets.sell(
        channel, [msgspec.convert(b, TicketIn) for b in bodies])
    answered = {}
    for body, outcome in zip(bodies, outcomes, strict=True):
        assert isinstance(outcome, SaleOutcome), outcome
        answered[body["ticket_id"]] = outcome.body
    statuses = [json.loads(answered[b["ticket_id"]])["status"] for b in bodies]
    assert statuses == ["accepted", "rejected", "partial", "accepted", "accepted", "accepted"]
    found = {r.ticket: bytes(r.decision)
             for _, _, r in records(Path(svc.settings.journal_dir))
             if isinstance(r, SaleRecord) and r.ticket in answered and r.via == "answer"}
    assert found == answered
    if svc.store.single_node:
        new = _lines(Path(svc.settings.journal_dir), after=before)
        kinds = [json.loads(line)["type"] for lines in new.values() for line in lines]
        assert [k for k in kinds if k not in ("marks", "cap")] == ["sales"]


def _lines(directory: Path, after: dict[str, int] | None = None) -> dict[str, list[bytes]]:
    """The journal's lines, by file (those past `after`'s counts)."""
    return {path.name: path.read_bytes().splitlines()[(after or {}).get(path.name, 0):]
            for path in directory.glob("capsvc-*.jsonl")}


@pytest.mark.parametrize("redis_backend", ["standalone"], indirect=True)
async def test_a_ticket_that_moves_on_is_judged_before_the_batch_s_later_tickets(
        client: Client) -> None:
    """The current draw stopped by an admin; one combination at 4,500 of 5,000 on the next.
    A batch [T0: no first draw (moves on to the next), T1: the next draw], each 500 on that
    combination: T0 takes the room and T1 is refused, as sent alone in that order (sales in
    one call: the call leaves T1 to be judged after T0 has moved on)."""
    draw = await client.current()
    assert (await client.post(f"/v1/games/fdj-keno/draws/{draw}/close",
                              token="admin")).status == 200
    eight = TEN[:8]
    for stake in (1000, 1000, 1000, 1000, 500):
        assert (await client.sell(ticket([{"numbers": eight, "stake": stake}],
                                         first_draw=draw + 1))).status == 200
    t0 = ticket([{"numbers": eight, "stake": 500}])
    t1 = ticket([{"numbers": eight, "stake": 500}], first_draw=draw + 1)
    reply = await client.post(BATCHES, {"tickets": [t0, t1]})
    assert reply.status == 200, reply.body
    bodies = [r["body"] for r in reply.body["results"]]
    assert [(b["draws"], b["status"]) for b in bodies] == [
        ([draw + 1], "accepted"), ([draw + 1], "rejected")]


@pytest.mark.parametrize("redis_backend", ["standalone"], indirect=True)
async def test_a_request_is_answered_once_its_own_calls_are_done(
        service: tuple[Service, str], client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two batches of 64 reaching a worker in one event-loop tick are sold in two calls;
    the first is answered as soon as its call is done, while the second's is still held
    (the tick's last call does not hold every request of the tick back)."""
    svc, _ = service
    channel = next(c for c in svc.settings.channels if c.id == "fr-retail")
    draw = await client.current()
    release = asyncio.Event()
    calls: list[str] = []
    sell_group = Tickets._sell_group

    async def held(self: Tickets, group: list[Any], continues: bool = False) -> Any:
        calls.append(group[0].ticket.ticket_id)
        if group[0].ticket.ticket_id.startswith("L-"):
            await release.wait()
        return await sell_group(self, group, continues)

    monkeypatch.setattr(Tickets, "_sell_group", held)

    def batch(prefix: str) -> list[TicketIn]:
        return [msgspec.convert(ticket([{"numbers": [*range(1, 8), 8 + i % 60], "stake": 100}],
                                       ticket_id=f"{prefix}-{i}", first_draw=draw + i // 60),
                                TicketIn) for i in range(64)]

    early = asyncio.ensure_future(svc.usecases.tickets.sell(channel, batch("E")))
    late = asyncio.ensure_future(svc.usecases.tickets.sell(channel, batch("L")))
    answered = await asyncio.wait_for(early, 10)
    assert calls == ["E-0", "L-0"]  # one tick, two calls
    assert all(isinstance(o, SaleOutcome) for o in answered)
    assert not late.done()
    release.set()
    assert all(isinstance(o, SaleOutcome) for o in await asyncio.wait_for(late, 10))


@pytest.mark.parametrize("redis_backend", ["cluster"], indirect=True)
async def test_a_batch_whose_step_failed_on_one_node_is_settled_by_another_process(
        settings: Settings, redis_backend: Any, redis_db: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a Redis Cluster a batch's reserves go one call a node. The answer of the call
    that carried them to one node is lost (it ran): the tickets whose grids it carried are
    answered 503 (outcome unknown), the others are decided. The same batch sent again
    through a second process: the decided tickets answer their decisions byte for byte,
    the others are settled (their claims resumed, their reserves' records found, not
    counted again), and every counter holds each accepted stake once."""
    started = []
    async with aiohttp.ClientSession() as session:
        try:
            clients = []
            for name in ("a", "b"):
                svc = build(dataclasses.replace(settings, journal_dir=str(tmp_path / name)),
                            redis_backend.url)
                runner, url = await start_service(svc)
                started.append((runner, svc))
                clients.append(Client(session, url))
            a, b = clients
            store = started[0][1].store
            draw = await a.current()
            grids = [sorted(random.Random(i).sample(range(1, 71), 8)) for i in range(24)]
            victim = store.redis.node_of(
                bucket_keys("fdj-keno", combination.encode(grids[0]), draw, 1)[0])
            submit = store.redis.submit_partly_declared
            lost: list[Any] = []

            def losing(*args: Any) -> asyncio.Future[Any]:
                ran = submit(*args)
                if (lost or args[1] != "capsvc_calls" or args[4] != victim
                        or "capsvc_reserve" not in functions_of(args)):
                    return ran
                lost.append(args)
                answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

                def drop(done: asyncio.Future[Any]) -> None:
                    assert not done.cancelled()
                    assert done.exception() is None  # it ran
                    answer.set_exception(Unavailable("redis: the connection was lost"))

                ran.add_done_callback(drop)
                return answer

            monkeypatch.setattr(store.redis, "submit_partly_declared", losing)
            tickets = [ticket([{"numbers": g, "stake": 500}], first_draw=draw) for g in grids]
            first = await a.post(BATCHES, {"tickets": tickets})
            assert first.status == 200
            statuses = [r["status"] for r in first.body["results"]]
            assert lost
            assert 503 in statuses, statuses
            assert 200 in statuses, statuses
            again = await b.post(BATCHES, {"tickets": tickets})
            assert [r["status"] for r in again.body["results"]] == [200] * len(tickets)
            for before, after in zip(first.body["results"], again.body["results"],
                                     strict=True):
                if before["status"] == 200:
                    assert after["body"] == before["body"]
                assert after["body"]["status"] == "accepted"
            for g in grids:
                assert await a.staked(g, draw) == 500
        finally:
            for runner, svc in started:
                await runner.cleanup()
                await svc.redis.aclose()


async def test_each_ticket_of_a_batch_is_stamped_with_its_own_calls(
        service: tuple[Service, str], client: Client) -> None:
    """Each decision journaled carries the G of the calls that made or reported it (what a
    restore checks Redis still holds; a `sales` line carries the highest of its sales'):
    a replay in a batch, reported from what its first call read, carries that call's; on a
    Redis Cluster each sale carries the marks of its own calls, its ticket's slot's and its
    grid's counters' slot's."""
    svc, _ = service
    draw = await client.current()
    known = ticket([{"numbers": TEN[:8], "stake": 200}], first_draw=draw)
    assert (await client.sell(known)).status == 200
    grids = [sorted(random.Random(100 + i).sample(range(1, 71), 8)) for i in range(8)]
    fresh = [ticket([{"numbers": g, "stake": 200}], first_draw=draw) for g in grids]
    reply = await client.post(BATCHES, {"tickets": [known, *fresh]})
    assert [r["status"] for r in reply.body["results"]] == [200] * 9
    stamped = {(r.ticket, r.via): r.marks for _, _, r in records(Path(svc.settings.journal_dir))
               if isinstance(r, SaleRecord)}
    replay = stamped[(known["ticket_id"], "replay")]
    assert replay
    assert all(g > 0 for g in replay.values())
    for body, grid in zip(fresh, grids, strict=True):
        marks = stamped[(body["ticket_id"], "answer")] or {}
        own = {NODE_MARK} if svc.store.single_node else {mark_of_slot(slot_of(key)) for key in (
            ticket_key("fr-retail", body["ticket_id"]),
            bucket_keys("fdj-keno", combination.encode(grid), draw, 1)[0])}
        assert own <= set(marks), (marks, own)
        assert all(marks[mark] > 0 for mark in own)
