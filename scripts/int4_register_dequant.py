"""A candidate GPU int4 product for issue 44's goal, waiting for a lent GPU to time it against kernels/invariant.py's
`quantized_linear` before it may replace it (docs/results/2026-11-30-int4-register-dequant.md).

On a lent GPU machine, from the repository root (nothing to install or carry; a few minutes):

    python scripts/int4_register_dequant.py --out OUT/candidate.json [--shape llama-7b] [--rows 1,16]

The landed kernel dequantizes each weight tile in float32, rounds it to bfloat16 and stores it to shared memory,
where the 16-row mma reads it back: about 8.3 SASS instructions a weight in its sm_90 loop
(scripts/sass_census.py). This one reads codes repacked once at load (`repack`) so that each tensor-core
instruction's weight operand is made in registers from the words as they arrive, and Hopper's wgmma takes it
from there (its A operand; x, the B operand, through shared memory as the pipeliner stages it): about 3.2.

- Layout. K is cut into steps of STEP = 128 input dims, four blocks of 32. A step's codes for one output are
  16 uint32 words; nibble p of word w holds dim (p % 4) * 32 + 2 * w + p // 4 of the step. So `(word >> 4j) &
  0x000F000F` holds the codes of dims 2w and 2w + 1 of block j, the lower in the low half, which is how a
  bfloat16 pair sits in the tensor core's operand register: OR-ing in 0x43004300 makes them the bfloat16 pair
  (128 + q, 128 + q') exactly. Worked example: dim 37 of a step is block 1, 2w + h = 5, so word 2, nibble
  1 + 4 * 1 = 5: bits 20-23 of word 2.
- Dequantization, a pair at a time (`_PAIR_ASM`, PTX): one LOP3 makes the pair, + -(128 + z) is exact (small
  integers), * s + m rounds once (fma.rn.bf16x2). Scales, offsets -(128 + z) and Q4_1 mins are bfloat16
  [N, blocks]; the landed kernel keeps float32 scales and rounds the float32 weight, so the two products agree
  to bfloat16's precision, not bit for bit (`dense` is this one's weight). The interpreter runs no PTX: it makes
  the same values in float32 and rounds them to bfloat16 by hand (twice rounded: rarely a unit apart).
- Row-invariant as the landed kernel: one tile for every M (BLOCK_M 16 rows, wgmma's N), the span fixed by K,
  the spans' float32 sums added in span order, by invariant._span_sums' second launch or (fused_sum) by the
  last of a tile's spans to finish, inside the one launch.

`main` times both products on every projection of a Llama shape at each row count (CUDA graphs, weights read
from HBM, as bench_quantized_gpu.py does) over TILES x SPANS x fused_sum, checks each against the float64 product
by its own `dense` weight, a row against itself alone, and the fused sums against the second launch's; adds each
variant's projections over a step (`projection_sums`); then times whole steps as they run (`step`: every layer's
own weights, one CUDA graph), the landed product's and the candidate's at the STEP_CONFIGS best configurations by
those sums of each of RULES (one span for every projection, or each weight shape's fastest), and writes one JSON,
fastest first.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import bench_quantized_gpu as bench  # noqa: E402

from trt_lookahead.engine.quantize import BLOCK_SIZE  # noqa: E402
from trt_lookahead.kernels import invariant  # noqa: E402

STEP = 128  # input dims per step: four blocks of 32, 16 words of 8 codes per output
BLOCKS = STEP // BLOCK_SIZE
WORDS = STEP // 8
PAIR_MASK = tl.constexpr(0x000F000F)  # a word's codes j and j + 4, shifted down by 4j
MAGIC = tl.constexpr(0x43004300)  # bfloat16 128.0 in both halves: OR-ed over a code q in a half's low bits, 128 + q
# (BLOCK_N, warps, steps a loop iteration, pipeline stages), BLOCK_N >= 64 (one warpgroup's wgmma A operand), for
# main's sweep: fewest loop instructions a weight first (scripts/sass_census.py). TILE, until a GPU's sweep
# picks: the fewest among those giving a 1-row 7B projection a program per SM at QUANTIZED_SPAN (BLOCK_N 128)
TILES = ((256, 8, 1, 2), (256, 8, 1, 3), (128, 4, 1, 2), (128, 4, 1, 3), (128, 4, 1, 4), (128, 8, 2, 3),
         (128, 8, 1, 3), (64, 4, 1, 3))
TILE = (128, 4, 1, 2)
BLOCK_M = 16  # rows per program, for every M: wgmma's N
SPANS = (512, 1024, 2048, None)  # the spans main times at each tile
CHECK_TOLERANCE = 1e-2  # a product's relative error: bfloat16 rows and outputs give about 2^-9, a misplaced code ~1
STEP_CONFIGS = 5  # configurations of each rule main times as whole steps per M, the best by their projections' sums
RULES = ("fixed", "per shape")  # how a configuration picks each projection's (span, fused_sum): step_sums


class Packed(NamedTuple):
    """An [N, k] int4 weight in the candidate's layout (see the module docstring)."""

    words: torch.Tensor  # int32 [N, steps * WORDS]
    scales: torch.Tensor  # bfloat16 [N, steps * BLOCKS]
    offsets: torch.Tensor  # bfloat16 [N, steps * BLOCKS]: -(128 + z)
    mins: torch.Tensor | None  # bfloat16 [N, steps * BLOCKS]: a Q4_1 block's m
    k: int


def repack(codes: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor, mins: torch.Tensor | None,
           k: int) -> Packed:
    """An int4 QuantizedLinear's buffers (MatMulNBits' layout: two codes a byte, low nibble first; zero points two
    a byte) in the candidate's layout, K padded to whole steps with zero codes and zero scales."""
    n, blocks = scales.shape
    if codes.shape[1] * 2 != blocks * BLOCK_SIZE:
        raise ValueError(f"int4 codes of {codes.shape[1]} bytes per output do not hold {blocks} blocks of "
                         f"{BLOCK_SIZE}")
    steps = -(-blocks // BLOCKS)
    q = torch.stack([codes & 0xF, codes >> 4], -1).reshape(n, blocks * BLOCK_SIZE).int()
    q = torch.nn.functional.pad(q, (0, steps * STEP - q.shape[1]))
    # dim j * 32 + 2w + h of a step -> nibble p = j + 4h of word w
    q = q.view(n, steps, BLOCKS, WORDS, 2).permute(0, 1, 3, 4, 2).reshape(n, steps, WORDS, 8)
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int32)
    words = (q << shifts).sum(-1, dtype=torch.int64)  # the nibbles are disjoint: the sum is their OR
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).view(n, steps * WORDS)
    z = torch.stack([zero_points & 0xF, zero_points >> 4], -1).reshape(n, -1)[:, :blocks]

    def per_block(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t.float(), (0, steps * BLOCKS - blocks)).to(torch.bfloat16)

    return Packed(words, per_block(scales), per_block(-128 - z.int()), None if mins is None else per_block(mins), k)


def dense(packed: Packed) -> torch.Tensor:
    """[N, k] float32: the weight the candidate multiplies by, ((128 + q) - (128 + z)) * s (+ m) rounded once to
    bfloat16, as its fused multiply-add computes it."""
    n = packed.words.shape[0]
    nibbles = torch.stack([(packed.words >> (4 * p)) & 0xF for p in range(8)], -1)  # [n, steps * WORDS, 8]
    # nibble p = j + 4h of word w -> dim j * 32 + 2w + h
    q = nibbles.view(n, -1, WORDS, 2, BLOCKS).permute(0, 1, 4, 2, 3).reshape(n, -1, BLOCK_SIZE).double()
    z = -packed.offsets.double()[..., None] - 128
    w = (q - z) * packed.scales.double()[..., None]
    if packed.mins is not None:
        w = w + packed.mins.double()[..., None]
    return w.to(torch.bfloat16).float().reshape(n, -1)[:, : packed.k]


# one pair of weights on sm_80+: the codes' bits under 128.0's (a & b | c), + -(128 + z) exactly, then one rounding
# of * s + m; Triton packs each two bfloat16 operands and results in one 32-bit register (pack=2)
_PAIR_ASM = tl.constexpr(f"""{{
.reg .b32 t, one;
mov.b32 one, 0x3F803F80;
lop3.b32 t, $1, {PAIR_MASK.value:#010x}, {MAGIC.value:#010x}, 0xea;
fma.rn.bf16x2 t, t, one, $3;
fma.rn.bf16x2 $0, t, $4, $5;
}}""")


@triton.jit
def _block_weights(words, j: tl.constexpr, scale, offset, m, INTERPRETED: tl.constexpr):
    """[BLOCK_N, 32] weights of block j of a step, ((128 + q) - (128 + z)) * s + m, from its [BLOCK_N, WORDS] words
    and the block's [BLOCK_N] scale, offset -(128 + z) and min (0 without mins): bfloat16 pairs made in the
    operand's registers (float32 holding bfloat16 values in the interpreter, which runs no PTX: the same values,
    rounded twice, so rarely a bfloat16 unit apart)."""
    shifted = words >> (4 * j)
    if INTERPRETED:
        t = (shifted & PAIR_MASK) | MAGIC  # (128 + q, 128 + q') bfloat16 pairs
        pairs = tl.join((t << 16).to(tl.float32, bitcast=True), (t & 0xFFFF0000).to(tl.float32, bitcast=True))
        w = tl.reshape(pairs, (pairs.shape[0], pairs.shape[1] * 2))  # dims 2w + h of block j
        return invariant._bfloat16_values((w + offset.to(tl.float32)[:, None]) * scale.to(tl.float32)[:, None]
                                + m.to(tl.float32)[:, None])
    both = tl.join(shifted, shifted)
    both = tl.reshape(both, (both.shape[0], both.shape[1] * 2))  # each word at the dims 2w, 2w + 1 it holds
    shape: tl.constexpr = both.shape
    return tl.inline_asm_elementwise(_PAIR_ASM, "=r,r,r,r,r,r",
                                     [both, tl.broadcast_to(offset[:, None], shape),
                                      tl.broadcast_to(scale[:, None], shape), tl.broadcast_to(m[:, None], shape)],
                                     dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _column(t, j: tl.constexpr):
    """Column j of a [BLOCK_N, 4] tensor, by two splits (Triton has no register indexing)."""
    even, odd = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))  # columns (0, 2) and (1, 3)
    low, high = tl.split(even if j % 2 == 0 else odd)
    return low if j < 2 else high


@triton.jit(do_not_specialize=["M", "SPAN_STEPS"])
def _int4_kernel(x_ptr, w_ptr, y_ptr, part_ptr, c_ptr, s_ptr, o_ptr, m_ptr, M, N, K, SPAN_STEPS, stride_xm,
                 stride_wn, stride_ym, stride_s, SPLIT: tl.constexpr, FUSED_SUM: tl.constexpr,
                 HAS_MINS: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 SUBSTEPS: tl.constexpr, EVEN_K: tl.constexpr):
    """y = x @ w^T for w [N, K] in the candidate's layout, over this program's span of SPAN_STEPS iterations of
    SUBSTEPS steps; the accumulator is [BLOCK_N, BLOCK_M] (weights as wgmma's A operand). SPLIT: the span's float32
    sums go to part [spans, M, N], added in span order by invariant._span_sums, or (FUSED_SUM) by the tile's last
    span to finish, counted in c (int32 a tile, zero between calls)."""
    pid_m, pid_n, span = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for it in range(span * SPAN_STEPS, tl.minimum(tl.cdiv(K, 128 * SUBSTEPS), (span + 1) * SPAN_STEPS)):
        for sub in tl.static_range(SUBSTEPS):
            step = it * SUBSTEPS + sub
            word = step * 16 + tl.arange(0, 16)  # the step's words; an iteration's last steps may lie past K
            g = step * 4 + tl.arange(0, 4)  # the step's blocks
            w_ok, ok = n_ok[:, None], n_ok[:, None]
            if not EVEN_K:
                w_ok = w_ok & (word < tl.cdiv(K, 128) * 16)[None, :]
                ok = ok & (g < tl.cdiv(K, 128) * 4)[None, :]
            words = tl.load(w_ptr + offs_n[:, None] * stride_wn + word[None, :], mask=w_ok,
                            other=0).to(tl.uint32, bitcast=True)  # [BLOCK_N, 16]
            s4 = tl.load(s_ptr + offs_n[:, None] * stride_s + g[None, :], mask=ok, other=0.0)  # [BLOCK_N, 4]
            o4 = tl.load(o_ptr + offs_n[:, None] * stride_s + g[None, :], mask=ok, other=0.0)
            m4 = tl.zeros_like(s4)
            if HAS_MINS:
                m4 = tl.load(m_ptr + offs_n[:, None] * stride_s + g[None, :], mask=ok, other=0.0)
            for j in tl.static_range(4):
                dims = (step * 4 + j) * 32 + tl.arange(0, 32)
                x_ok = m_ok[None, :]
                if not EVEN_K:
                    x_ok = x_ok & (dims < K)[:, None]
                xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + dims[:, None], mask=x_ok, other=0.0)  # [32, BLOCK_M]
                w = _block_weights(words, j, _column(s4, j), _column(o4, j), _column(m4, j), INTERPRETED)
                acc = tl.dot(w.to(tl.float32 if INTERPRETED else xt.dtype),
                             xt.to(tl.float32) if INTERPRETED else xt, acc, input_precision="ieee")
    out_ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT:
        tl.store(part_ptr + (span * M + offs_m)[None, :] * N + offs_n[:, None], acc, mask=out_ok)
        if FUSED_SUM:  # the last of the tile's spans to finish adds all their sums, in span order
            tl.debug_barrier()  # every thread's sums stored before the release below
            tile = pid_m * tl.num_programs(1) + pid_n
            if tl.atomic_add(c_ptr + tile, 1, sem="acq_rel", scope="gpu") == tl.num_programs(2) - 1:
                total = tl.load(part_ptr + offs_m[None, :] * N + offs_n[:, None], mask=out_ok, other=0.0,
                                cache_modifier=".cg")  # from L2: this SM's L1 may hold an earlier call's
                for other in range(1, tl.num_programs(2)):
                    total += tl.load(part_ptr + (other * M + offs_m)[None, :] * N + offs_n[:, None], mask=out_ok,
                                     other=0.0, cache_modifier=".cg")
                tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], total.to(y_ptr.dtype.element_ty),
                         mask=out_ok)
                tl.atomic_xchg(c_ptr + tile, 0)  # zero for the next call (a CUDA graph's replay)
    else:
        tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty), mask=out_ok)


_COUNTERS: dict[str, torch.Tensor] = {}  # per device: one int32 a tile, zero between calls (FUSED_SUM)


def counters(device: torch.device, tiles: int) -> torch.Tensor:
    """A zeroed int32 counter a tile on `device`, kept across calls (each call leaves it zero)."""
    have = _COUNTERS.get(str(device))
    if have is None or have.numel() < tiles:
        have = _COUNTERS[str(device)] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return have


def int4_linear(x: torch.Tensor, packed: Packed, tile: tuple[int, int, int, int] = TILE,
                span: int | str | None = "auto", fused_sum: bool = False) -> torch.Tensor:
    """x [..., k] times the packed weight's transpose, row-invariant; float32 accumulation. tile: (BLOCK_N, warps,
    steps an iteration, pipeline stages); span: a multiple of 128 * steps an iteration, or None for all of K;
    fused_sum: the spans' sums added inside the product's launch (same bits, one launch fewer; calls on one
    device must not overlap: they share the counters)."""
    BN, warps, substeps, stages = tile
    if span == "auto":
        span = invariant.quantized_span(packed.k)  # the landed product's rule: fixed by K
    invariant._check_span(span, STEP * substeps, str(STEP * substeps))
    x2 = invariant._rows(x)
    M, K = x2.shape
    N = packed.words.shape[0]
    iters = triton.cdiv(K if span is None else span, STEP * substeps)
    spans = triton.cdiv(K, iters * STEP * substeps)
    y, part = invariant._outputs(x2, N, spans)
    mins = packed.scales if packed.mins is None else packed.mins
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BN), spans)
    fused = fused_sum and spans > 1
    count = counters(x2.device, grid[0] * grid[1]) if fused else part
    _int4_kernel[grid](
        x2, packed.words, y, part, count, packed.scales, packed.offsets, mins, M, N, K, iters, x2.stride(0),
        packed.words.stride(0), y.stride(0), packed.scales.stride(0), SPLIT=spans > 1, FUSED_SUM=fused,
        HAS_MINS=packed.mins is not None, INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1", BLOCK_M=BLOCK_M,
        BLOCK_N=BN, SUBSTEPS=substeps, EVEN_K=K % (STEP * substeps) == 0, num_warps=warps, num_stages=stages)
    if spans > 1 and not fused:
        invariant._span_sums(part, None, y, M, N, spans)
    return y.view(*x.shape[:-1], N)


def packed_bytes(packed: Packed) -> int:
    """The bytes one product reads for the weight: words, and the bfloat16 scales, offsets (and mins)."""
    return bench.tensor_bytes(packed.words, packed.scales, packed.offsets, packed.mins)


def check(x: torch.Tensor, packed: Packed, weight: torch.Tensor, tile: tuple[int, int, int, int],
          span: int | str | None, fused_sum: bool) -> dict[str, Any]:
    """The candidate against the float64 product by `weight` (its own `dense` weight), row 0 against itself
    alone, and (fused_sum) the whole against the spans added by a second launch; `passed` if all hold (the error
    under CHECK_TOLERANCE)."""
    y = int4_linear(x, packed, tile, span, fused_sum)
    want = x.double() @ weight.double().t()
    err = ((y.double() - want).norm() / want.norm()).item()
    alone = int4_linear(x[:1], packed, tile, span, fused_sum)
    found: dict[str, Any] = {"relative_error": err, "row_alone_same_bits": bool(torch.equal(alone[0], y[0]))}
    if fused_sum:
        found["same_bits_as_two_launches"] = bool(torch.equal(int4_linear(x, packed, tile, span), y))
    found["passed"] = bool(err < CHECK_TOLERANCE and found["row_alone_same_bits"]
                           and found.get("same_bits_as_two_launches", True))
    return found


def variants(tiles: tuple[tuple[int, int, int, int], ...], spans: tuple[int | None, ...],
             K: int) -> list[tuple[tuple[int, int, int, int], int | None, bool]]:
    """(tile, span, fused_sum) main times for K: spans that split K and are whole iterations, each with its sums
    added by a second launch and inside the first; all of K once."""
    out: list[tuple[tuple[int, int, int, int], int | None, bool]] = []
    for tile in tiles:
        for span in spans:
            if span is None:
                out.append((tile, None, False))
            elif span < K and span % (STEP * tile[2]) == 0:
                out += [(tile, span, False), (tile, span, True)]
    return out


def candidate_product(tile: tuple[int, int, int, int],
                      spans: dict[tuple[int, int], tuple[int | str | None, bool]]) -> bench.Product:
    """`int4_linear` at a tile, with the (span, fused_sum) that `spans` gives a weight's shape (N, k), as
    bench_quantized_gpu times a product: one choice per shape, whatever M, so still row-invariant."""
    def product(x: torch.Tensor, packed: Packed) -> torch.Tensor:
        span, fused_sum = spans[(packed.words.shape[0], packed.k)]
        return int4_linear(x, packed, tile, span, fused_sum)
    return product


def random_packed(N: int, K: int, device: str) -> Packed:
    """A random int4 weight of [N, K] in the candidate's layout (bench_quantized_gpu's random blocks, repacked)."""
    codes, scales, zeros = bench.quantized_weight(N, K, 4, device)
    return repack(codes, scales, zeros, None, K)


def run(shape: dict[str, Any], rows: list[int], peak_gbps: float, tiles: tuple[tuple[int, int, int, int], ...],
        spans: tuple[int | None, ...], device: str = "cuda") -> list[dict[str, Any]]:
    """Per projection and M: the landed int4 product's time, and the candidate's at each tile and span with its
    checks (random weights in MatMulNBits' layout, repacked; bfloat16 rows); the checks once more with mins.
    Weights cold as bench_quantized_gpu's: each product cycles through its own `cold_copies`."""
    out: list[dict[str, Any]] = []
    for name, (N, K) in bench.projections(shape).items():
        landed_weights = bench.cold_weights(bench.KINDS["int4"], N, K, device)
        codes, scales, zeros = first = landed_weights[0]
        packed_weights = [repack(c, s, z, None, K) for c, s, z in landed_weights]
        packed = packed_weights[0]
        weight = dense(packed)
        with_mins = repack(codes, scales, zeros, torch.rand_like(scales) - 0.5, K)  # a Q4_1 weight: m added
        weight_with_mins = dense(with_mins)
        landed_limit = bench.tensor_bytes(*first) / (peak_gbps * 1e3)
        limit = packed_bytes(packed) / (peak_gbps * 1e3)
        for M in rows:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            landed = bench.call_us(bench.quantized_product(4), x, landed_weights)
            row: dict[str, Any] = {"projection": name, "N": N, "K": K, "M": M, "copies": len(landed_weights),
                                   "landed_us": round(landed, 2), "landed_x_limit": round(landed / landed_limit, 2),
                                   "limit_us": round(limit, 2),
                                   "mins_check": check(torch.randn(max(M, 2), K, device=device, dtype=torch.bfloat16),
                                                       with_mins, weight_with_mins, TILE, "auto", False),
                                   "candidates": []}
            for tile, span, fused in variants(tiles, spans, K):
                entry: dict[str, Any] = {"tile": tile, "span": span, "fused_sum": fused}
                try:
                    us = bench.call_us(candidate_product(tile, {(N, K): (span, fused)}), x, packed_weights)
                    entry |= {"us": round(us, 2), "x_limit": round(us / limit, 2),
                              **check(torch.randn(max(M, 2), K, device=device, dtype=torch.bfloat16), packed,
                                      weight, tile, span, fused)}
                except Exception as exc:  # a tile the GPU cannot hold is a row, not the end of the run
                    entry["error"] = f"{exc}"[:200]
                row["candidates"].append(entry)
            row["candidates"].sort(key=lambda e: e.get("us", float("inf")))
            out.append(row)
            print(json.dumps({**row, "candidates": row["candidates"][:3]}), flush=True)
        del landed_weights, packed_weights
    return out


def steps(shape: dict[str, Any], sums: list[dict[str, Any]], peak_gbps: float, configs: int,
          device: str = "cuda") -> list[dict[str, Any]]:
    """Per M of `sums` (step_sums'): the whole step timed as it runs (bench_quantized_gpu.step_weights, one CUDA
    graph) with the landed product, and with the candidate at the `configs` best configurations of each rule by
    their projections' sums, fastest first."""
    landed = bench.step_weights(shape, bench.KINDS["int4"].make, device)
    packed = bench.step_weights(shape, random_packed, device)
    landed_limit = sum(bench.tensor_bytes(*w) for _, w in landed) / (peak_gbps * 1e3)
    limit = sum(packed_bytes(w) for _, w in packed) / (peak_gbps * 1e3)
    sizes = bench.projections(shape)
    out: list[dict[str, Any]] = []
    for entry in sums:
        inputs = bench.step_inputs(shape, entry["M"], device)
        us = bench.replay_us(bench.step_calls(landed, bench.quantized_product(4), inputs))
        timed = []
        for rule in RULES:
            for best in [b for b in entry["best"] if b["rule"] == rule][:configs]:
                spans = {sizes[name]: (span, fused) for name, (span, fused) in best["spans"].items()}
                step_us = bench.replay_us(bench.step_calls(packed, candidate_product(tuple(best["tile"]), spans),
                                                           inputs))
                timed.append({**best, "sum_ms": best["ms"], "ms": round(step_us / 1e3, 3),
                              "x_limit": round(step_us / limit, 2)})
        timed.sort(key=lambda t: t["ms"])
        out.append({"M": entry["M"], "limit_ms": round(limit / 1e3, 3), "landed_ms": round(us / 1e3, 3),
                    "landed_x_limit": round(us / landed_limit, 2), "best": timed})
        print(json.dumps(out[-1]), flush=True)
    return out


def step_sums(rows: list[dict[str, Any]], layers: int) -> list[dict[str, Any]]:
    """Per M: the projections' own times added over a whole step (layers x each layer's four, plus the lm_head):
    landed, the memory limit of the candidate's bytes, and the candidate's configurations that ran and passed their
    checks on every projection, fastest first. A configuration is a tile and each projection's (span, fused_sum),
    by one of RULES: "fixed", one (span, fused_sum) for every projection, as main times them; or "per shape", at
    each tile each projection's fastest by its times added over every M measured (a choice per weight shape, never
    per M)."""
    times = {r["projection"]: layers if r["projection"] != "lm_head" else 1 for r in rows}
    Ms = sorted({r["M"] for r in rows})
    us: dict[tuple[Any, ...], float] = {}  # (M, projection, tile, span, fused) -> microseconds of one call
    failed = set()  # (tile, span, fused) that failed a check anywhere: a fault may show on any shape, so out
    for r in rows:
        for c in r["candidates"]:
            if "us" in c:
                us[(r["M"], r["projection"], tuple(c["tile"]), c["span"], c["fused_sum"])] = c["us"]
                if not c["passed"]:
                    failed.add((tuple(c["tile"]), c["span"], c["fused_sum"]))
    # a projection's variant counts where it ran at every M (one choice serves every M) and never failed
    usable = {key[1:] for key in us if all((M, *key[1:]) in us for M in Ms) and key[2:] not in failed}
    configs: list[tuple[str, tuple[int, ...], dict[str, tuple[int | None, bool]]]] = []
    for tile, span, fused in sorted({key[1:] for key in usable}, key=str):
        configs.append(("fixed", tile, {name: (span, fused) for name in times}))
    for tile in sorted({key[1] for key in usable}):
        choice: dict[str, tuple[int | None, bool]] = {}
        for name in times:
            options = [key[2:] for key in usable if key[:2] == (name, tile)]
            if options:
                choice[name] = min(options, key=lambda o: (sum(us[(M, name, tile, *o)] for M in Ms), str(o)))
        configs.append(("per shape", tile, choice))
    out = []
    for M in Ms:
        at_m = [r for r in rows if r["M"] == M]
        landed = sum(r["landed_us"] * times[r["projection"]] for r in at_m)
        limit = sum(r["limit_us"] * times[r["projection"]] for r in at_m)
        ranked: list[dict[str, Any]] = []
        for rule, tile, spans in configs:
            keys = [(M, name, tile, *spans[name]) for name in times if name in spans]
            if len(keys) == len(times) and all(k[1:] in usable for k in keys):
                total = sum(us[k] * times[k[1]] for k in keys)
                ranked.append({"tile": list(tile), "rule": rule,
                               "spans": {name: list(spans[name]) for name in times}, "ms": round(total / 1e3, 3),
                               "x_limit": round(total / limit, 2)})
        ranked.sort(key=lambda w: (w["ms"], w["rule"]))
        out.append({"M": M, "landed_ms": round(landed / 1e3, 3), "limit_ms": round(limit / 1e3, 3), "best": ranked})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = bench.gpu_parser(__doc__.splitlines()[0], "1,16")
    parser.add_argument("--tiles", type=int, default=len(TILES), help="time the first TILES only")
    parser.add_argument("--step-configs", type=int, default=STEP_CONFIGS,
                        help="whole steps timed per M and rule: the best configurations by their projections' sums")
    args = parser.parse_args(argv)
    if bench.no_gpu():
        return 2
    shape = bench.shape_of(args.shape)
    rows = run(shape, [int(r) for r in args.rows.split(",")], args.peak_gbps, TILES[: args.tiles], SPANS)
    sums = step_sums(rows, shape["num_layers"])
    result = {"shape": args.shape, "device": torch.cuda.get_device_name(), "l2_bytes": bench.l2_bytes("cuda"),
              "projection_sums": sums, "rows": rows}
    bench.write_result(args.out, result)  # the projections, if the steps die
    result["step"] = steps(shape, sums, args.peak_gbps, args.step_configs)
    return bench.finish(args.out, result)


if __name__ == "__main__":
    raise SystemExit(main())
