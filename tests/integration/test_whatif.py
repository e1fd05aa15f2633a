"""`capsvc whatif` over a real service's journal: sellers on real HTTP (concurrent, a cap
reached on the hot combinations, some grids refused, a subscription, a cancel), then the
command over the journal the service wrote: the scenario of the cap in force is what the
sellers were answered, and the self-check passes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support.service import served

TOKEN = "t-whatif"
HOT = ([3, 7, 12, 18, 25, 33, 41, 56], [1, 2, 3, 4, 5, 6, 7, 8, 9],
       [10, 11, 20, 22, 30, 40, 50, 60, 65, 70])
"""Three combinations (8, 9 and 10 numbers, ascending as answered) every seller plays."""
CONFIG = f"""\
[journal]
settle = "0s"

[[games]]
id = "capped-keno"
preset = "fdj-keno-2008"
cap_limit = 2000

[[channels]]
id = "fr-retail"
token_sha256 = "{hashlib.sha256(TOKEN.encode()).hexdigest()}"
games = ["capped-keno"]
scopes = ["sell", "read"]
"""


def sell(base: str, body: dict[str, Any]) -> dict[str, Any]:
    r = requests.post(f"{base}/v1/tickets", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code in (200, 201), r.text
    out: dict[str, Any] = r.json()
    return out


@pytest.mark.slow
def test_the_scenario_of_the_cap_in_force_is_what_the_sellers_were_answered(
        tmp_path: Path) -> None:
    config = tmp_path / "capsvc.toml"
    config.write_text(CONFIG)
    answers: list[dict[str, Any]] = []
    with served(str(config)) as service:
        base = service.base_url
        first = sell(base, {"ticket_id": "W-0", "game": "capped-keno",
                            "grids": [{"numbers": HOT[0], "stake": 500}]})
        draw = first["draws"][0]
        answers.append(first)
        lock = threading.Lock()

        def seller(k: int) -> None:
            for i in range(12):
                grids = [{"numbers": HOT[(k + i) % 3], "stake": 500}]
                if i % 3 == 0:
                    grids.append({"numbers": [5, 15, 25, 35, 45], "stake": 200})
                out = sell(base, {"ticket_id": f"W-{k}-{i}", "game": "capped-keno",
                                  "first_draw": draw, "grids": grids})
                with lock:
                    answers.append(out)

        threads = [threading.Thread(target=seller, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        subscription = sell(base, {"ticket_id": "W-sub", "game": "capped-keno",
                                   "first_draw": draw, "draws": 2,
                                   "grids": [{"numbers": [2, 4, 6, 8, 10, 12, 14, 16],
                                              "stake": 300}]})
        answers.append(subscription)
        cancelled = sell(base, {"ticket_id": "W-cancelled", "game": "capped-keno",
                                "first_draw": draw,
                                "grids": [{"numbers": [9, 19, 29, 39, 49, 59, 69, 61],
                                           "stake": 1000}]})
        r = requests.post(f"{base}/v1/tickets/W-cancelled/cancel", timeout=30,
                          headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200, r.text
        journal = service.journal_dir
    live = [(g["status"], g.get("reason"), len(g["numbers"]), g["numbers"])
            for a in answers for g in a["grids"] if len(g["numbers"]) >= 8]
    accepted = [g for g in live if g[0] == "accepted"]
    refused = [g for g in live if g[1] == "combination_capped"]
    assert refused, "the cap was reached"
    assert cancelled["status"] == "accepted"
    stakes = {tuple(h): 500 for h in HOT} | {(2, 4, 6, 8, 10, 12, 14, 16): 300}

    out = subprocess.run(
        [sys.executable, "-m", "capsvc", "whatif", "--config", str(config), "--game",
         "capped-keno", "--draw", str(draw), "--dir", str(journal), "--cap", "2000",
         "--cap", "1000", "--cap", "3000", "--format", "json"],
        capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    what = json.loads(out.stdout)
    assert (what["game"], what["draw"], what["currency"]) == ("capped-keno", draw, "EUR")
    in_force, lower, higher = what["scenarios"]
    assert in_force["in_force"] is True
    assert not lower["in_force"]
    assert not higher["in_force"]
    assert in_force["grids_accepted"] == len(accepted)
    assert in_force["grids_refused"] == len(refused)
    assert in_force["stake_accepted"] == sum(stakes[tuple(g[3])] for g in accepted)
    assert in_force["stake_refused"] == sum(stakes[tuple(g[3])] for g in refused)
    assert in_force["top_stake"] == 2000
    assert in_force["combinations_at_cap"] == 3
    assert in_force["subscription_grids"] == 1
    # 10 numbers at 20 EUR: 20 x 200,000 EUR.
    assert in_force["top_liability"] == 400_000_000
    assert lower["grids_accepted"] == 3 * 2 + 1
    assert lower["top_stake"] == 1000
    assert higher["grids_refused"] == sum(1 for a in answers for g in a["grids"]
                                          if tuple(g["numbers"]) in map(tuple, HOT)) - 3 * 6
    text = subprocess.run(
        [sys.executable, "-m", "capsvc", "whatif", "--config", str(config), "--game",
         "capped-keno", "--draw", str(draw), "--dir", str(journal), "--cap", "2000"],
        capture_output=True, text=True, timeout=120, check=False)
    assert text.returncode == 0, text.stderr
    assert "* 20.00 EUR" in text.stdout
