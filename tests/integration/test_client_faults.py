"""capsvc.client through faults, against the real service.

Between the client and the service, `HttpFaultProxy`: answers lost after the service ran
the request, answers delayed past the client's timeout, connections reset before the request
reached the service. Between the service and Redis, `FaultProxy`: Redis replies lost and
delayed. What must hold whatever happens:
- every decision the client reports is the one recorded (a later look-up answers the same
  decision, the same receipt), and its stakes are counted once;
- a deadline passed without a decision is `OutcomeUnknown` carrying the ticket id, and once
  the service has settled what was in flight the ticket is exactly one of "never counted"
  (404) or "decided" (its look-up), never half-counted;
- each counter equals the stakes of the accepted, uncancelled grids, and none passes the cap;
- the sold-out feed iterator, its connections cut again and again, yields each event once.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from capsvc.client import (
    CancelOut,
    Client,
    ConflictError,
    NotFoundError,
    OutcomeUnknown,
    TicketOut,
)
from tests.conftest import TEN, TOKENS, new_id, ticket
from tests.support.faults import FaultProxy, Rule, command
from tests.support.http_faults import Chaos, HttpFaultProxy, request
from tests.support.servers import RedisServer
from tests.support.service import ServiceProcess

FAULTS = Path(__file__).parent.parent / "capsvc-faults.toml"
"""Short deadlines: Redis timeout 300 ms, request timeout 1 s, pending deadline 3 s."""
SETTLED_S = 8.0
"""Longer than a request can run plus the janitor's pending deadline and a tick."""
CAP = 5000
HOT = [TEN[:8], TEN[1:9], TEN[:9], TEN]
SALE = request("POST", "/v1/tickets")


class Stack:
    """client -> HttpFaultProxy -> capsvc serve -> FaultProxy -> redis-server."""

    def __init__(self) -> None:
        self.redis = RedisServer().start()
        self.redis_faults = FaultProxy("127.0.0.1", self.redis.port).start()
        self.service = ServiceProcess(str(FAULTS), self.redis_faults.url).start()
        self.http = HttpFaultProxy("127.0.0.1", self.service.port).start()

    def stop(self) -> None:
        self.http.stop()
        self.service.stop()
        self.redis_faults.stop()
        self.redis.stop()

    def client(self, **options: Any) -> Client:
        """A client through the faults."""
        return Client(self.http.url, TOKENS["fr"], **options)

    def direct(self) -> Client:
        """A client straight to the service (to look at what was recorded)."""
        return Client(self.service.base_url, TOKENS["fr"], backoff_s=0.05)


@pytest.fixture
def stack() -> Iterator[Stack]:
    s = Stack()
    yield s
    s.stop()


async def staked(c: Client, numbers: list[int], draw: int) -> int:
    return (await c.combination("fdj-keno", draw, numbers)).staked or 0


async def test_a_lost_answer_is_sent_again_and_the_sale_counted_once(stack: Stack) -> None:
    """The service sold; the answer never arrived (connection reset): the client sends the
    same request again and returns the decision, a replay of the first."""
    async with stack.direct() as look, stack.client(backoff_s=0.01) as c:
        draw = (await look.current_draw("fdj-keno")).draw
        rule = stack.http.drop_response(SALE)
        sold = await c.sell(ticket([{"numbers": TEN, "stake": 500}], first_draw=draw))
        assert rule.fired.is_set()
        assert sold.status == "accepted"
        assert stack.http.forwarded.count([b"POST", b"/v1/tickets"]) == 2
        assert await staked(look, TEN, draw) == 500
        assert (await look.ticket(sold.ticket_id)).receipt == sold.receipt


async def test_an_answer_slower_than_the_timeout_is_a_retry_not_a_second_sale(
        stack: Stack) -> None:
    """The answer comes after the client's timeout: the client has already sent the same
    request again; the sale is counted once and both answers are the one decision."""
    async with stack.direct() as look, stack.client(timeout_s=0.3, backoff_s=0.01) as c:
        draw = (await look.current_draw("fdj-keno")).draw
        stack.http.delay_response(SALE, 1.0)
        sold = await c.sell(ticket([{"numbers": TEN, "stake": 1000}], first_draw=draw))
        assert sold.status == "accepted"
        assert await staked(look, TEN, draw) == 1000
        cancel_rule = stack.http.drop_response(request("POST", "/v1/tickets/"))
        released = await c.cancel(sold.ticket_id)
        assert cancel_rule.fired.is_set()
        assert released.released == 1000
        assert await staked(look, TEN, draw) == 0


async def test_a_batch_whose_answer_was_lost_is_sent_again_each_sale_counted_once(
        stack: Stack) -> None:
    """Three concurrent sales leave as one batch and its answer is lost: each ticket goes
    again (on its own backoff, alone or with others) and each call returns its own
    decision, a replay of the first, each stake counted once. Then a batch whose answer is
    slower than the client's timeout: the same."""
    async with stack.direct() as look, stack.client(timeout_s=0.5, backoff_s=0.01) as c:
        draw = (await look.current_draw("fdj-keno")).draw
        batch = request("POST", "/v1/ticket-batches")
        dropped = stack.http.drop_response(batch)
        bodies = [ticket([{"numbers": n, "stake": 500}], first_draw=draw) for n in HOT[:3]]
        sold = await c.sell_many(bodies)
        assert dropped.fired.is_set()
        assert stack.http.forwarded.count([b"POST", b"/v1/ticket-batches"]) >= 1
        assert len(stack.http.forwarded) >= 2  # the batch, and its tickets again
        stack.http.delay_response(batch, 1.0)
        late = [ticket([{"numbers": n, "stake": 500}], first_draw=draw) for n in HOT[:3]]
        sold += await c.sell_many(late)
        bodies += late
        assert [s.ticket_id for s in sold if isinstance(s, TicketOut)] == [
            b["ticket_id"] for b in bodies]
        for decided in sold:
            assert isinstance(decided, TicketOut)
            assert decided.status == "accepted"
            assert (await look.ticket(decided.ticket_id)).receipt == decided.receipt
        for numbers in HOT[:3]:
            assert await staked(look, numbers, draw) == 1000


async def test_a_reset_before_the_service_saw_it_is_sent_again(stack: Stack) -> None:
    async with stack.direct() as look, stack.client(backoff_s=0.01) as c:
        draw = (await look.current_draw("fdj-keno")).draw
        stack.http.reset_request(SALE, count=3)
        sold = await c.sell(ticket([{"numbers": TEN, "stake": 200}], first_draw=draw))
        assert sold.status == "accepted"
        assert stack.http.forwarded.count([b"POST", b"/v1/tickets"]) == 1
        assert await staked(look, TEN, draw) == 200


async def test_a_passed_deadline_is_outcome_unknown_then_exactly_decided_or_never_counted(
        stack: Stack) -> None:
    """Every answer lost: OutcomeUnknown (the sale was counted: its look-up answers it).
    Every request reset: OutcomeUnknown (never counted: 404, nothing staked). And with every
    Redis reply lost, the service's own 503s: OutcomeUnknown, and once settled, one of the
    two."""
    async with stack.direct() as look, stack.client(backoff_s=0.05) as c:
        draw = (await look.current_draw("fdj-keno")).draw
        answered = ticket([{"numbers": HOT[0], "stake": 500}], first_draw=draw)
        stack.http.drop_response(SALE, count=1000)
        with pytest.raises(OutcomeUnknown) as unknown:
            await c.sell(answered, deadline_s=1.0)
        assert unknown.value.ticket_id == answered["ticket_id"]
        assert unknown.value.attempts >= 2
        stack.http.calm()
        assert (await look.ticket(answered["ticket_id"])).status == "accepted"
        assert await staked(look, HOT[0], draw) == 500

        never = ticket([{"numbers": HOT[1], "stake": 500}], first_draw=draw)
        stack.http.reset_request(SALE, count=1000)
        with pytest.raises(OutcomeUnknown):
            await c.sell(never, deadline_s=1.0)
        stack.http.calm()
        with pytest.raises(NotFoundError):
            await look.ticket(never["ticket_id"])
        assert await staked(look, HOT[1], draw) == 0

        redis_down = ticket([{"numbers": HOT[2], "stake": 500}], first_draw=draw)
        lost = stack.redis_faults.drop_reply(command("FCALL"), count=1000)
        with pytest.raises(OutcomeUnknown) as unknown:
            await c.sell(redis_down, deadline_s=1.5)
        assert unknown.value.last.startswith("HTTP 503")
        stack.redis_faults.remove(lost)
        await asyncio.sleep(SETTLED_S)
        try:
            decided = await look.ticket(redis_down["ticket_id"])
        except NotFoundError:
            assert await staked(look, HOT[2], draw) == 0
        else:
            accepted = sum(g.cost or 0 for g in decided.grids if g.status == "accepted")
            assert await staked(look, HOT[2], draw) == accepted


class Ledger:
    """What the sellers were told, to compare with what the service recorded."""

    def __init__(self) -> None:
        self.decided: dict[str, TicketOut] = {}
        self.unknown: set[str] = set()
        self.cancelled: dict[str, int] = {}
        self.cancel_unknown: set[str] = set()
        self.errors: list[str] = []


def chaos_client(stack: Stack, batch_size: int = 1) -> Client:
    return stack.client(timeout_s=0.6, backoff_s=0.02, max_backoff_s=0.3,
                        batch_size=batch_size)


async def seller(stack: Stack, ledger: Ledger, draw: int, seed: int, count: int,
                 shared: Client | None = None) -> None:
    """Sells `count` tickets on the hot combinations through the faults, cancels some; with
    its own client, or with one the sellers share (whose concurrent sales leave in
    batches)."""
    rng = random.Random(seed)
    async with contextlib.nullcontext(shared) if shared else chaos_client(stack) as c:
        for _ in range(count):
            grids = [{"numbers": rng.choice(HOT), "stake": rng.choice([300, 500, 1000])}
                     for _ in range(rng.randint(1, 3))]
            body = ticket(grids, first_draw=draw, ticket_id=new_id(f"C{seed}"))
            try:
                sold = await c.sell(body, deadline_s=rng.choice([0.4, 3.0, 8.0]))
            except OutcomeUnknown:
                ledger.unknown.add(body["ticket_id"])
                continue
            ledger.decided[sold.ticket_id] = sold
            if sold.status != "rejected" and rng.random() < 0.25:
                try:
                    out: CancelOut = await c.cancel(sold.ticket_id, deadline_s=8.0)
                except OutcomeUnknown:
                    ledger.cancel_unknown.add(sold.ticket_id)
                except ConflictError as e:
                    ledger.errors.append(f"{sold.ticket_id}: {e}")
                else:
                    ledger.cancelled[sold.ticket_id] = out.released


def redis_chaos(proxy: FaultProxy, stop: threading.Event, seed: int, rules: list[Rule]
                ) -> None:
    """Now and then, a Redis reply lost or delayed past the service's Redis timeout (each
    rule added to `rules`)."""
    rng = random.Random(seed)
    while not stop.wait(rng.uniform(0.3, 1.0)):
        if rng.random() < 0.5:
            rules.append(proxy.drop_reply(command("FCALL")))
        else:
            rules.append(proxy.delay_reply(command("FCALL"), 0.5))


async def forced(stack: Stack, ledger: Ledger, draw: int) -> str:
    """Once the chaos is over, one outcome of each kind whatever the timing, sent alone
    through a client whose timeout no answer of a loaded machine reaches: a sale whose
    every answer is lost (unknown; recorded, or not if the service answered 503), one whose
    first answer is lost (decided on a retry), one whose every request is reset (unknown;
    never counted: its rule stays, so that an attempt the proxy reads after the client gave
    up is reset too). The id of the one never sent."""
    bodies = [ticket([{"numbers": HOT[i], "stake": 300}], first_draw=draw,
                     ticket_id=new_id("F")) for i in range(3)]
    async with stack.client(backoff_s=0.02, batch_size=1) as c:
        stack.http.drop_response(SALE, count=1000)
        with pytest.raises(OutcomeUnknown):
            await c.sell(bodies[0], deadline_s=1.0)
        stack.http.calm()
        stack.http.drop_response(SALE)
        sold = await c.sell(bodies[1])
        stack.http.calm()
        stack.http.reset_request(SALE, count=1000)
        with pytest.raises(OutcomeUnknown):
            await c.sell(bodies[2], deadline_s=1.0)
    ledger.unknown |= {bodies[0]["ticket_id"], bodies[2]["ticket_id"]}
    ledger.decided[sold.ticket_id] = sold
    return str(bodies[2]["ticket_id"])


@pytest.mark.slow
@pytest.mark.parametrize("route", ["one by one", "batches"])
async def test_chaos_every_reported_decision_is_the_recorded_one_counted_once(
        stack: Stack, route: str) -> None:
    """Eight sellers, 160 tickets on four hot combinations, with faults both sides of the
    service; short deadlines for some sales; each seller with its own client (one sale a
    request), or all with one client (their concurrent sales in batches). Then, once
    settled: each decision reported is the one recorded; each unknown one is decided or
    never counted; each counter equals the accepted, uncancelled stakes and stays within
    the cap."""
    ledger = Ledger()
    async with stack.direct() as look, chaos_client(stack, batch_size=8) as shared:
        draw = (await look.current_draw("fdj-keno")).draw
        faults = stack.http.chaos(Chaos(request("POST", "/v1/ticket"), drop=0.10,
                                        delay=0.12, reset=0.08, delay_s=1.2, seed=19))
        stop = threading.Event()
        rules: list[Rule] = []
        chaos = threading.Thread(target=redis_chaos,
                                 args=(stack.redis_faults, stop, 20, rules))
        chaos.start()
        try:
            await asyncio.gather(*(seller(stack, ledger, draw, seed, 20,
                                          shared if route == "batches" else None)
                                   for seed in range(8)))
        finally:
            stop.set()
            chaos.join()
        batches = stack.http.forwarded.count([b"POST", b"/v1/ticket-batches"])
        assert (batches > 0) == (route == "batches")
        print(f"decided {len(ledger.decided)}, unknown {len(ledger.unknown)}, cancelled "
              f"{len(ledger.cancelled)}, http faults {faults.counts}")
        stack.http.calm()
        for rule in rules:
            stack.redis_faults.remove(rule)
        never_sent = await forced(stack, ledger, draw)
        await asyncio.sleep(SETTLED_S)

        assert not ledger.errors, ledger.errors
        expected: dict[tuple[int, ...], int] = defaultdict(int)
        for ticket_id, told in ledger.decided.items():
            recorded = await look.ticket(ticket_id)
            assert (recorded.status, recorded.total_cost, recorded.receipt) == (
                told.status, told.total_cost, told.receipt), ticket_id
            assert [g.status for g in recorded.grids] == [g.status for g in told.grids]
            if ticket_id in ledger.cancelled:
                assert recorded.cancelled is not None
                assert recorded.cancelled.released == ledger.cancelled[ticket_id]
            if recorded.cancelled is None:
                for g in recorded.grids:
                    if g.status == "accepted":
                        expected[tuple(g.numbers)] += g.cost or 0
        never = set()
        for ticket_id in ledger.unknown:
            try:
                recorded = await look.ticket(ticket_id)
            except NotFoundError:
                never.add(ticket_id)
                continue
            if recorded.cancelled is None:
                for g in recorded.grids:
                    if g.status == "accepted":
                        expected[tuple(g.numbers)] += g.cost or 0
        for numbers in HOT:
            counted = await staked(look, numbers, draw)
            assert counted == expected[tuple(numbers)], numbers
            assert counted <= CAP
        assert len(ledger.decided) + len(ledger.unknown) == 160 + 3
        # The checks met each kind of outcome (forced: how many of each the chaos gave
        # depends on the machine's speed).
        assert never_sent in never


async def test_the_feed_iterator_through_cut_connections_misses_and_repeats_nothing(
        stack: Stack) -> None:
    """capped_events through the proxy; every connection cut after each capped
    combination: the iterator reconnects with Last-Event-ID and yields each event once,
    one snapshot in all."""
    events: list[Any] = []
    arrived = asyncio.Event()
    async with stack.direct() as seller_client, stack.client(backoff_s=0.02) as c:
        draw = (await seller_client.current_draw("fdj-keno")).draw

        async def follow() -> None:
            async for event in c.capped_events("fdj-keno", draw=draw):
                events.append(event)
                arrived.set()

        async def seen(n: int) -> None:
            while sum(e.kind == "capped" for e in events) < n:
                arrived.clear()
                await arrived.wait()

        task = asyncio.create_task(follow())
        await asyncio.wait_for(arrived.wait(), 10)  # the snapshot
        for i, numbers in enumerate(HOT):
            stack.http.cut()
            for _ in range(5):
                await seller_client.sell(ticket([{"numbers": numbers, "stake": 1000}],
                                                first_draw=draw))
            await asyncio.wait_for(seen(i + 1), 10)
        task.cancel()
    kinds = [e.kind for e in events]
    assert kinds.count("snapshot") == 1
    assert [e.data["numbers"] for e in events if e.kind == "capped"] == HOT
    assert len({e.id for e in events}) == len(events)
