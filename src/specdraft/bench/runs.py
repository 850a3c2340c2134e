"""What a bench run holds and passes around: the loaded models, one generation's parameters and its output.

Below `methods` (our loop and transformers'), `llama_cpp_peer` and `llama_server_peer`, which run generations with
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdraft.drafters import DEFAULT_DRAFTER
from specdraft.drafters.base import Drafter
from specdraft.engine import DEFAULT_TREE_BRANCH
from specdraft.models.causal_lm import CausalLM
from specdraft.models.loading import prepare_draft
from specdraft.policy import AutoK
from specdraft.sampling import SamplingParams


@dataclass
class Models:
    """The loaded weights every method shares; quantized drafts are made once, on first use."""

    target: CausalLM
    draft: CausalLM | None = None  # the run's --draft
    other_drafts: dict[str, CausalLM] = field(default_factory=dict)  # drafts methods name with draft=PATH
    prepared: dict[str, CausalLM] = field(default_factory=dict)
    policies: dict[tuple, AutoK] = field(default_factory=dict)  # `k=auto` policies, kept across prompts
    drafters: dict["RunParams", Drafter] = field(default_factory=dict)  # one per method: suffix memory spans prompts
    target_spec: str | None = None  # what the user named as the target (for peers that load its file)
    draft_spec: str | None = None  # what the user named as the draft (for peers that load its file)
    peers: dict[str, object] = field(default_factory=dict)  # engines peers make once per run, by peer name

    def draft_as(self, quant: str, vocab: int | str = 0, name: str = "") -> CausalLM:
        """The draft (the run's, or the one a method named `name`) with `quant` and `vocab` applied (a copy:
        other methods keep the loaded weights)."""
        key = f"{name}/{quant}/{vocab}"
        if key not in self.prepared:
            self.prepared[key] = prepare_draft(self.other_drafts[name] if name else self.draft, quant, copy=True,
                                               vocab=vocab)
        return self.prepared[key]

    def close_peers(self) -> None:
        """Stop what the peers started (a `close()` each: the llama-server processes) and forget every peer."""
        peers, self.peers = list(self.peers.values()), {}
        for peer in peers:
            close = getattr(peer, "close", None)
            if callable(close):
                close()


@dataclass(frozen=True)
class RunParams:
    """What one generation of a method needs besides the prompt."""

    sampling: SamplingParams
    max_new_tokens: int
    k: int | str | None = None  # draft tokens per step (or "auto"); None: the method's default
    draft_quant: str = "none"  # the draft's weights (see models.loading.prepare_draft)
    draft_vocab: int | str = 0  # tokens the draft's head scores (0 = all, or auto; see models.draft_head)
    drafter: str = DEFAULT_DRAFTER  # spec only: the registered drafter (parts joined by +)
    drafter_options: tuple[tuple[str, object], ...] = ()  # spec only: the drafter's options given
    tree_budget: int = 0  # spec only: draft nodes per step (0 = chains)
    tree_branch: int = DEFAULT_TREE_BRANCH  # spec only: children per tree node
    draft: str = ""  # another draft model than the run's (a path or bundled name; "" = the run's)
    peer_options: tuple[tuple[str, object], ...] = ()  # the llama-server peers only: their keys given


@dataclass
class RunOutput:
    """One generation: the new tokens (cut after the first EOS), its time and, for our loop, its counts."""

    token_ids: list[int]
    wall_seconds: float
    steps: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    accepted_at: list[int] | None = None  # accepted_at[i]: drafts accepted at position i
    drafted_at: list[int] | None = None  # drafted_at[i]: drafts that reached position i
    draft_seconds: float | None = None  # time spent proposing (our loop only)
    verify_seconds: float | None = None  # time spent in the target's verification passes (our loop only)
    k: int | None = None  # the most draft tokens of any step (None when nothing was drafted)
    k_per_step: list[int] | None = None  # draft tokens of each step (our loop only)
    by_source: dict[str, dict[str, int]] | None = None  # steps, drafted, accepted per draft source (our loop only)
    prefill_seconds: float | None = None  # time spent in the target's prompt pass (our loop only)
    forced_tokens: int | None = None  # tokens a constraint's grammar decided alone, without a pass (our loop only)
    mask_seconds: float | None = None  # time computing a constraint's masks (our loop only)


def cut_at_eos(token_ids: list[int], eos_ids: set[int]) -> list[int]:
    """The tokens up to and including the first EOS (as our loop emits them)."""
    for i, token in enumerate(token_ids):
        if token in eos_ids:
            return token_ids[: i + 1]
    return token_ids
