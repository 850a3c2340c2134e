"""What Medusa heads and the EAGLE drafter learn from self-distillation data.

Both read the target's frozen LM head restricted to the drafter's vocabulary (`SubsetHead`):
a label outside it is skipped. Medusa head j (0-based) learns the target's own token two
plus j positions ahead (cross-entropy, weighted `decay**j` as in Medusa). EAGLE learns to
regress the next feature (smooth L1) and to match the target's next-token distribution
through the head (cross-entropy against the target's softmax, weight `classification_weight`),
with noise on its input features so that it can read its own predictions when drafting.
Held-out accuracy is measured on the continuations the target wrote (not on prompt text).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from specdraft.models.draft_head import SubsetHead
from specdraft.models.eagle import EagleDrafterModel
from specdraft.models.medusa import MedusaHeads
from specdraft.training.data import DistillSequence

# Positions of one sequence scored per loss call (a random subset; keeps the logits' memory bounded).
SCORED_POSITIONS = 256
IGNORE = -100


def _sub_index(head: SubsetHead) -> torch.Tensor:
    """[V] each token id's column in the subset head, IGNORE where it has none."""
    index = torch.full((head.out_features,), IGNORE, dtype=torch.long, device=head.ids.device)
    index[head.ids] = torch.arange(len(head.ids), device=head.ids.device)
    return index


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _subset(count: int, generator: torch.Generator) -> torch.Tensor:
    """At most SCORED_POSITIONS of `count` positions, at random, in order."""
    if count <= SCORED_POSITIONS:
        return torch.arange(count)
    return torch.randperm(count, generator=generator)[:SCORED_POSITIONS].sort().values


class MedusaObjective:
    """Cross-entropy of each head against the target's token `2 + j` positions ahead."""

    def __init__(self, heads: MedusaHeads, vocab_head: SubsetHead, decay: float = 0.8) -> None:
        self.module, self.vocab_head, self.decay = heads, vocab_head, decay
        self.index = _sub_index(vocab_head)
        self.device = vocab_head.ids.device

    def _labels(self, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[len(rows), heads] the sub-vocabulary label of each head at each row (IGNORE past the end)."""
        heads = self.module.config.num_heads
        ahead = rows.unsqueeze(-1) + 2 + torch.arange(heads)  # [n, heads]
        valid = ahead < tokens.shape[0]
        labels = self.index[tokens[ahead.clamp_max(tokens.shape[0] - 1)].to(self.device)]
        return labels.masked_fill(~valid.to(self.device), IGNORE)

    def loss(self, sequence: DistillSequence, generator: torch.Generator) -> tuple[torch.Tensor, int]:
        usable = sequence.tokens.shape[0] - 2  # rows with a label for head 0
        if usable < 1:
            return torch.zeros(()), 0
        rows = _subset(usable, generator)
        hidden = sequence.hidden[rows].to(self.device, torch.float32)  # [n, H]
        labels = self._labels(sequence.tokens, rows)  # [n, heads]
        with _autocast(self.device):
            logits = self.vocab_head.scores(self.module(hidden))  # [n, heads, N]
        weights = self.decay ** torch.arange(labels.shape[1], device=self.device)  # [heads]
        per_head = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=IGNORE,
                                   reduction="none").sum(0)  # [heads]
        return (per_head * weights).sum(), len(rows)

    @torch.no_grad()
    def evaluate(self, sequences: list[DistillSequence]) -> dict[str, float]:
        heads = self.module.config.num_heads
        right, seen = torch.zeros(heads), torch.zeros(heads)
        for sequence in sequences:
            rows = torch.arange(max(0, sequence.prompt_length - 1), sequence.tokens.shape[0] - 2)
            if rows.numel() == 0:
                continue
            labels = self._labels(sequence.tokens, rows)  # [n, heads]
            with _autocast(self.device):
                logits = self.vocab_head.scores(self.module(sequence.hidden[rows].to(self.device, torch.float32)))
            valid = labels != IGNORE
            right += ((logits.argmax(-1) == labels) & valid).sum(0).cpu()
            seen += valid.sum(0).cpu()
        return {f"top1@{j + 1}": float(right[j] / seen[j]) if seen[j] else 0.0 for j in range(heads)}


class EagleObjective:
    """Next-feature regression plus next-token cross-entropy through the target's head, teacher-forced."""

    def __init__(self, model: EagleDrafterModel, vocab_head: SubsetHead, embed: torch.nn.Module,
                 classification_weight: float = 0.1, noise: float = 0.2) -> None:
        self.module, self.vocab_head, self.embed = model, vocab_head, embed
        self.classification_weight, self.noise = classification_weight, noise
        self.device = vocab_head.ids.device

    def _predict(self, sequence: DistillSequence, generator: torch.Generator | None):
        features = sequence.hidden.to(self.device, torch.float32)  # [T, H]
        inputs = features[:-1]
        if generator is not None and self.noise:  # uniform noise, scaled to each feature's spread
            spread = features.std(0, keepdim=True)  # [1, H]
            inputs = inputs + (torch.rand(inputs.shape, generator=generator).to(self.device) * 2 - 1) * self.noise * spread
        with torch.no_grad():
            embeds = self.embed(sequence.tokens[1:].to(self.device)).float()  # [T - 1, H]
        positions = torch.arange(inputs.shape[0], device=self.device)
        with _autocast(self.device):
            predicted = self.module(inputs, embeds, positions, use_cache=False)  # [T - 1, H]
        return predicted.float(), features[1:]

    def loss(self, sequence: DistillSequence, generator: torch.Generator) -> tuple[torch.Tensor, int]:
        count = sequence.tokens.shape[0] - 1
        if count < 1:
            return torch.zeros(()), 0
        predicted, actual = self._predict(sequence, generator)  # [T - 1, H] each
        regression = F.smooth_l1_loss(predicted, actual, reduction="none").mean(-1).sum()
        rows = _subset(count, generator).to(self.device)
        with _autocast(self.device):
            with torch.no_grad():
                target_probs = self.vocab_head.scores(actual[rows]).float().softmax(-1)  # [n, N]
            draft_logprobs = self.vocab_head.scores(predicted[rows]).float().log_softmax(-1)  # [n, N]
        classification = -(target_probs * draft_logprobs).sum(-1).sum() * (count / len(rows))
        return regression + self.classification_weight * classification, count

    @torch.no_grad()
    def evaluate(self, sequences: list[DistillSequence]) -> dict[str, float]:
        right = seen = 0
        for sequence in sequences:
            predicted, actual = self._predict(sequence, None)
            rows = torch.arange(max(0, sequence.prompt_length - 1), predicted.shape[0], device=self.device)
            if rows.numel() == 0:
                continue
            with _autocast(self.device):
                guess = self.vocab_head.scores(predicted[rows]).argmax(-1)
                truth = self.vocab_head.scores(actual[rows]).argmax(-1)
            right += int((guess == truth).sum())
            seen += rows.numel()
        return {"top1": right / seen if seen else 0.0}


class DistillObjective:
    """Forward KL from the target's next-token distribution to a draft model's, on the target's continuations.

    The data keeps the target's top-k log-probabilities per position; the rest of its mass is one
    more outcome, so KL(p || q) = sum_top p_i log(p_i / q_i) + p_rest log(p_rest / q_rest), exact
    for the distributions coarsened to (top-k, rest). `module` is the trained part of `draft`
    (its last layers); the rest stays frozen and builds no autograd graph.
    """

    def __init__(self, draft: torch.nn.Module, trained: torch.nn.Module, device: torch.device) -> None:
        self.draft, self.module, self.device = draft, trained, device

    def _rows(self, sequence: DistillSequence) -> torch.Tensor:
        """Positions that predict a continuation token (the target wrote them; the draft will draft there)."""
        return torch.arange(max(0, sequence.prompt_length - 1), sequence.tokens.shape[0])

    def _log_q(self, sequence: DistillSequence, rows: torch.Tensor) -> torch.Tensor:
        """[len(rows), V] the draft's next-token log-probabilities at `rows`."""
        tokens = sequence.tokens.to(self.device, torch.long).unsqueeze(0)  # [1, T]
        with _autocast(self.device):
            hidden = self.draft.model(input_ids=tokens, use_cache=False).last_hidden_state[0]  # [T, H]
            logits = self.draft.lm_head(hidden[rows.to(self.device)])  # [n, V]
        return logits.float().log_softmax(-1)

    def _kl(self, sequence: DistillSequence, rows: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        """[n] KL(p || q) per row over (the target's top-k, the rest)."""
        top_ids = sequence.top_ids[rows].to(self.device, torch.long)  # [n, K]
        log_p = sequence.top_logprobs[rows].to(self.device, torch.float32)  # [n, K]
        p = log_p.exp()
        p_rest = (1 - p.sum(-1)).clamp_min(1e-6)  # [n]
        log_q_top = log_q.gather(-1, top_ids)  # [n, K]
        q_rest = (1 - log_q_top.exp().sum(-1)).clamp_min(1e-6)  # [n]
        return (p * (log_p - log_q_top)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())

    def loss(self, sequence: DistillSequence, generator: torch.Generator) -> tuple[torch.Tensor, int]:
        rows = self._rows(sequence)
        if rows.numel() == 0:
            return torch.zeros(()), 0
        rows = rows[_subset(rows.numel(), generator)]
        return self._kl(sequence, rows, self._log_q(sequence, rows)).sum(), rows.numel()

    @torch.no_grad()
    def evaluate(self, sequences: list[DistillSequence]) -> dict[str, float]:
        """`agree`: the draft's top token is the target's (greedy acceptance); `alpha_top_k`: sum of
        min(p, q) over the target's top-k (a lower bound on acceptance when sampling at temperature 1);
        `kl`: mean KL(p || q)."""
        agree = overlap = kl = seen = 0.0
        for sequence in sequences:
            rows = self._rows(sequence)
            if rows.numel() == 0:
                continue
            log_q = self._log_q(sequence, rows)
            top_ids = sequence.top_ids[rows].to(self.device, torch.long)  # [n, K]
            p = sequence.top_logprobs[rows].to(self.device, torch.float32).exp()
            agree += float((log_q.argmax(-1) == top_ids[:, 0]).sum())
            overlap += float(torch.minimum(p, log_q.gather(-1, top_ids).exp()).sum())
            kl += float(self._kl(sequence, rows, log_q).sum())
            seen += rows.numel()
        seen = max(seen, 1.0)
        return {"agree": agree / seen, "alpha_top_k": overlap / seen, "kl": kl / seen}
