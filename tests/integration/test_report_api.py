"""The audit's HTTP routes on a standalone Redis and on a Redis Cluster: a draw's report
(JSON and CSV) agrees with Redis while the draw is on sale, the reconciliation cancels the
abandoned tickets through the route, and every bad request is a clear 4xx that changes
nothing."""

from __future__ import annotations

import csv
import io

from tests.conftest import TEN, Client, ticket


async def test_the_report_of_the_draw_on_sale_agrees_with_redis_in_json_and_csv(
        client: Client) -> None:
    """Two sales and a cancel on the draw on sale: the report (not final) counts them, its
    totals equal Redis's counters (redis.complete), its CSV has the same figures."""
    draw = await client.current()
    kept, cancelled = ticket(first_draw=draw), ticket(first_draw=draw)
    for body in (kept, cancelled):
        assert (await client.sell(body)).status == 200
    assert (await client.post(f"/v1/tickets/{cancelled['ticket_id']}/cancel")).status == 200
    reply = await client.get(f"/v1/games/fdj-keno/draws/{draw}/report", token="read")
    assert reply.status == 200, reply.body
    report = reply.body
    assert (report["final"], report["activity"]) == (False, True)
    assert (report["tickets"]["accepted"], report["tickets"]["cancelled"]) == (1, 1)
    assert report["stake"] == 500
    assert report["redis"] == {"compared": 1, "complete": True, "differences": []}
    assert await client.staked(TEN[:8], draw) == report["top"][0]["staked"] == 500
    reply = await client.get(f"/v1/games/fdj-keno/draws/{draw}/report?format=csv",
                             token="admin")
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/csv")
    rows = {(r[0], r[1], r[2]): r[3] for r in csv.reader(io.StringIO(reply.raw.decode()))}
    assert rows["tickets", "accepted", "count"] == "1"
    assert rows["draw", "", "stake"] == "500"


async def test_the_reconcile_route_cancels_the_abandoned_tickets_it_is_asked_to(
        client: Client) -> None:
    """An export without one accepted ticket, cancel_abandoned=true: that ticket is
    cancelled (its stake released, GET says so); the export's ticket is untouched."""
    draw = await client.current()
    sold, abandoned = ticket(first_draw=draw), ticket(first_draw=draw)
    costs = {}
    for body in (sold, abandoned):
        reply = await client.sell(body)
        costs[body["ticket_id"]] = reply.body["total_cost"]
    export = f"channel,ticket_id,total_cost\nfr-retail,{sold['ticket_id']},500\n".encode()
    reply = await client.post(f"/v1/games/fdj-keno/draws/{draw}/reconcile?grace=0"
                              "&cancel_abandoned=true", data=export, token="admin")
    assert reply.status == 200, reply.body
    (item,) = reply.body["not_sold"]
    assert (item["ticket_id"], item["cancel"]) == (abandoned["ticket_id"],
                                                   "cancelled: 500 released")
    gone = await client.get(f"/v1/tickets/{abandoned['ticket_id']}")
    assert gone.body["cancelled"]["released"] == 500
    kept = await client.get(f"/v1/tickets/{sold['ticket_id']}")
    assert "cancelled" not in kept.body
    assert await client.staked(TEN[:8], draw) == 500


async def test_bad_report_and_reconcile_requests_are_clear_errors_that_change_nothing(
        client: Client) -> None:
    """Scopes (a seller cannot reconcile, a sell-only channel cannot read reports), a bad
    format, draw or parameter, an export that is not UTF-8 or not CSV of the columns: each
    its 4xx and code; the ticket sold meanwhile is not cancelled."""
    draw = await client.current()
    body = ticket(first_draw=draw)
    assert (await client.sell(body)).status == 200
    base = f"/v1/games/fdj-keno/draws/{draw}"
    header = b"channel,ticket_id,total_cost\n"
    cases = [
        ("GET", f"{base}/report", None, "pf", 403, "forbidden"),
        ("GET", f"{base}/report?format=xml", None, "read", 422, "invalid_request"),
        ("GET", "/v1/games/fdj-keno/draws/0/report", None, "read", 404, "not_found"),
        ("GET", "/v1/games/nope/draws/1/report", None, "admin", 404, "not_found"),
        ("POST", f"{base}/reconcile?cancel_abandoned=true", header, "fr", 403, "forbidden"),
        ("POST", f"{base}/reconcile?grace=soon", header, "admin", 422, "invalid_request"),
        ("POST", f"{base}/reconcile?cancel_abandoned=yes", header, "admin", 422,
         "invalid_request"),
        ("POST", f"{base}/reconcile?cancel_abandoned=true", b"\xff\xfe\x00", "admin", 422,
         "invalid_export"),
        ("POST", f"{base}/reconcile?cancel_abandoned=true", b"ticket,cost\n", "admin", 422,
         "invalid_export"),
        ("POST", f"{base}/reconcile?cancel_abandoned=true&grace=0",
         header + b"fr-retail,X-1,5.00\n", "admin", 422, "invalid_export"),
        ("POST", f"{base}/reconcile", b"", None, 401, "unauthorized"),
    ]
    for method, path, data, token, status, code in cases:
        reply = await client.request(method, path, data=data, token=token)
        assert (reply.status, reply.body["error"]["code"]) == (status, code), (path, data)
    stored = await client.get(f"/v1/tickets/{body['ticket_id']}")
    assert "cancelled" not in stored.body
    assert await client.staked(TEN[:8], draw) == 500
