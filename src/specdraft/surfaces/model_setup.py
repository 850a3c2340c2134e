"""Models and drafter options as the `generate` and `serve` commands take them (shared, thin)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import typer


def _flag_name(key: str) -> str:
    return key.replace("-", "_")


def flag_names() -> list[str]:
    """The Python names of the drafter flags (`draft-confidence` -> `draft_confidence`), in declaration order."""
    from specdraft.drafters import user_options

    return [_flag_name(key) for key in user_options()]


def with_drafter_flags(command: Callable, after: str) -> Callable:
    """Give `command` (which takes `**drafter_options`) a `--KEY` typer option for every option a user's drafter
    declares (`drafters.Option`), placed after its parameter `after`: None = not given, the drafter's default
    applies. A drafter's option is declared once, in the registry; this is how the CLI learns it."""
    from specdraft.drafters import DRAFTERS, user_options

    flags = []
    for key, option in user_options().items():
        users = [name for name, info in DRAFTERS.items() if key in info.options and not info.bench_only]
        kind = type(option.default)
        flags.append(inspect.Parameter(
            _flag_name(key), inspect.Parameter.KEYWORD_ONLY, annotation=Optional[kind],
            default=typer.Option(None, f"--{key}", min=option.minimum,
                                 help=f"{', '.join(users)}: {option.help} (default {option.default!r}).")))
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values()
           if p.kind is not inspect.Parameter.VAR_KEYWORD]
    at = next(i for i, p in enumerate(own) if p.name == after) + 1
    command.__signature__ = inspect.Signature([*(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own[:at]),
                                               *flags,
                                               *(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own[at:])])
    return command


def with_options_of(command: Callable, source: Callable, names: list[str]) -> Callable:
    """`command` (which takes `**options`) taking, after its own options, the options of command `source` named in
    `names`, declared as `source` declares them (typer reads the signature)."""
    shared = inspect.signature(source, eval_str=True).parameters
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values()
           if p.kind is not inspect.Parameter.VAR_KEYWORD]
    command.__signature__ = inspect.Signature([*own, *(shared[name].replace(kind=inspect.Parameter.KEYWORD_ONLY)
                                                       for name in names)])
    return command


def drafter_flags(**given) -> dict[str, Any]:
    """The drafter options given on the command line (by Python name), keyed by option (None = not given)."""
    from specdraft.drafters import user_options

    return {key: given.get(_flag_name(key)) for key in user_options()}


def load_models(target: str, draft: str, drafter: str | None, options: dict[str, Any], *, dtype: str, device: str,
                gguf_weights: str, draft_quant: str, draft_vocab: int | str, context: int | None = None):
    """(target, draft or None): the draft only when `drafter` (None = plain decoding) needs one; both hold `context`
    tokens (`load_model(max_context=)`; None: each its own), the draft as many of them as its positions allow (it
    keeps its reads within them: `ModelDrafter`), so only the target refuses a context.

    The drafter and its options, the dtype and both models' names are checked before anything loads (a
    mistyped target is named at once, not after the draft has loaded), the native kernels are built (where
    not yet cached: no compile inside the first generation), and the draft loads first, so its unpacking
    peak passes before the target is in memory.
    """
    from specdraft.drafters import check_drafter, check_not_bench_only, needs_draft_model
    from specdraft.kernels.prebuild import build_all
    from specdraft.models.draft_head import draft_vocab_value
    from specdraft.models.loading import (check_compatible, draft_requantized, load_model, prepare_draft, resolve_dtype,
                                          resolve_model_path)

    if drafter is not None:
        check_drafter(drafter, options)
        check_not_bench_only(drafter)
    draft_vocab = draft_vocab_value(draft_vocab)  # a bad value fails before anything loads
    resolve_dtype(dtype)
    with_draft = drafter is not None and needs_draft_model(drafter)
    for name in (target, draft) if with_draft else (target,):
        resolve_model_path(name)  # an unknown name or a missing file fails here (a bundled one is assembled once)
    build_all()
    draft_lm = None
    if with_draft:
        draft_lm = prepare_draft(load_model(draft, dtype=dtype, device=device, gguf_weights=gguf_weights,
                                            requantized=draft_requantized(draft_quant, device), max_context=context,
                                            clip_context=True),
                                 draft_quant, vocab=draft_vocab)
    target_lm = load_model(target, dtype=dtype, device=device, gguf_weights=gguf_weights, max_context=context)
    if draft_lm is not None:
        check_compatible(target_lm, draft_lm)
    return target_lm, draft_lm
