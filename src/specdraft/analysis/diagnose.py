"""How well a draft fits a target, per output position, teacher-forced on the target's own greedy output.

For each prompt:

```
output  = SpeculativeDecoder(target).generate(prompt)        # the target's greedy tokens
p_logits = target.forward(prompt + output[:-1])[-N:]          # one pass each, fresh caches,
q_logits = draft.forward(prompt + output[:-1])[-N:]           # row j predicts output[j]
per position j: top-1 agreement, Σ_x min(p, q), ½ Σ_x |p - q|, cos(logits), cos(hidden)
measured = SpeculativeDecoder(target, ModelDrafter(draft), k).stream(prompt)   # --measure
```

Temperature. Top-1 agreement always compares argmaxes (what greedy verification tests). The
distribution metrics (Σ min(p, q), total variation) use `p = warp(target logits)` and
`q = warp(draft logits)` at the run's temperature, or at temperature 1 when the run is greedy
(at temperature 0 both are point masses and Σ min(p, q) would only repeat the agreement).
The predicted α is the mean top-1 agreement for a greedy run and the mean Σ min(p, q) (the
exact probability that a sampled draft token is accepted) for a sampled one. The measured run
decodes at the run's temperature (seed 0) on the same prompt; for a sampled run its path
differs from the greedy one the prediction was taken on, so the two agree only on average.

Measured α is per token, as the prediction is: accepted draft tokens / tested draft tokens,
a draft token being tested when every token before it in its step was accepted (a step's
rejection counts once). The engine's `accepted / drafted` (which also counts the draft tokens
after a rejection, never tested) is reported beside it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from specdraft.drafters import ModelDrafter
from specdraft.engine import SpeculativeDecoder
from specdraft.errors import SpecdraftError
from specdraft.models import registry
from specdraft.models.causal_lm import CausalLM
from specdraft.run import RECOVERED, StepEvent
from specdraft.sampling import SamplingParams, warp

DIAGNOSE_JSON, AGREEMENT_PNG = "diagnose.json", "agreement.png"
ROLLING_WINDOW = 8  # positions averaged per point of agreement.png
CHUNK = 64  # output positions warped at once (bounds memory at large vocabularies)
DIAGNOSE_K = 5  # draft tokens per step of the measured run (fixed, so measured α compares with predicted)
METRIC_NAMES = ("agreement", "expected_acceptance", "total_variation", "logit_cosine", "hidden_cosine")


# ----- per-position metrics (pure: tensors in, numbers out) ------------------------------------------------
@dataclass
class PositionMetrics:
    """Draft against target at each output position j (row j predicts output token j).

    agreement            argmax of the draft's logits == argmax of the target's
    expected_acceptance  Σ_x min(p(x), q(x)): the probability a token drawn from q is accepted
    total_variation      ½ Σ_x |p(x) - q(x)| (= 1 - expected_acceptance)
    logit_cosine         cosine similarity of the two raw logit vectors
    hidden_cosine        cosine similarity of the final hidden states (None: hidden sizes differ)
    """

    agreement: list[bool]
    expected_acceptance: list[float]
    total_variation: list[float]
    logit_cosine: list[float]
    hidden_cosine: list[float] | None = None

    def __len__(self) -> int:
        return len(self.agreement)

    def means(self) -> dict[str, float | None]:
        """The mean of each metric over the positions (None for an absent or empty one)."""
        return {name: mean(getattr(self, name)) for name in METRIC_NAMES}


def mean(values: Sequence[float] | None) -> float | None:
    """The arithmetic mean (bools count as 0/1); None for None or an empty sequence."""
    return sum(float(v) for v in values) / len(values) if values else None


def compare_positions(
    target_logits: torch.Tensor,  # [N, V]
    draft_logits: torch.Tensor,  # [N, V]
    params: SamplingParams,  # the warping of p and q (should not be greedy: point masses say little)
    target_hidden: torch.Tensor | None = None,  # [N, H]
    draft_hidden: torch.Tensor | None = None,  # [N, H']
) -> PositionMetrics:
    """The per-position metrics of two aligned logit (and hidden-state) sequences."""
    if target_logits.shape != draft_logits.shape:
        raise SpecdraftError(f"Target and draft logits differ in shape: {tuple(target_logits.shape)} and "
                             f"{tuple(draft_logits.shape)}; the draft must share the target's vocabulary.")
    agree, overlap, tv, cos = [], [], [], []
    for start in range(0, target_logits.shape[0], CHUNK):
        t = target_logits[start:start + CHUNK].float()  # [n, V]
        d = draft_logits[start:start + CHUNK].float()  # [n, V]
        p, q = warp(t, params), warp(d, params)  # [n, V] each
        agree.append(t.argmax(-1) == d.argmax(-1))  # [n]
        overlap.append(torch.minimum(p, q).sum(-1))  # [n]
        tv.append(0.5 * (p - q).abs().sum(-1))  # [n]
        cos.append(F.cosine_similarity(t, d, dim=-1))  # [n]
    hidden = None
    if target_hidden is not None and draft_hidden is not None and target_hidden.shape == draft_hidden.shape:
        hidden = F.cosine_similarity(target_hidden.float(), draft_hidden.float(), dim=-1).tolist()  # [N]

    def joined(parts: list[torch.Tensor]) -> list:
        return torch.cat(parts).tolist() if parts else []
    return PositionMetrics(joined(agree), joined(overlap), joined(tv), joined(cos), hidden)


@torch.inference_mode()
def teacher_force(
    model: CausalLM, prompt_ids: Sequence[int], output_ids: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One pass over prompt + output[:-1] from a fresh cache: logits[N, V] and final hidden states[N, H].

    Row j holds what the model predicts for output token j (N = len(output_ids)). The cache is
    cleared again afterwards.
    """
    if not output_ids:
        raise SpecdraftError("Nothing to compare: the target generated no tokens for this prompt.")
    count = len(output_ids)
    tokens = torch.tensor([[*prompt_ids, *output_ids[:-1]]], dtype=torch.long, device=model.device)  # [1, L + N - 1]
    model.reset()
    try:
        out = model.forward(tokens, logits_to_keep=count, hidden_to_keep=count)
    finally:
        model.reset()
    hidden = out.hidden_states[0] if out.hidden_states is not None else None  # [N, H]
    return out.logits[0], hidden  # [N, V]


def rolling_mean(values: Sequence[float], window: int = ROLLING_WINDOW) -> list[float]:
    """Trailing mean at each position j over values[max(0, j - window + 1) .. j]."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out, total = [], 0.0
    for j, value in enumerate(values):
        total += float(value)
        if j >= window:
            total -= float(values[j - window])
        out.append(total / min(j + 1, window))
    return out


# ----- generations -------------------------------------------------------------------------------------------
@dataclass
class GreedyOutput:
    """The target's greedy output: tokens and the text each adds (aligned one to one)."""

    token_ids: list[int]
    pieces: list[str]


def greedy_output(target: CausalLM, prompt_ids: Sequence[int], max_new_tokens: int) -> GreedyOutput:
    """The target's own greedy continuation (plain decoding with our loop)."""
    token_ids, pieces = [], []
    for event in SpeculativeDecoder(target).stream(list(prompt_ids), SamplingParams(), max_new_tokens):
        token_ids += event.token_ids
        pieces += event.pieces
    return GreedyOutput(token_ids, pieces)


@dataclass
class MeasuredRun:
    """Counts of a real speculative run: α per token (accepted / tested) and the engine's accepted / drafted."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # steps whose draft had a rejection (a recovered token)
    new_tokens: int = 0

    @property
    def alpha(self) -> float | None:
        """Per-token α: accepted / (accepted + rejected); None when no draft token was tested."""
        tested = self.accepted + self.rejected
        return self.accepted / tested if tested else None

    @property
    def acceptance_rate(self) -> float | None:
        """The engine's α: accepted / drafted."""
        return self.accepted / self.drafted if self.drafted else None

    def record(self, event: StepEvent) -> None:
        """Count one step. A rejection is a recovered token; a step cut short by EOS or a stop string
        (accepted < drafted, no recovered token) rejected nothing that was tested."""
        self.steps += 1
        self.drafted += event.drafted
        self.accepted += event.accepted
        self.rejected += RECOVERED in event.kinds
        self.new_tokens += len(event.token_ids)

    def add(self, other: "MeasuredRun") -> "MeasuredRun":
        """The pooled counts of two runs."""
        return MeasuredRun(*(getattr(self, n) + getattr(other, n)
                             for n in ("steps", "drafted", "accepted", "rejected", "new_tokens")))

    def to_dict(self) -> dict:
        """The JSON form, with both α's."""
        return {**asdict(self), "alpha": self.alpha, "acceptance_rate": self.acceptance_rate}


def measure(target: CausalLM, draft: CausalLM, prompt_ids: Sequence[int], sampling: SamplingParams,
            max_new_tokens: int, k: int = DIAGNOSE_K) -> MeasuredRun:
    """Run `SpeculativeDecoder(target, ModelDrafter(draft), k)` and count per-token acceptance step by step."""
    run = MeasuredRun()
    decoder = SpeculativeDecoder(target, ModelDrafter(draft), k=k)
    for event in decoder.stream(list(prompt_ids), sampling, max_new_tokens):
        run.record(event)
    return run


# ----- one prompt, many prompts ----------------------------------------------------------------------------
@dataclass
class PromptDiagnosis:
    """Everything `diagnose` found for one prompt."""

    question_id: int | str
    category: str
    prompt_tokens: int
    output: GreedyOutput
    metrics: PositionMetrics
    predicted_alpha: float | None
    measured: MeasuredRun | None = None

    def to_dict(self) -> dict:
        """The JSON form: ids, text pieces, per-position metrics, their means and both α's."""
        return {
            "question_id": self.question_id, "category": self.category, "prompt_tokens": self.prompt_tokens,
            "token_ids": self.output.token_ids, "pieces": self.output.pieces,
            "positions": asdict(self.metrics), "means": self.metrics.means(),
            "predicted_alpha": self.predicted_alpha,
            "measured": self.measured.to_dict() if self.measured is not None else None,
        }


def predicted_alpha(metrics: PositionMetrics, greedy: bool) -> float | None:
    """Greedy: mean top-1 agreement; sampled: mean Σ min(p, q)."""
    return mean(metrics.agreement if greedy else metrics.expected_acceptance)


def metric_params(temperature: float) -> SamplingParams:
    """The warping of p and q for the distribution metrics: the run's temperature, or 1 for a greedy run."""
    return SamplingParams(temperature=temperature if temperature > 0 else 1.0)


def diagnose_prompt(
    target: CausalLM, draft: CausalLM, prompt_ids: Sequence[int], *, max_new_tokens: int = 128,
    temperature: float = 0.0, measure_k: int | None = DIAGNOSE_K, question_id: int | str = 0, category: str = "",
) -> PromptDiagnosis:
    """Teacher-force the target's greedy output through both models, compare, and (with `measure_k`) run.

    `measure_k` None skips the measured run.
    """
    output = greedy_output(target, prompt_ids, max_new_tokens)
    target_logits, target_hidden = teacher_force(target, prompt_ids, output.token_ids)  # [N, V], [N, H]
    draft_logits, draft_hidden = teacher_force(draft, prompt_ids, output.token_ids)  # [N, V], [N, H']
    metrics = compare_positions(target_logits, draft_logits, metric_params(temperature), target_hidden, draft_hidden)
    measured = None
    if measure_k is not None:
        measured = measure(target, draft, prompt_ids, SamplingParams(temperature=temperature), max_new_tokens,
                           measure_k)
    return PromptDiagnosis(question_id, category, len(prompt_ids), output, metrics,
                           predicted_alpha(metrics, temperature == 0), measured)


def overall(diagnoses: Sequence[PromptDiagnosis], greedy: bool) -> dict:
    """Pooled over every position of every prompt: metric means, predicted α and the pooled measured run."""
    pooled = PositionMetrics(
        *([v for d in diagnoses for v in getattr(d.metrics, name)] for name in METRIC_NAMES[:4]),
        hidden_cosine=([v for d in diagnoses for v in d.metrics.hidden_cosine]
                       if diagnoses and all(d.metrics.hidden_cosine is not None for d in diagnoses) else None),
    )
    runs = [d.measured for d in diagnoses if d.measured is not None]
    measured = None
    for run in runs:
        measured = run if measured is None else measured.add(run)
    return {"positions": len(pooled), "means": pooled.means(), "predicted_alpha": predicted_alpha(pooled, greedy),
            "measured": measured.to_dict() if measured is not None else None}


# ----- the command ------------------------------------------------------------------------------------------
@dataclass
class DiagnoseConfig:
    """Everything one `specdraft diagnose` run is given (the CLI options, parsed)."""

    target: str = registry.DEFAULT_TARGET
    draft: str = registry.DEFAULT_DRAFT
    prompts: Path | None = None  # None: the shipped prompt set
    categories: Sequence[str] | None = None
    max_prompts: int | None = None  # per category, in file order (as in bench)
    max_new_tokens: int = 128
    temperature: float = 0.0
    draft_quant: str = "auto"
    dtype: str = "bfloat16"
    threads: int | None = None
    measure: bool = True
    k: int = DIAGNOSE_K
    chat: bool | None = None


@dataclass
class DiagnoseResult:
    """The diagnoses of every prompt, pooled figures and the settings, as diagnose.json holds them."""

    settings: dict
    prompts: list[PromptDiagnosis] = field(default_factory=list)
    overall: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The JSON form written to diagnose.json."""
        return {"settings": self.settings, "overall": self.overall, "prompts": [d.to_dict() for d in self.prompts]}


def _check(config: DiagnoseConfig) -> None:
    if config.max_new_tokens < 1:
        raise SpecdraftError(f"--max-new-tokens must be >= 1, got {config.max_new_tokens}.")
    if config.measure and config.k < 1:
        raise SpecdraftError(f"--k must be >= 1, got {config.k}.")
    if config.threads is not None and config.threads < 1:
        raise SpecdraftError(f"--threads must be >= 1, got {config.threads}.")
    SamplingParams(temperature=config.temperature)  # raises on a bad temperature


def run_diagnose(config: DiagnoseConfig,
                 on_prompt: Callable[[PromptDiagnosis], None] | None = None) -> DiagnoseResult:
    """Load the pair, diagnose every selected prompt (calling `on_prompt` after each) and pool the figures."""
    from specdraft.prompts import default_prompts_path, load_prompts, select_prompts
    from specdraft.models.early_exit import early_exit_layer, early_exit_view
    from specdraft.models.loading import check_compatible, draft_requantized, load_model, prepare_draft
    from specdraft.text import encode_prompt

    _check(config)
    early_exit_layer(config.draft)  # a malformed early-exit:L fails before loading
    prompts_path = Path(config.prompts) if config.prompts is not None else default_prompts_path()
    prompts = select_prompts(load_prompts(prompts_path), config.categories, config.max_prompts)
    threads_before = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        target = load_model(config.target, dtype=config.dtype)
        exit_layer = early_exit_layer(config.draft)
        if exit_layer is not None:  # the target's own first layers: nothing to load or quantize
            draft = early_exit_view(target, exit_layer)
        else:
            draft = load_model(config.draft, dtype=config.dtype, device=target.device,
                               requantized=draft_requantized(config.draft_quant, target.device))
            check_compatible(target, draft)
            draft = prepare_draft(draft, config.draft_quant)
        settings = {
            "target": config.target, "draft": draft.name, "prompts": str(prompts_path),
            "categories": list(config.categories or []), "max_prompts": config.max_prompts,
            "max_new_tokens": config.max_new_tokens, "temperature": config.temperature,
            "metric_temperature": metric_params(config.temperature).temperature,
            "predicted_alpha": "mean top-1 agreement" if config.temperature == 0 else "mean Σ min(p, q)",
            "measure": config.measure, "k": config.k if config.measure else None, "seed": 0,
            "dtype": str(target.dtype).removeprefix("torch."), "device": str(target.device),
            "threads": torch.get_num_threads(), "hidden_sizes": [target.config.hidden_size, draft.config.hidden_size],
        }
        result = DiagnoseResult(settings)
        for prompt in prompts:
            ids = encode_prompt(target.tokenizer, prompt.turns[0], chat=config.chat)
            for model in (target, draft):
                if len(ids) + config.max_new_tokens > model.max_context:
                    raise SpecdraftError(
                        f"Question {prompt.question_id!r} has {len(ids)} prompt tokens; with --max-new-tokens "
                        f"{config.max_new_tokens} that passes {model.name}'s context of {model.max_context}. "
                        "Lower --max-new-tokens or leave that prompt out.")
            diagnosis = diagnose_prompt(target, draft, ids, max_new_tokens=config.max_new_tokens,
                                        temperature=config.temperature,
                                        measure_k=config.k if config.measure else None,
                                        question_id=prompt.question_id, category=prompt.category)
            result.prompts.append(diagnosis)
            if on_prompt is not None:
                on_prompt(diagnosis)
        result.overall = overall(result.prompts, config.temperature == 0)
    finally:
        torch.set_num_threads(threads_before)
    return result


def write_outputs(result: DiagnoseResult, out: str | Path, window: int = ROLLING_WINDOW) -> list[Path]:
    """Write OUT/diagnose.json and OUT/agreement.png; returns their paths."""
    import json

    from specdraft.analysis.charts import agreement_chart

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / DIAGNOSE_JSON
    json_path.write_text(json.dumps(result.to_dict(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    series = [(f"{d.category}:{d.question_id}", rolling_mean(d.metrics.agreement, window)) for d in result.prompts]
    png_path = agreement_chart(series, out / AGREEMENT_PNG, window)
    return [json_path, png_path]
