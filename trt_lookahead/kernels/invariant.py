"""Row-invariant Triton kernels for the exact step on a GPU: projections, RMSNorm and padded attention.

A row's result depends only on its own inputs (and, for attention, on the keys its mask row shows it),
never on how many rows the call holds or where the row sits (docs/design.md 4.2, "batch-invariant
kernels"): every reduction runs in one fixed order per row.
- `linear`: an output element is one chain of products over the input dim in order, whatever the tile, or
  (`linear_span`, fixed per shape, never per M) one chain per span of K_SPAN input dims, the spans' sums added
  in order; the tile (`linear_tile`) grows with M for speed. Every tile of LINEAR_TILES gave the same bits on
  an H200 in both dtypes (tests/kernels/test_invariant.py checks it wherever a GPU runs them); the
  interpreter's tl.dot is numpy's matmul, whose bits depend on the tile's shape, so it runs one tile.
- `rms_norm`: one program per row, the whole row in one block.
- `padded_attention`: a program per tile of queries x their grouped query heads (rows of two tl.dot products
  per key block), KV head, chunk of KEY_CHUNK positions and slot. Keys are reduced in position order (a
  lookahead branch's keys sit in other step rows than their positions': `key_rows` maps them) in blocks at
  fixed positions ([b*KEY_BLOCK_N, (b+1)*KEY_BLOCK_N) whatever T or the cache length): cached blocks with
  one key tile for every row, the rest with one tile, or one per query where queries see different keys
  there. Row j of a product depends on row j's operands only, so each way gives a row the same bits; a
  block no row sees is skipped, and one a row does not see adds exactly zero to it. Chunks are merged in
  order; a slot whose keys fit one chunk is normalised in place (the merge of one chunk is exact).
Launched on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (the tests without a GPU).
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl

from trt_lookahead.kernels.reference import default_scale
from trt_lookahead.kernels.triton_kernel import LOG2E, block_d, interpreter_upcast

# (BLOCK_M, BLOCK_N, BLOCK_K, warps), largest first; a tile of 64 or 128 rows serves M above half its rows,
# and the first that still gives half the GPU's SMs a program wins (measured on an H200 at the
# 1B shapes, M = 1 .. 960: within 0-30% of the best of 14 tiles, 1.5-2.7x faster than one 32 x 64 x 64 tile)
LINEAR_TILES = ((128, 256, 64, 8), (128, 128, 64, 8), (64, 128, 64, 4), (16, 64, 128, 4), (16, 32, 128, 4))
INTERPRETED_TILE = (32, 64, 64, 4)
KEY_BLOCK_N = 32  # attention's key blocks: positions [b * KEY_BLOCK_N, (b + 1) * KEY_BLOCK_N)
KEY_CHUNK = 1024  # positions [c * KEY_CHUNK, (c + 1) * KEY_CHUNK) reduced by one program, merged in order
K_SPAN = 2048  # input dims per program where linear_span splits a product's reduction
SPAN_SUM_BLOCK = 1024
NUM_WARPS = 4


@triton.jit(do_not_specialize=["M", "SPAN_BLOCKS"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, SPAN_BLOCKS, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, UPCAST_DOT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n, span = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # the span's input dims, SPAN_BLOCKS blocks of BLOCK_K: a block index keeps k0 a known multiple of BLOCK_K
    for kb in range(span * SPAN_BLOCKS, tl.minimum(tl.cdiv(K, BLOCK_K), (span + 1) * SPAN_BLOCKS)):
        k0 = kb * BLOCK_K
        k_ok = (k0 + offs_k) < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                    mask=(offs_m < M)[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None],
                    mask=(offs_n < N)[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        if UPCAST_DOT:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    out_ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT:  # this span's float32 sums at [span, M, N], for _span_sum_kernel
        tl.store(y_ptr + (span * M + offs_m)[:, None] * N + offs_n[None, :], acc, mask=out_ok)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_ok)


@triton.jit(do_not_specialize=["M"])
def _span_sum_kernel(part_ptr, b_ptr, y_ptr, M, N, SPANS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK: tl.constexpr):
    """y = the spans' sums added in span order (then the bias), element by element."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for span in tl.static_range(1, SPANS):
        acc = acc + tl.load(part_ptr + span * M * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def linear_tile(M: int, N: int, sms: int) -> tuple[int, int, int, int]:
    """The LINEAR_TILES entry for an [M, K] x [K, N] product on a GPU of `sms` multiprocessors."""
    for tile in LINEAR_TILES[:-1]:
        BM, BN = tile[0], tile[1]
        if (BM == 16 or M > BM // 2) and triton.cdiv(M, BM) * triton.cdiv(N, BN) >= sms // 2:
            return tile
    return LINEAR_TILES[-1]


def linear_span(N: int, K: int, sms: int) -> int | None:
    """The input-dim span each program reduces for an [M, K] x [K, N] product, whatever M: None (all of K)
    unless 1 row's narrowest tiles leave half the SMs idle and K holds several K_SPANs."""
    if triton.cdiv(N, LINEAR_TILES[-1][1]) >= sms // 2 or K < 2 * K_SPAN:
        return None
    return K_SPAN


@functools.cache
def _sms(device: Any) -> int:
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def linear(x: Any, weight: Any, bias: Any = None, tile: tuple[int, int, int, int] | None = None,
           span: int | str | None = "auto") -> Any:
    """F.linear(x, weight, bias) for x [..., K] and weight [N, K], row-invariant; float32 accumulation.
    tile: (BLOCK_M, BLOCK_N, BLOCK_K, warps), else `linear_tile`'s (INTERPRETED_TILE on the CPU). span: the
    input dims one program reduces (a multiple of 128; the spans' sums are added in order), else `linear_span`'s;
    a row's bits depend on it, never on M or the tile."""
    import torch

    M, K = x.numel() // x.shape[-1], x.shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if tile is None:
        tile = linear_tile(M, N, _sms(x.device)) if x.is_cuda else INTERPRETED_TILE
    if span == "auto":
        span = linear_span(N, K, _sms(x.device)) if x.is_cuda else None
    if span is not None and (not isinstance(span, int) or span <= 0 or span % 128):
        raise ValueError(f"span must be a positive multiple of 128, got {span!r}")
    spans = 1 if span is None else triton.cdiv(K, span)
    BM, BN, BK, warps = tile
    part = y if spans == 1 else torch.empty(spans, M, N, dtype=torch.float32, device=x.device)
    _linear_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN), spans)](
        x2, w, w if bias is None else bias, part, M, N, K, triton.cdiv(K if spans == 1 else span, BK),
        x2.stride(0), w.stride(0), y.stride(0), HAS_BIAS=bias is not None, SPLIT=spans > 1,
        UPCAST_DOT=interpreter_upcast(x.dtype), BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=warps,
    )
    if spans > 1:
        _span_sum_kernel[(triton.cdiv(M * N, SPAN_SUM_BLOCK),)](part, w if bias is None else bias, y, M, N,
                                                               SPANS=spans, HAS_BIAS=bias is not None,
                                                               BLOCK=SPAN_SUM_BLOCK, num_warps=NUM_WARPS)
    return y.view(*x.shape[:-1], N)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, eps, stride_x, stride_y, BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    h = x.to(tl.float32)
    h = h * (1.0 / tl.sqrt(tl.sum(h * h, 0) / H + eps))
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    # RMSNorm's rounding: the normalised row in the input dtype, then times the weight
    y = h.to(x.dtype).to(tl.float32) * w
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    """RMSNorm of x [..., H] with weight [H], row-invariant: one program per row."""
    import torch

    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, H, float(eps), x2.stride(0), y.stride(0),
                                     BLOCK_H=triton.next_power_of_2(H), num_warps=NUM_WARPS)
    return y.view(*x.shape[:-1], H)


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
def _padded_attention_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, len_ptr, out_ptr, acc_ptr, m_ptr, l_ptr, T, S, CHUNK_BLOCKS,
                             CHUNKS, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                             QK_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             SPLIT: tl.constexpr, UPCAST_DOT: tl.constexpr):
    G: tl.constexpr = HQ // HKV
    QUERIES: tl.constexpr = BLOCK_M // G  # a tile's rows: QUERIES queries x their G query heads
    tile, b = tl.program_id(0), tl.program_id(2)
    kv_head, chunk = tl.program_id(1) // CHUNKS, tl.program_id(1) % CHUNKS
    cache_len = tl.load(len_ptr + b)
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
    for blk in range(tl.maximum(lo, cached), hi):  # blocks holding step keys (and the cache's last ones)
        offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
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
                s = tl.where((row_ok & (shared | (j == own)))[:, None], tl.dot(q, tl.trans(k), input_precision="ieee"),
                             s)
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
                pv = tl.where((row_ok & (shared | (j == own)))[:, None], tl.dot(p_in, v, input_precision="ieee"), pv)
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
def _combine_kernel(acc_ptr, m_ptr, l_ptr, len_ptr, out_ptr, T, S, CHUNK, CHUNKS,
                    HQ: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (query, head)'s chunks merged in chunk order; a chunk it sees nothing of adds exact zeros."""
    head = tl.program_id(0)  # (b * T + t) * HQ + h
    chunks = tl.cdiv(tl.minimum(tl.load(len_ptr + head // (T * HQ)) + T, S), CHUNK)
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
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k_cache.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} are not a multiple of KV heads {Hkv}")
    if chunk <= 0 or chunk % KEY_BLOCK_N:
        raise ValueError(f"chunk must be a positive multiple of {KEY_BLOCK_N}, got {chunk}")
    q = q.contiguous()
    out = torch.empty_like(q)
    cache_len = cache_len.to(torch.int32)
    CHUNKS = triton.cdiv(S, chunk)
    split = CHUNKS > 1
    m = l = acc = out  # unused where every slot's keys fit one chunk
    if split:
        m = torch.empty(B * T * Hq * CHUNKS, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        acc = torch.empty(B * T * Hq * CHUNKS, D, dtype=torch.float32, device=q.device)
    scale = default_scale(D) if scale is None else scale
    block_m = attention_rows(Hq // Hkv)
    _padded_attention_kernel[(triton.cdiv(T, block_m // (Hq // Hkv)), Hkv * CHUNKS, B)](
        q, k_cache, v_cache, key_rows.contiguous(), cache_len, out, acc, m, l, T, S,
        chunk // KEY_BLOCK_N, CHUNKS, HQ=Hq, HKV=Hkv, D=D, BLOCK_D=block_d(D), QK_SCALE=float(scale) * LOG2E,
        BLOCK_M=block_m, BLOCK_N=KEY_BLOCK_N, SPLIT=split, UPCAST_DOT=interpreter_upcast(q.dtype),
        num_warps=NUM_WARPS,
    )
    if split:
        _combine_kernel[(B * T * Hq,)](acc, m, l, cache_len, out, T, S, chunk, CHUNKS, HQ=Hq, D=D,
                                       BLOCK_D=block_d(D), num_warps=1)
    return out


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
