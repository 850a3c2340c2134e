"""The methods a benchmark compares, chosen by name from a registry, and how each one runs.

A method is written `NAME` or `NAME:key=value;key=value`, the keys being `specdraft generate`'s
option names without their dashes (`spec:k=8`, `hf-ar:temperature=0.7;seed=3`); its label in
every output is the whole string. Every method runs on the same loaded weights (`llama-cpp`
on the same GGUF file, loaded by llama.cpp) and takes a prompt as token ids, so all of them
see exactly the same input.

| name               | what runs                                                          |
| ------------------ | ------------------------------------------------------------------ |
| `ar`               | `SpeculativeDecoder(target)`: plain decoding, our loop              |
| `spec`             | `SpeculativeDecoder(target, drafter, k)`: `drafter=NAME` (default `model`, the draft model; `ngram`, `ngram+model`, ...); `tree-budget=N;tree-branch=B` drafts trees; `draft=PATH` another draft model than the run's `--draft` |
| `hf-ar`            | transformers `generate` (greedy, or sampling with the same warping) |
| `hf-assisted`      | transformers assisted generation with the same draft model          |
| `hf-prompt-lookup` | transformers prompt lookup decoding                                 |
| `llama-cpp`        | llama.cpp (llama-cpp-python) plain decoding of the target's GGUF    |
| `llama-server`     | llama.cpp's server, plain decoding of the target's GGUF             |
| `llama-server-spec`| llama.cpp's server with its draft-model speculation (the run's draft GGUF; `draft-n-max`, `draft-n-min`) |
| `llama-server-ngram` | llama.cpp's server with its n-gram speculation (`spec-type`, `ngram-TYPE-*`) |

A prompt with a `schema` (`prompts`) is answered under that JSON schema by `ar` and `spec`, the only methods that
follow one (`constraints`); `schema=0` runs them on the same prompts without it (`spec:schema=0`, the speed of the
unconstrained answer). The other methods refuse such prompts.

`spec:drafter=oracle;oracle-alpha=A` (greedy only) is a synthetic-acceptance measurement, not a
drafter: before each timed run an untimed `ar` run of the same prompt and budget is recorded,
and the `oracle` drafter proposes those very tokens, each wrong with probability 1 − A
(`drafters.oracle`). Its speedup is what the machinery makes of per-token acceptance A on these
weights. The method string must give `oracle-alpha`, so the label says what was simulated.

For the transformers methods `k` means `num_assistant_tokens` (with a constant schedule and
no confidence cut-off; unset, transformers' own defaults apply) or `prompt_lookup_num_tokens`
(default 10); their steps, drafted and accepted counts, draft and verify times and k are not
reported (None).

`llama-cpp` (see `bench.llama_cpp_peer`) needs a GGUF target and llama-cpp-python (`make
peers`); it runs with its own numerics, so it is marked `own_numerics`: its greedy output is
reported as agreement with `ar`, not judged for exactness. So are the `llama-server` methods (see
`bench.llama_server_peer`: a llama-server started by the bench, its keys llama.cpp's `--spec-KEY` flags).
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from specdraft.bench import llama_server_peer
from specdraft.bench.runs import Models, RunOutput, RunParams, cut_at_eos
from specdraft.constraints import Constraint
from specdraft.drafters import DEFAULT_DRAFTER, DRAFTERS, check_drafter, drafter_parts, make_drafter, needs_draft_model
from specdraft.drafters.base import Drafter
from specdraft.drafters.oracle import OracleDrafter
from specdraft.engine import DEFAULT_K, DEFAULT_TREE_BRANCH, build_decoder, check_tree_options
from specdraft.policy import AUTO, make_policy
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.models.draft_head import draft_vocab_value
from specdraft.models.gguf_native import transformers_view
from specdraft.models.loading import DRAFT_QUANTS
from specdraft.run import sync_device
from specdraft.sampling import SamplingParams

PROMPT_LOOKUP_K = 10  # transformers' usual prompt_lookup_num_tokens
ORACLE = OracleDrafter.name  # the bench-only drafter of synthetic acceptance (recorded before each run)

# Option keys (generate's option names without dashes) and how their values are read.
def k_value(text: str) -> int | str:
    """A method's k: `auto` or a whole number."""
    return AUTO if text.strip().lower() == AUTO else int(text)


OPTION_TYPES: dict[str, Callable] = {"k": k_value, "temperature": float, "top-k": int, "top-p": float, "seed": int,
                                 "draft-quant": str, "draft-vocab": draft_vocab_value, "drafter": str, "tree-budget": int,
                                 "tree-branch": int, "draft": str, "schema": int}
# Every registered drafter's options, read as their defaults' types (`ngram-max=3`, `draft-confidence=0.2`).
DRAFTER_KEYS = tuple(sorted({key for info in DRAFTERS.values() for key in info.options}))
OPTION_TYPES.update({key: type(option.default) for info in DRAFTERS.values() for key, option in info.options.items()})
OPTION_TYPES.update(llama_server_peer.OPTION_TYPES)  # the llama-server peers' keys: llama.cpp's --spec-KEY flags
SAMPLING_KEYS = ("temperature", "top-k", "top-p", "seed")


@dataclass(frozen=True)
class MethodInfo:
    """A registered method: a one-line description, the option keys it takes, and how it runs.

    `check(target_spec)`, when set, raises SpecdraftError before any model loads if the method
    cannot run (a missing optional package, a target of the wrong kind). `own_numerics`: the
    method computes the target with other kernels than ours, so its greedy output is compared
    with `ar` for agreement but not held to exactness.
    """

    description: str
    keys: tuple[str, ...]
    needs_draft: bool
    run: Callable[[Models, list[int], RunParams], RunOutput]
    check: Callable[[str], None] | None = None
    own_numerics: bool = False
    constrains: bool = False  # it follows a prompt's JSON schema (`run` takes `constraint=`)


@dataclass
class MethodSpec:
    """A parsed method string: its label (the whole string), registry name and options."""

    label: str
    name: str
    options: dict[str, int | float] = field(default_factory=dict)

    @property
    def info(self) -> MethodInfo:
        """The registry entry of this method."""
        return METHODS[self.name]

    @property
    def follows_schema(self) -> bool:
        """Whether it answers a prompt with a schema under that schema (`schema=0` turns it off)."""
        return self.info.constrains and self.options.get("schema", 1) != 0

    @property
    def draft_quant(self) -> str:
        """The draft's weights this method asks for (`draft-quant`; spec: `auto`, the rest `none`)."""
        return str(self.options.get("draft-quant", "auto" if self.name == "spec" else "none"))

    @property
    def needs_draft(self) -> bool:
        """Whether this method runs the draft model (for spec: whether its drafter does)."""
        if "draft" in self.options:
            return False
        if self.name == "spec":
            return needs_draft_model(str(self.options.get("drafter", DEFAULT_DRAFTER)))
        return self.info.needs_draft

    @property
    def other_draft(self) -> str:
        """The draft model this method names with `draft=` ("" when it uses the run's, or none)."""
        if self.name == "spec" and not needs_draft_model(str(self.options.get("drafter", DEFAULT_DRAFTER))):
            return ""
        return str(self.options.get("draft", ""))

    def sampling(self, temperature: float = 0.0, seed: int = 0) -> SamplingParams:
        """The method's sampling: the run-wide temperature and seed unless the method sets its own."""
        return SamplingParams(
            temperature=float(self.options.get("temperature", temperature)),
            top_k=int(self.options.get("top-k", 0)),
            top_p=float(self.options.get("top-p", 1.0)),
            seed=int(self.options.get("seed", seed)),
        )

    def params(self, max_new_tokens: int, temperature: float = 0.0, seed: int = 0) -> RunParams:
        """Everything a run of this method needs besides the prompt (validated)."""
        k = self.options.get("k")
        if k == AUTO and self.name != "spec":
            raise SpecdraftError(f"k=auto is for spec only; give {self.name} a whole number in {self.label!r}.")
        if k is not None and k != AUTO and k < 1:
            raise SpecdraftError(f"k must be >= 1 or auto in method {self.label!r}, got {k}.")
        quant = self.draft_quant
        if quant not in DRAFT_QUANTS:
            raise SpecdraftError(f"draft-quant must be one of {', '.join(DRAFT_QUANTS)} in {self.label!r}, got {quant!r}.")
        vocab = self.options.get("draft-vocab", AUTO if self.name == "spec" else 0)
        drafter = str(self.options.get("drafter", DEFAULT_DRAFTER))
        given = {key: value for key, value in self.options.items() if key in DRAFTER_KEYS}
        try:
            check_drafter(drafter, given)
        except SpecdraftError as error:
            raise SpecdraftError(f"{error} (in method {self.label!r})") from None
        if self.name == "spec" and ORACLE in drafter_parts(drafter):
            self._check_oracle(drafter, temperature)
        budget, branch = int(self.options.get("tree-budget", 0)), int(self.options.get("tree-branch", DEFAULT_TREE_BRANCH))
        try:
            check_tree_options(budget, branch)
        except SpecdraftError as error:
            raise SpecdraftError(f"{error} (in method {self.label!r})") from None
        peer_options = llama_server_peer.check_options(self.name, self.options, self.label)
        return RunParams(self.sampling(temperature, seed), max_new_tokens, k, quant, vocab, drafter,
                         tuple(sorted(given.items())), budget, branch, self.other_draft, peer_options)

    def _check_oracle(self, drafter: str, temperature: float) -> None:
        """The oracle measures alone, greedy, and its label names the α it simulates (module doc)."""
        if drafter != ORACLE:
            raise SpecdraftError(f"The oracle drafter measures alone; give drafter=oracle, not {drafter!r} "
                                 f"(in method {self.label!r}).")
        if not self.sampling(temperature).greedy:
            raise SpecdraftError(f"The oracle drafter measures greedy runs only; drop temperature (or set it to 0) "
                                 f"in method {self.label!r} and for the run.")
        if "oracle-alpha" not in self.options:
            raise SpecdraftError(f"Give the oracle's acceptance in the method, e.g. "
                                 f"{self.label.rstrip(';')};oracle-alpha=0.8, so its label says what it simulates.")
        try:  # its values, before anything loads
            OracleDrafter(self.options["oracle-alpha"], self.options.get("oracle-seed", 0))
        except SpecdraftError as error:
            raise SpecdraftError(f"{error} (in method {self.label!r})") from None


# ----- running one generation ---------------------------------------------------------------------
def _drafter(models: Models, params: RunParams) -> Drafter:
    """The drafter of these settings, made once per run (so a suffix drafter remembers earlier prompts)."""
    if params not in models.drafters:
        draft = (models.draft_as(params.draft_quant, params.draft_vocab, params.draft)
                 if needs_draft_model(params.drafter) else None)
        models.drafters[params] = make_drafter(params.drafter, dict(params.drafter_options), draft_model=draft,
                                               target_model=models.target)
    return models.drafters[params]


def _run_ours(models: Models, prompt_ids: list[int], params: RunParams, drafter: bool,
              constraint: Constraint | None = None) -> RunOutput:
    target = models.target
    if drafter:
        k = params.k or DEFAULT_K
        if k == AUTO:  # one policy per draft setting: its measurements carry over from prompt to prompt
            setting = (params.drafter, params.drafter_options, params.draft, params.draft_quant, params.draft_vocab,
                       params.tree_budget, params.tree_branch)
            if setting not in models.policies:
                models.policies[setting] = make_policy(AUTO, params.tree_budget)
            k = models.policies[setting]
        decoder = build_decoder(target, _drafter(models, params), k=k, tree_budget=params.tree_budget,
                                tree_branch=params.tree_branch)
    else:
        decoder = build_decoder(target)
    sync_device(target.device)
    started = time.perf_counter()
    completion = decoder.generate(prompt_ids, params.sampling, params.max_new_tokens, constraint=constraint)
    sync_device(target.device)
    wall = time.perf_counter() - started
    stats = completion.stats
    return RunOutput(completion.token_ids, wall, steps=stats.steps, drafted=stats.drafted, accepted=stats.accepted,
                     accepted_at=list(stats.accepted_at), drafted_at=list(stats.drafted_at),
                     draft_seconds=stats.draft_seconds, verify_seconds=stats.verify_seconds,
                     k=max(stats.k_per_step, default=0) or None, k_per_step=list(stats.k_per_step),
                     by_source=stats.by_source(), prefill_seconds=stats.prefill_seconds,
                     forced_tokens=stats.forced_tokens, mask_seconds=stats.mask_seconds)


def run_ar(models: Models, prompt_ids: list[int], params: RunParams, constraint: Constraint | None = None) -> RunOutput:
    """Plain decoding with our loop (no drafter)."""
    return _run_ours(models, prompt_ids, params, drafter=False, constraint=constraint)


def run_spec(models: Models, prompt_ids: list[int], params: RunParams,
             constraint: Constraint | None = None) -> RunOutput:
    """Speculative decoding: the method's drafter proposes up to `k` tokens a step. The `oracle` drafter first
    gets an untimed `ar` run of the prompt under the same settings to read its tokens from."""
    drafter = _drafter(models, params)
    if isinstance(drafter, OracleDrafter):
        recorded = _run_ours(models, prompt_ids, params, drafter=False, constraint=constraint)
        drafter.record(prompt_ids + recorded.token_ids)
    return _run_ours(models, prompt_ids, params, drafter=True, constraint=constraint)


def hf_generate_kwargs(target: CausalLM, params: RunParams) -> dict:
    """Keyword arguments for transformers' `generate` that match our decoding settings exactly.

    Everything that could otherwise come from the checkpoint's generation_config (a repetition
    penalty, default top-k 50, min-p) is set explicitly, so the peers warp as our loop does.
    """
    eos = sorted(target.eos_token_ids)
    pad = getattr(target.tokenizer, "pad_token_id", None)
    kwargs: dict = {
        "max_new_tokens": params.max_new_tokens,
        "eos_token_id": eos or None,
        "pad_token_id": pad if pad is not None else (eos[0] if eos else None),
        "repetition_penalty": 1.0,
        "no_repeat_ngram_size": 0,
    }
    sampling = params.sampling
    if sampling.greedy:
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k,
                      top_p=sampling.top_p, min_p=None, typical_p=1.0)
    return kwargs


@contextlib.contextmanager
def _assistant_tokens(draft: CausalLM, k: int | None) -> Iterator[None]:
    """With `k`, make transformers draft exactly `k` tokens a step (constant schedule, no confidence cut)."""
    if k is None:
        yield
        return
    config = transformers_view(draft.model).generation_config
    names = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    saved = {name: getattr(config, name, None) for name in names}
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
    config.assistant_confidence_threshold = 0.0
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' notices for one call (its assisted path warns about its own internal kwargs)."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


def _run_hf(models: Models, prompt_ids: list[int], params: RunParams, **extra) -> RunOutput:
    target = models.target
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=target.device)  # [1, L]
    attention_mask = torch.ones_like(input_ids)  # [1, L]
    kwargs = hf_generate_kwargs(target, params)
    if not params.sampling.greedy:
        torch.manual_seed(params.sampling.seed)  # transformers samples from the global generator
    with torch.inference_mode(), _quiet_transformers():
        sync_device(target.device)
        started = time.perf_counter()
        output = transformers_view(target.model).generate(input_ids, attention_mask=attention_mask, **kwargs,
                                                          **extra)  # [1, L + n]
        sync_device(target.device)
        wall = time.perf_counter() - started
    new_ids = cut_at_eos(output[0, len(prompt_ids):].tolist(), target.eos_token_ids)
    return RunOutput(new_ids, wall)


def run_hf_ar(models: Models, prompt_ids: list[int], params: RunParams) -> RunOutput:
    """transformers `generate` without a drafter."""
    return _run_hf(models, prompt_ids, params)


def run_hf_assisted(models: Models, prompt_ids: list[int], params: RunParams) -> RunOutput:
    """transformers assisted generation with the shared draft model."""
    draft = models.draft_as(params.draft_quant, name=params.draft)
    with _assistant_tokens(draft, params.k):
        return _run_hf(models, prompt_ids, params, assistant_model=transformers_view(draft.model))


def run_hf_prompt_lookup(models: Models, prompt_ids: list[int], params: RunParams) -> RunOutput:
    """transformers prompt lookup decoding (n-gram matches in the prompt and output so far)."""
    return _run_hf(models, prompt_ids, params, prompt_lookup_num_tokens=params.k or PROMPT_LOOKUP_K)


def run_llama_cpp(models: Models, prompt_ids: list[int], params: RunParams) -> RunOutput:
    """llama.cpp's plain decoding of the target's GGUF file (see bench.llama_cpp_peer; imported on use)."""
    from specdraft.bench import llama_cpp_peer

    return llama_cpp_peer.run_llama_cpp(models, prompt_ids, params)


def check_llama_cpp(target_spec: str) -> None:
    """Raise SpecdraftError unless the target is a GGUF file and llama-cpp-python imports."""
    from specdraft.bench import llama_cpp_peer

    llama_cpp_peer.check(target_spec)


METHODS: dict[str, MethodInfo] = {
    "ar": MethodInfo("plain decoding with specdraft's loop", SAMPLING_KEYS + ("schema",), False, run_ar,
                     constrains=True),
    "spec": MethodInfo("specdraft speculative decoding (drafter=NAME, default the draft model, int4 on CPU)",
                       ("k", "drafter", "draft", "draft-quant", "draft-vocab", "tree-budget", "tree-branch", "schema")
                       + DRAFTER_KEYS + SAMPLING_KEYS, True, run_spec, constrains=True),
    "hf-ar": MethodInfo("transformers generate", SAMPLING_KEYS, False, run_hf_ar),
    "hf-assisted": MethodInfo("transformers assisted generation with the draft model (bf16 unless draft-quant)",
                              ("k", "draft", "draft-quant") + SAMPLING_KEYS,
                              True, run_hf_assisted),
    "hf-prompt-lookup": MethodInfo("transformers prompt lookup decoding", ("k",) + SAMPLING_KEYS, False,
                                   run_hf_prompt_lookup),
    "llama-cpp": MethodInfo("llama.cpp plain decoding of the target's GGUF file (needs `make peers`)", SAMPLING_KEYS,
                            False, run_llama_cpp, check=check_llama_cpp, own_numerics=True),
    **{name: MethodInfo(description, SAMPLING_KEYS + llama_server_peer.KEYS[name], name == llama_server_peer.SPEC,
                        functools.partial(llama_server_peer.run, name), check=llama_server_peer.check,
                        own_numerics=True)
       for name, description in (
           (llama_server_peer.PLAIN, "llama.cpp's llama-server, plain decoding of the target's GGUF file"),
           (llama_server_peer.SPEC, "llama-server with the draft's GGUF file (--spec-type draft-simple; "
                                    "draft-n-max, draft-n-min)"),
           (llama_server_peer.NGRAM, "llama-server with n-gram speculation (spec-type: ngram-simple, ngram-mod, "
                                     "ngram-map-k)"))},
}


# ----- parsing method strings ------------------------------------------------------------------------
def _read_value(key: str, value: str, label: str) -> int | float:
    kind = OPTION_TYPES[key]
    try:
        return kind(value)
    except ValueError:
        what = {int: "a whole number", k_value: "auto or a whole number"}.get(kind, "a number")
        raise SpecdraftError(f"{key} must be {what} in method {label!r}, got {value!r}.") from None
    except SpecdraftError as error:
        raise SpecdraftError(f"{error} (in method {label!r})") from None


def parse_method(text: str) -> MethodSpec:
    """Parse `NAME` or `NAME:key=value;key=value` into a MethodSpec (label = the whole string)."""
    label = text.strip()
    name, _, rest = label.partition(":")
    name = name.strip()
    if name not in METHODS:
        raise SpecdraftError(f"Unknown method {name!r} in {label!r}; choose from: {', '.join(METHODS)}.")
    info = METHODS[name]
    options: dict[str, int | float] = {}
    for part in filter(None, (p.strip() for p in rest.split(";"))):
        key, eq, value = (s.strip() for s in part.partition("="))
        if not eq or not key or not value:
            raise SpecdraftError(f"Method options are key=value pairs separated by ';'; got {part!r} in {label!r}.")
        if key not in info.keys:
            raise SpecdraftError(f"Unknown option {key!r} for method {name!r} in {label!r}; "
                                 f"{name} takes: {', '.join(info.keys)}.")
        if key in options:
            raise SpecdraftError(f"Option {key!r} is given twice in {label!r}.")
        options[key] = _read_value(key, value, label)
    return MethodSpec(label, name, options)


def parse_methods(text: str) -> list[MethodSpec]:
    """Parse a comma list of methods; labels must be distinct."""
    specs = [parse_method(part) for part in text.split(",") if part.strip()]
    if not specs:
        raise SpecdraftError(f"No methods given; choose from: {', '.join(METHODS)}.")
    labels = [s.label for s in specs]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise SpecdraftError(f"Method {repeated[0]!r} is listed twice.")
    return specs
