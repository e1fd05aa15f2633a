"""Every decision Redis holds reaches the journal: a ticket stays in its pending index until
its decision is journaled, and the janitor journals what a dying request left; on a
standalone Redis (sales in one call) and a Redis Cluster (sales in steps)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis
from msgspec import msgpack

from capsvc.domain.errors import Unavailable
from capsvc.http.server import Service
from capsvc.journal.reader import records
from capsvc.journal.records import CancelRecord, SaleRecord, VoidRecord
from capsvc.redis.store import (
    TICKET_BUCKETS,
    UNJOURNALED,
    lua_source,
    pending_key,
    ticket_key,
)
from tests.conftest import TEN, Client, past_deadline, ticket
from tests.records import held


def indexed(db: Any) -> int:
    """Tickets the janitor would journal: the pending indexes' entries, and the sales of
    the entries of the unjournaled sales (one call's sales an entry)."""
    sales = sum(len(msgpack.decode(v)[1]) for v in db.hvals(UNJOURNALED))
    return sales + sum(db.zcard(pending_key(b)) for b in range(TICKET_BUCKETS))


async def entries_gone(db: Any) -> int:
    """The index entries left once the requests' releases have reached Redis (sent at the
    end of the tick that journaled them, nobody waiting: up to a second is given)."""
    for _ in range(50):
        if indexed(db) == 0:
            return 0
        await asyncio.sleep(0.02)
    return indexed(db)


def journaled(svc: Service, ticket_id: str) -> list[tuple[str, str]]:
    """(record type, via) of each record of the ticket in the service's journal."""
    return [("cancel" if isinstance(r, CancelRecord) else "sale", r.via)
            for _, _, r in records(Path(svc.settings.journal_dir))
            if isinstance(r, SaleRecord) and r.ticket == ticket_id]


async def test_a_decision_its_process_did_not_journal_is_journaled_by_the_janitor(
        service: tuple[Service, str], client: Client, redis_db: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis decided the sale, the journal refused it (the answer: 503), nobody retries:
    the ticket stays indexed, and the janitor journals the decision past the deadline."""
    svc, _ = service
    draw = await client.current()
    body = ticket([{"numbers": TEN, "stake": 500}], first_draw=draw)

    def refused(*args: object, **kwargs: object) -> Any:
        raise Unavailable("the journal could not be written")

    monkeypatch.setattr(svc.usecases.journal, "sales", refused)
    assert (await client.sell(body)).status == 503
    monkeypatch.undo()
    assert await client.staked(TEN, draw) == 500
    assert journaled(svc, body["ticket_id"]) == []
    assert indexed(redis_db) == 1
    assert await svc.usecases.janitor.run_once() == 0  # not due yet
    assert await past_deadline(svc.usecases.janitor).run_once() == 1
    assert journaled(svc, body["ticket_id"]) == [("sale", "janitor")]
    assert indexed(redis_db) == 0


async def test_a_replay_of_a_ticket_being_cancelled_leaves_its_cancel_to_the_janitor(
        service: tuple[Service, str], client: Client, redis_db: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancel decided whose release failed (503): a replay of the sale answers the
    decision and leaves the ticket indexed, so the janitor still finishes the cancel and
    journals it."""
    svc, _ = service
    draw = await client.current()
    body = ticket([{"numbers": TEN, "stake": 500}], first_draw=draw)
    assert (await client.sell(body)).status == 200

    async def lost(*args: object, **kwargs: object) -> None:
        raise Unavailable("the release was lost")

    monkeypatch.setattr(svc.store, "cancelled", lost)
    assert (await client.post(f"/v1/tickets/{body['ticket_id']}/cancel")).status == 503
    monkeypatch.undo()
    replay = await client.sell(body)
    assert (replay.status, replay.headers["Idempotent-Replayed"]) == (200, "true")
    assert indexed(redis_db) == 1
    assert await past_deadline(svc.usecases.janitor).run_once() == 1
    got = await client.get(f"/v1/tickets/{body['ticket_id']}")
    assert got.body["cancelled"]["released"] == 500
    assert await client.staked(TEN, draw) == 0
    assert ("cancel", "janitor") in journaled(svc, body["ticket_id"])
    assert indexed(redis_db) == 0


async def test_sales_cancels_and_replays_leave_no_index_entry_behind(
        service: tuple[Service, str], client: Client, redis_db: redis.Redis) -> None:
    """Once each decision is journaled, its entry goes: after sales, a replay, a rejection
    and a cancel, the pending indexes are empty (memory scanned)."""
    draw = await client.current()
    sold = ticket([{"numbers": TEN, "stake": 1000}], first_draw=draw)
    assert (await client.sell(sold)).status == 200
    assert (await client.sell(sold)).headers["Idempotent-Replayed"] == "true"
    for _ in range(5):
        await client.sell(ticket([{"numbers": TEN, "stake": 1000}], first_draw=draw))
    assert (await client.post(f"/v1/tickets/{sold['ticket_id']}/cancel")).status == 200
    assert await entries_gone(redis_db) == 0


async def test_a_library_without_the_batched_release_is_replaced_and_entries_still_go(
        service: tuple[Service, str], client: Client, redis_db: redis.Redis) -> None:
    """An older library, without capsvc_journaled_many, was loaded last (`FUNCTION LOAD
    REPLACE`): the first release is refused as unknown, the transport loads this library and
    sends it again; no entry is left, nothing journaled twice."""
    svc, _ = service
    source = lua_source()
    older = source.replace(
        "register('capsvc_journaled_many', journaled_many, CROSS_SLOT)\n", "")
    assert older != source
    await svc.store.redis.broadcast("FUNCTION", "LOAD", "REPLACE", older)
    draw = await client.current()
    sold = [ticket([{"numbers": TEN, "stake": 100}], first_draw=draw) for _ in range(5)]
    for body in await asyncio.gather(*(client.sell(b) for b in sold)):
        assert body.status == 200
    assert await entries_gone(redis_db) == 0
    assert await svc.store.library_loaded()
    assert await past_deadline(svc.usecases.janitor).run_once() == 0
    assert [journaled(svc, b["ticket_id"]) for b in sold] == [[("sale", "answer")]] * 5


# -- the entry goes only while the ticket holds what was journaled -----------------------


def refuse_journal(monkeypatch: pytest.MonkeyPatch, recorder: Any, method: str) -> None:
    def refused(*args: object, **kwargs: object) -> Any:
        raise Unavailable("the journal could not be written")

    monkeypatch.setattr(recorder, method, refused)


async def test_a_cancel_refused_as_closed_leaves_an_unjournaled_decision_to_the_janitor(
        service: tuple[Service, str], client: Client, redis_db: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A sale decided but not journaled, its draw then stopped, a cancel refused (409): the
    ticket stays indexed and the janitor journals the decision."""
    svc, _ = service
    draw = await client.current()
    body = ticket([{"numbers": TEN, "stake": 500}], first_draw=draw)
    refuse_journal(monkeypatch, svc.usecases.journal, "sales")
    assert (await client.sell(body)).status == 503
    monkeypatch.undo()
    assert (await client.post(f"/v1/games/fdj-keno/draws/{draw}/close",
                              token="admin")).status == 200
    assert (await client.post(f"/v1/tickets/{body['ticket_id']}/cancel")).status == 409
    await past_deadline(svc.usecases.janitor).run_once()
    assert await client.staked(TEN, draw) == 500
    assert journaled(svc, body["ticket_id"]) == [("sale", "janitor")]
    assert indexed(redis_db) == 0


async def test_a_cancel_interrupted_while_the_janitor_journals_a_sale_is_still_finished(
        service: tuple[Service, str], client: Client, redis_db: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The janitor journals a decision its request left; meanwhile another process decides
    a cancel of the ticket and loses its release: the cancel's entry stays, and the janitor
    finishes the cancel (stake given back)."""
    svc, _ = service
    draw = await client.current()
    body = ticket([{"numbers": TEN, "stake": 500}], first_draw=draw)
    journal, ledger = svc.usecases.journal, svc.usecases.tickets.steps
    original_sale, original_give_back = journal.sales, ledger.give_back
    refuse_journal(monkeypatch, journal, "sales")
    assert (await client.sell(body)).status == 503
    monkeypatch.undo()

    async def lost(*args: object, **kwargs: object) -> None:
        raise Unavailable("the cancel's release never ran")

    def journals_slowly(*args: Any, **kwargs: Any) -> asyncio.Future[None]:
        async def slow() -> None:
            ledger.give_back = lost  # type: ignore[method-assign]
            try:
                assert (await client.post(
                    f"/v1/tickets/{body['ticket_id']}/cancel")).status == 503
            finally:
                ledger.give_back = original_give_back  # type: ignore[method-assign]
            await original_sale(*args, **kwargs)
        return asyncio.ensure_future(slow())

    monkeypatch.setattr(journal, "sales", journals_slowly)
    settled = await past_deadline(svc.usecases.janitor).run_once()
    monkeypatch.undo()
    key = ticket_key("fr-retail", body["ticket_id"])
    if held(redis_db, key, "st") == b"k":  # the cancel's entry not reached that round
        settled += await past_deadline(svc.usecases.janitor).run_once()
    assert settled == 2  # the sale journaled, the cancel finished
    assert (held(redis_db, key, "st"), await client.staked(TEN, draw)) == (b"c", 0)
    assert indexed(redis_db) == 0


async def test_a_cancel_interrupted_during_a_replay_is_still_finished(
        service: tuple[Service, str], client: Client, redis_db: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """While a replay of a sale is being journaled, another process decides a cancel and
    loses its release: the replay leaves the entry (the ticket moved on), the janitor
    finishes the cancel and journals it."""
    svc, _ = service
    draw = await client.current()
    body = ticket([{"numbers": TEN, "stake": 500}], first_draw=draw)
    assert (await client.sell(body)).status == 200
    journal, ledger = svc.usecases.journal, svc.usecases.tickets.steps
    original_ticket, original_give_back = journal.ticket, ledger.give_back

    async def lost(*args: object, **kwargs: object) -> None:
        raise Unavailable("the cancel's release never ran")

    def replay_journaled_slowly(*args: Any, **kwargs: Any) -> asyncio.Future[None]:
        async def slow() -> None:
            ledger.give_back = lost  # type: ignore[method-assign]
            try:
                reply = await client.post(f"/v1/tickets/{body['ticket_id']}/cancel")
                assert reply.status == 503, reply.body
            finally:
                ledger.give_back = original_give_back  # type: ignore[method-assign]
            await original_ticket(*args, **kwargs)
        return asyncio.ensure_future(slow())

    monkeypatch.setattr(journal, "ticket", replay_journaled_slowly)
    replay = await client.sell(body)
    monkeypatch.undo()
    assert (replay.status, replay.headers.get("Idempotent-Replayed")) == (200, "true")
    await asyncio.sleep(0.3)  # the replay's removal of the entry has run (or not)
    key = ticket_key("fr-retail", body["ticket_id"])
    assert held(redis_db, key, "st") == b"k"
    await past_deadline(svc.usecases.janitor).run_once()
    assert (held(redis_db, key, "st"), await client.staked(TEN, draw)) == (b"c", 0)
    assert ("cancel", "janitor") in journaled(svc, body["ticket_id"])
    assert indexed(redis_db) == 0


async def test_a_void_whose_journal_write_failed_is_settled_and_journaled_again(
        service: tuple[Service, str], client: Client, redis_db: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Sales in steps: a sale interrupted before its grids were decided is voided by the
    janitor; if the void cannot be journaled the ticket stays (given back, indexed), and the
    next round voids it again and journals it."""
    svc, _ = service
    if svc.store.single_node:
        pytest.skip("a sale in one call is never left undecided")
    draw = await client.current()
    body = ticket([{"numbers": TEN, "stake": 500}], first_draw=draw)

    async def lost(*args: object, **kwargs: object) -> Any:
        raise Unavailable("redis reply lost")

    monkeypatch.setattr(svc.usecases.tickets.steps, "reserve_all", lost)
    assert (await client.sell(body)).status == 503
    monkeypatch.undo()
    refuse_journal(monkeypatch, svc.usecases.journal, "void")
    with pytest.raises(Unavailable):
        await past_deadline(svc.usecases.janitor).run_once()
    monkeypatch.undo()
    assert indexed(redis_db) == 1
    await past_deadline(svc.usecases.janitor).run_once()
    voids = [r for _, _, r in records(Path(svc.settings.journal_dir))
             if isinstance(r, VoidRecord) and r.ticket == body["ticket_id"]]
    assert [v.why for v in voids] == ["abandoned"]
    assert (await client.get(f"/v1/tickets/{body['ticket_id']}")).status == 404
    assert await client.staked(TEN, draw) == 0
    assert indexed(redis_db) == 0
