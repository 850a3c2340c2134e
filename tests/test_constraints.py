"""Structured output under speculation, on tiny random models with a real (tiny) tokenizer.

Every answer under a constraint matches it, for `ar` and every registered drafter, chains and trees, greedy and
sampled; greedy `spec` equals greedy `ar` under the same constraint; sampled answers follow the masked target
distribution (a chi-square test on the first two tokens), and the same test rejects the two classic bugs: a drawn
draft token cut because the grammar forbids it (the draft's mask skipped), and a grammar state not rolled back
after a rejection.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from conftest import build_tokenizer, perturbed, tiny_config, tiny_model
from registered_drafters import build, registered
from specdraft import SamplingParams, SpeculativeDecoder
from specdraft.batch_engine import BatchedDecoder, BatchRequest
from specdraft.constraints import Constraint, GrammarState, start_grammar
from specdraft.drafters.base import Draft, DraftContext, Drafter
from specdraft.drafters.model import ModelDrafter
from specdraft.run import FORCED
from specdraft.errors import SpecdraftError
from specdraft.goodness_of_fit import chi_square_pvalue
from specdraft.models.causal_lm import CausalLM
from specdraft.sampling import sample, warp

SCHEMA = {  # bounded and compact (llguidance's own key): a random model's answer must end within the budget
    "x-guidance": {"whitespace_flexible": False},
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "y"]},
                   "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["a", "b", "c"], "additionalProperties": False,
}
LIST_REGEX = r"(yes|no)(, (yes|no)){0,3}"
CONSTRAINTS = {"schema": Constraint.json_schema(SCHEMA), "regex": Constraint.regex(LIST_REGEX)}
PROMPT_TEXT = '{"a":27,"b":"x","c":[true,false]} yes, no, yes {"a":27,"b":"x","c":[true,false]}'


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def models(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    target = tiny_model(tiny_config(vocab_size=len(tokenizer), eos=eos), seed=1)
    return {"target": target, "draft": perturbed(target, noise=0.3, seed=2)}


@pytest.fixture()
def lm(models, tokenizer):
    """A fresh CausalLM over one of the module's models."""
    return lambda name: CausalLM(models[name], tokenizer, name=name)


def valid(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(LIST_REGEX, text) is not None
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


# ----- what a user gets wrong ------------------------------------------------------------------------
@pytest.mark.parametrize("make, message", [
    (lambda: Constraint.json_schema("{not json"), "not valid JSON"),
    (lambda: Constraint.json_schema("[1, 2]"), "must be a JSON object"),
    (lambda: Constraint.json_schema({"type": "objekt"}).check(), "Invalid type"),
    (lambda: Constraint.regex("a(b").check(), "unclosed group"),
    (lambda: Constraint.regex(""), "regex is empty"),
    (lambda: Constraint.grammar("start: missing_rule\n").check(), "missing_rule"),
    (lambda: Constraint("xml", "<a/>"), "Unknown constraint kind"),
    (lambda: Constraint.from_options(regex="a", json_object=True), "not --regex and --json-object"),
])
def test_a_bad_constraint_says_what_is_wrong(make, message):
    with pytest.raises(SpecdraftError, match=re.escape(message)):
        make()


def test_a_constraint_needs_a_tokenizer(models):
    with pytest.raises(SpecdraftError, match="needs the model's tokenizer"):
        start_grammar(Constraint.json_object(), CausalLM(models["target"], None, name="bare"))


# ----- the grammar state -----------------------------------------------------------------------------
def test_masks_cuts_rollback_and_forced_tokens(lm, tokenizer):
    ids = {text: tokenizer.convert_tokens_to_ids(text) for text in ("a", "b", "c", "d", "dd", "z")}
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    state = start_grammar(Constraint.regex("[a-d][a-d]"), lm("target"))
    assert set(state.allowed(()).nonzero().flatten().tolist()) == {ids[t] for t in ("a", "b", "c", "d", "dd")}
    assert state.allowed((ids["z"],)) is None  # a forbidden prefix: no accepted path reaches its row
    assert state.allowed((ids["dd"],)).nonzero().flatten().tolist() == [eos]

    chain = Draft.chain(torch.tensor([ids["a"], ids["z"], ids["b"]]))
    assert chain.allowed_by(state).tokens.tolist() == [ids["a"]]  # a point mass: cut at the first forbidden token
    drawn = Draft.chain(chain.tokens, q_draft=torch.full((3, state.vocab), 1.0 / state.vocab))
    assert drawn.allowed_by(state).k == 3  # drawn tokens stay: the verifier rejects them (p = 0)
    tree = Draft.tree(torch.tensor([ids["z"], ids["a"], ids["b"], ids["c"]]), [-1, -1, 0, 1])
    kept = tree.allowed_by(state)  # z and its child go; a and its child stay
    assert kept.tokens.tolist() == [ids["a"], ids["c"]] and kept.parents.tolist() == [-1, 0]

    logits = torch.zeros(4, state.vocab)
    rows = state.mask_rows(logits, [()] + Draft.chain(torch.tensor([ids["a"], ids["b"], eos])).paths())
    assert torch.isfinite(rows[0]).sum() == 5 and torch.isfinite(rows[2]).tolist().count(True) == 1
    assert torch.isfinite(rows[3]).all()  # after EOS: nothing is masked (the answer has ended)

    state.allowed((ids["b"], ids["c"]))  # the matcher went down another draft; the commit rolls it back
    state.commit([ids["a"]])
    assert state.allowed(()).nonzero().flatten().tolist() == sorted(ids[t] for t in ("a", "b", "c", "d"))
    assert state.forced() is None and state.forced((ids["d"],)) == eos
    assert state.forced_run((ids["d"],)) == [eos] and state.forced_run(()) == []
    state.commit([ids["d"], eos])
    assert state.accepting


def test_json_whitespace_is_bounded_by_default(lm, tokenizer):
    """Between two JSON tokens: nothing, one space, or a newline and an indent (a model cannot run on in spaces)."""
    state = start_grammar(Constraint.json_object(), lm("target"))
    brace, space, newline = (tokenizer.convert_tokens_to_ids(t) for t in ("{", "Ġ", "Ċ"))
    assert state.allowed((brace,))[space] and state.allowed((brace,))[newline]
    assert not state.allowed((brace, space))[space] and not state.allowed((brace, space))[newline]
    assert state.allowed((brace, newline))[space]


# ----- every drafter: valid answers, greedy spec == greedy ar ---------------------------------------
@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_every_drafter_answers_validly_and_greedy_equals_ar(lm, tokenizer, kind):
    constraint = CONSTRAINTS[kind]
    prompts = [tokenizer.encode(PROMPT_TEXT), [1, 2, 3], [7]]
    ar = SpeculativeDecoder(lm("target"))
    expected = [ar.generate(p, max_new_tokens=48, constraint=constraint) for p in prompts]
    assert all(out.finish_reason == "stop" and valid(kind, out.text) for out in expected)
    assert sum(out.stats.forced_tokens for out in expected) > 0
    for name in registered():
        for tree_budget in (0, 5):
            target = lm("target")
            spec = SpeculativeDecoder(target, build(name, target, lm("draft")), k=3,
                                      tree_budget=tree_budget)
            for prompt, reference in zip(prompts, expected):
                out = spec.generate(prompt, max_new_tokens=48, constraint=constraint)
                assert out.token_ids == reference.token_ids, (name, tree_budget)
                assert out.stats.forced_tokens == out.kinds.count(FORCED)
            sampled = [spec.generate(p, SamplingParams(temperature=1.0, seed=s), max_new_tokens=48,
                                     constraint=constraint) for s, p in enumerate(prompts)]
            assert all(valid(kind, out.text) for out in sampled if out.finish_reason == "stop"), (name, tree_budget)
            assert sum(out.stats.drafted for out in sampled) > 0 or name in ("ngram", "suffix"), name


@pytest.mark.parametrize("name", [None, "model", "eagle", "medusa", "dflash"])
def test_the_batch_decoder_answers_as_a_single_request(lm, tokenizer, name):
    """Batched, each answer under the schema equals its single-request answer (plain, a draft model's chains and
    trees, feature drafters), and the tokens the grammar forces are appended without a pass there too."""
    constraint = CONSTRAINTS["schema"]
    prompts = [tokenizer.encode(PROMPT_TEXT), [1, 2, 3], [7]]
    expected = [SpeculativeDecoder(lm("target")).generate(p, max_new_tokens=48, constraint=constraint).token_ids
                for p in prompts]
    for tree_budget in (0, 5) if name else (0,):
        target = lm("target")
        make = None if name is None else lambda: build(name, target, lm("draft"))
        batch = BatchedDecoder(target, make, tree_budget=tree_budget)
        outs = batch.generate_all([BatchRequest(p, max_new_tokens=48, constraint=constraint) for p in prompts])
        assert [out.token_ids for out in outs] == expected, (name, tree_budget)
        assert all(valid("schema", out.text) for out in outs)
        assert all(out.stats.forced_tokens == out.kinds.count(FORCED) > 0 for out in outs)
        assert sum(out.stats.steps for out in outs) < sum(len(out.token_ids) for out in outs)
    with pytest.raises(SpecdraftError, match="regex is not valid"):
        batch.add(BatchRequest([1, 2], constraint=Constraint.regex("(")))


def test_a_batch_mixes_constrained_and_free_answers(lm, tokenizer):
    """Sequences under a schema, a regex and none step together, each answering as alone (greedy, and seeded
    sampling with a fixed k)."""
    requests = [BatchRequest([1, 2, 3], max_new_tokens=40, constraint=CONSTRAINTS["schema"]),
                BatchRequest([1, 2, 3], max_new_tokens=40),
                BatchRequest([7, 8], SamplingParams(temperature=1.0, seed=4), 40, constraint=CONSTRAINTS["regex"], k=3),
                BatchRequest([7, 8], SamplingParams(temperature=1.0, seed=4), 40, k=3)]
    target = lm("target")
    outs = BatchedDecoder(target, lambda: ModelDrafter(lm("draft"), min_confidence=0.0)).generate_all(requests)
    for request, out in zip(requests, outs):
        alone = SpeculativeDecoder(lm("target"), ModelDrafter(lm("draft"), min_confidence=0.0), k=3).generate(
            request.prompt_ids, request.sampling, 40, constraint=request.constraint)
        assert out.token_ids == alone.token_ids  # a seeded sample too: its k is fixed
        if request.constraint is not None:
            assert valid("schema" if request.constraint.kind == "json_schema" else "regex", out.text)
    assert outs[1].stats.forced_tokens == 0 and outs[0].stats.forced_tokens > 0


# ----- sampled answers follow the masked target (tier 2) ----------------------------------------------
TWO_CHARS = Constraint.regex("[a-d][a-d]")  # 5 first tokens (a, b, c, d, dd), then a choice or EOS
SAMPLES = 1200  # the naive cut scores p ~ 1e-10 at 1,000 samples, 1e-32 at 2,500
P_PASS, P_REJECT = 1e-3, 1e-6


class TableDrafter(Drafter):
    """Draws each draft token from one fixed distribution (context-free), masked like the target's rows."""

    name = "table"

    def __init__(self, logits: torch.Tensor) -> None:  # [V]
        self.logits = logits

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        tokens, rows = [], []
        for _ in range(k):
            q = warp(ctx.constrain(self.logits.unsqueeze(0), [tokens]), ctx.params)  # [1, V]
            tokens.append(int(sample(q, ctx.generator)))
            rows.append(q)
        return Draft.chain(torch.tensor(tokens), torch.cat(rows))


def flat_target(models, tokenizer) -> CausalLM:
    """The tiny target with its logits unsharpened, so the masked distributions have spread to test."""
    model = perturbed(models["target"], noise=0.0, seed=0)
    with torch.no_grad():
        model.lm_head.weight.div_(20.0)
    return CausalLM(model, tokenizer, name="flat")


def masked_two_tokens(target: CausalLM, prompt: list[int]) -> dict[tuple[int, int], float]:
    """The exact probability of each first two tokens under the target masked by TWO_CHARS (temperature 1)."""
    state = start_grammar(TWO_CHARS, target)
    eos = target.eos_token_ids

    def next_probs(context: list[int], prefix: list[int]) -> torch.Tensor:
        target.reset()
        logits = target.forward(torch.tensor([context]), logits_to_keep=1).logits[0, -1:].float()  # [1, V]
        return state.mask_rows(logits, [prefix]).double().softmax(-1)[0]  # [V]

    table = {}
    first = next_probs(prompt, [])
    for a in first.nonzero().flatten().tolist():
        if a in eos:
            table[(a, -1)] = float(first[a])
            continue
        second = next_probs(prompt + [a], [a])
        for b in second.nonzero().flatten().tolist():
            table[(a, b)] = float(first[a] * second[b])
    target.reset()
    return table


def sampled_pvalue(decoder: SpeculativeDecoder, expected: dict[tuple[int, int], float], prompt: list[int]) -> float:
    """Chi-square p-value of SAMPLES sampled answers' first two tokens against `expected`; 0 when an answer is
    one the masked target can never produce (or breaks the grammar)."""
    cells = {cell: i for i, cell in enumerate(expected)}
    observed = np.zeros(len(cells))
    for seed in range(SAMPLES):
        try:
            out = decoder.generate(prompt, SamplingParams(temperature=1.0, seed=seed), max_new_tokens=2,
                                   constraint=TWO_CHARS)
        except SpecdraftError:  # a broken grammar state
            return 0.0
        cell = (out.token_ids[0], out.token_ids[1] if len(out.token_ids) > 1 else -1)
        if cell not in cells:
            return 0.0
        observed[cells[cell]] += 1
    return chi_square_pvalue(observed, np.array(list(expected.values())) * SAMPLES)


@pytest.fixture(scope="module")
def two_token_setup(models, tokenizer):
    target = flat_target(models, tokenizer)
    prompt = [5, 9, 14]
    logits = torch.full((target.vocab_size,), -4.0)  # the draft: half its mass on one legal token, some forbidden
    logits[tokenizer.convert_tokens_to_ids("a")] = 2.0
    logits[tokenizer.convert_tokens_to_ids("z")] = 1.5
    return target, prompt, logits, masked_two_tokens(target, prompt)


@pytest.mark.parametrize("shape", ["chain", pytest.param("model chain", marks=pytest.mark.slow),
                                   pytest.param("tree", marks=pytest.mark.slow)])
def test_sampled_answers_follow_the_masked_target(two_token_setup, models, tokenizer, shape):
    """A chain drawn from a fixed q; the draft model's chain (the tokens the grammar forces after a drawn one go
    into the draft without a pass: here the EOS after two letters) and a draft model's tree (`slow`: the chain's
    test, quick, covers the same verification)."""
    target, prompt, logits, expected = two_token_setup
    draft = CausalLM(perturbed(models["target"], noise=1.0, seed=5), tokenizer)
    if shape == "chain":
        decoder = SpeculativeDecoder(target, TableDrafter(logits), k=3)
    elif shape == "model chain":
        decoder = SpeculativeDecoder(target, ModelDrafter(draft, min_confidence=0.0), k=3)
    else:
        decoder = SpeculativeDecoder(target, ModelDrafter(draft, min_confidence=0.0), k="auto", tree_budget=4,
                                     tree_branch=2)
    assert sampled_pvalue(decoder, expected, prompt) > P_PASS


def test_a_drawn_token_the_grammar_forbids_is_rejected_not_cut(two_token_setup, monkeypatch):
    """With the draft's mask skipped, drawn forbidden tokens reach the verifier, which rejects them (p = 0): still
    exact. Cutting them instead (as for point masses) biases the answer, and the test sees it."""
    target, prompt, logits, expected = two_token_setup
    monkeypatch.setattr(DraftContext, "constrain", lambda self, rows, prefixes: rows)
    decoder = SpeculativeDecoder(target, TableDrafter(logits), k=3)
    assert sampled_pvalue(decoder, expected, prompt) > P_PASS
    monkeypatch.setattr(Draft, "drawn_count", property(lambda self: 0))
    assert sampled_pvalue(decoder, expected, prompt) < P_REJECT


def test_a_grammar_state_not_rolled_back_is_caught(two_token_setup, monkeypatch):
    target, prompt, logits, expected = two_token_setup

    def commit_on_top(self, tokens):  # the bug: the matcher stays where the draft took it
        self._ahead = []
        self._move([t for t in tokens if t not in self.eos_ids])
        self._ahead = []
        self._masks.clear()

    monkeypatch.setattr(GrammarState, "commit", commit_on_top)
    decoder = SpeculativeDecoder(target, TableDrafter(logits), k=3)
    assert sampled_pvalue(decoder, expected, prompt) < P_REJECT


def test_a_draft_row_the_grammar_leaves_empty_becomes_uniform_over_the_allowed(lm, tokenizer):
    """A narrowed draft head scores only common tokens (the rest -inf); where the grammar allows none of them, the
    drafter draws from the allowed tokens uniformly instead of from NaNs."""
    state = start_grammar(Constraint.regex("[a-d][a-d]"), lm("target"))
    allowed = state.allowed(())
    logits = torch.full((2, state.vocab), float("-inf"))
    logits[:, tokenizer.convert_tokens_to_ids("z")] = 3.0  # the head's only scored token: forbidden
    logits[1, tokenizer.convert_tokens_to_ids("a")] = 1.0
    rows = state.mask_rows(logits, [(), ()])
    assert torch.equal(rows[0].softmax(-1) > 0, allowed) and torch.allclose(rows[0].softmax(-1)[allowed], torch.tensor(0.2))
    assert rows[1].softmax(-1)[tokenizer.convert_tokens_to_ids("a")] == 1.0


def test_the_draft_model_drafts_forced_tokens_without_a_pass(lm, tokenizer):
    """After each token it draws, the draft model appends the run the grammar forces and reads it in its next pass:
    a schema's keys and punctuation cost no draft passes; the answer stays ar's."""
    target = lm("target")
    passes = []
    drafter = ModelDrafter(lm("draft"), min_confidence=0.0)
    forward = drafter.model.forward
    drafter.model.forward = lambda tokens, *a, **kw: passes.append(tokens.shape[1]) or forward(tokens, *a, **kw)
    constraint = CONSTRAINTS["schema"]
    out = SpeculativeDecoder(target, drafter, k=4).generate([1, 2, 3], max_new_tokens=48, constraint=constraint)
    assert out.token_ids == SpeculativeDecoder(lm("target")).generate([1, 2, 3], max_new_tokens=48,
                                                                       constraint=constraint).token_ids
    assert out.stats.drafted > len(passes)  # more draft tokens than draft passes: a drawn one costs a pass each


@pytest.mark.slow
def test_sampled_answers_follow_the_masked_target_with_power(models, tokenizer):
    """Full power, as `test_engine_statistics.py`: the draft model's chain at its default cut under TWO_CHARS
    (temperature 0.9, top-p 0.95), the first two tokens in cells of every token the masked target can produce and
    the answer's end; as many answers as catch a total variation of 0.02 with probability 0.9 at α = 1e-3."""
    from specdraft.analysis.check import check_distribution, target_cells
    from specdraft.goodness_of_fit import samples_for_bias

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    one_layer = {"target": tiny_model(tiny_config(vocab_size=len(tokenizer), eos=eos, layers=1), seed=1)}  # cheaper
    target = flat_target(one_layer, tokenizer)
    prompt = [5, 9, 14]
    params = SamplingParams(temperature=0.9, top_p=0.95)
    decoder = SpeculativeDecoder(target, ModelDrafter(CausalLM(perturbed(one_layer["target"], noise=1.0, seed=5),
                                                               tokenizer)), k=3)
    mask = start_grammar(TWO_CHARS, target).mask_rows
    cells = target_cells(target, prompt, params, depth=2, top=None, mask=mask)
    samples = samples_for_bias(0.02, len(cells.paths) - 1, P_PASS)

    def answers(prompt, samplings, max_new_tokens, enough=None):  # the grammar ends answers at two characters
        return [decoder.generate(list(prompt), sampling, max_new_tokens, constraint=TWO_CHARS).token_ids
                for sampling in samplings]

    verdict = check_distribution(target, answers, [prompt], params, samples, depth=2, top=None, alpha=P_PASS, mask=mask)
    assert verdict.detectable <= 0.02 + 1e-9 and verdict.passed, verdict
