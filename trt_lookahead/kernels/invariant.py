"""Row-invariant Triton kernels for the exact step on a GPU: projections, RMSNorm and padded attention.

A row's result depends only on its own inputs (and, for attention, on the keys its mask row shows it),
never on how many rows the call holds or where the row sits (docs/design.md 4.2, "batch-invariant
kernels"): every reduction runs in one fixed order per row.
- `linear`: no split-K: an output element is one chain of products over the input dim in order, whatever
  the tile; the tile (`linear_tile`) grows with M for speed. Every tile of LINEAR_TILES gave the same bits on
  an H200 in both dtypes (tests/kernels/test_invariant.py checks it wherever a GPU runs them); the
  interpreter's tl.dot is numpy's matmul, whose bits depend on the tile's shape, so it runs one tile.
- `rms_norm`: one program per row, the whole row in one block.
- `padded_attention`: one program per (query, query head, slot); keys read in position order (a lookahead
  branch's keys sit in other step rows than their positions': `key_rows` maps them), in blocks at fixed
  positions ([b*KEY_BLOCK_N, (b+1)*KEY_BLOCK_N) whatever T or the cache length); a block the query sees
  nothing of is skipped, and an unseen key adds exactly zero. (One program per KV head serving its grouped
  query heads measured slower on an H200: its 3D temporaries cost more than the shared key loads save.)
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
NUM_WARPS = 4


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, UPCAST_DOT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                    mask=(offs_m < M)[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None],
                    mask=(offs_n < N)[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        if UPCAST_DOT:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def linear_tile(M: int, N: int, sms: int) -> tuple[int, int, int, int]:
    """The LINEAR_TILES entry for an [M, K] x [K, N] product on a GPU of `sms` multiprocessors."""
    for tile in LINEAR_TILES[:-1]:
        BM, BN = tile[0], tile[1]
        if (BM == 16 or M > BM // 2) and triton.cdiv(M, BM) * triton.cdiv(N, BN) >= sms // 2:
            return tile
    return LINEAR_TILES[-1]


@functools.cache
def _sms(device: Any) -> int:
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def linear(x: Any, weight: Any, bias: Any = None, tile: tuple[int, int, int, int] | None = None) -> Any:
    """F.linear(x, weight, bias) for x [..., K] and weight [N, K], row-invariant; float32 accumulation.
    tile: (BLOCK_M, BLOCK_N, BLOCK_K, warps), else `linear_tile`'s (INTERPRETED_TILE on the CPU)."""
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
    BM, BN, BK, warps = tile
    _linear_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
        x2, w, w if bias is None else bias, y, M, N, K, x2.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, UPCAST_DOT=interpreter_upcast(x.dtype),
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=warps,
    )
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


@triton.jit(do_not_specialize=["T", "S"])
def _padded_attention_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, out_ptr, T, S,
                             HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                             QK_SCALE: tl.constexpr, BLOCK_N: tl.constexpr):
    t, head, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = head // (HQ // HKV)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_row = (b * T + t) * (HQ * D) + head * D + offs_d
    q = tl.load(q_ptr + q_row, mask=d_ok, other=0.0).to(tl.float32)  # [BLOCK_D]
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, S, BLOCK_N):  # key positions [start, start + BLOCK_N): the same blocks in every step
        offs_n = start + tl.arange(0, BLOCK_N)
        rows = tl.load(rows_ptr + (b * T + t) * S + offs_n, mask=offs_n < S, other=-1)  # [BLOCK_N], -1: unseen
        if tl.max(rows, 0) >= 0:  # a block this row sees nothing of would add exact zeros: skip it
            seen = rows >= 0
            kv = (b * S + tl.maximum(rows, 0))[:, None] * (HKV * D) + kv_head * D + offs_d[None, :]
            kv_ok = seen[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv, mask=kv_ok, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_ptr + kv, mask=kv_ok, other=0.0).to(tl.float32)
            s = tl.where(seen, tl.sum(k * q[None, :], 1) * QK_SCALE, float("-inf"))  # [BLOCK_N], base 2
            m_new = tl.maximum(m_i, tl.max(s, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe)
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(out_ptr + q_row, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def padded_attention(q: Any, k_cache: Any, v_cache: Any, key_rows: Any, scale: float | None = None) -> Any:
    """Row-invariant attention of a padded step: q [B*T, Hq, D]; the layer's cache [>= B*S, Hkv, D], slot b's
    rows at b*S .. b*S+S-1; key_rows [B, T, S] int32: for query t of slot b, the row (in its slot) holding the
    key at position p, -1 where it sees none (`key_rows` builds it). -> [B*T, Hq, D]."""
    import torch

    B, T, S = key_rows.shape
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k_cache.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} are not a multiple of KV heads {Hkv}")
    q = q.contiguous()
    out = torch.empty_like(q)
    scale = default_scale(D) if scale is None else scale
    _padded_attention_kernel[(T, Hq, B)](
        q, k_cache, v_cache, key_rows.contiguous(), out, T, S,
        HQ=Hq, HKV=Hkv, D=D, BLOCK_D=block_d(D), QK_SCALE=float(scale) * LOG2E, BLOCK_N=KEY_BLOCK_N,
        num_warps=NUM_WARPS,
    )
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
