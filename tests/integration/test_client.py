"""capsvc.client against the real service: typed decisions and
errors, a sale whose answer was lost sent again until decided (counted once), a deadline
passed without a decision is OutcomeUnknown and the ticket is then exactly one of "never
counted" or "decided", never a 4xx sent again; the blocking client for scripts."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from capsvc.client import (
    AuthError,
    CapsvcError,
    Client,
    ConflictError,
    NotFoundError,
    OutcomeUnknown,
    SyncClient,
    TicketOut,
    ValidationError,
)
from capsvc.domain.errors import Unavailable
from capsvc.http.server import Service
from tests.conftest import CONFIG, TEN, TOKENS, ticket
from tests.conftest import Client as Http
from tests.support.service import ServiceProcess, served


async def test_sell_look_up_and_cancel_with_typed_decisions_and_errors(
        service: tuple[Service, str], client: Http) -> None:
    """A sale, its look-up and its cancel come back as the service's types; a stake not
    allowed, a reused id, an unknown token and an unknown ticket raise their own errors."""
    _, url = service
    draw = await client.current()
    body = ticket([{"numbers": TEN, "stake": 500}], first_draw=draw)
    async with Client(url, TOKENS["fr"]) as c:
        sold = await c.sell(body)
        assert isinstance(sold, TicketOut)
        assert (sold.status, sold.total_cost) == ("accepted", 500)
        assert (await c.ticket(body["ticket_id"])).receipt == sold.receipt
        assert (await c.cancel(body["ticket_id"])).released == 500
        assert (await c.ticket(body["ticket_id"])).cancelled is not None
        with pytest.raises(ValidationError) as bad:
            await c.sell(ticket([{"numbers": TEN, "stake": 700}], first_draw=draw))
        assert (bad.value.status, bad.value.code) == (422, "stake_not_allowed")
        with pytest.raises(ConflictError):
            await c.sell(dict(body, grids=[{"numbers": TEN[:8], "stake": 100}]))
        with pytest.raises(NotFoundError):
            await c.ticket("never-sold")
        assert (await c.current_draw("fdj-keno")).draw == draw
        assert (await c.combination("fdj-keno", draw, TEN)).staked == 0
    async with Client(url, "not-a-token") as c:
        with pytest.raises(AuthError):
            await c.games()


async def test_a_sale_whose_answer_was_lost_is_sent_again_and_counted_once(
        service: tuple[Service, str], client: Http, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first two answers are 503 after Redis decided (outcome unknown): the client
    sends the same request again and returns the one decision, counted once."""
    svc, url = service
    draw = await client.current()
    original, failures = svc.usecases.journal.sales, [2]

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if failures[0]:
            failures[0] -= 1
            raise Unavailable("the answer was lost")
        return original(*args, **kwargs)

    monkeypatch.setattr(svc.usecases.journal, "sales", flaky)
    body = ticket([{"numbers": TEN, "stake": 500}], first_draw=draw)
    async with Client(url, TOKENS["fr"], backoff_s=0.01) as c:
        sold = await c.sell(body)
    assert (sold.status, failures[0]) == ("accepted", 0)
    assert await client.staked(TEN, draw) == 500


async def test_no_decision_before_the_deadline_is_outcome_unknown_never_a_guess(
        service: tuple[Service, str], client: Http, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every answer a 503: OutcomeUnknown carrying the ticket id, within the deadline; the
    ticket is then decided (Redis counted it; a look-up answers it) or never counted."""
    svc, url = service
    draw = await client.current()

    def down(*args: Any, **kwargs: Any) -> Any:
        raise Unavailable("the journal cannot be written")

    monkeypatch.setattr(svc.usecases.journal, "sales", down)
    body = ticket([{"numbers": TEN, "stake": 500}], first_draw=draw)
    async with Client(url, TOKENS["fr"], backoff_s=0.01) as c:
        with pytest.raises(OutcomeUnknown) as unknown:
            await c.sell(body, deadline_s=2.5)  # Retry-After: 1 s, honoured
        assert unknown.value.ticket_id == body["ticket_id"]
        assert unknown.value.attempts > 1
        monkeypatch.undo()
        decided = await c.ticket(body["ticket_id"])
    assert (decided.status, await client.staked(TEN, draw)) == ("accepted", 500)


@pytest.fixture
def live() -> Iterator[ServiceProcess]:
    with served(str(CONFIG)) as service:
        yield service


def test_the_blocking_client_sells_and_cancels_for_a_script(live: ServiceProcess) -> None:
    """SyncClient: the same methods, blocking, one pool; closed by its `with`."""
    with SyncClient(live.base_url, TOKENS["fr"]) as c:
        draw = c.current_draw("fdj-keno").draw
        body = ticket([{"numbers": TEN, "stake": 200}], first_draw=draw)
        assert c.sell(body).status == "accepted"
        assert c.cancel(body["ticket_id"]).released == 200
        with pytest.raises(ValidationError):
            c.sell(ticket([{"numbers": TEN, "stake": 7}], first_draw=draw))


async def test_players_and_a_draws_report_through_the_client(
        service: tuple[Service, str], client: Http) -> None:
    """A player's limit set and read, another game's stake recorded once (same ref twice),
    and the report of the draw on sale, as the service's types."""
    _, url = service
    async with Client(url, TOKENS["ma"]) as c:
        assert (await c.set_limit("P-CL", 1000)).self_limit == 1000
        first = await c.record_stake("P-CL", "loto-1", "loto", 400)
        again = await c.record_stake("P-CL", "loto-1", "loto", 400)
        assert (first.status, first.remaining, again.remaining) == ("accepted", 600, 600)
        assert (await c.player("P-CL")).spent == 400
    draw = await client.current()
    async with Client(url, TOKENS["admin"]) as c:
        report = await c.report("fdj-keno", draw)
        assert (report.draw, report.final) == (draw, False)


async def test_the_feed_resumes_across_a_restart_missing_and_repeating_nothing(
        live: ServiceProcess, tmp_path: Path) -> None:
    """capped_events: a snapshot, then each combination capped once: one before the
    service is restarted, one while it is down (sold by another service on the same Redis),
    one after; the iterator reconnects with Last-Event-ID and yields each exactly once."""
    other = ServiceProcess(str(CONFIG), live.redis_url).start()
    hot = [[1, 2, 3, 4, 5, 6, 7, n] for n in (8, 9, 10)]
    try:
        async with Client(live.base_url, TOKENS["fr"], backoff_s=0.05) as c:
            draw = (await c.current_draw("fdj-keno")).draw
            events: list[Any] = []
            arrived = asyncio.Event()

            async def follow() -> None:
                async for event in c.capped_events("fdj-keno", draw=draw):
                    events.append(event)
                    arrived.set()

            async def cap(url: str, numbers: list[int]) -> None:
                async with Client(url, TOKENS["fr"]) as seller:
                    for stake in (1000,) * 5:
                        await seller.sell(ticket([{"numbers": numbers, "stake": stake}],
                                                 first_draw=draw))

            async def seen(n: int) -> None:
                while sum(e.kind == "capped" for e in events) < n:
                    arrived.clear()
                    await arrived.wait()

            task = asyncio.create_task(follow())
            await cap(live.base_url, hot[0])
            await asyncio.wait_for(seen(1), 10)
            live.stop()
            await cap(other.base_url, hot[1])
            live.start()
            await cap(live.base_url, hot[2])
            await asyncio.wait_for(seen(3), 20)
            task.cancel()
        kinds = [e.kind for e in events]
        assert kinds[0] == "snapshot"
        assert kinds.count("snapshot") == 1  # resumed, not started again
        capped = [e.data["numbers"] for e in events if e.kind == "capped"]
        assert capped == hot
        ids = [e.id for e in events]
        assert len(ids) == len(set(ids))
    finally:
        other.stop()


def test_a_dict_that_makes_no_request_is_a_validation_error_sent_nowhere() -> None:
    """sell() of a dict that is not a ticket (a wrong type, a missing field) raises the
    ValidationError the service would answer, with its path; nothing is sent (the URL leads
    nowhere)."""
    with SyncClient("http://127.0.0.1:9", "t") as c:
        with pytest.raises(ValidationError) as bad:
            c.sell({"ticket_id": "T-1", "game": "fdj-keno",
                     "grids": [{"numbers": [1, 2], "stake": "5"}]})
        assert (bad.value.status, bad.value.code, bad.value.path) == (
            422, "invalid_request", "$.grids[0].stake")
        with pytest.raises(ValidationError) as missing:
            c.availability("fdj-keno", {"draws": 2})
        assert missing.value.path == "$"


def test_the_blocking_client_has_every_method_of_the_async_one() -> None:
    public = {n for n in vars(Client) if not n.startswith("_") and callable(getattr(Client, n))}
    assert public - {"aclose"} <= set(vars(SyncClient)), public - set(vars(SyncClient))


async def test_concurrent_sales_go_in_batches_each_with_its_own_answer(
        live: ServiceProcess) -> None:
    """batch_size > 1: concurrent `sell` calls (and `sell_many`) leave as POST
    /v1/ticket-batches; each call still gets its own decision or typed error, and a replay
    is the same decision."""
    async with Client(live.base_url, TOKENS["fr"], batch_size=16) as c:
        draw = (await c.current_draw("fdj-keno")).draw
        before = await _batches(c)
        good = [ticket([{"numbers": TEN[:8], "stake": 100}], first_draw=draw)
                for _ in range(10)]
        bad = ticket([{"numbers": TEN[:8], "stake": 123}], first_draw=draw)
        results = await c.sell_many([*good, bad])
        assert all(isinstance(r, TicketOut) and r.status == "accepted" for r in results[:10])
        assert isinstance(results[10], CapsvcError)
        assert results[10].code == "stake_not_allowed"
        assert await _batches(c) > before
        again = await asyncio.gather(*[c.sell(t) for t in good])
        assert [a.receipt for a in again] == [r.receipt for r in results[:10]]  # type: ignore[union-attr]


async def _batches(c: Client) -> float:
    """Batch requests the service has counted (capsvc_ticket_batch_size_count)."""
    assert c._session is not None
    async with c._session.get(c.base_url + "/metrics") as resp:
        text = await resp.text()
    lines = [line for line in text.splitlines()
             if line.startswith("capsvc_ticket_batch_size_count")]
    return float(lines[0].split()[-1]) if lines else 0.0
