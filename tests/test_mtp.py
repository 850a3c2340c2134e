"""MTP heads: the multi-token-prediction layer a model's own checkpoint carries (`mtp_checkpoints`: random weights,
the DeepSeek-V3 / GLM-4.5 names) for a Llama-3.x-shaped, a Qwen3-shaped and a Qwen2-shaped tiny target.

- Tier 1, the forward: our draft logits equal a small reference forward written here from the sources (vLLM's
  `DeepSeekMultiTokenPredictorLayer` and `compute_logits`: embedding zeroed at position 0, enorm / hnorm,
  eh_proj over [e ; h], the block, `shared_head.norm` under the head; a Llama / Qwen decoder layer as the block),
  float32, 1e-4: the catch-up rows and two draft steps fed back, through the cache.
- Loading: no MTP layers declared, a missing or misshapen tensor, an MoE block: each a SpecdraftError saying what.
- Tier 3: greedy `spec` equals `ar` with the mtp drafter, chains and trees, single and batched.
- Tier 2: sampled output (chains, with and without the confidence cut, and trees) follows the target exactly by a
  chi-square test, 1,500 draws over 64 cells (catches every bias of total variation >= 0.105 with probability 0.9 at
  alpha 1e-3: `detectable_bias`), with a planted-bias control the same test must reject: each drafted token handed
  to the verifier with the next position's q row.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from conftest import (PROMPTS, assert_batch_answers_as_alone, assert_cli_spec_equals_ar_and_check_passes,
                      assert_greedy_spec_equals_ar, assert_planted_bias_caught, assert_sampled_output_follows,
                      sharpened, small_sampling_target, tiny_config)
from mtp_checkpoints import random_mtp_layer, save_with_mtp
from specdraft import SpeculativeDecoder
from specdraft.drafters import Draft, MtpDrafter, make_drafter
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.models.mtp_loading import load_mtp
from test_eagle3 import LLAMA3_ROPE, reference_inv_freq, rms

V = 96


@pytest.fixture(scope="module")
def targets() -> dict:
    """Tiny random targets: Llama 3.x (llama3 rope scaling, GQA, biases on every projection), Qwen3 (q/k norms,
    head_dim apart from the width) and Qwen2 (q/k/v biases)."""
    torch.manual_seed(41)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                                         rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072,
                                         attention_bias=True, tie_word_embeddings=False))
    torch.manual_seed(42)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=4096, tie_word_embeddings=False))
    torch.manual_seed(43)
    qwen2 = Qwen2ForCausalLM(tiny_config(vocab_size=V, layers=2))
    return {"llama": sharpened(llama), "qwen3": sharpened(qwen3), "qwen2": sharpened(qwen2)}


# Each case: the target, the layer's options, and how the folder is written.
CASES = {
    "llama": ("llama", dict(seed=1), dict()),  # the target's embeddings and LM head shared
    "qwen3-own-copies": ("qwen3", dict(own_embeddings=True, own_head=True, extra_layers=1, seed=2),
                         dict(layers=2, shards=True)),  # DeepSeek's copies; a second MTP layer, not read; shards
    "qwen2": ("qwen2", dict(seed=3), dict()),
}


def make_case(name: str, targets: dict, folder):
    target_name, layer_options, save_options = CASES[name]
    target_model = targets[target_name]
    tensors = random_mtp_layer(target_model.config, **layer_options)
    return target_model, tensors, save_with_mtp(target_model, tensors, folder, **save_options)


# ----- the reference forward, from the sources --------------------------------------------------------------------
class Reference:
    """The first MTP layer run as vLLM's `DeepSeekMultiTokenPredictorLayer` writes it, with a Llama / Qwen decoder
    layer (transformers' `LlamaDecoderLayer`, `Qwen3DecoderLayer`) as `mtp_block`, one position at a time."""

    def __init__(self, target_model, tensors: dict[str, torch.Tensor]) -> None:
        config = target_model.config
        self.L = config.num_hidden_layers
        self.t = {name.removeprefix(f"model.layers.{self.L}."): value for name, value in tensors.items()
                  if name.startswith(f"model.layers.{self.L}.")}
        self.heads, self.kv = config.num_attention_heads, config.num_key_value_heads
        self.d = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.embedding = self.t.get("embed_tokens.weight", target_model.get_input_embeddings().weight.detach())
        self.head = self.t.get("shared_head.head.weight", target_model.lm_head.weight.detach())
        layer = {"head_dim": self.d, **config.to_dict()}
        self.inv_freq = reference_inv_freq(layer)
        self.keys, self.values = [], []  # [kv, d] per position fed

    def _rope(self, x: torch.Tensor, position: int) -> torch.Tensor:  # x: [heads, d]
        angles = position * self.inv_freq
        cos, sin = torch.cat([angles, angles]).cos(), torch.cat([angles, angles]).sin()
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def _linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        y = self.t[f"{name}.weight"] @ x
        return y + self.t[f"{name}.bias"] if f"{name}.bias" in self.t else y

    def step(self, hidden: torch.Tensor, token: int, position: int) -> torch.Tensor:
        """The layer's output for one pair (previous state [H], token) at `position`, seeing every pair before."""
        t = self.t
        embeds = self.embedding[token] * (position != 0)  # "masking inputs at position 0"
        x = t["eh_proj.weight"] @ torch.cat([rms(embeds, t["enorm.weight"], self.eps),
                                             rms(hidden, t["hnorm.weight"], self.eps)])
        a = rms(x, t["input_layernorm.weight"], self.eps)
        q = self._linear("self_attn.q_proj", a).view(self.heads, self.d)
        k = self._linear("self_attn.k_proj", a).view(self.kv, self.d)
        v = self._linear("self_attn.v_proj", a).view(self.kv, self.d)
        if "self_attn.q_norm.weight" in t:  # a Qwen3 layer
            q, k = rms(q, t["self_attn.q_norm.weight"], self.eps), rms(k, t["self_attn.k_norm.weight"], self.eps)
        self.keys.append(self._rope(k, position))
        self.values.append(v)
        keys, values = torch.stack(self.keys, 1), torch.stack(self.values, 1)  # [kv, n, d]
        group = self.heads // self.kv
        scores = torch.einsum("hd,hnd->hn", self._rope(q, position), keys.repeat_interleave(group, 0)) / self.d ** 0.5
        attended = torch.einsum("hn,hnd->hd", scores.softmax(-1), values.repeat_interleave(group, 0))
        r = x + self._linear("self_attn.o_proj", attended.reshape(-1))
        m = rms(r, t["post_attention_layernorm.weight"], self.eps)
        gate, up = t["mlp.gate_proj.weight"] @ m, t["mlp.up_proj.weight"] @ m
        return r + t["mlp.down_proj.weight"] @ (torch.nn.functional.silu(gate) * up)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """`compute_logits`: shared_head.head (or the target's LM head) over shared_head.norm(out). # [V]"""
        return self.head @ rms(out, self.t["shared_head.norm.weight"], self.eps)


def final_states(target_model, tokens: torch.Tensor) -> torch.Tensor:
    """The target's final (normed) hidden states `[T, H]`, from transformers directly."""
    with torch.no_grad():
        return target_model.model(tokens.unsqueeze(0)).last_hidden_state[0]


@pytest.mark.parametrize("name", list(CASES))
def test_draft_logits_equal_the_reference_forward(targets, tmp_path, name):
    """Catch-up rows fed in two passes through the cache (position 0 among them), then two draft steps fed back."""
    target_model, tensors, folder = make_case(name, targets, tmp_path / "model")
    model = load_mtp(folder, target_model.lm_head, dtype=torch.float32)
    assert model.config.layer_index == target_model.config.num_hidden_layers
    sequence = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(7))
    states = final_states(target_model, sequence[:9])  # [9, H]: pairs (h_t, x_{t+1}), t < 9
    embedding = target_model.get_input_embeddings()
    reference = Reference(target_model, tensors)
    reference_outs = [reference.step(states[i], int(sequence[i + 1]), i) for i in range(9)]
    with torch.no_grad():
        model.reset_cache()
        outs = [model(model.project(states[a:b]), model.embed(sequence[a + 1:b + 1], embedding), torch.arange(a, b))
                for a, b in ((0, 5), (5, 9))]
        got = model.draft_logits(torch.cat(outs))  # [9, V]
    torch.testing.assert_close(got, torch.stack([reference.logits(out) for out in reference_outs]),
                               rtol=1e-4, atol=1e-4)
    ours_out, reference_out = outs[-1][-1:], reference_outs[-1]
    for position in (9, 10):
        token = sequence[position + 1:position + 2]
        with torch.no_grad():
            ours_out = model(model.fed_back(ours_out), model.embed(token, embedding), torch.tensor([position]))
        reference_out = reference.step(reference_out, int(token), position)
        torch.testing.assert_close(model.draft_logits(ours_out)[0], reference.logits(reference_out),
                                   rtol=1e-4, atol=1e-4)


def test_the_head_is_shared_not_copied(targets, tmp_path):
    """Without `shared_head.head` the layer scores with the target's LM head: the same storage, not a copy."""
    target_model, _, folder = make_case("qwen2", targets, tmp_path / "model")
    model = load_mtp(folder, target_model.lm_head, dtype=torch.float32)
    assert model.lm_head.inner.weight.data_ptr() == target_model.lm_head.weight.data_ptr()
    assert model.embed_tokens is None


# ----- loading: what to fix -----------------------------------------------------------------------------------------
def test_broken_checkpoints_say_what_to_fix(targets, tmp_path):
    target_model = targets["qwen2"]
    L = target_model.config.num_hidden_layers
    target_model.save_pretrained(tmp_path / "plain")
    with pytest.raises(SpecdraftError, match="declares no MTP layers"):
        load_mtp(tmp_path / "plain", target_model.lm_head)
    tensors = random_mtp_layer(target_model.config, seed=4)
    del tensors[f"model.layers.{L}.hnorm.weight"]
    with pytest.raises(SpecdraftError, match="lacks hnorm.weight"):
        load_mtp(save_with_mtp(target_model, tensors, tmp_path / "missing"), target_model.lm_head)
    tensors = random_mtp_layer(target_model.config, seed=4)
    tensors[f"model.layers.{L}.mlp.gate_proj.weight"] = torch.zeros(80, 32)
    with pytest.raises(SpecdraftError, match=r"gate_proj.weight has shape \(80, 32\).*intermediate_size"):
        load_mtp(save_with_mtp(target_model, tensors, tmp_path / "shape"), target_model.lm_head)
    tensors = random_mtp_layer(target_model.config, seed=4)
    tensors[f"model.layers.{L}.mlp.experts.0.up_proj.weight"] = torch.zeros(64, 32)
    with pytest.raises(SpecdraftError, match="mixture of experts"):
        load_mtp(save_with_mtp(target_model, tensors, tmp_path / "moe"), target_model.lm_head)
    plain = CausalLM(target_model, name="tiny-qwen2")  # not a folder: --trained is needed
    with pytest.raises(SpecdraftError, match="pass --trained FOLDER"):
        make_drafter("mtp", target_model=plain)
    other = LlamaForCausalLM(LlamaConfig(vocab_size=V + 8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).float().eval()
    model = load_mtp(save_with_mtp(target_model, random_mtp_layer(target_model.config, seed=4), tmp_path / "ok"),
                     target_model.lm_head, dtype=torch.float32)
    with pytest.raises(SpecdraftError, match="target's own checkpoint folder"):
        MtpDrafter(CausalLM(other), model)


# ----- tier 3: greedy spec == ar ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("tree", [0, 6])
def test_greedy_spec_equals_ar(targets, tmp_path, name, tree):
    """Chains (k=4, no cut and the default cut) and dynamic trees (6 nodes, 3 children); the drafter reads the
    target's own folder when --trained is not given (the target's name is its folder, as `load_model` names it)."""
    target_model, _, folder = make_case(name, targets, tmp_path / "model")
    assert_greedy_spec_equals_ar(CausalLM(target_model, name=str(folder)), "mtp", {}, tree, name)


def test_greedy_spec_equals_ar_on_a_packed_gguf_target(tmp_path):
    """A Q4_K_M GGUF target on the CPU kernels, its MTP layer from a folder (`--trained`): the packed LM head is read
    row by row for the draft, and the output is still `ar`'s (chains and trees)."""
    from safetensors.torch import save_file

    from specdraft.bench.random_gguf import default_tokenizer, tiny_config as family_config, write_random_gguf
    from specdraft.models.loading import load_model

    if default_tokenizer() is None:
        pytest.skip("no bundled GGUF here to take a tokenizer from")
    gguf = write_random_gguf(family_config("qwen3", num_hidden_layers=4), tmp_path / "t.gguf", "Q4_K_M",
                             tokenizer=default_tokenizer(), seed=3)
    target = load_model(str(gguf), dtype="bfloat16", verbose=False)
    folder = tmp_path / "mtp"
    folder.mkdir()
    config = json.loads(target.config.to_json_string())
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    save_file(random_mtp_layer(target.config, seed=6), str(folder / "model.safetensors"))
    expected = [SpeculativeDecoder(target).generate(p, max_new_tokens=16).token_ids for p in PROMPTS[::2]]
    for tree in (0, 6):
        drafter = make_drafter("mtp", {"trained": str(folder), "draft-confidence": 0.0}, target_model=target)
        outs = [SpeculativeDecoder(target, drafter, k=3, tree_budget=tree, tree_branch=3).generate(p, max_new_tokens=16)
                for p in PROMPTS[::2]]
        assert [out.token_ids for out in outs] == expected, tree
        assert sum(out.stats.drafted for out in outs) > 0


@pytest.mark.parametrize("tree", [0, 5])
def test_a_batch_answers_as_alone(targets, tmp_path, tree):
    """BatchedDecoder, three slots for four requests, one set of weights shared by every sequence's drafter (as a
    server builds them: `shared`): each greedy answer is its answer alone."""
    target_model, _, folder = make_case("qwen3-own-copies", targets, tmp_path / "model")
    assert_batch_answers_as_alone(target_model, "mtp", str(folder), tree)


# ----- tier 2: sampled output follows the target ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_target() -> Qwen2ForCausalLM:
    return small_sampling_target()


def small_drafter(target_model, tmp_path, cls=MtpDrafter, min_confidence: float = 0.0):
    """The 8-token target's random MTP layer (the target's embeddings and LM head), drafting with its own q."""
    folder = save_with_mtp(target_model, random_mtp_layer(target_model.config, seed=9), tmp_path / "small")
    target = CausalLM(target_model)
    return cls(target, load_mtp(folder, target_model.lm_head, dtype=torch.float32), min_confidence), target


class ShiftedQ(MtpDrafter):
    """Planted bias: the tokens are drawn right, but each is handed to the verifier with the q row of the position
    after it (the last row repeated): the off-by-one of a chain that records its row after feeding the token back."""

    def propose(self, ctx, k):
        draft = super().propose(ctx, k)
        if draft.q_draft is None:
            return draft
        rows = torch.cat([draft.q_draft[1:], draft.q_draft[-1:]])  # [k, V]
        return Draft.chain(draft.tokens, rows)


@pytest.mark.parametrize("tree, cut", [(0, 0.0), (0, 0.2), pytest.param(6, 0.0, marks=pytest.mark.slow)])  # ~20 s each
def test_sampled_output_follows_the_target(small_target, tmp_path, tree, cut):
    """Chains (k=3) with no cut and with the confidence cut biting (0.2), and sampled trees (6 nodes, 3 children: the
    drawn chain, point-mass siblings): the drafted tokens' q is the MTP layer's softmax over the whole vocabulary."""
    drafter, target = small_drafter(small_target, tmp_path, min_confidence=cut)
    decoder = SpeculativeDecoder(target, drafter, k=3, tree_budget=tree, tree_branch=3)
    assert_sampled_output_follows(small_target, decoder)


def test_q_rows_off_by_one_are_caught(small_target, tmp_path):
    """The control: the same test rejects the chain whose q rows are each the next position's."""
    drafter, target = small_drafter(small_target, tmp_path, ShiftedQ)
    assert_planted_bias_caught(small_target, SpeculativeDecoder(target, drafter, k=3), "q rows off by one")


# ----- the command line ---------------------------------------------------------------------------------------------
def test_generate_and_check_read_the_targets_own_folder(tiny_model_dirs, tiny_tokenizer, tmp_path):
    """`--drafter mtp` with no --trained reads the MTP layer from the target's own folder: `generate` equals `ar`
    greedily, and `specdraft check` passes (greedy identity and the sampled test it sizes itself)."""
    from transformers import AutoModelForCausalLM

    target_model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["target"], dtype=torch.float32)
    folder = save_with_mtp(target_model, random_mtp_layer(target_model.config, seed=5), tmp_path / "target")
    tiny_tokenizer.save_pretrained(folder)
    assert_cli_spec_equals_ar_and_check_passes(folder, ["--drafter", "mtp"])
