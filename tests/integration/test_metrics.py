"""/metrics after real sales: counters move by exactly what was sold."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from capsvc.http.server import Service
from tests.conftest import TEN, Client, ticket


async def scrape(client: Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reply = await client.get("/metrics", token=None)
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(reply.raw.decode())
            for s in family.samples}


def delta(after: dict[tuple[str, tuple[tuple[str, str], ...]], float],
          before: dict[tuple[str, tuple[tuple[str, str], ...]], float],
          name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


async def test_counters_move_by_what_was_sold(service: tuple[Service, str],
                                              client: Client) -> None:
    """Tickets, grids, reasons, stake, caps, near-caps and latency counts add up exactly."""
    before = await scrape(client)
    for _ in range(4):  # 4 x 10 EUR: the 4th brings the counter to 80 %
        await client.sell(ticket([{"numbers": TEN, "stake": 1000}]))
    await client.sell(ticket([{"numbers": TEN, "stake": 1000}, {"numbers": [1, 2], "stake": 100}]))
    await client.sell(ticket([{"numbers": TEN, "stake": 100}]))  # capped: rejected
    await client.sell(ticket([{"numbers": TEN[:9], "stake": 700}]))  # 422, no decision
    limited = ticket([{"numbers": [1, 2], "stake": 250}], game="lnm-keno", player_id="P-M")
    await client.request("PUT", "/v1/players/P-M/limit", {"daily": 100}, token="ma")
    await client.sell(limited, token="ma")
    after = await scrape(client)
    m = "capsvc_tickets_total"
    assert delta(after, before, m, game="fdj-keno", status="accepted") == 5
    assert delta(after, before, m, game="fdj-keno", status="rejected") == 1
    assert delta(after, before, m, game="lnm-keno", status="rejected") == 1
    g = "capsvc_grids_total"
    assert delta(after, before, g, game="fdj-keno", status="accepted", reason="") == 6
    assert delta(after, before, g, game="fdj-keno", status="rejected",
                 reason="combination_capped") == 1
    assert delta(after, before, "capsvc_accepted_stake_total", game="fdj-keno") == 5100
    assert delta(after, before, "capsvc_combinations_capped_total", game="fdj-keno") == 1
    assert delta(after, before, "capsvc_near_cap_total", game="fdj-keno") == 1
    assert delta(after, before, "capsvc_cap_rejections_total", game="fdj-keno",
                 picks="10") == 1
    assert delta(after, before, "capsvc_player_limit_rejections_total", game="lnm-keno") == 1
    h = "capsvc_http_request_duration_seconds_count"
    assert delta(after, before, h, route="/v1/tickets", method="POST", status="200") == 7
    assert delta(after, before, h, route="/v1/tickets", method="POST", status="422") == 1
    assert after[("capsvc_build_info", (("version", "0.1.0"),))] == 1
    assert delta(after, before, "capsvc_redis_batch_size_count") > 0
    text = (await client.get("/metrics", token=None)).raw.decode()
    assert "P-M" not in text  # no player as a label
    assert "T-" not in text  # no ticket as a label


async def test_every_series_of_the_dashboards_exists_from_the_start(
        service: tuple[Service, str], client: Client) -> None:
    """Before any sale or error, the series the dashboard and the alerts use are exported
    at 0: Redis errors by kind, player-limit rejections, decisions by game and status."""
    metrics = await scrape(client)
    for kind in ("timeout", "connection", "reply"):
        assert metrics[("capsvc_redis_errors_total", (("kind", kind),))] == 0
    assert metrics[("capsvc_player_limit_rejections_total", (("game", "lnm-keno"),))] == 0
    for status in ("accepted", "partial", "rejected"):
        assert ("capsvc_tickets_total", (("game", "fdj-keno"), ("status", status))) in metrics
    assert ("capsvc_cap_rejections_total", (("game", "fdj-keno"), ("picks", "8"))) in metrics
