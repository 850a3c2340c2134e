"""The `llama-cpp` peer: plain decoding of the target's own GGUF file through llama-cpp-python.

It answers "how do we compare with llama.cpp on the same model?" in the same run as `ar`:
same GGUF file, same prompt token ids (ours, not re-tokenized), same token budget, same EOS
ids (`target.eos_token_ids`), the same number of threads as torch (`torch.get_num_threads()`,
i.e. `--threads`). `wall_seconds` covers prefill and decode; loading the model is not timed
(the runner's warm-up loads it). One `llama_cpp.Llama` is kept per run on `Models.peers`, made
again only when a longer prompt needs a larger context.

Sampling is one llama.cpp sampler chain per generation, in our warping order: greedy
(temperature 0), else temperature -> top-k -> top-p -> a `dist` sampler seeded with the
method's seed, so the same seed reproduces a run. (`Llama.sample()` is not used: it builds a
fresh sampler each call, which would reseed the generator every token, and it adds llama.cpp's
defaults top-k 40, top-p 0.95 and min-p 0.05.) The distribution is the target's warped one as
llama.cpp computes it; the random stream is llama.cpp's, so sampled tokens are not comparable
one by one with ours.

Exactness: llama.cpp runs its own kernels (its quantized dot products, its accumulation order,
its activation precision), so its greedy output is the same model's argmax under different
numerics and may part from `ar` wherever the top two logits are close. That is not a
lossless-decoding failure, and the near-tie rule (calibrated for our own kernels at different
batch shapes) does not bound it. So this method is registered with `own_numerics=True`: the
summary reports its `greedy_exact` as n/a, reports `agreement` (tokens before the first
difference from `ar`, over the longer output) instead, and the exactness check that makes
`specdraft bench` exit 1 leaves it out. Divergences are still listed in summary.json with the
target's top-2 gap at that position, for information.

llama-cpp-python is optional and not installed by `pip install -e '.[models,dev]'`; `make
peers` builds it from source for this CPU (llama.cpp's native detection; AMX off only where the
CPU has it but the OS does not grant it: see `bench.llama_cpp_build`). It runs on the CPU here (no
layers offloaded). A run's machine block records `system_info()`, the CPU features llama.cpp
reports it was built with, so a comparison shows which kernels each side ran.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from specdraft.bench.runs import Models, RunOutput, RunParams
from specdraft.errors import SpecdraftError
from specdraft.models.loading import resolve_model_path
from specdraft.sampling import SamplingParams

PEER = "llama-cpp"  # this peer's key in Models.peers
CONTEXT_STEP = 1024  # contexts are made in multiples of this, so most prompts reuse one Llama
MAX_SEED = 0xFFFFFFFE  # 0xFFFFFFFF is llama.cpp's "random seed"


def import_llama_cpp():
    """The llama_cpp module, or a SpecdraftError that says how to install it."""
    try:
        import llama_cpp
    except (ImportError, OSError) as error:
        raise SpecdraftError(
            f"Method llama-cpp needs llama-cpp-python, which is not installed or does not load ({error}). "
            "Run `make peers` (builds it from source into .venv, about 5 minutes), or leave llama-cpp out of --methods."
        ) from None
    return llama_cpp


def system_info() -> str | None:
    """`llama_cpp.llama_print_system_info()` as text (the CPU features llama.cpp was built with: `AVX2 = 1 | ...`),
    or None where the loaded module does not have it."""
    function = getattr(import_llama_cpp(), "llama_print_system_info", None)
    if function is None:
        return None
    info = function()
    return (info.decode(errors="replace") if isinstance(info, bytes) else str(info)).strip()


def target_gguf(target_spec: str | None, method: str = PEER, role: str = "target") -> Path:
    """The GGUF file of the target (or of the draft, `role="draft"`): a bundled name or a .gguf path; a
    SpecdraftError naming `method` for anything else."""
    if target_spec is None:
        raise SpecdraftError(f"Method {method} needs to know the {role}'s file; none was given.")
    kind, path = resolve_model_path(target_spec)
    if kind != "gguf":
        raise SpecdraftError(
            f"Method {method} runs the {role}'s GGUF file, but the {role} {target_spec!r} is a {kind} ({path}). "
            f"Give --{role} a .gguf file or a bundled model name, or leave {method} out of --methods."
        )
    return path


def check(target_spec: str) -> None:
    """Fail before any model loads when this method cannot run: no GGUF target, or no llama-cpp-python."""
    target_gguf(target_spec)
    import_llama_cpp()


def _llama(models: Models, needed: int):
    """The run's Llama on the target's GGUF with a context of at least `needed` tokens (made or reused)."""
    threads = torch.get_num_threads()
    llama, made_with = models.peers.get(PEER, (None, None))
    if llama is not None and llama.n_ctx() >= needed and made_with == threads:
        return llama
    llama_cpp = import_llama_cpp()
    path = target_gguf(models.target_spec)
    n_ctx = -(-needed // CONTEXT_STEP) * CONTEXT_STEP
    models.peers.pop(PEER, None)  # let the old one go first
    llama = llama_cpp.Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512,
                            n_gpu_layers=0, verbose=False)
    models.peers[PEER] = (llama, threads)
    return llama


def _sampler_chain(llama_cpp, sampling: SamplingParams):
    """One sampler chain for a whole generation: greedy, or temperature -> top-k -> top-p -> seeded dist."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    if sampling.greedy:
        parts = [llama_cpp.llama_sampler_init_greedy()]
    else:
        if not 0 <= sampling.seed <= MAX_SEED:
            llama_cpp.llama_sampler_free(chain)
            raise SpecdraftError(f"llama-cpp's seed must be in [0, {MAX_SEED}], got {sampling.seed}.")
        parts = [llama_cpp.llama_sampler_init_temp(sampling.temperature)]
        if sampling.top_k > 0:
            parts.append(llama_cpp.llama_sampler_init_top_k(sampling.top_k))
        if sampling.top_p < 1.0:
            parts.append(llama_cpp.llama_sampler_init_top_p(sampling.top_p, 1))
        parts.append(llama_cpp.llama_sampler_init_dist(sampling.seed))
    for part in parts:
        llama_cpp.llama_sampler_chain_add(chain, part)  # the chain owns (and frees) its parts
    return chain


def run_llama_cpp(models: Models, prompt_ids: list[int], params: RunParams) -> RunOutput:
    """Plain decoding of the target's GGUF file by llama.cpp, from our prompt token ids, stopping at EOS."""
    llama = _llama(models, len(prompt_ids) + params.max_new_tokens)
    llama_cpp = import_llama_cpp()
    eos = models.target.eos_token_ids
    chain = _sampler_chain(llama_cpp, params.sampling)
    token_ids: list[int] = []
    try:
        started = time.perf_counter()
        llama.reset()
        llama.eval(prompt_ids)  # prefill
        while True:
            token = int(llama_cpp.llama_sampler_sample(chain, llama.ctx, -1))
            token_ids.append(token)
            if token in eos or len(token_ids) >= params.max_new_tokens:
                break
            llama.eval([token])
        wall = time.perf_counter() - started
    finally:
        llama_cpp.llama_sampler_free(chain)
    return RunOutput(token_ids, wall)
