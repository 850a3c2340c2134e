"""DFlash block drafts from their published checkpoints: random-weight drafts in z-lab's `DFlashDraftModel` format
(`dflash_checkpoints`) for a Qwen3-shaped and a Llama-3.x-shaped tiny target.

- Tier 1, the forward: our block logits equal a small reference forward written here from the source (z-lab's
  `dflash/model.py`: `DFlashDraftModel.forward`, `Qwen3DFlashAttention`, `extract_context_feature`), float32, 1e-4,
  the reference recomputing the whole context each time while ours keeps it in the caches (two passes).
- Loading: a missing or misshapen tensor, no mask token, layers the target lacks: each a SpecdraftError.
- Tier 3: greedy `spec` equals `ar` with the dflash drafter (chains, the default cut, trees over the block's rows),
  single and batched.
- Tier 2: sampled output, chains with the confidence cut on (it bites: threshold 0.2) and trees, follows the target
  exactly by a chi-square test, 1,500 draws over 64 cells (catches every bias of total variation >= 0.105 with
  probability 0.9 at alpha 1e-3: `detectable_bias`), with a planted-bias control the same test must reject, for
  chains and trees: each drawn token replaced by its row's argmax, proposed under the row as its q (tokens not drawn
  from the q handed over).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from conftest import (PROMPTS, assert_batch_answers_as_alone, assert_cli_spec_equals_ar_and_check_passes,
                      assert_greedy_spec_equals_ar, assert_planted_bias_caught, assert_sampled_output_follows,
                      sharpened, small_sampling_target)
from dflash_checkpoints import random_dflash, save_dflash
from specdraft import SpeculativeDecoder
from specdraft.drafters import DFlashDrafter, Draft, make_drafter
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.models.dflash_loading import build_dflash, from_published, load_dflash
from test_eagle3 import LLAMA3_ROPE, reference_inv_freq, rms

V = 96


@pytest.fixture(scope="module")
def targets() -> dict:
    torch.manual_seed(51)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=4096, tie_word_embeddings=False))
    torch.manual_seed(52)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                         num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                                         rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072,
                                         tie_word_embeddings=False))
    return {"qwen3": sharpened(qwen3), "llama": sharpened(llama)}


CASES = {  # the target, the draft's options
    "qwen3": ("qwen3", dict(layers=2, target_layer_ids=[1, 3], seed=1)),
    "llama-default-layers": ("llama", dict(layers=3, block_size=5, seed=2)),  # ids from build_target_layer_ids
}


def make_case(name: str, targets: dict, folder):
    target_name, options = CASES[name]
    target_model = targets[target_name]
    config, tensors = random_dflash(target_model.config, **options)
    return target_model, config, tensors, save_dflash(config, tensors, folder)


# ----- the reference forward, from the source ---------------------------------------------------------------------
def reference_block_logits(config: dict, t: dict[str, torch.Tensor], target_model, features: torch.Tensor,
                           block: torch.Tensor) -> torch.Tensor:
    """`DFlashDraftModel.forward` with no cache: target_hidden = hidden_norm(fc(features)) at positions 0 .. m - 1,
    the block (anchor and masks, the target's embeddings) at m ..; every layer's q from the block, k and v from
    [target_hidden ; block] (k_norm on both), no mask; norm; the target's lm_head. Rows `[B, V]`."""
    eps, d = config["rms_norm_eps"], config["head_dim"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    inv = reference_inv_freq({"head_dim": d, "rope_theta": config["rope_theta"]})
    m, size = features.shape[0], block.shape[0]
    angles = torch.arange(m + size).float().unsqueeze(-1) * inv
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # [m + B, d]

    def rope(x, c, s):  # x: [n, h, d]
        half = d // 2
        return x * c.unsqueeze(1) + torch.cat([-x[..., half:], x[..., :half]], -1) * s.unsqueeze(1)

    target_hidden = rms(features @ t["fc.weight"].T, t["hidden_norm.weight"], eps)  # [m, H]
    h = target_model.get_input_embeddings().weight.detach()[block]  # [B, H]
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        a = rms(h, t[p + "input_layernorm.weight"], eps)
        q = rms((a @ t[p + "self_attn.q_proj.weight"].T).view(size, heads, d), t[p + "self_attn.q_norm.weight"], eps)
        both = torch.cat([target_hidden, a])  # [m + B, H]
        k = rms((both @ t[p + "self_attn.k_proj.weight"].T).view(m + size, kv, d), t[p + "self_attn.k_norm.weight"],
                eps)
        v = (both @ t[p + "self_attn.v_proj.weight"].T).view(m + size, kv, d)
        q, k = rope(q, cos[-size:], sin[-size:]), rope(k, cos, sin)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)  # [m + B, heads, d]
        scores = torch.einsum("bhd,nhd->hbn", q, k) * d ** -0.5
        attended = torch.einsum("hbn,nhd->bhd", scores.softmax(-1), v).reshape(size, -1)
        h = h + attended @ t[p + "self_attn.o_proj.weight"].T
        g = rms(h, t[p + "post_attention_layernorm.weight"], eps)
        h = h + (torch.nn.functional.silu(g @ t[p + "mlp.gate_proj.weight"].T) * (g @ t[p + "mlp.up_proj.weight"].T)
                 ) @ t[p + "mlp.down_proj.weight"].T
    return rms(h, t["norm.weight"], eps) @ target_model.lm_head.weight.detach().T


def target_features(target_model, tokens: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """`extract_context_feature`: hidden_states[id + 1] of each target layer id, side by side `[T, n * H]`."""
    with torch.no_grad():
        states = target_model(tokens.unsqueeze(0), output_hidden_states=True).hidden_states
    return torch.cat([states[i][0] for i in layers], dim=-1)


@pytest.mark.parametrize("name", list(CASES))
def test_block_logits_equal_the_reference_forward(targets, tmp_path, name):
    """Two passes: context 0..4 with the block at 5, then context 5..8 added (ours from the caches) with the block at
    9; every row of each block as the reference computes it from the whole context."""
    target_model, config, tensors, folder = make_case(name, targets, tmp_path / "draft")
    model = load_dflash(folder, dtype=torch.float32)
    sequence = torch.randint(0, V - 1, (12,), generator=torch.Generator().manual_seed(7))
    layers = model.config.target_layers
    features = target_features(target_model, sequence[:9], layers)  # [9, n * H]
    embedding = target_model.get_input_embeddings()
    model.reset_cache()
    for start, anchor in ((0, 5), (5, 9)):
        block = torch.full((model.config.block_size,), model.config.mask_token_id)
        block[0] = sequence[anchor]
        with torch.no_grad():
            out = model(features[start:anchor], embedding(block), start, anchor)
        torch.testing.assert_close(out @ target_model.lm_head.weight.T,
                                   reference_block_logits(config, tensors, target_model, features[:anchor], block),
                                   rtol=1e-4, atol=1e-4)
    assert model.cache_len == 9


def test_broken_checkpoints_say_what_to_fix(targets, tmp_path):
    target_model = targets["qwen3"]
    config, tensors = random_dflash(target_model.config, target_layer_ids=[1, 3], seed=3)
    del tensors["hidden_norm.weight"]
    with pytest.raises(SpecdraftError, match="missing tensors hidden_norm.weight"):
        load_dflash(save_dflash(config, tensors, tmp_path / "missing"))
    config, tensors = random_dflash(target_model.config, target_layer_ids=[1, 3], seed=3)
    config["intermediate_size"] = 80
    with pytest.raises(SpecdraftError, match=r"gate_proj.weight has shape \(64, 32\)"):
        load_dflash(save_dflash(config, tensors, tmp_path / "shape"))
    config, tensors = random_dflash(target_model.config, target_layer_ids=[1, 3], seed=3)
    del config["dflash_config"]["mask_token_id"]
    with pytest.raises(SpecdraftError, match="mask_token_id"):
        load_dflash(save_dflash(config, tensors, tmp_path / "mask"))
    config, tensors = random_dflash(target_model.config, target_layer_ids=[1, 5], seed=3)  # 5: the last layer
    model = load_dflash(save_dflash(config, tensors, tmp_path / "layers"), dtype=torch.float32)
    with pytest.raises(SpecdraftError, match="target_layer_ids"):
        DFlashDrafter(CausalLM(target_model), model)
    with pytest.raises(SpecdraftError, match="pass --trained PATH"):
        make_drafter("dflash", target_model=CausalLM(target_model))


# ----- tier 3: greedy spec == ar ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("tree", [0, 6])
def test_greedy_spec_equals_ar(targets, tmp_path, name, tree):
    """Chains (k=4: up to the block's rows; no cut and the default cut) and trees over the block's rows (6 nodes, 3
    children)."""
    target_model, _, _, folder = make_case(name, targets, tmp_path / "draft")
    assert_greedy_spec_equals_ar(CausalLM(target_model), "dflash", {"trained": str(folder)}, tree, name)


@pytest.mark.parametrize("tree", [0, 5])
def test_a_batch_answers_as_alone(targets, tmp_path, tree):
    target_model, _, _, folder = make_case("qwen3", targets, tmp_path / "draft")
    assert_batch_answers_as_alone(target_model, "dflash", str(folder), tree)


def test_greedy_spec_equals_ar_on_a_packed_gguf_target(tmp_path):
    """A Q4_K_M GGUF target on the CPU kernels: its packed LM head is read row by row for the draft, its passes
    return the draft's layer through transformers' layers, and the output is still `ar`'s."""
    from specdraft.bench.random_gguf import default_tokenizer, tiny_config as family_config, write_random_gguf
    from specdraft.models.loading import load_model

    if default_tokenizer() is None:
        pytest.skip("no bundled GGUF here to take a tokenizer from")
    gguf = write_random_gguf(family_config("qwen3", num_hidden_layers=4), tmp_path / "t.gguf", "Q4_K_M",
                             tokenizer=default_tokenizer(), seed=3)
    target = load_model(str(gguf), dtype="bfloat16", verbose=False)
    config, tensors = random_dflash(target.config, layers=1, heads=4, kv_heads=2, head_dim=64, intermediate=512,
                                    block_size=5, target_layer_ids=[1], seed=4)
    folder = str(save_dflash(config, tensors, tmp_path / "draft"))
    expected = [SpeculativeDecoder(target).generate(p, max_new_tokens=16).token_ids for p in PROMPTS[::2]]
    drafter = make_drafter("dflash", {"trained": folder, "draft-confidence": 0.0}, target_model=target)
    outs = [SpeculativeDecoder(target, drafter, k=3).generate(p, max_new_tokens=16) for p in PROMPTS[::2]]
    assert [out.token_ids for out in outs] == expected
    assert sum(out.stats.drafted for out in outs) > 0


# ----- tier 2: sampled output follows the target ---------------------------------------------------------------------
CUT = 0.2  # the confidence cut's threshold: it stops many chains early, not all
NORM_SCALE = 3.0


@pytest.fixture(scope="module")
def small_target() -> Qwen2ForCausalLM:
    return small_sampling_target()


def small_drafter(target_model, cls=DFlashDrafter):
    """A random one-layer DFlash draft reading the first layer's output of the 8-token target, block of 4."""
    config, tensors = random_dflash(target_model.config, layers=1, heads=2, kv_heads=1, block_size=4,
                                    target_layer_ids=[0], seed=9)
    tensors["norm.weight"] = tensors["norm.weight"] * NORM_SCALE  # sharper rows: chains the cut stops at any depth
    target = CausalLM(target_model)
    dflash_config, ours = from_published(config, tensors)
    return cls(target, build_dflash(dflash_config, ours, "test", torch.float32), CUT), target


class ArgmaxUnderQ(DFlashDrafter):
    """Planted bias: each drawn token is replaced by its row's most likely token, handed to the verifier with the row
    as its q, as if it had been drawn from it (a greedy block passed off as a sampled one; a tree's point masses are
    their own rows' argmax)."""

    def propose(self, ctx, k):
        draft = super().propose(ctx, k)
        if draft.q_draft is None:
            return draft
        return Draft.tree(draft.q_draft.argmax(-1), draft.parents.tolist(), draft.q_draft)


TREES = [0, pytest.param(6, marks=pytest.mark.slow)]  # chains, and trees of 6 nodes (slow, as other drafters' trees)


@pytest.mark.parametrize("tree", TREES)
def test_sampled_output_follows_the_target(small_target, tree):
    """Chains of up to 3 from one pass with the confidence cut on (it looks only at the tokens drawn before), and
    trees over the 3 rows (6 nodes, 3 children: the drawn chain, point-mass siblings)."""
    drafter, target = small_drafter(small_target)
    decoder = SpeculativeDecoder(target, drafter, k=3, tree_budget=tree, tree_branch=3)
    assert_sampled_output_follows(small_target, decoder)


@pytest.mark.parametrize("tree", TREES)
def test_tokens_not_drawn_from_their_q_are_caught(small_target, tree):
    """The control: the same test rejects the drafter whose drawn tokens are its rows' argmaxes, not draws from them."""
    drafter, target = small_drafter(small_target, ArgmaxUnderQ)
    decoder = SpeculativeDecoder(target, drafter, k=3, tree_budget=tree, tree_branch=3)
    assert_planted_bias_caught(small_target, decoder, "argmax tokens under q")


# ----- the command line ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tree", [[], ["--tree-budget", 8]], ids=["chain", "tree"])
def test_generate_and_check_take_a_checkpoint_folder(tiny_model_dirs, tmp_path, tree):
    """`--drafter dflash --trained FOLDER` on the command line, chains and trees: `generate` equals `ar` greedily, and
    `specdraft check` passes (greedy identity and the sampled test it sizes itself)."""
    from transformers import AutoConfig

    config, tensors = random_dflash(AutoConfig.from_pretrained(tiny_model_dirs["target"]), layers=1, block_size=5,
                                    target_layer_ids=[0], seed=5)
    folder = save_dflash(config, tensors, tmp_path / "draft")
    assert_cli_spec_equals_ar_and_check_passes(tiny_model_dirs["target"],
                                               ["--drafter", "dflash", "--trained", folder, *tree])
