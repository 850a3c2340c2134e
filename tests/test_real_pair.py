"""Tier 3 on the real bundled pair (slow): greedy speculative output equals plain decoding."""

import pytest
import torch

from specdraft import ModelDrafter, SamplingParams, SpeculativeDecoder, check_compatible, load_model
from specdraft.exactness import compare_greedy
from specdraft.kernels import cache_attention
from specdraft.models import registry
from specdraft.text import encode_prompt

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # the kernels on two threads

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Explain in three sentences why the sky is blue.",
    "Write a SQL query that lists the ten customers with the highest total order value.",
]


@pytest.fixture(scope="module")
def pair():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    target = load_model(registry.DEFAULT_TARGET)
    draft = load_model(registry.DEFAULT_DRAFT)
    check_compatible(target, draft)
    yield target, draft
    torch.set_num_threads(threads)


def test_bundled_files_verified(pair):
    for model in registry.BUNDLED_MODELS.values():
        assert registry.is_assembled(model)


def test_shipped_token_counts_rank_the_bundled_draft_head(pair):
    """The shipped counts were made for the bundled tokenizer, so `--draft-vocab` ranks by them: code
    tokens of high id (indentation runs, identifiers) make the cut, and the output stays exact."""
    from specdraft.models.loading import prepare_draft
    from specdraft.models.token_counts import token_counts_for

    target, draft = pair
    counts, path = token_counts_for(draft.tokenizer)
    assert path.name == "qwen2.5.token_counts.safetensors" and int((counts > 0).sum()) > 50_000
    narrowed = prepare_draft(draft, "int4", copy=True, vocab=32768)
    kept = set(narrowed.model.get_output_embeddings().ids.tolist())
    code_ids = draft.tokenizer.encode("raise ValueError(x.dtype)\n\n**Note**:", add_special_tokens=False)
    assert set(code_ids) <= kept and max(code_ids) > 32768  # ids past the lowest 32768, taken by count
    ids = encode_prompt(target.tokenizer, PROMPTS[0])
    ar = SpeculativeDecoder(target).generate(ids, max_new_tokens=48)
    spec = SpeculativeDecoder(target, ModelDrafter(narrowed)).generate(ids, max_new_tokens=48)
    verdict = compare_greedy(target, ids, ar.token_ids, spec.token_ids)
    assert verdict.acceptable, verdict


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_spec_equals_ar(pair, prompt):
    target, draft = pair
    ids = encode_prompt(target.tokenizer, prompt)
    ar = SpeculativeDecoder(target).generate(ids, max_new_tokens=64)
    spec = SpeculativeDecoder(target, ModelDrafter(draft), k=4).generate(ids, max_new_tokens=64)
    verdict = compare_greedy(target, ids, ar.token_ids, spec.token_ids)
    assert verdict.acceptable, verdict
    assert spec.stats.acceptance_rate is not None and spec.stats.acceptance_rate > 0.3
    assert spec.stats.steps < ar.stats.steps


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_greedy_auto_k_with_int4_draft_equals_ar(pair, prompt):
    """The default configuration (int4 draft, k chosen by the cost model) is exact too."""
    from specdraft.models.loading import prepare_draft

    target, draft = pair
    ids = encode_prompt(target.tokenizer, prompt)
    ar = SpeculativeDecoder(target).generate(ids, max_new_tokens=64)
    spec = SpeculativeDecoder(target, ModelDrafter(prepare_draft(draft, "int4", copy=True))).generate(ids, max_new_tokens=64)
    verdict = compare_greedy(target, ids, ar.token_ids, spec.token_ids)
    assert verdict.acceptable, verdict
    assert spec.stats.mean_k is not None and spec.stats.steps < ar.stats.steps


def test_sampled_run_is_reproducible_and_stops(pair):
    target, draft = pair
    decoder = SpeculativeDecoder(target, ModelDrafter(draft), k=3)
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=11)
    a = decoder.generate(PROMPTS[1], params, max_new_tokens=40, stop=["\n\n"])
    b = decoder.generate(PROMPTS[1], params, max_new_tokens=40, stop=["\n\n"])
    assert a.token_ids == b.token_ids and a.text == b.text
    assert "\n\n" not in a.text


def test_eos_ends_a_short_answer(pair):
    target, draft = pair
    out = SpeculativeDecoder(target, ModelDrafter(draft), k=4).generate("Reply with the single word: yes", max_new_tokens=32)
    assert out.finish_reason == "stop" and out.token_ids[-1] in target.eos_token_ids
    assert "yes" in out.text.lower()


REWRITE_PROMPT = (
    "Rewrite this function so that it uses a list comprehension, keeping the names:\n\n"
    "def squares_of_evens(numbers):\n    result = []\n    for number in numbers:\n"
    "        if number % 2 == 0:\n            result.append(number * number)\n    return result\n"
)


@pytest.mark.parametrize("name", ["ngram", "suffix", "ngram+model"])
def test_greedy_free_drafters_equal_ar(pair, name):
    """Drafters without a draft model (and composed with one) on the real target: exact, and they draft."""
    from specdraft.drafters import make_drafter
    from specdraft.models.loading import prepare_draft

    target, draft = pair
    ids = encode_prompt(target.tokenizer, REWRITE_PROMPT)
    ar = SpeculativeDecoder(target).generate(ids, max_new_tokens=64)
    drafter = make_drafter(name, draft_model=prepare_draft(draft, "int4", copy=True) if "model" in name else None)
    spec = SpeculativeDecoder(target, drafter, k=4).generate(ids, max_new_tokens=64)
    verdict = compare_greedy(target, ids, ar.token_ids, spec.token_ids)
    assert verdict.acceptable, verdict
    assert spec.stats.accepted > 0 and spec.stats.steps < ar.stats.steps


DANCE_PROMPT = (  # Spec-Bench question 402: trees parted from `ar` at token 37 when hidden keys shifted the exp sum
    "Hallie had dance practice for 1 hour on Tuesdays and 2 hours on Thursdays.  On Saturdays, she had dance "
    "practice that lasted twice as long as Tuesday's night class.  How many hours a week did she have dance practice?"
)


@pytest.mark.parametrize("name,prompt", [("model", PROMPTS[0]), ("model", PROMPTS[1]), ("model", DANCE_PROMPT),
                                         ("suffix", REWRITE_PROMPT)])
def test_greedy_trees_equal_ar(pair, name, prompt):
    """Tree drafts on the real target (tree attention through the model's own attention, the accepted
    path kept in both caches): exact, and deeper per step than a chain of the same depth. With our attention
    kernel a tree node gets the bits of plain decoding, so the outputs are identical, not just near-tie equal."""
    from specdraft.drafters import make_drafter
    from specdraft.models.loading import prepare_draft

    target, draft = pair
    ids = encode_prompt(target.tokenizer, prompt)
    ar = SpeculativeDecoder(target).generate(ids, max_new_tokens=64)
    drafter = make_drafter(name, draft_model=prepare_draft(draft, "int4", copy=True) if name == "model" else None)
    spec = SpeculativeDecoder(target, drafter, k=6, tree_budget=12, tree_branch=3).generate(ids, max_new_tokens=64)
    verdict = compare_greedy(target, ids, ar.token_ids, spec.token_ids)
    assert verdict.acceptable, verdict
    if cache_attention.available():
        assert spec.token_ids == ar.token_ids
    assert spec.stats.steps < ar.stats.steps
    if name == "model":  # some accepted path left the first-listed line of the tree
        assert any(path != list(range(len(path))) for path in spec.stats.path_per_step)


def test_sampled_tree_run_is_reproducible(pair):
    from specdraft.models.loading import prepare_draft

    target, draft = pair
    decoder = SpeculativeDecoder(target, ModelDrafter(prepare_draft(draft, "int4", copy=True)), k=5, tree_budget=10,
                                 tree_branch=3)
    params = SamplingParams(temperature=0.7, seed=5)
    a = decoder.generate(PROMPTS[0], params, max_new_tokens=40)
    b = decoder.generate(PROMPTS[0], params, max_new_tokens=40)
    assert a.token_ids == b.token_ids and a.stats.steps < 40


def test_batched_greedy_equals_each_request_alone(pair):
    """Three requests in one packed batch, on the packed kernels (every pass on int8 activations on AVX2, a
    sequence's first token on the 16-bit kernels as alone): each gets its output alone, near-ties allowed."""
    from specdraft.batch_engine import BatchedDecoder, BatchRequest
    from specdraft.drafters import make_drafter
    from specdraft.models.causal_lm import CausalLM
    from specdraft.models.loading import prepare_draft

    target, draft = pair
    narrowed = prepare_draft(draft, "int4", copy=True, vocab=32768)
    ids = [encode_prompt(target.tokenizer, prompt) for prompt in PROMPTS]
    alone = [SpeculativeDecoder(target).generate(i, max_new_tokens=32).token_ids for i in ids]
    for maker in (None, lambda: make_drafter("ngram+model", draft_model=CausalLM(narrowed.model, narrowed.tokenizer))):
        batch = BatchedDecoder(target, maker, max_batch=3)
        got = batch.generate_all([BatchRequest(i, SamplingParams(temperature=0.0), 32) for i in ids])
        for prompt_ids, reference, completion in zip(ids, alone, got):
            verdict = compare_greedy(target, prompt_ids, reference, completion.token_ids)
            assert verdict.acceptable, verdict


def test_a_prompt_read_after_cached_rows_of_its_beginning_holds_the_bits_of_one_read(pair):
    """What the server's prefix cache relies on, on the real target: a chat prompt read whole, or as the rows of its
    beginning (the system prompt, or all but its last tokens) taken over by another cache and then the rest, gives
    the same cache rows and next-token logits, bit for bit."""
    from specdraft.models.causal_lm import CausalLM

    target, _ = pair
    if not target.reads_split_exactly:
        pytest.skip("prompt reads do not split exactly on this machine's kernels (AMX, or no C attention kernel)")
    ids = torch.tensor([encode_prompt(target.tokenizer, PROMPTS[2])])  # [1, L]
    length = ids.shape[1]
    whole = CausalLM(target.model, target.tokenizer)
    whole.prefill(ids)
    want_rows = [(k.clone(), v.clone()) for k, v in whole.rows(length)]
    want = whole.forward(torch.tensor([[13]])).logits
    for split in (20, length - 3):
        first = CausalLM(target.model, target.tokenizer)
        first.prefill(ids[:, :split])
        reader = CausalLM(target.model, target.tokenizer)
        reader.append_rows([(k.clone(), v.clone()) for k, v in first.rows(split)])
        reader.prefill(ids[:, split:])
        assert all(torch.equal(k, wk) and torch.equal(v, wv) for (k, v), (wk, wv) in zip(reader.rows(length), want_rows))
        assert torch.equal(reader.forward(torch.tensor([[13]])).logits, want)


@pytest.mark.parametrize("question", ["json-01", "json-09", "json-17"])
def test_greedy_spec_equals_ar_under_a_schema(pair, question):
    """The shipped JSON-by-schema prompts (one of each kind): valid answers, the default `spec` (ngram+model, int4
    draft, k auto) token for token `ar`'s under the same schema, and fewer target passes."""
    from pathlib import Path

    import specdraft.bench
    from specdraft.constraints import Constraint
    from specdraft.engine import build_decoder
    from specdraft.models.loading import prepare_draft
    from specdraft.prompts import load_prompts

    target, draft = pair
    shipped = Path(specdraft.bench.__file__).parent / "data" / "json_prompts.jsonl"
    prompts = {p.question_id: p for p in load_prompts(shipped)}
    constraint = Constraint.json_schema(prompts[question].schema)
    ids = encode_prompt(target.tokenizer, prompts[question].turns[0])
    ar = SpeculativeDecoder(target).generate(ids, max_new_tokens=256, constraint=constraint)
    spec = build_decoder(target, "ngram+model", draft_model=prepare_draft(draft, "auto")).generate(
        ids, max_new_tokens=256, constraint=constraint)
    assert ar.finish_reason == "stop" and constraint.validates(ar.text)
    assert spec.token_ids == ar.token_ids
    assert ar.stats.forced_tokens > 0 and spec.stats.steps < ar.stats.steps
