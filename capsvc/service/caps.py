"""The cap in force for each draw: fixed by the draw's first sale.

A new `cap_limit` in the configuration applies to draws no sale has reached yet, never to
one already selling: two players of one draw are judged by one cap, and a draw's threshold
is never raised (or lowered) under the sales already made.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from capsvc.domain.games import Game
from capsvc.redis.store import Store, replies_of

_CACHED_CAPS = 4096
"""Fixed caps a process remembers (a few games times the draws on sale); beyond, it forgets
them all and reads them again: they never change once fixed."""


OnLearnt = Callable[[str, int, int, int], None]
"""(game, draw, cap, the draw's expiry): a draw's cap learnt."""


class DrawCaps:
    """The cap in force for each draw. A draw's cap is fixed by its first sale, in Redis
    (shared by every process), and never changes after that: a new `cap_limit` in the
    configuration applies to draws that have not been sold yet, never to one already
    selling (two players of one draw are judged by one cap; a curtailed draw's threshold is
    not raised). A process remembers the caps it has seen fixed, so a sale pays the round
    trip once per draw and process."""

    def __init__(self, store: Store, on_learnt: OnLearnt | None = None) -> None:
        self.store = store
        self.on_learnt = on_learnt
        """Told of each draw's cap the first time this process learns it (the wiring
        journals it: capsvc.journal.recorder.Recorder.cap)."""
        self._fixed: dict[tuple[str, int], int] = {}

    def known(self, game: Game, first: int, draws: int) -> list[int] | None:
        """The caps of draws first..first+draws-1 if this process has seen them all fixed
        (no round trip: the common case of a sale), else None."""
        fixed, gid = self._fixed, game.rules.id
        caps = []
        for d in range(first, first + draws):
            cap = fixed.get((gid, d))
            if cap is None:
                return None
            caps.append(cap)
        return caps

    def remember(self, game: Game, first: int, caps: list[int]) -> None:
        """Caps found fixed for draws first, first+1, … (they never change)."""
        if len(self._fixed) + len(caps) > _CACHED_CAPS:
            self._fixed.clear()
        learnt, fixed = self.on_learnt, self._fixed
        for i, cap in enumerate(caps):
            key = (game.rules.id, first + i)
            if learnt is not None and key not in fixed:
                learnt(game.rules.id, first + i, cap, game.expire_at(first + i))
            fixed[key] = cap

    async def fix(self, game: Game, first: int, draws: int) -> list[int]:
        """The caps of draws first..first+draws-1, fixing at the configured cap those that
        no sale has fixed yet (the game has a cap)."""
        rules = game.rules
        assert rules.cap_limit is not None
        replies = await replies_of([self.store.fix_cap(rules.id, d, rules.cap_limit,
                                                       game.expire_at(d))
                                    for d in range(first, first + draws)])
        caps = [rules.cap_limit if r is None else int(r) for r in replies]
        self.remember(game, first, caps)
        return caps

    async def argument(self, game: Game, first: int, draws: int, *, fix: bool) -> str | int:
        """The caps of a grid's draws as the Lua functions take them (lua/capsvc.lua,
        CAPS): fixed first when `fix` (a sale), else as in force (a release, a seal), with
        the shadow cap of the game."""
        caps = self.known(game, first, draws)
        if caps is None:
            caps = (await self.fix(game, first, draws) if fix else
                    [c for c, _ in await self.in_force(game, first, draws)])
        return caps_argument(caps, game.rules.shadow_cap_limit)

    async def in_force(self, game: Game, first: int, draws: int) -> list[tuple[int, bool]]:
        """(cap, fixed) of each draw, fixing nothing: a draw no sale has fixed yet has the
        configured cap, which its first sale will fix."""
        rules = game.rules
        assert rules.cap_limit is not None
        known = self.known(game, first, draws)
        if known is not None:
            return [(c, True) for c in known]
        replies = await replies_of([self.store.fixed_cap(rules.id, d)
                                    for d in range(first, first + draws)])
        for d, r in zip(range(first, first + draws), replies, strict=True):
            if r is not None:  # fixed: for good
                self.remember(game, d, [int(r)])
        return [(rules.cap_limit, False) if r is None else (int(r), True) for r in replies]


def caps_argument(caps: Sequence[int], shadow: int | None) -> str | int:
    """The caps of a grid's draws as the Lua functions take them (lua/capsvc.lua, CAPS)."""
    if shadow is None and all(c == caps[0] for c in caps):
        return caps[0]
    text = ",".join(map(str, caps))
    return text if shadow is None else f"{text}/{shadow}"
