"""TreeTemplate: the static shape of the verification branch, a token tree rooted at x_t (docs/design.md 2.7).

A template is a parent array over V nodes, each parent listed before its children, so any prefix of it is
again a tree: a step with fewer slots lays the first nodes. `tree_template` lists its nodes best-first, so
every prefix is the best tree of its size. The mask needs one table: node j's preorder index pre[j] and the
preorder end ends[j] of its subtree, and node i sees node j iff pre[j] <= pre[i] < ends[j] (j is i or an
ancestor). Node i sits at relative position depth[i] (1 .. depth). Siblings are ranked in order of listing
(rank 0 first); the draft laying puts the best-scored branch at rank 0.

    chain_template(G, levels)      today's G linear candidates: G chains of `levels` nodes
    tree_template(nodes, depth)    every tree size from one rule: best-first by acceptance per depth and rank
    Acceptance.prior() / .fit()    that rule's rates: a rank-decaying prior, or fitted to what `tune` measured
    resolve_tree(spec, config)     what a runtime's `tree` option names: None (linear), auto or parents
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trt_lookahead.errors import UserError
from trt_lookahead.files import read_utf8
from trt_lookahead.lookahead.config import LookaheadConfig

ROOT = -1  # the parent of depth-1 nodes: x_t, step slot 0
RANK_DECAY = 0.45  # prior acceptance of a rank-r child relative to rank 0 (tree_template's shaping rule)
FIRST_ACCEPT = 0.6  # prior acceptance of a rank-0 child given its parent
DEFAULT_TREE = "auto"  # a checkpoint's tree unless asked otherwise: at equal T it accepts more (docs/design.md 9)
FIT_PSEUDO = 8.0  # offered nodes of weight the fit gives each cell's guess (Acceptance.fit)
TREE_DEPTH = 6  # the depth of `auto` templates (measured: depth 6 and 8 accept the same, docs/design.md 9)


@dataclass(frozen=True)
class TreeTemplate:
    """V nodes, each parent before its children: parents[i] in [-1, i); validated on construction."""

    parents: tuple[int, ...]
    depth: np.ndarray = field(init=False, repr=False, compare=False)  # [V] int64 relative position, 1-based
    pre: np.ndarray = field(init=False, repr=False, compare=False)  # [V] int64 preorder index (children in order)
    ends: np.ndarray = field(init=False, repr=False, compare=False)  # [V] int64 preorder end of node i's subtree
    rank: np.ndarray = field(init=False, repr=False, compare=False)  # [V] int64 rank among its siblings

    def __post_init__(self) -> None:
        V = len(self.parents)
        depth, rank, size = np.zeros(V, np.int64), np.zeros(V, np.int64), np.ones(V, np.int64)
        children: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            if isinstance(p, bool) or not isinstance(p, int | np.integer) or not ROOT <= p < i:
                raise ValueError(f"tree node {i} has parent {p!r}: parents must be -1 (x_t) or an earlier node")
            depth[i] = 1 if p == ROOT else depth[p] + 1
            siblings = children.setdefault(int(p), [])
            rank[i] = len(siblings)
            siblings.append(i)
        for i in range(V - 1, -1, -1):  # children come after their parent: sizes bottom-up
            if self.parents[i] != ROOT:
                size[self.parents[i]] += size[i]
        pre, start = np.zeros(V, np.int64), {ROOT: 0}  # start: the preorder index of a node's next child
        for i, p in enumerate(self.parents):
            pre[i] = start[p]
            start[p] += size[i]
            start[i] = pre[i] + 1
        for name, value in (("depth", depth), ("pre", pre), ("ends", pre + size), ("rank", rank)):
            value.flags.writeable = False
            object.__setattr__(self, name, value)

    @property
    def nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return int(self.depth.max(initial=0))

    def prefix(self, nodes: int) -> TreeTemplate:
        """The first `nodes` nodes: a tree again (parents come first), used by a step with fewer verification slots."""
        if not 0 <= nodes <= self.nodes:
            raise ValueError(f"a {self.nodes}-node tree template has no {nodes}-node prefix")
        return TreeTemplate(self.parents[:nodes])

    def ancestors(self) -> np.ndarray:
        """[V, V] bool: row i marks node i and its ancestors."""
        pre = self.pre
        return (pre[None, :] <= pre[:, None]) & (pre[:, None] < self.ends[None, :])

    @property
    def table(self) -> np.ndarray:
        """[2V] int64: (pre[v], ends[v]) for each node v in turn, the one table the mask's closed form reads
        (kernels/mask.py `tree_ends`)."""
        return np.stack([self.pre, self.ends], axis=1).reshape(-1)

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


@dataclass(frozen=True)
class Acceptance:
    """P(a node is accepted | its parent is), by depth and sibling rank: the shaping rule of tree_template.

    Rank 0 at depth d: first[d-1]; rank r+1 is rank r times decay[d-1, r]. Past the tables' last depth or
    rank, the last one applies. `prior()` is the rank-decaying prior; `fit()` reads `tune`'s measurements.
    """

    first: np.ndarray  # [D] rank-0 acceptance per depth
    decay: np.ndarray  # [D, R] acceptance of rank r+1 relative to rank r, each <= 1

    @classmethod
    def prior(cls, decay: float = RANK_DECAY) -> Acceptance:
        """FIRST_ACCEPT * decay**r at every depth (Medusa/Token Recycling style)."""
        return cls(np.array([FIRST_ACCEPT]), np.array([[decay]]))

    @classmethod
    def fit(cls, counts: Mapping[tuple[int, int], tuple[int, int]], pseudo: float = FIT_PSEUDO) -> Acceptance:
        """From (accepted, offered) per measured (depth, rank): each rate is shrunk toward its guess from the cell
        before it (rank r-1 times RANK_DECAY; rank 0 from the depth above; FIRST_ACCEPT first) by `pseudo`
        offered nodes, so a thin cell stays near the guess, then made non-increasing in rank."""
        if not counts:
            raise ValueError("no measured tree acceptance to fit a template to")
        # one rank past the measured ones: unmeasured, it is its guess, so later ranks decay by RANK_DECAY
        depths, ranks = max(d for d, _ in counts), max(r for _, r in counts) + 2
        rate = np.zeros((depths, ranks))
        for d in range(depths):
            for r in range(ranks):
                guess = rate[d, r - 1] * RANK_DECAY if r else rate[d - 1, 0] if d else FIRST_ACCEPT
                accepted, offered = counts.get((d + 1, r), (0, 0))
                rate[d, r] = min((accepted + pseudo * guess) / (offered + pseudo), rate[d, r - 1] if r else 1.0)
        return cls(rate[:, 0], rate[:, 1:] / rate[:, :-1])

    def rank0(self, depth: int) -> float:
        return float(self.first[min(depth, len(self.first)) - 1])

    def step(self, depth: int, rank: int) -> float:
        """Acceptance of rank+1 relative to rank at `depth`."""
        row = self.decay[min(depth, len(self.decay)) - 1]
        return float(row[min(rank, len(row) - 1)])


def tree_template(nodes: int, depth: int, accept: Acceptance | None = None) -> TreeTemplate:
    """The `nodes` most likely nodes up to `depth` under `accept` (the prior by default): a node's probability
    is the product of its path's acceptances. Listed best-first, so the first k nodes are the k most likely:
    a step with fewer slots lays the best tree of its own size (docs/design.md 2.7)."""
    if nodes < 0 or depth < 1:
        raise ValueError(f"a tree template needs nodes >= 0 and depth >= 1, got nodes={nodes} depth={depth}")
    accept = accept or Acceptance.prior()
    # best-first: heap of (-probability, tie order, parent id, rank, depth); ids in order of choice
    heap = [(-accept.rank0(1), 0, ROOT, 0, 1)]
    parents: list[int] = []
    order = 1
    while heap and len(parents) < nodes:
        neg, _, parent, rank, d = heapq.heappop(heap)
        me = len(parents)
        parents.append(parent)
        heapq.heappush(heap, (neg * accept.step(d, rank), order, parent, rank + 1, d))  # the next sibling
        order += 1
        if d < depth:
            heapq.heappush(heap, (neg * accept.rank0(d + 1), order, me, 0, d + 1))  # the first child
            order += 1
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
        text = read_utf8(Path(text), "tree file", "; give a file holding a comma list of parents like -1,0,-1, or "
                                                  "tree=auto or off")
    try:
        template = spec if isinstance(spec, TreeTemplate) else TreeTemplate.parse(text)
    except ValueError as exc:
        raise UserError(f"{exc} (or give tree=auto or off)") from None
    if template.nodes < nodes:
        raise UserError(f"a {template.nodes}-node tree template cannot fill the {nodes} verification slots of "
                        f"{config}: give at least {nodes} parents, tree=auto, or a smaller G")
    return template
