"""The `suffix` drafter (SuffixDecoding, Oliaro et al. 2024): continue the tail by what followed it before.

Two counted, depth-limited suffix tries (every window `tokens[i : i + max_depth]` of a sequence is a
path from the root; a node counts how often its path occurred):

- the **current** trie holds this request's prompt and committed tokens, indexed as they come
  (one appended token costs O(max_depth): the "open" nodes of the suffixes ending at the last
  position are each extended by it);
- the **corpus** trie holds earlier requests (prompt + output), at most `max_requests` of them and
  at most `max_nodes` nodes; the least recently used request is evicted whole (its windows are
  subtracted and nodes whose count reaches 0 are dropped). A request is used when it is added
  and when a proposal draws from it.

Keeping the two apart means a pattern seen a hundred times in the corpus does not drown what
this request itself just did (its own text is usually the better predictor), and the corpus
changes only between requests, so matching the tail against it is incremental too.

Proposal. For each suffix of the sequence of length m in [`min_match`, `max_depth` - 1] that
occurred before *with a continuation* (the occurrence at the very end has none: it adds to a
node's count but not to its children's total, which is what probabilities are taken from), walk
down taking the most frequent child (ties: the most recent) with empirical probability
`child.count / parent's children total`, while the running product stays >= `min_score` and
the length <= min(k, `max_spec_factor` * m). A walk's score is Σ_i Π_{j≤i} p_j, the expected
number of accepted tokens if the counts were the truth; the highest-scoring walk over every
match length and both tries is the draft (ties: the longer match, then the current request).
Scoring every match length rather than only the longest matters in a depth-limited trie: the
longest match leaves the least depth below it to continue into.

Trees (`ctx.tree_branch > 1`, SuffixDecoding's speculation trees). From each such match node,
grow a tree best first: a node's score is the product of the empirical probabilities along its
path, the frontier holds at most `tree_branch` children of each kept node (the most frequent,
ties: the most recent), and the `k` best-scoring nodes are kept, those with score >= `min_score`
and depth <= min(`ctx.max_depth`, `max_spec_factor` * m, `max_depth` - m). Scores never grow
along a path, so the kept set is ancestor-closed, and listing nodes in the order they were kept
(score desc, then depth, then sibling rank) puts parents first and siblings likeliest first. A
tree's score is the sum of its nodes' scores (again the expected accepted tokens); as for chains,
the best tree over every match length and both tries is the draft, not a merge of the tries: the
two tries' counts measure different things (this request vs. many earlier ones), so adding them
would let the corpus drown the request, and the per-match choice is what the chain already does.

The proposal is deterministic (`q_draft = None`), so verification treats it as a point mass and
the output stays exactly the target's. No model runs: a step costs a few hundred dictionary
look-ups (c ≈ 0).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass
from heapq import nlargest
from operator import attrgetter

import torch

from specdraft.drafters.base import Draft, DraftContext, Drafter
from specdraft.errors import SpecdraftError
from specdraft.tree import grow_best_first

DEFAULT_MAX_DEPTH = 24  # trie depth: the longest match plus what can follow it
DEFAULT_MIN_MATCH = 2  # one-token matches propose often and are mostly wrong
DEFAULT_MIN_SCORE = 0.1  # stop once the walk's estimated survival falls below this
DEFAULT_MAX_SPEC_FACTOR = 1.5  # draft at most this many tokens per matched token (tuning: drafter doc)
DEFAULT_MAX_REQUESTS = 64  # earlier requests remembered
DEFAULT_MAX_NODES = 1 << 20  # corpus trie nodes (~100 bytes each in CPython)
FIRST_LIMIT = 8  # draft length `source` prepares for before any `propose` said what k is


class _Node:
    """One trie node: the path from the root to it occurred `count` times.

    `total` is the sum of the children's counts (occurrences that went on to another token);
    `children` is None, the only child itself, or a dict token -> child (a lone child is kept
    without a dict: most nodes of a depth-limited trie have exactly one). `stamp` is the trie's
    clock when an insertion last passed through: recency breaks count ties, and in the corpus
    it names the request that inserted it.
    """

    __slots__ = ("token", "count", "total", "children", "stamp")

    def __init__(self, token: int, stamp: int) -> None:
        self.token = token
        self.count = 0
        self.total = 0
        self.children: _Node | dict[int, _Node] | None = None
        self.stamp = stamp


def _child(node: _Node, token: int) -> _Node | None:
    """The child of `node` reached by `token`, if any."""
    children = node.children
    if children is None:
        return None
    if type(children) is dict:
        return children.get(token)
    return children if children.token == token else None


_rank = attrgetter("count", "stamp")  # most frequent child; among equals, the most recent


def _best_child(node: _Node) -> _Node | None:
    children = node.children
    if type(children) is dict:
        return max(children.values(), key=_rank)
    return children


def _best_children(node: _Node, branch: int) -> list[_Node]:
    """At most `branch` children of `node`, likeliest first (most frequent, ties: most recent)."""
    children = node.children
    if children is None:
        return []
    if type(children) is dict:
        return nlargest(branch, children.values(), key=_rank)
    return [children]


class SuffixTrie:
    """A counted suffix trie limited to `max_depth` tokens per path (module doc).

    A sequence is inserted by `append`ing its tokens one at a time to a list of open nodes,
    `open_nodes[j]` being the node of its last j tokens (`open_nodes[0]` is the root); it is
    removed again, window by window, with `remove`.
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(-1, 0)
        self.num_nodes = 0  # not counting the root
        self.clock = 0  # one tick per appended token

    def append(self, open_nodes: list[_Node], token: int) -> list[_Node]:
        """Count `token` after every suffix in `open_nodes`; the open nodes one token later."""
        self.clock += 1
        stamp = self.clock
        keep = self.max_depth - 1  # deeper nodes can have no children, so they are not kept open
        next_open = [self.root]
        for depth, node in enumerate(open_nodes):
            children = node.children
            if children is None:
                child = node.children = _Node(token, stamp)
                self.num_nodes += 1
            elif type(children) is dict:
                child = children.get(token)
                if child is None:
                    child = children[token] = _Node(token, stamp)
                    self.num_nodes += 1
            elif children.token == token:
                child = children
            else:
                child = _Node(token, stamp)
                node.children = {children.token: children, token: child}
                self.num_nodes += 1
            child.count += 1
            child.stamp = stamp
            node.total += 1
            if depth < keep:
                next_open.append(child)
        return next_open

    def insert(self, tokens: list[int]) -> list[_Node]:
        """Count every window of `tokens`; the open nodes after its last token."""
        open_nodes = [self.root]
        for token in tokens:
            open_nodes = self.append(open_nodes, token)
        return open_nodes

    def remove(self, tokens: list[int]) -> None:
        """Undo `insert(tokens)`: subtract each window's path and drop nodes whose count reaches 0."""
        depth_limit = self.max_depth
        for start in range(len(tokens)):
            window = tokens[start : start + depth_limit]
            parent = self.root
            for depth, token in enumerate(window):
                node = _child(parent, token)
                node.count -= 1
                parent.total -= 1
                if node.count == 0:
                    # Everything below had count <= 1, i.e. only this window's occurrence: the rest
                    # of the window's path goes with it.
                    self._unlink(parent, token)
                    self.num_nodes -= len(window) - depth
                    break
                parent = node

    @staticmethod
    def _unlink(parent: _Node, token: int) -> None:
        children = parent.children
        if type(children) is dict:
            del children[token]
            if len(children) == 1:
                parent.children = next(iter(children.values()))
        else:
            parent.children = None

    def walk(self, node: _Node, limit: int, min_score: float) -> tuple[list[int], list[float], _Node]:
        """Up to `limit` tokens below `node`, each the most frequent child, while the product of
        their probabilities stays >= `min_score`; with each token's score Π_{j≤i} p_j (the walk's
        score is their sum) and the last node reached."""
        tokens: list[int] = []
        scores: list[float] = []
        survival = 1.0
        while len(tokens) < limit and node.total:
            child = _best_child(node)
            survival *= child.count / node.total
            if survival < min_score:
                break
            tokens.append(child.token)
            scores.append(survival)
            node = child
        return tokens, scores, node

    @staticmethod
    def grow(node: _Node, limit: int, branch: int, depth: int, min_score: float
             ) -> tuple[list[int], list[int], list[float], int]:
        """The speculation tree below `node` (module doc): at most `limit` nodes, at most `branch`
        children each, at most `depth` deep, each with score (product of probabilities) >= `min_score`.
        Returns tokens, parents (-1: `node`), each node's score, and the newest stamp used."""
        def children(parent: _Node, parent_depth: int, parent_score: float):
            if parent_depth >= depth or not parent.total:
                return
            for child in _best_children(parent, branch):
                score = parent_score * child.count / parent.total
                if score < min_score:
                    return  # the rest are no likelier
                yield child.token, score, child

        tokens, parents, scores, nodes = grow_best_first(node, children, limit)
        return tokens, parents, scores, max((child.stamp for child in nodes), default=0)


@dataclass
class SuffixProposal:
    """The best continuation found for the current sequence (empty: nothing worth proposing)."""

    tokens: list[int]
    scores: list[float]  # per token, the product of empirical probabilities along its path
    match_length: int  # tokens of the tail that matched (0: no proposal)
    request_id: int | None = None  # the corpus request it was drawn from; None: the current request
    parents: list[int] | None = None  # a tree: parent index per token (-1: the last committed token); None: a chain

    @property
    def score(self) -> float:
        """Expected accepted tokens under the empirical counts: Σ of the tokens' scores."""
        return sum(self.scores)


NO_PROPOSAL = SuffixProposal([], [], 0)


@dataclass
class _StoredRequest:
    tokens: list[int]  # what was inserted (prompt + output, at most max_nodes // max_depth tokens)
    first_stamp: int  # the corpus clock range its insertion used
    last_stamp: int


class SuffixMemory:
    """Earlier requests (prompt + output) in one counted trie, the corpus: at most `max_requests` of them and at most
    `max_nodes` nodes, the least recently used evicted whole (module doc). A drafter's own, or shared by the
    drafters of a server's sequences of one cache salt, which each match the current request against it;
    `version` counts its changes, so a request matching against it knows to match again."""

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH, max_requests: int = DEFAULT_MAX_REQUESTS,
                 max_nodes: int = DEFAULT_MAX_NODES) -> None:
        self.max_depth, self.max_requests, self.max_nodes = max_depth, max_requests, max_nodes
        self.corpus = SuffixTrie(max_depth)
        self.requests: OrderedDict[int, _StoredRequest] = OrderedDict()  # least recently used first
        self.version = 0
        self._next_id = 0
        self._first_stamps: list[int] = []  # of the stored requests, ascending (they are inserted in order)
        self._stamp_owners: list[int] = []  # request id for each entry of _first_stamps

    def store(self, sequence: list[int]) -> int | None:
        """Store `sequence` (a request's prompt + output), evicting least recently used requests beyond
        `max_requests` / `max_nodes`. Returns the new request's id (None: nothing stored)."""
        # A request alone never outgrows the node budget: N tokens make at most N * max_depth nodes.
        stored = sequence[-(self.max_nodes // self.max_depth):] if self.max_nodes >= self.max_depth else []
        if self.max_requests == 0 or len(stored) < 2:
            return None
        first_stamp = self.corpus.clock + 1
        self.corpus.insert(stored)
        self.version += 1
        request_id = self._next_id
        self._next_id += 1
        self.requests[request_id] = _StoredRequest(stored, first_stamp, self.corpus.clock)
        self._first_stamps.append(first_stamp)
        self._stamp_owners.append(request_id)
        while len(self.requests) > self.max_requests or self.corpus.num_nodes > self.max_nodes:
            self.evict(next(iter(self.requests)))
        return request_id if request_id in self.requests else None

    def touch(self, request_id: int) -> None:
        """Mark a stored request as just used (it is evicted last)."""
        if request_id in self.requests:
            self.requests.move_to_end(request_id)

    def evict(self, request_id: int) -> None:
        """Forget a stored request: its windows leave the corpus counts."""
        stored = self.requests.pop(request_id)
        self.corpus.remove(stored.tokens)
        self.version += 1
        i = self._stamp_owners.index(request_id)
        del self._first_stamps[i], self._stamp_owners[i]

    def owner(self, stamp: int) -> int | None:
        """The stored request whose insertion last passed through a node with this stamp (None: it
        has been evicted since, and the node survives through other requests)."""
        i = bisect_right(self._first_stamps, stamp) - 1
        if i < 0:
            return None
        request_id = self._stamp_owners[i]
        return request_id if stamp <= self.requests[request_id].last_stamp else None


class SuffixIndex:
    """The current request's trie, matched with a `SuffixMemory` of earlier requests (module doc).

    `start_request(prompt)`, `extend(new_tokens)` as the sequence grows, `propose(...)` any
    time, `finish_request(sequence)` to move the request into the memory (its own, or `memory` shared).
    """

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH, max_requests: int = DEFAULT_MAX_REQUESTS,
                 max_nodes: int = DEFAULT_MAX_NODES, memory: SuffixMemory | None = None) -> None:
        self.memory = memory if memory is not None else SuffixMemory(max_depth, max_requests, max_nodes)
        self.max_depth = self.memory.max_depth
        self._reset_current()

    @property
    def corpus(self) -> SuffixTrie:
        return self.memory.corpus

    @property
    def requests(self) -> OrderedDict[int, _StoredRequest]:
        return self.memory.requests

    def _reset_current(self) -> None:
        self.tokens: list[int] = []  # the current request: prompt + committed tokens
        self.current = SuffixTrie(self.max_depth)
        self._open = [self.current.root]  # current-trie nodes of the last j tokens, j = 0 .. max_depth - 1
        self._corpus_matches = [self.corpus.root]  # corpus nodes of the last j tokens, j = 0 .. longest
        self._version = self.memory.version  # of the memory those matches were made in

    # -- the current request -------------------------------------------------------------------
    def start_request(self, prompt: list[int]) -> None:
        """Forget the current request (without storing it) and start one with `prompt`."""
        self._reset_current()
        self.extend(prompt)

    def extend(self, new_tokens: list[int]) -> None:
        """The current sequence grew by `new_tokens`."""
        self.tokens.extend(new_tokens)
        trie, open_nodes = self.current, self._open
        for token in new_tokens:
            open_nodes = trie.append(open_nodes, token)
        self._open = open_nodes
        if self._version != self.memory.version:  # another request changed the shared memory
            self._rematch_corpus()
            return
        if len(new_tokens) >= self.max_depth - 1:  # only the last max_depth - 1 tokens can match
            self._corpus_matches = [self.corpus.root]
            new_tokens = new_tokens[-(self.max_depth - 1):]
        for token in new_tokens:
            self._match_corpus(token)

    def _match_corpus(self, token: int) -> None:
        """Follow `token` from every corpus node matching a suffix (if the suffix of length j + 1
        is in the corpus, so is that of length j: the matches are a prefix of the list)."""
        matches = [self.corpus.root]
        for node in self._corpus_matches[: self.max_depth - 1]:
            child = _child(node, token)
            if child is None:
                break
            matches.append(child)
        self._corpus_matches = matches

    def _rematch_corpus(self) -> None:
        """Recompute the corpus matches after the corpus changed under a live request."""
        self._corpus_matches = [self.corpus.root]
        self._version = self.memory.version
        for token in self.tokens[-(self.max_depth - 1):]:
            self._match_corpus(token)

    def _matched(self) -> list[_Node]:
        """The corpus matches of the current tail, made again if the memory changed since."""
        if self._version != self.memory.version:
            self._rematch_corpus()
        return self._corpus_matches

    def match_lengths(self) -> tuple[int, int]:
        """Longest tail of the current sequence that occurred before with a continuation, in the
        current request and in the corpus (0: none)."""
        def longest(nodes: list[_Node]) -> int:
            return max((j for j in range(1, len(nodes)) if nodes[j].total), default=0)
        return longest(self._open), longest(self._matched())

    # -- proposing -----------------------------------------------------------------------------
    def propose(self, limit: int, min_match: int = DEFAULT_MIN_MATCH, min_score: float = DEFAULT_MIN_SCORE,
                max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR) -> SuffixProposal:
        """The highest-scoring walk of at most `limit` tokens over every match length and both tries."""
        best = NO_PROPOSAL
        best_node: _Node | None = None
        for trie, matches in ((self.current, self._open), (self.corpus, self._matched())):
            found = False
            for length in range(len(matches) - 1, min_match - 1, -1):  # longest first: it wins ties
                cap = min(limit, int(max_spec_factor * length + 1e-9), self.max_depth - length)
                if cap <= best.score:  # every probability is <= 1, so the score is <= the length
                    continue
                node = matches[length]
                if not node.total:  # only the occurrence at the very end: nothing followed it
                    continue
                tokens, scores, last = trie.walk(node, cap, min_score)
                if sum(scores) > best.score:
                    best, best_node, found = SuffixProposal(tokens, scores, length), last, True
            if found and trie is self.corpus:
                best.request_id = self.memory.owner(best_node.stamp)
        return best

    def propose_tree(self, limit: int, branch: int, depth: int | None = None, min_match: int = DEFAULT_MIN_MATCH,
                     min_score: float = DEFAULT_MIN_SCORE, max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR
                     ) -> SuffixProposal:
        """The highest-scoring tree of at most `limit` nodes, `branch` children per node and `depth`
        levels (None: no cap beyond the match's) over every match length and both tries (module doc)."""
        best = NO_PROPOSAL
        best_stamp = 0
        for trie, matches in ((self.current, self._open), (self.corpus, self._matched())):
            found = False
            for length in range(len(matches) - 1, min_match - 1, -1):  # longest first: it wins ties
                levels = min(int(max_spec_factor * length + 1e-9), self.max_depth - length)
                if depth is not None:
                    levels = min(levels, depth)
                # Scores at one depth sum to <= 1, so a tree scores <= its depth (and <= its size).
                if min(limit, levels) <= best.score:
                    continue
                node = matches[length]
                if not node.total:  # only the occurrence at the very end: nothing followed it
                    continue
                tokens, parents, scores, stamp = trie.grow(node, limit, branch, levels, min_score)
                if sum(scores) > best.score:
                    best, best_stamp, found = SuffixProposal(tokens, scores, length, parents=parents), stamp, True
            if found and trie is self.corpus:
                best.request_id = self.memory.owner(best_stamp)
        return best

    # -- the memory ----------------------------------------------------------------------------
    def finish_request(self, sequence: list[int]) -> int | None:
        """Drop the current request and store `sequence` (its prompt + output) in the memory (`SuffixMemory.store`).
        Returns the new request's id (None: nothing stored)."""
        self._reset_current()
        request_id = self.memory.store(sequence)
        self._rematch_corpus()
        return request_id

    def touch(self, request_id: int) -> None:
        """Mark a stored request as just used (it is evicted last)."""
        self.memory.touch(request_id)

    def evict(self, request_id: int) -> None:
        """Forget a stored request: its windows leave the corpus counts."""
        self.memory.evict(request_id)
        self._rematch_corpus()


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise SpecdraftError(message)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class SuffixDrafter(Drafter):
    """SuffixDecoding: draft what followed the tail before, in this request or an earlier one (module doc).

    The index persists across requests: the same drafter used for many prompts remembers the
    earlier ones (up to `max_requests` / `max_nodes`, least recently used evicted first); drafters given one
    `memory` (a server's sequences of one cache salt) remember those of all of them, its bounds theirs.
    `max_spec_factor` caps a draft at that many tokens per matched token: a 2-token match drafts
    at most 3, a match of 6 up to 9 (short matches are weak evidence, long ones strong). On word
    tokens of stdlib source (fresh and near-repeated requests, perfect-target simulation) 1.5 gave
    the most committed tokens per unit of verification width: 1.0 drafts too little on repeats,
    2.0 and 3.0 add tokens at falling acceptance. `min_score` between 0.05 and 0.3 changed that
    by under 0.5%; 0.1 is SuffixDecoding's value.

    With `ctx.tree_branch > 1` the draft is a speculation tree of up to `k` nodes (module doc);
    `ctx.max_depth` caps its depth. With `ctx.tree_branch == 1` it is the chain described above.
    """

    name = "suffix"

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH, min_match: int = DEFAULT_MIN_MATCH,
                 min_score: float = DEFAULT_MIN_SCORE, max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR,
                 max_requests: int = DEFAULT_MAX_REQUESTS, max_nodes: int = DEFAULT_MAX_NODES,
                 memory: SuffixMemory | None = None) -> None:
        _check(_is_int(max_depth) and 2 <= max_depth <= 1024,
               f"suffix max depth must be an integer in [2, 1024], got {max_depth!r}.")
        _check(_is_int(min_match) and 1 <= min_match < max_depth,
               f"suffix min match must be an integer in [1, max depth - 1 = {max_depth - 1}], got {min_match!r}.")
        _check(isinstance(min_score, (int, float)) and not isinstance(min_score, bool) and 0.0 <= min_score <= 1.0,
               f"suffix min score must be a number in [0, 1], got {min_score!r}.")
        _check(isinstance(max_spec_factor, (int, float)) and not isinstance(max_spec_factor, bool)
               and 0.0 < max_spec_factor < float("inf"),
               f"suffix max spec factor (draft tokens per matched token) must be a positive number, "
               f"got {max_spec_factor!r}.")
        _check(_is_int(max_requests) and max_requests >= 0,
               f"suffix max requests must be an integer >= 0 (0: remember no earlier request), got {max_requests!r}.")
        _check(_is_int(max_nodes) and max_nodes >= 0,
               f"suffix max nodes must be an integer >= 0, got {max_nodes!r}.")
        self.min_match, self.min_score, self.max_spec_factor = min_match, float(min_score), float(max_spec_factor)
        self.index = SuffixIndex(max_depth, max_requests, max_nodes, memory)
        self._in_request = False
        self._limit = FIRST_LIMIT  # the k of the last `propose`: what `source` prepares a proposal for
        self._cached = NO_PROPOSAL  # the proposal for a sequence of length _cached_len, made with _cached_limit
        self._cached_len, self._cached_limit = -1, 0
        self._cached_shape: tuple[int, int | None] = (1, None)  # (tree_branch, max_depth) it was made for

    def begin(self, prompt: torch.Tensor) -> None:  # prompt: [L] int64
        if self._in_request:  # the last request never ended: remember it as far as it was seen
            self.index.finish_request(self.index.tokens)
        self.index.start_request(prompt.tolist())
        self._in_request = True
        self._cached_len = -1

    def _catch_up(self, sequence: torch.Tensor) -> None:  # sequence: [L], grows by committed tokens only
        known = len(self.index.tokens)
        if not self._in_request or sequence.shape[0] < known:  # no `begin`: a new request
            self.begin(sequence)
        elif known == 0:
            self.index.extend(sequence.tolist())
        elif sequence.shape[0] > known:
            tail = sequence[known - 1:].tolist()  # the last known token too, as a check it is the same request
            if tail[0] != self.index.tokens[-1]:
                self.begin(sequence)
            else:
                self.index.extend(tail[1:])

    def _proposal(self, ctx: DraftContext, limit: int) -> SuffixProposal:
        sequence = ctx.sequence  # [L]
        self._catch_up(sequence)
        cached = self._cached
        shape = (ctx.tree_branch, ctx.max_depth) if ctx.tree_branch > 1 else (1, None)
        # A proposal made for a larger limit is still the best one for `limit` if it fits in it
        # (a tree too: it then holds every node its match allows, and no other can score more).
        if (self._cached_len == sequence.shape[0] and self._cached_shape == shape
                and len(cached.tokens) <= limit <= self._cached_limit):
            return cached
        if shape[0] > 1:
            proposal = self.index.propose_tree(limit, shape[0], shape[1], self.min_match, self.min_score,
                                               self.max_spec_factor)
        else:
            proposal = self.index.propose(limit, self.min_match, self.min_score, self.max_spec_factor)
        self._cached, self._cached_len, self._cached_limit = proposal, sequence.shape[0], limit
        self._cached_shape = shape
        return proposal

    def source(self, ctx: DraftContext, declined: frozenset[str] = frozenset()) -> str | None:
        if self.name in declined:
            return None
        return self.name if self._proposal(ctx, self._limit).tokens else None

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        if k < 1:
            return Draft.chain(ctx.sequence.new_empty(0))
        self._limit = k
        proposal = self._proposal(ctx, k)
        if proposal.request_id is not None:
            self.index.touch(proposal.request_id)
        tokens = torch.tensor(proposal.tokens[:k], dtype=torch.long, device=ctx.sequence.device)  # [≤ k]
        scores = proposal.scores[:k]
        # A tree's nodes are in topological order, so its first k are a tree too.
        if proposal.parents is None:
            return Draft.chain(tokens, scores=scores)
        return Draft.tree(tokens, proposal.parents[:k], scores=scores)

    def end(self, sequence: torch.Tensor) -> None:  # sequence: [L] prompt + every committed token
        self.index.finish_request(sequence.tolist())
        self._in_request = False
        self._cached_len = -1
