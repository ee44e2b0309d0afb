"""TreeTemplate: the static shape of the verification branch, a token tree rooted at x_t (docs/design.md 2.7).

A template is a parent array over V nodes in preorder (a node's subtree is the run of nodes after it), so
any prefix of it is again a tree and the mask needs one table: node j's subtree ends before `ends[j]`,
and node i sees node j iff j <= i < ends[j]. Node i sits at relative position depth[i] (1 .. depth).
Siblings are ranked (rank 0 first); the draft laying puts the best-scored branch at rank 0.

    chain_template(G, levels)      today's G linear candidates: G chains of `levels` nodes
    tree_template(nodes, depth)    every tree size from one rule: best-first by a rank-decaying prior
    resolve_tree(spec, config)     what a runtime's `tree` option names: None (linear), auto or parents
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import LookaheadConfig

ROOT = -1  # the parent of depth-1 nodes: x_t, step slot 0
RANK_DECAY = 0.45  # prior acceptance of a rank-r child relative to rank 0 (tree_template's shaping rule)
FIRST_ACCEPT = 0.6  # prior acceptance of a rank-0 child given its parent
DEFAULT_TREE = "auto"  # a checkpoint's tree unless asked otherwise: at equal T it accepts more (docs/design.md 9)
TREE_DEPTH = 6  # the depth of `auto` templates (measured: depth 6 and 8 accept the same, docs/design.md 9)


@dataclass(frozen=True)
class TreeTemplate:
    """V nodes in preorder: parents[i] in [-1, i) and every subtree contiguous; validated on construction."""

    parents: tuple[int, ...]
    depth: np.ndarray = field(init=False, repr=False, compare=False)  # [V] int64 relative position, 1-based
    ends: np.ndarray = field(init=False, repr=False, compare=False)  # [V] int64 exclusive end of node i's subtree
    rank: np.ndarray = field(init=False, repr=False, compare=False)  # [V] int64 rank among its siblings

    def __post_init__(self) -> None:
        V = len(self.parents)
        depth, ends, rank = np.zeros(V, np.int64), np.arange(1, V + 1), np.zeros(V, np.int64)
        children: dict[int, int] = {}
        stack: list[int] = []  # the open path: the current node's ancestors
        for i, p in enumerate(self.parents):
            if isinstance(p, bool) or not isinstance(p, int | np.integer) or not ROOT <= p < i:
                raise ValueError(f"tree node {i} has parent {p!r}: parents must be -1 (x_t) or an earlier node")
            while stack and stack[-1] != p:
                stack.pop()
            if p != ROOT and not stack:
                raise ValueError(f"tree node {i}: its parent {p} is not on the open path, so nodes are not in preorder")
            for a in stack:
                ends[a] = i + 1
            depth[i] = len(stack) + 1
            rank[i] = children.get(p, 0)
            children[p] = rank[i] + 1
            stack.append(i)
        for name, value in (("depth", depth), ("ends", ends), ("rank", rank)):
            value.flags.writeable = False
            object.__setattr__(self, name, value)

    @property
    def nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return int(self.depth.max(initial=0))

    def prefix(self, nodes: int) -> TreeTemplate:
        """The first `nodes` nodes: a tree again (preorder), used by a step with fewer verification slots."""
        if not 0 <= nodes <= self.nodes:
            raise ValueError(f"a {self.nodes}-node tree template has no {nodes}-node prefix")
        return TreeTemplate(self.parents[:nodes])

    def ancestors(self) -> np.ndarray:
        """[V, V] bool: row i marks node i and its ancestors."""
        i = np.arange(self.nodes)
        return (i[None, :] <= i[:, None]) & (i[:, None] < self.ends[None, :])

    @classmethod
    def parse(cls, text: str) -> TreeTemplate:
        """A comma list of parents, e.g. `-1,0,1,-1,3` (the form `str` writes)."""
        try:
            return cls(tuple(int(p) for p in text.replace(" ", "").replace("\n", "").split(",") if p))
        except ValueError as exc:
            raise ValueError(f"tree template {text!r}: {exc}; write parents as a comma list like -1,0,-1") from None

    def __str__(self) -> str:
        return ",".join(map(str, self.parents))


def covers(tree: TreeTemplate | None, config: LookaheadConfig) -> TreeTemplate | None:
    """The tree `config`'s verification slots are laid as: `tree`'s first G(N-1) nodes, or None (G linear
    candidates) without a tree or where it has fewer nodes, so a runtime's tree never caps a request's config."""
    nodes = config.G * config.levels
    return None if tree is None or tree.nodes < nodes else tree.prefix(nodes)


def chain_template(chains: int, levels: int) -> TreeTemplate:
    """`chains` disjoint chains of `levels` nodes: the linear verification branch (candidate k, token m)."""
    return TreeTemplate(tuple(ROOT if m == 0 else k * levels + m - 1 for k in range(chains) for m in range(levels)))


def tree_template(nodes: int, depth: int, decay: float = RANK_DECAY) -> TreeTemplate:
    """The `nodes` most likely nodes up to `depth` under a prior where a rank-r child is accepted with
    probability FIRST_ACCEPT * decay**r given its parent (Medusa/Token Recycling style), in preorder."""
    if nodes < 0 or depth < 1:
        raise ValueError(f"a tree template needs nodes >= 0 and depth >= 1, got nodes={nodes} depth={depth}")
    # best-first: heap of (-probability, tie order, parent id, rank, depth); ids in order of choice
    heap = [(-FIRST_ACCEPT, 0, ROOT, 0, 1)]
    chosen: list[tuple[int, int]] = []  # (parent id, rank) per chosen id
    order = 1
    while heap and len(chosen) < nodes:
        neg, _, parent, rank, d = heapq.heappop(heap)
        me = len(chosen)
        chosen.append((parent, rank))
        heapq.heappush(heap, (neg * decay, order, parent, rank + 1, d))  # the next sibling
        order += 1
        if d < depth:
            heapq.heappush(heap, (neg * FIRST_ACCEPT, order, me, 0, d + 1))  # the first child
            order += 1
    kids: dict[int, list[int]] = {}
    for me, (parent, _) in enumerate(chosen):  # chosen in rank order per parent
        kids.setdefault(parent, []).append(me)
    parents: list[int] = []
    stack = [(c, ROOT) for c in reversed(kids.get(ROOT, []))]
    while stack:  # preorder, rank 0 first
        me, parent_pos = stack.pop()
        pos = len(parents)
        parents.append(parent_pos)
        stack.extend((c, pos) for c in reversed(kids.get(me, [])))
    return TreeTemplate(tuple(parents))


def resolve_tree(spec: str | TreeTemplate | None, config: LookaheadConfig) -> TreeTemplate | None:
    """None for "off"/None (G linear candidates); "auto": tree_template(G(N-1), TREE_DEPTH) of `config`; a parent
    list, a file holding one, or a TreeTemplate as given. UserError if it cannot fill config's G(N-1) slots."""
    word = spec.strip().lower() if isinstance(spec, str) else None
    if spec is None or word == "off":
        return None
    nodes = config.G * config.levels
    if word == "auto":
        if not nodes:
            raise UserError(f"tree=auto sizes the draft tree from the lookahead config's G(N-1) slots, and {config} "
                            "has none: give a config with G >= 1 (e.g. 7,5,7)")
        return tree_template(nodes, TREE_DEPTH)
    text = spec if isinstance(spec, str) else ""
    if text and not text.lstrip().startswith("-") and Path(text).is_file():
        text = Path(text).read_text()
    try:
        template = spec if isinstance(spec, TreeTemplate) else TreeTemplate.parse(text)
    except ValueError as exc:
        raise UserError(f"{exc} (or give tree=auto or off)") from None
    if template.nodes < nodes:
        raise UserError(f"a {template.nodes}-node tree template cannot fill the {nodes} verification slots of "
                        f"{config}: give at least {nodes} parents, tree=auto, or a smaller G")
    return template
