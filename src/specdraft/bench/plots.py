"""The PNG plots of `specdraft bench`, drawn from summary.json's methods and the records.

speedup_by_category.png     grouped bars: speedup over ar per category (and overall), one bar per method
acceptance_by_position.png  accepted_at / drafted_at per draft position, one line per drafting method
speedup_vs_theory.png       per drafting method: Σ τ(α, k) / Σ (V(k+1)/V(1) + k·c) over its steps' k, for its
                            measured c and pass costs, and the measured (α per token, speedup after prefill) point
tokens_per_second.png       new_tokens / wall_seconds per prompt, one line per method

A plot with nothing to show (no `ar`, no drafting method) is still written, with a note.
The measured point of the theory plot sits at the per-token α (`theory.token_acceptance`),
the α the formula takes, not at accepted / drafted (which also counts untested draft tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from specdraft.analysis.charts import new_figure, note, save, theory_curve
from specdraft.analysis.theory import mixed_speedup, token_acceptance
from specdraft.bench.summary import position_counts

SPEEDUP_BY_CATEGORY = "speedup_by_category.png"
ACCEPTANCE_BY_POSITION = "acceptance_by_position.png"
SPEEDUP_VS_THEORY = "speedup_vs_theory.png"
TOKENS_PER_SECOND = "tokens_per_second.png"
PLOTS = (SPEEDUP_BY_CATEGORY, ACCEPTANCE_BY_POSITION, SPEEDUP_VS_THEORY, TOKENS_PER_SECOND)


def plot_speedup_by_category(methods: Mapping[str, Mapping], path: str | Path) -> Path:
    """Grouped bars: each method's speedup over ar per category and overall."""
    categories = list(dict.fromkeys(c for figures in methods.values() for c in figures.get("categories", {})))
    groups = [*categories, "overall"]
    shown = {m: f for m, f in methods.items() if f.get("speedup_vs_ar") is not None}
    figure = new_figure(width=max(7.5, 1.5 + 0.7 * len(groups) * max(1, len(shown)) / 2))
    axes = figure.add_subplot()
    width = 0.8 / max(1, len(shown))
    for j, (method, figures) in enumerate(shown.items()):
        values = [figures.get("categories", {}).get(c, {}).get("speedup_vs_ar") for c in categories]
        values.append(figures["speedup_vs_ar"])
        xs = [i - 0.4 + width * (j + 0.5) for i, v in enumerate(values) if v is not None]
        axes.bar(xs, [v for v in values if v is not None], width, label=method)
    if not shown:
        note(axes, "no speedup: the run has no `ar` method")
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks(range(len(groups)), groups, rotation=30 if len(groups) > 6 else 0, ha="right"
                    if len(groups) > 6 else "center")
    axes.set(ylabel="speedup over ar", title="Speedup over plain decoding by category")
    if shown:
        axes.legend(fontsize="small")
    axes.grid(axis="y", alpha=0.3)
    return save(figure, path)


def plot_acceptance_by_position(records: Sequence[Mapping], path: str | Path) -> Path:
    """accepted_at[i] / drafted_at[i] per draft position i, one line per method that drafts."""
    from matplotlib.ticker import MaxNLocator  # matplotlib is the `bench` extra: imported when a plot is drawn

    figure = new_figure()
    axes = figure.add_subplot()
    counts = position_counts(records)
    for method, (accepted_at, drafted_at) in counts.items():
        positions = [i for i, d in enumerate(drafted_at) if d]
        axes.plot([i + 1 for i in positions], [accepted_at[i] / drafted_at[i] for i in positions], marker="o",
                  label=method)
    if not counts:
        note(axes, "no method drafted")
    else:
        axes.legend(fontsize="small")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set(ylim=(-0.02, 1.02), xlabel="draft position", ylabel="accepted / drafted at this position",
             title="Acceptance by draft position")
    axes.grid(alpha=0.3)
    return save(figure, path)


def plot_speedup_vs_theory(methods: Mapping[str, Mapping], records: Sequence[Mapping], path: str | Path,
                           costs: Mapping | None = None) -> Path:
    """Per drafting method with c: the theoretical curve over α for the k it drafted step by step (its k histogram,
    plain steps included) and the measured (α per token, speedup after prefill) point. With this machine's measured
    pass costs (`costs`), a step is priced as it costs here: a pass over k + 1 tokens at its measured ratio to a
    one-token pass, not at one."""
    pass_seconds = (costs or {}).get("pass_seconds") or {}
    figure = new_figure()
    axes = figure.add_subplot()
    counts = position_counts(records)
    drawn = 0
    for method, figures in methods.items():
        k, c = figures.get("k"), figures.get("cost_ratio")
        if k is None or c is None or method not in counts:
            continue
        # records that do not list their steps' k: every step drafted k; no prefill times: the whole run's speedup
        steps = {int(width): n for width, n in (figures.get("k_histogram") or {k: 1}).items()}
        speedup = figures.get("decode_speedup_vs_ar") or figures.get("speedup_vs_ar")
        xs, ys = theory_curve(lambda a: mixed_speedup(a, steps, c, pass_seconds))
        mean_k = sum(k * n for k, n in steps.items()) / sum(steps.values())
        (line,) = axes.plot(xs, ys, label=f"{method}: theory, its k per step (mean {mean_k:.2f}), c = {c:.3f}")
        alpha = token_acceptance(*counts[method])
        if alpha is not None and speedup is not None:
            axes.plot([alpha], [speedup], marker="o", markersize=8, color=line.get_color(), linestyle="none",
                      label=f"{method}: measured, α/token = {alpha:.2f}, {speedup:.2f}× "
                            f"(theory {mixed_speedup(alpha, steps, c, pass_seconds):.2f}×)")
        drawn += 1
    if not drawn:
        note(axes, "no drafting method with measured times")
    else:
        axes.legend(fontsize="small")
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set(xlim=(0, 1), xlabel="α per token (accepted / tested draft tokens)", ylabel="speedup over ar after prefill",
             title="Measured speedup against Σ τ(α, k) / Σ (V(k+1)/V(1) + k·c) over the steps")
    axes.grid(alpha=0.3)
    return save(figure, path)


def plot_tokens_per_second(records: Sequence[Mapping], path: str | Path) -> Path:
    """new_tokens / wall_seconds of every prompt, one line per method, prompts in run order."""
    prompts = list(dict.fromkeys((r["category"], r["question_id"]) for r in records))
    methods = list(dict.fromkeys(r["method"] for r in records))
    figure = new_figure(width=max(7.5, 1.5 + 0.25 * len(prompts)))
    axes = figure.add_subplot()
    index = {prompt: i for i, prompt in enumerate(prompts)}
    for method in methods:
        points = sorted((index[(r["category"], r["question_id"])], r["new_tokens"] / r["wall_seconds"])
                        for r in records if r["method"] == method and r["wall_seconds"] > 0)
        axes.plot([x for x, _ in points], [y for _, y in points], marker="o", markersize=4, label=method)
    if not records:
        note(axes, "no records")
    else:
        axes.legend(fontsize="small")
    axes.set_xticks(range(len(prompts)), [f"{c}:{q}" for c, q in prompts], rotation=90, fontsize="x-small")
    axes.set(ylabel="tokens / s", title="Tokens per second per prompt")
    axes.grid(alpha=0.3)
    return save(figure, path)


def write_plots(summary: Mapping, records: Sequence[Mapping], out: str | Path) -> list[str]:
    """Write the four plots into `out`; returns their file names (for report.md)."""
    out = Path(out)
    methods = summary.get("methods", {})
    plot_speedup_by_category(methods, out / SPEEDUP_BY_CATEGORY)
    plot_acceptance_by_position(records, out / ACCEPTANCE_BY_POSITION)
    plot_speedup_vs_theory(methods, records, out / SPEEDUP_VS_THEORY, summary.get("costs"))
    plot_tokens_per_second(records, out / TOKENS_PER_SECOND)
    return list(PLOTS)
