"""A sale's decision as a TicketOut, made the one way the service makes every decision
(capsvc.domain.decisions.render of the replies' results): what tests build the decisions
they expect, and the journals they write, with."""

from __future__ import annotations

from collections.abc import Sequence
from zoneinfo import ZoneInfo

import msgspec

from capsvc.client.models import TicketOut
from capsvc.domain.decisions import Reserved, render, results_of
from capsvc.domain.validator import Sale

_decode = msgspec.json.Decoder(TicketOut).decode


def build_decision(channel_id: str, tz: ZoneInfo, sale: Sale, sale_id: str, at: int,
                   replies: Sequence[Reserved | None] | None) -> TicketOut:
    """The decision of a sale's reserve replies (None: a grid not capped; `replies` None:
    the whole ticket refused by the player's limit)."""
    return _decode(render(channel_id, sale, sale_id, at, results_of(tz.key, replies))[0])


def player_limit_decision(sale: Sale) -> TicketOut:
    """The whole ticket refused: it does not fit in the player's daily budget."""
    return build_decision("", ZoneInfo("UTC"), sale, "", 0, None)
