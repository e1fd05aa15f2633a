"""A restore's announcement reaches every node first and every mark in one round trip, and
its renewals too: a process restoring thousands of slots' records on a cluster holds the
others within milliseconds, and keeps holding them (capsvc.recovery.reconciler._Announcer)."""

from __future__ import annotations

import asyncio
from typing import Any

from capsvc.recovery.reconciler import ANNOUNCE_MS, _Announcer

NODES = [f"n:{{{i}}}" for i in range(3)]
SLOTS = [f"m:{{{i}}}" for i in range(2000)]


class _Store:
    """Records each mark call as it is sent; answers only when the test says so."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, list[Any]]] = []
        self.unanswered: list[asyncio.Future[Any]] = []

    def mark_call(self, name: str, mark: str, args: list[Any]) -> asyncio.Future[Any]:
        self.sent.append((name, mark, args))
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.unanswered.append(fut)
        return fut

    def answer_all(self) -> None:
        for fut in self.unanswered:
            if not fut.done():
                fut.set_result(0)
        self.unanswered = []


async def _until(condition: Any) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("never")


async def test_every_node_is_announced_first_then_every_mark_at_once() -> None:
    store = _Store()
    announcer = _Announcer(store, "life", NODES)  # type: ignore[arg-type]
    begun = asyncio.ensure_future(announcer.begin(SLOTS))
    await _until(lambda: len(store.sent) == len(NODES))
    assert [mark for _, mark, _ in store.sent] == NODES  # nothing else before they answer
    store.answer_all()
    await _until(lambda: len(store.sent) == len(NODES) + len(SLOTS))  # none waits for another
    store.answer_all()
    await begun
    assert all(args == [ANNOUNCE_MS, "life", announcer.token] for _, _, args in store.sent)
    await announcer.end()


async def test_every_mark_is_renewed_at_once() -> None:
    store = _Store()
    announcer = _Announcer(store, "life", NODES)  # type: ignore[arg-type]
    begun = asyncio.ensure_future(announcer.begin(SLOTS))
    await _until(lambda: len(store.sent) == len(NODES))
    store.answer_all()
    await _until(lambda: len(store.sent) == len(NODES) + len(SLOTS))
    store.answer_all()
    await begun
    store.sent.clear()
    await asyncio.sleep(ANNOUNCE_MS / 5000 + 0.05)  # one renewal's period
    renewed = [mark for name, mark, _ in store.sent if name == "capsvc_announce"]
    assert sorted(renewed) == sorted(NODES + SLOTS)  # all sent, none waiting for another
    store.answer_all()
    released = asyncio.ensure_future(announcer.release())
    await _until(lambda: any(name == "capsvc_announce_end" for name, _, _ in store.sent))
    ended = [mark for name, mark, _ in store.sent if name == "capsvc_announce_end"]
    assert sorted(ended) == sorted(NODES + SLOTS)  # all sent, none waiting for another
    store.answer_all()
    await released
