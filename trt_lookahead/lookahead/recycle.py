"""Recycled top-k: every token's most likely successors, as the model last computed them (docs/design.md 3.9).

A step already computes the next-token distribution at each of its output slots; the executor returns the
top RECYCLE_K ids there (StepBatch.top_ids). `SuccessorMap.record` keeps, for each input token, the top-k
of the newest slot that fed it (Token Recycling's adjacency matrix, arXiv 2408.08696), and the same for each
(previous token, token) pair a slot fed, which a lookup tries first. `SuccessorMap.chains`
gives x_t's likeliest successors, each continued by its own likeliest successor, as branches that compete in
the trie with the other sources; `fill_recycled` then fills the draft-tree slots the trie left empty, from
the successors of each slot's parent token.

    chains, successors {5: [7, 9], 7: [3, 4], 3: [5]}, x_t = 5, 2 ranks, depth 4:  [(7, 3, 5, 7), (9,)]
    the same with the pair (5, 7) -> [4] recorded too: 7 after 5 is followed by 4  ->  [(7, 4), (9,)]

Worked example, template parents [-1, 0, 0, -1] (x_t -> a -> {b, c}; x_t -> d), x_t = 5:
    successors {5: [7, 9], 7: [3, 4], 9: [1, 2]}, drafts after the trie [7, -1, -1, -1]
    node 1 (rank 0 under 7): 3;  node 2 (rank 1 under 7): 4, the next successor not taken by a sibling;
    node 3 (rank 1 under x_t): 9, since 7 is taken  ->  drafts [7, 3, 4, 9]
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

import numpy as np

from trt_lookahead.lookahead.tree import ROOT

RECYCLE = "recycled"  # the origin of recycled drafts
RECYCLE_K = 8  # successors kept per token (the widest rank a template node takes from them)
RECYCLE_CHAINS = 2  # x_t's likeliest successors offered to the trie as chains (docs/design.md 3.9)
# (previous, token) pairs a map keeps, ~460 bytes each with their top-k: a request's recent context (~200 steps at
# 7/5/7), and a runtime's shared map (~60 MB), which a long-lived server would otherwise grow without bound
REQUEST_PAIRS, SHARED_PAIRS = 1 << 13, 1 << 17
NO_CONTEXT = -1  # a slot whose previous token is not known


def context_key(previous: int, token: int) -> int:
    """One int for the pair (previous, token): token ids are below 2**32."""
    return previous << 32 | token


class SuccessorMap:
    """token -> its top-k successors (a tuple, most likely first) from the newest step slot that fed it, and the same
    keyed by (previous token, token) where the slot's previous token is known (`context_key`).

    A lookup tries the pair first: the model's top-k after two tokens of context, where it has computed them, is a
    better guess than after one. With `shared` (a runtime's map, pool scope "shared"), records feed both maps, and
    a lookup reads this map (pair, then token) before the shared one (pair, then token): a request's own context
    wins over other requests' (docs/design.md 3.9). Past `pairs` pairs, the older half (by first write) is dropped.
    """

    def __init__(self, shared: SuccessorMap | None = None, pairs: int = REQUEST_PAIRS) -> None:
        self.table: dict[int, tuple[int, ...]] = {}  # bounded by the vocabulary: one entry per token
        self.pairs: dict[int, tuple[int, ...]] = {}  # context_key -> top-k, in the order first written
        self.capacity = pairs
        self.shared = shared

    def __len__(self) -> int:
        return len(self.table)

    def tables(self) -> tuple[dict[int, tuple[int, ...]], ...]:
        """(own pairs, own tokens, shared pairs, shared tokens): the order a lookup tries them in. A recorded tuple
        is never empty, so `a.get(k) or b.get(k)` falls through exactly where `a` has no entry."""
        shared = self.shared
        if shared is None:
            return self.pairs, self.table, {}, {}
        return self.pairs, self.table, shared.pairs, shared.table

    def get(self, token: int, previous: int = NO_CONTEXT) -> tuple[int, ...]:
        """token's successors after `previous`, else after token alone: this map's, then the shared map's (() if
        neither recorded it)."""
        own_pairs, own, shared_pairs, shared = self.tables()
        if previous < 0:
            return own.get(token) or shared.get(token, ())
        key = context_key(previous, token)
        return own_pairs.get(key) or own.get(token) or shared_pairs.get(key) or shared.get(token, ())

    def chains(self, x: int, ranks: int, depth: int, previous: int = NO_CONTEXT) -> list[tuple[int, ...]]:
        """x's `ranks` likeliest successors (after `previous`, x), each continued by its likeliest successor up to
        `depth` tokens."""
        get, found = self.get, []
        for token in get(x, previous)[:ranks]:
            chain = [x, token]
            while len(chain) <= depth and (following := get(chain[-1], chain[-2])):
                chain.append(following[0])
            found.append(tuple(chain[1:]))
        return found

    def record(self, inputs: np.ndarray, top: np.ndarray, previous: Sequence[int] | None = None) -> None:
        """inputs [K] the tokens fed at K output slots, top [K, k] the model's top-k there, previous [K] the token
        before each in its slot's context (NO_CONTEXT: unknown); later slots win."""
        tokens, tops = inputs.tolist(), list(map(tuple, top.tolist()))
        entries = list(zip(tokens, tops, strict=True))  # once for both maps
        maps = (self,) if self.shared is None else (self, self.shared)
        for m in maps:
            m.table.update(entries)
        if previous is None:
            return
        # context_key inlined: ~100 slots a step at T = 120 (hot path)
        pairs = [(p << 32 | t, k) for p, t, k in zip(previous, tokens, tops, strict=True) if p >= 0]
        for m in maps:
            m.pairs.update(pairs)
            if len(m.pairs) > m.capacity:  # keep the newest half: one rebuild per capacity / 2 new pairs
                m.pairs = dict(islice(m.pairs.items(), len(m.pairs) - m.capacity // 2, None))


def fill_recycled(parents: Sequence[int], drafts: np.ndarray, origins: list[str], successors: SuccessorMap,
                  x: int, previous: int = NO_CONTEXT) -> None:
    """Fill the empty (-1) nodes of drafts[:V] (V = len(parents), parents first) with recycled successors, in place.

    A node takes the most likely successor of its parent token (x at depth 1) after its grandparent's (`previous`
    at depth 1), as `SuccessorMap.get` looks it up, that no earlier sibling holds; a node whose parent is empty
    stays empty.
    """
    V = len(parents)
    tokens = drafts[:V].tolist()
    own_pairs, own, shared_pairs, shared = successors.tables()  # the lookup `get` makes, inlined (hot path)
    taken: dict[int, list[int]] = {}  # node (ROOT = x_t) -> the tokens its children hold so far
    for v, p in enumerate(parents):
        token = tokens[v]
        siblings = taken.get(p)
        if token < 0:
            if p == ROOT:
                parent, grand = x, previous
            else:
                parent, q = tokens[p], parents[p]
                grand = x if q == ROOT else tokens[q]
            if parent < 0:
                continue
            key = grand << 32 | parent  # context_key, inlined
            found = ((grand >= 0 and own_pairs.get(key)) or own.get(parent) or (grand >= 0 and shared_pairs.get(key))
                     or shared.get(parent, ()))
            for token in found:
                if siblings is None or token not in siblings:
                    break
            else:
                continue
            tokens[v], origins[v] = token, RECYCLE
        if siblings is None:
            taken[p] = [token]
        else:
            siblings.append(token)
    drafts[:V] = tokens
