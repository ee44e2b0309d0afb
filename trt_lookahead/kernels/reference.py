"""LookaheadAttention: the op's contract and its torch reference.

One op per layer attends each batch row's T step tokens over that row's KV cache and over each other:

    out[b, i] = softmax(scale * q[b, i] . [K_cache[b, 0:cache_len[b]] ; K_step[b, visible_b(i)]])
                @ [V_cache[b] ; V_step[b]]

inputs   query [B, T, Hq, D], key [B, T, Hkv, D], value [B, T, Hkv, D]   (RoPE already applied)
         key_cache [B, Hkv, S, D], value_cache [B, Hkv, S, D]           (row b: rows 0..cache_len[b]-1 valid)
         cache_len [B] int32                                             device tensor: each row's cached prefix
         step_config [B, 3] int32 = (W, N, G) per row                    device tensor; W = 0 means causal
         tree_ends [2E >= 2T] int32 (the node's; here `tree_ends=`)     a draft tree's table, tree = 1
output   [B, T, Hq, D]
attrs    num_q_heads, num_kv_heads, head_dim, scale, tree

Rows never see each other: row b is exactly the single-sequence op on its own cache, so a row's result
does not depend on what shares its batch. The step mask is never a tensor: it is the closed form
`mask.step_visible` of the row's (W, N, G), equal to `StepLayout(LookaheadConfig(W, N, G),
padded_tokens=T).mask` (slots past (W+G)(N-1) are pads that see only themselves); W = 0 gives the causal
prefill mask (j <= i) for any T. Because (W, N, G) and cache_len are read from device tensors, one
compiled graph serves every step, every mix of rows and every smaller config padded to the engine's T.
Query head h reads KV head h // (Hq // Hkv) (grouped-query attention). See docs/design.md section 6.4.

The reference computes with `BlockedAttention`, the row-invariant form the CPU executors also run
(docs/design.md section 4.2): a query row's result depends only on that row and the keys it sees, never
on how many other rows the call holds, where the row sits, or how many keys other rows see.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from trt_lookahead.kernels.mask import step_mask

OP_NAME = "LookaheadAttention"
OP_DOMAIN = "trt_lookahead"  # also the TensorRT plugin namespace
OP_VERSION = 1


KEY_BLOCK = 64  # block b holds the keys at positions [b * KEY_BLOCK, (b + 1) * KEY_BLOCK), whatever the step
ROW_MULTIPLE = 4  # query rows per product are padded to a multiple: BLAS rounds 1-3-row products differently
LOG2_E = 1.0 / math.log(2.0)  # softmax(s) = 2^(s log2 e) normalised
VALUE_WIDTH = 16  # the value product's width is padded to a multiple (BLAS rounds 9 wide in float32 by row)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def as_config_tensor(step_configs) -> torch.Tensor:
    """[B, 3] int32 device-tensor form of per-row (W, N, G) configs."""
    return torch.tensor(np.asarray(step_configs, np.int64).reshape(-1, 3), dtype=torch.int32)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class Chains:
    """The own blocks of a step's branch queries, in the step's terms: one product per leaf and own block."""

    shape: ChainShape  # what the mask alone decides: the products' rows
    key: np.ndarray  # [L, Mc, tail * BK] the K/V row whose probability each product row reads at each position
    layout: np.ndarray  # [L, tail * BK] the K/V row at each position of a leaf's layout (0 where none: p is 0)
    first: int  # the own blocks are first .. first + tail - 1
    past: np.ndarray  # the blocks past the own ones, where the branch queries' results are zeroed


@dataclass(frozen=True)
class ChainShape:
    """What of a step's own blocks its mask alone decides (`chain_shape`): the products' rows and leaf chains."""

    depth: np.ndarray  # [L, Mc] the position - cache_len of each product row's query
    row: np.ndarray  # [L, Mc] the p / o row of each product row (a pad reads a real row's; its result is dropped)
    real: np.ndarray  # [L, Mc] bool: product rows that are a query's head, not pads
    blind: np.ndarray  # [L, Mc] a step slot the row's query does not see: its probability there is 0
    leaf: np.ndarray  # [k]: leaf leaf[k]'s chain holds step slot slot[k], at depth slot_depth[k]
    slot: np.ndarray  # [k]
    slot_depth: np.ndarray  # [k]
    reach: int  # the deepest branch query's depth
    branch_rows: np.ndarray  # [n * G] the p / o rows of the branch queries


@functools.lru_cache(maxsize=64)
def chain_shape(packed: bytes, t: int, G: int) -> ChainShape | None:
    """The own-block products of the step mask [t, t] packed by `pack_mask`, G query heads per KV head (p row
    i * G + g). None: every query's step keys sit at their positions' rows (a causal step).

    A query whose visible step keys are not at their positions' rows (a branch past its first token) sees its
    chain (one key per position, ancestors and itself), a prefix of the chain of a leaf (a step token no other
    sees). The leaf's keys laid at their positions serve every query on that chain, a query's probabilities
    past its own position being exact zeros. Example, 4/3/4: the window's level-2 token of column c sees x_t,
    level 1's token c and itself; level 1's token c rides on its layout.
    """
    mask = np.unpackbits(np.frombuffer(packed, np.uint8), count=t * t).reshape(t, t).astype(bool)
    rel = mask.sum(1) - 1  # [t] a step token's position - cache_len: it sees one key per position of its chain
    branch = np.flatnonzero((mask & (rel != np.arange(t))[None, :]).any(1))  # such queries
    if len(branch) == 0:
        return None
    i, j = np.nonzero(mask[branch])
    if len(np.unique(i * t + rel[j])) != len(i):
        raise ValueError("a step mask row sees two step tokens at one position; it is not a chain of positions")
    leaves = branch[~(mask & ~np.eye(t, dtype=bool))[:, branch].any(0)]  # [L] branch queries no other sees
    on_leaf = mask[leaves][:, branch]  # [L, n] leaf l's chain holds branch query q
    leaf_of = on_leaf.argmax(0)  # [n] the first leaf whose chain holds each branch query
    prefix = mask[leaves[leaf_of]] & (rel[None, :] <= rel[branch, None])  # [n, t] that chain cut at the query
    if not on_leaf.any(0).all() or (prefix != mask[branch]).any():
        raise ValueError("a step mask row's keys are not a prefix of a leaf's chain; the step is not a tree")
    members = [branch[leaf_of == leaf] for leaf in range(len(leaves))]  # the queries riding on each layout
    Mc = _round_up(max(len(m) for m in members) * G, ROW_MULTIPLE)
    query = np.full((len(leaves), Mc), branch[0])  # [L, Mc] the step token of each product row
    real = np.zeros((len(leaves), Mc), bool)
    for leaf, rows in enumerate(members):
        query[leaf, : len(rows) * G], real[leaf, : len(rows) * G] = np.repeat(rows, G), True
    blind = (~mask).argmax(1)[query]
    if mask[query, blind].any():
        raise ValueError("a branch query sees every step key")  # cannot happen: it skips a slot of its chain
    on, slot = np.nonzero(mask[leaves])
    return ChainShape(
        depth=rel[query], row=query * G + np.arange(Mc) % G, real=real, blind=blind, leaf=on, slot=slot,
        slot_depth=rel[slot], reach=int(rel[branch].max()),
        branch_rows=(branch[:, None] * G + np.arange(G)).reshape(-1),
    )


def pack_mask(mask: np.ndarray) -> bytes:
    """A step mask as `chain_shape`'s cache key: one bit per slot pair (a 1024-token mask is 128 kB)."""
    return np.packbits(np.asarray(mask, bool)).tobytes()


def plan_chains(mask: np.ndarray, P: int, G: int) -> Chains | None:
    """The own blocks (`chain_shape`) of a step of mask [t, t] over P cached keys, in K/V rows and blocks."""
    shape = chain_shape(pack_mask(mask), len(mask), G)
    if shape is None:
        return None
    BK, L = KEY_BLOCK, len(shape.row)
    first = P // BK  # blocks before it hold cached keys only, at their positions' rows
    tail = (P + shape.reach) // BK + 1 - first  # blocks up to the last branch position
    x = first * BK + np.arange(tail * BK)  # [tail * BK] the positions of the own blocks
    layout = np.tile(np.where(x < P, x, -1), (L, 1))  # [L, tail * BK] the K/V row at each position
    layout[shape.leaf, P + shape.slot_depth - first * BK] = P + shape.slot
    seen = (layout[:, None] >= 0) & (x - P <= shape.depth[:, :, None])  # [L, Mc, tail * BK] (cached: x < P)
    return Chains(
        shape=shape, key=np.where(seen, layout[:, None], P + shape.blind[:, :, None]), layout=np.maximum(layout, 0),
        first=first, past=np.arange(first + tail, -(-(P + len(mask)) // BK)),
    )


class BlockedAttention:
    """Row-invariant attention of a step's t tokens over cache_len cached keys and the step's own keys.

    Planned once per step (mask and cache_len), called once per layer. A query row's result depends only
    on its query and the keys it sees at their positions, never on the other rows, where the row sits,
    or how many keys other rows see (docs/design.md section 4.2): its softmax runs over key blocks of
    KEY_BLOCK positions (a step token's position is cache_len + the number of step tokens it sees - 1),
    each block's scores [rows, D] x [D, KEY_BLOCK] and values [rows, KEY_BLOCK] x [KEY_BLOCK, width] one
    fixed-shape product (rows a multiple of ROW_MULTIPLE), masked keys exact zeros, the maximum exact in
    any order, and the blocks added pairwise over a power-of-two count. A row whose step keys are not
    stored at their positions' rows (a lookahead branch past its first token) gets its blocks from
    cache_len's on again, its chain's keys at their positions: one layout per leaf chain serves every row
    on it (`chain_shape`; the mask must be a tree, as every closed-form one is). A ones column appended
    to V makes each block's softmax denominator in the same product. Scores are in base 2 (scale * log2 e,
    then exp2): the CPU's exp2 costs a third of exp and does not slow down on masked (-inf) scores. Computes
    in float32 (float64 for float64 inputs).
    """

    def __init__(
        self,
        step_mask: torch.Tensor | np.ndarray | None,  # [t, t] bool: step token i sees step token j; None: t = 1
        cache_len: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        scale: float | None = None,
    ) -> None:
        if num_q_heads % num_kv_heads:
            raise ValueError(f"query heads {num_q_heads} are not a multiple of KV heads {num_kv_heads}")
        if isinstance(step_mask, torch.Tensor):
            step_mask = step_mask.cpu().numpy()
        mask = np.ones((1, 1), bool) if step_mask is None else np.asarray(step_mask, bool)
        t, P = len(mask), int(cache_len)
        G, Hkv, D, BK = num_q_heads // num_kv_heads, num_kv_heads, head_dim, KEY_BLOCK
        work = torch.float64 if dtype == torch.float64 else torch.float32
        self.shape, self.dtype, self.keys, self.device = (t, num_q_heads, D), dtype, P + t, device
        self.scale2 = (default_scale(D) if scale is None else scale) * LOG2_E  # scores in base 2
        self.blocks = blocks = -(-(P + t) // BK)
        self.rows = rows = t * G  # row i * G + g: query i, head h * G + g of KV head h
        padded = _round_up(rows, ROW_MULTIPLE)
        allowed = np.zeros((padded, blocks * BK), bool)
        allowed[:rows, :P] = True
        allowed[:rows, P : P + t] = np.repeat(mask, G, 0)
        allowed[rows:, 0] = True  # pad rows see key 0, so no row is empty
        bias = np.where(allowed, 0.0, -np.inf).reshape(padded, blocks, BK).transpose(1, 0, 2)
        bias = np.tile(bias, (Hkv, 1, 1)).reshape(Hkv * blocks, padded, BK)  # the same for every KV head
        self.bias = torch.from_numpy(bias).to(work).to(device)  # [Hkv * blocks, padded, BK]: 0 or -inf
        self.q = torch.zeros(Hkv, blocks, padded, D, dtype=work, device=device)  # the queries, once per block
        self.q_scaled = torch.empty(t, num_q_heads, D, dtype=work, device=device)
        self.k = torch.zeros(Hkv, blocks * BK, D, dtype=work, device=device)
        width = _round_up(D + 1, VALUE_WIDTH)
        self.v = torch.zeros(Hkv, blocks * BK, width, dtype=work, device=device)
        self.v[..., D] = 1.0
        self.tree = 1 << (blocks - 1).bit_length()  # the blocks are added pairwise over this power of two
        self.chains = plan_chains(mask, P, G)
        self._plan_views(t, G, D, padded, width, work)

    def _plan_views(self, t: int, G: int, D: int, padded: int, width: int, work: torch.dtype) -> None:
        """Every view a call reads or writes, and its score and output buffers: made once per step, not per layer
        (on the CPU each view and allocation costs about a microsecond, and a call makes forty of them)."""
        Hkv, blocks, BK, n = self.k.shape[0], self.blocks, KEY_BLOCK, self.keys
        self.q_in = self.q[:, :, : self.rows].view(Hkv, blocks, t, G, D)
        self.k_in, self.v_in = self.k[:, :n], self.v[:, :n, :D]
        self.q3, self.v3 = self.q.view(Hkv * blocks, padded, D), self.v.view(Hkv * blocks, BK, width)
        self.keys3 = self.k.view(Hkv * blocks, BK, D).transpose(1, 2)  # [Hkv * blocks, D, BK]
        self.s3 = torch.empty(Hkv * blocks, padded, BK, dtype=work, device=self.device)  # scores, then p
        self.s4, self.p2 = self.s3.view(Hkv, blocks, padded, BK), self.s3.view(Hkv, -1)  # p: all of a head's rows
        o_rows = Hkv * blocks * padded
        self.o_rows = torch.empty(o_rows + self._plan_chain_indices(padded), width, dtype=work, device=self.device)
        self.o3 = self.o_rows[:o_rows].view(Hkv * blocks, padded, width)  # then the scratch rows of chain pads
        o = self.o4 = self.o3.view(Hkv, blocks, padded, width)
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (into, added): pairwise over `tree` blocks
        half = self.tree // 2
        while half:
            self.pairs.append((o[:, : o.shape[1] - half], o[:, half:]))
            o, half = o[:, :half], half // 2
        total = o[:, 0, : self.rows].view(Hkv, t, G, width)
        self.numerator, self.denominator = total[..., :D], total[..., D : D + 1]

    def _plan_chain_indices(self, padded: int) -> int:
        """Flat indices of the chains' products (one per leaf, own block and KV head) -> the scratch rows they need."""
        c = self.chains
        if c is None:
            return 0
        Hkv, blocks, BK = self.k.shape[0], self.blocks, KEY_BLOCK
        L, Mc, n = c.key.shape
        key = c.key.reshape(L, Mc, n // BK, BK).transpose(2, 0, 1, 3)  # [tail, L, Mc, BK]
        own = (np.arange(Hkv)[:, None] * blocks + c.first + np.arange(n // BK)) * padded  # [Hkv, tail] first o rows
        o = own[:, :, None, None] + c.shape.row  # [Hkv, tail, L, Mc] the o row (flat) of each product row
        pads = np.broadcast_to(~c.shape.real, o.shape)
        o[pads] = Hkv * blocks * padded + np.arange(pads.sum())  # one scratch row each
        past = ((np.arange(Hkv)[:, None, None] * blocks + c.past[:, None]) * padded + c.shape.branch_rows).reshape(-1)

        def index(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a).reshape(-1)).to(self.device)

        self.p_index = index((key // BK * padded + c.shape.row[:, :, None]) * BK + key % BK)  # into one head's p
        self.v_index = index(c.layout.reshape(L, n // BK, BK).transpose(1, 0, 2))  # [tail, L, BK] V rows
        self.o_index, self.past_index = index(o), index(past) if len(past) else None
        self.chain_rows = Mc
        return int(pads.sum())

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [t, Hq, D], k/v [>= cache_len + t, Hkv, D] (any strides; rows past cache_len + t unread) -> [t, Hq, D]."""
        T, Hq, D = self.shape
        Hkv, BK, n = self.k.shape[0], KEY_BLOCK, self.keys
        G, width = Hq // Hkv, self.v.shape[-1]
        # the scale goes into the queries (one rounding per element): a BLAS's alpha may be applied before or after
        # the sum depending on the row count, and scale x log2 e is no power of two
        scaled = self.q_scaled.copy_(q).mul_(self.scale2)
        self.q_in.copy_(scaled.view(T, Hkv, 1, G, D).permute(1, 2, 0, 3, 4))
        self.k_in.copy_(k[:n].transpose(0, 1))
        self.v_in.copy_(v[:n].transpose(0, 1))
        torch.baddbmm(self.bias, self.q3, self.keys3, out=self.s3)
        s = self.s4
        s.sub_(s.amax(3, keepdim=True).amax(1, keepdim=True)).exp2_()  # p [Hkv, blocks, padded, BK]
        torch.bmm(self.s3, self.v3, out=self.o3)
        if self.chains is not None:  # the branch queries' own blocks: each chain's keys at their positions
            pc = self.p2.index_select(1, self.p_index).view(-1, self.chain_rows, BK)  # [Hkv * tail * L, Mc, BK]
            vc = self.v.index_select(1, self.v_index).view(-1, BK, width)  # [Hkv * tail * L, BK, width]
            self.o_rows.index_copy_(0, self.o_index, torch.bmm(pc, vc).view(-1, width))
            if self.past_index is not None:
                self.o_rows.index_fill_(0, self.past_index, 0.0)
        for into, added in self.pairs:  # the missing blocks are zeros: blocks past a row's keys add nothing
            into += added
        out = torch.empty(T, Hkv, G, D, dtype=self.o3.dtype, device=self.device)  # fresh: kept past the call
        torch.div(self.numerator, self.denominator, out=out.permute(1, 0, 2, 3))
        return out.view(T, Hq, D).to(self.dtype)

    def seam(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *_: object) -> torch.Tensor:
        """The model's attention seam (model/llama.py) for the planned step: the cache's first rows are the keys."""
        return self(q, k_cache, v_cache)


def lookahead_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cache_len: torch.Tensor,
    step_config: torch.Tensor | np.ndarray,
    *,
    scale: float | None = None,
    masks: np.ndarray | None = None,
    tree_ends: np.ndarray | None = None,
) -> torch.Tensor:
    """Reference semantics, row by row, computed in float32 (float64 for float64 inputs); query's dtype.

    `masks` [B, T, T] overrides the closed-form step masks (tests pass StepLayout's to check the closed form).
    `tree_ends`: the verification slots form the tree template of this table (TreeTemplate.table) instead of G
    chains.
    """
    B, T, Hq, D = query.shape
    Hkv = key.shape[2]
    lengths = torch.as_tensor(cache_len).reshape(B).tolist()
    configs = np.asarray(step_config, np.int64).reshape(B, 3)
    rows = []
    for b in range(B):
        P = int(lengths[b])
        row_mask = step_mask(T, configs[b], tree_ends) if masks is None else np.asarray(masks[b], bool)
        keys = torch.cat([key_cache[b, :, :P].transpose(0, 1), key[b]], 0)  # [P+T, Hkv, D]
        values = torch.cat([value_cache[b, :, :P].transpose(0, 1), value[b]], 0)
        attend = BlockedAttention(row_mask, P, Hq, Hkv, D, query.dtype, query.device, scale)
        rows.append(attend(query[b], keys, values))
    return torch.stack(rows)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (normwise, so near-zero entries do not dominate)."""
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))
