"""Medusa heads (Cai et al. 2024): several future tokens from the target's last hidden state.

Head i (1-based) reads the target's final hidden state h_t at position t (the one its LM head
turns into token t + 1) and predicts token t + 1 + i through a residual block,
`h + up(silu(down(h)))`, and the target's own LM head (frozen, shared). `up` starts at zero,
so an untrained head repeats the target's next-token guess. The blocks are low-rank
(`rank` wide) to keep the shipped weights small.

The vocabulary head is the target's LM head restricted to `vocab_ids` (see `draft_head`): a
drafter never proposes a token outside it, which costs nothing in exactness (q is what it
sampled from) and saves most of the head's time on a CPU.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class MedusaConfig:
    """Shape of a set of Medusa heads."""

    hidden_size: int  # the target's
    num_heads: int = 4
    rank: int = 256

    def to_json(self) -> str:
        return json.dumps({"kind": "medusa", **asdict(self)})


class MedusaHeads(nn.Module):
    """`num_heads` residual blocks over the target's final hidden state; logits come from a shared head."""

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        heads, hidden, rank = config.num_heads, config.hidden_size, config.rank
        self.down = nn.Parameter(torch.randn(heads, hidden, rank) * hidden ** -0.5)  # [heads, H, r]
        self.up = nn.Parameter(torch.zeros(heads, rank, hidden))  # [heads, r, H]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # hidden: [N, H] -> [N, heads, H]
        """Each head's feature for the vocabulary head; head i's predicts the token i + 1 after the next."""
        inner = F.silu(torch.einsum("nh,khr->nkr", hidden, self.down.to(hidden.dtype)))  # [N, heads, r]
        return hidden.unsqueeze(1) + torch.einsum("nkr,krh->nkh", inner, self.up.to(hidden.dtype))
