"""A decision's results (capsvc.domain.decisions.results_of): what a journal's `sales` line
keeps of every sale's first answer, whichever protocol made it, and what its body is
rendered from (render), byte for byte msgspec's encoding of the TicketOut the contract
describes."""

from __future__ import annotations

import random
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import msgspec
import pytest

from capsvc.client.models import GridOut, Receipt, TicketIn, TicketOut
from capsvc.config import load_settings
from capsvc.domain import decisions
from capsvc.domain.decisions import (
    ACCEPTED,
    CLOSED,
    REJECTED,
    RELEASED,
    SHADOWED,
    Reserved,
    Verdict,
    receipt_id,
    render,
    results_of,
)
from capsvc.domain.errors import ApiError
from capsvc.domain.validator import Sale, validate_ticket

GAMES = load_settings(Path(__file__).parents[1] / "capsvc-test.toml").games
ZONES = ["Europe/Paris", "Africa/Casablanca", "Pacific/Tahiti", "UTC"]


def expected(sale: Sale, sid: str, at: int, zone: str, replies: list[Reserved | None] | None
             ) -> TicketOut:
    """The decision the contract describes, built field by field (the reference the
    rendered bytes are held to)."""
    assert sale.first_draw is not None
    first, draws = sale.first_draw, list(range(sale.first_draw,
                                                sale.first_draw + sale.draws))
    if replies is None:
        return TicketOut(ticket_id=sale.ticket_id, game=sale.game, status="rejected",
                         reason="player_limit", draws=draws, total_cost=0, receipt=None,
                         grids=[GridOut(index=g.index, numbers=list(g.numbers),
                                        status="rejected", reason="player_limit")
                                for g in sale.grids])
    grids, total = [], 0
    for g, r in zip(sale.grids, replies, strict=True):
        if r is None or r.accepted:
            grids.append(GridOut(index=g.index, numbers=list(g.numbers), status="accepted",
                                 cost=g.cost))
            total += g.cost
        else:
            grids.append(GridOut(index=g.index, numbers=list(g.numbers), status="rejected",
                                 reason="combination_capped", draw=first + r.offset,
                                 remaining=r.room))
    accepted = sum(g.status == "accepted" for g in grids)
    issued = datetime.fromtimestamp(at / 1000, ZoneInfo(zone)).isoformat(
        timespec="milliseconds" if at % 1000 else "seconds")
    return TicketOut(
        ticket_id=sale.ticket_id, game=sale.game, draws=draws, grids=grids,
        status="accepted" if accepted == len(grids) else "partial" if accepted else "rejected",
        total_cost=total + sale.joker_cost if accepted else 0,
        receipt=Receipt(receipt_id("fr-retail", sale.ticket_id, sid), issued)
        if accepted else None)


def test_results_render_the_decision_the_contract_describes_byte_for_byte() -> None:
    """Random sales (1-5 grids of capped and other sizes, subscriptions, multipliers,
    Joker+) and replies (accepted, accepted over a shadow,
    refused by the cap on any draw with any room, refused by the player's limit), in any
    time zone, at instants with and without milliseconds, several sales at one instant (a
    batch's): the body rendered from the results is msgspec's encoding of the decision
    built field by field, and the verdict the metrics tally says what it says."""
    rng = random.Random(3)
    at, rendered_n = 1_796_000_000_000, 0
    for i in range(1500):
        game = GAMES[rng.choice(["fdj-keno", "lnm-keno"])]
        grids = []
        for _ in range(rng.randint(1, 5)):
            picks = rng.randint(game.picks_min, game.picks_max)
            grids.append({"numbers": rng.sample(range(1, game.numbers + 1), picks),
                          "stake": rng.choice(game.stakes),
                          "multiplier": game.multiplier and rng.random() < 0.3})
        ticket = rng.choice([f"R-{i}", f"R.{i}:x_Y"])
        body = {"ticket_id": ticket, "game": game.id, "draws": rng.choice(game.durations),
                "grids": grids, "first_draw": 1000 + i, "joker_plus": rng.random() < 0.2}
        if game.daily_limit is not None:
            body["player_id"] = f"P-{i}"
        try:
            sale = validate_ticket(game, msgspec.convert(body, TicketIn))
        except ApiError:  # a Joker+ the game does not offer
            continue
        if rng.random() < 0.7:  # else the batch's instant again
            at += rng.choice([1, 1000, 86_400_000 + 7])
        zone, sid = rng.choice(ZONES), f"{rng.getrandbits(64):016x}"
        replies: list[Reserved | None] | None = None
        if game.daily_limit is None or rng.random() > 0.1:
            replies = [None if not g.capped else rng.choice([
                Reserved(ACCEPTED, near=rng.randint(0, 1)), Reserved(SHADOWED),
                Reserved(REJECTED, offset=rng.randrange(sale.draws),
                         room=rng.randrange(0, 5000, 50))]) for g in sale.grids]
        rendered, verdict = render("fr-retail", sale, sid, at, results_of(zone, replies))
        rendered_n += 1
        want = expected(sale, sid, at, zone, replies)
        assert rendered == msgspec.json.encode(want), (body, replies)
        assert verdict == Verdict(
            sale.game, want.status, want.total_cost,
            sum(g.status == "accepted" for g in want.grids),
            tuple(len(g.numbers) for g in want.grids if g.reason == "combination_capped"),
            replies is None, len(want.grids))
    assert rendered_n > 1000


@pytest.mark.parametrize("kind", [CLOSED, RELEASED])
def test_a_grid_neither_accepted_nor_rejected_has_no_decision(kind: int) -> None:
    """A reply of a draw closed mid-sale (or a record released) renders no decision: 422."""
    with pytest.raises(ApiError) as e:
        results_of("UTC", [Reserved(ACCEPTED), Reserved(kind)])
    assert e.value.code == "draw_closed"


def test_a_render_keeps_its_own_instant_whatever_renders_meanwhile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another render in the middle of one (a report's thread renders the journal's
    decisions while the event loop answers sales), at another instant in another zone:
    each body has its own instant, as rendered alone."""
    game = GAMES["fdj-keno"]
    sale = validate_ticket(game, msgspec.convert(
        {"ticket_id": "T-1", "game": "fdj-keno", "first_draw": 7,
         "grids": [{"numbers": [*range(1, 9)], "stake": game.stakes[0]}]}, TicketIn))
    results = b"Europe/Paris|1"
    alone = {at: render("fr-retail", sale, "ab" * 8, at, results)[0]
             for at in (1_796_000_000_123, 1_796_000_999_456)}
    real = decisions.receipt_id
    inner: list[bytes] = []
    armed = [False]

    def meanwhile(channel: str, ticket: str, sale_id: str) -> str:
        if armed[0]:  # the other render, between this one's instant and its receipt
            armed[0] = False
            inner.append(render("fr-retail", sale, "ab" * 8, 1_796_000_999_456,
                                b"Pacific/Tahiti|1")[0])
        return real(channel, ticket, sale_id)

    monkeypatch.setattr(decisions, "receipt_id", meanwhile)
    render("fr-retail", sale, "ab" * 8, 1_796_000_999_456, results)  # the cache's instant
    armed[0] = True
    assert render("fr-retail", sale, "ab" * 8, 1_796_000_000_123, results)[0] == \
        alone[1_796_000_000_123]
    assert inner
    assert b"-10:00" in inner[0]
