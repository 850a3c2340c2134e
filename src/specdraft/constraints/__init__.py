"""Structured output: answers that must match a JSON schema, any JSON object, a regex or a grammar.

`Constraint` says what the user asked for; `GrammarState` follows one answer through it (llguidance's matcher,
chosen by measured mask time on the bundled 151,936-token vocabulary: docs/benchmarks/2026-11-zen5-constraint-mask-
libraries) and turns each position's grammar state into a mask over the vocabulary.

Exactness under a constraint (docs/exactness.md): the distribution to reproduce is the target's with the
grammar's mask applied before warping, token by token. So at every draft position the mask of the grammar state
after that position's own prefix (along its branch of a tree) is applied to the target's row, and the drafters
apply the same mask to their q before drawing; the state advances along each draft and falls back to the
committed sequence before the next step, so a rejected draft leaves nothing behind. Recovered and bonus tokens come
from the masked target rows. A deterministic proposal (n-gram, suffix, a greedy draft) is cut at its first
forbidden token; a token drawn from a q is never cut by its value (that would bias it away from q): where a
drafter's q is not masked, a drawn forbidden token stays and the verifier rejects it, having p = 0 there. Where the
grammar leaves a single legal token, that token is the masked target's only choice: the decoder appends it without
drafting or verifying (kind "forced", counted in the statistics).
"""

from specdraft.constraints.constraint import CONSTRAINT_KINDS, Constraint
from specdraft.constraints.grammar_state import GrammarState, start_grammar

__all__ = ["CONSTRAINT_KINDS", "Constraint", "GrammarState", "start_grammar"]
