"""The padded step's attention as one Triton kernel in two modes, and the combine of its chunks.

A program per tile of queries x their grouped query heads (rows of two tl.dot products per key block: the query
heads sharing a KV head read its keys once), KV head, chunk of keys and slot (flash-decoding: a long context's
chunks run in separate programs, merged in chunk order by `_combine_kernel`; a slot whose keys fit one chunk is
normalised in place and pays no merge). A slot's keys are its cache rows below cache_len[b] + T, read from
device memory, so the launch is capturable in a CUDA graph; blocks past them are never read, and neither are
chunks past them.
- `padded_attention` (exact, row-invariant: docs/design.md 4.2): keys are reduced in position order (a
  lookahead branch's keys sit in other step rows than their positions': `key_rows` maps them) in blocks at
  fixed positions ([b*KEY_BLOCK_N, (b+1)*KEY_BLOCK_N) whatever T or the cache length): cached blocks with
  one key tile for every row, the rest with one tile, or one per query where queries see different keys
  there. Row j of a product depends on row j's operands only, so each way gives a row the same bits; a
  block no row sees is skipped, and one a row does not see adds exactly zero to it. Chunks of KEY_CHUNK are
  merged in order, so a row's bits depend on the chunk: fixed per model.
- `step_attention` (fast, MASK_IN_REGISTERS): keys in row order, every block one shared tile, the step mask
  evaluated in registers from its closed form (kernels/mask.py `step_visible`, or `tree_step_visible` with a
  tree table, through kernels/triton_kernel.py's compiled helpers) from each row's (W, N, G); no table.
Launched on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (the tests without a GPU).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from trt_lookahead.kernels.reference import default_scale
from trt_lookahead.kernels.triton_kernel import (
    LOG2E,
    NUM_WARPS,
    block_d,
    interpreter_upcast,
    step_visible,
    tree_step_visible,
)

KEY_BLOCK_N = 32  # attention's key blocks: positions [b * KEY_BLOCK_N, (b + 1) * KEY_BLOCK_N)
KEY_CHUNK = 1024  # the exact step's chunk: positions [c * KEY_CHUNK, (c + 1) * KEY_CHUNK) reduced by one program
# the fast step's chunk of key rows per program: a short context is one chunk; a longer one is spread over more
# programs (the GPU's SMs) at one merge per (query, head) (not yet tuned on a GPU)
STEP_KEY_CHUNK = 256


@triton.jit
def _key_tile(rows_ptr, table_row, slot_row, offs_n, n_ok, shared, any_seen, kv_head, offs_d, d_ok,
              HKV: tl.constexpr, D: tl.constexpr):
    """Offsets and mask of one key block's [BLOCK_N, BLOCK_D] cache tile: position p's row p where the block
    is shared, else the rows the table gives one query (its `table_row`)."""
    key_rows = tl.load(rows_ptr + table_row + offs_n, mask=n_ok, other=-1)
    key_rows = tl.where(shared, tl.where(any_seen, offs_n, -1), key_rows)  # [BLOCK_N], -1: no key
    kv = (slot_row + tl.maximum(key_rows, 0))[:, None] * (HKV * D) + kv_head * D + offs_d[None, :]
    return kv, (key_rows >= 0)[:, None] & d_ok[None, :]


@triton.jit
def _softmax_block(s, seen, m_i, l_i, QK_SCALE: tl.constexpr):
    """One key block's online-softmax step for every row: its weights p, the old sums' factor, new max and sum."""
    s = tl.where(seen, s * QK_SCALE, float("-inf"))  # base 2
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit(do_not_specialize=["T", "S", "CHUNK_BLOCKS", "CHUNKS"])
def _padded_attention_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, len_ptr, cfg_ptr, tree_ptr, out_ptr, acc_ptr, m_ptr, l_ptr,
                             T, S, CHUNK_BLOCKS, CHUNKS, len_stride, cfg_stride_b, cfg_stride_c, HQ: tl.constexpr,
                             HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, QK_SCALE: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                             UPCAST_DOT: tl.constexpr, MASK_IN_REGISTERS: tl.constexpr, HAS_TREE: tl.constexpr):
    G: tl.constexpr = HQ // HKV
    QUERIES: tl.constexpr = BLOCK_M // G  # a tile's rows: QUERIES queries x their G query heads
    tile, b = tl.program_id(0), tl.program_id(2)
    kv_head, chunk = tl.program_id(1) // CHUNKS, tl.program_id(1) % CHUNKS
    cache_len = tl.load(len_ptr + b * len_stride).to(tl.int32)
    blocks = tl.cdiv(tl.minimum(cache_len + T, S), BLOCK_N)  # a step token's position is below cache_len + T
    lo = chunk * CHUNK_BLOCKS  # this program's key blocks [lo, hi)
    hi = tl.minimum(lo + CHUNK_BLOCKS, blocks)
    if SPLIT and lo >= hi:
        return  # a chunk past the slot's keys: the combine never reads it
    cached = tl.minimum(cache_len // BLOCK_N, hi)  # blocks [lo, cached) hold cached keys only, seen by every row
    offs_m = tl.arange(0, BLOCK_M)
    j = offs_m // G  # [BLOCK_M]: the row's query within the tile
    t = tile * QUERIES + j
    row_ok = (j < QUERIES) & (t < T)
    queries = tl.minimum(QUERIES, T - tile * QUERIES)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    heads = (b * T + t) * HQ + kv_head * G + offs_m % G  # [BLOCK_M]: the row's (query, head)
    q = tl.load(q_ptr + heads[:, None] * D + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)  # [BLOCK_M, BLOCK_D]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Every block is one score product and one value product per row, whichever loop reads it: row j of a dot
    # depends on row j's operands only, and each product passes through the same where, so a block's bits are
    # the same read here (cached keys, no table) as below (keys the table places) or in another step.
    for blk in range(lo, cached):
        kv = (b * S + blk * BLOCK_N + tl.arange(0, BLOCK_N))[:, None] * (HKV * D) + kv_head * D + offs_d[None, :]
        k = tl.load(k_ptr + kv, mask=d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + kv, mask=d_ok[None, :], other=0.0)
        if UPCAST_DOT:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.where(row_ok[:, None], tl.dot(q, tl.trans(k), input_precision="ieee"), 0.0)  # [BLOCK_M, BLOCK_N]
        p, alpha, m_i, l_i = _softmax_block(s, row_ok[:, None], m_i, l_i, QK_SCALE)
        p_in = p.to(v_ptr.dtype.element_ty)  # the value product's operands in the cache's dtype
        if UPCAST_DOT:
            p_in = p_in.to(tl.float32)
        acc = acc * alpha[:, None] + tl.where(row_ok[:, None], tl.dot(p_in, v, input_precision="ieee"), 0.0)
    if MASK_IN_REGISTERS:  # the row's (W, N, G), and whether its verification slots are the tree's
        window = tl.load(cfg_ptr + b * cfg_stride_b).to(tl.int32)
        ngram = tl.load(cfg_ptr + b * cfg_stride_b + cfg_stride_c).to(tl.int32)
        verify = tl.load(cfg_ptr + b * cfg_stride_b + 2 * cfg_stride_c).to(tl.int32)
        step_t = tl.minimum(t, T - 1)  # rows past T (masked by row_ok) clamped: the tree table is 2T long
        if HAS_TREE:  # the tree's node G(N-1) - 1 is real (subtree end > 0) where it has G(N-1) nodes
            slots = verify * (ngram - 1)
            covered = (slots <= 0) | (tl.load(tree_ptr + tl.maximum(2 * slots - 1, 0)) > 0)
    for blk in range(tl.maximum(lo, cached), hi):  # blocks holding step keys (and the cache's last ones)
        offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        if MASK_IN_REGISTERS:  # one tile: row r of the slot holds cached key r, or step token r - cache_len
            rel = offs_n - cache_len  # [BLOCK_N]
            key_ok = (rel < T) & (offs_n < S)  # rows from cache_len + T on are never read
            step_j = tl.minimum(tl.maximum(rel, 0), T - 1)
            step_seen = step_visible(step_t[:, None], step_j[None, :], window, ngram, verify)  # [BLOCK_M, BLOCK_N]
            if HAS_TREE:
                step_seen = tl.where(covered, tree_step_visible(step_t[:, None], step_j[None, :], window, ngram,
                                                                verify, tree_ptr), step_seen)
            seen = row_ok[:, None] & ((rel < 0)[None, :] | ((key_ok & (rel >= 0))[None, :] & step_seen))
            if tl.max(seen.to(tl.int32)) > 0:  # a block no row sees would add exact zeros: skip it
                kv = (b * S + offs_n)[:, None] * (HKV * D) + kv_head * D + offs_d[None, :]
                kv_ok = key_ok[:, None] & d_ok[None, :]
                k = tl.load(k_ptr + kv, mask=kv_ok, other=0.0)  # [BLOCK_N, BLOCK_D]
                v = tl.load(v_ptr + kv, mask=kv_ok, other=0.0)
                if UPCAST_DOT:
                    k, v = k.to(tl.float32), v.to(tl.float32)
                s = tl.where(row_ok[:, None], tl.dot(q, tl.trans(k), input_precision="ieee"), 0.0)
                p, alpha, m_i, l_i = _softmax_block(s, seen, m_i, l_i, QK_SCALE)
                p_in = p.to(v_ptr.dtype.element_ty)
                if UPCAST_DOT:
                    p_in = p_in.to(tl.float32)
                acc = acc * alpha[:, None] + tl.where(row_ok[:, None], tl.dot(p_in, v, input_precision="ieee"), 0.0)
        else:  # the table places each query's keys in position order
            n_ok = offs_n < S
            rows = tl.load(rows_ptr + ((b * T + t) * S)[:, None] + offs_n[None, :],
                           mask=row_ok[:, None] & n_ok[None, :], other=-1)  # [BLOCK_M, BLOCK_N]: -1 unseen
            if tl.max(rows) >= 0:  # a block no row sees would add exact zeros: skip it
                seen = rows >= 0
                # shared: every row that sees position p reads it from row p: one key tile serves all; else each
                # query's own tile, each row's products kept from its own
                shared = tl.min(tl.where(seen, rows == offs_n[None, :], True).to(tl.int32)) == 1
                any_seen = tl.max(seen.to(tl.int32), 0) > 0  # [BLOCK_N]
                tiles = tl.where(shared, 1, queries)
                s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for own in range(0, tiles):
                    kv, kv_ok = _key_tile(rows_ptr, (b * T + tile * QUERIES + own) * S, b * S, offs_n, n_ok, shared,
                                          any_seen, kv_head, offs_d, d_ok, HKV, D)
                    k = tl.load(k_ptr + kv, mask=kv_ok, other=0.0)  # [BLOCK_N, BLOCK_D]
                    if UPCAST_DOT:
                        k = k.to(tl.float32)
                    s = tl.where((row_ok & (shared | (j == own)))[:, None],
                                 tl.dot(q, tl.trans(k), input_precision="ieee"), s)
                p, alpha, m_i, l_i = _softmax_block(s, seen, m_i, l_i, QK_SCALE)
                p_in = p.to(v_ptr.dtype.element_ty)
                if UPCAST_DOT:
                    p_in = p_in.to(tl.float32)
                pv = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
                for own in range(0, tiles):
                    kv, kv_ok = _key_tile(rows_ptr, (b * T + tile * QUERIES + own) * S, b * S, offs_n, n_ok, shared,
                                          any_seen, kv_head, offs_d, d_ok, HKV, D)
                    v = tl.load(v_ptr + kv, mask=kv_ok, other=0.0)
                    if UPCAST_DOT:
                        v = v.to(tl.float32)
                    pv = tl.where((row_ok & (shared | (j == own)))[:, None], tl.dot(p_in, v, input_precision="ieee"),
                                  pv)
                acc = acc * alpha[:, None] + pv
    # a slot whose keys fit one chunk is normalised here: the combine's merge of one chunk (x 1, + 0) is exact
    if SPLIT and blocks > CHUNK_BLOCKS:  # this chunk's running max, sum and unnormalised output, for the combine
        parts = heads * CHUNKS + chunk  # [BLOCK_M]
        tl.store(m_ptr + parts, m_i, mask=row_ok)
        tl.store(l_ptr + parts, l_i, mask=row_ok)
        tl.store(acc_ptr + parts[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + heads[:, None] * D + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["T", "S", "CHUNK", "CHUNKS"])
def _combine_kernel(acc_ptr, m_ptr, l_ptr, len_ptr, out_ptr, T, S, CHUNK, CHUNKS, len_stride,
                    HQ: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (query, head)'s chunks merged in chunk order; a chunk it sees nothing of adds exact zeros."""
    head = tl.program_id(0)  # (b * T + t) * HQ + h
    chunks = tl.cdiv(tl.minimum(tl.load(len_ptr + head // (T * HQ) * len_stride).to(tl.int32) + T, S), CHUNK)
    if chunks <= 1:
        return  # written by its one chunk
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m = tl.full([1], float("-inf"), tl.float32)
    for c in range(0, chunks):
        m = tl.maximum(m, tl.load(m_ptr + head * CHUNKS + c))
    m = tl.where(m == float("-inf"), 0.0, m)
    l_sum = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for c in range(0, chunks):
        w = tl.exp2(tl.load(m_ptr + head * CHUNKS + c) - m)
        l_sum = l_sum + tl.load(l_ptr + head * CHUNKS + c) * w
        acc = acc + tl.load(acc_ptr + (head * CHUNKS + c) * D + offs_d, mask=d_ok, other=0.0) * w
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)
    tl.store(out_ptr + head * D + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def attention_rows(group: int) -> int:
    """Rows of an attention tile for `group` query heads per KV head: queries x their heads, >= 16 (tl.dot's M)."""
    return max(16, triton.next_power_of_2(group))


def _launch(q: Any, k_cache: Any, v_cache: Any, cache_len: Any, B: int, T: int, S: int, scale: float | None,
            chunk: int, rows: Any = None, config: Any = None, tree: Any = None) -> Any:
    """Run the kernel (table mode with `rows`, else the mask in registers from `config` and `tree`) and the
    combine where the keys span several chunks -> [B*T, Hq, D]."""
    import torch

    Hq, D = q.shape[1], q.shape[2]
    Hkv = k_cache.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} are not a multiple of KV heads {Hkv}")
    if chunk <= 0 or chunk % KEY_BLOCK_N:
        raise ValueError(f"chunk must be a positive multiple of {KEY_BLOCK_N}, got {chunk}")
    q = q.contiguous()
    out = torch.empty_like(q)
    CHUNKS = triton.cdiv(S, chunk)
    split = CHUNKS > 1
    m = l = acc = out  # unused where every slot's keys fit one chunk
    if split:
        m = torch.empty(B * T * Hq * CHUNKS, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        acc = torch.empty(B * T * Hq * CHUNKS, D, dtype=torch.float32, device=q.device)
    scale = default_scale(D) if scale is None else scale
    block_m = attention_rows(Hq // Hkv)
    in_registers = rows is None
    has_tree = tree is not None and tree.numel() > 0
    cfg_strides = config.stride() if in_registers else (0, 0)
    _padded_attention_kernel[(triton.cdiv(T, block_m // (Hq // Hkv)), Hkv * CHUNKS, B)](
        q, k_cache, v_cache, cache_len if in_registers else rows, cache_len, config if in_registers else cache_len,
        tree if has_tree else cache_len, out, acc, m, l, T, S, chunk // KEY_BLOCK_N, CHUNKS, cache_len.stride(0),
        *cfg_strides, HQ=Hq, HKV=Hkv, D=D, BLOCK_D=block_d(D), QK_SCALE=float(scale) * LOG2E, BLOCK_M=block_m,
        BLOCK_N=KEY_BLOCK_N, SPLIT=split, UPCAST_DOT=interpreter_upcast(q.dtype), MASK_IN_REGISTERS=in_registers,
        HAS_TREE=has_tree, num_warps=NUM_WARPS,
    )
    if split:
        _combine_kernel[(B * T * Hq,)](acc, m, l, cache_len, out, T, S, chunk, CHUNKS, cache_len.stride(0), HQ=Hq,
                                       D=D, BLOCK_D=block_d(D), num_warps=1)
    return out


def padded_attention(q: Any, k_cache: Any, v_cache: Any, key_rows: Any, cache_len: Any,
                     scale: float | None = None, chunk: int = KEY_CHUNK) -> Any:
    """Row-invariant attention of a padded step: q [B*T, Hq, D]; the layer's cache [>= B*S, Hkv, D], slot b's
    rows at b*S .. b*S+S-1; cache_len [B]: every query of slot b sees positions below cache_len[b] at their rows;
    key_rows [B, T, S] int32 (`key_rows` builds it): for query t of slot b, the row (in its slot) holding the key
    at position p, -1 where it sees none; no position reaches cache_len[b] + T. Positions are reduced in programs
    of `chunk` (a multiple of KEY_BLOCK_N) merged in order, so a row's bits depend on `chunk`: fix it per model.
    -> [B*T, Hq, D]."""
    import torch

    B, T, S = key_rows.shape
    return _launch(q, k_cache, v_cache, cache_len.to(torch.int32), B, T, S, scale, chunk, rows=key_rows.contiguous())


def step_attention(q: Any, k_cache: Any, v_cache: Any, cache_len: Any, config: Any, tree_ends: Any, S: int,
                   scale: float | None = None, chunk: int = STEP_KEY_CHUNK) -> Any:
    """The fast padded step's attention: q [B*T, Hq, D] (row b's T step tokens, their keys and values already at
    cache rows b*S + cache_len[b] + i); the layer's cache [>= B*S, Hkv, D]; cache_len [B] and config [B, 3]
    (W, N, G; CAUSAL = (0, 0, 0)) int64 on the device, views of one staging buffer as they may be (any strides).
    Query t of row b sees rows b*S + [0, cache_len[b]) and step row j where kernels/mask.py
    `step_visible(t, j, W, N, G)` says so, or `tree_step_visible` with tree_ends [2T] (`mask.tree_ends`) for the
    rows whose G(N-1) slots the tree covers; an empty tree_ends: G linear candidates. Rows from cache_len[b] + T
    on are never read. -> [B*T, Hq, D]."""
    B = cache_len.shape[0]
    T = q.shape[0] // max(B, 1)
    if q.shape[0] != B * T or tuple(config.shape) != (B, 3):
        raise ValueError(f"q [{q.shape[0]}, ..] and config {list(config.shape)} do not hold {B} rows of T tokens "
                         f"(q [B*T, Hq, D], config [B, 3])")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous [rows, Hkv, D] (one layer's cache)")
    if k_cache.shape[0] < B * S:
        raise ValueError(f"the cache's {k_cache.shape[0]} rows do not hold {B} slots of {S}")
    if tree_ends.numel() and (tree_ends.dim() != 1 or tree_ends.numel() < 2 * T):
        raise ValueError(f"tree_ends must be [>= {2 * T}] (mask.tree_ends) or empty, got {list(tree_ends.shape)}")
    return _launch(q, k_cache, v_cache, cache_len, B, T, S, scale, chunk, config=config, tree=tree_ends.contiguous())


def key_rows(mask: Any, cache_len: Any, positions: Any) -> Any:
    """[B, T, S] int32 for `padded_attention`: query t of slot b reads the key at position p from row p of its
    slot below cache_len[b], else from the step row cache_len[b] + j of the step token j at position p that
    mask[b, t] shows it; -1 where it sees no key at p. Keys in position order, as plain decoding stores them,
    whichever step rows a lookahead branch sits in. mask [B, T, S] bool over the slot's rows, positions [B, T]."""
    import torch

    B, T, S = mask.shape
    dev = mask.device
    i = torch.arange(T, device=dev)
    step_rows = (cache_len[:, None] + i[None, :]).clamp(max=S - 1)  # [B, T]: each step token's row
    sees = mask.gather(2, step_rows[:, None, :].expand(B, T, T))  # [B, T, T]: query t sees step token j
    rows = torch.arange(S + 1, device=dev)[None, None, :].expand(B, T, S + 1)
    table = torch.where(rows < cache_len[:, None, None], rows, -1).to(torch.int32).contiguous()
    # a step key's position is unique among the keys one query sees; unseen ones land in the dropped column S
    where = torch.where(sees, positions[:, None, :].expand(B, T, T), S)
    table.scatter_(2, where, step_rows[:, None, :].expand(B, T, T).to(torch.int32))
    table[..., S] = -1
    return table[..., :S].contiguous()
