"""Drafters, chosen by name from a registry (never by `if method == ...`).

A name may compose registered drafters with `+`: `ngram+model` asks `ngram` first and lets
`model` draft whenever `ngram` has nothing to propose (or the policy turns it down).
Options are keyed by their CLI names without dashes (`ngram-max`, `exit-layer`, ...); each
drafter reads the ones it knows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from specdraft.drafters.base import Draft, DraftContext, Drafter
from specdraft.drafters.composed import ComposedDrafter
from specdraft.drafters.dflash import DFlashDrafter
from specdraft.drafters.eagle import EagleDrafter
from specdraft.drafters.eagle3 import Eagle3Drafter
from specdraft.drafters.early_exit import EarlyExitDrafter
from specdraft.drafters.medusa import MedusaDrafter
from specdraft.drafters.model import DEFAULT_CATCH_UP, DEFAULT_CONTEXT, DEFAULT_MIN_CONFIDENCE, ModelDrafter
from specdraft.drafters.mtp import MtpDrafter
from specdraft.drafters.ngram import DEFAULT_MAX_N, DEFAULT_MIN_N, NgramDrafter
from specdraft.drafters.oracle import DEFAULT_ALPHA as ORACLE_ALPHA, DEFAULT_SEED as ORACLE_SEED, OracleDrafter
from specdraft.drafters.suffix import (DEFAULT_MAX_REQUESTS, DEFAULT_MAX_SPEC_FACTOR, DEFAULT_MIN_MATCH,
                                       DEFAULT_MIN_SCORE, SuffixDrafter, SuffixMemory)
from specdraft.errors import SpecdraftError


# Prompt lookup where it finds a match and the cost model finds it worth a draft, else the draft model.
# Measured (docs/benchmarks/2026-11-fused-decoder-all-drafters, 28 prompts): 1.25x ar overall against 1.17x
# for `model` alone, no category below 1.01x (`model`: summarization 0.94x).
DEFAULT_DRAFTER = "ngram+model"


@dataclass(frozen=True)
class Option:
    """A drafter option, declared once: its default (whose type is the option's), what it does, and its least value
    (None: any). The CLI's `--KEY` flags of `generate` and `serve`, `specdraft drafters`, the bench's method keys
    and the server's defaults all come from these."""

    default: Any
    help: str
    minimum: float | None = None


@dataclass(frozen=True)
class DrafterInfo:
    """A registered drafter: a one-line description, its options (by key: `--KEY` on the command line) and how to
    build it.

    `build(options, draft_model=..., target_model=...)` gets every option of `options` filled in (the values).
    `bench_only`: a measuring tool `specdraft bench` alone can feed (`generate` and `serve` refuse it).
    `remembers_requests`: one drafter learns from the earlier requests it drafted for (cross-request memory, which
    a server partitions by `cache_salt`; `make_drafter(remember=False)` builds it without).
    """

    description: str
    build: Callable[..., Drafter]
    needs_draft_model: bool
    options: dict[str, Option]
    bench_only: bool = False
    remembers_requests: bool = False


def _build_model(options: dict, draft_model=None, **_resources) -> Drafter:
    if draft_model is None:
        raise SpecdraftError("The 'model' drafter needs a draft model: pass --draft NAME_OR_PATH.")
    return ModelDrafter(draft_model, min_confidence=options["draft-confidence"], context=options["draft-context"],
                        catch_up=options["draft-catch-up"])


def _build_ngram(options: dict, **_resources) -> Drafter:
    return NgramDrafter(max_n=options["ngram-max"], min_n=options["ngram-min"])


def _build_suffix(options: dict, remember: bool = True, memory: dict | None = None, **_resources) -> Drafter:
    shared = memory.setdefault("suffix", SuffixMemory()) if memory is not None and remember else None
    return SuffixDrafter(min_match=options["suffix-min-match"], min_score=options["suffix-min-score"],
                         max_spec_factor=options["suffix-factor"], max_requests=DEFAULT_MAX_REQUESTS if remember else 0,
                         memory=shared)


def _build_oracle(options: dict, **_resources) -> Drafter:
    return OracleDrafter(alpha=options["oracle-alpha"], seed=options["oracle-seed"])


def _build_early_exit(options: dict, target_model=None, **_resources) -> Drafter:
    if target_model is None:
        raise SpecdraftError("The 'early-exit' drafter needs the target model it drafts for.")
    return EarlyExitDrafter(target_model, exit_layer=options["exit-layer"] or None,
                            min_confidence=options["draft-confidence"])


def _trained(kind: str, options: dict, target_model):
    from specdraft.models.trained import load_trained

    if target_model is None:
        raise SpecdraftError(f"The '{kind}' drafter needs the target model it was trained for.")
    return load_trained(options["trained"], kind, target_model.name, target_model.config.hidden_size,
                        dtype=target_model.dtype, device=target_model.device)


def _built_once(kind: str, options: dict, shared: dict | None, build):
    """A trained drafter of its own for this sequence; with `shared` (a batch's: one dict for all its sequences)
    the weights are loaded and packed once and each call gets a `sibling` over them."""
    if shared is None:
        return build()
    key = (kind, options["trained"], options["draft-confidence"])
    if key not in shared:
        shared[key] = build()
    return shared[key].sibling()


def _build_medusa(options: dict, target_model=None, shared=None, **_resources) -> Drafter:
    def build():
        trained = _trained("medusa", options, target_model)
        return MedusaDrafter(target_model, trained.module, trained.vocab_ids, options["draft-confidence"])
    return _built_once("medusa", options, shared, build)


def _build_eagle(options: dict, target_model=None, shared=None, **_resources) -> Drafter:
    def build():
        trained = _trained("eagle", options, target_model)
        return EagleDrafter(target_model, trained.module, trained.vocab_ids, options["draft-confidence"])
    return _built_once("eagle", options, shared, build)


def _build_eagle3(options: dict, target_model=None, shared=None, **_resources) -> Drafter:
    def build():
        from specdraft.models.eagle3_loading import load_eagle3

        if target_model is None:
            raise SpecdraftError("The 'eagle3' drafter needs the target model its head was trained for.")
        if not options["trained"]:
            raise SpecdraftError("The 'eagle3' drafter runs a published EAGLE-3 head: pass --trained PATH, a SpecForge "
                                 "or speculators checkpoint folder (config.json and model.safetensors) or the GGUF "
                                 "llama.cpp's convert_hf_to_gguf.py --target-model-dir makes of one.")
        model = load_eagle3(options["trained"], dtype=target_model.dtype, device=target_model.device)
        return Eagle3Drafter(target_model, model, options["draft-confidence"])
    return _built_once("eagle3", options, shared, build)


def _build_dflash(options: dict, target_model=None, shared=None, **_resources) -> Drafter:
    def build():
        from specdraft.models.dflash_loading import load_dflash

        if target_model is None:
            raise SpecdraftError("The 'dflash' drafter needs the target model its draft was trained for.")
        if not options["trained"]:
            raise SpecdraftError("The 'dflash' drafter runs a published DFlash draft: pass --trained PATH, its "
                                 "checkpoint folder (config.json and model.safetensors).")
        model = load_dflash(options["trained"], dtype=target_model.dtype, device=target_model.device)
        return DFlashDrafter(target_model, model, options["draft-confidence"])
    return _built_once("dflash", options, shared, build)


def _build_mtp(options: dict, target_model=None, shared=None, **_resources) -> Drafter:
    def build():
        from pathlib import Path

        from specdraft.models.mtp_loading import full_target_head, load_mtp

        if target_model is None:
            raise SpecdraftError("The 'mtp' drafter needs the target model whose MTP layer it runs.")
        path = options["trained"] or target_model.name  # default: the target's own checkpoint folder
        if not Path(path).is_dir() and not options["trained"]:
            raise SpecdraftError(f"The 'mtp' drafter reads the MTP layer from the target's checkpoint folder; "
                                 f"{target_model.name} is not one: pass --trained FOLDER.")
        model = load_mtp(path, full_target_head(target_model), dtype=target_model.dtype, device=target_model.device)
        return MtpDrafter(target_model, model, options["draft-confidence"])
    return _built_once("mtp", options, shared, build)


CONFIDENCE = Option(DEFAULT_MIN_CONFIDENCE, "stop a draft once the drafter's own estimate that the whole draft is "
                    "accepted falls below this (0 = always k)")
TRAINED = Option("", "a trained drafter: for medusa and eagle a file from `specdraft train` (default: the one shipped "
                 "for the target); for eagle3 a published EAGLE-3 head, its checkpoint folder (SpecForge or "
                 "speculators) or its llama.cpp GGUF (required); for dflash a DFlash checkpoint folder (required); "
                 "for mtp the checkpoint folder that carries the model's MTP layers (default: the target's own "
                 "folder)")

DRAFTERS: dict[str, DrafterInfo] = {
    "model": DrafterInfo("a smaller LM of the same vocabulary drafts token by token (its own KV cache)",
                         _build_model, True, {
                             "draft-confidence": CONFIDENCE,
                             "draft-context": Option(DEFAULT_CONTEXT, "the draft's first read takes at most the prompt's "
                                                     "last N tokens (its prefill is the largest cost on long prompts; the "
                                                     "output is unchanged; 0 = all)", 0),
                             "draft-catch-up": Option(DEFAULT_CATCH_UP, "after plain steps the draft reads at most "
                                                      "the last N tokens it missed, after what it holds (0 = all, up "
                                                      "to --draft-context)", 0)}),
    "ngram": DrafterInfo("prompt lookup: proposes what followed the last n tokens earlier in prompt or output "
                         "(no model, c ≈ 0)", _build_ngram, False, {
                             "ngram-max": Option(DEFAULT_MAX_N, "longest tail to look up"),
                             "ngram-min": Option(DEFAULT_MIN_N, "shortest tail to look up")}),
    "suffix": DrafterInfo("suffix decoding: the most frequent continuation of the longest matches in this request "
                          "and in earlier ones (remembered across requests; no model, c ≈ 0)", _build_suffix, False, {
                              "suffix-min-match": Option(DEFAULT_MIN_MATCH, "shortest match that may propose"),
                              "suffix-min-score": Option(DEFAULT_MIN_SCORE, "stop a draft once its estimated "
                                                         "survival falls below this"),
                              "suffix-factor": Option(DEFAULT_MAX_SPEC_FACTOR, "at most this many draft tokens per "
                                                      "matched token")}, remembers_requests=True),
    "early-exit": DrafterInfo("self-speculation: the target's first L layers, final norm and LM head draft (shared "
                              "weights; accepts little unless the model was trained for early exit)",
                              _build_early_exit, False, {
                                  "exit-layer": Option(0, "draft with the target's first L layers (0: 3/4 of them; "
                                                       "choose by `specdraft diagnose --draft early-exit:L`)"),
                                  "draft-confidence": CONFIDENCE}),
    "medusa": DrafterInfo("Medusa heads trained on the target's hidden states: every draft position from one small "
                          "pass over the target's last feature (chain or tree; --trained FILE, default the shipped ones)",
                          _build_medusa, False, {"trained": TRAINED, "draft-confidence": CONFIDENCE}),
    "eagle": DrafterInfo("EAGLE feature drafter: one trained decoder layer extrapolates the target's hidden states, "
                         "reading them from its verification passes (--trained FILE, default the shipped one)",
                         _build_eagle, False, {"trained": TRAINED, "draft-confidence": CONFIDENCE}),
    "eagle3": DrafterInfo("a published EAGLE-3 head (SpecForge, speculators or its llama.cpp GGUF): fuses three of the "
                          "target's layers, drafts chains or trees over its draft vocabulary (--trained PATH)",
                          _build_eagle3, False, {"trained": TRAINED, "draft-confidence": CONFIDENCE}),
    "dflash": DrafterInfo("a published DFlash block draft: one pass over the target's states proposes the whole "
                          "chain or tree (--trained FOLDER)", _build_dflash, False, {"trained": TRAINED,
                                                                                     "draft-confidence": CONFIDENCE}),
    "mtp": DrafterInfo("the target's own multi-token-prediction (MTP / nextn) layer, chained: reads the target's final "
                       "states, shares its embeddings and LM head (DeepSeek-V3 / GLM-4.5 layout; --trained FOLDER, "
                       "default the target's own)", _build_mtp, False, {"trained": TRAINED,
                                                                          "draft-confidence": CONFIDENCE}),
    "oracle": DrafterInfo("bench only: synthetic acceptance; proposes the target's own tokens from a recorded ar run "
                          "of the prompt, each wrong with probability 1 - oracle-alpha (`specdraft bench` records "
                          "them: spec:drafter=oracle;oracle-alpha=0.8)", _build_oracle, False, {
                              "oracle-alpha": Option(ORACLE_ALPHA, "the chance each proposed token is right"),
                              "oracle-seed": Option(ORACLE_SEED, "seeds the right/wrong draws")}, bench_only=True),
}


def drafter_parts(name: str) -> list[str]:
    """The registered drafters a (possibly composed) name is made of, checked."""
    parts = [part.strip() for part in name.split("+")]
    for part in parts:
        if part not in DRAFTERS:
            raise SpecdraftError(f"Unknown drafter {part!r}; choose one of: {', '.join(sorted(DRAFTERS))}, "
                                 "or compose them with '+' (e.g. ngram+model).")
    if len(set(parts)) != len(parts):
        raise SpecdraftError(f"Drafter {name!r} names a part twice.")
    return parts


def check_not_bench_only(name: str) -> None:
    """Raise SpecdraftError when a part of drafter `name` is a bench-only measuring tool (for `generate`, `serve`)."""
    tools = [part for part in drafter_parts(name) if DRAFTERS[part].bench_only]
    if tools:
        usable = ", ".join(sorted(part for part, info in DRAFTERS.items() if not info.bench_only))
        raise SpecdraftError(f"The {tools[0]!r} drafter is for benchmarks only: it needs a recorded ar run of each "
                             f"prompt, which `specdraft bench` makes (see `specdraft drafters`). Choose another "
                             f"drafter: {usable}.")


def needs_draft_model(name: str) -> bool:
    """Whether any part of drafter `name` drafts with a separate draft model."""
    return any(DRAFTERS[part].needs_draft_model for part in drafter_parts(name))


def remembers_requests(name: str) -> bool:
    """Whether any part of drafter `name` learns from earlier requests (`DrafterInfo.remembers_requests`)."""
    return any(DRAFTERS[part].remembers_requests for part in drafter_parts(name))


def drafter_options(name: str) -> dict[str, Any]:
    """Every option the parts of `name` read, with its default."""
    options: dict[str, Any] = {}
    for part in drafter_parts(name):
        options.update({key: option.default for key, option in DRAFTERS[part].options.items()})
    return options


def user_options() -> dict[str, Option]:
    """Every option of the drafters a user can pick (bench-only tools left out), by key, first declaration first:
    what `generate` and `serve` take as `--KEY` flags."""
    options: dict[str, Option] = {}
    for info in DRAFTERS.values():
        if not info.bench_only:
            for key, option in info.options.items():
                options.setdefault(key, option)
    return options


def check_drafter(name: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check drafter `name` and the options given to it (None = not given); return every option it
    reads, the given ones over the defaults. Raises SpecdraftError before anything is loaded."""
    known = drafter_options(name)
    given = {key: value for key, value in (options or {}).items() if value is not None}
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise SpecdraftError(f"Drafter {name!r} takes no option {', '.join(unknown)}; "
                             f"it takes: {', '.join(sorted(known)) or 'none'}.")
    return {**known, **given}


def make_drafter(name: str, options: dict[str, Any] | None = None, **resources) -> Drafter:
    """Build drafter `name` (parts joined by `+`) with `options` over the defaults, from the given
    resources (`draft_model=`, `target_model=`, `shared=`: a dict passed with every build of a batch's sequences,
    in which trained drafters keep the weights they load once for all; `memory=`: a dict in which a drafter that
    learns from earlier requests keeps what it learns, shared by every drafter built with it (a server's sequences
    of one cache salt); `remember=False`: such a drafter remembers none)."""
    filled = check_drafter(name, options)
    drafters = [DRAFTERS[part].build(filled, **resources) for part in drafter_parts(name)]
    composed = drafters[-1]
    for drafter in reversed(drafters[:-1]):
        composed = ComposedDrafter(drafter, composed)
    return composed


__all__ = ["DRAFTERS", "ComposedDrafter", "DFlashDrafter", "Draft", "DraftContext", "Drafter", "DrafterInfo",
           "Eagle3Drafter", "EagleDrafter", "EarlyExitDrafter", "MedusaDrafter", "ModelDrafter", "MtpDrafter",
           "NgramDrafter", "Option", "OracleDrafter", "SuffixDrafter", "check_drafter", "check_not_bench_only",
           "drafter_options", "make_drafter", "needs_draft_model", "remembers_requests", "user_options"]
