"""A packed GGUF model whose layers all stack runs in our own class (`packed_model`), without transformers' model
code, and computes what transformers' class of its family computes with the same stacked parts, bit for bit: prompt
passes, passes over a cache, tree passes, hidden states, sliding windows (Gemma), on the PyTorch path and fused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specdraft.bench.random_gguf import default_tokenizer, file_reference, tiny_config, write_random_gguf
from specdraft.kernels import gguf_matmul
from specdraft.models.attention import use_grouped_sdpa
from specdraft.models.causal_lm import CausalLM
from specdraft.models.gguf_native import build_native_model
from specdraft.models.packed_model import PackedForCausalLM
from specdraft.models.quantize import int4_kernel_available

pytestmark = pytest.mark.skipif(not (int4_kernel_available() and gguf_matmul.available()),
                                reason="the packed layers stack where the tile kernels run")

FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "gemma3", "gemma2")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """`get(family)`: (our own model, transformers' class with the same stacked layers) of one tiny Q4_K_M file."""
    root, made = tmp_path_factory.mktemp("own"), {}

    def get(family: str):
        if family not in made:
            path = write_random_gguf(tiny_config(family), root / f"{family}.gguf", "Q4_K_M", seed=3)
            config = file_reference(path).config
            own = build_native_model(path, config, torch.bfloat16)
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr("specdraft.models.gguf_native.stack_layers", lambda *args: False)
                theirs = build_native_model(path, config, torch.bfloat16)
            use_grouped_sdpa(theirs)  # the attention our own model runs (as `CausalLM` switches a model to it)
            made[family] = own, theirs
        return made[family]
    return get


def passes(lm: CausalLM, tokens: torch.Tensor, hidden: bool) -> list[torch.Tensor]:
    """Logits (and final hidden states) of a prompt pass, a chain over the cache, a one-token pass and a tree pass."""
    outputs = []
    lm.reset()
    out = lm.forward(tokens[:, :20], logits_to_keep=20, hidden_to_keep=20 if hidden else 0)  # prompt pass
    outputs += [out.logits, out.hidden_states]
    out = lm.forward(tokens[:, 20:24], logits_to_keep=4)  # a chain over the cache
    outputs.append(out.logits)
    outputs.append(lm.forward(tokens[:, 24:25]).logits)  # one token
    visible = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children
    out = lm.forward(tokens[:, 25:28], logits_to_keep=3, offsets=torch.tensor([0, 1, 1]), visible=visible)
    outputs.append(out.logits)
    lm.truncate(25)
    reader = _Reader()  # a drafter reading the states entering layers 0 and 1 (EAGLE-3's)
    lm.read_features_at(reader, (0, 1))
    out = lm.forward(tokens[:, 25:28], logits_to_keep=3, hidden_to_keep=3)
    outputs += [out.logits, out.hidden_states]
    return [o for o in outputs if o is not None]


class _Reader:
    """Stands for a drafter that claims a model's feature layers (held weakly by the model)."""


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_own_model_computes_transformers_bits(pair, family, fused, monkeypatch):
    own, theirs = pair(family)
    assert isinstance(own, PackedForCausalLM) and not isinstance(theirs, PackedForCausalLM)
    if not fused:
        monkeypatch.setattr("specdraft.models.causal_lm.fused_decoder", lambda model: None)
    tokens = torch.randint(0, 512, (1, 28), generator=torch.Generator().manual_seed(0))
    if family.startswith("gemma"):  # the tiny Gemmas' sliding window (8) is shorter than the sequence: trees refused
        tokens = tokens[:, :25]
    mine, want = CausalLM(own), CausalLM(theirs)
    with torch.inference_mode():
        got_all = passes(mine, tokens, hidden=True) if tokens.shape[1] == 28 else _chain(mine, tokens)
        want_all = passes(want, tokens, hidden=True) if tokens.shape[1] == 28 else _chain(want, tokens)
    assert len(got_all) == len(want_all)
    for got, expected in zip(got_all, want_all):
        assert torch.equal(got, expected)


def _chain(lm: CausalLM, tokens: torch.Tensor) -> list[torch.Tensor]:
    """A prompt pass past the window, then passes over the cache (a sliding window's mask at work)."""
    lm.reset()
    out = lm.forward(tokens[:, :12], logits_to_keep=12, hidden_to_keep=12)
    outputs = [out.logits, out.hidden_states, lm.forward(tokens[:, 12:16], logits_to_keep=4).logits]
    outputs += [lm.forward(tokens[:, i:i + 1]).logits for i in range(16, 25)]
    return outputs


def test_every_hidden_state_as_transformers_returns_them(pair):
    """`output_hidden_states`: each layer's input, then the final normed states, as transformers' classes return."""
    own, theirs = pair("qwen3")
    ids = torch.randint(0, 512, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got = own(input_ids=ids, use_cache=False, output_hidden_states=True, logits_to_keep=0)
        want = theirs(input_ids=ids, use_cache=False, output_hidden_states=True, logits_to_keep=0)
    assert len(got.hidden_states) == len(want.hidden_states) == own.config.num_hidden_layers + 1
    for a, b in zip(got.hidden_states, want.hidden_states):
        assert torch.equal(a, b)
    assert torch.equal(got.logits, want.logits)


def test_a_pass_refuses_what_it_does_not_take(pair):
    own, _ = pair("llama")
    ids = torch.zeros((1, 3), dtype=torch.long)
    with pytest.raises(TypeError, match="inputs_embeds"):
        own(input_ids=ids, inputs_embeds=torch.zeros(1, 3, 8))
    with pytest.raises(ValueError, match="additive mask"):
        own(input_ids=ids, attention_mask=torch.ones((1, 3), dtype=torch.long))


def test_loading_a_kept_model_imports_no_transformers_model_code(tmp_path, monkeypatch):
    """A later load of a packed GGUF file in a fresh process runs without `transformers.modeling_utils` (whose import
    took most of a later load) and says it runs in our own model."""
    from specdraft.models.loading import load_model

    tokenizer = default_tokenizer()
    if tokenizer is None:
        pytest.skip("the bundled Qwen2.5-Coder GGUF (whose tokenizer the file takes) is not in the cache folder")
    path = write_random_gguf(tiny_config("llama"), tmp_path / "llama.gguf", "Q4_K_M", tokenizer, seed=4)
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    for _ in range(2):  # packs and keeps the model, its config and tokenizer; then pickles the tokenizer
        assert isinstance(load_model(str(path), verbose=False).model, PackedForCausalLM)
    script = ("import sys\nfrom specdraft.models.loading import load_model\n"
              f"lm = load_model({str(path)!r})\n"
              "print(type(lm.model).__name__, 'transformers.modeling_utils' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["PackedForCausalLM", "False"], done.stdout


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_transformers_view_generates_our_tokens(pair, family):
    """transformers' `generate` (the `hf-*` peers) runs our model's parts in the family's class: the same greedy
    tokens as our plain decoding, no tensor copied."""
    from specdraft.models.gguf_native import transformers_view
    from specdraft.models.kv_cache import growing_cache

    own, _ = pair(family)
    view = transformers_view(own)
    assert transformers_view(own) is view and view.lm_head is own.lm_head
    assert view.model.layers[0].self_attn is own.model.layers[0].self_attn
    prompt, want = [5, 9, 200, 31, 7], []
    with torch.inference_mode():
        cache, ids = growing_cache(own.config), torch.tensor([prompt])  # greedy as generate runs: bf16 passes
        for _ in range(12):
            ids = own(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            want.append(int(ids))
        out = view.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 5, dtype=torch.long), do_sample=False,
                            max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    assert out[0, 5:].tolist() == want


def test_a_kept_tokenizer_is_the_built_one_and_a_broken_one_is_built_again(tmp_path, capsys):
    """`_kept_tokenizer` pickles what it builds from the kept folder; the next load reads that pickle back (the same
    encodings, vocabulary and chat template, without the Python copies of vocabulary and merges transformers keeps
    after building: `lean_tokenizer`), and a pickle cut short costs a build, not the load; an older pickle goes."""
    from transformers.configuration_utils import PretrainedConfig

    from specdraft.models.loading import _kept_tokenizer, load_tokenizer

    tokenizer = default_tokenizer()
    if tokenizer is None:
        pytest.skip("the bundled Qwen2.5-Coder GGUF (whose tokenizer is kept here) is not in the cache folder")
    built = load_tokenizer(str(tokenizer))  # kept in the cache folder by the bundled model's loads
    built.save_pretrained(str(tmp_path))
    config = PretrainedConfig(model_type="qwen2")
    (tmp_path / "tokenizer-0.0.pickle").write_bytes(b"older")
    first = _kept_tokenizer(tmp_path, config)
    kept = list(tmp_path.glob("tokenizer-*.pickle"))
    assert len(kept) == 1 and kept[0].name != "tokenizer-0.0.pickle"
    again = _kept_tokenizer(tmp_path, config)
    text = "def f(x):\n    return x ** 2  # ünïcödé 你好"
    messages = [{"role": "user", "content": "hi"}]
    for got in (first, again):
        assert not {"_vocab", "_merges"} & set(vars(got))
        assert got.encode(text) == built.encode(text) and got.get_vocab() == built.get_vocab()
        assert got.apply_chat_template(messages, tokenize=False) == built.apply_chat_template(messages, tokenize=False)
    kept[0].write_bytes(kept[0].read_bytes()[:100])  # cut short
    rebuilt = _kept_tokenizer(tmp_path, config)
    assert rebuilt.encode(text) == built.encode(text)
    assert "could not read the kept tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("recovered", [True, False])
def test_rope_freqs_rotate_as_in_transformers_class(tmp_path, recovered):
    """A file with `rope_freqs`: Llama 3's own factors (the config's `llama3` rotary then has them: not applied again)
    or factors of no published scaling (applied to the default rotary): our model rotates as transformers' class
    built from the same file does, bit for bit."""
    from specdraft.bench import random_gguf
    from specdraft.models.gguf_config import gguf_config

    rope = dict(random_gguf.LLAMA_32_ROPE) if recovered else {**random_gguf.LLAMA_32_ROPE,
                                                               "original_max_position_embeddings": 64}
    path = write_random_gguf(tiny_config("llama", rope_parameters=rope), tmp_path / "rope.gguf", "Q4_K_M", seed=5)
    config = gguf_config(path)
    assert (config.rope_parameters.get("rope_type") == "llama3") == recovered
    own = build_native_model(path, config, torch.bfloat16)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("specdraft.models.gguf_native.stack_layers", lambda *args: False)
        theirs = build_native_model(path, config, torch.bfloat16)
    use_grouped_sdpa(theirs)
    assert isinstance(own, PackedForCausalLM)
    assert torch.equal(own.model.rotary_emb.inv_freq, theirs.model.rotary_emb.inv_freq)
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert torch.equal(own(input_ids=ids, use_cache=False).logits, theirs(input_ids=ids, use_cache=False).logits)


def _resident_bytes(name_part: str) -> int:
    """Resident bytes of this process's mappings of files whose path holds `name_part` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            inside = len(fields) == 6 and name_part in fields[5]
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")
def test_a_requantized_draft_gives_back_the_mapped_pages_it_replaced(tmp_path, monkeypatch):
    """A draft loaded from its kept file (mapped) and re-quantized to int4 by `prepare_draft` gives back the file pages
    of the bf16 linears it replaced: they stayed resident beside the int4 copies (the bundled pair's CLI run peaked at
    2.73 GB, its test's bound 2.5)."""
    from specdraft.models import heap
    from specdraft.models.loading import load_model, prepare_draft

    tokenizer = default_tokenizer()
    if tokenizer is None or not heap.drops_file_pages():
        pytest.skip("needs the bundled tokenizer and Linux's page dropping")
    config = tiny_config("llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=4)
    path = write_random_gguf(config, tmp_path / "draft.gguf", "F16", tokenizer, seed=6)
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    load_model(str(path), verbose=False, requantized=True)  # packs it (plain F16 linears, for re-quantizing) and keeps it
    draft = load_model(str(path), verbose=False, requantized=True)  # mapped from the kept file
    for parameter in draft.model.parameters():  # touch every page, as re-quantizing does
        parameter.sum()
    touched = _resident_bytes("-plain-")
    assert touched > 4 * 512 * 512 * 2  # at least the layers' bf16 projections
    prepare_draft(draft, "int4", vocab=0)
    assert _resident_bytes("-plain-") < touched / 4
