"""Canonical, collision-free form of a combination of numbers.

A combination is the *set* of numbers of a grid: 3-7-12 is 12-3-7. Its canonical form is
the sorted numbers written as two digits each and joined (`[3, 7, 12]` → `"030712"`), which
is injective for matrices of at most 99 numbers (the configuration enforces that): two
different sets never share a key, so a capped combination can never reject an innocent grid.
"""

from __future__ import annotations

from collections.abc import Iterable

_TWO_DIGITS = tuple(f"{n:02d}" for n in range(100))


def encode(numbers: Iterable[int]) -> str:
    """The canonical key of numbers in 1..99 given in ascending order, as the validator
    returns them (two digits each)."""
    return "".join(map(_TWO_DIGITS.__getitem__, numbers))


def decode(key: str) -> list[int]:
    """The sorted numbers of a canonical key."""
    return [int(key[i : i + 2]) for i in range(0, len(key), 2)]
