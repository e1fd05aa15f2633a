"""The sale as a ticket record keeps it (validator.pack_sale / unpack_sale): every sale comes
back whole (the fingerprint recomputed, the first draw asked or defaulted), small enough for
Redis to keep a record of one or two grids as a listpack (values of at most 64 bytes)."""

from __future__ import annotations

import tomllib
from functools import cache
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from capsvc.client.models import TicketIn
from capsvc.config import GameRules, parse_settings
from capsvc.domain.validator import Sale, pack_sale, unpack_sale, validate_ticket
from tests.contract.conftest import CONFIG


@cache
def games() -> dict[str, GameRules]:
    return parse_settings(tomllib.loads(CONFIG.read_text()), str(CONFIG)).games


@st.composite
def sales(draw: st.DrawFn) -> tuple[Sale, bool]:
    """A sale as stored (first draw resolved), and whether the request named its draw."""
    g = games()[draw(st.sampled_from(["fdj-keno", "lnm-keno"]))]
    grids = draw(st.lists(st.fixed_dictionaries({
        "numbers": st.lists(st.integers(1, g.numbers), min_size=g.picks_min,
                            max_size=g.picks_max, unique=True),
        "stake": st.sampled_from(g.stakes),
        "multiplier": st.booleans() if g.multiplier else st.just(False)}),
        min_size=1, max_size=g.max_grids))
    asked = draw(st.booleans())
    first = draw(st.integers(1, 10**6))
    body: dict[str, Any] = {
        "ticket_id": draw(st.from_regex(r"[A-Za-z0-9._:-]{1,64}", fullmatch=True)),
        "game": g.id, "grids": grids, "draws": draw(st.sampled_from(g.durations)),
        "first_draw": first if asked else None,
        "joker_plus": draw(st.booleans()) if g.joker_plus_price else False}
    if g.daily_limit is not None:
        body["player_id"] = draw(st.from_regex(r"[A-Za-z0-9._:-]{1,64}", fullmatch=True))
    sale = validate_ticket(g, msgspec.convert(body, TicketIn))
    return msgspec.structs.replace(sale, first_draw=first), asked


@settings(max_examples=500, deadline=None)
@given(sales())
def test_every_sale_comes_back_whole(case: tuple[Sale, bool]) -> None:
    """Packed by a sale being made (which says whether its draw was asked) or from the
    journal (found out from the fingerprint): the same bytes, the same sale back."""
    sale, asked = case
    assert pack_sale(sale, asked) == pack_sale(sale)
    assert unpack_sale(pack_sale(sale, asked)) == sale


def test_a_fingerprint_of_another_algorithm_is_kept() -> None:
    sale = validate_ticket(games()["fdj-keno"], msgspec.convert(
        {"ticket_id": "T-1", "game": "fdj-keno", "grids": [{"numbers": [1, 2], "stake": 100}]},
        TicketIn))
    foreign = msgspec.structs.replace(sale, first_draw=7, fingerprint="f" * 32)
    assert unpack_sale(pack_sale(foreign)) == foreign


def test_records_of_one_or_two_grids_stay_under_redis_listpack_value_limit() -> None:
    ten = [3, 7, 12, 18, 25, 33, 41, 56, 60, 70]
    for grids in (1, 2):
        sale = validate_ticket(games()["fdj-keno"], msgspec.convert(
            {"ticket_id": "A-00000123", "game": "fdj-keno",
             "grids": [{"numbers": ten, "stake": 1000, "multiplier": True}] * grids},
            TicketIn))
        packed = pack_sale(msgspec.structs.replace(sale, first_draw=13179))
        assert len(packed) <= 64, (grids, len(packed))
        assert len(packed) < len(msgspec.json.encode(sale)) / 3
