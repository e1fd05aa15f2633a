"""Chaos: concurrent sales with retries and cancels while processes and Redis are killed.

Two `capsvc serve` processes (each with its janitor) over one Redis with AOF `always`.
Sixteen clients sell a few hundred tickets on three hot combinations, retrying on 503 and
on broken connections as a sales system would, and cancel some; a few sales are abandoned
after one try. Meanwhile a service is killed with SIGKILL and restarted, and so is Redis.
Once no request is in flight and no ticket pending, every counter equals the stakes of the
accepted, uncancelled grids (as GET tells each ticket), and none exceeds the cap.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from capsvc.domain import combination
from capsvc.redis.store import bucket_keys
from tests.conftest import TEN, TOKENS, new_id
from tests.support.servers import RedisServer
from tests.support.service import ServiceProcess

CONFIG = Path(__file__).parent.parent / "capsvc-faults.toml"
HOT = [TEN[:8], TEN[:9], TEN]
CAP = 5000
SETTLED_WITHIN_S = 60.0
"""How long the requests in flight and the janitors (deadline 3 s) may take to settle
before the test fails (a hang, not a speed)."""


def in_flight(base: str) -> float:
    """`capsvc_http_requests_in_flight` of a service."""
    text = requests.get(f"{base}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("capsvc_http_requests_in_flight"))


class Chaos:
    def __init__(self, tmp: Path) -> None:
        (tmp / "redis").mkdir()
        self.redis = RedisServer(directory=str(tmp / "redis"),
                                 extra=("--appendfsync", "always")).start()
        self.services = [ServiceProcess(str(CONFIG), self.redis.url).start() for _ in range(2)]
        self.draw = 0
        self.lock = threading.Lock()
        self.sold: dict[str, dict[str, Any]] = {}
        self.failures = 0
        """Answers a sales system would retry (503, broken connections)."""

    def url(self, i: int) -> str:
        return self.services[i % 2].base_url

    def call(self, method: str, path: str, body: Any = None, *, tries: int = 60,
             timeout: float = 5.0) -> requests.Response | None:
        """Like a sales system: same request again on 503 or a broken connection, on
        either process."""
        for attempt in range(tries):
            try:
                resp = requests.request(
                    method, self.url(attempt + random.randrange(2)) + path, json=body,
                    timeout=timeout, headers={"Authorization": f"Bearer {TOKENS['fr']}"})
            except requests.RequestException:
                resp = None
            if resp is not None and resp.status_code != 503:
                return resp
            with self.lock:
                self.failures += 1
            time.sleep(0.2)
        return None

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(25):
            time.sleep(rng.uniform(0.05, 0.15))  # spread the sales over the kills
            grids = [{"numbers": rng.choice(HOT), "stake": rng.choice([300, 500, 1000])}
                     for _ in range(rng.randint(1, 2))]
            body = {"ticket_id": new_id("C"), "game": "fdj-keno", "first_draw": self.draw,
                    "grids": grids}
            with self.lock:
                self.sold[body["ticket_id"]] = body
            if rng.random() < 0.05:  # abandoned after one short try: the janitor settles it
                self.call("POST", "/v1/tickets", body, tries=1, timeout=0.05)
                continue
            resp = self.call("POST", "/v1/tickets", body)
            assert resp is not None, "a sale never got an answer"
            assert resp.status_code == 200, resp.text
            if rng.random() < 0.3 and resp.json()["total_cost"]:
                cancel = self.call("POST", f"/v1/tickets/{body['ticket_id']}/cancel")
                assert cancel is not None
                assert cancel.status_code == 200, cancel.text

    def kill_and_restart(self) -> None:
        time.sleep(1.0)
        victim = self.services[0]
        assert victim.process is not None
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait()
        time.sleep(0.5)
        self.services[0] = ServiceProcess(str(CONFIG), self.redis.url, port=victim.port).start()
        time.sleep(1.0)
        self.redis.kill()
        time.sleep(0.5)
        self.redis.start()

    def idle(self) -> None:
        """Until neither service has a request in flight: an abandoned sale runs on after
        its client gave up, until it is decided or cut by the request timeout."""
        deadline = time.monotonic() + SETTLED_WITHIN_S
        for service in self.services:
            while in_flight(service.base_url):
                assert time.monotonic() < deadline, "requests in flight for ever"
                time.sleep(0.05)

    def settled(self, tid: str) -> requests.Response:
        """GET of a ticket, again while it is pending (409: abandoned half-way, the
        janitors settle it once their deadline has passed)."""
        deadline = time.monotonic() + SETTLED_WITHIN_S
        while True:
            got = self.call("GET", f"/v1/tickets/{tid}")
            assert got is not None
            if got.status_code != 409 or time.monotonic() > deadline:
                return got
            time.sleep(0.2)

    def stop(self) -> None:
        for s in self.services:
            s.stop()
        self.redis.stop()


@pytest.mark.slow
def test_counters_equal_accepted_minus_released_through_kills(tmp_path: Path) -> None:
    """Through SIGKILLs of a service and of Redis, retries, cancels and abandoned sales,
    every counter ends equal to accepted minus released, never above the cap."""
    chaos = Chaos(tmp_path)
    try:
        current = requests.get(chaos.url(0) + "/v1/games/fdj-keno/draws/current", timeout=5,
                               headers={"Authorization": f"Bearer {TOKENS['admin']}"})
        chaos.draw = int(current.json()["draw"])
        with ThreadPoolExecutor(17) as pool:
            killer = pool.submit(chaos.kill_and_restart)
            for f in [pool.submit(chaos.client, seed) for seed in range(16)]:
                f.result()
            killer.result()
        assert chaos.failures > 0, "the kills hit no request: the test proved nothing"
        chaos.idle()
        expected: dict[tuple[int, ...], int] = defaultdict(int)
        for tid in chaos.sold:
            got = chaos.settled(tid)
            assert got.status_code in (200, 404), got.text
            if got.status_code == 404:
                continue  # abandoned before a decision, released by the janitor
            decision = got.json()
            if "cancelled" in decision:
                continue
            for g in decision["grids"]:
                if g["status"] == "accepted":
                    expected[tuple(g["numbers"])] += g["cost"]
        db = chaos.redis.client()
        for numbers in HOT:
            combo = combination.encode(numbers)
            (key,) = bucket_keys("fdj-keno", combo, chaos.draw, 1)
            counted = int(db.hget(key, combo) or 0)
            assert counted == expected[tuple(numbers)], (numbers, counted, expected)
            assert counted <= CAP
    finally:
        chaos.stop()

