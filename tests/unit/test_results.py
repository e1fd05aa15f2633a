"""A decision's results (capsvc.domain.decisions.results_of): what a journal's `sales` line
keeps of every sale's first answer, whichever protocol made it, and renders the answer
from again (decision_of), byte for byte."""

from __future__ import annotations

import random
from pathlib import Path
from zoneinfo import ZoneInfo

import msgspec

from capsvc.client.models import TicketIn
from capsvc.config import load_settings
from capsvc.domain.decisions import (
    ACCEPTED,
    REJECTED,
    SHADOWED,
    Reserved,
    build_decision,
    decision_of,
    player_limit_decision,
    results_of,
)
from capsvc.domain.validator import validate_ticket

GAMES = load_settings(Path(__file__).parents[1] / "capsvc-test.toml").games
ZONES = ["Europe/Paris", "Africa/Casablanca", "Pacific/Tahiti", "UTC"]


def test_results_render_the_answer_they_were_taken_from() -> None:
    """Random sales (1-5 grids of capped and other sizes, subscriptions, multipliers,
    Joker+) and replies (accepted, accepted over a shadow, refused by the cap on any draw
    with any room, refused by the player's limit), in any time zone: the body rendered from
    the results is the body answered."""
    rng = random.Random(3)
    for i in range(500):
        game = GAMES[rng.choice(["fdj-keno", "lnm-keno"])]
        grids = []
        for _ in range(rng.randint(1, 5)):
            picks = rng.randint(game.picks_min, game.picks_max)
            grids.append({"numbers": rng.sample(range(1, game.numbers + 1), picks),
                          "stake": rng.choice(game.stakes),
                          "multiplier": game.multiplier and rng.random() < 0.3})
        body = {"ticket_id": f"R-{i}", "game": game.id, "draws": rng.choice(game.durations),
                "grids": grids, "first_draw": 1000 + i}
        if game.daily_limit is not None:
            body["player_id"] = f"P-{i}"
        sale = validate_ticket(game, msgspec.convert(body, TicketIn))
        zone, sid, at = rng.choice(ZONES), f"{rng.getrandbits(64):016x}", 1_796_000_000_000 + i
        if game.daily_limit is not None and rng.random() < 0.1:
            answered = player_limit_decision(sale)
            results = results_of(zone, None)
        else:
            replies = [None if not g.capped else rng.choice([
                Reserved(ACCEPTED, near=rng.randint(0, 1)), Reserved(SHADOWED),
                Reserved(REJECTED, offset=rng.randrange(sale.draws),
                         room=rng.randrange(0, 5000, 50))]) for g in sale.grids]
            answered = build_decision("fr-retail", ZoneInfo(zone), sale, sid, at, replies)
            results = results_of(zone, replies)
        assert msgspec.json.encode(decision_of("fr-retail", sale, sid, at, results)) == \
            msgspec.json.encode(answered), (body, results)
