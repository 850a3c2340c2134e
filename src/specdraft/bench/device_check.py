"""The GPU check: the CUDA path measured on random weights at the bundled pair's shapes, in one short run.

    PYTHONPATH=src python -m specdraft.bench.device_check --out device_check.json           # on a GPU machine
    python -m specdraft.bench.device_check --dry-run --out /tmp/device_check.json           # tiny shapes, CPU

A GPU machine here has torch and transformers and nothing else of ours (no registry, no bundled weights), so
this needs only those two (and scipy for the chi-square test, skipped without it). It writes one JSON file and
prints a table:

1. the target's pass cost by width (1 .. 64 tokens) over a 512-token cache, on the static cache with CUDA
   graphs and the fused Triton kernels (one and 16 tokens also over 4,000 and 12,000 cached tokens), the same
   passes on the torch formulas (`unfused`), and one eager
   (transformers' forward, growing cache) one-token pass beside them;
2. the draft model's one-token step and c, its cost against the target's, the same for each token of a drafted
   chain of k = 1 .. 8 (`ModelDrafter.propose`, host work included), and the kernels of both models' one-token
   passes (torch.profiler: device time and count per kernel);
3. our `ar` next to transformers' `generate` (eager, and with `cache_implementation="static"`, which compiles
   the forward) on the same model, in the same process;
4. `spec` with the `oracle` drafter (bench only: the target's own recorded tokens, each wrong with
   probability 1 - α) at α = 0.6 / 0.8 / 0.95, k auto: speedup over our `ar`, measured α and τ;
   continuous batching on the static cache (`batch_engine`): aggregate tokens/s of 1 .. 16 requests at once,
   plain (the model's dtype), plain, with the oracle at each α and with the draft model on random weights (float32:
   `batch_speed`), how many answers equal their answer alone, and what the whole batch's steps did;
5. exactness on tiny models on the device: greedy `spec` == `ar` (chains, k auto, trees; in a batch, each answer
   as alone), and the chi-square test of the first two sampled tokens against the target's exact distribution;
6. structured output on the device: answers of a tiny target with a byte-level tokenizer under a regex and a JSON
   schema, valid and greedy `spec` == `ar` (chains, k auto, trees). It needs llguidance and jsonschema, which a GPU
   machine lacks: carry their wheels (docs/gpu.md gives the `pip download` line) and `pip install --no-deps` them
   there; without llguidance the part says it was skipped.

The parts run in the order exactness, then speed: a fault on the device ends every CUDA call after it, and the
timings are where one appeared (transformers' compiled `generate` before our passes: docs/gpu.md), so they come
last, compiled `generate` last of all.

`--dry-run` runs every part at tiny shapes with few tokens (on the CPU unless --device says otherwise), so
the script is tested in the quick test set and cannot rot.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import transformers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from specdraft.batch_engine import BatchedDecoder, BatchRequest
from specdraft.drafters import ModelDrafter, make_drafter
from specdraft.drafters.base import DraftContext
from specdraft.drafters.oracle import OracleDrafter
from specdraft.engine import SpeculativeDecoder
from specdraft.exactness import exact_two_tokens
from specdraft.goodness_of_fit import chi_square_pvalue
from specdraft.models.causal_lm import CausalLM
from specdraft.run import sync_device
from specdraft.sampling import SamplingParams

ALPHAS = (0.6, 0.8, 0.95)
PASS_WIDTHS = (1, 2, 4, 8, 16, 32, 64)
BATCH_SIZES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Shapes:
    """Model shapes and run sizes of one check."""

    target: dict  # Qwen2Config fields
    draft: dict
    cache_tokens: int  # cache length under the timed passes
    long_caches: tuple[int, ...]  # longer caches the one- and 16-token passes are timed over too
    prompt_tokens: int
    new_tokens: int
    repeats: int  # timed repeats per pass width
    samples: int  # seeds of the chi-square test
    compiled_generate: bool


def qwen2(layers: int, hidden: int, intermediate: int, heads: int, vocab: int) -> dict:
    return dict(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=intermediate,
                num_attention_heads=heads, num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=True,
                max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)


# The bundled pair: Qwen2.5-Coder 1.5B (target) and 0.5B (draft) shapes.
FULL = Shapes(target=qwen2(28, 1536, 8960, 12, 151936), draft=qwen2(24, 896, 4864, 14, 151936),
              cache_tokens=512, long_caches=(4000, 12000), prompt_tokens=128, new_tokens=256, repeats=20,
              samples=2000, compiled_generate=True)
DRY = Shapes(target=qwen2(2, 64, 128, 4, 512), draft=qwen2(1, 32, 64, 4, 512),
             cache_tokens=40, long_caches=(300,), prompt_tokens=16, new_tokens=24, repeats=2, samples=300,
             compiled_generate=False)


def tiny(vocab: int, positions: int = 512) -> dict:
    """The exactness parts' tiny Qwen2: 2 layers, 16-wide heads (the least the fused kernels take), untied head."""
    return qwen2(2, 64, 128, 4, vocab) | {"max_position_embeddings": positions, "tie_word_embeddings": False}


def random_model(fields: dict, dtype: torch.dtype, device: torch.device, seed: int) -> Qwen2ForCausalLM:
    """A Qwen2 of the given shape with transformers' own random initialisation, on `device`."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**fields)).to(dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def timed(device: torch.device, run, repeats: int) -> float:
    """Median seconds of `run()` over `repeats` calls after one warm call."""
    run()
    times = []
    for _ in range(repeats):
        sync_device(device)
        started = time.perf_counter()
        run()
        sync_device(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def pass_costs(lm: CausalLM, cache_tokens: int, widths: tuple[int, ...], repeats: int) -> dict[int, float]:
    """Milliseconds of a pass of each width over a cache of `cache_tokens` (cut back after each)."""
    generator = torch.Generator().manual_seed(0)
    lm.reset()
    lm.prefill(torch.randint(0, lm.vocab_size, (1, cache_tokens), generator=generator).to(lm.device))
    costs = {}
    for width in widths:
        tokens = torch.randint(0, lm.vocab_size, (1, width), generator=generator).to(lm.device)

        def one_pass():
            lm.forward(tokens, logits_to_keep=width)
            lm.truncate(cache_tokens)

        costs[width] = 1000 * timed(lm.device, one_pass, repeats)
    return costs


def unfused_pass_costs(target_model, draft_model, shapes: Shapes, widths: tuple[int, ...]) -> dict:
    """The same passes on the torch formulas in place of the fused Triton kernels (`SPECDRAFT_FUSED_KERNELS=0`)."""
    with mock.patch.dict(os.environ, {"SPECDRAFT_FUSED_KERNELS": "0"}):  # the user's setting comes back after
        target = CausalLM(target_model, name="target", static_cache=True)
        draft = CausalLM(draft_model, name="draft", static_cache=True)
    row = {"target": pass_costs(target, shapes.cache_tokens, widths, shapes.repeats),
           "draft": pass_costs(draft, shapes.cache_tokens, (1,), shapes.repeats),
           "target_long": {cached: pass_costs(target, cached, (1, 16), shapes.repeats)
                           for cached in shapes.long_caches}}
    row["c"] = row["draft"][1] / row["target"][1]
    del target, draft
    gc.collect()
    torch.cuda.empty_cache()
    return row


def generate_timed(decoder: SpeculativeDecoder, prompt: list[int], new_tokens: int) -> tuple[list[int], dict]:
    """The tokens and speed of a greedy generation (after one untimed warm-up run)."""
    decoder.generate(prompt, max_new_tokens=min(new_tokens, 16))
    sync_device(decoder.target.device)
    started = time.perf_counter()
    out = decoder.generate(prompt, max_new_tokens=new_tokens)
    sync_device(decoder.target.device)
    seconds = time.perf_counter() - started
    stats = out.stats
    return out.token_ids, {"tokens": len(out.token_ids), "seconds": seconds, "tok_s": len(out.token_ids) / seconds,
                           "alpha": stats.acceptance_rate, "tau": stats.mean_committed_per_step,
                           "steps": stats.steps, "mean_k": stats.mean_k, "prefill_seconds": stats.prefill_seconds,
                           "draft_seconds": stats.draft_seconds, "verify_seconds": stats.verify_seconds}


def hf_generate(model, prompt: list[int], new_tokens: int, **kwargs) -> tuple[list[int], dict]:
    """transformers' own greedy `generate` (second call timed: a compiling one compiles in the first)."""
    ids = torch.tensor([prompt], device=model.device)
    args = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, **args)
    sync_device(model.device)
    first = time.perf_counter() - started
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, **args)
    sync_device(model.device)
    seconds = time.perf_counter() - started
    tokens = out[0, len(prompt):].tolist()
    return tokens, {"tokens": len(tokens), "seconds": seconds, "tok_s": len(tokens) / seconds,
                    "first_call_seconds": first}


def guarded(results: dict, key: str, run) -> None:
    """Record `run()`'s result under `key`, or the error it raised (one failed part does not end the check)."""
    started = time.perf_counter()
    try:
        results[key] = run()
    except Exception as error:  # noqa: BLE001 - a report, not a program: every part is tried
        where = traceback.extract_tb(error.__traceback__)[-1]
        results[key] = {"error": f"{type(error).__name__}: {error} ({Path(where.filename).name}:{where.lineno})"}
    print(f"  {key}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)


def speed_part(shapes: Shapes, device: torch.device, dtype: torch.dtype, results: dict, skip: set[str]) -> None:
    target_model = random_model(shapes.target, dtype, device, seed=0)
    draft_model = random_model(shapes.draft, dtype, device, seed=1)
    started = time.perf_counter()
    target = CausalLM(target_model, name="target", static_cache=True)
    draft = CausalLM(draft_model, name="draft", static_cache=True)
    results["load_and_capture_seconds"] = time.perf_counter() - started
    results["fused_kernels"] = {"target": target._static.fused, "draft": draft._static.fused}
    widths = tuple(w for w in PASS_WIDTHS if w <= 64)
    guarded(results, "target_pass_ms", lambda: pass_costs(target, shapes.cache_tokens, widths, shapes.repeats))
    guarded(results, "draft_pass_ms", lambda: pass_costs(draft, shapes.cache_tokens, (1,), shapes.repeats))
    if target._static.fused and "unfused" not in skip:
        guarded(results, "unfused_pass_ms", lambda: unfused_pass_costs(target_model, draft_model, shapes, widths))
    if "eager" not in skip:
        guarded(results, "target_eager_pass_ms", lambda: pass_costs(
            CausalLM(target_model, name="eager", static_cache=False), shapes.cache_tokens, (1,), shapes.repeats))
    if "error" not in results["target_pass_ms"] and "error" not in results["draft_pass_ms"]:
        results["c"] = results["draft_pass_ms"][1] / results["target_pass_ms"][1]
    if device.type == "cuda" and "profile" not in skip:
        guarded(results, "target_profile", lambda: kernel_profile(target, shapes.cache_tokens))
        guarded(results, "draft_profile", lambda: kernel_profile(draft, shapes.cache_tokens))

    prompt = torch.randint(0, shapes.target["vocab_size"], (shapes.prompt_tokens,),
                           generator=torch.Generator().manual_seed(2)).tolist()
    ar_tokens, results["ar"] = generate_timed(SpeculativeDecoder(target), prompt, shapes.new_tokens)
    if "host" not in skip:
        guarded(results, "ar_host_profile", lambda: host_profile(SpeculativeDecoder(target), prompt, shapes.new_tokens))
    if "eager" not in skip:
        guarded(results, "hf_generate_eager", lambda: hf_generate(target_model, prompt, shapes.new_tokens)[1])
    def oracle_run(alpha: float) -> dict:
        drafter = OracleDrafter(alpha=alpha, seed=0)
        drafter.record(prompt + ar_tokens)
        tokens, row = generate_timed(SpeculativeDecoder(target, drafter, k="auto"), prompt, shapes.new_tokens)
        row["speedup"] = row["tok_s"] / results["ar"]["tok_s"]
        row["same_tokens_as_ar"] = tokens == ar_tokens
        row["first_difference"] = next((i for i, (a, b) in enumerate(zip(tokens, ar_tokens)) if a != b), None)
        return row

    for alpha in ALPHAS:
        guarded(results, f"oracle_{alpha}", lambda alpha=alpha: oracle_run(alpha))
    def model_spec():
        tokens, row = generate_timed(SpeculativeDecoder(target, ModelDrafter(draft), k="auto"), prompt,
                                     shapes.new_tokens)
        row["speedup"] = row["tok_s"] / results["ar"]["tok_s"]
        return row
    guarded(results, "spec_model_drafter_random_weights", model_spec)
    guarded(results, "draft_chain", lambda: draft_chain_costs(target, draft, shapes))
    if "batch" not in skip:  # the oracle in float32: see `batch_speed`
        guarded(results, "batch_plain", lambda: batch_speed(target, shapes, drafting=False))
        guarded(results, "batch", lambda: batch_speed(
            CausalLM(random_model(shapes.target, torch.float32, device, seed=0), name="target", static_cache=True),
            shapes, draft_model=random_model(shapes.draft, torch.float32, device, seed=1)))
    if "long" not in skip:  # after the runs above: the cache grows, and its graphs are captured anew as needed
        guarded(results, "long_cache_pass_ms", lambda: {
            cached: pass_costs(target, cached, (1, 16), shapes.repeats) for cached in shapes.long_caches})
    if shapes.compiled_generate and "hf" not in skip:
        # last: a run where it came before our passes (and after the long caches) failed with an illegal memory
        # access in the next spec run; the oracle again after it tells whether the two can share a process
        guarded(results, "hf_generate_static_compiled", lambda: hf_generate(
            target_model, prompt, shapes.new_tokens, cache_implementation="static")[1])
        guarded(results, f"oracle_{ALPHAS[-1]}_after_hf_compiled", lambda: oracle_run(ALPHAS[-1]))


def batch_speed(target: CausalLM, shapes: Shapes, drafting: bool = True, draft_model=None) -> dict:
    """Continuous batching on the device's cache (a GPU's static one): B requests of distinct random prompts,
    greedy, all joining at once, at each batch size of `BATCH_SIZES`; aggregate tokens/s with plain steps and (with
    `drafting`) with `spec`, k chosen by the goodput rule: each request an `oracle` drafter of its own at each α of
    `ALPHAS`, and a draft model on `draft_model`'s (random) weights; how many answers in the batch equal the same
    request's answer alone, and what the steps of the whole batch did (`step_trace`).

    In float32: a GPU's kernels add in another order in a batch than alone (a pass's width and its rows' keys
    differ), and on random weights, whose logits are near-ties everywhere, bf16's rounding then turns every answer
    of a batch away from its answer alone within a few tokens (measured on an H200), where the oracle's recordings
    end. In float32 the answers hold, so the oracle drafts through the whole answer as it does alone."""
    size_most, new_tokens = max(BATCH_SIZES), shapes.new_tokens // 2
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, target.vocab_size, (shapes.prompt_tokens,), generator=generator).tolist()
               for _ in range(size_most)]
    greedy = SamplingParams(temperature=0.0)
    started = time.perf_counter()
    alone = [SpeculativeDecoder(target).generate(p, greedy, max_new_tokens=new_tokens).token_ids for p in prompts]
    rows = {"alone_ar_tok_s": size_most * new_tokens / (time.perf_counter() - started), "new_tokens": new_tokens,
            "widest_graph": target.widest_graph}

    def oracle(alpha: float, prompt: list[int], answer: list[int]) -> OracleDrafter:
        drafter = OracleDrafter(alpha=alpha, seed=0)
        drafter.record(prompt + answer)
        return drafter

    def draft(prompt: list[int], answer: list[int]) -> ModelDrafter:
        return ModelDrafter(CausalLM(draft_model, name="draft", static_cache=False))  # packed as it joins

    def run(batch: BatchedDecoder, size: int, drafter) -> tuple[dict, list[list[int]]]:
        """`drafter(prompt, answer)`: a request's drafter (None: plain)."""
        requests = [BatchRequest(p, greedy, new_tokens, make_drafter=partial(drafter, p, a) if drafter else None)
                    for p, a in zip(prompts[:size], alone)]
        batch.largest_batch = 0
        steps, step = [], batch.step
        batch.step = lambda: (events := step(), steps.append(batch.last_step))[0]
        sync_device(target.device)
        began = time.perf_counter()
        done = batch.generate_all(requests)
        sync_device(target.device)
        del batch.step
        seconds = time.perf_counter() - began
        tokens = sum(len(c.token_ids) for c in done)
        drafted, accepted = sum(c.stats.drafted for c in done), sum(c.stats.accepted for c in done)
        steps_taken = sum(c.stats.steps for c in done)
        return {"tok_s": tokens / seconds, "seconds": seconds, "largest_batch": batch.largest_batch,
                "alpha": accepted / drafted if drafted else None, "tau": tokens / steps_taken if steps_taken else None,
                "steps": step_trace([s for s in steps if s is not None], size, target.widest_graph)}, \
            [c.token_ids for c in done]

    methods = {"ar": None}
    if drafting:
        methods |= {f"oracle_{alpha}": partial(oracle, alpha) for alpha in ALPHAS}
        if draft_model is not None:
            methods["draft_model"] = draft
    # one batch a method, as a server keeps one, warmed up at the largest size: the caches grow to what the sweep
    # fills (their graphs are then captured anew, as passes need them), a draft model's packed cache captures its
    # passes and the oracle makes its first draws, before anything is timed
    for method, drafter in methods.items():
        batch = BatchedDecoder(target, None, max_batch=size_most)
        run(batch, size_most, drafter)
        for size in BATCH_SIZES:
            row, answers = run(batch, size, drafter)
            row["same_as_alone"] = sum(a == b for a, b in zip(answers, alone))
            if method != "ar":
                row["vs_ar"] = row["tok_s"] / rows[f"ar_{size}"]["tok_s"]
            rows[f"{method}_{size}"] = row
    return rows


def step_trace(steps: list, size: int, widest: int | None) -> dict:
    """What a batch run's steps of all `size` sequences did: how many drafted, their mean pass width, how many ran
    wider than the widest captured graph (eagerly), and the mean milliseconds of a step that drafted and of one
    that did not."""
    full = [s for s in steps if s.sequences == size]
    drafting = [s for s in full if s.drafted]
    plain = [s for s in full if not s.drafted]
    return {"full_steps": len(full), "drafting_steps": len(drafting),
            "mean_width_drafting": statistics.fmean(s.width for s in drafting) if drafting else None,
            "eager_steps": sum(widest is not None and s.width > widest for s in full),
            "ms_drafting": 1000 * statistics.fmean(s.seconds for s in drafting) if drafting else None,
            "ms_plain": 1000 * statistics.fmean(s.seconds for s in plain) if plain else None}


def draft_chain_costs(target: CausalLM, draft: CausalLM, shapes: Shapes, most: int = 8) -> dict:
    """The draft model's chain of k = 1 .. `most` greedy tokens (`ModelDrafter.propose`, every token drafted: no
    confidence stop) after a prompt it has read, in milliseconds per drafted token, and c: that against the
    target's one-token pass over the same cache."""
    generator = torch.Generator().manual_seed(3)
    sequence = torch.randint(0, target.vocab_size, (shapes.cache_tokens,), generator=generator).to(target.device)
    context = DraftContext(sequence, SamplingParams(temperature=0.0), torch.Generator(device=target.device), None)
    drafter = ModelDrafter(draft, min_confidence=0.0, context=0)
    drafter.begin(sequence)
    drafter.propose(context, 1)  # reads the prompt
    drafter.commit(sequence.shape[0], [])
    target_ms = pass_costs(target, shapes.cache_tokens, (1,), shapes.repeats)[1]
    rows = {"target_one_token_ms": target_ms}
    for k in range(1, most + 1):
        def chain():
            drafter.propose(context, k)
            drafter.commit(sequence.shape[0], [])
        per_token = 1000 * timed(target.device, chain, shapes.repeats) / k
        rows[k] = {"ms_per_token": per_token, "c": per_token / target_ms}
    return rows


def batch_greedy(target: CausalLM, draft: CausalLM, prompts: list[list[int]], new_tokens: int) -> dict:
    """Each request's greedy answer in a batch of them (3 at a time, a draft model each, k auto) against its answer
    alone with the same drafter."""
    expected = [SpeculativeDecoder(target, ModelDrafter(draft, min_confidence=0.0)).generate(
        p, max_new_tokens=new_tokens).token_ids for p in prompts]
    batch = BatchedDecoder(target, lambda: ModelDrafter(CausalLM(draft.model, static_cache=False), min_confidence=0.0),
                           max_batch=3)
    got = batch.generate_all([BatchRequest(p, SamplingParams(temperature=0.0), new_tokens) for p in prompts])
    return {"identical": sum(c.token_ids == e for c, e in zip(got, expected)), "runs": len(prompts),
            "drafted": sum(c.stats.drafted for c in got)}


def perturbed(model: Qwen2ForCausalLM, noise: float, seed: int) -> Qwen2ForCausalLM:
    copy = Qwen2ForCausalLM(model.config).to(device=model.device, dtype=model.dtype).eval()
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(noise * p.abs().mean() * torch.randn(p.shape, generator=generator, device=model.device,
                                                        dtype=p.dtype))
    copy.generation_config.eos_token_id = None
    return copy


def greedy_part(device: torch.device, results: dict, prompts: int) -> None:
    """spec == ar on tiny models through the device's path: chains (k 1, 3, auto) and trees (budget 8)."""
    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        target_model = tiny_sharp(device, dtype)
        draft_model = perturbed(target_model, noise=0.3, seed=1)
        target, draft = CausalLM(target_model, static_cache=True), CausalLM(draft_model, static_cache=True)
        same = total = 0
        batch_prompts = []
        for index in range(prompts):
            prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(index)).tolist()
            batch_prompts.append(prompt)
            expected = SpeculativeDecoder(target).generate(prompt, max_new_tokens=40).token_ids
            for k, tree in ((1, 0), (3, 0), ("auto", 0), (3, 8)):
                got = SpeculativeDecoder(target, ModelDrafter(draft, min_confidence=0.0), k=k,
                                         tree_budget=tree).generate(prompt, max_new_tokens=40).token_ids
                same += got == expected
                total += 1
        rows[str(dtype).removeprefix("torch.")] = {"identical": same, "runs": total}
        rows[f"batch_{str(dtype).removeprefix('torch.')}"] = batch_greedy(target, draft, batch_prompts * 2, 40)
    rows["cache_grows"] = grown_cache_run(device, prompt_tokens=2040)
    results["greedy_spec_equals_ar"] = rows


def grown_cache_run(device: torch.device, prompt_tokens: int) -> dict:
    """spec == ar where the sequence outgrows the static cache's first capacity (the graphs are captured anew)."""
    target_model = random_model(tiny(256, positions=4096), torch.bfloat16 if device.type == "cuda" else torch.float32, device, seed=6)
    target = CausalLM(target_model, static_cache=True)
    draft = CausalLM(perturbed(target_model, noise=0.3, seed=2), static_cache=True)
    first_capacity = target._static.cache.capacity
    prompt = torch.randint(0, 256, (prompt_tokens,), generator=torch.Generator().manual_seed(9)).tolist()
    expected = SpeculativeDecoder(target).generate(prompt, max_new_tokens=40).token_ids
    got = SpeculativeDecoder(target, ModelDrafter(draft, min_confidence=0.0), k=3, tree_budget=6).generate(
        prompt, max_new_tokens=40).token_ids
    return {"identical": int(got == expected), "runs": 1, "capacity": [first_capacity,
                                                                      target._static.cache.capacity]}


def host_profile(decoder: SpeculativeDecoder, prompt: list[int], new_tokens: int, top: int = 25) -> list[str]:
    """Where the host's time goes in a greedy generation (cProfile, by own time): what a step spends besides its
    passes."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    decoder.generate(prompt, max_new_tokens=new_tokens)
    sync_device(decoder.target.device)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return [line for line in text.getvalue().splitlines() if line.strip()]


def kernel_profile(lm: CausalLM, cache_tokens: int, passes: int = 5, top: int = 15) -> dict:
    """The device kernels of `passes` one-token passes (CUDA graph replays included): the costliest by total time."""
    from torch.profiler import ProfilerActivity, profile

    lm.reset()
    lm.prefill(torch.zeros((1, cache_tokens), dtype=torch.long, device=lm.device))
    token = torch.zeros((1, 1), dtype=torch.long, device=lm.device)
    sync_device(lm.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(passes):
            lm.forward(token)
            lm.truncate(cache_tokens)
        sync_device(lm.device)
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if device_us > 0:
            rows.append((device_us / passes, event.count // passes, event.key[:90]))
    rows.sort(reverse=True)
    return {"device_us_per_pass": sum(r[0] for r in rows), "kernels_per_pass": sum(r[1] for r in rows),
            "top": [{"us": round(us, 1), "count": count, "name": name} for us, count, name in rows[:top]]}


def tiny_sharp(device: torch.device, dtype: torch.dtype, vocab: int = 256, seed: int = 5) -> Qwen2ForCausalLM:
    """A tiny random target with sharp logits (its argmaxes are not near-ties)."""
    model = random_model(tiny(vocab), torch.float32, device, seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model.to(dtype)


def sampled_part(device: torch.device, results: dict, samples: int) -> None:
    """Chi-square of the first two sampled tokens (temperature 1) against the target's exact distribution."""
    vocab, prompt = 8, [1, 2, 3, 4, 1, 2, 5, 1, 2, 6, 1, 2]
    target_model = random_model(tiny(vocab), torch.float32, device, seed=7)
    with torch.no_grad():
        target_model.lm_head.weight.mul_(4.0)
    draft_model = perturbed(target_model, noise=0.5, seed=3)
    expected = exact_two_tokens(target_model, prompt).ravel() * samples
    target, draft = CausalLM(target_model, static_cache=True), CausalLM(draft_model, static_cache=True)
    cases = {"chain k=3": (ModelDrafter(draft, min_confidence=0.0), 0),
             "tree budget 6": (ModelDrafter(draft, min_confidence=0.05), 6),
             "ngram": (make_drafter("ngram"), 0)}
    rows = {}
    for name, (drafter, budget) in cases.items():
        decoder = SpeculativeDecoder(target, drafter, k=3, tree_budget=budget, tree_branch=3 if budget else 4)
        counts = np.zeros(vocab * vocab)
        for seed in range(samples):
            a, b = decoder.generate(prompt, SamplingParams(temperature=1.0, seed=seed), 4).token_ids[:2]
            counts[a * vocab + b] += 1
        rows[name] = {"p_value": chi_square_pvalue(counts, expected), "samples": samples}
    results["chi_square"] = rows


def tiny_tokenizer(corpus: list[str], vocab: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `corpus` (`vocab` ids), with chat specials; <|im_end|> ends an answer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")


LIST_REGEX = r"(yes|no)(, (yes|no)){0,3}"
RECORD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                  "b": {"enum": ["x", "y"]}},
                 "required": ["a", "b"], "additionalProperties": False,
                 "x-guidance": {"whitespace_flexible": False}}  # compact: a random model's answer ends


def constrained_part(device: torch.device, results: dict, prompts: int) -> None:
    """Answers under a regex and a JSON schema through the device's path: valid, and greedy spec == ar."""
    if importlib.util.find_spec("llguidance") is None:
        results["constrained"] = {"skipped": "llguidance is not installed here; carry its wheel (module doc)"}
        return
    from specdraft.constraints import Constraint

    tokenizer = tiny_tokenizer(['{"a":12,"b":"x"}', "yes, no, yes"] * 20, vocab=300)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    target_model = tiny_sharp(device, torch.float32, vocab=len(tokenizer))
    target_model.config.eos_token_id = target_model.generation_config.eos_token_id = eos
    draft_model = perturbed(target_model, noise=0.3, seed=1)
    draft_model.config.eos_token_id = draft_model.generation_config.eos_token_id = eos
    target = CausalLM(target_model, tokenizer, name="tiny", static_cache=True)
    draft = CausalLM(draft_model, tokenizer, name="tiny draft", static_cache=True)
    rows = {}
    for name, constraint in (("regex", Constraint.regex(LIST_REGEX)), ("schema", Constraint.json_schema(RECORD_SCHEMA))):
        same = valid = total = 0
        for index in range(prompts):
            prompt = torch.randint(0, len(tokenizer) - 3, (8,), generator=torch.Generator().manual_seed(index)).tolist()
            expected = SpeculativeDecoder(target).generate(prompt, max_new_tokens=40, constraint=constraint).token_ids
            for k, tree in ((3, 0), ("auto", 0), (3, 8)):
                out = SpeculativeDecoder(target, ModelDrafter(draft, min_confidence=0.0), k=k, tree_budget=tree).generate(
                    prompt, max_new_tokens=40, constraint=constraint)
                same += out.token_ids == expected
                valid += out.finish_reason == "stop" and (re.fullmatch(LIST_REGEX, out.text) is not None
                                                          if name == "regex" else bool(constraint.validates(out.text)))
                total += 1
        rows[name] = {"identical": same, "valid": valid, "runs": total}
    results["constrained"] = rows


def table(results: dict) -> str:
    """The check's numbers as a few plain-text lines."""
    lines = [f"device: {results['device']}  torch {results['torch']}  transformers {results['transformers']}"]
    passes = results.get("target_pass_ms", {})
    if "error" not in passes:
        one = passes.get(1)
        lines.append("target pass ms by width: " + ", ".join(f"{w}: {ms:.2f}" for w, ms in passes.items())
                     + (f"  (16 tokens = {passes[16] / one:.2f}x one)" if one and 16 in passes else ""))
    for key in ("target_profile", "draft_profile"):
        if key in results:
            lines.append(f"{key}: {json.dumps(results[key])}")
    for key in ("target_eager_pass_ms", "draft_pass_ms", "c", "fused_kernels", "long_cache_pass_ms", "unfused_pass_ms",
                "load_and_capture_seconds"):
        if key in results:
            lines.append(f"{key}: {results[key]}")
    for key in ("ar", "hf_generate_eager", "hf_generate_static_compiled", "spec_model_drafter_random_weights",
                *(f"oracle_{a}" for a in ALPHAS), f"oracle_{ALPHAS[-1]}_after_hf_compiled"):
        row = results.get(key)
        if row is None:
            continue
        if "error" in row:
            lines.append(f"{key}: {row['error']}")
            continue
        extra = "".join(f"  {name} {row[name]:.2f}" for name in ("speedup", "alpha", "tau", "mean_k")
                        if isinstance(row.get(name), float))
        lines.append(f"{key}: {row['tok_s']:.1f} tok/s ({row['tokens']} tokens){extra}"
                     + (f"  same as ar: {row['same_tokens_as_ar']}" if "same_tokens_as_ar" in row else ""))
    for key, dtype in (("batch_plain", results["dtype"]), ("batch", "torch.float32")):
        batch = results.get(key, {})
        if "error" in batch:
            lines.append(f"{key}: {batch['error']}")
            continue
        if not batch:
            continue
        lines.append(f"{key} ({dtype}), {batch['new_tokens']} tokens a request, 1 / 2 / 4 / 8 / 16 at once (tok/s; "
                     f"alone, one after another: {batch['alone_ar_tok_s']:.1f}):")
        for method in [name.removesuffix("_1") for name in batch if name.endswith("_1")]:
            cells = [batch[f"{method}_{size}"] for size in BATCH_SIZES]
            lines.append(f"  {method}: " + " / ".join(f"{row['tok_s']:.1f}" for row in cells)
                         + ("  vs ar " + " / ".join(f"{row['vs_ar']:.2f}" for row in cells)
                            + "  tau " + " / ".join(f"{row['tau']:.2f}" for row in cells) if "vs_ar" in cells[0] else "")
                         + f"  same as alone: {sum(r['same_as_alone'] for r in cells)}/{sum(BATCH_SIZES)}")
            if "vs_ar" in cells[0]:
                lines.append("    steps of the whole batch (drafting / all, eager): " + " / ".join(
                    f"{row['steps']['drafting_steps']}/{row['steps']['full_steps']},{row['steps']['eager_steps']}"
                    for row in cells))
    chain = results.get("draft_chain", {})
    if chain and "error" not in chain:
        lines.append("draft chain, c per drafted token at k = 1 .. 8: " + " / ".join(
            f"{row['c']:.2f}" for key, row in chain.items() if isinstance(row, dict)))
    elif chain:
        lines.append(f"draft_chain: {chain['error']}")
    for key in ("speed_part", "greedy_part", "sampled_part", "constrained_part"):
        if key in results:
            lines.append(f"{key}: {results[key]}")
    for key in ("greedy_spec_equals_ar", "chi_square", "constrained"):
        if key in results:
            lines.append(f"{key}: {json.dumps(results[key])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes and few tokens (CPU unless --device)")
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out: speed, greedy, sampled, "
                        "constrained, and "
                        "within speed: eager (transformers' eager pass and generate), hf (transformers' "
                        "static-cache compiled generate), profile (the kernel profiles), long (passes over 4,000 and 12,000 "
                        "cached tokens), host (a host-side profile of `ar`), unfused (the passes on "
                        "the torch formulas beside the fused kernels), batch (continuous batching at 1 .. 16 "
                        "requests)")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"))
    shapes = DRY if args.dry_run else FULL
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    skip = {part for part in args.skip.split(",") if part}
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
               "torch": torch.__version__, "transformers": transformers.__version__, "dtype": str(dtype),
               "dry_run": args.dry_run, "shapes": {"target": shapes.target, "draft": shapes.draft}}
    started = time.perf_counter()
    parts = {"greedy": lambda: greedy_part(device, results, prompts=1 if args.dry_run else 5),  # speed last: a
             "sampled": lambda: sampled_part(device, results, shapes.samples),  # fault there ends CUDA for the rest
             "constrained": lambda: constrained_part(device, results, prompts=1 if args.dry_run else 4),
             "speed": lambda: speed_part(shapes, device, dtype, results, skip)}
    for name, part in parts.items():
        if name not in skip:
            print(f"{name} ...", file=sys.stderr, flush=True)
            guarded(results, f"{name}_part", part)
            if results[f"{name}_part"] is None:
                del results[f"{name}_part"]
    results["seconds"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str))
    print(table(results))
    return results


if __name__ == "__main__":
    main()
