"""The typed replies (capsvc.redis.replies) and the Lua headers that document them agree, and
each decoder reads the layout its header gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from capsvc.domain.decisions import ACCEPTED, CLOSED, REJECTED, SHADOWED, Reserved
from capsvc.redis import replies as r

LUA = (Path(__file__).parents[2] / "lua" / "capsvc.lua").read_text()

DOCUMENTED = {
    "claim": [r.Claimed, r.Decided, r.Pending, r.Refused],
    "sell": [r.Sold, r.Decided, r.Pending, r.Refused, r.StoppedAt],
    "ticket": [r.TicketRecord],
    "expire": [r.Due],
    "cancel": [r.Cancelling, r.NotCancelled],
    "reserve": [Reserved],
    "release": [r.Released],
    "budget": [r.Budget],
    "player": [r.PlayerLimits],
    "marks": [r.MarkState],
}


def header(function: str) -> str:
    """The header of `function`: the `--[[ <function>: … ]]` block before its
    `local function`, whitespace collapsed."""
    at = LUA.index(f"local function {function}(")
    begin = LUA.rindex(f"--[[ {function}:", 0, at)
    return " ".join(LUA[begin:LUA.index("]]", begin)].split())


@pytest.mark.parametrize(("function", "types"), DOCUMENTED.items())
def test_each_reply_type_is_the_layout_its_function_documents(
        function: str, types: list[type]) -> None:
    text = header(function)
    for t in types:
        layout = " ".join(t.LUA.split())  # type: ignore[attr-defined]
        assert layout in text, f"{t.__name__}: {layout!r} not in the header of {function}"


def test_claims_decode_by_kind() -> None:
    assert r.claim_of([b"new", 5, b"s1"]) == r.Claimed(5, "s1")
    assert r.claim_of([b"final", b"{}", 5, b"s1", b"sale", None, b"c", 7, 500]) == r.Decided(
        b"{}", 5, "s1", b"sale", None, b"c", 7, 500)
    assert r.claim_of([b"pending", 5, b"s1", b"sale"]) == r.Pending(5, "s1", b"sale")
    assert r.claim_of([b"stopped", 2]) == r.StoppedAt(2)
    for why in ("closed", "later"):
        assert r.claim_of([why.encode()]) == r.Refused(why)
    assert r.claim_of([b"stale", b"sale"]) == r.Refused("stale", sale=b"sale")
    assert r.claim_of([b"day", 7]) == r.Refused("day", 7)


def test_one_call_sales_decode_at_their_call_s_instant_with_their_caller_s_id() -> None:
    """A sale made is its results alone, or {'new', …} with what it has to report; the
    call's instant and the caller's sale id complete it; other kinds decode as claims."""
    assert r.sale_of(b"Europe/Paris|1", 5, "s1", [5000], "E") == r.Sold(
        5, "s1", b"Europe/Paris|1", 0, 0, 0, [5000], "E")
    sold = r.sale_of([b"new", b"Europe/Paris|1", 1, 2, 3, b"5000,4000"], 5, "s1", [9, 9])
    assert sold == r.Sold(5, "s1", b"Europe/Paris|1", 1, 2, 3, [5000, 4000])
    assert r.sale_of([b"new", b"res|P", 0, 0, 0, None], 5, "s1", [9]) == r.Sold(
        5, "s1", b"res|P", 0, 0, 0, None)
    assert r.sale_of([b"stopped", 2], 5, "s1", [9]) == r.StoppedAt(2)
    assert r.sale_of([b"final", b"{}", 4, b"s0", b"sale", None, b"f"], 5, "s1",
                     [9]) == r.Decided(b"{}", 4, "s0", b"sale", None, b"f", None, None)


def test_tickets_hand_overs_and_cancels_decode() -> None:
    assert r.ticket_of([None] * 8) is None
    record = r.ticket_of([b"f", b"{}", b"sale", b"s1", b"5", None, None, None])
    assert record == r.TicketRecord(b"f", b"{}", b"sale", "s1", 5, None, None, None)
    assert record.decided
    assert r.due_of([]) is None
    assert r.due_of([b"wait"]) is False
    assert r.due_of([b"x", b"5", b"s1", b"sale"]) == r.Due(b"x", 5, "s1", b"sale")
    assert r.due_of([b"k", b"5", b"s1", b"sale", b"{}", b"9", b"500", None]) == r.Due(
        b"k", 5, "s1", b"sale", b"{}", 9, 500, None)
    assert r.cancel_of([b"k", b"9", b"500", b"s1"]) == r.Cancelling(b"k", 9, 500)
    assert r.cancel_of([b"c", b"9", b"500"]) == r.Cancelling(b"c", 9, 500)
    assert r.cancel_of([b"missing"]) == r.NotCancelled("missing")


def test_grids_decode_by_kind() -> None:
    assert r.reserved_of([1, 2, 0, 1]) == Reserved(ACCEPTED, near=2, sold_out=(0, 1))
    assert r.reserved_of([2, 0]) == Reserved(SHADOWED)
    assert r.reserved_of([0, 1, 300]) == Reserved(REJECTED, offset=1, room=300)
    assert r.reserved_of([-1]) == Reserved(CLOSED)
    assert not r.reserved_of([-2]).accepted
    assert r.released_of([500, 0, 2]) == r.Released(500, (0, 2))
    assert r.released_of([0]) == r.Released(0, ())


def test_budgets_and_limits_decode() -> None:
    assert r.budget_of([1, 700]) == r.Budget(ACCEPTED, 700)
    assert r.budget_of([1, 0]) == r.Budget(ACCEPTED, 0)  # recorded, no room left
    assert r.budget_of([1, 0, 1]) == r.Budget(ACCEPTED, 0, restored=True)
    assert r.budget_of([-2]) == r.Budget(-2)
    assert r.limits_of([b"none", b"", b"", 0]) == r.PlayerLimits(None, None, False, None, 0)
    assert r.limits_of([b"500", b"none", b"2026-12-04", 100]) == r.PlayerLimits(
        500, None, True, "2026-12-04", 100)
    assert r.limits_of([b"500", b"300", b"2026-12-04", 100]) == r.PlayerLimits(
        500, 300, False, "2026-12-04", 100)


def test_marks_decode() -> None:
    assert r.mark_state_of([None, None, None]) == r.MarkState(0, 0, (0,))
    assert r.mark_state_of([b"7", b"1800000000000", b"5", None]) == r.MarkState(
        7, 1800000000000, (5, 0))


@pytest.mark.parametrize("reply", [None, 7, [], [5], [5, 6], b"OK"])
async def test_a_sale_call_s_reply_of_another_layout_fails_its_requests_and_keeps_its_entry(
        reply: object) -> None:
    """A call of capsvc_sell answered in a layout not this library's (another version
    loaded): each request waiting on it fails, none is left waiting, and no sale is reported
    journaled (its entry stays for the janitor)."""
    import asyncio

    from capsvc.redis import store as s

    loop = asyncio.get_running_loop()
    shape = s.Store.shape("g", 7, 1, 10, 10, 60_000, 5000, [5000], 100, "UTC", False, [10])
    sale = s.Store.sale_call(shape, *s.ticket_names("c", "t"), b"sale", [("\x01\x02", 100)])
    groups = [s._QueuedSales([sale], loop.create_future(), [None], False)]
    entry = s.Unjournaled("e")
    call = loop.create_future()
    call.set_result(reply)
    s._answer_sales(groups, entry, call)
    with pytest.raises((TypeError, ValueError, IndexError)):
        groups[0].out.result()
    assert entry.left in (0, 1)  # never below: the entry is never let go
