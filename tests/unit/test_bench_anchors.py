"""The bench scripts that instrument capsvc still find what they anchor on: bench/floor.py
finds every step of capsvc_sell. Asserts nothing about speed (no server runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
def test_bench_floor_still_finds_the_sale_s_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/floor.py times capsvc_sell's steps between lines it anchors on: each found."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import floor  # type: ignore[import-not-found]

    timed = floor.timed_library()
    for _, step in floor.SECTIONS:
        assert f"  mark('{step}')" in timed
    assert "redis.register_function('capsvc_sections', sections)" in timed


def test_bench_mark_parts_still_finds_the_mark_s_read_and_write(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/mark_parts.py takes the mark's read and write out of lua/capsvc.lua's MARKS by
    their lines (it exits saying so when one is gone): both found."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import mark_parts  # type: ignore[import-not-found]

    library = mark_parts.library()  # SystemExit when the read or the write is not found
    assert all(f"redis.register_function('{name}'" in library
               for name in ("marked", "no_read", "no_write", "wrap_only"))

