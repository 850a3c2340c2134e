"""Drafters, chosen by name from a registry (never by `if method == ...`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specdraft.drafters.base import Draft, DraftContext, Drafter
from specdraft.drafters.model import DEFAULT_MIN_CONFIDENCE, ModelDrafter
from specdraft.errors import SpecdraftError


@dataclass(frozen=True)
class DrafterInfo:
    """A registered drafter: a one-line description and how to build it from loaded resources."""

    description: str
    build: Callable[..., Drafter]
    needs_draft_model: bool


def _build_model(draft_model=None, min_confidence: float = DEFAULT_MIN_CONFIDENCE, **_options) -> Drafter:
    if draft_model is None:
        raise SpecdraftError("The 'model' drafter needs a draft model: pass --draft NAME_OR_PATH.")
    return ModelDrafter(draft_model, min_confidence=min_confidence)


DRAFTERS: dict[str, DrafterInfo] = {
    "model": DrafterInfo("a smaller LM of the same vocabulary drafts token by token (its own KV cache)",
                         _build_model, needs_draft_model=True),
}


def make_drafter(name: str, **resources) -> Drafter:
    """Build the drafter registered as `name` from the given resources (e.g. `draft_model=`)."""
    try:
        info = DRAFTERS[name]
    except KeyError:
        raise SpecdraftError(f"Unknown drafter {name!r}; choose one of: {', '.join(sorted(DRAFTERS))}.") from None
    return info.build(**resources)


__all__ = ["DRAFTERS", "Draft", "DraftContext", "Drafter", "DrafterInfo", "ModelDrafter", "make_drafter"]
