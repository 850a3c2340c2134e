"""PNG charts with matplotlib's object API on an Agg canvas: no pyplot, no global backend switch.

Every chart is drawn on a fresh `Figure` that owns its own `FigureCanvasAgg`, so drawing is
independent of whatever backend the process (or a notebook) has selected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from specdraft.analysis.theory import expected_speedup
from specdraft.extras import require

CURVE_POINTS = 201  # α samples of a theory curve over [0, 1]


def new_figure(width: float = 7.5, height: float = 4.5):
    """A figure on its own Agg canvas, laid out with constrained layout (MissingExtra without matplotlib)."""
    require("bench", "Drawing a chart", "matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def save(figure, path: str | Path) -> Path:
    """Write `figure` as a PNG to `path` (folders made as needed) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path


def note(axes, text: str) -> None:
    """Write `text` in the middle of empty `axes` (a chart with nothing to show is still written)."""
    axes.text(0.5, 0.5, text, ha="center", va="center", transform=axes.transAxes, color="grey")


def theory_curve(speedup: Callable[[float], float], points: int = CURVE_POINTS) -> tuple[list[float], list[float]]:
    """α in [0, 1] and the expected speedup `speedup(α)` at each (`theory.expected_speedup` for one k,
    `theory.mixed_speedup` for a run's mix of k)."""
    alphas = [i / (points - 1) for i in range(points)]
    return alphas, [speedup(a) for a in alphas]


def speedup_chart(ks: Sequence[int], c: float, path: str | Path, alphas: Sequence[float] = (),
                  slope: float = 0.0) -> Path:
    """`specdraft theory --out`: expected speedup over α, one curve per k, the given α's marked."""
    figure = new_figure()
    axes = figure.add_subplot()
    for k in ks:
        xs, ys = theory_curve(lambda a, k=k: expected_speedup(a, k, c, 1 + slope * k))
        axes.plot(xs, ys, label=f"k = {k}")
    for alpha in alphas:
        axes.axvline(alpha, color="grey", linestyle=":", linewidth=1)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set(xlim=(0, 1), xlabel="α (per-token acceptance)", ylabel="expected speedup over plain decoding",
             title=f"Expected speedup τ / (1 + k·s + k·c), c = {c:g}, s = {slope:g}")
    axes.legend(ncols=2, fontsize="small")
    axes.grid(alpha=0.3)
    return save(figure, path)


def agreement_chart(series: Sequence[tuple[str, Sequence[float]]], path: str | Path, window: int) -> Path:
    """`specdraft diagnose --out`: rolling top-1 agreement along the output, one line per prompt."""
    figure = new_figure()
    axes = figure.add_subplot()
    for label, values in series:
        axes.plot(range(len(values)), values, label=label, linewidth=1.2)
    if not series:
        note(axes, "no prompts")
    axes.set(ylim=(-0.02, 1.02), xlabel="output position", ylabel=f"top-1 agreement (rolling mean of {window})",
             title="Where the draft agrees with the target (teacher-forced on the target's greedy output)")
    if series:
        axes.legend(fontsize="x-small", ncols=2 if len(series) > 6 else 1)
    axes.grid(alpha=0.3)
    return save(figure, path)
