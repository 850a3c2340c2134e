"""What Medusa heads and the EAGLE drafter learn from self-distillation data.

Both read the target's frozen LM head restricted to the drafter's vocabulary (`SubsetHead`):
a label outside it is skipped. Medusa head j (0-based) learns the target's own token two
plus j positions ahead (cross-entropy, weighted `decay**j` as in Medusa). EAGLE learns to
regress the next feature (smooth L1) and to match the target's next-token distribution
through the head (cross-entropy against the target's softmax, weight `classification_weight`),
with noise on its input features so that it can read its own predictions when drafting.
Held-out accuracy is measured on the continuations the target wrote (not on prompt text).

EAGLE-3 (`Eagle3Objective`, SpecForge's training-time test) unrolls its head `ttt_length` steps: step 0 reads the
pairs (fc(target layers at t), x_{t+1}); step j feeds each row's own output of step j - 1 back with the next
token x_{t+1+j}, as drafting does, and every step is scored against the target's next-token distribution
renormalised over the draft vocabulary (cross-entropy, step j weighted 0.8**j; positions whose target top token
is outside the draft vocabulary do not count).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from specdraft.models.causal_lm import CausalLM
from specdraft.models.draft_head import SubsetHead
from specdraft.models.eagle import EagleDrafterModel
from specdraft.models.eagle3 import Eagle3Model
from specdraft.models.medusa import MedusaHeads
from specdraft.training.data import DistillSequence, target_layer_states

# Positions of one sequence scored per loss call (a random subset; keeps the logits' memory bounded).
SCORED_POSITIONS = 256
IGNORE = -100
UNROLLED_STEP_WEIGHT = 0.8  # step j of EAGLE-3's unrolling weighs 0.8**j (SpecForge's ploss_weight)


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


class UnrolledAttention:
    """The attention of EAGLE-3's unrolled training steps, called once per step with that step's rows.

    Row t of step 0 is the pair built from the target's states at t; row t of step j >= 1 is the j-th pair fed
    back after it (position t + j). Each sees the step-0 rows 0 .. t (causal) and its own rows of steps 1 .. j,
    which is what the layer's cache holds when it drafts j tokens after the target's pair t (SpecForge's
    training-time test mask). Step j has fewer rows than step 0 (the last rows have no token to read): row t of
    every step is row t of the first.
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []  # per step [kv, rows, d], rotated
        self.values: list[torch.Tensor] = []  # per step [kv, rows, d]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q `[heads, n, d]`, k and v `[kv, n, d]` of this step -> `[heads, n, d]`."""
        self.keys.append(k)
        self.values.append(v)
        heads, rows, dim = q.shape
        group = heads // k.shape[0]  # query heads per key head, as SDPA's enable_gqa pairs them
        first_keys = self.keys[0].repeat_interleave(group, 0)  # [heads, n0, d]
        first_values = self.values[0].repeat_interleave(group, 0)
        width = first_keys.shape[1]
        scores = q @ first_keys.transpose(1, 2) * dim ** -0.5  # [heads, n, n0]
        causal = torch.ones(rows, width, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        own = [(q * key[:, :rows].repeat_interleave(group, 0)).sum(-1, keepdim=True) * dim ** -0.5
               for key in self.keys[1:]]  # [heads, n, 1] each: the row's own pair of steps 1 .. j
        weights = torch.cat([scores, *own], dim=-1).float().softmax(-1).to(q.dtype)  # [heads, n, n0 + j]
        attended = weights[..., :width] @ first_values  # [heads, n, d]
        for step, value in enumerate(self.values[1:]):
            own_value = value[:, :rows].repeat_interleave(group, 0)  # [heads, n, d]
            attended = attended + weights[..., width + step:width + step + 1] * own_value
        return attended


class Eagle3Objective:
    """EAGLE-3's training-time test (see the module doc) for `model` on `target`'s states, `ttt_length` steps,
    computed in the target's dtype (autocast to bf16 for a bf16 target; float32 throughout for a float32 one)."""

    def __init__(self, model: Eagle3Model, target: CausalLM, ttt_length: int = 7, keep_bytes: int = 0) -> None:
        self.module, self.target, self.ttt_length = model, target, ttt_length
        self.device = target.device
        self.embed = target.model.get_input_embeddings()
        target.read_features_at(self, model.config.resolved_aux_layers(target.config.num_hidden_layers))
        self.keep_bytes = keep_bytes  # memory for the target's states of sequences seen, reread in later epochs
        self._kept: dict[bytes, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._kept_bytes = 0

    def _target_states(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`target_layer_states` of `tokens` `[T]` over the head's vocabulary. The first `keep_bytes` of them are
        kept, keyed by the tokens, so a later epoch reads them instead of running the target again (the same values:
        the target is frozen; its pass was about 70% of a step on a 2-core CPU)."""
        key = tokens.cpu().numpy().tobytes()
        states = self._kept.get(key)
        if states is None:
            states = target_layer_states(self.target, tokens, self.module.lm_head.ids)  # [T, 3H], [T, N], [T]
            size = sum(t.numel() * t.element_size() for t in states)
            if self._kept_bytes + size <= self.keep_bytes:
                self._kept[key] = states
                self._kept_bytes += size
        return states

    def _unroll(self, tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per step j, rows t = 0 .. T - 2 - j: (the head's logits over its vocabulary `[n, N]`, the target's
        distribution over it `[n, N]`, whether the target's top token is in it `[n]`). # tokens: [T]"""
        model, rows = self.module, tokens.shape[0] - 1
        ids = model.lm_head.ids
        features, target_logits, target_top = self._target_states(tokens)  # [T, 3H], [T, N], [T]
        in_vocab = torch.zeros(self.target.vocab_size, dtype=torch.bool, device=self.device)
        in_vocab[ids] = True
        target_probs = target_logits[1:].softmax(-1)  # [T - 1, N]: after pair t, the token x_{t+2}
        counted = in_vocab[target_top[1:]]  # [T - 1]
        with torch.no_grad():
            embeds = model.embed(tokens[1:].to(self.device), self.embed).float()  # [T - 1, H]: x_{t+1}
        attention, steps = UnrolledAttention(), []
        with torch.autocast(self.device.type, dtype=self.target.dtype, enabled=self.target.dtype != torch.float32):
            hidden = model.project(features[:rows].float())  # [T - 1, H]
            for step in range(min(self.ttt_length, rows)):
                count = rows - step  # row t reads x_{t+1+step} and learns the target's next token after it
                positions = torch.arange(count, device=self.device) + step
                out = model(hidden, embeds[step:step + count], positions, use_cache=False, attend=attention)
                logits = model.lm_head.scores(model.head_input(out))  # [count, N]
                steps.append((logits.float(), target_probs[step:step + count], counted[step:step + count]))
                hidden = model.fed_back(out)[:count - 1]  # what the next step's rows read
        return steps

    def loss(self, sequence: DistillSequence, generator: torch.Generator) -> tuple[torch.Tensor, int]:
        count = sequence.tokens.shape[0] - 1
        if count < 1:
            return torch.zeros(()), 0
        total = torch.zeros((), device=self.device)
        for step, (logits, target_probs, counted) in enumerate(self._unroll(sequence.tokens)):
            cross_entropy = -(target_probs * logits.log_softmax(-1)).sum(-1)  # [n]
            total = total + UNROLLED_STEP_WEIGHT ** step * (cross_entropy * counted).sum()
        return total, count

    @torch.no_grad()
    def evaluate(self, sequences: list[DistillSequence]) -> dict[str, float]:
        """`top1@j`: how often the head's top token at unrolled step j is the target's (over the rows past the
        prompt: the chains drafted inside the target's continuation)."""
        right, seen = torch.zeros(self.ttt_length), torch.zeros(self.ttt_length)
        for sequence in sequences:
            start = max(0, sequence.prompt_length - 1)
            for step, (logits, target_probs, counted) in enumerate(self._unroll(sequence.tokens)):
                agree = (logits.argmax(-1) == target_probs.argmax(-1)) & counted
                right[step] += float(agree[start:].sum())
                seen[step] += max(0, agree.shape[0] - start)
        return {f"top1@{j + 1}": float(right[j] / seen[j]) if seen[j] else 0.0 for j in range(self.ttt_length)}


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
