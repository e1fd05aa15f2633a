"""The sale as a ticket record keeps it (validator.pack_sale / unpack_sale): every sale comes
back whole (the first draw asked or defaulted, the fingerprint with it), small enough for
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
from capsvc.domain.validator import (
    Sale,
    pack_sale,
    request_fingerprint,
    sale_fingerprint,
    unpack_sale,
    validate_ticket,
)
from tests.contract.conftest import CONFIG


@cache
def games() -> dict[str, GameRules]:
    return parse_settings(tomllib.loads(CONFIG.read_text()), str(CONFIG)).games


@st.composite
def sales(draw: st.DrawFn) -> tuple[Sale, TicketIn]:
    """A sale as stored (first draw resolved), and the request it was made from."""
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
    request = msgspec.convert(body, TicketIn)
    sale = validate_ticket(g, request)
    return msgspec.structs.replace(sale, first_draw=first), request


@settings(max_examples=500, deadline=None)
@given(sales())
def test_every_sale_comes_back_whole(case: tuple[Sale, TicketIn]) -> None:
    """The same sale back, whether its first draw was asked or not; and the fingerprint of
    the sale a record keeps is its request's: a retry of it is never refused as another
    request (409)."""
    sale, request = case
    back = unpack_sale(pack_sale(sale))
    assert back == sale
    assert back.asked == (request.first_draw is not None)
    assert sale_fingerprint(back) == request_fingerprint(request)


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
