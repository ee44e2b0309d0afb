"""Draft sources for the token tree and their laying onto a template (docs/design.md section 3.9).

`SuffixIndex` finds continuations of the context's longest suffix (up to `max_match` tokens) in the
request's own text, newest occurrence first, as prompt lookup and suffix decoding do. `lay_tree` merges
every source's branches into one trie rooted at x_t (a shared prefix is one node whose score is the sum
of its branches') and lays it onto a TreeTemplate: the rank-r slot under a node gets its r-th best child.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trt_lookahead.lookahead.tree import ROOT, TreeTemplate

SUFFIX = "suffix"  # the origin of suffix-matched drafts
SCAN = 4  # occurrences of one match read per continuation asked for (repeats are skipped)
Branch = tuple[Sequence[int], str, float]  # (tokens after x_t, origin, score)


class SuffixIndex:
    """Every n-gram (n <= max_match) of a growing token list -> the indices where it ends, oldest first."""

    def __init__(self, max_match: int = 4) -> None:
        if max_match < 1:
            raise ValueError(f"suffix matching needs max_match >= 1, got {max_match}")
        self.max_match = max_match
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        seq, ends = self.tokens, self._ends
        for t in tokens:
            seq.append(int(t))
            last = len(seq) - 1
            for n in range(1, min(self.max_match, len(seq)) + 1):
                ends.setdefault(tuple(seq[last - n + 1 :]), []).append(last)

    def continuations(self, depth: int, limit: int) -> list[tuple[tuple[int, ...], int]]:
        """Up to `limit` distinct (continuation of at most `depth` tokens, match length), longest match first,
        then newest occurrence first; the current end of the text is never its own match."""
        seq, last = self.tokens, len(self.tokens) - 1
        found: list[tuple[tuple[int, ...], int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_match, len(seq)), 0, -1):
            ends = self._ends.get(tuple(seq[last - n + 1 :]), ())
            for end in ends[: -SCAN * limit - 1 : -1]:  # the newest occurrences: a common token has thousands
                following = tuple(seq[end + 1 : end + 1 + depth])
                if end == last or following in seen:
                    continue
                seen.add(following)
                found.append((following, n))
                if len(found) == limit:
                    return found
        return found


def lay_tree(template: TreeTemplate, ranks: Sequence[int], branches: Sequence[Branch], drafts: np.ndarray,
             origins: list[str]) -> None:
    """Fill drafts[:V] / origins[:V] (V = template.nodes) from the trie of `branches`; empty slots keep -1.

    ranks: template.rank as a list (read per node). Children are ranked by score, ties in branch order.
    """
    child: list[dict[int, int]] = [{}]
    score, origin, token = [0.0], [""], [ROOT]
    for tokens, source, weight in branches:
        node = 0
        for t in tokens:
            nxt = child[node].get(t)
            if nxt is None:
                nxt = child[node][t] = len(token)
                child.append({})
                score.append(0.0)
                origin.append(source)
                token.append(t)
            score[nxt] += weight
            node = nxt
    ranked: dict[int, list[int]] = {}
    placed = [-1] * template.nodes  # the trie node laid at each template node
    for v, parent in enumerate(template.parents):
        at = 0 if parent == ROOT else placed[parent]
        if at < 0:
            continue
        kids = ranked.get(at)
        if kids is None:
            kids = ranked[at] = sorted(child[at].values(), key=lambda c: -score[c])
        if ranks[v] < len(kids):
            c = placed[v] = kids[ranks[v]]
            drafts[v] = token[c]
            origins[v] = origin[c]
