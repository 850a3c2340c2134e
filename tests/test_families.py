"""Every declared family, built packed from a tiny GGUF file in each common mix, against transformers' float32
reference of the same file (its own GGUF loader: the file's values, un-permuted and un-offset by transformers'
code, not ours), and greedy speculative decoding equal to plain decoding on each."""

from __future__ import annotations

import pytest
import torch

from specdraft import ModelDrafter, SpeculativeDecoder
from specdraft.bench.random_gguf import file_reference, tiny_config, write_random_gguf
from specdraft.exactness import compare_greedy
from specdraft.kernels import decoder_layers, dense_matmul, gguf_matmul, isa, numerics, q4k_tiles
from specdraft.models.causal_lm import CausalLM
from specdraft.models.context import hold_context
from specdraft.models.fast_layers import StackedAttention
from specdraft.models.fused_decoder import fused_decoder
from specdraft.models.gguf_config import LLAMA3_ROPE, gguf_config
from specdraft.models.gguf_native import FlatLinear, build_native_model, describe_packing
from specdraft.models.quantize import five_bit_tiles_run, int4_kernel_available

pytestmark = pytest.mark.skipif(not int4_kernel_available(), reason="no CPU int4 kernel in this PyTorch build")

FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "gemma3", "gemma2")
MIXES = ("Q4_K_M", "Q5_K_M", "Q8_0", "Q4_0", "F16", "BF16", "F32")
STACKED = FAMILIES  # every family runs on the stacked and fused layers (`architectures.layer_shape`)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """`get(family, mix)`: a tiny random model of the family written as llama.cpp would, and its float32 reference."""
    root, made = tmp_path_factory.mktemp("families"), {}

    def get(family: str, mix: str):
        if (family, mix) not in made:
            path = write_random_gguf(tiny_config(family), root / f"{family}-{mix}.gguf", mix, seed=1)
            made[family, mix] = path, file_reference(path)
        return made[family, mix]
    return get


def prompts(count: int = 3, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (1, n), generator=generator) for n in (1, 9, 23)[:count]]


def assert_agrees(got: torch.Tensor, want: torch.Tensor, bound: float = 0.05, tie: float = 0.1) -> int:
    """`got` within `bound` of `want` (relative norm of the difference) and its top token `want`'s wherever `want`'s
    top two are not a near-tie (apart by more than `tie` of `want`'s deviation); returns how many positions were
    decided. # [1, T, V] each"""
    assert ((got - want).norm() / want.norm()).item() < bound
    top2 = want.topk(2, dim=-1).values  # [1, T, 2]
    clear = (top2[..., 0] - top2[..., 1]) > tie * want.std()  # not a near-tie
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    return int(clear.sum())


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_family_matches_the_float32_reference(files, family, mix):
    """Every linear packed (no bf16 copy), logits within bf16 error of the reference, and the top token the
    reference's wherever the reference's top two are not a near-tie."""
    path, reference = files(family, mix)
    model = build_native_model(path, reference.config, torch.bfloat16)
    all_packed = gguf_matmul.available() and (mix not in dense_matmul.ELEMENT_BYTES or dense_matmul.available())
    if all_packed:  # else Q6_K (no tile kernel: the PyTorch level) or F16, BF16, F32 (AVX-512, AMX) are unpacked to bf16
        assert not any(isinstance(m, FlatLinear) for m in model.modules()), describe_packing(model)
    if mix == "Q5_K_M" and q4k_tiles.available():  # its Q5_K rows: as stored on the AVX2 and AVX-512 levels
        assert "Q5_K kernels" in describe_packing(model) and "5-bit" not in describe_packing(model), describe_packing(model)
    elif mix == "Q5_K_M" and int4_kernel_available():  # else 5-bit tiles where the kernel has them, else halves
        five_bit = five_bit_tiles_run(reference.config.hidden_size, reference.config.hidden_size)
        assert ("5-bit kernels" in describe_packing(model)) == five_bit, describe_packing(model)
        assert ("split in two halves" in describe_packing(model)) != five_bit, describe_packing(model)
    if family in STACKED and all_packed:  # layers whose linears are unpacked do not stack
        assert all(isinstance(layer.self_attn, StackedAttention) for layer in model.model.layers)
    with torch.inference_mode():
        decided = sum(assert_agrees(model(ids).logits.float(), reference(ids).logits) for ids in prompts())  # [1, T, V]
    assert decided >= 15  # of 33 positions


@pytest.mark.parametrize("mix", ["Q4_K_M", "F16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculation_equals_plain_decoding(files, family, mix):
    """The packed target (on the fused layer stack where its family runs there) decodes the same tokens greedily
    with a draft of its own family as without one."""
    if mix in dense_matmul.ELEMENT_BYTES and not dense_matmul.available():
        pytest.skip("F16 runs on PyTorch's bf16 linears here, whose roundings depend on the pass width")
    path, reference = files(family, mix)
    target = CausalLM(build_native_model(path, reference.config, torch.bfloat16))
    if decoder_layers.available():
        assert (fused_decoder(target.model) is not None) == (family in STACKED)
    plain = SpeculativeDecoder(target)
    spec = SpeculativeDecoder(target, ModelDrafter(CausalLM(reference), min_confidence=0.0), k=3)
    accepted = 0
    for prompt in ([3, 17, 100, 5], [42] * 6, list(range(200, 230))):
        want = plain.generate(prompt, max_new_tokens=16)
        got = spec.generate(prompt, max_new_tokens=16)
        assert compare_greedy(target, prompt, want.token_ids, got.token_ids, margin=0.0).acceptable
        assert got.token_ids == want.token_ids
        accepted += got.stats.accepted
    assert accepted > 0


@pytest.fixture(scope="module")
def capped_gemma2(tmp_path_factory):
    """A tiny Gemma 2 file whose soft-caps bite (scores capped at 1, logits at 12), its float32 reference, and that
    reference's logits of 23 tokens as written, without the scores' cap and without the logits' cap:
    `(path, reference, ids [1, 23], {"both": ..., "attention": ..., "final": ...})` (the caps each kept)."""
    config = tiny_config("gemma2", attn_logit_softcapping=1.0, final_logit_softcapping=12.0)
    path = write_random_gguf(config, tmp_path_factory.mktemp("capped") / "gemma2.gguf", "Q4_K_M", seed=1)
    reference, ids, logits = file_reference(path), prompts()[-1], {}
    for kept, (attention, final) in {"both": (1.0, 12.0), "final": (None, 12.0), "attention": (1.0, None)}.items():
        bare = file_reference(path)
        bare.config.attn_logit_softcapping, bare.config.final_logit_softcapping = attention, final
        for layer in bare.model.layers:
            layer.self_attn.attn_logit_softcapping = attention
        with torch.inference_mode():
            logits[kept] = bare(ids).logits  # [1, 23, V]
    return path, reference, ids, logits


@pytest.mark.parametrize("level", isa.LEVELS)
def test_gemma2_soft_caps_on_each_kernel_level(capped_gemma2, level, monkeypatch):
    """Gemma 2's soft-capped attention scores and logits, on each kernel level (`SPECDRAFT_ISA`): the packed model
    (on the fused C stack where native kernels run: a prompt on the stacked layers, passes over its cache fused)
    computes the capped reference's logits, far from the same weights' without either cap; greedy `spec` == `ar`."""
    if not isa.CPU_FLAGS[level] <= isa.cpu_flags():
        pytest.skip(f"this CPU has no {level}")
    monkeypatch.setenv(numerics.ISA_VARIABLE, level)
    path, reference, ids, logits = capped_gemma2
    capped = logits["both"]
    assert (logits["final"].argmax(-1) != capped.argmax(-1)).any()  # the scores' cap changes the choices
    target = CausalLM(build_native_model(path, reference.config, torch.bfloat16))
    assert (fused_decoder(target.model) is not None) == (level != "torch")
    with torch.inference_mode():
        got = torch.cat([target.forward(ids[:, :17], logits_to_keep=17).logits,  # [1, 23, V]
                         *(target.forward(ids[:, t:t + 3], logits_to_keep=3).logits for t in (17, 20))], dim=1)
    assert assert_agrees(got, capped) >= 8
    for without in ("final", "attention"):  # each cap moves the logits far past the bound
        assert ((got - logits[without]).norm() / logits[without].norm()).item() > 0.15, without
    plain = SpeculativeDecoder(target)
    spec = SpeculativeDecoder(target, ModelDrafter(CausalLM(reference), min_confidence=0.0), k=3)
    accepted = 0
    for prompt in ([3, 17, 100, 5], list(range(200, 230))):
        want = plain.generate(prompt, max_new_tokens=16)
        got_ids = spec.generate(prompt, max_new_tokens=16)
        assert got_ids.token_ids == want.token_ids
        accepted += got_ids.stats.accepted
    assert accepted > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_file_config_is_the_written_models(files, family):
    """The config read from the file (`gguf_config`: transformers' parse, completed) has the shape and attention
    of the model written, where transformers' parse alone leaves defaults (head size, Gemma's sliding layers and
    query scale)."""
    path, _ = files(family, "Q8_0")
    written, read = tiny_config(family), gguf_config(path)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "layer_types", "query_pre_attn_scalar", "sliding_window"):
        if hasattr(written, key) and (key != "sliding_window" or family.startswith("gemma")):
            assert getattr(read, key) == getattr(written, key), key


@pytest.mark.parametrize("family", FAMILIES)
def test_config_and_tokenizer_are_transformers_own(tmp_path, family):
    """Our header reader with transformers' key table gives the config transformers' own GGUF parse gives (which
    takes tens of seconds over a real vocabulary), and the tokenizer class it registers for the family encodes and
    decodes as `AutoTokenizer` does (here with the bundled Qwen vocabulary, cut to the tiny model's)."""
    from transformers import AutoConfig, AutoTokenizer

    from specdraft.bench.random_gguf import default_tokenizer
    from specdraft.models.gguf_config import complete_config
    from specdraft.models.gguf_header import read_header
    from specdraft.models.loading import _gguf_tokenizer

    if default_tokenizer() is None:
        pytest.skip("the bundled Qwen2.5-Coder GGUF is not in the cache folder")
    path = write_random_gguf(tiny_config(family), tmp_path / f"{family}.gguf", "Q8_0", default_tokenizer(), seed=1)
    ours = gguf_config(path)
    theirs = complete_config(AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name), read_header(path), path)
    assert {**ours.to_dict(), "_name_or_path": None} == {**theirs.to_dict(), "_name_or_path": None}
    tokenizer, reference = _gguf_tokenizer(path, ours), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert type(tokenizer) is type(reference)
    text = "def merge(a, b):\n    return sorted(a + b)  # ünïcode 你好"
    assert tokenizer(text).input_ids == reference(text).input_ids
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.chat_template) == (
        reference.bos_token, reference.eos_token, reference.chat_template)


def test_llama3_rotary_scaling_is_read_from_its_frequency_factors(tmp_path):
    """A Llama 3.2 file keeps its rotary scaling only as `rope_freqs`; the config read back has it as transformers'
    `llama3` scaling, and the packed model computes the reference's logits."""
    config = tiny_config("llama", rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0, "factor": 32.0})
    path = write_random_gguf(config, tmp_path / "llama3.gguf", "Q8_0", seed=2)
    read = gguf_config(path)
    assert read.rope_parameters["rope_type"] == "llama3" and read.rope_parameters["factor"] == 32.0
    model = build_native_model(path, read, torch.bfloat16)
    reference = file_reference(path)
    ids = torch.arange(40, 80).unsqueeze(0)  # [1, 40]
    with torch.inference_mode():
        got, want = model(ids).logits.float(), reference(ids).logits
    assert ((got - want).norm() / want.norm()).item() < 0.05


HALF = 64 // 2  # tiny_config's head_dim 64, whole-head rotary
LONG_FACTORS = [1.0 + 0.5 * i for i in range(HALF)]
SHORT_FACTORS = [1.0 + 0.25 * (i % 5) for i in range(HALF)]


def longrope_config():
    """A tiny Phi config with LongRoPE factors for a pretraining length of 256 and a context of 4,096."""
    return tiny_config("phi3", max_position_embeddings=4096, original_max_position_embeddings=256,
                       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": LONG_FACTORS,
                                        "short_factor": SHORT_FACTORS, "original_max_position_embeddings": 256})


@pytest.fixture(scope="module")
def longrope_file(tmp_path_factory):
    """`longrope_config` written as llama.cpp would (no tokenizer)."""
    return write_random_gguf(longrope_config(), tmp_path_factory.mktemp("longrope") / "longrope.gguf", "Q8_0", seed=3)


def test_longrope_files_run_with_their_factors(longrope_file, tmp_path):
    """A Phi file with LongRoPE factors (Phi-3.5, Phi-4-mini: tensors beside the pretraining length) is read into
    transformers' `longrope` parameters: the packed model computes the reference's logits (transformers rotating with
    the short factors and the attention factor), which differ from the same weights without the factors; the context
    is held to the pretraining length (also where held to its default at load); greedy `spec` == `ar`. Factors
    written otherwise are refused on both paths."""
    import numpy as np
    from gguf import GGUFWriter

    from specdraft import SpecdraftError
    from specdraft.models.loading import _refuse_unread_frequency_factors

    path = longrope_file
    read = gguf_config(path)
    assert read.rope_parameters["rope_type"] == "longrope" and read.max_position_embeddings == 256
    assert read.rope_parameters["short_factor"] == pytest.approx(SHORT_FACTORS)
    assert read.rope_parameters["attention_factor"] == pytest.approx((1 + np.log(16) / np.log(256)) ** 0.5)
    model = build_native_model(path, read, torch.bfloat16)
    assert "short factors" in hold_context(model, None, "phi")
    reference = file_reference(path)
    plain = file_reference(path)
    plain.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    plain.model.rotary_emb = type(plain.model.rotary_emb)(config=plain.config)
    ids = torch.arange(40, 120).unsqueeze(0)  # [1, 80]
    with torch.inference_mode():
        got, want, without = model(ids).logits.float(), reference(ids).logits, plain(ids).logits
    assert ((got - want).norm() / want.norm()).item() < 0.05
    assert ((without - want).norm() / want.norm()).item() > 0.2  # the factors matter
    target = CausalLM(model)
    assert target.max_context == 256
    spec = SpeculativeDecoder(target, ModelDrafter(CausalLM(reference), min_confidence=0.0), k=3)
    prompt = list(range(100, 130))
    want_ids = SpeculativeDecoder(target).generate(prompt, max_new_tokens=16).token_ids
    assert spec.generate(prompt, max_new_tokens=16).token_ids == want_ids

    odd = tmp_path / "odd.gguf"  # factors without the pretraining length beside them
    writer = GGUFWriter(str(odd), "phi3")
    writer.add_tensor("rope_factors_short.weight", np.ones(32, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = tiny_config("phi3")
    with pytest.raises(SpecdraftError, match="LongRoPE"):
        build_native_model(odd, config, torch.bfloat16)
    with pytest.raises(SpecdraftError, match="LongRoPE"):
        _refuse_unread_frequency_factors(odd, config)


def test_longrope_context_past_the_pretraining_length_takes_the_long_factors(longrope_file, monkeypatch):
    """A context above the pretraining length (`hold_context`, as `load_model(max_context=)` and `--context` ask for
    it) takes the long factors for every position of every pass, fixed at load, as llama.cpp does: a prompt read in
    chunks that stay under the length, and passes over its cache (fused), compute what transformers computes in one
    pass that crosses it (the long factors throughout), not the short factors' logits; greedy `spec` == `ar` across
    the old boundary; a context past the file's is refused, naming the model, unless clipped (a draft's): then it
    holds the file's."""
    from specdraft import SpecdraftError

    model = build_native_model(longrope_file, gguf_config(longrope_file), torch.bfloat16)
    with pytest.raises(SpecdraftError, match="past phi-target's longest context of 4096"):
        hold_context(model, 5000, "phi-target")
    clipped = build_native_model(longrope_file, gguf_config(longrope_file), torch.bfloat16)
    assert hold_context(clipped, 5000, "phi-draft", clip=True).startswith(
        "context 4096 (all its positions allow of --context 5000): LongRoPE long factors")
    assert clipped.config.max_position_embeddings == 4096
    assert "LongRoPE long factors at every position" in hold_context(model, 1024, "phi-target")
    target = CausalLM(model)
    assert target.max_context == 1024
    if decoder_layers.available():
        assert fused_decoder(target.model) is not None
    ids = torch.randint(0, 512, (1, 300), generator=torch.Generator().manual_seed(5))  # past the 256 positions
    reference = file_reference(longrope_file)
    # the logits on 16-bit activations: int8 ones on every pass (the AVX2 and AVX-512 default) put these 300 positions
    # 5.8% from the float32 reference where 16-bit ones put them 3.7% (measured), and the factors are what is tested
    monkeypatch.setenv(numerics.INT8_VARIABLE, "none")
    with torch.inference_mode():
        want = reference(ids).logits  # [1, 300, V]: one pass that crosses 256, so the long factors at every position
        short = reference(ids[:, :200]).logits  # [1, 200, V]: a pass under it, the short factors
        passes = [target.forward(ids[:, a:b], logits_to_keep=b - a).logits  # chunks under 256, then fused passes
                  for a, b in ((0, 128), (128, 256), (256, 294), (294, 297), (297, 298), (298, 300))]
    got = torch.cat(passes, dim=1)  # [1, 300, V]
    assert ((short - want[:, :200]).norm() / want[:, :200].norm()).item() > 0.2  # the factor sets differ
    # over 300 positions the bf16 error (about 4%) turns near-ties up to 0.14 of the deviation apart (measured), so a
    # position counts as decided from 0.2 here (0.1 over the 33 short positions above)
    assert assert_agrees(got, want, tie=0.2) >= 100
    assert ((got[:, :200] - want[:, :200]).norm() / want[:, :200].norm()).item() < 0.05  # under 256: long too
    monkeypatch.undo()  # speculation is exact on each machine's own passes

    draft = build_native_model(longrope_file, gguf_config(longrope_file), torch.bfloat16)
    hold_context(draft, 1024, "phi-draft")  # the same weights at the same positions (its whole prompt read): drafts agree
    plain = SpeculativeDecoder(target)
    spec = SpeculativeDecoder(target, ModelDrafter(CausalLM(draft), min_confidence=0.0, context=0, catch_up=0), k=3)
    prompt = ids[0, :236].tolist()
    want_ids = plain.generate(prompt, max_new_tokens=40)  # positions 236 .. 275: across 256
    got_ids = spec.generate(prompt, max_new_tokens=40)
    assert got_ids.token_ids == want_ids.token_ids and len(want_ids.token_ids) == 40
    assert got_ids.stats.accepted > 0


def test_the_loading_line_names_the_longrope_factors(tmp_path, capsys):
    """`load_model(max_context=)` holds the context and says on its loading line which factors run."""
    from specdraft.bench.random_gguf import default_tokenizer
    from specdraft.models.loading import load_model

    if default_tokenizer() is None:
        pytest.skip("the bundled Qwen2.5-Coder GGUF is not in the cache folder")
    path = write_random_gguf(longrope_config(), tmp_path / "longrope.gguf", "Q8_0", default_tokenizer(), seed=3)
    assert load_model(str(path), max_context=1024).max_context == 1024
    assert "context 1024: LongRoPE long factors at every position" in capsys.readouterr().err
    assert load_model(str(path)).max_context == 256
    assert "context 256: LongRoPE short factors" in capsys.readouterr().err


def test_the_draft_holds_the_context_as_far_as_its_positions_allow(tmp_path, capsys):
    """`load_models(context=)` (`--context` of generate, serve and check) holds the draft too: past its pretraining
    length a LongRoPE draft takes the long factors for every position; a draft whose longest context is shorter than
    the one asked holds all it allows (its loading line says so), where a target refuses it, naming itself."""
    from specdraft import SpecdraftError
    from specdraft.bench.random_gguf import default_tokenizer
    from specdraft.surfaces.model_setup import drafter_flags, load_models

    if default_tokenizer() is None:
        pytest.skip("the bundled Qwen2.5-Coder GGUF is not in the cache folder")
    target_file = write_random_gguf(longrope_config(), tmp_path / "target.gguf", "Q8_0", default_tokenizer(), seed=3)
    shorter = longrope_config()
    shorter.max_position_embeddings = 2048  # LongRoPE factors for 256 tokens and beyond, up to 2,048
    draft_file = write_random_gguf(shorter, tmp_path / "draft.gguf", "Q8_0", default_tokenizer(), seed=4)

    def load(context: int, draft=draft_file):
        return load_models(str(target_file), str(draft), "model", drafter_flags(), dtype="bfloat16", device="cpu",
                           gguf_weights="auto", draft_quant="none", draft_vocab=0, context=context)

    target, draft = load(1024)
    assert target.max_context == draft.max_context == 1024
    assert draft.config.rope_parameters["short_factor"] == pytest.approx(LONG_FACTORS)  # the long set everywhere
    target, draft = load(3000)
    assert (target.max_context, draft.max_context) == (3000, 2048)
    assert draft.config.rope_parameters["short_factor"] == pytest.approx(LONG_FACTORS)
    assert "context 2048 (all its positions allow of --context 3000): LongRoPE long factors" in capsys.readouterr().err
    with pytest.raises(SpecdraftError, match=f"past {target_file}'s longest context of 4096"):
        load(5000, draft=target_file)
