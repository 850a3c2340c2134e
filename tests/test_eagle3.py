"""EAGLE-3 from its published checkpoints: random-weight heads in the SpecForge and speculators formats (and the GGUF
llama.cpp's converter makes of them) for a Llama-3.x-shaped and a Qwen3-shaped tiny target (`eagle3_checkpoints`).

- Tier 1, the forward: our draft logits equal a small reference forward written here from the sources
  (SpecForge's `LlamaForCausalLMEagle3` and its TTT loop, speculators' `Eagle3FirstLayerMixin` and `Eagle3DraftModel`,
  vLLM's `Eagle3LlamaForCausalLM.compute_logits`, llama.cpp's `eagle3.cpp`), float32, 1e-4: the catch-up rows and
  two draft steps fed back, through the cache.
- Loading: a missing or misshapen tensor, layers the target lacks, a head for another vocabulary: each a
  SpecdraftError that says what to fix.
- Tier 3: greedy `spec` equals `ar` with the eagle3 drafter, chains and trees, single and batched.
- Tier 2: sampled output (chain and tree) follows the target exactly by a chi-square test, 1,500 draws over 64 cells
  (catches every bias of total variation >= 0.105 with probability 0.9 at alpha 1e-3: `detectable_bias`), with a
  planted-bias control that the same test must reject: q rows left in draft-id order (d2t not applied to q).
"""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from conftest import (PROMPTS, assert_batch_answers_as_alone, assert_cli_spec_equals_ar_and_check_passes,
                      assert_greedy_spec_equals_ar, assert_planted_bias_caught, assert_sampled_output_follows,
                      sharpened, small_sampling_target)
from eagle3_checkpoints import draft_vocabulary, random_head, save_folder, save_gguf
from specdraft import SamplingParams, SpeculativeDecoder
from specdraft.drafters import Draft, Eagle3Drafter, make_drafter
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.models.eagle3_loading import build_eagle3, from_published, load_eagle3

V = 96
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


@pytest.fixture(scope="module")
def targets() -> dict:
    """Tiny random targets of the two shapes (transformers' init): Llama 3.x (llama3 rope scaling, GQA) and Qwen3
    (q/k norms, head_dim set apart from the width)."""
    torch.manual_seed(31)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                         num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                                         rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072,
                                         tie_word_embeddings=False))
    torch.manual_seed(32)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=4096, tie_word_embeddings=False))
    return {"llama": sharpened(llama), "qwen3": sharpened(qwen3)}


# Each case: the target, and the head (format, shape and options) built for it.
HEADS = {
    # SpecForge, Llama 3.x: a head wider than the target (target_hidden_size), its own embeddings, llama3 rope, the
    # default layers (2, L/2, L-3) (no ids in its config)
    "specforge-llama": ("llama", dict(fmt="specforge", hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96,
                                      draft_ids=draft_vocabulary(V, 40, 1), rope_theta=500000.0,
                                      rope_scaling=LLAMA3_ROPE, seed=1)),
    # SpecForge's Eagle 3.1 options: per-layer fc norms, SGLang layer ids (eagle_config), lm_head without the norm
    "specforge-llama-fc-norm": ("llama", dict(fmt="specforge", hidden=32, heads=4, kv_heads=4, head_dim=8,
                                              intermediate=64, draft_ids=draft_vocabulary(V, 48, 2),
                                              aux_layers=(1, 3, 7), fc_norm=True, norm_output=False,
                                              own_embeddings=False, seed=2)),
    # speculators, Qwen3 layer (q/k norms): the target's embeddings, explicit ids, a shuffled draft vocabulary,
    # norm_before_residual and norm_output (normed states fed back)
    "speculators-qwen3": ("qwen3", dict(fmt="speculators", hidden=32, heads=4, kv_heads=2, head_dim=16,
                                        intermediate=64, draft_ids=draft_vocabulary(V, 40, 3, shuffled=True),
                                        aux_layers=(1, 4, 6), layer_type="qwen3", rope_theta=1000000.0,
                                        norm_before_residual=True, norm_output=True, own_embeddings=False, seed=3)),
    # speculators, Llama layer, gpt-oss style norm over the fused features, the whole vocabulary (no d2t)
    "speculators-llama-norm-before-fc": ("llama", dict(fmt="speculators", hidden=32, heads=2, kv_heads=1,
                                                       head_dim=16, intermediate=64, draft_ids=list(range(V)),
                                                       aux_layers=(2, 4, 5), norm_before_fc=True,
                                                       rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, seed=4)),
}


def make_head(name: str, targets: dict):
    target_name, options = HEADS[name]
    return targets[target_name], random_head(targets[target_name].config, **options)


# ----- the reference forward, from the sources --------------------------------------------------------------------
def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as every source computes it (float32 variance, weight after)."""
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_inv_freq(layer: dict) -> torch.Tensor:
    """The rotary frequencies `[d/2]`: theta^(-2i/d), scaled as SpecForge's LlamaRotaryEmbedding does for llama3."""
    d, parameters = layer["head_dim"], layer.get("rope_parameters") or {}  # transformers 5 saves rope_parameters
    theta = layer.get("rope_theta") or parameters.get("rope_theta", 10000.0)
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    scaling = layer.get("rope_scaling") or parameters
    if scaling and scaling.get("rope_type") == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wave = 2 * torch.pi / inv
        smooth = (old / wave - low) / (high - low)
        inv = torch.where(wave < old / high, inv,
                          torch.where(wave > old / low, inv / factor, (1 - smooth) * inv / factor + smooth * inv))
    return inv


class Reference:
    """One EAGLE-3 head run as the sources write it: fc over the fused features, the first (only) decoder layer over
    cat[input_layernorm(embeds), hidden_norm(hidden)], norm and lm_head, logits scattered to target ids by d2t."""

    def __init__(self, head, target_embedding: torch.Tensor) -> None:
        c, t = head.config, head.tensors
        self.fmt, self.t = head.fmt, t
        self.layer = c.get("transformer_layer_config", c)
        self.layer.setdefault("head_dim", self.layer["hidden_size"] // self.layer["num_attention_heads"])
        self.eps = self.layer.get("rms_norm_eps", 1e-6)
        self.p = "midlayer." if head.fmt == "specforge" else "layers.0."
        self.embedding = t.get("embed_tokens.weight", target_embedding)
        speculators = head.fmt == "speculators"
        self.norm_before_residual = bool(c.get("norm_before_residual", False))
        self.feed_normed = speculators and bool(c.get("norm_output", False))  # speculators: post-norm states fed back
        self.logits_normed = speculators or bool(c.get("norm_output", True))  # SpecForge: norm_output gates the norm
        self.inv_freq = reference_inv_freq(self.layer)
        self.keys, self.values = [], []  # [kv, d] per position fed

    def project(self, features: torch.Tensor) -> torch.Tensor:
        t = self.t
        if "input_norm.weight" in t:
            features = rms(features, t["input_norm.weight"], self.eps)
        if "fc_norm.0.weight" in t:
            features = torch.cat([rms(chunk, t[f"fc_norm.{i}.weight"], self.eps)
                                  for i, chunk in enumerate(features.chunk(3, dim=-1))], dim=-1)
        return features @ t["fc.weight"].T

    def _rope(self, x: torch.Tensor, position: int) -> torch.Tensor:  # x: [heads, d]
        angles = position * self.inv_freq
        cos, sin = torch.cat([angles, angles]).cos(), torch.cat([angles, angles]).sin()
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def step(self, hidden: torch.Tensor, token: int, position: int) -> torch.Tensor:
        """The layer's output for one pair (hidden [H], token) at `position`, seeing every pair fed before."""
        t, p, layer = self.t, self.p, self.layer
        heads, kv, d = layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]
        embeds = rms(self.embedding[token], t[p + "input_layernorm.weight"], self.eps)
        normed = rms(hidden, t[p + "hidden_norm.weight"], self.eps)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([embeds, normed])
        q = (t[p + "self_attn.q_proj.weight"] @ x).view(heads, d)
        k = (t[p + "self_attn.k_proj.weight"] @ x).view(kv, d)
        v = (t[p + "self_attn.v_proj.weight"] @ x).view(kv, d)
        if p + "self_attn.q_norm.weight" in t:  # a Qwen3 layer
            q = rms(q, t[p + "self_attn.q_norm.weight"], self.eps)
            k = rms(k, t[p + "self_attn.k_norm.weight"], self.eps)
        self.keys.append(self._rope(k, position))
        self.values.append(v)
        keys, values = torch.stack(self.keys, 1), torch.stack(self.values, 1)  # [kv, n, d]
        group = heads // kv
        scores = torch.einsum("hd,hnd->hn", self._rope(q, position), keys.repeat_interleave(group, 0)) / d ** 0.5
        attended = torch.einsum("hn,hnd->hd", scores.softmax(-1), values.repeat_interleave(group, 0))
        r = residual + t[p + "self_attn.o_proj.weight"] @ attended.reshape(-1)
        m = rms(r, t[p + "post_attention_layernorm.weight"], self.eps)
        gate, up = t[p + "mlp.gate_proj.weight"] @ m, t[p + "mlp.up_proj.weight"] @ m
        return r + t[p + "mlp.down_proj.weight"] @ (torch.nn.functional.silu(gate) * up)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Target-vocabulary logits `[V]` of an output: lm_head over the draft vocabulary, placed at j + d2t[j]."""
        h = rms(out, self.t["norm.weight"], self.eps) if self.logits_normed else out
        scores = self.t["lm_head.weight"] @ h
        ids = torch.arange(scores.shape[0]) + self.t.get("d2t", torch.zeros(scores.shape[0], dtype=torch.long))
        full = torch.full((self.layer["vocab_size"],), float("-inf"))
        full[ids] = scores
        return full

    def fed_back(self, out: torch.Tensor) -> torch.Tensor:
        return rms(out, self.t["norm.weight"], self.eps) if self.feed_normed else out


def assert_same_logits(ours: torch.Tensor, reference: torch.Tensor) -> None:
    """Equal support (the draft vocabulary's target ids, -inf elsewhere) and values within 1e-4."""
    assert torch.equal(torch.isfinite(ours), torch.isfinite(reference))
    finite = torch.isfinite(reference)
    torch.testing.assert_close(ours[finite], reference[finite], rtol=1e-4, atol=1e-4)


def target_features(target_model, tokens: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """The states entering `layers` at every position of `tokens` `[T, 3 * H]`, from transformers directly."""
    with torch.no_grad():
        states = target_model(tokens.unsqueeze(0), output_hidden_states=True).hidden_states
    return torch.cat([states[i][0] for i in layers], dim=-1)


@pytest.mark.parametrize("name", [*HEADS, "specforge-llama-gguf"])
def test_draft_logits_equal_the_reference_forward(targets, tmp_path, name):
    """Catch-up rows fed in two passes through the cache, then two draft steps fed back: every row's logits as the
    reference computes them. The GGUF case reads the converter's file of the SpecForge head."""
    target_model, head = make_head(name.removesuffix("-gguf"), targets)
    path = (save_gguf(head, tmp_path / "head.gguf", target_model.config) if name.endswith("gguf")
            else save_folder(head, tmp_path / "head"))
    model = load_eagle3(path, dtype=torch.float32)
    assert model.config.source == ("gguf" if name.endswith("gguf") else head.fmt)
    assert model.config.resolved_aux_layers(target_model.config.num_hidden_layers) == head.aux_layers
    generator = torch.Generator().manual_seed(7)
    sequence = torch.randint(0, V, (12,), generator=generator)  # the pairs (f_t, x_{t+1}), t < 9; drafts after
    features = target_features(target_model, sequence[:9], head.aux_layers)  # [9, 3H]
    embedding = target_model.get_input_embeddings()
    reference = Reference(head, embedding.weight.detach())
    g = reference.project(features)
    reference_outs = [reference.step(g[i], int(sequence[i + 1]), i) for i in range(9)]
    with torch.no_grad():
        model.reset_cache()
        projected = model.project(features)
        torch.testing.assert_close(projected, g, rtol=1e-4, atol=1e-4)
        outs = [model(projected[a:b], model.embed(sequence[a + 1:b + 1], embedding), torch.arange(a, b))
                for a, b in ((0, 6), (6, 9))]
        got = model.draft_logits(torch.cat(outs))  # [9, V]
    assert_same_logits(got, torch.stack([reference.logits(out) for out in reference_outs]))
    # two draft steps: the last output fed back with the next token, at the next positions
    ours_out, reference_out = outs[-1][-1:], reference_outs[-1]
    for position in (9, 10):
        token = sequence[position + 1:position + 2]
        with torch.no_grad():
            ours_out = model(model.fed_back(ours_out), model.embed(token, embedding), torch.tensor([position]))
        reference_out = reference.step(reference.fed_back(reference_out), int(token), position)
        assert_same_logits(model.draft_logits(ours_out)[0], reference.logits(reference_out))



# ----- loading: what to fix -----------------------------------------------------------------------------------------
def test_broken_checkpoints_say_what_to_fix(targets, tmp_path):
    target_model, head = make_head("specforge-llama", targets)
    target = CausalLM(target_model, name="tiny-llama")
    missing = save_folder(head, tmp_path / "missing")
    del head.tensors["midlayer.hidden_norm.weight"]
    save_folder(head, missing)
    with pytest.raises(SpecdraftError, match="missing tensors hidden_norm.weight"):
        load_eagle3(missing)
    _, head = make_head("specforge-llama", targets)
    head.config["intermediate_size"] = 80  # the weights say 96
    with pytest.raises(SpecdraftError, match=r"gate_proj.weight has shape \(96, 64\).*intermediate_size"):
        load_eagle3(save_folder(head, tmp_path / "shape"))
    _, head = make_head("specforge-llama", targets)
    head.tensors["midlayer.self_attn.q_proj.bias"] = torch.zeros(64)
    with pytest.raises(SpecdraftError, match="q_proj.bias"):
        load_eagle3(save_folder(head, tmp_path / "bias"))
    _, head = make_head("specforge-llama", targets)
    head.tensors["d2t"][0] = V  # draft id 0 -> target id V: outside the vocabulary
    with pytest.raises(SpecdraftError, match="outside the target's vocabulary"):
        load_eagle3(save_folder(head, tmp_path / "d2t"))
    _, head = make_head("specforge-llama", targets)
    head.config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 4, 8]}  # 8 + 1: past the 8 layers
    model = load_eagle3(save_folder(head, tmp_path / "layers"), dtype=torch.float32)
    with pytest.raises(SpecdraftError, match="eagle_aux_hidden_state_layer_ids"):
        Eagle3Drafter(target, model)
    with pytest.raises(SpecdraftError, match="pass --trained PATH"):
        make_drafter("eagle3", target_model=target)
    with pytest.raises(SpecdraftError, match="no config.json"):
        load_eagle3(tmp_path)
    other_vocab = LlamaForCausalLM(LlamaConfig(vocab_size=V + 8, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(SpecdraftError, match="vocabulary of 96"):
        Eagle3Drafter(CausalLM(other_vocab.float().eval()), model)


def test_target_passes_return_the_layers_a_live_eagle3_drafter_reads(targets, tmp_path):
    """While an eagle3 drafter lives, every CausalLM over the target's weights returns the states entering its
    layers side by side (transformers' hidden_states[i]); once it is gone, the final states again."""
    target_model, head = make_head("speculators-qwen3", targets)
    target = CausalLM(target_model)
    tokens = torch.tensor([[3, 14, 15, 92, 65, 35]])
    final = target.prefill(tokens, hidden=True)  # [6, H]
    drafter = make_drafter("eagle3", {"trained": str(save_folder(head, tmp_path / "h"))}, target_model=target)
    other = CausalLM(target_model)  # a batch's prompt reader: another CausalLM over the same weights
    assert other.feature_layers == head.aux_layers == (1, 4, 6)
    torch.testing.assert_close(other.prefill(tokens, hidden=True), target_features(target_model, tokens[0], (1, 4, 6)))
    assert other.prefill(tokens[:, :0], hidden=True).shape == (0, 3 * 32)
    other.reset()
    out = other.forward(tokens, logits_to_keep=1, hidden_to_keep=2)
    assert out.hidden_states.shape == (1, 2, 3 * 32)
    del drafter
    gc.collect()
    assert other.feature_layers is None
    target.reset()
    torch.testing.assert_close(target.prefill(tokens, hidden=True), final)


def test_feature_drafters_of_two_kinds_take_turns_on_one_target(targets, tmp_path):
    """eagle3 (three layers' states) and eagle (the final ones) on one target, one request after another (the methods
    of one bench run): each request's prompt pass is asked for its drafter's states, so each stays `ar`'s output.
    Drafting with both at once is refused: an `eagle` request handed three layers' states says so."""
    from registered_drafters import random_eagle

    target_model, head = make_head("speculators-qwen3", targets)
    target = CausalLM(target_model)
    eagle3 = make_drafter("eagle3", {"trained": str(save_folder(head, tmp_path / "h"))}, target_model=target)
    eagle = random_eagle(target)
    expected = SpeculativeDecoder(target).generate(PROMPTS[0], max_new_tokens=8).token_ids
    for drafter in (eagle3, eagle, eagle3, eagle):
        assert SpeculativeDecoder(target, drafter, k=2).generate(PROMPTS[0], max_new_tokens=8).token_ids == expected
    answer = SpeculativeDecoder(target, eagle, k=2).stream(PROMPTS[0], max_new_tokens=8)
    next(answer)  # the eagle request is under way
    eagle3.claim_features()  # an eagle3 request starts beside it
    with pytest.raises(SpecdraftError, match="another drafter on the same target"):
        list(answer)


def test_batches_of_two_feature_drafter_kinds_take_turns_on_one_target(targets, tmp_path):
    """Batches of eagle3, eagle and eagle3 requests again (one a one-token prompt, whose first pass is a step's), on
    one target, every drafter made beforehand: each request joining asks the passes for its drafter's states, so
    each answers as `ar`."""
    from registered_drafters import random_eagle
    from specdraft.batch_engine import BatchedDecoder, BatchRequest

    target_model, head = make_head("speculators-qwen3", targets)
    folder = str(save_folder(head, tmp_path / "h"))
    prompts = [PROMPTS[0], [5]]
    expected = [SpeculativeDecoder(CausalLM(target_model)).generate(p, max_new_tokens=8).token_ids for p in prompts]
    batch = BatchedDecoder(CausalLM(target_model), max_batch=2)
    eagle3 = [make_drafter("eagle3", {"trained": folder}, target_model=batch.target) for _ in prompts]
    eagle = [random_eagle(batch.target) for _ in prompts]  # made last: theirs is the live claim before any request
    for drafters in (eagle3, eagle, eagle3):
        batch.make_drafter = iter(drafters).__next__
        completions = batch.generate_all([BatchRequest(p, SamplingParams(temperature=0.0), 8) for p in prompts])
        assert [c.token_ids for c in completions] == expected


# ----- tier 3: greedy spec == ar ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["specforge-llama", "speculators-qwen3", "specforge-llama-gguf"])
@pytest.mark.parametrize("tree", [0, 6])
def test_greedy_spec_equals_ar(targets, tmp_path, name, tree):
    """Chains (k=4, no cut and the default cut) and dynamic trees (6 nodes, 3 children) on each target shape."""
    target_model, head = make_head(name.removesuffix("-gguf"), targets)
    path = (save_gguf(head, tmp_path / "head.gguf", target_model.config) if name.endswith("gguf")
            else save_folder(head, tmp_path / "head"))
    assert_greedy_spec_equals_ar(CausalLM(target_model), "eagle3", {"trained": str(path)}, tree, name)


def test_greedy_spec_equals_ar_on_a_packed_gguf_target(tmp_path, monkeypatch):
    """A Q4_K_M GGUF target on the CPU kernels, whose few-token passes run fused in one C call: with an eagle3 drafter
    its verification passes stay fused and hand over the three layers the C stack copies out on its way, and the
    output is still `ar`'s."""
    from specdraft.bench.random_gguf import default_tokenizer, tiny_config as family_config, write_random_gguf
    from specdraft.models.fused_decoder import FusedDecoder, fused_decoder
    from specdraft.models.loading import load_model

    if default_tokenizer() is None:
        pytest.skip("no bundled GGUF here to take a tokenizer from")
    gguf = write_random_gguf(family_config("qwen3", num_hidden_layers=4), tmp_path / "t.gguf", "Q4_K_M",
                             tokenizer=default_tokenizer(), seed=3)
    target = load_model(str(gguf), dtype="bfloat16", verbose=False)
    head = random_head(target.config, "speculators", hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512,
                       draft_ids=draft_vocabulary(target.config.vocab_size, 256, 1), aux_layers=(1, 2, 3),
                       layer_type="qwen3", seed=2)
    folder = str(save_folder(head, tmp_path / "head"))
    expected = [SpeculativeDecoder(target).generate(p, max_new_tokens=16).token_ids for p in PROMPTS[::2]]
    if fused_decoder(target.model) is None:
        pytest.skip("the fused decoder does not run here")
    asked = []  # the feature layers of each fused pass
    run = FusedDecoder.run
    monkeypatch.setattr(FusedDecoder, "run", lambda self, *args: asked.append(args[-1]) or run(self, *args))
    for tree in (0, 6):
        drafter = make_drafter("eagle3", {"trained": folder, "draft-confidence": 0.0}, target_model=target)
        spec = SpeculativeDecoder(target, drafter, k=3, tree_budget=tree, tree_branch=3)
        outs = [spec.generate(p, max_new_tokens=16) for p in PROMPTS[::2]]
        assert [out.token_ids for out in outs] == expected, tree
        assert sum(out.stats.drafted for out in outs) > 0
    assert asked.count((1, 2, 3)) >= sum(len(p) > 1 for p in PROMPTS[::2]) * 2  # verifications ran fused


@pytest.mark.parametrize("tree", [0, 5])
def test_a_batch_answers_as_alone(targets, tmp_path, tree):
    """BatchedDecoder, three slots for four requests, one set of weights shared by every sequence's drafter (as a
    server builds them: `shared`): each greedy answer is its answer alone."""
    target_model, head = make_head("speculators-qwen3", targets)
    path = str(save_folder(head, tmp_path / "head"))
    assert_batch_answers_as_alone(target_model, "eagle3", path, tree)


# ----- tier 2: sampled output follows the target ---------------------------------------------------------------------
DRAFT_IDS = [6, 0, 3, 7, 1, 4]  # 6 of the 8 tokens (2 and 5 only through the residual), in a shuffled draft order


@pytest.fixture(scope="module")
def small_target() -> Qwen2ForCausalLM:
    return small_sampling_target()


def small_drafter(target_model, cls=Eagle3Drafter) -> Eagle3Drafter:
    """A random speculators head (sharp draft distributions) for the 8-token target, drafting with its own q."""
    head = random_head(target_model.config, "speculators", hidden=32, heads=2, kv_heads=1, head_dim=16,
                       intermediate=64, draft_ids=DRAFT_IDS, aux_layers=(0, 1, 1), head_scale=12.0, seed=9)
    config, tensors = from_published(head.config, head.tensors)
    target = CausalLM(target_model)
    return cls(target, build_eagle3(config, tensors, "test", torch.float32)), target


class UnmappedQ(Eagle3Drafter):
    """Planted bias: the tokens are drawn right, but the q rows handed to the verifier stay in draft-id order
    (column j holds draft id j's probability, d2t not applied): the bug of scattering the draw but not its q."""

    def propose(self, ctx, k):
        draft = super().propose(ctx, k)
        if draft.q_draft is None:
            return draft
        order = torch.tensor(DRAFT_IDS)
        wrong = torch.zeros_like(draft.q_draft)
        wrong[:, :len(DRAFT_IDS)] = draft.q_draft[:, order]
        return Draft.chain(draft.tokens, wrong)


@pytest.mark.parametrize("tree", [0, pytest.param(6, marks=pytest.mark.slow)])  # 30 s each on 2 cores
def test_sampled_output_follows_the_target(small_target, tree):
    """Chains (k=3) and sampled trees (6 nodes, 3 children: the drawn chain, point-mass siblings)."""
    drafter, target = small_drafter(small_target)
    decoder = SpeculativeDecoder(target, drafter, k=3, tree_budget=tree, tree_branch=3)
    assert_sampled_output_follows(small_target, decoder)


def test_q_left_in_draft_order_is_caught(small_target):
    """The control: the same test rejects the drafter whose q rows miss the d2t map."""
    drafter, target = small_drafter(small_target, UnmappedQ)
    assert_planted_bias_caught(small_target, SpeculativeDecoder(target, drafter, k=3), "q in draft-id order")


# ----- the command line and llama.cpp's own converter ---------------------------------------------------------------
def test_generate_and_check_take_a_checkpoint_folder(tiny_model_dirs, tmp_path):
    """`--drafter eagle3 --trained FOLDER` on the command line: `generate` equals `ar` greedily, and `specdraft check`
    passes (greedy identity and the sampled test it sizes itself)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dirs["target"])
    head = random_head(config, "specforge", hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64,
                       draft_ids=draft_vocabulary(config.vocab_size, 256, 5), aux_layers=(0, 1, 1), seed=5)
    folder = save_folder(head, tmp_path / "head")
    assert_cli_spec_equals_ar_and_check_passes(tiny_model_dirs["target"], ["--drafter", "eagle3", "--trained", folder])


CONVERT = """
import sys
source, head, target, out = sys.argv[1:5]
sys.path[:0] = [source + "/gguf-py", source]  # the converter with its own gguf-py (it knows EAGLE3)
import conversion.llama
conversion.llama.LlamaModel.set_vocab = lambda self: None  # the tiny target's tokenizer is none the converter knows
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", head, "--target-model-dir", target, "--outfile", out, "--outtype", "f16"]
convert_hf_to_gguf.main()
"""


@pytest.mark.slow  # a subprocess that imports the converter and torch: about 15 s
def test_llama_cpps_own_converter_makes_the_gguf_we_read(targets, tmp_path):
    """llama.cpp's `convert_hf_to_gguf.py --target-model-dir` (the llama-cpp-python 0.3.36 source) on a SpecForge
    head: the same tensor table and eagle3 keys as `eagle3_checkpoints.save_gguf`, and the same weights as the
    folder once read (the vocabulary metadata, which needs a tokenizer the converter knows, is left out)."""
    import subprocess
    import sys

    from specdraft.bench.llama_cpp_build import llama_cpp_dir
    from specdraft.models.gguf_header import read_header

    source = llama_cpp_dir() / "source"
    if not (source / "convert_hf_to_gguf.py").is_file():
        pytest.skip("no llama.cpp source here (`make peers` extracts it from llama-cpp-python's sdist)")
    target_model, head = make_head("specforge-llama", targets)
    target_model.save_pretrained(tmp_path / "target")
    folder = save_folder(head, tmp_path / "head")
    done = subprocess.run([sys.executable, "-c", CONVERT, str(source), str(folder), str(tmp_path / "target"),
                           str(tmp_path / "real.gguf")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ours = save_gguf(head, tmp_path / "ours.gguf", target_model.config)
    real_header, our_header = read_header(tmp_path / "real.gguf"), read_header(ours)
    assert ({e.name: (e.type_name, e.shape) for e in real_header.tensors}
            == {e.name: (e.type_name, e.shape) for e in our_header.tensors})
    keys = {k for k in real_header.fields if k.startswith("eagle3.")}
    assert keys == {k for k in our_header.fields if k.startswith("eagle3.")}
    assert all(str(real_header.get(k)) == str(our_header.get(k)) for k in keys)
    real, expected = load_eagle3(tmp_path / "real.gguf", torch.float32), load_eagle3(folder, torch.float32)
    assert all(torch.equal(value, expected.state_dict()[name]) for name, value in real.state_dict().items())
