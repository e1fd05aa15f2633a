"""Faults between the service and Redis at each step of a sale and of a cancel.

A real `capsvc serve` talks to a real Redis through `tests.support.faults.FaultProxy`, which
delays or loses a chosen reply or request. Each test is one way a step can fail; each
ends with the counters equal to what was accepted minus what was released, and with one
decision that the client can see.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from capsvc.config import load_settings
from capsvc.domain import combination
from capsvc.redis.store import Store, lua_source, record_bucket_of, ticket_key
from capsvc.redis.transport import Coalescer
from capsvc.wiring import build_usecases
from tests.conftest import TEN, TOKENS, new_id, past_deadline
from tests.records import held
from tests.support.faults import Command, FaultProxy, command
from tests.support.servers import RedisServer
from tests.support.service import ServiceProcess

ONE_CALL = Path(__file__).parent.parent / "capsvc-faults.toml"
"""Short deadlines; a sale of a game without player limits is one call on standalone."""
CONFIG = Path(tempfile.mkdtemp(prefix="capsvc-steps-")) / "capsvc-faults-steps.toml"
"""The same, but every sale in steps, as on a Redis Cluster: most tests here inject their
faults between those steps, on a standalone Redis."""
CONFIG.write_text(ONE_CALL.read_text().replace("[redis]\n", '[redis]\nsale_calls = "steps"\n', 1))
RESERVE = command("FCALL", "capsvc_reserve")
RELEASE = command("FCALL", "capsvc_release")
FINALIZE = command("FCALL", "capsvc_finalize")


def reserve_of(numbers: list[int]) -> Callable[[Command], bool]:
    """The reserve of the grid whose combination is `numbers`."""
    combo = combination.encode(sorted(numbers)).encode()
    return lambda cmd: RESERVE(cmd) and combo in cmd


class Api:
    """A synchronous client of one service."""

    def __init__(self, base_url: str) -> None:
        self.base = base_url
        self.http = requests.Session()

    def call(self, method: str, path: str, body: Any = None, token: str = "fr"
             ) -> requests.Response:
        return self.http.request(method, self.base + path, json=body, timeout=10,
                                 headers={"Authorization": f"Bearer {TOKENS[token]}"})

    def sell(self, body: dict[str, Any]) -> requests.Response:
        return self.call("POST", "/v1/tickets", body)

    def read(self, path: str) -> Any:
        """A read's body, sent again while it answers 503: right after a fault the proxy
        cut, the service's connection to Redis may still be coming back."""
        deadline = time.monotonic() + 10
        while (reply := self.call("GET", path, token="admin")).status_code == 503:
            assert time.monotonic() < deadline, reply.text
            time.sleep(0.1)
        return reply.json()

    def current(self) -> int:
        return int(self.read("/v1/games/fdj-keno/draws/current")["draw"])

    def staked(self, numbers: list[int], draw: int) -> int:
        path = f"/v1/games/fdj-keno/draws/{draw}/combinations/{'-'.join(map(str, numbers))}"
        return int(self.read(path)["staked"])


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def unknown_outcome(resp: requests.Response) -> None:
    """A 503 that says the outcome is unknown, with Retry-After."""
    assert resp.status_code == 503, resp.text
    assert "outcome is unknown" in resp.json()["error"]["message"]
    assert "Retry-After" in resp.headers


def retried(api: Api, body: dict[str, Any], rule: Any) -> requests.Response:
    """The sale meets the fault (503, outcome unknown); once the fault has fired and the
    late reply would have come, the same request again: accepted."""
    unknown_outcome(api.sell(body))
    assert rule.fired.wait(5)
    time.sleep(1.2)
    retry = api.sell(body)
    assert retry.status_code == 200, retry.text
    assert retry.json()["status"] == "accepted"
    return retry


@pytest.fixture
def proxy(redis_server: RedisServer, standalone_db: redis.Redis) -> Iterator[FaultProxy]:
    with FaultProxy("127.0.0.1", redis_server.port) as p:
        yield p


def serve(config: Path, proxy: FaultProxy) -> Iterator[Api]:
    """A service on `config`, talking to the session's Redis through the proxy."""
    service = ServiceProcess(str(config), proxy.url).start()
    try:
        yield Api(service.base_url)
    finally:
        service.stop()


@pytest.fixture
def api(proxy: FaultProxy) -> Iterator[Api]:
    """The service selling in steps, through the proxy."""
    yield from serve(CONFIG, proxy)


def sale(*grids: tuple[list[int], int], **fields: Any) -> dict[str, Any]:
    return {"ticket_id": new_id("F"), "game": "fdj-keno",
            "grids": [{"numbers": n, "stake": s} for n, s in grids], **fields}


def test_delayed_reserve_reply_is_503_then_the_retry_converges(
        api: Api, proxy: FaultProxy) -> None:
    """The reserve ran but its reply came after the timeout: 503 (outcome unknown); the
    retry answers the one decision, counted once, and GET tells the same."""
    draw = api.current()
    body = sale((TEN[:8], 500))
    rule = proxy.delay_reply(RESERVE, 1.0)
    retry = retried(api, body, rule)
    assert api.staked(TEN[:8], draw) == 500
    assert api.call("GET", f"/v1/tickets/{body['ticket_id']}").content == retry.content


def test_a_get_cut_short_is_a_503_that_says_nothing_changed(
        api: Api, proxy: FaultProxy) -> None:
    """A look-up whose Redis reply comes too late: a 503 with Retry-After that does not say
    "the outcome is unknown" (a GET changes nothing), and the same GET again answers."""
    body = sale((TEN[:8], 500))
    assert api.sell(body).status_code == 200
    key = ticket_key("fr-retail", body["ticket_id"])
    rule = proxy.delay_reply(command("FCALL", "capsvc_ticket", "2", record_bucket_of(key)), 1.0)
    resp = api.call("GET", f"/v1/tickets/{body['ticket_id']}")
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert error["code"] == "unavailable"
    assert "Retry-After" in resp.headers
    assert "nothing was changed" in error["message"]
    assert "outcome is unknown" not in error["message"]
    assert rule.fired.wait(5)
    time.sleep(1.2)
    assert api.call("GET", f"/v1/tickets/{body['ticket_id']}").status_code == 200


def test_a_503_never_retried_is_settled_as_accepted(api: Api, proxy: FaultProxy) -> None:
    """Every grid was counted but the answer was lost: the janitor finalizes the sale as
    accepted within the pending deadline (an answer may have reached the client)."""
    draw = api.current()
    body = sale((TEN[:8], 500), (TEN[:9], 300))
    proxy.delay_reply(RESERVE, 1.0, count=2)
    unknown_outcome(api.sell(body))
    eventually(lambda: api.call("GET", f"/v1/tickets/{body['ticket_id']}").status_code == 200)
    got = api.call("GET", f"/v1/tickets/{body['ticket_id']}").json()
    assert got["status"] == "accepted"
    assert (api.staked(TEN[:8], draw), api.staked(TEN[:9], draw)) == (500, 300)
    replay = api.sell(body)
    assert replay.json() == got
    assert replay.headers["Idempotent-Replayed"] == "true"


def test_a_sale_cut_before_its_last_grid_is_released_then_sold_afresh(
        api: Api, proxy: FaultProxy) -> None:
    """The second grid's reserve never reached Redis: no answer was sent, so the janitor
    gives the first grid's stake back and forgets the claim; the retry is a new sale."""
    draw = api.current()
    body = sale((TEN[:8], 500), (TEN[:9], 300))
    proxy.drop_request(reserve_of(TEN[:9]))
    unknown_outcome(api.sell(body))
    assert api.staked(TEN[:9], draw) == 0
    eventually(lambda: api.call("GET", f"/v1/tickets/{body['ticket_id']}").status_code == 404)
    assert api.staked(TEN[:8], draw) == 0
    retry = api.sell(body)
    assert retry.json()["status"] == "accepted"
    assert (api.staked(TEN[:8], draw), api.staked(TEN[:9], draw)) == (500, 300)


def test_a_lost_decision_write_is_finalized_with_the_same_body(
        api: Api, proxy: FaultProxy) -> None:
    """The decision write was lost with its connection: the answer is a 503 (outcome
    unknown), GET says pending until the janitor writes the decision the records make;
    a replay then answers it; nothing is counted twice."""
    draw = api.current()
    body = sale((TEN[:8], 500))
    proxy.drop_request(FINALIZE)
    unknown_outcome(api.sell(body))
    path = f"/v1/tickets/{body['ticket_id']}"
    eventually(lambda: api.call("GET", path).status_code == 200)
    got = api.call("GET", path)
    assert got.json()["status"] == "accepted"
    assert api.sell(body).content == got.content
    assert api.staked(TEN[:8], draw) == 500


@pytest.mark.parametrize("finisher", ["retry", "janitor"])
def test_a_cancel_cut_before_its_release_is_finished(
        api: Api, proxy: FaultProxy, finisher: str) -> None:
    """The cancel was decided but its release lost (503, outcome unknown): GET already
    shows the cancellation, and the retry, or else the janitor, gives the stake back once."""
    draw = api.current()
    body = sale((TEN[:8], 500))
    assert api.sell(body).status_code == 200
    proxy.drop_request(RELEASE)
    path = f"/v1/tickets/{body['ticket_id']}"
    unknown_outcome(api.call("POST", path + "/cancel"))
    assert api.staked(TEN[:8], draw) == 500
    assert api.call("GET", path).json()["cancelled"]["released"] == 500
    if finisher == "retry":
        again = api.call("POST", path + "/cancel")
        assert again.json() == {"ticket_id": body["ticket_id"], "status": "cancelled",
                                "released": 500}
    eventually(lambda: api.staked(TEN[:8], draw) == 0)
    assert api.call("POST", path + "/cancel").json()["released"] == 500
    assert api.staked(TEN[:8], draw) == 0
    looked = api.call("GET", path).content
    assert api.sell(body).content == looked.split(b',"state":"cancelled"')[0] + b"}"


def test_a_duplicate_whose_reserve_lands_after_the_cancel_counts_nothing(
        redis_server: RedisServer, standalone_db: redis.Redis, proxy: FaultProxy) -> None:
    """Two copies of one request on two processes: the second resumes the pending sale but
    its reserve is held; the first completes and the ticket is cancelled; the held reserve
    then lands: it counts nothing and the duplicate answers the original decision."""
    direct = ServiceProcess(str(CONFIG), redis_server.url).start()
    slow = ServiceProcess(str(CONFIG), proxy.url).start()
    try:
        fast_api, slow_api = Api(direct.base_url), Api(slow.base_url)
        draw = fast_api.current()
        body = sale((TEN[:8], 500))
        release = threading.Event()
        held = proxy.hold_request(RESERVE, release)
        answers: list[requests.Response] = []
        late = threading.Thread(target=lambda: answers.append(slow_api.sell(body)))
        late.start()
        assert held.fired.wait(5)
        first = fast_api.sell(body)
        assert first.json()["status"] == "accepted"
        path = f"/v1/tickets/{body['ticket_id']}"
        assert fast_api.call("POST", path + "/cancel").status_code == 200
        assert fast_api.staked(TEN[:8], draw) == 0
        release.set()
        late.join(10)
        assert answers, "the duplicate never answered"
        assert answers[0].status_code in (200, 503), answers[0].text
        if answers[0].status_code == 200:
            assert answers[0].content == first.content
        assert fast_api.staked(TEN[:8], draw) == 0
    finally:
        slow.stop()
        direct.stop()


async def test_two_janitors_racing_a_retry_never_release_the_new_sale(
        redis_server: RedisServer, standalone_db: redis.Redis, proxy: FaultProxy) -> None:
    """Janitor B seals an abandoned sale and is held before its release; janitor A settles
    it completely; the client's retry is a new sale and is accepted; then B's release runs:
    it touches nothing of the new sale (counter and ticket stay as the retry left them)."""
    direct = ServiceProcess(str(CONFIG), redis_server.url).start()
    stores: list[Store] = []
    try:
        client = Api(direct.base_url)
        draw = client.current()
        body = sale((TEN[:8], 500), (TEN[:9], 300))
        settings_ = load_settings(CONFIG)
        janitors = []
        for url in (proxy.url, redis_server.url):
            store = Store(Coalescer(url, timeout_s=10, library=lua_source()))
            stores.append(store)
            usecases = build_usecases(settings_, store)
            await usecases.clock.sync()
            janitors.append(past_deadline(usecases.janitor))
        janitor_b, janitor_a = janitors
        # The sale: first grid counted, second never sent.
        with FaultProxy("127.0.0.1", redis_server.port) as cut:
            seller = ServiceProcess(str(CONFIG), cut.url).start()
            try:
                cut.drop_request(reserve_of(TEN[:9]))
                unknown_outcome(Api(seller.base_url).sell(body))
            finally:
                seller.stop()
        release = threading.Event()
        held = proxy.hold_request(RELEASE, release)
        b_done = asyncio.ensure_future(janitor_b.run_once())
        assert await asyncio.to_thread(held.fired.wait, 5)
        assert await janitor_a.run_once() == 1
        retry = client.sell(body)
        assert retry.json()["status"] == "accepted"
        release.set()
        await b_done
        assert (client.staked(TEN[:8], draw), client.staked(TEN[:9], draw)) == (500, 300)
        path = f"/v1/tickets/{body['ticket_id']}"
        assert client.call("GET", path).content == retry.content
        assert client.call("POST", path + "/cancel").json()["released"] == 800
        assert (client.staked(TEN[:8], draw), client.staked(TEN[:9], draw)) == (0, 0)
    finally:
        for store in stores:
            await store.redis.aclose()
        direct.stop()


@pytest.fixture
def pair(redis_server: RedisServer, standalone_db: redis.Redis,
         proxy: FaultProxy) -> Iterator[tuple[Api, Api]]:
    """Two processes over one Redis: the first through the proxy, the second direct."""
    slow = ServiceProcess(str(CONFIG), proxy.url).start()
    direct = ServiceProcess(str(CONFIG), redis_server.url).start()
    yield Api(slow.base_url), Api(direct.base_url)
    direct.stop()
    slow.stop()


def in_background(call: Callable[[], requests.Response]) -> tuple[threading.Thread,
                                                                  list[requests.Response]]:
    answers: list[requests.Response] = []
    thread = threading.Thread(target=lambda: answers.append(call()))
    thread.start()
    return thread, answers


def test_a_sale_claimed_after_an_admin_stop_does_not_stand(
        pair: tuple[Api, Api], proxy: FaultProxy) -> None:
    """The claim is held on the wire while an admin stops the draw; once it lands (after
    the stop) the sale is refused and nothing it counted stays."""
    slow, direct = pair
    draw = direct.current()
    body = sale((TEN[:8], 500), first_draw=draw)
    release = threading.Event()
    held = proxy.hold_request(command("FCALL", "capsvc_claim"), release)
    thread, answers = in_background(lambda: slow.sell(body))
    assert held.fired.wait(5)
    assert direct.call("POST", f"/v1/games/fdj-keno/draws/{draw}/close",
                       token="admin").status_code == 200
    release.set()
    thread.join(10)
    assert answers[0].status_code == 422, answers[0].text
    assert answers[0].json()["error"]["code"] == "draw_closed"
    assert direct.staked(TEN[:8], draw) == 0
    assert direct.call("GET", f"/v1/tickets/{body['ticket_id']}").status_code == 404


def test_a_cancel_decided_after_an_admin_stop_is_refused(
        pair: tuple[Api, Api], proxy: FaultProxy) -> None:
    """The cancel is held on the wire while an admin stops the first draw; once it lands
    (after the stop was answered) it is refused and the stake stays counted."""
    slow, direct = pair
    draw = direct.current()
    body = sale((TEN[:8], 500), first_draw=draw)
    assert direct.sell(body).status_code == 200
    release = threading.Event()
    held = proxy.hold_request(command("FCALL", "capsvc_cancel"), release)
    path = f"/v1/tickets/{body['ticket_id']}/cancel"
    thread, answers = in_background(lambda: slow.call("POST", path))
    assert held.fired.wait(5)
    assert direct.call("POST", f"/v1/games/fdj-keno/draws/{draw}/close",
                       token="admin").status_code == 200
    release.set()
    thread.join(10)
    assert (answers[0].status_code, answers[0].json()["error"]["code"]) == (
        409, "not_cancellable")
    assert direct.staked(TEN[:8], draw) == 500


def partial_lnm_ticket(api: Api, player: str) -> dict[str, Any]:
    """Fill an LNM combination to its cap (50,000, charged to `player`) and return a ticket
    of that player that the cap will accept in part: one grid on the full combination, one
    on another (2,500 each)."""
    full = {"ticket_id": new_id("F"), "game": "lnm-keno", "player_id": player,
            "grids": [{"numbers": TEN[:8], "stake": 2500}] * 20}
    assert api.call("POST", "/v1/tickets", full, token="ma").json()["total_cost"] == 50000
    return {"ticket_id": new_id("F"), "game": "lnm-keno", "player_id": player,
            "grids": [{"numbers": TEN[:8], "stake": 2500}, {"numbers": TEN[:9], "stake": 2500}]}


def test_a_duplicates_late_settle_does_not_charge_a_cancelled_ticket_again(
        pair: tuple[Api, Api], proxy: FaultProxy) -> None:
    """A partial LNM ticket: a duplicate's budget settle is held on the wire; the ticket is
    decided and cancelled meanwhile (budget given back); the late settle then lands and
    charges nothing."""
    slow, direct = pair
    body = partial_lnm_ticket(direct, "P-LATE")
    release = threading.Event()
    held = proxy.hold_request(command("FCALL", "capsvc_settle"), release)
    thread, answers = in_background(lambda: slow.call("POST", "/v1/tickets", body, token="ma"))
    assert held.fired.wait(5)
    first = direct.call("POST", "/v1/tickets", body, token="ma")
    assert first.json()["status"] == "partial", first.text
    path = f"/v1/tickets/{body['ticket_id']}"
    assert direct.call("POST", path + "/cancel", token="ma").json()["released"] == 2500
    release.set()
    thread.join(10)
    assert answers[0].status_code in (200, 503), answers[0].text
    spent = direct.call("GET", "/v1/players/P-LATE", token="ma").json()["spent"]
    assert spent == 50000  # the filler ticket only


def test_the_sold_out_list_keeps_its_ttl_when_its_reply_is_lost(
        api: Api, proxy: FaultProxy, standalone_db: redis.Redis) -> None:
    """The sale that fills a combination adds it to the draw's sold-out list; with that
    step's reply lost, the list still expires with its draw (one atomic step)."""
    draw = api.current()
    for _ in range(4):
        assert api.sell(sale((TEN[:8], 1000))).status_code == 200
    rule = proxy.drop_reply(command("FCALL", "capsvc_sold_out"))
    api.sell(sale((TEN[:8], 1000)))
    assert rule.fired.wait(5)
    key = f"x:{{fdj-keno}}:{draw}"
    eventually(lambda: standalone_db.exists(key) == 1)
    assert standalone_db.pttl(key) > 0


def test_a_partial_sale_settles_the_budget_before_writing_its_decision(
        api: Api, proxy: FaultProxy, standalone_db: redis.Redis) -> None:
    """A partial LNM sale gives the refused grid's cost back before its decision is
    written: while that settle is held the ticket is still pending (a lost settle leaves
    it to a retry or the janitor, never a decision with the budget overcharged)."""
    body = partial_lnm_ticket(api, "P-ORDER")
    release = threading.Event()
    settle = proxy.hold_request(command("FCALL", "capsvc_settle"), release)
    thread, answers = in_background(lambda: api.call("POST", "/v1/tickets", body, token="ma"))
    assert settle.fired.wait(5)
    time.sleep(0.1)
    assert held(standalone_db, ticket_key("ma-retail", body["ticket_id"]), "st") == b"p"
    release.set()
    thread.join(10)
    assert answers[0].json()["status"] == "partial", answers[0].text
    spent = api.call("GET", "/v1/players/P-ORDER", token="ma").json()["spent"]
    assert spent == 50000 + 2500


def test_a_sale_concluded_by_the_janitor_puts_its_capped_combination_on_the_list(
        api: Api, proxy: FaultProxy) -> None:
    """The sale that fills a combination is answered 503 (its reserve reply came too late)
    and never retried: once the janitor has written its decision, the draw's sold-out list
    has the combination."""
    draw = api.current()
    for _ in range(4):
        assert api.sell(sale((TEN[:8], 1000))).status_code == 200
    body = sale((TEN[:8], 1000))
    proxy.delay_reply(RESERVE, 1.0)
    unknown_outcome(api.sell(body))
    eventually(lambda: api.call("GET", f"/v1/tickets/{body['ticket_id']}").status_code == 200)
    capped = api.call("GET", f"/v1/games/fdj-keno/draws/{draw}/capped").json()
    assert capped["combinations"] == [sorted(TEN[:8])]


# -- the one-call sale (standalone Redis, games without player limits) ----------------------

SELL = command("FCALL", "capsvc_sell")


@pytest.fixture
def one_call(proxy: FaultProxy) -> Iterator[Api]:
    """The service selling in one call, through the proxy."""
    yield from serve(ONE_CALL, proxy)


@pytest.mark.parametrize("fault", ["reply lost", "reply late", "request lost"])
def test_a_one_call_sale_whose_call_fails_converges_on_retry(
        one_call: Api, proxy: FaultProxy, redis_server: RedisServer, fault: str) -> None:
    """The one call ran and its reply was lost or came too late, or it never reached Redis:
    503 (outcome unknown); the retry answers one decision, counted once; GET says the same;
    nothing is left for the janitor (no pending state)."""
    api = one_call
    draw = api.current()
    body = sale((TEN[:8], 500), (TEN[:9], 300), (TEN[:3], 200))
    rule = {"reply lost": lambda: proxy.drop_reply(SELL),
            "reply late": lambda: proxy.delay_reply(SELL, 1.0),
            "request lost": lambda: proxy.drop_request(SELL)}[fault]()
    retry = retried(api, body, rule)
    ran = fault != "request lost"
    assert retry.headers.get("Idempotent-Replayed") == ("true" if ran else None)
    assert (api.staked(TEN[:8], draw), api.staked(TEN[:9], draw)) == (500, 300)
    assert api.call("GET", f"/v1/tickets/{body['ticket_id']}").content == retry.content
    db = redis_server.client()  # no pending state: nothing in the janitor's index
    assert not [k for k in db.scan_iter("p:*") if db.zscore(k, ticket_key("fr", body["ticket_id"]))]


def test_a_one_call_sale_cancelled_and_replayed_gives_back_once(
        one_call: Api, proxy: FaultProxy) -> None:
    """A one-call sale's decision is derived from its results: cancel it (its reply lost,
    then retried), replay it, GET it: the counters are given back once, the replay is the
    original decision and GET shows the cancellation."""
    api = one_call
    draw = api.current()
    body = sale((TEN[:8], 500), (TEN[:10], 1000))
    first = api.sell(body)
    assert first.status_code == 200
    rule = proxy.drop_reply(command("FCALL", "capsvc_cancel"))
    unknown_outcome(api.call("POST", f"/v1/tickets/{body['ticket_id']}/cancel"))
    assert rule.fired.wait(5)
    done = api.call("POST", f"/v1/tickets/{body['ticket_id']}/cancel")
    assert done.json() == {"ticket_id": body["ticket_id"], "status": "cancelled",
                           "released": 1500}
    assert (api.staked(TEN[:8], draw), api.staked(TEN[:10], draw)) == (0, 0)
    assert api.sell(body).content == first.content
    got = api.call("GET", f"/v1/tickets/{body['ticket_id']}").json()
    assert got["cancelled"]["released"] == 1500
    assert got["state"] == "cancelled"
    assert {k: v for k, v in got.items() if k not in ("cancelled", "state")} == first.json()
