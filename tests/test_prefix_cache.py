"""Prefix caching: a prompt read as cached rows of its beginning and then the rest holds the bits of one read, and
a batch that reuses a shared beginning answers as alone."""

from __future__ import annotations

import pytest
import torch

from specdraft import SamplingParams, SpecdraftError, SpeculativeDecoder
from specdraft.batch_engine import BatchedDecoder, BatchRequest
from specdraft.drafters import NgramDrafter
from specdraft.kernels import decoder_layers, isa
from specdraft.models.causal_lm import CausalLM
from specdraft.prefix_cache import PrefixCache, shared_length
from specdraft.models.fast_layers import fast_decoder_layers
from test_fast_layers import int4_model


@pytest.fixture(params=["avx512", "avx2"])
def level(request, monkeypatch):
    """Each level of fused layers and attention kernels this CPU runs (AVX2 forced where it has more)."""
    if request.param == "avx2":
        if not isa.CPU_FLAGS["avx2"] <= isa.cpu_flags():
            pytest.skip("no AVX2 on this CPU")
        monkeypatch.setenv("SPECDRAFT_ISA", "avx2")
    elif isa.detected() != "avx512":
        pytest.skip("the AVX-512 kernels do not run here (or AMX does, where prefixes are not reused)")
    if decoder_layers.level() != request.param:
        pytest.skip(f"the {request.param} fused layers do not build here")
    return request.param


def fused_int4_model(seed: int):
    """A packed 4-bit model with its layers stacked for the tile kernels and fused, as `load_model` leaves one."""
    model = int4_model(seed=seed)
    fast_decoder_layers(model)
    return model


def read(model, pieces: list[torch.Tensor]) -> CausalLM:
    """A cache that read the prompt in `pieces` ([1, n] each), each piece's rows taken over by a fresh reader (as a
    batch takes a cached prefix's rows), then the next token's pass."""
    lm = CausalLM(model)
    for piece in pieces:
        part = CausalLM(model)
        part.append_rows([None if r is None else (r[0].clone(), r[1].clone()) for r in lm.rows(lm.cache_len)])
        part.prefill(piece)
        lm = part
    return lm


def test_a_prompt_read_in_any_split_holds_the_bits_of_one_read(level):
    """Reading a prompt whole, or as a cached beginning (taken over as rows) and then the rest, in pieces of one
    token, a few over a cache (fused layers) or many (transformers' layers), gives the same cache and logits."""
    model = fused_int4_model(seed=3)
    prompt = torch.randint(0, 96, (1, 110), generator=torch.Generator().manual_seed(8))
    whole = read(model, [prompt])
    assert whole.reads_split_exactly
    want_rows = [(k.clone(), v.clone()) for k, v in whole.rows(110)]
    want = whole.forward(torch.tensor([[17]])).logits
    for splits in ([1], [7], [20, 21], [30], [45, 100], [109]):
        bounds = [0, *splits, 110]
        lm = read(model, [prompt[:, a:b] for a, b in zip(bounds, bounds[1:])])
        for (k, v), (want_k, want_v) in zip(lm.rows(110), want_rows):
            assert torch.equal(k, want_k) and torch.equal(v, want_v), splits
        assert torch.equal(lm.forward(torch.tensor([[17]])).logits, want), splits


def test_prefixes_are_reused_only_where_a_split_read_is_exact(tiny_target, make_lm):
    """A float32 model's wide passes take SDPA, whose rows depend on the split: its batch keeps no prefixes."""
    lm = make_lm(tiny_target)
    assert not lm.reads_split_exactly
    assert BatchedDecoder(lm, None).prefixes is None


def rows_of(tokens: list[int], layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fake cached rows whose values name their token, [1, 1, n, 4] per layer."""
    states = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1).expand(1, 1, len(tokens), 4).contiguous()
    return [(states + layer, -states - layer) for layer in range(layers)]


def test_the_prefix_cache_gives_the_longest_shared_beginning_and_keeps_to_its_budget():
    per_token = 2 * 2 * 4 * 4  # keys and values, 2 layers, 4 floats
    cache = PrefixCache(max_bytes=20 * per_token)
    assert cache.match(torch.tensor([1, 2, 3])) == (0, [])
    cache.add(torch.tensor([1, 2, 3, 4, 5]), rows_of([1, 2, 3, 4, 5]))
    cache.add(torch.tensor([1, 2, 9, 9, 9, 9]), rows_of([1, 2, 9, 9, 9, 9]))
    length, rows = cache.match(torch.tensor([1, 2, 3, 4, 7, 7]))
    assert length == 4 and torch.equal(rows[1][0][0, 0, :, 0], torch.tensor([2.0, 3, 4, 5]))
    assert cache.reused_tokens == 4 and cache.nbytes == 11 * per_token
    cache.add(torch.tensor([1, 2, 3]), rows_of([1, 2, 3]))  # a kept prompt begins with it: nothing new
    assert len(cache) == 2 and cache.nbytes == 11 * per_token
    cache.add(torch.tensor([1, 2, 3, 4, 5, 6, 7]), rows_of([1, 2, 3, 4, 5, 6, 7]))  # it covers [1 .. 5]
    assert len(cache) == 2 and cache.nbytes == 13 * per_token
    cache.add(torch.tensor([5] * 10), rows_of([5] * 10))  # over budget: the least recently used leaves
    assert cache.match(torch.tensor([1, 2, 9, 9]))[0] == 2 and cache.match(torch.tensor([1, 2, 3]))[0] == 3
    assert cache.nbytes == 17 * per_token
    cache.add(torch.tensor(list(range(21))), rows_of(list(range(21))))  # larger than the budget: not kept
    assert cache.nbytes == 17 * per_token and cache.match(torch.tensor([0, 1]))[0] == 0
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0 and cache.match(torch.tensor([5, 5]))[0] == 0
    assert shared_length(torch.tensor([4, 5]), torch.tensor([4, 5, 6])) == 2


def test_a_prompt_shares_rows_only_with_prompts_kept_under_its_salt():
    """Prompts kept under one salt are invisible to every other (unsalted included), and neither covers nor
    replaces the others' (vLLM's `cache_salt`)."""
    cache = PrefixCache(max_bytes=1 << 20)
    cache.add(torch.tensor([1, 2, 3, 4]), rows_of([1, 2, 3, 4]), salt="a")
    assert cache.match(torch.tensor([1, 2, 3, 4, 5])) == (0, [])
    assert cache.match(torch.tensor([1, 2, 3, 4, 5]), "b") == (0, [])
    assert cache.match(torch.tensor([1, 2, 3, 4, 5]), "a")[0] == 4
    cache.add(torch.tensor([1, 2, 3]), rows_of([1, 2, 3]))  # "a" holds these rows, but not for the unsalted
    cache.add(torch.tensor([1, 2, 3, 4, 5, 6]), rows_of([1, 2, 3, 4, 5, 6]), salt="b")  # covers "a"'s: both stay
    assert len(cache) == 3
    assert [cache.match(torch.tensor([1, 2, 3, 4, 5, 6]), salt)[0] for salt in ("", "a", "b", "c")] == [3, 4, 6, 0]


def test_a_batch_reads_only_what_follows_a_shared_beginning_and_answers_as_alone(level):
    """Prompts sharing a system prompt: each after the first reads from where they part, and answers, greedy and
    sampled, as it does alone."""
    model = fused_int4_model(seed=4)
    system = [(11 * i + 5) % 96 for i in range(37)]
    prompts = [system + [3, 1, 4, 1, 5], system + [2, 7, 1, 8], system + [2, 7, 1, 8, 2, 8, 1], system[:20] + [9]]
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.95, seed=3)
    batch = BatchedDecoder(CausalLM(model), None, max_batch=2)
    for sampling in (greedy, sampled):
        batch.clear_prefixes()
        done = [batch.generate_all([BatchRequest(p, sampling, 12, k=None)])[0] for p in prompts]
        want = [SpeculativeDecoder(CausalLM(model)).generate(p, sampling, max_new_tokens=12).token_ids for p in prompts]
        assert [c.token_ids for c in done] == want
        # the last token of a prompt is read by its first step; a prompt shorter than a kept one reuses all but that
        assert [c.stats.cached_prompt_tokens for c in done] == [0, 37, 40, 20]
    cold = BatchedDecoder(CausalLM(model), None, prefix_cache_bytes=0)
    assert cold.prefixes is None
    assert cold.generate_all([BatchRequest(prompts[1], greedy, 12)])[0].stats.cached_prompt_tokens == 0


def test_decoders_sharing_a_prefix_cache_answer_as_without_one(level, tiny_target, make_lm):
    """One request at a time (the library, a server with --max-batch 1): decoders over one target share the kept
    prompts, each reads what follows the longest beginning it shares, and answers as a decoder without them."""
    model = fused_int4_model(seed=6)
    system = [(13 * i + 2) % 96 for i in range(30)]
    prompts = [system + [1, 2, 3], system + [4, 5], system + [4, 5, 6, 7]]
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=11)
    target, prefixes = CausalLM(model), PrefixCache(1 << 20)
    plain, drafting = SpeculativeDecoder(target, prefixes=prefixes), SpeculativeDecoder(target, NgramDrafter(), k=3,
                                                                                         prefixes=prefixes)
    cached = []
    for decoder in (plain, drafting):
        for sampling in (greedy, sampled):
            for prompt in prompts:
                got = decoder.generate(prompt, sampling, max_new_tokens=10)
                want = SpeculativeDecoder(CausalLM(model)).generate(prompt, sampling, max_new_tokens=10)
                assert got.token_ids == want.token_ids
                cached.append(got.stats.cached_prompt_tokens)
    assert cached[:3] == [0, 30, 31] and cached[3:] == [32, 31, 33] * 3  # then each whole prompt is kept
    with pytest.raises(SpecdraftError, match="prefix cache"):
        SpeculativeDecoder(make_lm(tiny_target), prefixes=prefixes)  # float32: its reads do not split exactly
