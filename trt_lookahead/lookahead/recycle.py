"""Recycled top-k: every token's most likely successors, as the model last computed them (docs/design.md 3.9).

A step already computes the next-token distribution at each of its output slots; the executor returns the
top RECYCLE_K ids there (StepBatch.top_ids). `SuccessorMap.record` keeps, for each input token, the top-k
of the newest slot that fed it (Token Recycling's adjacency matrix, arXiv 2408.08696). `SuccessorMap.chains`
gives x_t's likeliest successors, each continued by its own likeliest successor, as branches that compete in
the trie with the other sources; `fill_recycled` then fills the draft-tree slots the trie left empty, from
the successors of each slot's parent token.

    chains, successors {5: [7, 9], 7: [3, 4], 3: [5]}, x_t = 5, 2 ranks, depth 4:  [(7, 3, 5, 7), (9,)]

Worked example, template parents [-1, 0, 0, -1] (x_t -> a -> {b, c}; x_t -> d), x_t = 5:
    successors {5: [7, 9], 7: [3, 4], 9: [1, 2]}, drafts after the trie [7, -1, -1, -1]
    node 1 (rank 0 under 7): 3;  node 2 (rank 1 under 7): 4, the next successor not taken by a sibling;
    node 3 (rank 1 under x_t): 9, since 7 is taken  ->  drafts [7, 3, 4, 9]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trt_lookahead.lookahead.tree import ROOT

RECYCLE = "recycled"  # the origin of recycled drafts
RECYCLE_K = 8  # successors kept per token (the widest rank a template node takes from them)
RECYCLE_CHAINS = 2  # x_t's likeliest successors offered to the trie as chains (docs/design.md 3.9)


class SuccessorMap:
    """token -> its top-k successors (a tuple, most likely first) from the newest step slot that fed it.

    With `shared` (a runtime's map, pool scope "shared"), records feed both maps and a token this map has never
    seen is looked up there: a request's own context wins over other requests' (docs/design.md 3.9).
    """

    def __init__(self, shared: SuccessorMap | None = None) -> None:
        self.table: dict[int, tuple[int, ...]] = {}  # bounded by the vocabulary: one entry per token
        self.shared = shared

    def __len__(self) -> int:
        return len(self.table)

    def tables(self) -> tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]]:
        """(own, shared) tables: look in own first; a recorded tuple is never empty, so `own.get(t) or
        shared.get(t, ())` falls through to the shared map exactly where this one has no entry."""
        return self.table, self.shared.table if self.shared is not None else {}

    def get(self, token: int) -> tuple[int, ...]:
        own, shared = self.tables()
        return own.get(token) or shared.get(token, ())

    def chains(self, x: int, ranks: int, depth: int) -> list[tuple[int, ...]]:
        """x's `ranks` likeliest successors, each continued by its likeliest successor up to `depth` tokens."""
        get, found = self.get, []
        for token in get(x)[:ranks]:
            chain = [token]
            while len(chain) < depth and (following := get(chain[-1])):
                chain.append(following[0])
            found.append(tuple(chain))
        return found

    def record(self, inputs: np.ndarray, top: np.ndarray) -> None:
        """inputs [K] the tokens fed at K output slots, top [K, k] the model's top-k there; later slots win."""
        pairs = list(zip(inputs.tolist(), map(tuple, top.tolist()), strict=True))
        self.table.update(pairs)
        if self.shared is not None:
            self.shared.table.update(pairs)


def fill_recycled(parents: Sequence[int], drafts: np.ndarray, origins: list[str], successors: SuccessorMap,
                  x: int) -> None:
    """Fill the empty (-1) nodes of drafts[:V] (V = len(parents), parents first) with recycled successors, in place.

    A node takes its parent token's (x for a depth-1 node) most likely successor that no earlier sibling
    holds; a node whose parent is empty stays empty.
    """
    V = len(parents)
    tokens = drafts[:V].tolist()
    own, shared = successors.tables()  # the lookup `get` makes, inlined: one dict lookup per node
    taken: dict[int, list[int]] = {}  # node (ROOT = x_t) -> the tokens its children hold so far
    for v, p in enumerate(parents):
        token = tokens[v]
        siblings = taken.get(p)
        if token < 0:
            parent = x if p == ROOT else tokens[p]
            if parent < 0:
                continue
            for token in own.get(parent) or shared.get(parent, ()):
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
