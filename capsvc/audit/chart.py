"""`capsvc whatif --chart`: the draw's combinations by accepted stake, one curve per cap,
each cap a dashed line of its curve's colour, drawn by matplotlib (the `charts` extra).

The only module that imports matplotlib, and only when a chart is asked for: the service
and every other command run without it.
"""

from __future__ import annotations

import io
from collections import Counter

from capsvc.audit.whatif import Replay
from capsvc.domain.money import MINOR_DIGITS

EXTRA = "pip install 'capsvc[charts]'"
"""What brings the plotting library."""


def available() -> bool:
    """Whether matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def steps(curve: Counter[int]) -> tuple[list[float], list[int]]:
    """The curve as a staircase: combinations ranked by accepted stake, largest first
    (x: rank, from 1; y: stake, minor units). `curve`: accepted stake -> combinations."""
    xs: list[float] = []
    ys: list[int] = []
    rank = 1
    for total in sorted(curve, reverse=True):
        n = curve[total]
        xs += [rank, rank + n]
        ys += [total, total]
        rank += n
    return xs, ys


def draw(replay: Replay) -> bytes:
    """The chart of `replay`, an SVG (its text as text, its ids the same from one run to
    the next)."""
    import matplotlib
    from matplotlib.figure import Figure

    what = replay.what
    unit = 10 ** MINOR_DIGITS.get(what.currency, 2)
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    colours = [f"C{i % 10}" for i in range(len(what.scenarios))]
    for scenario, curve, colour in zip(what.scenarios, replay.curves, colours, strict=True):
        xs, ys = steps(curve)
        label = f"cap {scenario.cap / unit:g} {what.currency}" + (
            " (in force)" if scenario.in_force else "")
        ax.plot(xs, [y / unit for y in ys], color=colour, linewidth=1.6, label=label)
        ax.axhline(scenario.cap / unit, color=colour, linewidth=0.8, linestyle="--")
    ax.set_xscale("log")
    ax.set_xlabel("combinations, ranked by accepted stake (log scale)")
    ax.set_ylabel(f"accepted stake ({what.currency})")
    ax.set_title(f"{what.game}, draw {what.draw}: {replay.combinations:,} combinations "
                 "played, accepted stake under each cap")
    ax.grid(True, which="major", linewidth=0.3)
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    out = io.BytesIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "capsvc"}):
        fig.savefig(out, format="svg", metadata={"Date": None})
    return out.getvalue()
