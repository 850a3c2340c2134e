"""Models and drafter options as the `generate` and `serve` commands take them (shared, thin)."""

from __future__ import annotations

from typing import Any


def drafter_flags(*, draft_confidence=None, draft_context=None, ngram_max=None, ngram_min=None, suffix_min_match=None,
                  suffix_min_score=None, suffix_factor=None, exit_layer=None, trained=None) -> dict[str, Any]:
    """The drafter options given on the command line, keyed by flag name (None = not given)."""
    return {"draft-confidence": draft_confidence, "draft-context": draft_context, "ngram-max": ngram_max, "ngram-min": ngram_min,
            "suffix-min-match": suffix_min_match, "suffix-min-score": suffix_min_score,
            "suffix-factor": suffix_factor, "exit-layer": exit_layer, "trained": trained}


def load_models(target: str, draft: str, drafter: str | None, options: dict[str, Any], *, dtype: str, device: str,
                gguf_weights: str, draft_quant: str, draft_vocab: int):
    """(target, draft or None): the draft only when `drafter` (None = plain decoding) needs one.

    The drafter and its options are checked before anything loads, the native kernels are built (where
    not yet cached: no compile inside the first generation), and the draft loads first, so its unpacking
    peak passes before the target is in memory.
    """
    from specdraft.drafters import check_drafter, check_not_bench_only, needs_draft_model
    from specdraft.kernels.prebuild import build_all
    from specdraft.models.loading import check_compatible, load_model, prepare_draft

    if drafter is not None:
        check_drafter(drafter, options)
        check_not_bench_only(drafter)
    build_all()
    draft_lm = None
    if drafter is not None and needs_draft_model(drafter):
        draft_lm = prepare_draft(load_model(draft, dtype=dtype, device=device, gguf_weights=gguf_weights),
                                 draft_quant, vocab=draft_vocab)
    target_lm = load_model(target, dtype=dtype, device=device, gguf_weights=gguf_weights)
    if draft_lm is not None:
        check_compatible(target_lm, draft_lm)
    return target_lm, draft_lm
