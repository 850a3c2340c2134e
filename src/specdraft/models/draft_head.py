"""A draft whose LM head scores only part of the vocabulary (the FR-Spec / EAGLE-3 idea).

The LM head is a large share of a small draft's weights (136M of the bundled 0.5B's ~490M).
Scoring only the `keep` lowest token ids (BPE vocabularies number tokens roughly by merge
order, so low ids are the common ones) plus every special token cuts that share; the other
tokens get -inf logits, so the draft never proposes them. Still exact: verification uses
the distribution the draft actually sampled from, whatever its support.
"""

from __future__ import annotations

import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM


class SubsetHead(nn.Module):
    """Logits over the full vocabulary from a head that scores only `ids`; the rest are -inf."""

    def __init__(self, head: nn.Linear, ids: torch.Tensor) -> None:
        super().__init__()
        self.out_features = head.out_features  # the full vocabulary: logits keep their width
        self.in_features = head.in_features
        self.register_buffer("ids", ids)  # [kept] int64, sorted
        self.inner = nn.Linear(head.in_features, len(ids), bias=head.bias is not None, device="meta")
        self.inner.weight = nn.Parameter(head.weight.detach()[ids].clone(), requires_grad=False)
        if head.bias is not None:
            self.inner.bias = nn.Parameter(head.bias.detach()[ids].clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., hidden] -> [..., V]
        scores = self.inner(x.reshape(-1, x.shape[-1]))  # [tokens, kept]
        full = scores.new_full((scores.shape[0], self.out_features), float("-inf"))  # [tokens, V]
        full[:, self.ids] = scores
        return full.view(*x.shape[:-1], self.out_features)


def restrict_draft_vocab(draft: CausalLM, keep: int) -> int:
    """Give `draft` a head over its `keep` lowest token ids plus its special tokens; returns how many it scores.

    Apply before quantizing (the new head is an ordinary linear). `keep` 0 leaves the draft as it is.
    """
    if keep == 0:
        return draft.vocab_size
    head = draft.model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise SpecdraftError("--draft-vocab needs the draft's LM head as a plain linear layer; load it unpacked "
                             "or use --draft-vocab 0.")
    if keep < 0:
        raise SpecdraftError(f"--draft-vocab must be >= 0 (0 = the whole vocabulary), got {keep}.")
    vocab = head.out_features
    special = set(draft.eos_token_ids)
    if draft.tokenizer is not None:
        special.update(draft.tokenizer.all_special_ids)
        special.update(range(len(draft.tokenizer), vocab))  # ids the tokenizer adds past its base vocabulary
        special.update(i for i in draft.tokenizer.added_tokens_decoder if i < vocab)
    ids = sorted(set(range(min(keep, vocab))) | {i for i in special if 0 <= i < vocab})
    if len(ids) >= vocab:
        return vocab
    draft.model.set_output_embeddings(SubsetHead(head, torch.tensor(ids, dtype=torch.long, device=head.weight.device)))
    return len(ids)
