"""The `llama-server` peers of `specdraft bench`: llama.cpp's own server, plain and with its own speculation.

| method               | the server runs the target's GGUF file with                      | keys besides sampling's        |
| -------------------- | ---------------------------------------------------------------- | ------------------------------ |
| `llama-server`       | nothing more: plain decoding                                      |                                |
| `llama-server-spec`  | `-md DRAFT --spec-type draft-simple`, DRAFT the run's `--draft` file | `draft-n-max`, `draft-n-min`   |
| `llama-server-ngram` | `--spec-type TYPE` (`spec-type`, default `ngram-simple`; also `ngram-mod`, `ngram-map-k`) | `spec-type`, `ngram-TYPE-*` |

A key `K=V` is llama.cpp's flag `--spec-K V` (`llama-server-spec:draft-n-max=8` runs `--spec-draft-n-max 8`;
`llama-server-ngram:spec-type=ngram-mod;ngram-mod-n-min=8`); a key unset leaves llama.cpp's default (draft-simple
drafts 3 tokens; ngram-simple looks up 12-grams and drafts 48; ngram-mod drafts 48 to 64). An `ngram-TYPE-*` key
must belong to the chosen type, which llama.cpp would otherwise ignore without a word.

What is the same as for `llama-cpp` (`bench.llama_cpp_peer`): the target's GGUF file, our prompt token ids (the
chat template as the bench renders it), the threads (`torch.get_num_threads()`: prompt, generation and draft),
the token budget, stopping at EOS (the tokens are cut after the first of our EOS ids), greedy (temperature 0) or
the same warping (temperature -> top-k -> top-p, seeded). Each prompt is one POST /completion with the token ids,
`cache_prompt: false` (the prompt pass runs, and is timed, every time, as ours) and `return_tokens`.
`wall_seconds` is the request's round trip (prompt pass and generation; loopback HTTP adds well under a
millisecond), `prefill_seconds` the server's own `prompt_ms`, α its `timings` (`draft_n`, `draft_n_accepted`;
a speculative server that drafted nothing reports 0 of 0). The server does not report steps per request (None).
Like `llama-cpp` these methods have their own numerics (`own_numerics`): their greedy output is reported as
agreement with `ar`.

Servers (`bench.llama_server`): one per method setting, started on first use (the runner's warm-up, untimed),
kept in `Models.peers` for the run and started again with a larger context when a prompt needs one (contexts in
multiples of `CONTEXT_STEP`, as `llama-cpp`); `Models.close_peers()` stops them when the run ends, however it ends.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from specdraft.bench.llama_cpp_peer import CONTEXT_STEP, target_gguf
from specdraft.bench.llama_server import LlamaServer, ServerSettings, server_binary
from specdraft.bench.runs import Models, RunOutput, RunParams, cut_at_eos
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingParams

PLAIN, SPEC, NGRAM = "llama-server", "llama-server-spec", "llama-server-ngram"
SPEC_KEYS = ("draft-n-max", "draft-n-min")
NGRAM_TYPES = {  # --spec-type: the keys (--spec-KEY flags) of that type
    "ngram-simple": ("ngram-simple-size-n", "ngram-simple-size-m", "ngram-simple-min-hits"),
    "ngram-map-k": ("ngram-map-k-size-n", "ngram-map-k-size-m", "ngram-map-k-min-hits"),
    "ngram-mod": ("ngram-mod-n-match", "ngram-mod-n-min", "ngram-mod-n-max"),
}
DEFAULT_NGRAM = "ngram-simple"
NGRAM_KEYS = ("spec-type",) + tuple(key for keys in NGRAM_TYPES.values() for key in keys)
KEYS = {PLAIN: (), SPEC: SPEC_KEYS, NGRAM: NGRAM_KEYS}  # each method's own keys
OPTION_TYPES = {key: (str if key == "spec-type" else int) for key in SPEC_KEYS + NGRAM_KEYS}


def check_options(method: str, options: dict, label: str) -> tuple[tuple[str, object], ...]:
    """The method's own keys among `options`, checked (a whole number >= 0, a known type, keys of that type), as
    `RunParams.peer_options`."""
    given = {key: value for key, value in options.items() if key in KEYS.get(method, ())}
    for key, value in given.items():
        if key != "spec-type" and value < 0:
            raise SpecdraftError(f"{key} must be >= 0 in method {label!r}, got {value}.")
    if method == NGRAM:
        kind = str(given.get("spec-type", DEFAULT_NGRAM))
        if kind not in NGRAM_TYPES:
            raise SpecdraftError(f"spec-type must be one of {', '.join(NGRAM_TYPES)} in method {label!r}, got {kind!r}.")
        stray = [key for key in given if key != "spec-type" and key not in NGRAM_TYPES[kind]]
        if stray:
            raise SpecdraftError(f"{stray[0]} is not an option of {kind} in method {label!r}; {kind} takes "
                                 f"{', '.join(NGRAM_TYPES[kind])}.")
    return tuple(sorted(given.items()))


def spec_flags(method: str, peer_options: tuple[tuple[str, object], ...], draft: Path | None = None) -> tuple[str, ...]:
    """llama.cpp's speculation flags for `method` with its keys (`draft`: the draft file, for `llama-server-spec`)."""
    options = dict(peer_options)
    if method == PLAIN:
        return ()
    if method == SPEC:
        if draft is None:
            raise SpecdraftError(f"Method {SPEC} needs the draft's GGUF file.")
        flags = ["-md", str(draft), "--spec-type", "draft-simple"]
    else:
        flags = ["--spec-type", str(options.pop("spec-type", DEFAULT_NGRAM))]
    for key, value in sorted(options.items()):
        flags += [f"--spec-{key}", str(value)]
    return tuple(flags)


def sampling_body(sampling: SamplingParams) -> dict:
    """The request's sampling: our warping order (temperature -> top-k -> top-p), nothing else, seeded; temperature
    0 keeps only the top token (greedy)."""
    return {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": 0.0,
            "seed": sampling.seed, "samplers": ["temperature", "top_k", "top_p"]}


def completion_body(prompt_ids: list[int], params: RunParams) -> dict:
    """One /completion request: our prompt token ids, the budget, no prompt reuse, the generated ids returned."""
    return {"prompt": list(prompt_ids), "n_predict": params.max_new_tokens, "cache_prompt": False,
            "return_tokens": True, "stream": False} | sampling_body(params.sampling)


def draft_counts(method: str, timings: dict) -> tuple[int | None, int | None]:
    """(drafted, accepted) from the server's timings: None for plain decoding, 0 of 0 where nothing was drafted."""
    if method == PLAIN:
        return None, None
    return int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))


def run_output(method: str, answer: dict, wall: float, eos_ids: set[int]) -> RunOutput:
    """A RunOutput from a /completion answer and the request's round trip."""
    if "tokens" not in answer:
        raise SpecdraftError(f"llama-server's answer has no token ids (`return_tokens`): {str(answer)[:300]}")
    timings = answer.get("timings") or {}
    drafted, accepted = draft_counts(method, timings)
    prefill = timings.get("prompt_ms")
    return RunOutput(cut_at_eos([int(t) for t in answer["tokens"]], eos_ids), wall, drafted=drafted, accepted=accepted,
                     prefill_seconds=None if prefill is None else prefill / 1000)


def check(target_spec: str) -> None:
    """Fail before any model loads when these methods cannot run: no GGUF target, or no llama-server."""
    target_gguf(target_spec, PLAIN)
    server_binary()


def _server(models: Models, method: str, params: RunParams, needed: int) -> LlamaServer:
    """The run's server of this method setting, with room for `needed` tokens (started, or reused)."""
    draft = target_gguf(models.draft_spec, SPEC, role="draft") if method == SPEC else None
    flags = spec_flags(method, params.peer_options, draft)
    key = " ".join((PLAIN, *flags))  # one server per setting
    server = models.peers.get(key)
    threads = torch.get_num_threads()
    if server is not None and server.settings.context >= needed and server.settings.threads == threads:
        return server
    if server is not None:
        models.peers.pop(key).close()
    context = -(-needed // CONTEXT_STEP) * CONTEXT_STEP
    server = LlamaServer(ServerSettings(target_gguf(models.target_spec, method), threads, context, spec=flags))
    models.peers[key] = server
    return server


def run(method: str, models: Models, prompt_ids: list[int], params: RunParams) -> RunOutput:
    """One generation of `method` (a name of `KEYS`) from our prompt token ids."""
    server = _server(models, method, params, len(prompt_ids) + params.max_new_tokens + 2)
    body = completion_body(prompt_ids, params)
    started = time.perf_counter()
    answer = server.post("/completion", body)
    wall = time.perf_counter() - started
    return run_output(method, answer, wall, models.target.eos_token_ids)
