"""A draft whose LM head scores only part of the vocabulary (the FR-Spec / EAGLE-3 idea).

The LM head is a large share of a small draft's weights (136M of the bundled 0.5B's ~490M).
Scoring only `keep` common tokens plus every special token cuts that share; the other tokens
get -inf logits, so the draft never proposes them. Still exact: verification uses the
distribution the draft actually sampled from, whatever its support.

Which tokens: half by how often they occur in a text corpus (`token_counts`: code and technical
prose, where BPE's order misses identifiers and indentation runs), then the lowest ids (BPE
vocabularies number tokens roughly by merge order, so low ids are the common ones of the
tokenizer's own, multilingual, corpus). Without counts, the lowest ids alone.

`--draft-vocab auto` (the default) narrows the head to AUTO_DRAFT_VOCAB tokens on the CPU, where a draft token's
time is the bytes it reads, and only where token counts exist for the draft's tokenizer; elsewhere it keeps the
whole vocabulary.
"""

from __future__ import annotations

from itertools import chain, islice

import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM


AUTO = "auto"
# On an AVX2 CPU (two bench runs of the same 28 prompts) the bundled draft at 32,768 tokens ran 1.08x and 1.17x `ar`
# against 1.04x and 1.07x for the whole vocabulary: c fell by a sixth while α held.
AUTO_DRAFT_VOCAB = 32768


def draft_vocab_value(text: str | int) -> int | str:
    """A --draft-vocab setting as given: `auto`, or how many tokens the head scores (0 = all)."""
    if str(text).strip().lower() == AUTO:
        return AUTO
    try:
        keep = int(text)
    except ValueError:
        raise SpecdraftError(f"--draft-vocab takes auto or a whole number of tokens (0 = all), got {text!r}.") from None
    if keep < 0:
        raise SpecdraftError(f"--draft-vocab must be >= 0 (0 = the whole vocabulary) or auto, got {keep}.")
    return keep


def resolved_draft_vocab(setting: int | str, draft: CausalLM, counted: bool) -> int:
    """How many tokens the head of `draft` scores for a --draft-vocab `setting`: `auto` is AUTO_DRAFT_VOCAB on the
    CPU where the tokenizer's token counts were found (`counted`), else 0 (the whole vocabulary)."""
    setting = draft_vocab_value(setting)
    if setting != AUTO:
        return setting
    return AUTO_DRAFT_VOCAB if draft.device.type == "cpu" and counted and draft.vocab_size > AUTO_DRAFT_VOCAB else 0


class SubsetHead(nn.Module):
    """Logits over the full vocabulary from a head that scores only `ids`; the rest are -inf."""

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None) -> None:  # weight: [kept, in]; ids: [kept] sorted
        super().__init__()
        self.out_features = out_features  # the full vocabulary: logits keep their width
        self.in_features = weight.shape[1]
        self.register_buffer("ids", ids)  # [kept] int64, sorted
        self.inner = nn.Linear(self.in_features, len(ids), bias=bias is not None, device="meta")
        self.inner.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        if bias is not None:
            self.inner.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, head: nn.Linear, ids: torch.Tensor) -> "SubsetHead":
        """The rows `ids` of a plain linear head."""
        bias = head.bias.detach()[ids] if head.bias is not None else None
        return cls(head.weight.detach()[ids], ids, head.out_features, bias)

    def scores(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., hidden] -> [..., kept]
        """Logits of the kept tokens only (column j is token `ids[j]`)."""
        return self.inner(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], len(self.ids))

    def widen(self, scores: torch.Tensor) -> torch.Tensor:  # scores: [..., kept] -> [..., V]
        """Kept-token logits placed in the full vocabulary, -inf elsewhere."""
        flat = scores.reshape(-1, scores.shape[-1])  # [tokens, kept]
        full = flat.new_full((flat.shape[0], self.out_features), float("-inf"))  # [tokens, V]
        full[:, self.ids] = flat
        return full.view(*scores.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., hidden] -> [..., V]
        return self.widen(self.scores(x))


def restrict_draft_vocab(draft: CausalLM, keep: int, counts: torch.Tensor | None = None) -> int:
    """Give `draft` a head over `keep` common tokens plus its special tokens; returns how many it scores.

    counts: [vocab] how often each token occurs in some corpus (see `token_counts`); half of `keep` is
    then taken by count, the rest as the lowest ids. None: the lowest ids alone. Apply before
    quantizing (the new head is an ordinary linear). `keep` 0 leaves the draft as it is.
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
    counts = torch.zeros(vocab, dtype=torch.long) if counts is None else counts[:vocab]
    counts = torch.cat([counts, counts.new_zeros(vocab - counts.shape[0])])  # ids past the tokenizer's: unseen
    special = {i for i in special if 0 <= i < vocab}
    chosen = set(common_token_ids(counts, min(keep + len(special), vocab), special, counted=keep // 2).tolist())
    # Rows in a multiple of 16, the int4 tile kernels' block (a head of any other size stays dense bf16: slower).
    chosen.update(islice((i for i in range(vocab) if i not in chosen), -len(chosen) % 16))
    ids = sorted(chosen)
    if len(ids) >= vocab:
        return vocab
    draft.model.set_output_embeddings(SubsetHead.from_linear(head, torch.tensor(ids, dtype=torch.long, device=head.weight.device)))
    return len(ids)


def head_rows(head: nn.Module, ids: torch.Tensor, in_features: int, chunk: int = 512) -> torch.Tensor:
    """The rows `ids` of any LM head's weight (a plain linear, or one on packed blocks), as the head
    computes them: it is run on the identity, `chunk` columns at a time. # [len(ids), in_features]"""
    device = ids.device
    dtype = next((p.dtype for p in head.parameters() if p.is_floating_point()), torch.bfloat16)
    rows = []
    with torch.inference_mode():
        zero = head(torch.zeros(1, in_features, dtype=dtype, device=device))[0, ids].float()  # [n] the bias, if any
        for start in range(0, in_features, chunk):
            eye = torch.eye(in_features, dtype=dtype, device=device)[start:start + chunk]  # [c, in]
            rows.append(head(eye)[:, ids].float() - zero)  # [c, n]
    return torch.cat(rows).T.contiguous()


def common_token_ids(counts: torch.Tensor, keep: int, always: set[int] = frozenset(),
                     counted: int | None = None) -> torch.Tensor:
    """`keep` token ids for a partial head: every id of `always` (special tokens), up to `counted` of
    those seen (most frequent first; None: all seen), then the lowest ids (BPE numbers common tokens
    first). Sorted.

    counts: [V] how often each token occurs in some text (zeros where unknown).
    """
    vocab = counts.shape[0]
    seen = counts.argsort(descending=True, stable=True)[: int((counts > 0).sum())].tolist()
    chosen = dict.fromkeys([i for i in always if 0 <= i < vocab])
    for token in chain(seen[:counted], range(vocab)):
        if len(chosen) >= keep:
            break
        chosen.setdefault(token)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def target_subset_head(lm: CausalLM, ids: torch.Tensor) -> SubsetHead:
    """`lm`'s own LM head restricted to `ids` (sorted), in `lm`'s dtype, for drafters that reuse it."""
    head = lm.model.get_output_embeddings()
    ids = ids.to(lm.device)
    if isinstance(head, nn.Linear):
        return SubsetHead.from_linear(head, ids)
    return SubsetHead(head_rows(head, ids, lm.config.hidden_size).to(lm.dtype), ids, lm.vocab_size)
