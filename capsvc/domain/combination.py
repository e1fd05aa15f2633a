"""Canonical, collision-free form of a combination of numbers.

A combination is the *set* of numbers of a grid: 3-7-12 is 12-3-7. Its canonical form is
the sorted numbers, one character each (`[3, 7, 12]` → `"\\x03\\x07\\x0c"`): injective for
matrices of at most 99 numbers (the configuration enforces that), so two different sets
never share a key and a capped combination can never reject an innocent grid. It is one
byte per number on the wire and in Redis (code points below 128 are one UTF-8 byte), and
it never holds a zero byte, which the store uses to tell grid records from counters.
"""

from __future__ import annotations

from collections.abc import Iterable


def encode(numbers: Iterable[int]) -> str:
    """The canonical key of numbers in 1..99 given in ascending order, as the validator
    returns them."""
    return "".join(map(chr, numbers))


def decode(key: str | bytes) -> list[int]:
    """The sorted numbers of a canonical key (as stored, or as Redis returns it)."""
    return list(key.encode() if isinstance(key, str) else key)
