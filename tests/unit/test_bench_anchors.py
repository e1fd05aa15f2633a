"""The bench scripts that patch or instrument capsvc still find what they anchor on:
bench/cuts.py's cuts apply once each and compile, bench/floor.py finds every step of
capsvc_sell. Asserts nothing about speed (no server runs)."""

from __future__ import annotations

import importlib.util
import py_compile
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_cuts", REPO / "bench" / "cuts.py")
assert spec is not None
assert spec.loader is not None
cuts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cuts)


@pytest.mark.parametrize("cut", sorted(cuts.CUTS))
def test_each_cut_applies_to_the_code_and_compiles(cut: str, tmp_path: Path) -> None:
    for name in ("capsvc/service/tickets.py", "capsvc/redis/store.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    cuts.patch(tmp_path, cuts.CUTS[cut])
    changed = [name for name in cuts.CUTS[cut]
               if (tmp_path / name).read_text() != (REPO / name).read_text()]
    assert changed == list(cuts.CUTS[cut])
    for name in changed:
        py_compile.compile(str(tmp_path / name), doraise=True)
    tickets = (tmp_path / "capsvc/service/tickets.py").read_text()
    assert "return SaleOutcome(body=_CONST, replayed=False)" in tickets or cut == "decided"


def test_a_changed_anchor_stops_the_script(tmp_path: Path) -> None:
    (tmp_path / "capsvc/service").mkdir(parents=True)
    (tmp_path / "capsvc/service/tickets.py").write_text("_ATTEMPTS = 4\n")
    with pytest.raises(SystemExit, match="changed"):
        cuts.patch(tmp_path, cuts.CUTS["validated"])


def test_bench_floor_still_finds_the_sale_s_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/floor.py times capsvc_sell's steps between lines it anchors on: each found."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import floor  # type: ignore[import-not-found]

    timed = floor.timed_library()
    for _, step in floor.SECTIONS:
        assert f"  mark('{step}')" in timed
    assert "redis.register_function('capsvc_sections', sections)" in timed
