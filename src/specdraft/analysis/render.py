"""What `specdraft theory`, `specdraft costs` and `specdraft diagnose` print: rich tables and coloured text."""

from __future__ import annotations

from typing import Sequence

from rich import box
from rich.table import Table
from rich.text import Text

from specdraft.analysis.costs import drift_text, rates_text
from specdraft.analysis.theory import TheoryCell

AGREE_STYLE, DISAGREE_STYLE = "green", "red"


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


# ----- theory -------------------------------------------------------------------------------------------------
def tau_table(grid: Sequence[Sequence[TheoryCell]]) -> Table:
    """Expected τ: one row per α, one column per k."""
    table = Table(title="expected τ (tokens per target step)")
    table.add_column("α", justify="right")
    for cell in grid[0]:
        table.add_column(f"k={cell.k}", justify="right", no_wrap=True)
    for row in grid:
        table.add_row(f"{row[0].alpha:g}", *(f"{cell.tau:.2f}" for cell in row))
    return table


def speedup_table(grid: Sequence[Sequence[TheoryCell]], c: float, slope: float = 0.0) -> Table:
    """Expected speedup: one row per α, one column per k, the best k of each row marked `*` and its own column."""
    formula = f"τ / (1 + k·s + k·c), c = {c:g}, s = {slope:g}" if slope else f"τ / (1 + k·c), c = {c:g}"
    table = Table(title=f"expected speedup {formula}; * best k")
    table.add_column("α", justify="right")
    for cell in grid[0]:
        table.add_column(f"k={cell.k}", justify="right", no_wrap=True)
    table.add_column("best k", justify="right", style="bold")
    for row in grid:
        cells = [Text(f"{cell.speedup:.2f}*", style="bold green") if cell.best else Text(f"{cell.speedup:.2f} ")
                 for cell in row]
        best = next(cell for cell in row if cell.best)
        table.add_row(f"{row[0].alpha:g}", *cells, str(best.k))
    if any(cell.best and cell.speedup < 1.0 for row in grid for cell in row):
        table.caption = "below 1.00: plain decoding is faster at that α"
    return table


# ----- costs --------------------------------------------------------------------------------------------------
def pass_cost_table(costs) -> Table:
    """The target's pass time by width (and the draft's per token), with the rates they imply."""
    table = Table(title=f"target pass time after {costs.context} cached tokens ({costs.device}, {costs.threads} threads)")
    table.add_column("tokens in the pass", justify="right")
    table.add_column("ms", justify="right")
    table.add_column("× one token", justify="right")
    for width, seconds in sorted(costs.pass_seconds.items()):
        table.add_row(str(width), f"{seconds * 1e3:.1f}", f"{costs.pass_ratio(width):.2f}")
    if costs.draft_seconds is not None:
        table.add_row("draft, 1", f"{costs.draft_seconds * 1e3:.1f}", f"c = {costs.draft_ratio:.2f}", style="cyan")
    summary = costs.to_dict()
    warning = drift_text(summary)
    table.caption = rates_text(summary) + ("" if warning is None else f" [yellow]{warning}[/]")
    return table


def prediction_table(report) -> Table:
    """The best k and expected speedup per α: with the draft, with a free draft, and if passes were flat."""
    table = Table(title="expected speedup over plain decoding, best k (0 = plain)")
    table.add_column("α", justify="right")
    columns = ([("this draft", report.draft)] if report.draft else []) + \
        [("free draft (n-gram)", report.free), ("free draft, flat passes", report.flat)]
    for name, _ in columns:
        table.add_column(name, justify="right", no_wrap=True)
    for i, alpha in enumerate(report.alphas):
        table.add_row(f"{alpha:g}", *(f"{rows[i].speedup:.2f}× (k={rows[i].k})" for _, rows in columns))
    return table


# ----- diagnose -----------------------------------------------------------------------------------------------
def agreement_text(pieces: Sequence[str], agreement: Sequence[bool]) -> Text:
    """The output text, each token green where the draft's top-1 agreed with the target's, red where not."""
    text = Text()
    for piece, agree in zip(pieces, agreement):
        text.append(piece, style=AGREE_STYLE if agree else DISAGREE_STYLE)
    return text


def diagnose_table(result) -> Table:
    """Per prompt and pooled (last row): metric means, predicted α beside measured α (a DiagnoseResult in).

    Columns: n positions, top-1 agreement, Σ min(p, q), total variation, cosine of logits and of
    hidden states, α predicted, α measured (per token), and the measured run's accepted / drafted.
    """
    predicted = result.settings.get("predicted_alpha", "")
    table = Table(title=f"draft against target (teacher-forced); α predicted = {predicted}",
                  box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True)
    table.add_column("prompt", overflow="fold")
    for column in ("n", "top-1", "Σmin", "TV", "cos l", "cos h", "α pred", "α meas", "acc/dr"):
        table.add_column(column, justify="right", no_wrap=True)
    rows = [(f"{d.category}:{d.question_id}", len(d.metrics), d.metrics.means(), d.predicted_alpha,
             d.measured.to_dict() if d.measured is not None else None) for d in result.prompts]
    pooled = result.overall
    rows.append(("all", pooled["positions"], pooled["means"], pooled["predicted_alpha"], pooled["measured"]))
    for i, (label, positions, means, alpha, measured) in enumerate(rows):
        measured = measured or {}
        table.add_row(label, str(positions), _fmt(means["agreement"]), _fmt(means["expected_acceptance"]),
                      _fmt(means["total_variation"]), _fmt(means["logit_cosine"], ".3f"),
                      _fmt(means["hidden_cosine"], ".3f"),
                      Text(_fmt(alpha), style="bold"), Text(_fmt(measured.get("alpha")), style="bold"),
                      _fmt(measured.get("acceptance_rate")), end_section=i == len(rows) - 2)
    table.caption = ("top-1: argmax agreement; Σmin: Σ min(p, q); TV: total variation; cos l / cos h: cosine of "
                     "logits / hidden states; α meas: accepted / tested draft tokens; acc/dr: accepted / drafted")
    return table


def prompt_line(diagnosis) -> Text:
    """One line per diagnosed prompt: its id, size, top-1 agreement and both α's (a PromptDiagnosis in)."""
    means = diagnosis.metrics.means()
    measured = diagnosis.measured.alpha if diagnosis.measured is not None else None
    return Text.assemble(
        (f"question {diagnosis.question_id}", "bold"), f" ({diagnosis.category}): {len(diagnosis.metrics)} tokens, "
        f"top-1 {_fmt(means['agreement'])}, Σmin(p,q) {_fmt(means['expected_acceptance'])}, ",
        (f"α predicted {_fmt(diagnosis.predicted_alpha)}, measured {_fmt(measured)}", "bold"),
    )
