"""The server app as `specdraft serve` builds it from its options: checked, models loaded, then `create_app` (used by
`serve`, by each replica of `serve --ray`, and by the tests)."""

from __future__ import annotations

from pathlib import Path

from specdraft.batch_engine import DEFAULT_MAX_BATCH, default_kv_budget
from specdraft.policy import GPU_MAX_AUTO_K


def check_speculation(k, tree_budget: int, tree_branch: int, flags: dict, max_k: int = GPU_MAX_AUTO_K) -> dict:
    """What `build_app` checks before it loads anything (a SpecdraftError naming the option): the speculation
    options (a fixed --k at most --max-k), and the drafters' flags, returned as the drafters' options."""
    from specdraft.engine import check_tree_options
    from specdraft.errors import SpecdraftError
    from specdraft.policy import FixedK, make_policy
    from specdraft.surfaces.model_setup import drafter_flags

    check_tree_options(tree_budget, tree_branch)
    if max_k < 1:
        raise SpecdraftError(f"--max-k must be >= 1, got {max_k}.")
    policy = make_policy(k, tree_budget)
    if isinstance(policy, FixedK) and policy.k > max_k:
        raise SpecdraftError(f"--k {policy.k} is above --max-k {max_k}, the most a request may ask for; lower --k or "
                             "raise --max-k.")
    return drafter_flags(**flags)


def build_app(*, api_key, served_model_name, max_queue, request_timeout, max_tokens, shutdown_grace, seed,
              max_body_mb=2.0, max_batch=DEFAULT_MAX_BATCH, kv_budget_mb=None, prefix_cache_mb=256.0,
              max_k=GPU_MAX_AUTO_K, cross_request_memory="shared", target, draft, drafter, k, tree_budget, tree_branch,
              draft_quant, draft_vocab, dtype, device, gguf_weights, context=None, **flags):
    """Load the models as `generate` does and build the app (SpecdraftError for a bad option)."""
    from specdraft.server import DecoderPool, ServerSettings, create_app
    from specdraft.surfaces.model_setup import load_models

    options = check_speculation(k, tree_budget, tree_branch, flags, max_k)  # bad options fail before any loading
    settings = ServerSettings(served_model=served_model_name or Path(target).name, api_key=api_key,
                              max_queue=max_queue, request_timeout=request_timeout, default_max_tokens=max_tokens,
                              shutdown_grace=shutdown_grace, seed=seed, max_body_bytes=int(max_body_mb * (1 << 20)),
                              max_batch=max_batch, prefix_cache_bytes=int(prefix_cache_mb * (1 << 20)),
                              cross_request_memory=cross_request_memory)
    target_lm, draft_lm = load_models(target, draft, drafter, options, dtype=dtype, device=device,
                                      gguf_weights=gguf_weights, draft_quant=draft_quant, draft_vocab=draft_vocab,
                                      context=context)
    pool = DecoderPool(target_lm, draft_lm, drafter=drafter, k=k, options=options, tree_budget=tree_budget,
                       tree_branch=tree_branch, max_k=max_k)
    settings.kv_budget = (default_kv_budget(target_lm.device) if kv_budget_mb is None
                          else int(kv_budget_mb * (1 << 20)) if kv_budget_mb > 0 else None)
    return create_app(pool, settings)
