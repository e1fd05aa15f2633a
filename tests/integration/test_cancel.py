"""POST /v1/tickets/{id}/cancel: release exactly what the ticket took, once."""

from __future__ import annotations

from tests.conftest import TEN, Client, new_id, ticket


async def test_cancel_releases_the_counters_once(client: Client) -> None:
    """Cancelling gives the stakes back; a replay of the cancel releases nothing more."""
    body = ticket([{"numbers": TEN, "stake": 500}, {"numbers": [1, 2, 3], "stake": 200}])
    other = ticket([{"numbers": TEN, "stake": 300}])
    sold = await client.sell(body)
    await client.sell(other)
    draw = sold.body["draws"][0]
    assert await client.staked(TEN, draw) == 800
    reply = await client.post(f"/v1/tickets/{body['ticket_id']}/cancel")
    assert reply.status == 200
    assert reply.body == {"ticket_id": body["ticket_id"], "status": "cancelled",
                          "released": sold.body["total_cost"]}
    assert await client.staked(TEN, draw) == 300
    again = await client.post(f"/v1/tickets/{body['ticket_id']}/cancel")
    assert again.status == 200
    assert again.body == reply.body
    assert await client.staked(TEN, draw) == 300


async def test_cancel_releases_only_accepted_grids(client: Client) -> None:
    """A partial ticket gives back its accepted grids, not the stakes it never took."""
    for _ in range(4):
        await client.sell(ticket([{"numbers": TEN, "stake": 1000}]))
    body = ticket([{"numbers": TEN, "stake": 1000}, {"numbers": TEN, "stake": 500}])
    sold = await client.sell(body)
    assert sold.body["status"] == "partial"
    draw = sold.body["draws"][0]
    await client.post(f"/v1/tickets/{body['ticket_id']}/cancel")
    assert await client.staked(TEN, draw) == 4000


async def test_cancel_subscription_releases_every_draw(client: Client) -> None:
    """FDJ allows cancelling a subscription before its first draw: all draws are released."""
    body = ticket([{"numbers": TEN, "stake": 500}], draws=5)
    sold = await client.sell(body)
    draws = sold.body["draws"]
    assert (await client.post(f"/v1/tickets/{body['ticket_id']}/cancel")).status == 200
    assert [await client.staked(TEN, d) for d in draws] == [0] * 5


async def test_replay_after_cancel_returns_original_decision(client: Client) -> None:
    """The decision never changes: a replayed sale after cancellation counts nothing."""
    body = ticket([{"numbers": TEN, "stake": 500}])
    sold = await client.sell(body)
    await client.post(f"/v1/tickets/{body['ticket_id']}/cancel")
    replay = await client.sell(body)
    assert replay.raw == sold.raw
    assert await client.staked(TEN, sold.body["draws"][0]) == 0


async def test_cancel_unknown_ticket_is_404(client: Client) -> None:
    """Unknown ticket: 404."""
    reply = await client.post(f"/v1/tickets/{new_id()}/cancel")
    assert reply.status == 404


async def test_cancel_of_a_rejected_ticket_is_not_allowed(client: Client) -> None:
    """Nothing accepted, nothing to cancel: 409 not_cancellable."""
    for _ in range(5):
        await client.sell(ticket([{"numbers": TEN, "stake": 1000}]))
    body = ticket([{"numbers": TEN, "stake": 100}])
    await client.sell(body)
    reply = await client.post(f"/v1/tickets/{body['ticket_id']}/cancel")
    assert reply.status == 409
    assert reply.body["error"]["code"] == "not_cancellable"


async def test_lnm_subscription_cannot_be_cancelled(client: Client) -> None:
    """LNM: subscriptions are never cancelled (no early interruption)."""
    body = ticket([{"numbers": TEN, "stake": 250}], game="lnm-keno", player_id="P-9", draws=2)
    assert (await client.sell(body, token="ma")).status == 200
    reply = await client.post(f"/v1/tickets/{body['ticket_id']}/cancel", token="ma")
    assert reply.status == 409
    assert reply.body["error"]["code"] == "not_cancellable"


async def test_lnm_single_draw_ticket_can_be_cancelled(client: Client) -> None:
    """LNM: a single-draw ticket may be cancelled until its draw closes."""
    body = ticket([{"numbers": TEN, "stake": 250}], game="lnm-keno", player_id="P-9",
                  first_draw=await client.current("lnm-keno") + 1)
    assert (await client.sell(body, token="ma")).status == 200
    reply = await client.post(f"/v1/tickets/{body['ticket_id']}/cancel", token="ma")
    assert reply.status == 200, reply.body


async def test_cancel_after_admin_close_is_refused(client: Client) -> None:
    """Once the first draw is closed (here by an admin), the ticket stands."""
    draw = await client.current()
    body = ticket([{"numbers": TEN, "stake": 500}], first_draw=draw + 1)
    await client.sell(body)
    assert (await client.post(f"/v1/games/fdj-keno/draws/{draw + 1}/close",
                              token="admin")).status == 200
    reply = await client.post(f"/v1/tickets/{body['ticket_id']}/cancel")
    assert reply.status == 409
    assert await client.staked(TEN, draw + 1) == 500


async def test_cancel_needs_sell_scope(client: Client) -> None:
    """A read-only channel may not cancel."""
    reply = await client.post(f"/v1/tickets/{new_id()}/cancel", token="read")
    assert reply.status == 403


async def test_a_cancelled_ticket_says_so_in_a_field_to_switch_on(client: Client) -> None:
    """GET of a cancelled ticket: `state: "cancelled"` beside its `cancelled` member, the
    decision's own `status` kept; before the cancel, and in every POST replay, no `state`
    (the decision as answered)."""
    draw = await client.current()
    body = ticket([{"numbers": TEN[:8], "stake": 500}], first_draw=draw + 1)
    sold = await client.sell(body)
    assert "state" not in (await client.get(f"/v1/tickets/{body['ticket_id']}")).body
    assert (await client.post(f"/v1/tickets/{body['ticket_id']}/cancel")).status == 200
    looked = (await client.get(f"/v1/tickets/{body['ticket_id']}")).body
    assert looked["state"] == "cancelled"
    assert looked["status"] == "accepted"
    assert looked["cancelled"]["released"] == 500
    replay = await client.sell(body)
    assert replay.raw == sold.raw
    assert "state" not in replay.body
