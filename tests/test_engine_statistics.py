"""Tier 2 with stated power: sampled output through the whole engine follows the target, for the drafters'
default options and every option that changes what is drafted, with warpers on and past the first two tokens.

Each test draws answers from a tiny random Qwen2 (8-token vocabulary) and compares their first tokens with the
target's exact distribution over cells (`analysis.check.target_cells`: the likeliest tokens at each place and an
"other" cell). Power: a chi-square test over m cells at level α = 1e-3 catches every bias of total variation δ with
probability ≥ 0.9 once 4nδ² reaches the noncentrality λ(m - 1) at which the noncentral χ² passes the test's
quantile 90% of the time (`goodness_of_fit`, module doc). Each test draws n = `samples_for_bias(0.02, m - 1)`
answers (19,000-25,000 here, so `slow`) and asserts that its detectable bias is
≤ 0.02 before it asserts the verdict.

Planted-bias controls run the same tests on drafts biased the way real bugs were: a chain cut that looks at the
drawn token's own probability (Medusa's cut before the fix) and a trim of a sampled tree by the drawn tokens' path
scores; both must be rejected. The quick set holds the Medusa cut's toy (the chain and the verifier alone, 20,000
draws, power stated the same way) and its control.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import Qwen2ForCausalLM

from conftest import perturbed, tiny_config
from registered_drafters import random_eagle, random_medusa
from specdraft import SamplingParams, SpeculativeDecoder
from specdraft.analysis.check import answer_start, check_distribution, single_answers, target_cells
from specdraft.batch_engine import BatchedDecoder, BatchRequest
from specdraft.drafters import MedusaDrafter, make_drafter
from specdraft.drafters.base import DraftContext
from specdraft.drafters.model import DEFAULT_MIN_CONFIDENCE
from specdraft.goodness_of_fit import chi_square_pvalue, detectable_bias, samples_for_bias
from specdraft.models.causal_lm import CausalLM
from specdraft.policy import AutoK, FixedK
from specdraft.sampling import sample
from specdraft.stats import GenerationStats
from specdraft.verify import verify_sampled

ALPHA = 1e-3  # each test's level
BIAS = 0.02  # the total variation each test catches with probability >= POWER
POWER = 0.9
V = 8
PROMPT = [1, 2, 3, 4, 1, 2, 3]  # [2, 3] occurred before: lookups propose from the first step
TREE_PROMPT = [1, 2, 3, 4, 1, 2, 5, 1, 2, 6, 1, 2]  # [1, 2] was followed by 3, 5 and 6: lookup trees branch


FIXED_CHAIN = MedusaDrafter._chain  # the chain as drafted now (a control below patches the class's)


def old_medusa_chain(self, logits, ctx):
    """Medusa's chain cut before the fix: a token stays while the running product *including its own
    probability* stays above the threshold, so a drawn token is kept or cut by its own value (biased)."""
    draft = FIXED_CHAIN(SimpleNamespace(min_confidence=0.0), logits, ctx)
    tokens, q_rows = draft.tokens, draft.q_draft
    if self.min_confidence and q_rows is not None:
        survival = q_rows.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).cumprod(0)  # [depth]
        keep = max(1, int((survival >= self.min_confidence).sum()))
        return type(draft).chain(tokens[:keep], q_rows[:keep])
    return draft


# ----- the Medusa cut alone: the chain and the verifier on a 4-token toy (quick) ------------------------------
TOY_P = torch.tensor([0.1, 0.3, 0.3, 0.3])  # the target's row at every position
TOY_HEADS = torch.tensor([[0.1, 0.7, 0.1, 0.1], [0.1, 0.6, 0.15, 0.15]]).log()  # [depth, V] the heads' logits
TOY_DRAWS = 20_000


def toy_second_tokens(chain) -> np.ndarray:
    """Counts of the second committed token over TOY_DRAWS seeded steps: one Medusa chain from `chain` (temperature
    1, threshold DEFAULT_MIN_CONFIDENCE), verified against TOY_P; a step that commits one token takes the second from
    a plain step (TOY_P). Exact drafting gives the counts of TOY_P."""
    generator = torch.Generator().manual_seed(0)
    ctx = DraftContext(torch.tensor([0]), SamplingParams(temperature=1.0), generator, None)
    drafter = SimpleNamespace(min_confidence=DEFAULT_MIN_CONFIDENCE)
    counts = np.zeros(4)
    for _ in range(TOY_DRAWS):
        draft = chain(drafter, TOY_HEADS, ctx)
        k = draft.k
        p_rows = TOY_P.expand(1, k + 1, 4)  # [1, k + 1, V]
        verdict = verify_sampled(draft.tokens.unsqueeze(0), draft.q_draft.unsqueeze(0), p_rows, generator)
        accepted = int(verdict.num_accepted)
        committed = draft.tokens[:accepted].tolist() + [int(verdict.next_token)]
        second = committed[1] if len(committed) > 1 else int(sample(TOY_P.unsqueeze(0), generator))
        counts[second] += 1
    return counts


def test_the_medusa_chain_cut_keeps_the_target_distribution():
    """Power: 4 cells, 20,000 draws at α = 1e-3 catch every total variation ≥ 0.018 with probability 0.9."""
    assert detectable_bias(TOY_DRAWS, 3, ALPHA, POWER) <= BIAS
    counts = toy_second_tokens(FIXED_CHAIN)
    assert chi_square_pvalue(counts, TOY_P.numpy() * TOY_DRAWS) > ALPHA, counts / TOY_DRAWS


def test_a_cut_that_looks_at_the_drawn_token_is_caught_on_the_toy():
    """Planted bias: the cut before the fix (the second token kept only when its own probability keeps the chain's
    product up: 0.7 · 0.6 ≥ 0.35 keeps token 1 after token 1, every other second token goes) moves the second
    token's marginal by a total variation of about 0.03."""
    counts = toy_second_tokens(old_medusa_chain)
    assert 0.5 * np.abs(counts / TOY_DRAWS - TOY_P.numpy()).sum() > BIAS
    assert chi_square_pvalue(counts, TOY_P.numpy() * TOY_DRAWS) < ALPHA


# ----- the whole engine (slow) -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target_model() -> Qwen2ForCausalLM:
    torch.manual_seed(7)
    model = Qwen2ForCausalLM(tiny_config(vocab_size=V, layers=1)).float().eval()  # one layer: a pass costs least
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # spread, but far from uniform, next-token distributions
    return model


def powered_check(target: CausalLM, answers, prompt: list[int], params: SamplingParams, depth: int = 2,
                  top: int = 2):
    """The verdict on answers to `prompt`, with as many draws as catch a bias of BIAS with probability POWER."""
    cells = target_cells(target, prompt, params, depth, top)
    samples = samples_for_bias(BIAS, len(cells.paths) - 1, ALPHA, POWER)
    verdict = check_distribution(target, answers, [prompt], params, samples, depth, top, ALPHA)
    assert verdict.detectable <= BIAS + 1e-9, verdict
    return verdict


class AutoKOnAPinnedMachine(AutoK):
    """`k=auto` whose timings are pinned: a target pass over w tokens costs 10 ms · (1 + 0.3 (w - 1)), a draft token
    1 ms, whatever the clock says. Its choices (k, probes, tree trims) then rest on the acceptance it has seen alone,
    so a seed reproduces a run, and they vary: drafting pays on these tiny models, but not always at full depth."""

    def observe(self, k, accepted, draft_seconds, verify_seconds, *args, **kwargs):
        pass_seconds = None if verify_seconds is None else 1e-2 * (1 + 0.3 * k)
        super().observe(k, accepted, 1e-3 * max(k, 1), pass_seconds, *args, **kwargs)


def pinned_auto(tree_budget: int = 0) -> AutoKOnAPinnedMachine:
    """`k=auto` (`make_policy("auto", tree_budget)`) on the pinned machine."""
    return AutoKOnAPinnedMachine(max_k=tree_budget, tree=True) if tree_budget else AutoKOnAPinnedMachine()


# Each case: a drafter with its default options (or the option named), the sampling it runs under, how far the
# test looks, and the decoder's k (an integer, or what makes its policy) / tree. `early-exit` drafts with the `model` drafter's code (its cut included);
# `suffix`, `ngram` and `oracle` propose point masses only, which the verifier tests cover at full power: their
# whole-engine runs are in the quick set (`test_drafter_statistics.py`).
CASES = {
    "medusa default cut, temperature 0.7, top-p 0.9": dict(
        drafter=lambda target, draft: random_medusa(target, DEFAULT_MIN_CONFIDENCE), k=3,
        params=SamplingParams(temperature=0.7, top_p=0.9)),
    "model default cut, k=auto, top-p 0.9, min-p 0.05, three tokens": dict(
        drafter=lambda target, draft: make_drafter("model", draft_model=draft), k=pinned_auto, depth=3,
        params=SamplingParams(temperature=0.9, top_p=0.9, min_p=0.05)),
    "eagle default cut, repetition penalty 1.3": dict(
        drafter=lambda target, draft: random_eagle(target, DEFAULT_MIN_CONFIDENCE), k=3,
        params=SamplingParams(temperature=1.0, repetition_penalty=1.3)),
    "model trees trimmed by k=auto, temperature 0.7": dict(
        drafter=lambda target, draft: make_drafter("model", draft_model=draft), k=lambda: pinned_auto(6), tree_budget=6,
        tree_branch=3, prompt=TREE_PROMPT, params=SamplingParams(temperature=0.7)),
}


def decoder_for(case: dict, target_model: Qwen2ForCausalLM) -> tuple[CausalLM, SpeculativeDecoder]:
    target = CausalLM(target_model)
    draft = CausalLM(perturbed(target_model, noise=0.5, seed=3))
    k = case.get("k", 3)  # an integer, or what makes a policy
    decoder = SpeculativeDecoder(target, case["drafter"](target, draft), k=k if isinstance(k, int) else k(),
                                 tree_budget=case.get("tree_budget", 0), tree_branch=case.get("tree_branch", 4))
    return target, decoder


def test_an_answer_stepped_until_it_holds_enough_tokens_starts_as_the_whole_answer(target_model):
    """`answer_start` (what the sampled checks draw) stops stepping once the answer holds `enough` tokens: the same
    tokens as the whole seeded answer begins with, from fewer steps."""
    decoder = SpeculativeDecoder(CausalLM(target_model), make_drafter("ngram"), k=3)
    shorter = 0
    for seed in range(12):
        params = SamplingParams(temperature=1.0, seed=seed)
        whole = decoder.generate(PROMPT, params, 8)
        stats = GenerationStats()
        start = answer_start(decoder, PROMPT, params, 8, 2, stats)
        assert len(start) >= 2 and start == whole.token_ids[:len(start)]
        assert stats.new_tokens == len(start) and stats.steps <= whole.stats.steps
        shorter += stats.steps < whole.stats.steps
    assert shorter > 6


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_sampled_output_follows_the_target_with_power(target_model, name):
    case = CASES[name]
    target, decoder = decoder_for(case, target_model)
    drafted = []
    answers = single_answers(decoder)

    def counted(prompt, samplings, max_new_tokens, enough=None):  # the answers, and how many drafts were verified
        drafted.append(sum(decoder.generate(list(prompt), sampling, max_new_tokens).stats.drafted > 0
                           for sampling in samplings[:200]))
        return answers(prompt, samplings, max_new_tokens, enough)

    verdict = powered_check(target, counted, case.get("prompt", PROMPT), case["params"], case.get("depth", 2))
    assert drafted[0] > 50, f"{name}: only {drafted[0]} of 200 answers drafted"
    assert verdict.passed, f"{name}: {verdict}"


@pytest.mark.slow
def test_batched_speculation_follows_the_target_with_power(target_model):
    """The batched engine (what `serve` runs), `ngram+model` at its defaults, each sequence with its own k (1, 2 or
    3: on these tiny models the goodput rule would step plain, a draft model costing what the target does)."""
    target = CausalLM(target_model)
    draft = perturbed(target_model, noise=0.5, seed=3)
    decoder = BatchedDecoder(target, lambda: make_drafter("ngram+model", draft_model=CausalLM(draft)),
                             max_batch=32, prefix_cache_bytes=0)
    params = SamplingParams(temperature=1.0, top_k=5)
    drafted = []

    def answers(prompt, samplings, max_new_tokens, enough=None):  # the answers, and how many of them drafted
        completions = decoder.generate_all([BatchRequest(list(prompt), sampling, max_new_tokens, k=1 + sampling.seed % 3)
                                            for sampling in samplings])
        drafted.append(sum(completion.stats.drafted > 0 for completion in completions))
        return [completion.token_ids for completion in completions]

    verdict = powered_check(target, answers, PROMPT, params)
    assert drafted[0] > verdict.samples // 4, f"only {drafted[0]} of {verdict.samples} answers drafted"
    assert verdict.passed, verdict


@pytest.mark.slow
def test_the_old_medusa_cut_is_caught_through_the_engine(target_model, monkeypatch):
    """Planted bias: Medusa's default options with the cut before the fix, the same test as above."""
    monkeypatch.setattr(MedusaDrafter, "_chain", old_medusa_chain)
    case = CASES["medusa default cut, temperature 0.7, top-p 0.9"]
    target, decoder = decoder_for(case, target_model)
    verdict = powered_check(target, single_answers(decoder), PROMPT, case["params"])
    assert not verdict.passed, verdict


class TrimDrawnByValue(FixedK):
    """Planted bias: trims a sampled tree's drawn chain after its first token when the second drawn token's own
    path score is below 0.025, about its median here (ignoring `keep`, which protects drawn tokens)."""

    def __init__(self) -> None:
        super().__init__(3, tree_budget=6)

    def trim(self, scores: list[float], source: str = "", keep: int = 1) -> int:
        return 1 if keep > 1 and scores[1] < 0.025 else len(scores)


@pytest.mark.slow
def test_a_trim_by_the_drawn_tokens_value_is_caught_through_the_engine(target_model):
    case = CASES["model trees trimmed by k=auto, temperature 0.7"]
    target = CausalLM(target_model)
    draft = CausalLM(perturbed(target_model, noise=0.5, seed=3))
    # a low cut, so drawn chains go two deep and more (at the default 0.35 they rarely pass one)
    decoder = SpeculativeDecoder(target, make_drafter("model", {"draft-confidence": 0.05}, draft_model=draft),
                                 k=TrimDrawnByValue(), tree_budget=6, tree_branch=3)
    verdict = powered_check(target, single_answers(decoder), TREE_PROMPT, case["params"])
    assert not verdict.passed, verdict
