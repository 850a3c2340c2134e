"""Tier 2 through the whole engine: sampled output of every drafter follows the target exactly.

A tiny random Qwen2 on an 8-token vocabulary is the target. Its exact distribution of the
first two generated tokens after a prompt, p(a) · p(b | a), is computed from its own logits;
each drafter then generates two tokens for many seeds, and a chi-square test compares the
counts of (a, b) with it. The prompt repeats itself, so the free drafters (deterministic
proposals, verified as point masses) propose from the first step. A negative control
(a residual that keeps a rejected deterministic proposal) must fail the same test. Tree
drafts (`model`, `medusa`, `eagle`, `ngram`, `suffix` with a tree budget) face the same test after a prompt
whose tail was followed by three different tokens.

Power: 1,500 draws over 64 cells at α = 1e-3 catch every bias of total variation ≥ 0.10 with probability 0.9
(`goodness_of_fit.detectable_bias(1500, 63, 1e-3)`): these quick tests catch gross errors of every drafter; the
full-power tests (total variation 0.02, the drafters' default options, warpers on) are in
`test_engine_statistics.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
from transformers import Qwen2ForCausalLM

import specdraft.verify as verify_module
from conftest import SMALL_V, perturbed, small_sampling_target
from registered_drafters import build, random_eagle, random_medusa, registered
from specdraft.analysis.check import answer_start
from specdraft.exactness import exact_two_tokens
from specdraft.goodness_of_fit import chi_square_pvalue
from specdraft import SamplingParams, SpeculativeDecoder
from specdraft.drafters import make_drafter
from specdraft.models.causal_lm import CausalLM
from specdraft.policy import DEFAULT_SOURCE, FixedK
from specdraft.stats import GenerationStats

V = SMALL_V
PROMPT = [1, 2, 3, 4, 1, 2, 3]  # the tail [2, 3] occurred before: ngram proposes [4, 1, 2, ...]
SAMPLES = 1500
PARAMS = SamplingParams(temperature=1.0)
P_PASS = 1e-3
P_REJECT = 1e-6


@pytest.fixture(scope="module")
def target_model() -> Qwen2ForCausalLM:
    return small_sampling_target()


def sampled_pairs(decoder: SpeculativeDecoder, prompt: list[int] = PROMPT) -> tuple[np.ndarray, dict]:
    """`[V * V]` counts of the first two generated tokens over SAMPLES seeds, and drafts per source
    (plus `"trees"`: steps whose draft branched)."""
    counts, drafted = np.zeros(V * V), {"trees": 0}
    for seed in range(SAMPLES):
        stats = GenerationStats()  # answers of four tokens (a second step has room to draft), stepped until two
        a, b = answer_start(decoder, prompt, SamplingParams(temperature=PARAMS.temperature, seed=seed), 4, 2, stats)[:2]
        counts[a * V + b] += 1
        for source, row in stats.by_source().items():
            drafted[source] = drafted.get(source, 0) + row["drafted"]
        drafted["trees"] += sum(k > depth for k, depth in zip(stats.k_per_step, stats.depth_per_step))
    return counts, drafted


QUICK = {"model", "ngram"}  # chains of a draft model and of a lookup in the quick set; every other drafter's run is `slow`
QUICK_TREES = {"ngram"}  # trees: a lookup's in the quick set (the `model` drafter's trees run in `slow`)


def quick_or_slow(names, quick: set[str] = QUICK) -> list:
    """`names` as parameters, those outside `quick` marked `slow` (each takes 15-35 s on 2 cores)."""
    return [name if name in quick else pytest.param(name, marks=pytest.mark.slow) for name in names]


@pytest.mark.parametrize("name", quick_or_slow(registered()))
def test_sampled_output_follows_the_target(target_model, name):
    draft = CausalLM(perturbed(target_model, noise=0.5, seed=3))
    target = CausalLM(target_model)
    decoder = SpeculativeDecoder(target, build(name, target, draft), k=3)
    counts, drafted = sampled_pairs(decoder)
    assert all(drafted.get(source, 0) > SAMPLES // 10 for source in name.split("+")), drafted
    pvalue = chi_square_pvalue(counts, exact_two_tokens(target_model, PROMPT).ravel() * SAMPLES)
    assert pvalue > P_PASS, f"{name}: p-value {pvalue:.3g}"


TREE_PROMPT = [1, 2, 3, 4, 1, 2, 5, 1, 2, 6, 1, 2]  # [1, 2] was followed by 3, 5 and 6: lookup trees branch
TREE_BUDGET = {"medusa": 3}  # fewer nodes than candidates: a drawn child left out by its value would show
TREE_DRAFTERS = {
    "model": lambda target, draft: make_drafter("model", {"draft-confidence": 0.05}, draft_model=draft),
    "medusa": lambda target, draft: random_medusa(target),
    "eagle": lambda target, draft: random_eagle(target),
    "ngram": lambda target, draft: make_drafter("ngram"),
    "suffix": lambda target, draft: make_drafter("suffix"),
}


@pytest.mark.parametrize("name", quick_or_slow(sorted(TREE_DRAFTERS), QUICK_TREES))
def test_sampled_tree_output_follows_the_target(target_model, name):
    """Tree drafts (deterministic children, tried as point masses in sibling order) keep the target's
    distribution through the whole engine."""
    draft = CausalLM(perturbed(target_model, noise=0.5, seed=3))
    target = CausalLM(target_model)
    decoder = SpeculativeDecoder(target, TREE_DRAFTERS[name](target, draft), k=3, tree_budget=TREE_BUDGET.get(name, 6), tree_branch=3)
    counts, drafted = sampled_pairs(decoder, TREE_PROMPT)
    assert drafted["trees"] > SAMPLES // 10, drafted
    pvalue = chi_square_pvalue(counts, exact_two_tokens(target_model, TREE_PROMPT).ravel() * SAMPLES)
    assert pvalue > P_PASS, f"{name} trees: p-value {pvalue:.3g}"


class CutSiblingsByDraw(FixedK):
    """Cuts a sampled tree's point-mass siblings by what was drawn: all of them when the drawn chain's path score
    is above the median here (a surer chain), none otherwise. `honour_keep=False` cuts the drawn chain after its
    first token when the second one's path score is below the median (the wrong cut the negative control must
    catch: it keeps a drawn token by its own value)."""

    def __init__(self, honour_keep: bool = True) -> None:
        super().__init__(3, tree_budget=6)
        self.honour_keep, self.cuts = honour_keep, 0

    def trim(self, scores: list[float], source: str = DEFAULT_SOURCE, keep: int = 1) -> int:
        if not self.honour_keep:
            cut = keep > 1 and scores[1] < 0.025
            self.cuts += cut
            return 1 if cut else len(scores)
        cut = scores[keep - 1] > 0.02 and keep < len(scores)
        self.cuts += cut
        return keep if cut else len(scores)


def cut_tree_pairs(target_model: Qwen2ForCausalLM, policy: CutSiblingsByDraw) -> tuple[float, dict]:
    """Sampled `model` trees (budget 6, 3 children) cut by `policy`: the p-value of the first two tokens' counts
    against the target's exact distribution, and the drafts per source."""
    draft = CausalLM(perturbed(target_model, noise=0.5, seed=3))
    decoder = SpeculativeDecoder(CausalLM(target_model), TREE_DRAFTERS["model"](None, draft), k=policy,
                                 tree_budget=6, tree_branch=3)
    counts, drafted = sampled_pairs(decoder, TREE_PROMPT)
    return chi_square_pvalue(counts, exact_two_tokens(target_model, TREE_PROMPT).ravel() * SAMPLES), drafted


@pytest.mark.slow  # with its negative control below, about a minute on 2 cores
def test_sampled_trees_cut_by_what_was_drawn_follow_the_target(target_model):
    """The engine may drop a sampled tree's point-mass siblings by any rule, even one that looks at the drawn
    tokens (`Draft.must_keep` keeps the drawn chain): the output keeps the target's distribution."""
    policy = CutSiblingsByDraw()
    pvalue, drafted = cut_tree_pairs(target_model, policy)
    assert drafted["trees"] > SAMPLES // 10 and policy.cuts > SAMPLES // 10, (drafted, policy.cuts)
    assert pvalue > P_PASS, f"cut siblings: p-value {pvalue:.3g}"


@pytest.mark.slow
def test_cutting_drawn_tokens_by_their_scores_is_caught(target_model):
    """Negative control: a cut that drops drawn tokens whose own path score is low (ignoring `keep`)."""
    policy = CutSiblingsByDraw(honour_keep=False)
    pvalue, _ = cut_tree_pairs(target_model, policy)
    assert policy.cuts > SAMPLES // 10, policy.cuts
    assert pvalue < P_REJECT, f"drawn tokens cut by their value went unnoticed: p-value {pvalue:.3g}"


def test_point_mass_left_in_the_residual_is_caught(target_model, monkeypatch):
    """Negative control: after rejecting a deterministic proposal x, drawing from p (x not removed)."""
    original = verify_module.residual_distribution

    def keeps_draft_token(p, q, draft_tokens):
        return p / p.sum(-1, keepdim=True) if q is None else original(p, q, draft_tokens)

    monkeypatch.setattr(verify_module, "residual_distribution", keeps_draft_token)
    decoder = SpeculativeDecoder(CausalLM(target_model), make_drafter("ngram"), k=3)
    counts, _ = sampled_pairs(decoder)
    pvalue = chi_square_pvalue(counts, exact_two_tokens(target_model, PROMPT).ravel() * SAMPLES)
    assert pvalue < P_REJECT, f"unremoved point mass went unnoticed: p-value {pvalue:.3g}"
