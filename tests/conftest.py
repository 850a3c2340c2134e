"""Tiny random models built in the tests themselves (logic), and the real bundled pair (truth, `slow`)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    # the GPU path's Triton kernels run as numpy here (read when Triton is first imported: before anything else)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from specdraft.models.causal_lm import CausalLM  # noqa: E402
from specdraft.bench.device_check import tiny_tokenizer as train_tokenizer  # noqa: E402

# The tests share two cores with nothing else: one intra-op thread avoids oversubscription.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """`slow` tests first, each file's in its order: on several workers (`make test`) the longest start early and the
    quick ones fill in behind them."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. Héllo wörld, ünïcode ☃ and 日本語 text.",
    "for i in range(10):\n    print(i * i)\n",
    "Speculative decoding drafts tokens and verifies them with the target model.",
] * 20


def avx512_library(flavour: str):
    """The AVX-512 library built with the tiles' `flavour` dot product (no AMX), or None where it does not run here."""
    from specdraft.kernels import bindings

    return bindings.library(bindings.Build("avx512", flavour))


def avx2_library(avx_vnni: bool = False):
    """The AVX2 library (with AVX-VNNI where asked), or None where it does not run here."""
    from specdraft.kernels import bindings

    return bindings.library(bindings.Build("avx2", avx_vnni=avx_vnni))


def _tile_kernel_params():
    """(kernel, dot flavour) pairs: AMX where granted; the AVX-512 kernels in each flavour this CPU runs; AVX2."""
    from specdraft.kernels import tiles

    return [pytest.param((tiles.AMX, None), id="amx",
                         marks=pytest.mark.skipif(not tiles.AMX.available(), reason="no AMX (or not granted) on this CPU"))] + [
        pytest.param((tiles.AVX512, flavour), id=f"avx512-{flavour}",
                     marks=pytest.mark.skipif(avx512_library(flavour) is None,
                                              reason=f"the AVX-512 {flavour} tile kernels do not run on this CPU"))
        for flavour in ("int16", "bf16")] + [
        pytest.param((tiles.AVX2, None), id="avx2",
                     marks=pytest.mark.skipif(avx2_library() is None, reason="no AVX2 (or no C compiler) here"))]


@pytest.fixture(params=_tile_kernel_params())
def tile_kernel(request, monkeypatch):
    """Each tile kernel this CPU runs (AVX-512 in both dot flavours, set by `SPECDRAFT_TILE_DOTS` for the test; AVX2
    even where AVX-512 is there)."""
    kernel, flavour = request.param
    if flavour is not None:
        monkeypatch.setenv("SPECDRAFT_TILE_DOTS", flavour)
    return kernel


def stored_levels() -> list[str]:
    """The levels with tiles of weights as the file stores them (Q4_K, Q8_0, IQ4) that this CPU runs: AVX2, AVX-512."""
    from specdraft.kernels import tiles

    return [kernel.name for kernel in (tiles.AVX2, tiles.AVX512) if kernel.available()]


@pytest.fixture(params=stored_levels())
def stored_level(request, monkeypatch) -> str:
    """Each level of `stored_levels`, forced for the test (`SPECDRAFT_ISA`: AVX2 even where AVX-512 is there)."""
    from specdraft.kernels import numerics, tiles

    monkeypatch.setenv(numerics.ISA_VARIABLE, request.param)
    assert tiles.tile_kernel().name == request.param
    return request.param


@pytest.fixture(params=["int16", "bf16"])
def tile_dots(request, monkeypatch):
    """Each dot flavour of the AVX-512 tile kernels this CPU runs, set for the whole test (decoder and prompt kernels too)."""
    if avx512_library(request.param) is None:
        pytest.skip(f"the AVX-512 {request.param} tile kernels do not run on this CPU")
    monkeypatch.setenv("SPECDRAFT_TILE_DOTS", request.param)
    return request.param


def activations_as_multiplied(x: torch.Tensor, kernel) -> torch.Tensor:
    """x `[tokens, K]` bf16 as `kernel` multiplies it, in float64: the int16 grid under AVX2 and the AVX-512 int16
    flavour, else x itself."""
    from specdraft.kernels import numerics, tiles

    on_grid = kernel is tiles.AVX2 or (kernel is tiles.AVX512 and numerics.current().tile_dots == "int16")
    return int16_activation_grid(x) if on_grid else x.double()


def int16_activation_grid(x: torch.Tensor) -> torch.Tensor:
    """x `[tokens, K]` as the AVX-512 tile kernels multiply it (`native/avx512/tiles.h`): each token's 16 inputs at a
    time rounded (ties to even) to a multiple of 2^e, e = floor(log2 max|x|) − 14 (0 where all 16 are zero).
    Independent of the kernel's own code: frexp gives the exponent, torch.round the rounding."""
    groups = x.float().view(x.shape[0], -1, 16)  # [T, K/16, 16]
    top = groups.abs().amax(dim=-1, keepdim=True)  # [T, K/16, 1]
    _, exponent = torch.frexp(top)  # top = m · 2^exponent, m in [0.5, 1): floor(log2 top) = exponent − 1
    step = torch.where(top > 0, torch.ldexp(torch.ones_like(top), exponent - 15), torch.ones_like(top))
    return (torch.round(groups / step) * step).view_as(x).double()


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few lines, with chat and end-of-text specials."""
    fast = train_tokenizer(CORPUS, vocab=320)
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def tiny_config(vocab_size: int = 64, layers: int = 2, max_positions: int = 256, eos=None) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        eos_token_id=eos, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )


# Lines of code and prose the training tests build prompts and text data from ({i}: a number that varies them).
TRAINING_LINES = ["def add{i}(a, b):\n    return a + b", "for i in range({i}):\n    print(i * i)",
                  "The quick brown fox {i} jumps over the lazy dog."]


def tiny_chat_target(layers: int = 2) -> CausalLM:
    """A tiny random target named `tiny` with the chat tokenizer, its end-of-turn token as end of sequence."""
    tokenizer = build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = tiny_model(tiny_config(vocab_size=len(tokenizer), layers=layers, eos=eos, max_positions=256), seed=1)
    return CausalLM(model, tokenizer, name="tiny")


def tiny_model(config: Qwen2Config, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float().eval()
    # Sharper logits than the default init, so argmaxes are not near-ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.generation_config.eos_token_id = config.eos_token_id
    return model


def perturbed(model: Qwen2ForCausalLM, noise: float, seed: int) -> Qwen2ForCausalLM:
    """A copy of `model` with Gaussian noise on every weight: a draft that agrees often, not always."""
    copy = Qwen2ForCausalLM(model.config).float().eval()
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(noise * p.abs().mean() * torch.randn(p.shape, generator=generator))
    copy.generation_config.eos_token_id = model.config.eos_token_id
    return copy


@pytest.fixture(scope="session")
def tiny_target() -> Qwen2ForCausalLM:
    return tiny_model(tiny_config(), seed=0)


@pytest.fixture(scope="session")
def drafts(tiny_target) -> dict[str, Qwen2ForCausalLM]:
    """Drafts of `tiny_target` from always right (its own weights) to mostly wrong (independent)."""
    return {
        "identical": perturbed(tiny_target, noise=0.0, seed=0),
        "close": perturbed(tiny_target, noise=0.3, seed=1),
        "far": perturbed(tiny_target, noise=1.0, seed=2),
        "independent": tiny_model(tiny_config(), seed=99),
    }


@pytest.fixture()
def make_lm():
    """Wrap a HF model (fresh cache each time) as the engine's CausalLM."""
    def wrap(model, tokenizer=None, name="tiny"):
        return CausalLM(model, tokenizer, name=name)
    return wrap


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, tiny_tokenizer):
    """Two saved Hugging Face folders (target, draft) sharing the tiny tokenizer, plus one with another vocabulary."""
    root = tmp_path_factory.mktemp("tiny_models")
    vocab = len(tiny_tokenizer)
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    target = tiny_model(tiny_config(vocab_size=vocab, eos=eos, max_positions=128), seed=1)
    draft = perturbed(target, noise=0.05, seed=2)
    other = tiny_model(tiny_config(vocab_size=vocab + 8, eos=eos), seed=3)
    paths = {}
    for name, model in (("target", target), ("draft", draft), ("other_vocab", other)):
        path = root / name
        model.save_pretrained(path)
        tiny_tokenizer.save_pretrained(path)
        paths[name] = path
    return paths


@pytest.fixture(scope="session")
def eagle_file(tiny_model_dirs, tmp_path_factory):
    """Random EAGLE weights for the tiny target, as `specdraft train eagle` writes them."""
    from transformers import AutoConfig

    from specdraft.models.eagle import EagleConfig, EagleDrafterModel
    from specdraft.models.trained import save_trained

    config = AutoConfig.from_pretrained(tiny_model_dirs["target"])
    torch.manual_seed(5)
    eagle = EagleDrafterModel(EagleConfig(config.hidden_size, width=64, num_heads=1, num_kv_heads=1,
                                          intermediate_size=64))
    return save_trained(tmp_path_factory.mktemp("eagle") / "eagle.safetensors", "eagle", eagle,
                        torch.arange(config.vocab_size), "tiny", {})


# ----- what the trained drafters' tests share (`test_eagle3`, `test_mtp`, `test_dflash`) ------------------------------
PROMPTS = [[5, 17, 42, 8, 59, 3, 5, 17], [7], list(range(10, 40))]  # the greedy tests' (a vocabulary of 64 up)
SMALL_V = 8  # the sampled tests' vocabulary: 64 cells of first two tokens
SAMPLED_PROMPT = [1, 2, 3, 4, 1, 2, 3]
SAMPLES = 1500  # with 63 degrees of freedom at alpha 1e-3: every bias of total variation >= 0.105 is caught
P_PASS, P_REJECT = 1e-3, 1e-6  # a drafter passes above P_PASS; a planted bias is caught below P_REJECT


def sharpened(model):
    """Sharper logits than the default init, so greedy argmaxes are not near-ties."""
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model.float().eval()


def small_sampling_target() -> Qwen2ForCausalLM:
    """The sampled tests' target: a tiny random Qwen2 on SMALL_V tokens."""
    torch.manual_seed(7)
    model = Qwen2ForCausalLM(tiny_config(vocab_size=SMALL_V, layers=2)).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # spread, but far from uniform, next-token distributions
    return model


def assert_sampled_output_follows(target_model: Qwen2ForCausalLM, decoder) -> None:
    """`decoder`'s first two sampled tokens follow `target_model`'s exact distribution of them (p-value above
    P_PASS), with more tokens drafted than samples; the test has the power the modules' docs state."""
    from specdraft.goodness_of_fit import detectable_bias

    assert detectable_bias(SAMPLES, SMALL_V * SMALL_V - 1, P_PASS) < 0.105
    pvalue, drafted = sampled_pairs_pvalue(target_model, decoder)
    assert drafted > SAMPLES
    assert pvalue > P_PASS, f"p-value {pvalue:.3g}"


def assert_planted_bias_caught(target_model: Qwen2ForCausalLM, decoder, bias: str) -> None:
    """The control: the same test rejects `decoder` (p-value below P_REJECT), whose drafter plants `bias`."""
    pvalue, _ = sampled_pairs_pvalue(target_model, decoder)
    assert pvalue < P_REJECT, f"{bias} went unnoticed: p-value {pvalue:.3g}"


def sampled_pairs_pvalue(target_model: Qwen2ForCausalLM, decoder) -> tuple[float, int]:
    """The chi-square p-value of the first two tokens `decoder` generates after SAMPLED_PROMPT over SAMPLES seeds
    against `target_model`'s exact distribution of them, and how many tokens were drafted."""
    from specdraft import SamplingParams
    from specdraft.analysis.check import answer_start
    from specdraft.exactness import exact_two_tokens
    from specdraft.goodness_of_fit import chi_square_pvalue
    from specdraft.stats import GenerationStats

    counts, drafted = np.zeros(SMALL_V * SMALL_V), 0  # [V * V]
    for seed in range(SAMPLES):
        stats = GenerationStats()  # answers of four tokens, stepped until they hold two
        a, b = answer_start(decoder, SAMPLED_PROMPT, SamplingParams(temperature=1.0, seed=seed), 4, 2, stats)[:2]
        counts[a * SMALL_V + b] += 1
        drafted += stats.drafted
    return chi_square_pvalue(counts, exact_two_tokens(target_model, SAMPLED_PROMPT).ravel() * SAMPLES), drafted


def assert_greedy_spec_equals_ar(target: CausalLM, drafter: str, options: dict, tree: int, name: str) -> None:
    """Greedy `spec` with `drafter` (made with `options`, no confidence cut and the default one; k 4, a tree of
    `tree` nodes if any) equals `ar` on PROMPTS, drafting something; a tree drafted with the cut off branches."""
    from specdraft import SpeculativeDecoder
    from specdraft.drafters import make_drafter

    expected = [SpeculativeDecoder(target).generate(p, max_new_tokens=24).token_ids for p in PROMPTS]
    for confidence in (0.0, None):
        made = make_drafter(drafter, {**options, "draft-confidence": confidence}, target_model=target)
        spec = SpeculativeDecoder(target, made, k=4, tree_budget=tree, tree_branch=3)
        outs = [spec.generate(p, max_new_tokens=24) for p in PROMPTS]
        assert [out.token_ids for out in outs] == expected, (name, tree, confidence)
        stats = [out.stats for out in outs]
        assert sum(s.drafted for s in stats) > 0
        if tree and confidence == 0.0:  # some drafts branched: more nodes than depth
            assert any(k > depth for s in stats for k, depth in zip(s.k_per_step, s.depth_per_step))


def assert_batch_answers_as_alone(target_model, drafter: str, trained: str, tree_budget: int = 0) -> None:
    """BatchedDecoder, three slots for four requests, one set of `drafter`'s weights (loaded from `trained`) shared
    by every sequence's drafter (as a server builds them: `shared`): each greedy answer is its answer alone."""
    from specdraft import SamplingParams, SpeculativeDecoder
    from specdraft.batch_engine import BatchedDecoder, BatchRequest
    from specdraft.drafters import make_drafter

    budgets = [20, 9, 16, 12]
    prompts = PROMPTS + [[2, 40, 2, 40, 2]]
    expected = [SpeculativeDecoder(CausalLM(target_model)).generate(p, max_new_tokens=b).token_ids
                for p, b in zip(prompts, budgets)]
    batch = BatchedDecoder(CausalLM(target_model), max_batch=3, tree_budget=tree_budget)
    shared: dict = {}
    batch.make_drafter = lambda: make_drafter(drafter, {"trained": trained}, target_model=batch.target, shared=shared)
    completions = batch.generate_all([BatchRequest(p, SamplingParams(temperature=0.0), b)
                                      for p, b in zip(prompts, budgets)])
    assert [c.token_ids for c in completions] == expected
    assert sum(c.stats.drafted for c in completions) > 0 and batch.largest_batch == 3
    assert len(shared) == 1  # the weights were loaded once


def assert_cli_spec_equals_ar_and_check_passes(target_dir, drafter: list) -> None:
    """On the command line, with the target at `target_dir` in float32: `generate` with `drafter` (`--drafter NAME`
    and its options) equals `ar` greedily, drafting something, and `specdraft check` of it passes (greedy identity
    and the sampled test it sizes itself)."""
    import json

    from typer.testing import CliRunner

    from specdraft.surfaces.cli import app

    runner = CliRunner()

    def run(*args):
        result = runner.invoke(app, [str(a) for a in args])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    target = ["--target", target_dir, "--dtype", "float32"]
    spec = run("generate", "def add", *target, *drafter, "--k", 3, "--max-new-tokens", 20, "--json")
    ar = run("generate", "def add", *target, "--method", "ar", "--max-new-tokens", 20, "--json")
    assert spec["completions"][0]["token_ids"] == ar["completions"][0]["token_ids"]
    assert spec["stats"]["drafted"] > 0
    report = run("check", *target, *drafter, "--prompt", "def add", "--samples", 200, "--temperature", 1.0, "--k", 2,
                 "--greedy-tokens", 12, "--json")
    assert report["passed"] and report["greedy"]["passed"] and report["sampled"]["passed"], report
