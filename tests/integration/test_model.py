"""The real service against the reference model, step by step, while time runs on.

A hypothesis state machine sells (alone and in batches, for players with a daily limit),
replays, conflicts, cancels, looks up, stops draws and lets time pass (a test game has a
draw every 2 seconds and a 3-second retention, so draws close and retentions pass during a
run) on a real `capsvc serve` over a real Redis, and after every step checks: every answer
equals the model's, every counter and every player's day equals the model's and no counter
exceeds the cap, every key has a TTL, and Redis holds nothing that the
contract says must be gone (no draw's counters after its retention, no ticket id after
its ticket's retention: the id is free and a new sale under it is counted afresh).
"""

from __future__ import annotations

import hashlib
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import requests
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from capsvc.config import load_settings
from capsvc.domain import combination
from capsvc.domain.calendar import DrawCalendar
from capsvc.redis.store import bucket_keys, record_bucket_of, ticket_key
from tests.model import MARGIN_MS, Expected, Model, Rules
from tests.records import unpack
from tests.support.servers import RedisCluster, RedisServer, redis_ms
from tests.support.service import ServiceProcess

TOKENS = {"fr": "m-fr", "pf": "m-pf", "ops": "m-ops"}
SWEPT_MS = 2_000 + 500
"""How long a ticket record may outlive its expiry: one pass of the janitor's sweep over
every bucket (`sweep` below) and a round (`interval`)."""
CONFIG = """
[server]
request_timeout = "2s"

[janitor]
pending_deadline = "4s"
interval = "500ms"
sweep = "2s"

# Each example starts from an emptied Redis (FLUSHALL under the running service): the
# journal would rightly put the earlier examples' decisions back. Its own guarantees are
# tested in test_journal.py and test_journal_redis_loss.py.
[journal]
enabled = false

[[games]]
id = "fast-keno"
preset = "fdj-keno-2008"
draw_every = "2s"
draw_from = "00:00"
draw_until = "23:59:58"
time_zone = "UTC"
retention = "3s"
sales_horizon = 10
cap_limit = 2000
daily_limit = 6000
""" + "".join(f"""
[[channels]]
id = "{name}"
token_sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"
games = ["fast-keno"]
scopes = {'["read", "admin"]' if name == "ops" else '["sell", "read"]'}
""" for name, token in TOKENS.items())

GAME = "fast-keno"
COMBOS = [(3, 7, 12, 18, 25, 33, 41, 56), (1, 2, 3, 4, 5, 6, 7, 8, 9),
          (10, 20, 30, 40, 50, 60, 61, 62, 63, 64), (5, 9, 13)]
"""Three capped combinations, hot enough to reach the cap, and one uncapped."""


class Fixture:
    """One Redis (standalone: sales in one call; a 3-primary cluster: sales in steps) and
    one service for the whole state machine."""

    def __init__(self, kind: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="capsvc-model-"))
        config = self.dir / "capsvc.toml"
        config.write_text(CONFIG)
        self.settings = load_settings(config)
        self.redis: RedisServer | RedisCluster = (
            RedisCluster() if kind == "cluster" else RedisServer()).start()
        self.service = ServiceProcess(str(config), self.redis.url).start()
        self.db: Any = self.redis.client()
        self.http = requests.Session()

    def flush(self) -> None:
        """Every key and the Lua library gone, on every node (the service reloads its
        library: "Function not found"); returns once the service answers from every node
        again (a look-up of an unknown ticket whose record lies there answers 404, not 503:
        until it has reloaded the library there, seen the loss and taken its marks again,
        it answers 503)."""
        servers = (self.redis.servers if isinstance(self.redis, RedisCluster)
                   else [self.redis])
        for server in servers:
            node = server.client()
            node.flushall()
            node.function_flush()
        deadline = time.monotonic() + 30
        for ticket_id in self._unknown_on_every_node():
            while self.http.get(f"{self.service.base_url}/v1/tickets/{ticket_id}",
                                timeout=10,
                                headers={"Authorization": f"Bearer {TOKENS['fr']}"}
                                ).status_code == 503:
                assert time.monotonic() < deadline, "the service never answered again"
                time.sleep(0.1)

    def _unknown_on_every_node(self) -> list[str]:
        """Ticket ids never sold whose records would lie on each primary, one a primary."""
        if not isinstance(self.redis, RedisCluster):
            return ["NONE"]
        by_node: dict[str, str] = {}
        n = 0
        while len(by_node) < len(self.redis.servers):
            ticket_id = f"NONE-{n}"
            node = self.db.get_node_from_key(record_bucket_of(ticket_key("fr", ticket_id)))
            by_node.setdefault(node.name, ticket_id)
            n += 1
        return list(by_node.values())

    def stop(self) -> None:
        self.http.close()
        self.service.stop()
        self.redis.stop()


@pytest.fixture(scope="module", params=["standalone", "cluster"])
def world(request: pytest.FixtureRequest) -> Iterator[Fixture]:
    fixture = Fixture(request.param)
    yield fixture
    fixture.stop()


grids = st.lists(
    st.fixed_dictionaries({"numbers": st.sampled_from(COMBOS).map(list),
                           "stake": st.sampled_from([300, 500, 1000])}),
    min_size=1, max_size=3)

PLAYERS = st.sampled_from(["A", "B"])
"""Two players: a daily limit of 6,000 that a few sales of one of them reach."""
PICK = st.integers(0, 2**16)
"""Which known ticket or counter a step takes, modulo how many there are. The model's
tickets and counters change with time (draws close, retentions pass), so a step never
draws from them: what a step draws must not depend on the clock, or hypothesis, replaying a
run, finds it drawing differently and stops the test as flaky."""


class _Result(msgspec.Struct):
    status: int
    body: msgspec.Raw


class _Batch(msgspec.Struct):
    results: list[_Result]


def nth(known: dict[Any, Any], pick: int) -> tuple[Any, Any] | None:
    """The `pick`-th (key, value) of `known` in key order, modulo its size; None if empty."""
    return sorted(known.items(), key=lambda kv: kv[0])[pick % len(known)] if known else None


class SaleMachine(RuleBasedStateMachine):
    world: Fixture

    def __init__(self) -> None:
        super().__init__()
        w = self.world
        w.flush()
        rules = w.settings.games[GAME]
        self.calendar = DrawCalendar(rules)
        self.model = Model(Rules(cap=rules.cap_limit or 0,
                                 capped_picks=frozenset(rules.capped_picks),
                                 retention_ms=rules.retention_ms,
                                 close_ms=self.calendar.close_ms,
                                 daily_limit=rules.daily_limit,
                                 day_of=self.calendar.local_day))
        self.paused_until = 0
        """When a primary last answered again after a pause (ms, this host's clock)."""

    # -- helpers ---------------------------------------------------------------------------

    def now(self) -> int:
        return redis_ms(self.world.db)

    def call(self, method: str, path: str, channel: str, body: Any = None,
             retry: bool = True) -> requests.Response:
        """The request, sent again on a 503 as the contract asks (outcome unknown: the
        same request converges; a loaded machine makes Redis answer late now and then)."""
        for _ in range(20 if retry else 1):
            resp = self.world.http.request(
                method, self.world.service.base_url + path, json=body, timeout=10,
                headers={"Authorization": f"Bearer {TOKENS[channel]}"})
            if resp.status_code != 503:
                break
            time.sleep(0.1)
        return resp

    def check(self, resp: requests.Response, expected: Expected) -> None:
        assert resp.status_code == expected.status, (resp.status_code, resp.text, expected)
        if expected.code is not None:
            assert resp.json()["error"]["code"] == expected.code, resp.text

    # -- rules -----------------------------------------------------------------------------

    @rule(channel=st.sampled_from(["fr", "pf"]), slot=st.integers(0, 5), grids=grids,
          draws=st.sampled_from([1, 2]), offset=st.integers(1, 4), fresh=st.booleans(),
          player=PLAYERS)
    def sell(self, channel: str, slot: int, grids: list[dict[str, Any]], draws: int,
             offset: int, fresh: bool, player: str) -> None:
        """A sale under a free ticket id (`fresh`, when one is free) or any id of the pool
        (a conflict when it is taken, a new ticket when its retention has passed)."""
        now = self.now()
        if fresh:
            free = [i for i in range(6) if self.model.ticket(channel, f"M-{i}", now) is None]
            slot = free[0] if free else slot
        first = self.calendar.current(now) + offset
        request = {"ticket_id": f"M-{slot}", "game": GAME, "player_id": player,
                   "first_draw": first, "draws": draws, "grids": grids}
        self._sell(channel, request, now)

    @rule(pick=PICK)
    def replay(self, pick: int) -> None:
        """The exact body of a known ticket again."""
        known = nth(self.model.tickets, pick)
        if known is None:
            return
        (channel, _), t = known
        self._sell(channel, t.request, self.now())

    def _sell(self, channel: str, request: dict[str, Any], now: int) -> None:
        expected = self.model.sell(channel, request, now)
        if expected is None:
            return
        resp = self.call("POST", "/v1/tickets", channel, request)
        self.check(resp, expected)
        if expected.replay_of is not None:
            assert resp.content == expected.replay_of.raw
            assert resp.headers.get("Idempotent-Replayed") == "true"
        elif expected.decision is not None:
            got = resp.json()
            receipt = got.pop("receipt")
            assert (receipt is not None) == (expected.decision["total_cost"] > 0)
            assert got == expected.decision
            self.model.record_sale(channel, request, expected.decision, resp.content, now)

    @rule(channel=st.sampled_from(["fr", "pf"]),
          sales=st.lists(st.tuples(st.integers(0, 5), grids, st.sampled_from([1, 2]),
                                   st.integers(1, 4), st.booleans(), PLAYERS),
                         min_size=1, max_size=4),
          replays=st.lists(PICK, max_size=2),
          pause=st.sampled_from([None, None, 0, 1, 2]),
          after=st.sampled_from([0.0, 0.005, 0.02]))
    def sell_batch(self, channel: str, sales: list[tuple[int, list[dict[str, Any]], int, int,
                                                         bool, str]], replays: list[int],
                   pause: int | None = None, after: float = 0.0) -> None:
        """Sales and replays in one POST /v1/ticket-batches (ticket ids distinct): each
        result is what the model answers for it alone, in order (a sale meets the counters
        and the player's budget the sales before it in the batch left).

        On the cluster, `pause`: that primary stops answering `after` seconds into the
        request, for longer than the service waits for Redis (SIGSTOP, then SIGCONT): the
        steps of the batch's sales on it (a claim, a reserve, a decision, whichever each
        sale is at) get no answer, the others go on; a ticket answered 503 is sent again,
        and every result is still the model's. The batch's sales then share no combination
        and no player: a sale whose outcome was unknown is judged again when sent again,
        after those behind it (the contract's order holds for the outcomes answered)."""
        now = self.now()
        paused = None
        if pause is not None and isinstance(self.world.redis, RedisCluster):
            paused = self.world.redis.servers[pause].process
        sent: list[tuple[dict[str, Any], Expected]] = []
        taken: set[Any] = set()  # the combinations and players of a paused batch's sales
        for slot, sale_grids, draws, offset, fresh, player in sales:
            if paused is not None:
                uses = {player, *(tuple(g["numbers"]) for g in sale_grids)}
                if uses & taken:
                    continue
                taken |= uses
            if fresh:
                free = [i for i in range(6)
                        if self.model.ticket(channel, f"M-{i}", now) is None]
                slot = free[0] if free else slot
            first = self.calendar.current(now) + offset
            self._queue(channel, {"ticket_id": f"M-{slot}", "game": GAME, "player_id": player,
                                  "first_draw": first, "draws": draws, "grids": sale_grids},
                        now, sent)
        for pick in replays:
            known = nth(self.model.tickets, pick)
            if known is not None and known[0][0] == channel:
                self._queue(channel, known[1].request, now, sent)
        if not sent:
            return
        if paused is not None:
            started = time.monotonic()
            timer = threading.Timer(after, paused.send_signal, (signal.SIGSTOP,))
            timer.start()
        try:
            resp = self.call("POST", "/v1/ticket-batches", channel,
                             {"tickets": [request for request, _ in sent]}, retry=paused is None)
        finally:
            if paused is not None:
                timer.join()
                time.sleep(max(0.0, started + after + 0.6 - time.monotonic()))
                paused.send_signal(signal.SIGCONT)
                self.paused_until = int(time.time() * 1000)
        assert resp.status_code == 200, resp.text
        results = msgspec.json.decode(resp.content, type=_Batch).results
        assert len(results) == len(sent)
        for (request, expected), result in zip(sent, results, strict=True):
            status, raw = result.status, bytes(result.body)
            if status == 503:  # unknown outcome: sent again, alone
                again = self.call("POST", "/v1/tickets", channel, request)
                status, raw = again.status_code, again.content
            assert status == expected.status, (status, raw, expected)
            if expected.code is not None:
                assert msgspec.json.decode(raw)["error"]["code"] == expected.code, raw
            if expected.replay_of is not None:
                assert raw == expected.replay_of.raw
            elif expected.decision is not None:
                got = msgspec.json.decode(raw)
                receipt = got.pop("receipt")
                assert (receipt is not None) == (expected.decision["total_cost"] > 0)
                assert got == expected.decision
                self.model.tickets[(channel, request["ticket_id"])].raw = raw

    def _queue(self, channel: str, request: dict[str, Any], now: int,
               sent: list[tuple[dict[str, Any], Expected]]) -> None:
        """A sale for the batch being built, unless its id is in it already or the model
        cannot tell its answer now; a new sale's decision is applied to the model at once,
        so that the batch's next sales meet its counters."""
        if any(r["ticket_id"] == request["ticket_id"] for r, _ in sent):
            return
        expected = self.model.sell(channel, request, now)
        if expected is None:
            return
        if expected.decision is not None and expected.replay_of is None:
            self.model.record_sale(channel, request, expected.decision, b"", now)
        sent.append((request, expected))

    @rule(channel=st.sampled_from(["fr", "pf"]), slot=st.integers(0, 5))
    def cancel(self, channel: str, slot: int) -> None:
        tid = f"M-{slot}"
        expected = self.model.cancel(channel, tid, self.now())
        if expected is None:
            return
        resp = self.call("POST", f"/v1/tickets/{tid}/cancel", channel)
        self.check(resp, expected)
        if resp.status_code == 200:
            assert resp.json()["released"] == self.model.record_cancel(channel, tid)

    @rule(channel=st.sampled_from(["fr", "pf"]), slot=st.integers(0, 5))
    def get(self, channel: str, slot: int) -> None:
        tid = f"M-{slot}"
        t = self.model.ticket(channel, tid, self.now())
        if t is False:
            return
        resp = self.call("GET", f"/v1/tickets/{tid}", channel)
        if t is None:
            assert resp.status_code == 404, resp.text
            return
        assert not isinstance(t, bool)
        assert resp.status_code == 200, resp.text
        got = resp.json()
        cancelled = got.pop("cancelled", None)
        assert got.pop("state", None) == ("cancelled" if cancelled is not None else None)
        assert got == requests.models.complexjson.loads(t.raw)
        assert (cancelled is None) == (t.cancelled is None)
        if cancelled is not None:
            assert cancelled["released"] == t.cancelled

    @rule(offset=st.integers(1, 4), dice=st.integers(0, 3))
    def stop_draw(self, offset: int, dice: int) -> None:
        if dice:  # stops are rare: most runs must sell
            return
        draw = self.calendar.current(self.now()) + offset
        resp = self.call("POST", f"/v1/games/{GAME}/draws/{draw}/close", "ops")
        assert resp.status_code == 200, resp.text
        self.model.stopped.add(draw)

    @rule(seconds=st.sampled_from([0.2, 0.6, 2.5]))
    def wait(self, seconds: float) -> None:
        time.sleep(seconds)

    @rule(pick=PICK)
    def availability(self, pick: int) -> None:
        """GET …/combinations answers the model's stake while the draw is retained."""
        known = nth(self.model.counters, pick)
        if known is None:
            return
        (numbers, draw), staked = known
        now = self.now()
        if self.model.expiry(draw) - now < 2 * MARGIN_MS or self.calendar.close_ms(draw) < now:
            return
        path = f"/v1/games/{GAME}/draws/{draw}/combinations/{'-'.join(map(str, numbers))}"
        resp = self.call("GET", path, "fr")
        assert resp.status_code == 200, resp.text
        assert resp.json()["staked"] == staked

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def counters_match_the_model(self) -> None:
        now = self.now()
        self.model.forget(now)
        db = self.world.db
        for (numbers, draw), staked in self.model.counters.items():
            if self.model.expiry(draw) - now < MARGIN_MS:
                continue
            (key,) = bucket_keys(GAME, combination.encode(numbers), draw, 1)
            assert int(db.hget(key, combination.encode(numbers)) or 0) == staked

    @invariant()
    def budgets_match_the_model(self) -> None:
        """Each player's day (GET /v1/players) holds what the model's accepted grids cost."""
        now = self.now()
        day, start, end = self.calendar.local_day(now)
        if self.model.near(start, now) or self.model.near(end, now):
            return
        for player in ("A", "B"):
            resp = self.call("GET", f"/v1/players/{player}", "fr")
            assert resp.status_code == 200, resp.text
            assert resp.json()["spent"] == self.model.spent.get((player, day), 0)

    @invariant()
    def redis_holds_nothing_it_should_not(self) -> None:
        """Every key has a TTL; no key of a draw or ticket whose retention has passed; no
        counter above the cap."""
        db, now = self.world.db, self.now()
        cap = self.model.rules.cap
        for key in db.scan_iter(count=1000):
            ttl = db.pttl(key)
            if ttl == -2:  # expired while scanning
                continue
            assert ttl >= 0, f"{key!r} has no TTL"
            kind = key.split(b":", 1)[0]
            if kind in (b"c", b"x"):
                draw = int(key.rsplit(b":", 1)[1])
                assert now < self.model.expiry(draw) + MARGIN_MS, f"{key!r} outlived its draw"
            if kind == b"c":
                for name, value in db.hgetall(key).items():
                    if not name.startswith(b"\0"):
                        assert int(value) <= cap, (key, name, value)
            if kind == b"r":  # ticket records: the janitor sweeps them past their expiry
                for ident, value in db.hgetall(key).items():
                    if ident == b"!":  # what a sale knew of the bucket's expiry: no more
                        expiry = db.pexpiretime(key)
                        assert expiry == -2 or int(value) <= expiry, (key, value, expiry)
                        continue
                    channel, tid = ident.decode().split("/")
                    t = self.model.tickets.get((channel, tid))
                    expires = t.expires_ms if t else self.model.retired.get((channel, tid))
                    assert expires is not None, f"{ident!r} is no ticket of the model"
                    assert unpack(value)[0] == expires, (ident, t)
                    # A primary paused while the record was due: a sweep round may have
                    # failed on it, its share of the buckets swept a pass later.
                    late = SWEPT_MS if self.paused_until > expires - SWEPT_MS else 0
                    assert now < expires + SWEPT_MS + MARGIN_MS + late, (
                        f"{ident!r} outlived its retention and the sweep")


@pytest.mark.slow
def test_the_service_behaves_as_the_model(world: Fixture) -> None:
    """Random runs of sales, replays, conflicts, cancels, stops and time passing: the real
    service answers and counts exactly as the reference model (players' budgets
    included), and forgets on time."""
    SaleMachine.world = world
    run_state_machine_as_test(SaleMachine, settings=settings(
        max_examples=6, stateful_step_count=50, deadline=None,
        suppress_health_check=list(HealthCheck)))


def test_a_ticket_id_used_again_after_its_retention_is_a_new_sale(world: Fixture) -> None:
    """Sold on draw d; once d closed and its retention passed, the same ticket id is a new
    sale: on a later draw filled to the cap by another channel it is refused (counted
    afresh, not taken for the old sale), and cancelling it gives back nothing."""
    world.flush()
    rules = world.settings.games[GAME]
    calendar = DrawCalendar(rules)
    http = world.http
    base = world.service.base_url

    def post(path: str, body: Any, channel: str) -> requests.Response:
        return http.post(base + path, json=body, timeout=10,
                         headers={"Authorization": f"Bearer {TOKENS[channel]}"})

    def now() -> int:
        return redis_ms(world.db)

    grid = [{"numbers": list(COMBOS[0]), "stake": 500}]
    first = calendar.current(now()) + 1
    old = post("/v1/tickets", {"ticket_id": "REUSED", "game": GAME, "player_id": "A",
                               "first_draw": first, "grids": grid}, "fr")
    assert old.json()["status"] == "accepted"
    time.sleep((calendar.close_ms(first) + rules.retention_ms - now()) / 1000 + 0.5)
    later = calendar.current(now()) + 2
    for i in range(4):  # 4 x 500 fills the 2000 cap
        filler = post("/v1/tickets", {"ticket_id": f"FILL-{i}", "game": GAME,
                                      "player_id": "B", "first_draw": later, "grids": grid},
                      "pf")
        assert filler.json()["status"] == "accepted"
    again = post("/v1/tickets", {"ticket_id": "REUSED", "game": GAME, "player_id": "A",
                                 "first_draw": later, "grids": grid}, "fr")
    assert again.status_code == 200, again.text
    assert again.headers.get("Idempotent-Replayed") is None
    assert again.json()["status"] == "rejected"
    assert again.json()["grids"][0]["remaining"] == 0
    cancel = post("/v1/tickets/REUSED/cancel", None, "fr")
    assert (cancel.status_code, cancel.json()["error"]["code"]) == (409, "not_cancellable")
    (key,) = bucket_keys(GAME, combination.encode(COMBOS[0]), later, 1)
    assert int(world.db.hget(key, combination.encode(COMBOS[0])) or 0) == 2000


def test_the_janitor_sweeps_a_record_its_bucket_outlives(world: Fixture) -> None:
    """Two tickets whose records share a bucket, sold on draws 4 apart: once the first one's
    retention has passed, the bucket lives on for the second (its TTL), and the janitor's
    sweep deletes the first one's record within `sweep` and a round."""
    world.flush()
    rules = world.settings.games[GAME]
    calendar = DrawCalendar(rules)
    first_id = "SWEPT"
    first_key = ticket_key("fr", first_id)
    second_id = next(f"KEPT-{n}" for n in range(10**6)
                     if record_bucket_of(ticket_key("fr", f"KEPT-{n}")) ==
                     record_bucket_of(first_key))
    bucket = record_bucket_of(first_key)

    def now() -> int:
        return redis_ms(world.db)

    draw = calendar.current(now()) + 1
    for ticket_id, first_draw in ((first_id, draw), (second_id, draw + 4)):
        sold = world.http.post(
            world.service.base_url + "/v1/tickets", timeout=10,
            headers={"Authorization": f"Bearer {TOKENS['fr']}"},
            json={"ticket_id": ticket_id, "game": GAME, "player_id": "A",
                  "first_draw": first_draw,
                  "grids": [{"numbers": list(COMBOS[3]), "stake": 300}]})
        assert sold.status_code == 200, sold.text
    expiry = calendar.close_ms(draw) + rules.retention_ms
    assert unpack(world.db.hget(bucket, f"fr/{first_id}"))[0] == expiry
    time.sleep(max(0.0, (expiry - now()) / 1000))
    deadline = time.monotonic() + (SWEPT_MS + MARGIN_MS) / 1000
    while world.db.hexists(bucket, f"fr/{first_id}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not world.db.hexists(bucket, f"fr/{first_id}")
    assert world.db.hexists(bucket, f"fr/{second_id}")
    # Past its newest record's expiry, by a day at most (lua/capsvc.lua, BUCKET_SLACK_MS).
    newest = calendar.close_ms(draw + 4) + rules.retention_ms
    assert newest <= world.db.pexpiretime(bucket) <= newest + 86_400_000
