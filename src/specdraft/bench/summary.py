"""From benchmark records to figures: pure arithmetic on the records, and the markdown report.

A record is one (prompt, method) run as written to `results.jsonl`; the fields used here are
`question_id`, `category`, `method`, `new_tokens`, `wall_seconds`, `steps`, `drafted`,
`accepted`, `token_ids`, `temperature` (0 = greedy) and, for our own loop, `draft_seconds`,
`verify_seconds` and `k` (records written before those existed count as None). Per method (and
per category):

    tokens_per_second       Σ new_tokens / Σ wall_seconds
    speedup_vs_ar           tokens_per_second / the reference's (`ar`) tokens_per_second
    acceptance_rate (α)     Σ accepted / Σ drafted           (None if nothing was drafted)
    mean_committed_per_step Σ new_tokens / Σ steps (τ)       (None if no steps were counted)
    greedy_exact            share of prompts whose token_ids equal the reference's, a
                            divergence at a near-tie counting as equal (greedy runs only;
                            None for a method with its own numerics, see below)
    agreement               Σ tokens before the first difference from the reference's run of
                            the same prompt / Σ the longer run's tokens (greedy runs only;
                            1 = identical outputs, no near-tie allowance)
    cost_ratio (c)          (Σ draft_seconds / Σ drafted) / (Σ verify_seconds / Σ steps): one
                            drafted token's time over one target step's (None if nothing drafted)
    k                       the most draft tokens any step of the method drafted (None: none)

The near-tie verdicts need the target model, so they come in from outside as
`near_ties[(question_id, method)] -> bool`; everything else is a function of the records.

A method with its own numerics (a peer that computes the target with other kernels, such as
`llama-cpp`; labels given as `own_numerics`) makes no claim to reproduce our greedy output
token for token, and the near-tie rule, calibrated for our kernels, does not bound how far
its logits stray. Its `greedy_exact` is None (the report says n/a), it is never an
exactness mismatch, and `agreement` says how closely it tracked `ar`. Its summary entry
carries `own_numerics: true`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Hashable, Iterable, Mapping, Sequence

from specdraft.analysis.costs import drift_text, rates_text
from specdraft.errors import SpecdraftError

Key = tuple[Hashable, str]  # (question_id, method label)
SYNTHETIC_SOURCE = "oracle"  # the draft source of synthetic acceptance (`drafters.oracle`): the report says so
FIELDS = ("tokens_per_second", "speedup_vs_ar", "acceptance_rate", "mean_committed_per_step", "greedy_exact",
          "agreement", "cost_ratio", "k", "mean_k", "prefill_share", "decode_speedup_vs_ar", "valid", "forced_share",
          "mask_share")


class ExactnessError(SpecdraftError):
    """A greedy method's output differs from `ar` beyond the near-tie rule; `mismatches` lists where."""

    def __init__(self, mismatches: Sequence[Key], result=None) -> None:
        self.mismatches = list(mismatches)
        self.result = result  # the BenchResult, when raised by the runner (files are written first)
        listing = ", ".join(f"question {qid} / {method}" for qid, method in self.mismatches)
        super().__init__(
            f"{len(self.mismatches)} greedy output(s) differ from ar beyond a near-tie: {listing}. "
            "Lossless decoding must reproduce the target's greedy output."
        )


def is_greedy(record: Mapping) -> bool:
    """Whether a record comes from a greedy run (temperature 0)."""
    return float(record.get("temperature", 0.0)) == 0.0


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def rates(records: Sequence[Mapping]) -> dict[str, float | None]:
    """tokens_per_second, acceptance_rate and mean_committed_per_step of a group of records."""
    new_tokens = sum(r["new_tokens"] for r in records)
    drafted = [r for r in records if r.get("drafted") is not None]
    counted = [r for r in records if r.get("steps") is not None]
    return {
        "tokens_per_second": _ratio(new_tokens, sum(r["wall_seconds"] for r in records)),
        "acceptance_rate": _ratio(sum(r["accepted"] for r in drafted), sum(r["drafted"] for r in drafted)),
        "mean_committed_per_step": _ratio(sum(r["new_tokens"] for r in counted), sum(r["steps"] for r in counted)),
    }


def _prefill_timed(records: Sequence[Mapping]) -> list[Mapping]:
    return [r for r in records if r.get("prefill_seconds") is not None]


def prefill_share(records: Sequence[Mapping]) -> float | None:
    """Σ prefill_seconds / Σ wall_seconds over the records that time their prompt pass (our loop only)."""
    timed = _prefill_timed(records)
    return _ratio(sum(r["prefill_seconds"] for r in timed), sum(r["wall_seconds"] for r in timed))


def decode_tokens_per_second(records: Sequence[Mapping]) -> float | None:
    """New tokens per second after the prompt pass: Σ new_tokens / Σ (wall − prefill), over timed records."""
    timed = _prefill_timed(records)
    return _ratio(sum(r["new_tokens"] for r in timed), sum(r["wall_seconds"] - r["prefill_seconds"] for r in timed))


def cost_ratio(records: Sequence[Mapping]) -> float | None:
    """c: (Σ draft_seconds / Σ drafted) / (Σ verify_seconds / Σ steps) over the records that carry all four.

    None when nothing was drafted or no verification time was counted (plain decoding, the peers,
    records from before these fields existed).
    """
    timed = [r for r in records if all(r.get(name) is not None
                                       for name in ("draft_seconds", "verify_seconds", "drafted", "steps"))]
    per_draft = _ratio(sum(r["draft_seconds"] for r in timed), sum(r["drafted"] for r in timed))
    per_step = _ratio(sum(r["verify_seconds"] for r in timed), sum(r["steps"] for r in timed))
    return per_draft / per_step if per_draft is not None and per_step else None


def mean_k(records: Sequence[Mapping]) -> float | None:
    """Draft tokens per step over the records that count steps (what a fixed or `auto` k drafted)."""
    counted = [r for r in records if r.get("steps") and r.get("drafted") is not None]
    return _ratio(sum(r["drafted"] for r in counted), sum(r["steps"] for r in counted))


def k_histogram(records: Sequence[Mapping]) -> dict[int, int]:
    """How many steps drafted each k, over the records that list their steps' k."""
    counts: dict[int, int] = {}
    for record in records:
        for k in record.get("k_per_step") or ():
            counts[k] = counts.get(k, 0) + 1
    return dict(sorted(counts.items()))


def drafts_by_source(records: Sequence[Mapping]) -> dict[str, dict[str, int]]:
    """Steps, drafted and accepted per draft source (`none`: plain steps), summed over the records."""
    table: dict[str, dict[str, int]] = {}
    for record in records:
        for source, row in (record.get("by_source") or {}).items():
            total = table.setdefault(source, {"steps": 0, "drafted": 0, "accepted": 0})
            for name in total:
                total[name] += row[name]
    return table


def position_counts(records: Sequence[Mapping]) -> dict[str, tuple[list[int], list[int]]]:
    """Per method that drafted: (Σ accepted_at, Σ drafted_at) per draft position, over its records."""
    counts: dict[str, tuple[list[int], list[int]]] = {}
    for record in records:
        accepted_at, drafted_at = record.get("accepted_at"), record.get("drafted_at")
        if not drafted_at or accepted_at is None:
            continue
        total_accepted, total_drafted = counts.setdefault(record["method"], ([], []))
        for total, values in ((total_accepted, accepted_at), (total_drafted, drafted_at)):
            total.extend([0] * (len(values) - len(total)))
            for i, value in enumerate(values):
                total[i] += value
    return {method: pair for method, pair in counts.items() if pair[1] and pair[1][0] > 0}


def max_k(records: Sequence[Mapping]) -> int | None:
    """The method's k: the largest `k` among the records (None when no record has one)."""
    ks = [r["k"] for r in records if r.get("k") is not None]
    return max(ks) if ks else None


def comparable(record: Mapping, reference: Mapping) -> bool:
    """Whether a run's tokens can be held to the reference's: both under the prompt's constraint, or neither."""
    return bool(record.get("constrained")) == bool(reference.get("constrained"))


def constrained_figures(records: Sequence[Mapping]) -> dict[str, float | None]:
    """Over the runs under a constraint (None without any): the share of answers valid by an independent validator,
    of tokens the grammar forced (no pass), and of the time after the prompt pass spent computing masks."""
    constrained = [r for r in records if r.get("constrained")]
    checked = [r for r in constrained if r.get("valid") is not None]
    decoding = sum(r["wall_seconds"] - (r.get("prefill_seconds") or 0.0) for r in constrained)
    return {"valid": _ratio(sum(bool(r["valid"]) for r in checked), len(checked)),
            "forced_share": _ratio(sum(r["forced_tokens"] or 0 for r in constrained),
                                   sum(r["new_tokens"] for r in constrained)),
            "mask_share": _ratio(sum(r["mask_seconds"] or 0.0 for r in constrained), decoding)}


def _exact(record: Mapping, reference: Mapping, near_ties: Mapping[Key, bool]) -> bool:
    if record["token_ids"] == reference["token_ids"]:
        return True
    return bool(near_ties.get((record["question_id"], record["method"]), False))


def greedy_exact(records: Sequence[Mapping], reference: Mapping[Hashable, Mapping],
                 near_ties: Mapping[Key, bool]) -> float | None:
    """Share of `records` equal to the reference run of the same prompt (None unless both are greedy).

    Prompts without a reference run are left out; a sampled run among `records` gives None.
    """
    if not all(is_greedy(r) for r in records):
        return None
    pairs = [(r, reference[r["question_id"]]) for r in records
             if r["question_id"] in reference and is_greedy(reference[r["question_id"]])
             and comparable(r, reference[r["question_id"]])]
    if not pairs:
        return None
    return sum(_exact(r, ref, near_ties) for r, ref in pairs) / len(pairs)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(records: Sequence[Mapping], reference: Mapping[Hashable, Mapping]) -> float | None:
    """Σ tokens before the first difference from the reference run / Σ the longer run's tokens (greedy only).

    Prompts without a greedy reference run are left out; a sampled run among `records` gives None.
    """
    if not all(is_greedy(r) for r in records):
        return None
    pairs = [(r["token_ids"], reference[r["question_id"]]["token_ids"]) for r in records
             if r["question_id"] in reference and is_greedy(reference[r["question_id"]])
             and comparable(r, reference[r["question_id"]])]
    longest = sum(max(len(a), len(b)) for a, b in pairs)
    if not pairs or not longest:
        return None
    return sum(_common_prefix(a, b) for a, b in pairs) / longest


def _group(records: Iterable[Mapping], field: str) -> dict[Hashable, list[Mapping]]:
    groups: dict[Hashable, list[Mapping]] = {}
    for record in records:
        groups.setdefault(record[field], []).append(record)
    return groups


def _figures(records: Sequence[Mapping], reference_records: Sequence[Mapping],
             near_ties: Mapping[Key, bool], own_numerics: bool = False) -> dict[str, float | None]:
    figures = rates(records)
    reference_tps = rates(reference_records)["tokens_per_second"] if reference_records else None
    tps = figures["tokens_per_second"]
    figures["speedup_vs_ar"] = tps / reference_tps if tps is not None and reference_tps else None
    # The prompt pass is the same work for every method of ours: the speedup of what follows it shows what
    # speculation did where a long prompt's prefill bounds the whole answer's (Amdahl).
    decode_tps = decode_tokens_per_second(records)
    reference_decode = decode_tokens_per_second(reference_records) if reference_records else None
    figures["decode_speedup_vs_ar"] = decode_tps / reference_decode if decode_tps and reference_decode else None
    figures["prefill_share"] = prefill_share(records)
    by_prompt = {r["question_id"]: r for r in reference_records}
    judged = reference_records and not own_numerics
    figures["greedy_exact"] = greedy_exact(records, by_prompt, near_ties) if judged else None
    figures["agreement"] = agreement(records, by_prompt) if reference_records else None
    figures["cost_ratio"], figures["k"], figures["mean_k"] = cost_ratio(records), max_k(records), mean_k(records)
    figures |= constrained_figures(records)
    return {name: figures[name] for name in FIELDS}


def summarize(
    records: Sequence[Mapping],
    reference: str | None = "ar",
    near_ties: Mapping[Key, bool] | None = None,
    methods: Sequence[str] | None = None,
    own_numerics: Iterable[str] = (),
) -> dict[str, dict]:
    """Per method: the figures of FIELDS overall and per category (`{"categories": {cat: figures}}`).

    `reference` is the label of the `ar` method (None or absent: no speedup, no greedy_exact);
    `methods` fixes the order of the result (default: first appearance in the records);
    `own_numerics` are the labels of methods not held to exactness (their entries say so).
    """
    near_ties = near_ties or {}
    own_numerics = set(own_numerics)
    by_method = _group(records, "method")
    reference_records = by_method.get(reference, []) if reference else []
    reference_by_category = _group(reference_records, "category")
    summary = {}
    for method in (methods if methods is not None else list(by_method)):
        own = by_method.get(method, [])
        if not own:
            continue
        peer = method in own_numerics
        figures = _figures(own, reference_records, near_ties, peer)
        figures["own_numerics"] = peer
        figures["k_histogram"] = k_histogram(own)
        figures["by_source"] = drafts_by_source(own)
        accepted_at, drafted_at = position_counts(own).get(method, ([], []))
        figures["acceptance_by_position"] = [a / d if d else None for a, d in zip(accepted_at, drafted_at)]
        figures["categories"] = {
            category: _figures(group, reference_by_category.get(category, []), near_ties, peer)
            for category, group in _group(own, "category").items()
        }
        summary[method] = figures
    return summary


def find_mismatches(
    records: Sequence[Mapping],
    reference: str | None = "ar",
    near_ties: Mapping[Key, bool] | None = None,
    own_numerics: Iterable[str] = (),
) -> list[Key]:
    """(question_id, method) of every greedy run whose tokens differ from the greedy reference's, not at a near-tie.

    Methods in `own_numerics` are not held to exactness and never listed.
    """
    near_ties = near_ties or {}
    own_numerics = set(own_numerics)
    if not reference:
        return []
    by_prompt = {r["question_id"]: r for r in records if r["method"] == reference and is_greedy(r)}
    return [
        (r["question_id"], r["method"]) for r in records
        if r["method"] != reference and r["method"] not in own_numerics and is_greedy(r)
        and r["question_id"] in by_prompt and comparable(r, by_prompt[r["question_id"]])
        and not _exact(r, by_prompt[r["question_id"]], near_ties)
    ]


def check_exactness(records: Sequence[Mapping], reference: str | None = "ar",
                    near_ties: Mapping[Key, bool] | None = None, own_numerics: Iterable[str] = ()) -> None:
    """Raise ExactnessError listing every greedy run that differs from the reference beyond a near-tie."""
    mismatches = find_mismatches(records, reference, near_ties, own_numerics)
    if mismatches:
        raise ExactnessError(mismatches)


# ----- the markdown report -------------------------------------------------------------------------------
def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def exact_cell(figures: Mapping, own_numerics: bool) -> str:
    """The greedy-exact cell of a method (or category): n/a for a method not held to exactness."""
    return "n/a" if own_numerics else _fmt(figures.get("greedy_exact"), ".0%")


def costs_lines(costs: Mapping | None) -> list[str]:
    """The report's section on what this machine's passes cost (`specdraft costs`), if measured."""
    if not costs:
        return []
    widths = sorted(costs["pass_seconds"], key=int)
    header = ["tokens in a target pass", *widths] + (["draft, 1 token"] if costs.get("draft_seconds") else [])
    row = ["ms", *(f"{costs['pass_seconds'][w] * 1e3:.1f}" for w in widths)]
    if costs.get("draft_seconds"):
        row.append(f"{costs['draft_seconds'] * 1e3:.1f} (c = {costs['draft_ratio']:.2f})")
    lines = ["## This machine's costs", "", *_table(header, [row]), "",
             f"Measured after the prompts (`specdraft costs`, {costs['context']} cached tokens): {rates_text(costs)}. "
             "Speedups depend on these: compare runs only on machines whose costs agree.", ""]
    warning = drift_text(costs)
    return lines + ([warning, ""] if warning else [])


def render_report(summary: Mapping, plots: Sequence[str] = ()) -> str:
    """`report.md`: speedup per method × category (as Spec-Bench's leaderboard), details, plots, settings, machine.

    `plots` are the PNG file names written beside the report (listed as images). With a method
    of its own numerics (a peer such as `llama-cpp`) the tables gain an "agreement" column.
    """
    methods: Mapping[str, Mapping] = summary.get("methods", {})
    categories = list(dict.fromkeys(c for figures in methods.values() for c in figures["categories"]))
    peers = [m for m, figures in methods.items() if figures.get("own_numerics")]
    agree = ["agreement"] if peers else []
    lines = ["# specdraft bench", "", "## Speedup over ar by category", ""]
    header = ["method", *categories, "overall", "τ", "α", "c", "k", "mean k", "tokens/s", "greedy exact", *agree]
    rows = []
    for method, figures in methods.items():
        peer = bool(figures.get("own_numerics"))
        per_category = [_fmt(figures["categories"].get(c, {}).get("speedup_vs_ar"), ".2f", "×") for c in categories]
        rows.append([f"`{method}`", *per_category, _fmt(figures["speedup_vs_ar"], ".2f", "×"),
                     _fmt(figures["mean_committed_per_step"]), _fmt(figures["acceptance_rate"]),
                     _fmt(figures.get("cost_ratio"), ".3f"), _fmt(figures.get("k"), "d"),
                     _fmt(figures.get("mean_k"), ".2f"), _fmt(figures["tokens_per_second"], ".1f"),
                     exact_cell(figures, peer),
                     *([_fmt(figures.get("agreement"), ".0%")] if peers else [])])
    lines += _table(header, rows)
    lines += ["", "## Per method and category", ""]
    rows = []
    for method, figures in methods.items():
        peer = bool(figures.get("own_numerics"))
        for category, cat in [*figures["categories"].items(), ("all", figures)]:
            rows.append([f"`{method}`", category, _fmt(cat["speedup_vs_ar"], ".2f", "×"),
                         _fmt(cat.get("decode_speedup_vs_ar"), ".2f", "×"), _fmt(cat.get("prefill_share"), ".0%"),
                         _fmt(cat["mean_committed_per_step"]), _fmt(cat["acceptance_rate"]),
                         _fmt(cat.get("cost_ratio"), ".3f"), _fmt(cat.get("mean_k"), ".2f"),
                         _fmt(cat["tokens_per_second"], ".1f"),
                         exact_cell(cat, peer), *([_fmt(cat.get("agreement"), ".0%")] if peers else [])])
    lines += _table(["method", "category", "speedup", "after prefill", "prefill", "τ", "α", "c", "mean k", "tokens/s",
                     "greedy exact", *agree], rows)
    histograms = {m: f["k_histogram"] for m, f in methods.items() if f.get("k_histogram")}
    if histograms:
        lines += ["", "## Draft tokens chosen per step", "",
                  "Steps that drafted each k (with `k=auto` the cost model chooses per step; 0 = a plain step).", ""]
        ks = sorted({int(k) for h in histograms.values() for k in h})
        lines += _table(["method", *[f"k={k}" for k in ks]],
                        [[f"`{m}`", *[str(h.get(k, h.get(str(k), 0))) for k in ks]] for m, h in histograms.items()])
    by_position = {m: f["acceptance_by_position"] for m, f in methods.items() if f.get("acceptance_by_position")}
    if by_position:
        lines += ["", "## Acceptance per draft position", "",
                  "Of the steps that drafted position i (a tree: depth i), the share whose accepted path reached it.", ""]
        depth = max(len(rates_) for rates_ in by_position.values())
        lines += _table(["method", *[f"{i + 1}" for i in range(depth)]],
                        [[f"`{m}`", *[_fmt(rates_[i] if i < len(rates_) else None, ".2f") for i in range(depth)]]
                         for m, rates_ in by_position.items()])
    constrained = {m: f for m, f in methods.items() if f.get("forced_share") is not None}
    if constrained:
        lines += ["", "## Answers under the prompts' JSON schemas", "",
                  "valid: answers `jsonschema` accepts; forced: tokens the grammar alone decided (appended without a "
                  "pass); masks: time computing the grammar's masks, as a share of the time after the prompt pass.", ""]
        lines += _table(["method", "valid", "forced", "masks"],
                        [[f"`{m}`", _fmt(f.get("valid"), ".0%"), _fmt(f["forced_share"], ".1%"),
                          _fmt(f.get("mask_share"), ".1%")] for m, f in constrained.items()])
    sources = {m: f["by_source"] for m, f in methods.items() if set(f.get("by_source") or {}) - {"none"}}
    if sources:
        lines += ["", "## Who drafted", "",
                  "Steps per draft source (`none`: nothing worth proposing, or the cost model chose a plain step).", ""]
        lines += _table(["method", "source", "steps", "drafted", "accepted", "α"],
                        [[f"`{m}`", source, str(row["steps"]), str(row["drafted"]), str(row["accepted"]),
                          _fmt(row["accepted"] / row["drafted"] if row["drafted"] else None, ".2f")]
                         for m, table in sources.items() for source, row in table.items()])
    lines += ["", "speedup: tokens/s over `ar`'s on the same prompts and budget; after prefill: the same for the time "
              "after the prompt pass (which is the same work for every method of ours; peers do not report it); "
              "prefill: the prompt pass's share of the method's time; τ: tokens per target step; "
              "α: accepted / drafted; c: one drafted token's time / one verification step's time; "
              "k: most draft tokens per step; mean k: draft tokens per step on average; greedy exact: share of prompts equal to `ar` (near-ties allowed).", ""]
    if peers:
        listed = ", ".join(f"`{m}`" for m in peers)
        lines += [f"{listed}: the same model computed by other kernels (own numerics), so its greedy output may "
                  "part from `ar` wherever the top two logits are close; that is not an exactness failure, and "
                  "greedy exact is n/a. agreement: tokens before the first difference from `ar` / tokens of the "
                  "longer output, over the greedy prompts (no near-tie allowance).", ""]
    repeats = (summary.get("settings") or {}).get("repeats", 1)
    if repeats > 1:
        lines += [f"Each prompt ran {repeats} times per method, round robin; every figure is from the run of median time."
                  + ("" if not summary.get("repeats_disagree") else
                     f" Repeats gave different tokens for {', '.join(summary['repeats_disagree'])}: a method that is "
                     "not deterministic (see `repeats_agree` in results.jsonl)."), ""]
    synthetic = [m for m, figures in methods.items() if SYNTHETIC_SOURCE in (figures.get("by_source") or {})]
    if synthetic:
        listed = ", ".join(f"`{m}`" for m in synthetic)
        lines += [f"{listed}: synthetic acceptance, a measurement of the machinery, not a drafter (bench only): the "
                  "`oracle` drafter proposes the target's own greedy tokens, recorded by an untimed `ar` run of each "
                  "prompt, each wrong with probability 1 − oracle-alpha, so a draft token is accepted with "
                  "probability oracle-alpha given the ones before it were.", ""]
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{Path(name).stem.replace('_', ' ')}]({name})" for name in plots]
        lines.append("")
    lines += costs_lines(summary.get("costs"))
    for title in ("settings", "machine"):
        lines += [f"## {title.capitalize()}", ""]
        lines += [f"- {key}: `{value}`" for key, value in summary.get(title, {}).items()]
        lines.append("")
    return "\n".join(lines)
