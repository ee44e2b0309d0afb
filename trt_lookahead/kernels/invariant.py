"""Row-invariant Triton kernels for the exact step on a GPU: projections and RMSNorm (its attention:
kernels/padded_attention.py).

A row's result depends only on its own inputs, never on how many rows the call holds or where the row sits
(docs/design.md 4.2, "batch-invariant kernels"): every reduction runs in one fixed order per row.
- `linear`: an output element is one chain of products over the input dim in order, whatever the tile, or
  (`linear_span`, fixed per shape, never per M) one chain per span of K_SPAN input dims, the spans' sums added
  in order; the tile (`linear_tile`) grows with M for speed. Every tile of LINEAR_TILES gave the same bits on
  an H200 in both dtypes (tests/kernels/test_invariant.py checks it wherever a GPU runs them); the
  interpreter's tl.dot is numpy's matmul, whose bits depend on the tile's shape, so it runs one tile.
- `rms_norm`: one program per row, the whole row in one block.
Launched on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (the tests without a GPU).
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl

from trt_lookahead.kernels.triton_kernel import interpreter_upcast

# (BLOCK_M, BLOCK_N, BLOCK_K, warps), largest first; a tile of 64 or 128 rows serves M above half its rows,
# and the first that still gives half the GPU's SMs a program wins (measured on an H200 at the
# 1B shapes, M = 1 .. 960: within 0-30% of the best of 14 tiles, 1.5-2.7x faster than one 32 x 64 x 64 tile)
LINEAR_TILES = ((128, 256, 64, 8), (128, 128, 64, 8), (64, 128, 64, 4), (16, 64, 128, 4), (16, 32, 128, 4))
INTERPRETED_TILE = (32, 64, 64, 4)
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
