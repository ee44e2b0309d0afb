"""The GPU product by int4 weights in model/llama.py QuantizedLinear's "words" layout: each pair of weights made in
the register the tensor core reads, row-invariant as every quantized product (docs/design.md 6.9).

kernels/invariant.py's `quantized_linear` dequantizes each weight tile in float32, rounds it to bfloat16 and
stores it to shared memory, where the 16-row mma reads it back: its loop's instructions, not the bytes, bound it
(scripts/sass_census.py counts them). This one reads the codes repacked once at load (`QuantizedLinear.set_layout`:
`(word >> 4j) & 0x000F000F` holds block j's dims 2w and 2w + 1, the lower in the low half, as a bfloat16 pair sits
in the tensor core's operand register), so each pair is made where it is used and Hopper's wgmma takes it as its
A operand (x, the B operand, through shared memory as the pipeliner stages it): less than half the instructions.

- Dequantization, a pair at a time (`_PAIR_ASM`, PTX): one LOP3 ORs the codes under 0x43004300, making the
  bfloat16 pair (128 + q, 128 + q') exactly; + -(128 + z) is exact (small integers); * s + m rounds once
  (fma.rn.bf16x2). So the weight is the layout's: ((128 + q) - (128 + z)) * s + m rounded once to bfloat16. The
  interpreter runs no PTX: it makes the same values in float32 and rounds them to bfloat16 by hand (twice rounded,
  so rarely a bfloat16 unit apart from a GPU's).
- A step (128 dims) is one dot: its four blocks joined into one [BLOCK_N, 128] operand, so its wgmmas are issued
  as a group and overlap the next step's dequantization; the loop's trip count is a constant (SPAN_STEPS), since
  ptxas serializes the wgmmas of a loop that may not run (see `_words_kernel`). Each block's scale and offset are
  one int32 of the layout, loaded once for both.
- Row-invariant: one tile (WORDS_TILE, BLOCK_M 16 rows: wgmma's N) for every M and the span fixed by the weight's
  shape (`words_span`), the spans' float32 sums added in span order by invariant's span sums.
- Launch: plain by default; `pdl=True` launches the product and its span sums as programmatic dependents, each
  program prefetching its span's words into L2 before it waits for the kernel before it (the same bits; not the
  default until a GPU has timed it, docs/design.md 6.9).

Where it runs (`words_kernel_reason`): CUDA devices of compute capability 9.0 or more (wgmma; bf16x2 arithmetic)
with bfloat16 activations, where it is the faster product at every row count measured (docs/design.md 6.9);
elsewhere the weights stay in blocks and invariant.py's product runs.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from trt_lookahead.kernels import invariant
from trt_lookahead.kernels.triton_kernel import interpreted

STEP = 128  # input dims a loop iteration reduces: four blocks of 32, 16 words of 8 codes per output (WORDS_STEP)
_STEP = tl.constexpr(STEP)  # the kernel's
PAIR_MASK = tl.constexpr(0x000F000F)  # a word's codes j and j + 4, shifted down by 4j
MAGIC = tl.constexpr(0x43004300)  # bfloat16 128.0 in both halves: OR-ed over a code q in a half's low bits, 128 + q
# (BLOCK_N, warps, pipeline stages) for every M (docs/design.md 6.9); BLOCK_N >= 64, one warpgroup's wgmma A operand
WORDS_TILE = (128, 8, 3)
BLOCK_M = 16  # rows per program, for every M: wgmma's N
# the programs a product's span rule aims for: enough to stream the weight from every SM of a large GPU at one row
WORDS_PROGRAMS = 256
MIN_CAPABILITY = (9, 0)

# one pair of weights: the codes' bits under 128.0's (a & b | c), + -(128 + z) exactly, then one rounding of * s + m;
# Triton packs each two bfloat16 operands and results in one 32-bit register (pack=2), and passes each 32-bit
# operand once per weight of the pair: $1 (and $2) the word, $3 (and $4) the block's int32 of the layout, its scale
# s in the low half and offset -(128 + z) in the high (each spread over both halves here), $5 the pair (m, m)
_PAIR_ASM = tl.constexpr(f"""{{
.reg .b32 t, one, s2, o2;
.reg .b16 s, o;
mov.b32 one, 0x3F803F80;
mov.b32 {{s, o}}, $3;
mov.b32 s2, {{s, s}};
mov.b32 o2, {{o, o}};
lop3.b32 t, $1, {PAIR_MASK.value:#010x}, {MAGIC.value:#010x}, 0xea;
fma.rn.bf16x2 t, t, one, o2;
fma.rn.bf16x2 $0, t, s2, $5;
}}""")


@triton.jit
def _block_weights(words, j: tl.constexpr, pair, m, INTERPRETED: tl.constexpr):
    """[BLOCK_N, 32] weights of block j of a step, ((128 + q) - (128 + z)) * s + m, from its [BLOCK_N, 16] words,
    the block's [BLOCK_N] (scale, offset -(128 + z)) pairs (uint32, the scale in the low half) and mins (0 without
    mins): bfloat16 pairs made in the operand's registers (float32 holding bfloat16 values in the interpreter)."""
    shifted = words >> (4 * j)
    if INTERPRETED:
        t = (shifted & PAIR_MASK) | MAGIC  # (128 + q, 128 + q') bfloat16 pairs
        w = tl.join((t << 16).to(tl.float32, bitcast=True), (t & 0xFFFF0000).to(tl.float32, bitcast=True))
        w = tl.reshape(w, (w.shape[0], w.shape[1] * 2))  # dims 2w + h of block j
        scale = (pair << 16).to(tl.float32, bitcast=True)
        offset = (pair & 0xFFFF0000).to(tl.float32, bitcast=True)
        return invariant._bfloat16_values((w + offset[:, None]) * scale[:, None] + m.to(tl.float32)[:, None])
    both = tl.join(shifted, shifted)
    both = tl.reshape(both, (both.shape[0], both.shape[1] * 2))  # each word at the dims 2w, 2w + 1 it holds
    shape: tl.constexpr = both.shape
    return tl.inline_asm_elementwise(_PAIR_ASM, "=r,r,r,r,r,r",
                                     [both, tl.broadcast_to(pair[:, None], shape), tl.broadcast_to(m[:, None], shape)],
                                     dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _column(t, j: tl.constexpr):
    """Column j of a [BLOCK_N, 4] tensor, by two splits (Triton has no register indexing)."""
    even, odd = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))  # columns (0, 2) and (1, 3)
    low, high = tl.split(even if j % 2 == 0 else odd)
    return low if j < 2 else high


@triton.jit
def _step_weights(words, pairs, mins, INTERPRETED: tl.constexpr):
    """[BLOCK_N, 128] weights of a step, its dims in order, from its [BLOCK_N, 16] words and its four blocks'
    [BLOCK_N, 4] pairs and mins: one tensor, so that the step is one dot (its wgmmas issued together)."""
    w0 = _block_weights(words, 0, _column(pairs, 0), _column(mins, 0), INTERPRETED)
    w1 = _block_weights(words, 1, _column(pairs, 1), _column(mins, 1), INTERPRETED)
    w2 = _block_weights(words, 2, _column(pairs, 2), _column(mins, 2), INTERPRETED)
    w3 = _block_weights(words, 3, _column(pairs, 3), _column(mins, 3), INTERPRETED)
    w = tl.join(tl.join(w0, w2), tl.join(w1, w3))  # [BLOCK_N, 32, 2, 2]: block 2a + b at [..., a, b]
    return tl.reshape(tl.permute(w, (0, 2, 3, 1)), (w.shape[0], 4 * w.shape[1]))


@triton.jit
def _prefetch_words(w_ptr, offs_n, N, K, stride_wn, first, SPAN_STEPS: tl.constexpr):
    """Ask L2 for the words of steps [first, first + SPAN_STEPS) (those in K) of rows offs_n (clamped to N), a
    64-byte step of each row at a time (per-thread prefetches: a bulk one takes a uniform address)."""
    rows = w_ptr + tl.minimum(offs_n, N - 1) * stride_wn
    for step in range(first, tl.minimum(first + SPAN_STEPS, tl.cdiv(K, _STEP))):
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.u32 $0, 0;", "=r,l", [rows + step * 16],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["M"])
def _words_kernel(x_ptr, w_ptr, y_ptr, p_ptr, m_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_p,
                  SPAN_STEPS: tl.constexpr, SPLIT: tl.constexpr, HAS_MINS: tl.constexpr, INTERPRETED: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr = False):
    """y = x @ w^T for w [N, K] in the words layout, over this program's span of SPAN_STEPS steps; the
    accumulator is [BLOCK_N, BLOCK_M] (weights as wgmma's A operand). SPAN_STEPS is a constant so the loop runs at
    least once: the compiler then pipelines the dots (with a loop that may not run, ptxas serializes every wgmma);
    EVEN: every span's steps lie in K, else the steps past K are masked to zero weights. SPLIT: y is float32
    [spans, M, N], the span's sums, added in span order by invariant._span_sums. p_ptr: the (scale, offset) pairs as
    int32, stride_p int32s a row; m_ptr: bfloat16 mins, the same stride in bfloat16s."""
    pid_m, pid_n, span = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    if PDL:  # launched as a programmatic dependent (invariant.pdl_options)
        gdc_launch_dependents()
        # the span's words, which no kernel writes, into L2 while the grid before finishes; nothing that grid
        # writes is read, and nothing is written, before the wait
        _prefetch_words(w_ptr, offs_n, N, K, stride_wn, span * SPAN_STEPS, SPAN_STEPS)
        gdc_wait()
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for i in range(SPAN_STEPS):
        step = span * SPAN_STEPS + i
        ok = n_ok[:, None]
        if not EVEN:
            # the step as a [BLOCK_N, 1] tensor: the interpreter refuses a mask and-ed with a scalar comparison
            ok = ok & (tl.full((BLOCK_N, 1), step, tl.int32) < tl.cdiv(K, _STEP))
        word = step * 16 + tl.arange(0, 16)
        g = step * 4 + tl.arange(0, 4)  # the step's blocks
        words = tl.load(w_ptr + offs_n[:, None] * stride_wn + word[None, :], mask=ok,
                        other=0).to(tl.uint32, bitcast=True)  # [BLOCK_N, 16]
        pairs = tl.load(p_ptr + offs_n[:, None] * stride_p + g[None, :], mask=ok,
                        other=0).to(tl.uint32, bitcast=True)  # [BLOCK_N, 4]
        mins = tl.zeros(pairs.shape, tl.bfloat16)
        if HAS_MINS:
            mins = tl.load(m_ptr + offs_n[:, None] * stride_p + g[None, :], mask=ok, other=0.0)
        w = _step_weights(words, pairs, mins, INTERPRETED)  # [BLOCK_N, 128]
        dims = step * _STEP + tl.arange(0, _STEP)
        x_ok = m_ok[None, :]
        if not EVEN:
            x_ok = x_ok & (dims < K)[:, None]
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + dims[:, None], mask=x_ok, other=0.0)  # [128, BLOCK_M]
        acc = tl.dot(w.to(tl.float32 if INTERPRETED else xt.dtype),
                     xt.to(tl.float32) if INTERPRETED else xt, acc, input_precision="ieee")
    out_ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT:
        tl.store(y_ptr + (span * M + offs_m)[None, :] * N + offs_n[:, None], acc, mask=out_ok)
    else:
        tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty), mask=out_ok)


def words_linear(x: Any, codes: Any, pairs: Any, mins: Any, tile: tuple[int, int, int] = WORDS_TILE,
                 span: int | str | None = "auto", pdl: bool = False) -> Any:
    """x [..., K] (bfloat16) times the transpose of an [N, K] weight in the words layout (QuantizedLinear's codes,
    scales as the (scale, offset) pairs, mins); float32 accumulation, x's dtype out. tile: (BLOCK_N, warps,
    pipeline stages); span: the input dims one program reduces (a multiple of STEP, or None for all of K),
    `words_span`'s by default. A row's bits depend on the span, never on M. pdl: launched as a programmatic
    dependent of the kernel before it on the stream (invariant.pdl_options), each program's words asked of L2
    before it waits for that kernel; the same bits (docs/design.md 6.9)."""
    BN, warps, stages = tile
    x2 = invariant._rows(x)
    M, K = x2.shape
    N = codes.shape[0]
    if codes.shape[1] < triton.cdiv(K, STEP) * 16:  # the kernel reads whole steps of 16 words
        raise ValueError(f"{codes.shape[1]} words per output do not hold the input's {K} dims in whole steps of "
                         f"{STEP} ({triton.cdiv(K, STEP) * 16} words)")
    if pairs.stride(1) != 1 or (mins is not None and mins.stride() != pairs.stride()):
        raise ValueError("the words layout's scales (and mins) are [N, blocks] rows with unit stride, as "
                         "QuantizedLinear.set_layout('words') holds them")
    if span == "auto":
        span = words_span(N, K, BN)
    invariant._check_span(span, STEP, str(STEP))
    span_steps = triton.cdiv(K if span is None else span, STEP)
    spans = triton.cdiv(K, span_steps * STEP)
    y, part = invariant._outputs(x2, N, spans)
    _words_kernel[(triton.cdiv(M, BLOCK_M), triton.cdiv(N, BN), spans)](
        x2, codes, part, pairs, pairs if mins is None else mins, M, N, K, x2.stride(0), codes.stride(0),
        y.stride(0), pairs.stride(0), SPAN_STEPS=span_steps, SPLIT=spans > 1, HAS_MINS=mins is not None,
        INTERPRETED=interpreted(), BLOCK_M=BLOCK_M, BLOCK_N=BN,
        EVEN=spans * span_steps * STEP == K, num_warps=warps, num_stages=stages, **invariant.pdl_options(pdl))
    if spans > 1:
        invariant._span_sums(part, None, y, M, N, spans, pdl)
    return y.view(*x.shape[:-1], N)


def words_span(N: int, K: int, block_n: int = WORDS_TILE[0]) -> int | None:
    """The input dims each program of an [N, K] product reduces, whatever M: all of K where N's tiles alone make
    WORDS_PROGRAMS programs, else the largest power-of-two multiple of STEP under K that makes them, else STEP."""
    tiles = triton.cdiv(N, block_n)
    if tiles >= WORDS_PROGRAMS or K <= STEP:
        return None
    span = STEP
    while span * 2 < K:
        span *= 2
    while span > STEP and tiles * triton.cdiv(K, span) < WORDS_PROGRAMS:
        span //= 2
    return span


def words_kernel_reason(device: Any, dtype: Any) -> str | None:
    """Why `words_linear` is not the product of int4 weights on `device` with `dtype` activations, or None."""
    import torch

    if dtype != torch.bfloat16:
        return f"multiplies bfloat16 activations, not {dtype}"
    if device.type != "cuda":
        return f"runs on CUDA, not {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (f"needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (wgmma), this GPU has "
                f"{capability[0]}.{capability[1]}")
    return None
