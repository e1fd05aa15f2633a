"""A host clock set minutes off changes no decision: the service's only clock is Redis TIME.

Three `capsvc serve` processes share one Redis: one on the true time, one whose host clock
is 5 minutes ahead and one 5 minutes behind (libfaketime moves the process's wall clock;
the monotonic clock is left alone). They must agree on the draw on sale, accept the same
sales, leave a pending sale to its deadline, and honour an admin stop made by a skewed
host at once.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.conftest import TEN
from tests.integration.test_sale_faults import CONFIG, Api, reserve_of, sale, unknown_outcome
from tests.support.faults import FaultProxy
from tests.support.servers import RedisServer
from tests.support.service import ServiceProcess

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
SKEWS = ["+0", "+5m", "-5m"]

pytestmark = pytest.mark.skipif(
    not LIBFAKETIME.exists() and shutil.which("faketime") is None,
    reason="libfaketime is not installed (apt-get install faketime)")


def skewed(offset: str) -> dict[str, str]:
    """The environment of a process whose wall clock is `offset` off."""
    return {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": offset,
            "FAKETIME_DONT_FAKE_MONOTONIC": "1", "FAKETIME_NO_CACHE": "1"}


@pytest.fixture
def proxy(redis_server: RedisServer, standalone_db: redis.Redis) -> Iterator[FaultProxy]:
    with FaultProxy("127.0.0.1", redis_server.port) as p:
        yield p


@pytest.fixture
def apis(proxy: FaultProxy) -> Iterator[dict[str, Api]]:
    """A service per skew, all through one proxy to the session's Redis."""
    services = {s: ServiceProcess(str(CONFIG), proxy.url, env=skewed(s)).start() for s in SKEWS}
    yield {s: Api(svc.base_url) for s, svc in services.items()}
    for svc in services.values():
        svc.stop()


def current(api: Api, game: str) -> int:
    return int(api.call("GET", f"/v1/games/{game}/draws/current", token="admin").json()["draw"])


def test_skewed_hosts_agree_on_the_draw_on_sale_and_accept_the_same_sales(
        apis: dict[str, Api]) -> None:
    """Every process names the same current draw (a minute game, where 5 minutes is 5
    draws), and each accepts a sale for it, explicit or defaulted."""
    for _ in range(3):  # a draw may close between the three questions
        draws = {s: current(a, "minute-keno") for s, a in apis.items()}
        if len(set(draws.values())) == 1:
            break
    assert len(set(draws.values())) == 1, draws
    draw = draws["+0"]
    for skew, api in apis.items():
        explicit = api.sell({**sale((TEN[:8], 100)), "game": "minute-keno", "first_draw": draw})
        defaulted = api.sell({**sale((TEN[:9], 100)), "game": "minute-keno"})
        for resp in (explicit, defaulted):
            assert resp.status_code in (200, 422), (skew, resp.text)
            if resp.status_code == 422:  # only if the draw really closed meanwhile
                assert current(apis["+0"], "minute-keno") > draw
            else:
                assert resp.json()["draws"][0] >= draw, (skew, resp.text)


def test_a_janitor_on_a_host_ahead_leaves_a_pending_sale_to_its_deadline(
        apis: dict[str, Api], proxy: FaultProxy) -> None:
    """A sale cut after its first grid stays pending while janitors 5 minutes ahead and
    behind run many times; its retry completes it, counted once."""
    api = apis["+0"]
    draw = api.current()
    body = sale((TEN[:8], 500), (TEN[:9], 300))
    proxy.drop_request(reserve_of(TEN[:9]))
    unknown_outcome(api.sell(body))
    time.sleep(1.0)  # janitors run every 300 ms; the deadline is 3 s by Redis TIME
    pending = api.call("GET", f"/v1/tickets/{body['ticket_id']}")
    assert (pending.status_code, pending.json()["error"]["code"]) == (409, "ticket_pending")
    retry = api.sell(body)
    assert retry.json()["status"] == "accepted", retry.text
    assert (api.staked(TEN[:8], draw), api.staked(TEN[:9], draw)) == (500, 300)


def test_an_admin_stop_from_a_host_ahead_applies_at_once_everywhere(
        apis: dict[str, Api]) -> None:
    """A draw stopped through a host 5 minutes ahead: a host 5 minutes behind sees it
    closed, refuses new sales for it and refuses to cancel its tickets."""
    behind, ahead = apis["-5m"], apis["+5m"]
    draw = behind.current()
    body = sale((TEN[:8], 500), first_draw=draw)
    assert behind.sell(body).status_code == 200
    assert ahead.call("POST", f"/v1/games/fdj-keno/draws/{draw}/close",
                      token="admin").status_code == 200
    status = behind.call("GET", f"/v1/games/fdj-keno/draws/{draw}", token="admin").json()
    assert status["status"] == "closed"
    refused = behind.sell(sale((TEN[:9], 500), first_draw=draw))
    assert refused.json()["error"]["code"] == "draw_closed"
    cancel = behind.call("POST", f"/v1/tickets/{body['ticket_id']}/cancel")
    assert (cancel.status_code, cancel.json()["error"]["code"]) == (409, "not_cancellable")


def test_concurrent_skewed_sellers_never_pass_the_cap(apis: dict[str, Api]) -> None:
    """Sellers on the three hosts race on one combination: exactly the cap is sold (a 503,
    Redis slow on a loaded machine, is sent again with the same body, as the contract says)."""
    draw = apis["+0"].current()
    results: list[int] = []

    def seller(api: Api) -> None:
        for _ in range(8):
            body = sale((TEN, 300), first_draw=draw)
            resp = api.sell(body)
            while resp.status_code == 503:
                resp = api.sell(body)
            results.append(resp.json()["total_cost"] if resp.status_code == 200 else -1)

    threads = [threading.Thread(target=seller, args=(a,)) for a in apis.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert -1 not in results
    assert sum(results) == 16 * 300
    assert apis["+0"].staked(TEN, draw) == 4800
