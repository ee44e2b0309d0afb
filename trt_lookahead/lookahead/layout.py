"""StepLayout: where every token of a fixed-shape lookahead step sits, what it sees, which outputs matter.

See docs/design.md section 2.
One step feeds T = (W + G)(N - 1) tokens in level-major order. x_t is the last accepted token at
absolute position p (its KV is not cached yet); everything before p is in the KV cache and every
slot sees all of it. Example W=5, N=4, G=2 (relative positions p + r):

    slot   0  1  2  3  4 |  5  6  7  8  9 | 10 11 12 13 14 | 15 16 17 | 18 19 20
    token x_t L0 L0 L0 L0 | L1 L1 L1 L1 L1 | L2 L2 L2 L2 L2 | c0 c0 c0 | c1 c1 c1
    r      0  1  2  3  4 |  1  2  3  4  5 |  2  3  4  5  6 |  1  2  3 |  1  2  3
           `---- B0 ----'   `---- B1 ----'   `---- B2 ----'   `- V0 -'   `- V1 -'
           lookahead branch (W columns, N-1 levels)            verification (G candidates)

    column j of the window: B0[j] -> B1[j] -> B2[j]  (a Jacobi trajectory, positions j, j+1, j+2)
    B0[j] sees B0[0..j]          B_l[j] sees B0[0..j] and B1[j]..B_l[j]
    V_k[m] sees x_t and V_k[0..m]; the two branches never see each other, candidates neither.

The mask is a pure function of (W, N, G) and, when the verification branch is a token tree, the tree
template (lookahead/tree.py): its nodes sit at their depth and see x_t and their ancestors. The same
mask follows from the relative positions alone (TensorRT-LLM's stack rule) once the slots are put in
depth-first order: column by column, then candidate by candidate (or tree node by node);
`mask_from_positions` and `dfs_order` give that derivation. A layout may be
padded to a larger engine T: pad slots sit at r = 0, see only themselves, and their outputs are unused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.tree import ROOT, TreeTemplate, chain_template, covers

LOOKAHEAD, VERIFY, PAD = 0, 1, 2


@dataclass(frozen=True)
class StepLayout:
    """The static layout of one step for `config`, optionally padded to `padded_tokens` slots.

    The G(N-1) verification slots are the first G(N-1) nodes of `tree`, or G linear candidates (`covers`).
    """

    config: LookaheadConfig
    padded_tokens: int | None = None
    tree: TreeTemplate | None = None
    kinds: np.ndarray = field(init=False, repr=False)  # [T] LOOKAHEAD / VERIFY / PAD
    rel_positions: np.ndarray = field(init=False, repr=False)  # [T] int64, offset from p
    mask: np.ndarray = field(init=False, repr=False)  # [T, T] bool, mask[i, j]: slot i sees slot j
    window_slots: np.ndarray = field(init=False, repr=False)  # [N-1, W] slot of B_l[j]
    candidate_slots: np.ndarray = field(init=False, repr=False)  # [G, N-1] slot of V_k[m] (tree: node k(N-1)+m)
    template: TreeTemplate = field(init=False, repr=False)  # the verification branch's G(N-1) nodes

    def __post_init__(self) -> None:
        cfg = self.config
        W, levels, G = cfg.W, cfg.levels, cfg.G
        T = cfg.step_tokens
        total = T if self.padded_tokens is None else self.padded_tokens
        if total < T:
            raise ValueError(f"cannot pad a {T}-token step layout for {cfg} to {total} tokens")

        window = np.arange(levels * W).reshape(levels, W)
        cands = levels * W + np.arange(G * levels).reshape(G, levels)
        template = covers(self.tree, cfg) or chain_template(G, levels)

        kinds = np.full(total, PAD, np.int8)
        kinds[:T] = LOOKAHEAD
        kinds[cands.ravel()] = VERIFY

        rel = np.zeros(total, np.int64)
        rel[window] = np.arange(levels)[:, None] + np.arange(W)[None, :]  # B_l[j] at l + j
        rel[cands.ravel()] = template.depth  # a verification node at its depth (V_k[m] at 1 + m)

        mask = np.zeros((total, total), bool)
        for j in range(W):
            mask[window[0, j], window[0, : j + 1]] = True  # B0 is causal
            for level in range(1, levels):
                mask[window[level, j], window[0, : j + 1]] = True
                mask[window[level, j], window[1 : level + 1, j]] = True  # own column
        verify = cands.ravel()
        for node, parent in enumerate(template.parents):
            mask[verify[node], 0] = True  # x_t
            mask[verify[node], verify[node]] = True
            if parent != ROOT:
                mask[verify[node], verify[: parent + 1]] |= mask[verify[parent], verify[: parent + 1]]
        pads = np.arange(T, total)
        mask[pads, pads] = True

        for name, value in (
            ("kinds", kinds),
            ("rel_positions", rel),
            ("mask", mask),
            ("window_slots", window),
            ("candidate_slots", cands),
            ("template", template),
        ):
            if isinstance(value, np.ndarray):
                value.flags.writeable = False
            object.__setattr__(self, name, value)

    @property
    def step_tokens(self) -> int:
        """Slots fed per step, padding included."""
        return len(self.kinds)

    @property
    def chain_slots(self) -> np.ndarray:
        """Slots of the column-0 chain B1[0] .. B_{N-2}[0]: a real continuation of x_t."""
        return self.window_slots[1:, 0]

    @property
    def newest_level_slots(self) -> np.ndarray:
        """Slots whose argmax becomes the next newest level (the tokens of L_{N-2})."""
        if self.config.levels == 1:
            return self.window_slots[0, 1:]  # L0 sits behind x_t in B0
        return self.window_slots[-1]

    @property
    def previous_slots(self) -> np.ndarray:
        """[T] the slot holding the token right before each slot's own in what it sees (one position earlier), or
        -1 where that token is in the cache: x_t's, and the pads'. E.g. B_l[j] -> B_{l-1}[j], B1[j] -> B0[j],
        B0[j] -> B0[j-1], a tree node -> its parent (x_t at depth 1)."""
        earlier = self.rel_positions[None, :] == self.rel_positions[:, None] - 1  # [T, T]
        seen = self.mask & earlier
        return np.where(seen.any(axis=1), seen.argmax(axis=1), -1)

    @property
    def output_slots(self) -> np.ndarray:
        """Slots whose next-token output the decoder reads; an executor may skip the others' logits."""
        used = np.zeros(self.step_tokens, bool)
        used[0] = True
        used[self.window_slots[-1]] = True  # harvest and the next newest level
        used[self.chain_slots] = True
        used[self.candidate_slots.ravel()] = True
        return np.flatnonzero(used)

    def packed_mask(self) -> np.ndarray:
        """TensorRT-LLM's packed form: bit j % 32 of word j // 32 in row i is set iff slot i sees slot j."""
        return pack_mask(self.mask)

    def dfs_order(self) -> np.ndarray:
        """Slot order in which the layout is a depth-first tree walk: column by column, then candidates (or the
        tree's nodes in preorder)."""
        unpadded = self.config.step_tokens
        nodes = self.candidate_slots.ravel()[np.argsort(self.template.pre, kind="stable")]
        return np.concatenate([self.window_slots.T.ravel(), nodes])[:unpadded]


def pack_mask(mask: np.ndarray) -> np.ndarray:
    """Pack a [T, T] bool mask into [T, ceil(T/32)] int32 words, low bit first."""
    rows, cols = mask.shape
    words = (cols + 31) // 32
    padded = np.zeros((rows, words * 32), bool)
    padded[:, :cols] = mask
    bits = padded.reshape(rows, words, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    return bits.sum(axis=2).astype(np.uint32).view(np.int32)


def unpack_mask(packed: np.ndarray, tokens: int) -> np.ndarray:
    """Inverse of `pack_mask`."""
    words = packed.view(np.uint32).astype(np.uint64)
    bits = (words[:, :, None] >> np.arange(32, dtype=np.uint64)) & 1
    return bits.reshape(len(packed), -1)[:, :tokens].astype(bool)


def mask_from_positions(positions: np.ndarray) -> np.ndarray:
    """TensorRT-LLM's rule for a depth-first token tree: a token sees the stack of its ancestors.

    Scan the tokens keeping a stack; pop while the current position is not above the top; the token
    then sees every token left on the stack and itself.
    """
    T = len(positions)
    mask = np.zeros((T, T), bool)
    stack: list[int] = []
    for i, pos in enumerate(positions.tolist()):
        while stack and positions[stack[-1]] >= pos:
            stack.pop()
        if stack and positions[stack[-1]] != pos - 1:
            raise ValueError(f"positions are not a depth-first tree walk at token {i}")
        stack.append(i)
        mask[i, stack] = True
    return mask
