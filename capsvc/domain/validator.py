"""The rules of a sale, as pure functions: a decoded request in, a normalized sale out.

No I/O here. Every rule error carries its code and the JSONPath of the offending value,
and is raised before anything touches Redis.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import msgspec
from msgspec import Struct

from capsvc.client.models import AvailabilityIn, TicketIn
from capsvc.config import GameRules
from capsvc.domain import combination
from capsvc.domain.errors import ApiError, rule_error

_encode = msgspec.json.encode
_NUMBERS_PATH_RE = re.compile(r"^[0-9]{1,3}(?:-[0-9]{1,3})*\Z")


class SaleGrid(Struct, frozen=True, array_like=True, gc=False):
    """One grid of a sale, normalized, with its price."""

    index: int
    numbers: tuple[int, ...]
    combo: str
    stake: int
    multiplier: bool
    cost: int
    capped: bool
    """Whether the game counts this grid's combination against the cap."""


class Sale(Struct, frozen=True, array_like=True, gc=False):
    """A ticket that passed every rule that does not depend on Redis.

    Stored (compactly, array-like) in the ticket record with `first_draw` resolved, so that
    a resumed request or the janitor can rebuild the decision or release what it took.
    """

    ticket_id: str
    game: str
    player_id: str | None
    first_draw: int | None
    draws: int
    grids: tuple[SaleGrid, ...]
    joker_plus: bool
    joker_cost: int
    asked: bool
    """Whether the request named its first draw (else the service chose it): part of what
    the request asks (`sale_fingerprint`)."""

    @property
    def requested_cost(self) -> int:
        """What the ticket costs if every grid is accepted."""
        return sum(g.cost for g in self.grids) + self.joker_cost


def check_numbers(rules: GameRules, numbers: list[int], path: str) -> tuple[int, ...]:
    """Numbers of one grid: right count, inside the matrix, distinct. Returns them sorted."""
    if not rules.picks_min <= len(numbers) <= rules.picks_max:
        raise rule_error(
            "picks_not_allowed",
            f"a grid has {rules.picks_min} to {rules.picks_max} numbers, got {len(numbers)}",
            path,
        )
    if len(set(numbers)) == len(numbers) and min(numbers) >= 1 and max(numbers) <= rules.numbers:
        return tuple(sorted(numbers))
    seen: set[int] = set()  # find the first offending number, for its path
    for j, n in enumerate(numbers):
        if not 1 <= n <= rules.numbers:
            raise rule_error(
                "number_out_of_range", f"numbers go from 1 to {rules.numbers}, got {n}",
                f"{path}[{j}]",
            )
        if n in seen:
            raise rule_error("duplicate_numbers", f"number {n} appears twice", f"{path}[{j}]")
        seen.add(n)
    return tuple(sorted(numbers))


def check_stake(rules: GameRules, stake: int, path: str) -> None:
    if stake not in rules.stakes:
        allowed = ", ".join(str(s) for s in rules.stakes)
        raise rule_error("stake_not_allowed", f"stake must be one of {allowed}, got {stake}", path)


def check_draws(rules: GameRules, draws: int) -> None:
    if draws not in rules.durations:
        allowed = ", ".join(str(d) for d in rules.durations)
        raise rule_error(
            "draws_not_allowed", f"draws must be one of {allowed}, got {draws}", "$.draws"
        )


def check_grid_count(rules: GameRules, count: int) -> None:
    if count > rules.max_grids:
        raise rule_error(
            "too_many_grids", f"at most {rules.max_grids} grids per ticket, got {count}", "$.grids"
        )


def _grid_error(rules: GameRules, numbers: list[int], stake: int, multiplier: bool,
                path: str) -> None:
    """Raise the first rule a grid breaks, with the JSONPath of the offending value."""
    check_numbers(rules, numbers, f"{path}.numbers")
    check_stake(rules, stake, f"{path}.stake")
    if multiplier and not rules.multiplier:
        raise rule_error("option_not_available", f"game {rules.id} has no multiplier option",
                         f"{path}.multiplier")


def sale_fingerprint(sale: Sale) -> str:
    """The fingerprint of the request `sale` was made from (`fingerprint_of`): worked out
    only when a ticket id already holds a sale, never on a new sale's path."""
    return fingerprint_of(sale.game, sale.player_id, sale.first_draw if sale.asked else None,
                          sale.draws, sale.joker_plus,
                          [(g.combo, g.stake, g.multiplier) for g in sale.grids])


def _fingerprint(t: TicketIn, combos: list[str]) -> str:
    """The request's identity for idempotency: what it asks, with each grid's numbers as a
    set (3-7-12 is 12-3-7)."""
    return fingerprint_of(t.game, t.player_id, t.first_draw, t.draws, t.joker_plus,
                           [(c, g.stake, g.multiplier)
                            for c, g in zip(combos, t.grids, strict=True)])


def fingerprint_of(game: str, player_id: str | None, first_draw: int | None, draws: int,
                    joker_plus: bool, grids: list[tuple[str, int, bool]]) -> str:
    """The fingerprint of a request from what it asks (grids: combination, stake,
    multiplier, in its order): a retry with another meaning is refused against it."""
    canonical = _encode((game, player_id, first_draw, draws, joker_plus, grids))
    return hashlib.blake2b(canonical, digest_size=16).hexdigest()


# -- the sale as the ticket record keeps it ---------------------------------------------

_pack = msgspec.msgpack.Encoder().encode
_unpack = msgspec.msgpack.Decoder(list[Any]).decode
_MULTIPLIER, _CAPPED = 1, 2


def pack_sale(sale: Sale) -> bytes:
    """The sale as the ticket record keeps it (`sale`), compact so that the record stays a
    small listpack in Redis (values of at most 64 bytes for tickets of one or two grids):
    MessagePack `[ticket_id, game, player_id, first_draw, draws, joker_plus, joker_cost,
    [[numbers (bytes), stake, flags], ...]]`, `first_draw` negative when the request left
    it to the service (`asked` false). What can be derived is not kept: each grid's index
    (its place), combination (its numbers) and cost (stake x multiplier x draws). Read by
    `unpack_sale`."""
    assert sale.first_draw is not None
    grids = [[bytes(g.numbers), g.stake, (_MULTIPLIER if g.multiplier else 0)
              | (_CAPPED if g.capped else 0)] for g in sale.grids]
    return _pack([sale.ticket_id, sale.game, sale.player_id,
                  sale.first_draw if sale.asked else -sale.first_draw, sale.draws,
                  sale.joker_plus, sale.joker_cost, grids])


def unpack_sale(raw: bytes) -> Sale:
    """The sale of a ticket record, packed by `pack_sale`."""
    tid, game, player, first, draws, joker, joker_cost, packed = _unpack(raw)
    grids = []
    for i, (numbers, stake, flags) in enumerate(packed):
        ordered = tuple(numbers)
        multiplier = bool(flags & _MULTIPLIER)
        grids.append(SaleGrid(i, ordered, combination.encode(ordered), stake, multiplier,
                              stake * (2 if multiplier else 1) * draws,
                              bool(flags & _CAPPED)))
    return Sale(ticket_id=tid, game=game, player_id=player, first_draw=abs(first),
                draws=draws, grids=tuple(grids), joker_plus=joker, joker_cost=joker_cost,
                asked=first > 0)


def request_fingerprint(t: TicketIn) -> str | None:
    """The fingerprint of the sale `validate_ticket` makes of a ticket (`sale_fingerprint`),
    without any game's rules (a retry must find its recorded decision even once the
    configuration would refuse it); None when its numbers could never have made a valid
    grid."""
    combos = []
    for g in t.grids:
        numbers = sorted(g.numbers)
        if not numbers or numbers[0] < 1 or numbers[-1] > 99 or len(set(numbers)) < len(numbers):
            return None
        combos.append(combination.encode(numbers))
    return _fingerprint(t, combos)


def validate_ticket(rules: GameRules, t: TicketIn) -> Sale:
    """Apply every rule of `rules` to the ticket; raise ApiError ("invalid") on the first break."""
    check_grid_count(rules, len(t.grids))
    check_draws(rules, t.draws)
    if rules.daily_limit is not None and t.player_id is None:
        raise rule_error(
            "player_required", f"game {rules.id} has player limits: player_id is required",
            "$.player_id",
        )
    if t.joker_plus and rules.joker_plus_price is None:
        raise rule_error(
            "option_not_available", f"game {rules.id} has no Joker+ option", "$.joker_plus"
        )
    grids: list[SaleGrid] = []
    low, high, top = rules.picks_min, rules.picks_max, rules.numbers
    stakes, draws, multiplier = rules.stakes, t.draws, rules.multiplier
    capped_sizes = rules.capped_picks if rules.cap_limit is not None else ()
    for i, g in enumerate(t.grids):
        numbers = g.numbers
        n = len(numbers)
        # One cheap test for the common, valid grid; the precise error (code and path) is
        # worked out only when it fails.
        if not (low <= n <= high and len(set(numbers)) == n and min(numbers) >= 1
                and max(numbers) <= top and g.stake in stakes
                and (multiplier or not g.multiplier)):
            _grid_error(rules, g.numbers, g.stake, g.multiplier, f"$.grids[{i}]")
        ordered = tuple(sorted(numbers))
        # index, numbers, combo, stake, multiplier, cost, capped (positional: the hot path)
        grids.append(SaleGrid(i, ordered, combination.encode(ordered), g.stake, g.multiplier,
                              g.stake * (2 if g.multiplier else 1) * draws, n in capped_sizes))
    joker_cost = (rules.joker_plus_price or 0) * draws if t.joker_plus else 0
    return Sale(
        ticket_id=t.ticket_id,
        game=t.game,
        player_id=t.player_id,
        first_draw=t.first_draw,
        draws=t.draws,
        grids=tuple(grids),
        joker_plus=t.joker_plus,
        joker_cost=joker_cost,
        asked=t.first_draw is not None,
    )


class Probe(Struct, frozen=True, gc=False):
    """One grid of an availability question."""

    index: int
    numbers: tuple[int, ...]
    combo: str
    stake: int
    capped: bool


def validate_availability(rules: GameRules, a: AvailabilityIn) -> list[Probe]:
    check_grid_count(rules, len(a.grids))
    check_draws(rules, a.draws)
    probes = []
    for i, g in enumerate(a.grids):
        numbers = check_numbers(rules, g.numbers, f"$.grids[{i}].numbers")
        check_stake(rules, g.stake, f"$.grids[{i}].stake")
        probes.append(Probe(i, numbers, combination.encode(numbers), g.stake,
                            rules.is_capped(len(numbers))))
    return probes


def parse_numbers_path(rules: GameRules, text: str) -> tuple[int, ...]:
    """`3-7-12-…` from a URL into validated sorted numbers."""
    if not _NUMBERS_PATH_RE.fullmatch(text):  # ASCII digits only: str.isdigit() takes "²"
        raise ApiError("invalid", "invalid_request",
                       "numbers are integers joined by '-', e.g. 3-7-12-18-25-33-41-56",
                       "numbers")
    return check_numbers(rules, [int(p) for p in text.split("-")], "numbers")


def budget_shares(days_of_draws: list[str], sale: Sale, policy: str, purchase_day: str,
                  accepted: set[int] | None = None) -> list[tuple[str, int]]:
    """What a ticket takes from the player's daily budgets, as (day, amount) pairs.

    `purchase_day`: the whole cost on the day of purchase. `draw_day`: each draw's share
    (stake x multiplier per grid, plus Joker+) on the day of that draw, `days_of_draws[i]`
    being the local day of draw i. `accepted`: the grids that count (None: all of them,
    the requested cost); Joker+ counts when at least one grid does.
    """
    grids = [g for g in sale.grids if accepted is None or g.index in accepted]
    per_draw = sum(g.cost // sale.draws for g in grids)
    if grids:
        per_draw += sale.joker_cost // sale.draws
    if policy == "purchase_day":
        return [(purchase_day, per_draw * sale.draws)]
    shares: dict[str, int] = {}
    for day in days_of_draws:
        shares[day] = shares.get(day, 0) + per_draw
    return list(shares.items())
