"""The static cache and the bucketed passes of `graph_decoder.StaticDecoder`, run eagerly on the CPU.

The CUDA graphs themselves need a GPU (`scripts/device_check.py`); everything around them (slots, padding rows,
masks, rollback, tree paths, growth) is the same code here, padding included.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from conftest import tiny_config, tiny_model
from specdraft.drafters import ModelDrafter
from specdraft.engine import SpeculativeDecoder
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM, wants_static_cache
from specdraft.models.graph_decoder import WIDTHS, StaticDecoder, static_obstacle
from specdraft.models.quantize import Int4Linear
from specdraft.models.static_cache import SCRATCH_SLOTS
from specdraft.tree import TreeLayout

ATOL = 2e-5


@pytest.fixture()
def model():
    return tiny_model(tiny_config(max_positions=1024), seed=3)


def pair(model) -> tuple[CausalLM, CausalLM]:
    return CausalLM(model, static_cache=False), CausalLM(model, static_cache=True)


def both(lms, *args, **kwargs):
    outs = [lm.forward(*args, **kwargs) for lm in lms]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=ATOL, rtol=0)
    if outs[0].hidden_states is not None:
        torch.testing.assert_close(outs[1].hidden_states, outs[0].hidden_states, atol=ATOL, rtol=0)
    assert lms[0].cache_len == lms[1].cache_len
    return outs


def test_static_passes_match_the_dynamic_cache(model):
    """A prompt, chain passes of every bucketed width and odd widths between, a rollback, a tree pass and its
    kept path: the same logits and hidden states as transformers' own forward on a growing cache."""
    dynamic, static = lms = pair(model)
    assert static._static is not None and dynamic._static is None
    generator = torch.Generator().manual_seed(0)
    both(lms, torch.randint(0, 64, (1, 90), generator=generator), logits_to_keep=90, hidden_to_keep=5)
    for width in (1, 2, 3, 4, 7, 8, 13, 16, 31, 33, 64):
        both(lms, torch.randint(0, 64, (1, width), generator=generator), logits_to_keep=width, hidden_to_keep=width)
        for lm in lms:
            lm.truncate(lm.cache_len - width // 2)  # a rejected tail
    both(lms, torch.randint(0, 64, (1, 1), generator=generator), logits_to_keep=0)

    layout = TreeLayout.from_parents([-1, -1, 0, 0, 1, 2])
    offsets, visible = layout.block_attention(1)
    start = static.cache_len
    tokens = torch.randint(0, 64, (1, 7), generator=generator)
    both(lms, tokens, 7, offsets=offsets, visible=visible)
    for lm in lms:
        lm.keep(start, [0, 1, 3, 6])  # the last token, then nodes 0, 2, 5: one root-to-leaf path
    both(lms, torch.randint(0, 64, (1, 2), generator=generator), logits_to_keep=2)


def test_padding_rows_write_only_scratch_slots(model):
    """A 3-token pass runs at width 4: slots past the pass stay as they were, the cache stays finite."""
    static = CausalLM(model, static_cache=True)
    static.forward(torch.tensor([[1, 2, 3, 4, 5]]))
    cache = static._static.cache
    before = cache.states.clone()
    static.forward(torch.tensor([[6, 7, 8]]), logits_to_keep=3)
    changed = (cache.states != before).any(dim=(0, 2, 3, 4)).nonzero().flatten().tolist()
    assert 3 not in WIDTHS and 4 in WIDTHS
    assert set(changed) <= {5, 6, 7} | set(range(cache.scratch, cache.scratch + SCRATCH_SLOTS))
    assert {5, 6, 7} <= set(changed) and torch.isfinite(cache.states).all()


def test_the_cache_grows_past_its_capacity():
    dynamic, static = lms = pair(tiny_model(tiny_config(max_positions=4096), seed=3))
    capacity = static._static.cache.capacity
    assert capacity < 4096
    generator = torch.Generator().manual_seed(1)
    both(lms, torch.randint(0, 64, (1, capacity - 2), generator=generator))
    both(lms, torch.randint(0, 64, (1, 5), generator=generator), logits_to_keep=5)  # crosses the capacity
    assert static._static.cache.capacity >= 2 * capacity
    both(lms, torch.randint(0, 64, (1, 1), generator=generator))


def test_capacity_is_at_most_the_context(model):
    decoder = CausalLM(model, static_cache=True)._static
    assert decoder.cache.capacity == 1024 and decoder.key_buckets() == [256, 512, 1024 + SCRATCH_SLOTS]


def test_module_weights_become_views_of_the_joined_matrices(model):
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.inference_mode():
        before = model(input_ids=tokens).logits
        decoder = StaticDecoder(model)
        after = model(input_ids=tokens).logits
    attention = model.model.layers[0].self_attn
    layer = decoder.layers[0]
    assert attention.q_proj.weight.data_ptr() == layer.qkv.data_ptr()
    assert attention.k_proj.weight.untyped_storage().data_ptr() == layer.qkv.untyped_storage().data_ptr()
    assert model.model.layers[0].mlp.up_proj.weight.untyped_storage().data_ptr() == layer.gate_up.untyped_storage().data_ptr()
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    again = StaticDecoder(model)  # a second decoder (an early-exit view, say) views the same memory
    assert again.layers[0].qkv.data_ptr() == layer.qkv.data_ptr()


@pytest.mark.parametrize("k,tree", [(3, 0), ("auto", 0), (4, 6)])
def test_greedy_speculation_on_static_caches_equals_plain_decoding(k, tree, tiny_target, drafts):
    """Target and draft both on static caches: spec == ar token for token, chains and trees."""
    expected = SpeculativeDecoder(CausalLM(tiny_target, static_cache=False)).generate([5, 9, 2, 7], max_new_tokens=40)
    target = CausalLM(tiny_target, static_cache=True)
    drafter = ModelDrafter(CausalLM(drafts["close"], static_cache=True), min_confidence=0.0)
    got = SpeculativeDecoder(target, drafter, k=k, tree_budget=tree).generate([5, 9, 2, 7], max_new_tokens=40)
    assert got.token_ids == expected.token_ids
    assert got.stats.accepted > 0 and got.stats.accepted < got.stats.drafted


def test_what_cannot_run_on_a_static_cache_is_named(model, monkeypatch):
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    assert static_obstacle(model) is None
    assert static_obstacle(LlamaForCausalLM(LlamaConfig(**sizes))) is None
    assert "sliding" in static_obstacle(MistralForCausalLM(MistralConfig(sliding_window=8, **sizes)))
    packed = tiny_model(tiny_config(), seed=4)
    packed.model.layers[1].mlp.down_proj = Int4Linear.quantize(packed.model.layers[1].mlp.down_proj)
    assert "nn.Linear" in static_obstacle(packed)
    assert not wants_static_cache(model, None)  # on the CPU, unasked: the dynamic cache
    monkeypatch.setenv("SPECDRAFT_STATIC_CACHE", "1")
    assert wants_static_cache(model, None) and not wants_static_cache(packed, None)
    with pytest.raises(SpecdraftError, match="static cache"):
        CausalLM(packed, static_cache=True)
    monkeypatch.setenv("SPECDRAFT_STATIC_CACHE", "yes")
    with pytest.raises(SpecdraftError, match="one of 0, 1, auto"):
        wants_static_cache(model, None)


@pytest.mark.parametrize("batched", [False, True])
def test_a_part_of_a_step_that_captured_a_graph_teaches_the_policy_none_of_its_times(tiny_target, drafts, monkeypatch,
                                                                                   batched):
    """A CUDA graph's capture (a width's first pass after the cache grew, a batch's cache made as requests came)
    takes far longer than the pass: timed as one, it priced that width out of the policy's choices (seen on an H200,
    where a batch stopped drafting). Here every target pass, or every draft pass, "captures" one: nothing is learnt of
    that part's times, the other part's are, and answers stay the same; without the captures the same runs learn
    both. (Before, a capture anywhere kept the whole step untimed, and a GPU batch whose first drafting step captured
    never timed its oracle's drafts.)"""
    from specdraft.batch_engine import BatchedDecoder, BatchRequest
    from specdraft.models import graph_decoder
    from specdraft.sampling import SamplingParams

    def capturing(lm: CausalLM) -> CausalLM:
        forward = lm.forward

        def capturing_forward(*args, **kwargs):
            graph_decoder._captured += 1
            return forward(*args, **kwargs)
        monkeypatch.setattr(lm, "forward", capturing_forward)
        return lm

    def learnt(captures: str | None):
        target = CausalLM(tiny_target)
        if captures == "target":
            capturing(target)

        def make():
            draft = CausalLM(drafts["identical"])
            return ModelDrafter(capturing(draft) if captures == "draft" else draft)
        if batched:
            if captures == "draft":  # a batch runs its drafts' passes on its packed draft cache
                from specdraft.models.packed_cache import PackedCache

                run = PackedCache.run
                monkeypatch.setattr(PackedCache, "run", lambda self, *args, **kwargs: (
                    setattr(graph_decoder, "_captured", graph_decoder._captured + 1), run(self, *args, **kwargs))[1])
            batch = BatchedDecoder(target, make, max_batch=2)
            done = batch.generate_all([BatchRequest([5, 17, 42, 8], SamplingParams(temperature=0.0), 40),
                                       BatchRequest([7, 7, 1], SamplingParams(temperature=0.0), 40)])
            costs = batch.costs
            realized = sum(sum(rates.steps) for rates in batch.realized._sizes.values())  # steps with their rates
            tokens = [c.token_ids for c in done]
        else:
            decoder = SpeculativeDecoder(target, make(), k="auto")
            tokens = [decoder.generate([5, 17, 42, 8], max_new_tokens=40).token_ids]
            costs, realized = decoder.policy.costs, 0
        draft_times = [t for c in costs.sources.values() for t in (c.draft_seconds_per_token, c.read_seconds_per_token)]
        return tokens, [s for s in costs.verify_seconds if s is not None], draft_times, realized

    plain_tokens, plain_passes, plain_drafted, plain_realized = learnt(captures=None)
    assert plain_passes
    # a batch's choice to draft rests on wall-clock rates, so only the single request surely drafts caught up
    assert (plain_realized > 0) if batched else any(d is not None for d in plain_drafted)
    tokens, passes, drafted, realized = learnt(captures="target")
    assert tokens == plain_tokens and not passes and realized == 0
    assert batched or any(d is not None for d in drafted)  # its drafts captured nothing: timed
    tokens, passes, drafted, realized = learnt(captures="draft")
    assert tokens == plain_tokens and all(d is None for d in drafted)
    assert passes  # its passes captured nothing: timed
