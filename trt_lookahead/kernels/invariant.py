"""Row-invariant Triton kernels for the exact step on a GPU: projections and RMSNorm (its attention:
kernels/padded_attention.py), and the product by quantized weights of every GPU step.

A row's result depends only on its own inputs, never on how many rows the call holds or where the row sits
(docs/design.md 4.2, "batch-invariant kernels"): every reduction runs in one fixed order per row.
- `linear`: an output element is one chain of products over the input dim in order, whatever the tile, or
  (`linear_span`, fixed per shape, never per M) one chain per span of K_SPAN input dims, the spans' sums added
  in order; the tile (`linear_tile`) grows with M for speed. Every tile of LINEAR_TILES gave the same bits on
  an H200 in both dtypes (tests/kernels/test_invariant.py checks it wherever a GPU runs them); the
  interpreter's tl.dot is numpy's matmul, whose bits depend on the tile's shape, so it runs one tile.
- `quantized_linear`: the product by a weight held in int8 or int4 blocks (engine/quantize.py's layout,
  MatMulNBits'), `_quantized_kernel`: each weight tile is dequantized in registers, so the weight streams at 1
  or 1/2 byte an element (plus a scale and zero point a block); 4-bit codes as words, one dot per code position
  (`_step_4bit`), 8-bit ones a byte each (`_step_8bit`); one tile (QUANTIZED_TILES) for every M and the span
  fixed per K, so quantized steps, fast or exact, are row-invariant (docs/design.md 6.9).
- `rms_norm`: one program per row, the whole row in one block.
Launched on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (the tests without a GPU).
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from trt_lookahead.kernels.triton_kernel import interpreted, interpreter_upcast

# (BLOCK_M, BLOCK_N, BLOCK_K, warps), largest first; a tile of 64 or 128 rows serves M above half its rows,
# and the first that still gives half the GPU's SMs a program wins (measured on an H200 at the
# 1B shapes, M = 1 .. 960: within 0-30% of the best of 14 tiles, 1.5-2.7x faster than one 32 x 64 x 64 tile)
LINEAR_TILES = ((128, 256, 64, 8), (128, 128, 64, 8), (64, 128, 64, 4), (16, 64, 128, 4), (16, 32, 128, 4))
INTERPRETED_TILE = (32, 64, 64, 4)
K_SPAN = 2048  # input dims per program where linear_span splits a product's reduction
# a quantized product's (BLOCK_M, BLOCK_N, BLOCK_K, warps) per code width and span on CUDA, for every M
# (quantized_linear): the fastest of sweeps at the 7B shapes, 1 and 16 rows (docs/design.md 6.9)
QUANTIZED_TILES = {4: (16, 128, 128, 8), 8: (16, 32, 256, 4)}
INTERPRETED_QUANTIZED_TILE = (32, 64, 128, 4)
QUANTIZED_SPAN = 1024
SPAN_SUM_BLOCK = 1024
NUM_WARPS = 4


@triton.jit(do_not_specialize=["M", "SPAN_BLOCKS"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, SPAN_BLOCKS, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y = x @ w^T (+ b) for a weight w [N, K]."""
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


@triton.jit
def _code_values(words, j: tl.constexpr, QBITS: tl.constexpr):
    """Code j of each uint32 word (the lowest input dim in the lowest bits) as the float32 1 + q / 2^QBITS: the
    code's bits moved to the top of the mantissa under 1.0's exponent, an exact value for two integer ops."""
    SHIFT: tl.constexpr = QBITS * j - (23 - QBITS)
    t = words << -SHIFT if SHIFT < 0 else words >> SHIFT
    return ((t & (((1 << QBITS) - 1) << (23 - QBITS))) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _bfloat16_values(w):
    """float32 w rounded to bfloat16's precision, to nearest even (what a compiled kernel's cast does), in float32."""
    bits = w.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dot(acc, x, w, UPCAST_DOT: tl.constexpr):
    """acc + x @ w, w float32 cast to x's dtype first (the interpreter's cast truncates, so it rounds by hand)."""
    if UPCAST_DOT:
        x, w = x.to(tl.float32), _bfloat16_values(w)
    else:
        w = w.to(x.dtype)
    return tl.dot(x, w, acc, input_precision="ieee")


@triton.jit
def _step_4bit(acc, x_ptr, w_ptr, s_ptr, z_ptr, m_ptr, step, offs_m, offs_n, M, N, K, stride_xm, stride_wn,
               stride_s, stride_z, UPCAST_DOT: tl.constexpr, QBLOCK: tl.constexpr, HAS_MINS: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """acc + one step of BLOCK_K input dims by 4-bit codes read as uint32 words: one dot per code position j, code
    j of every word (dequantized in float32 registers) against x's input dims 8 * word + j. No code is moved back
    into input-dim order: a shift, a mask and a multiply-add dequantize an element; the dot takes the dims
    in that fixed order, the same for every row."""
    WORDS: tl.constexpr = BLOCK_K // 8  # per output
    word = step * WORDS + tl.arange(0, WORDS)  # the step's words along a weight row
    g = word // (QBLOCK // 8)  # each word's block
    ok = (g < tl.cdiv(K, QBLOCK))[:, None] & (offs_n < N)[None, :]  # [WORDS, BLOCK_N]
    words = tl.load(w_ptr + offs_n[None, :] * stride_wn + word[:, None], mask=ok,
                    other=0).to(tl.uint32, bitcast=True)  # [WORDS, BLOCK_N]
    s = tl.load(s_ptr + offs_n[None, :] * stride_s + g[:, None], mask=ok, other=0.0)
    z = (tl.load(z_ptr + offs_n[None, :] * stride_z + (g // 2)[:, None], mask=ok, other=0)  # two a byte
         >> ((g % 2) * 4)[:, None]) & 0xF
    # (q - z) * s + m = (1 + q / 16) * 16 * s + c, c = m - (16 + z) * s rounded once a block
    scale, c = s * 16, -(16 + z.to(tl.float32)) * s
    if HAS_MINS:
        c += tl.load(m_ptr + offs_n[None, :] * stride_s + g[:, None], mask=ok, other=0.0)
    for j in tl.static_range(8):
        dims = word * 8 + j  # code j's input dims
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + dims[None, :],
                    mask=(offs_m < M)[:, None] & (dims < K)[None, :], other=0.0)  # [BLOCK_M, WORDS]
        acc = _dot(acc, x, _code_values(words, j, 4) * scale + c, UPCAST_DOT)
    return acc


@triton.jit
def _step_8bit(acc, x_ptr, w_ptr, s_ptr, z_ptr, m_ptr, step, offs_m, offs_n, M, N, K, stride_xm, stride_wn,
               stride_s, stride_z, UPCAST_DOT: tl.constexpr, QBLOCK: tl.constexpr, HAS_MINS: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + one step of BLOCK_K input dims by 8-bit codes, a byte each: (q - z) * s (+ m) in float32 in input-dim
    order, one dot."""
    GROUPS: tl.constexpr = BLOCK_K // QBLOCK
    offs_k = step * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = (offs_n < N)[None, :]
    q = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=n_ok & (offs_k < K)[:, None],
                other=0)  # [BLOCK_K, BLOCK_N]
    offs_g = step * GROUPS + tl.arange(0, GROUPS)  # the step's blocks
    g_ok = n_ok & (offs_g * QBLOCK < K)[:, None]
    s = tl.load(s_ptr + offs_n[None, :] * stride_s + offs_g[:, None], mask=g_ok, other=0.0)  # [GROUPS, BLOCK_N]
    z = tl.load(z_ptr + offs_n[None, :] * stride_z + offs_g[:, None], mask=g_ok, other=0)
    w = (tl.reshape(q.to(tl.float32), (GROUPS, QBLOCK, BLOCK_N)) - z.to(tl.float32)[:, None, :]) * s[:, None, :]
    if HAS_MINS:
        w = w + tl.load(m_ptr + offs_n[None, :] * stride_s + offs_g[:, None], mask=g_ok, other=0.0)[:, None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=(offs_m < M)[:, None] & (offs_k < K)[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
    return _dot(acc, x, tl.reshape(w, (BLOCK_K, BLOCK_N)), UPCAST_DOT)


@triton.jit(do_not_specialize=["M", "SPAN_STEPS"])
def _quantized_kernel(x_ptr, w_ptr, y_ptr, s_ptr, z_ptr, m_ptr, M, N, K, SPAN_STEPS, stride_xm, stride_wn,
                      stride_ym, stride_s, stride_z, SPLIT: tl.constexpr, UPCAST_DOT: tl.constexpr,
                      QBITS: tl.constexpr, QBLOCK: tl.constexpr, HAS_MINS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y = x @ w^T for w [N, K] held in QBITS-bit blocks of QBLOCK input dims (engine/quantize.py's layout; 4-bit
    codes as uint32 words), over this program's span of SPAN_STEPS steps of BLOCK_K input dims."""
    pid_m, pid_n, span = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for step in range(span * SPAN_STEPS, tl.minimum(tl.cdiv(K, BLOCK_K), (span + 1) * SPAN_STEPS)):
        if QBITS == 4:
            acc = _step_4bit(acc, x_ptr, w_ptr, s_ptr, z_ptr, m_ptr, step, offs_m, offs_n, M, N, K, stride_xm,
                             stride_wn, stride_s, stride_z, UPCAST_DOT, QBLOCK, HAS_MINS, BLOCK_K)
        else:
            acc = _step_8bit(acc, x_ptr, w_ptr, s_ptr, z_ptr, m_ptr, step, offs_m, offs_n, M, N, K, stride_xm,
                             stride_wn, stride_s, stride_z, UPCAST_DOT, QBLOCK, HAS_MINS, BLOCK_N, BLOCK_K)
    out_ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT:  # this span's float32 sums at [span, M, N], for _span_sum_kernel
        tl.store(y_ptr + (span * M + offs_m)[:, None] * N + offs_n[None, :], acc, mask=out_ok)
    else:
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_ok)


@triton.jit(do_not_specialize=["M"])
def _span_sum_kernel(part_ptr, b_ptr, y_ptr, M, N, SPANS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """y = the spans' sums added in span order (then the bias), element by element. PDL: launched as a programmatic
    dependent of the product that wrote the sums, so it waits for that grid before it reads them."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
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
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    return _product(x, w, bias, tile, span)


def quantized_linear(x: Any, codes: Any, scales: Any, zero_points: Any, mins: Any, bits: int,
                     tile: tuple[int, int, int, int] | None = None, span: int | str | None = "auto") -> Any:
    """`linear` of x [..., K] by a weight [N, K] held in blocks along K (engine/quantize.py's QuantizedWeight, as
    tensors): codes uint8 [N, blocks * block * bits / 8], scales float32 [N, blocks], zero points uint8 [N, blocks]
    (int8) or two a byte (int4), mins float32 [N, blocks] or None. Each weight tile is dequantized in float32 in
    registers ((q - z) * s + m; 4-bit: up to one rounding of the block's constant) and cast to x's dtype for the
    dot: the weight read at bits / 8 bytes an element. tile: (BLOCK_M, BLOCK_N, BLOCK_K, warps), QUANTIZED_TILES'
    on CUDA, for every M; span: the input dims one program reduces, `quantized_span`'s, fixed per K.
    Row-invariant: one tile for every M (a bfloat16 dot of weights made in registers gave an element other bits
    in other tiles on an H200) and the span fixed by K."""
    import torch

    N, blocks = scales.shape
    block = codes.shape[1] * 8 // bits // blocks  # the input dims a block holds
    BM, BN, BK, warps = tile or (QUANTIZED_TILES[bits] if x.is_cuda else INTERPRETED_QUANTIZED_TILE)
    if BK % block or block % 8:
        raise ValueError(f"a tile's BLOCK_K ({BK}) must hold whole blocks of {block} input dims, a multiple of 8")
    if span == "auto":
        span = quantized_span(x.shape[-1]) if x.is_cuda else None
    _check_span(span, BK, f"BLOCK_K ({BK})")
    x2 = _rows(x)
    M, K = x2.shape
    w = codes if codes.stride(-1) == 1 else codes.contiguous()
    if bits == 4:
        w = w.view(torch.int32)  # [N, blocks * block / 8] words of 8 codes
    steps = triton.cdiv(K if span is None else span, BK)  # steps of BLOCK_K per program
    spans = triton.cdiv(K, steps * BK)
    y, part = _outputs(x2, N, spans)
    _quantized_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN), spans)](
        x2, w, part, scales, zero_points, scales if mins is None else mins, M, N, K, steps, x2.stride(0),
        w.stride(0), y.stride(0), scales.stride(0), zero_points.stride(0), SPLIT=spans > 1,
        UPCAST_DOT=interpreter_upcast(x.dtype), QBITS=bits, QBLOCK=block, HAS_MINS=mins is not None, BLOCK_M=BM,
        BLOCK_N=BN, BLOCK_K=BK, num_warps=warps)
    if spans > 1:
        _span_sums(part, None, y, M, N, spans)
    return y.view(*x.shape[:-1], N)


def quantized_span(K: int) -> int | None:
    """The input dims each program of a quantized product reduces, whatever M: QUANTIZED_SPAN once K holds two
    (more programs to stream the weight at one row), else all of K."""
    return QUANTIZED_SPAN if K >= 2 * QUANTIZED_SPAN else None


def _check_span(span: Any, unit: int, what: str) -> None:
    """Refuse a span that is not None or a positive multiple of `unit` (named `what` in the message)."""
    if span is not None and (not isinstance(span, int) or span <= 0 or span % unit):
        raise ValueError(f"span must be a positive multiple of {what}, got {span!r}")


def _rows(x: Any) -> Any:
    """x [..., K] as [M, K] rows with unit stride along K."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _outputs(x2: Any, N: int, spans: int) -> tuple[Any, Any]:
    """(y [M, N] in x's dtype, where the kernel writes: y, or float32 [spans, M, N] for `_span_sums`)."""
    import torch

    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    return y, (y if spans == 1 else torch.empty(spans, M, N, dtype=torch.float32, device=x2.device))


def _span_sums(part: Any, bias: Any, y: Any, M: int, N: int, spans: int, pdl: bool = False) -> None:
    """y = the spans' float32 sums part [spans, M, N] added in span order (then the bias); pdl: as a programmatic
    dependent launch (`pdl_options`)."""
    _span_sum_kernel[(triton.cdiv(M * N, SPAN_SUM_BLOCK),)](part, part if bias is None else bias, y, M, N,
                                                           SPANS=spans, HAS_BIAS=bias is not None,
                                                           BLOCK=SPAN_SUM_BLOCK, num_warps=NUM_WARPS,
                                                           **pdl_options(pdl))


def pdl_options(pdl: bool) -> dict[str, bool]:
    """A launch's PDL constant and option: with pdl (never in the interpreter, which runs no PTX), the kernel is
    launched as a programmatic dependent of the one before it on the stream (Hopper's griddepcontrol), so it may
    start while that one finishes; a kernel so launched calls gdc_wait before it reads what the one before wrote
    or writes anything."""
    on = pdl and not interpreted()
    return {"PDL": on, "launch_pdl": True} if on else {}


def _tile(x: Any, N: int) -> tuple[int, int, int, int]:
    """`linear_tile`'s tile on CUDA (INTERPRETED_TILE on the CPU) for x's rows and N outputs."""
    return linear_tile(x.numel() // x.shape[-1], N, _sms(x.device)) if x.is_cuda else INTERPRETED_TILE


def _product(x: Any, w: Any, bias: Any, tile: tuple[int, int, int, int] | None, span: int | str | None) -> Any:
    """Launch `_linear_kernel` for x [..., K] and a float weight w [N, K]."""

    N = w.shape[0]
    x2 = _rows(x)
    M, K = x2.shape
    BM, BN, BK, warps = tile or _tile(x, N)
    if span == "auto":
        span = linear_span(N, K, _sms(x.device)) if x.is_cuda else None
    _check_span(span, 128, "128")
    spans = 1 if span is None else triton.cdiv(K, span)
    y, part = _outputs(x2, N, spans)
    _linear_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN), spans)](
        x2, w, w if bias is None else bias, part, M, N, K, triton.cdiv(K if spans == 1 else span, BK), x2.stride(0),
        w.stride(0), y.stride(0), HAS_BIAS=bias is not None, SPLIT=spans > 1,
        UPCAST_DOT=interpreter_upcast(x.dtype), BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=warps)
    if spans > 1:
        _span_sums(part, bias, y, M, N, spans)
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
