"""Amounts for people: minor units written in the currency's major unit, with its code."""

from __future__ import annotations

MINOR_DIGITS = {"XPF": 0, "JPY": 0, "KRW": 0, "BHD": 3, "JOD": 3, "KWD": 3, "OMR": 3,
                "TND": 3}
"""ISO 4217 currencies whose minor unit is not a hundredth (every other: 2 digits)."""


def amount(minor: int, currency: str) -> str:
    """`3750, "MAD"` -> `"37.50 MAD"`; `1000, "XPF"` -> `"1000 XPF"`."""
    digits = MINOR_DIGITS.get(currency, 2)
    if digits == 0:
        return f"{minor} {currency}"
    sign, units = ("-" if minor < 0 else ""), abs(minor)
    whole, part = divmod(units, 10 ** digits)
    return f"{sign}{whole}.{part:0{digits}d} {currency}"
