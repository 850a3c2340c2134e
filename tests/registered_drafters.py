"""Every registered drafter, built for the tiny test models, so the statistical (tier 2) and equivalence (tier 3)
tests run over the registry: a new drafter is covered without editing them. Only a drafter that needs more than
`make_drafter` gives (trained weights) has a builder here: random heads of the tiny target's width."""

from __future__ import annotations

import torch

from specdraft.drafters import (DRAFTERS, DFlashDrafter, Drafter, Eagle3Drafter, EagleDrafter, MedusaDrafter,
                                MtpDrafter, make_drafter)
from specdraft.models.causal_lm import CausalLM
from specdraft.models.dflash_loading import build_dflash, from_published as dflash_from_published
from specdraft.models.eagle import EagleConfig, EagleDrafterModel
from specdraft.models.eagle3_loading import build_eagle3, from_published
from specdraft.models.medusa import MedusaConfig, MedusaHeads
from specdraft.models.mtp_loading import build_mtp, from_published as mtp_from_published

OPTIONS = {"early-exit": {"exit-layer": 1}, "ngram+model": {"ngram-min": 3}}  # options that suit the tiny models
COMPOSED = ["ngram+model"]  # compositions tested beside the registered drafters


def random_medusa(target: CausalLM, min_confidence: float = 0.0) -> MedusaDrafter:
    """Medusa heads with random (not zero) blocks: proposals that differ from the target's guesses; `min_confidence`
    the chain cut (`draft-confidence`; the registry's default where the statistical tests test the default)."""
    torch.manual_seed(11)
    heads = MedusaHeads(MedusaConfig(target.config.hidden_size, num_heads=3, rank=8))
    with torch.no_grad():
        heads.up.normal_(0.0, 3.0)
    return MedusaDrafter(target, heads, torch.arange(target.vocab_size), min_confidence)


def random_eagle(target: CausalLM, min_confidence: float = 0.0) -> EagleDrafter:
    """An EAGLE layer with random weights (`min_confidence`: as `random_medusa`)."""
    torch.manual_seed(12)
    model = EagleDrafterModel(EagleConfig(target.config.hidden_size, width=128, num_heads=1, num_kv_heads=1,
                                          intermediate_size=64)).eval()
    return EagleDrafter(target, model, torch.arange(target.vocab_size), min_confidence)


def random_eagle3(target: CausalLM, min_confidence: float = 0.0) -> Eagle3Drafter:
    """A random EAGLE-3 head in the speculators format (`eagle3_checkpoints`), read through the loader's name and
    config mapping: three of the target's layer inputs (0, L // 2, L - 1), a draft vocabulary of all but every
    fourth token (the rest only through the residual)."""
    from eagle3_checkpoints import random_head

    config, layers = target.config, target.config.num_hidden_layers
    keep = [i for i in range(target.vocab_size) if i % 4 != 3]
    head = random_head(config, "speculators", hidden=config.hidden_size, heads=2, kv_heads=1, head_dim=16,
                       intermediate=64, draft_ids=keep, aux_layers=(0, layers // 2, layers - 1),
                       own_embeddings=False, seed=13)
    eagle3_config, tensors = from_published(head.config, head.tensors)
    return Eagle3Drafter(target, build_eagle3(eagle3_config, tensors, "random head", target.dtype, target.device),
                         min_confidence)


def random_mtp(target: CausalLM, min_confidence: float = 0.0) -> MtpDrafter:
    """A random MTP layer in the DeepSeek-V3 layout (`mtp_checkpoints`) for the target's shape, read through the
    loader's name and config mapping, scoring with the target's own LM head."""
    from mtp_checkpoints import random_mtp_layer

    config, prefix = target.config, f"model.layers.{target.config.num_hidden_layers}."
    tensors = {name.removeprefix(prefix): value for name, value in random_mtp_layer(config, seed=14).items()}
    mtp_config, ours = mtp_from_published(config.to_dict(), tensors, "random MTP layer")
    model = build_mtp(mtp_config, ours, "random MTP layer", target.model.get_output_embeddings(), target.dtype,
                      target.device)
    return MtpDrafter(target, model, min_confidence)


def random_dflash(target: CausalLM, min_confidence: float = 0.0) -> DFlashDrafter:
    """A random one-layer DFlash draft in z-lab's format (`dflash_checkpoints`) reading the first layer's output of
    the target, a block of 6 (5 draft rows), read through the loader's name and config mapping."""
    from dflash_checkpoints import random_dflash as random_checkpoint

    config, tensors = random_checkpoint(target.config, layers=1, heads=2, kv_heads=1, block_size=6,
                                        target_layer_ids=[0], seed=15)
    dflash_config, ours = dflash_from_published(config, tensors, "random DFlash draft")
    return DFlashDrafter(target, build_dflash(dflash_config, ours, "random DFlash draft", target.dtype, target.device),
                         min_confidence)


TRAINED = {"medusa": random_medusa, "eagle": random_eagle, "eagle3": random_eagle3, "mtp": random_mtp,
           "dflash": random_dflash}


def registered() -> list[str]:
    """Every drafter a user can pick (bench-only tools left out), and the compositions tested."""
    return sorted(name for name, info in DRAFTERS.items() if not info.bench_only) + COMPOSED


def build(name: str, target: CausalLM, draft: CausalLM) -> Drafter:
    """Drafter `name` for `target`, drafting with `draft` where it takes a draft model."""
    if name in TRAINED:
        return TRAINED[name](target)
    return make_drafter(name, OPTIONS.get(name), draft_model=draft, target_model=target)
