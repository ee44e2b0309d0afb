"""Quantization of an exported graph's projections: int8 or int4 weight blocks, float or int8 activations.

    blocks = quantize_blocks(w, bits=4)            # w [N, K] float32 (out, in) -> QuantizedWeight
    w_hat = blocks.dequantize()                    # [N, K]: exactly what the quantized graph multiplies by
    proto, used = quantize_graph(proto, "int4")    # every Gemm(x, W^T) on a weight -> com.microsoft MatMulNBits
    proto, used = quantize_graph(proto, "int4", activations="int8")  # ... multiplying int8 activation blocks
    x_hat = quantize_activations(x)                # x [..., K] torch: what those nodes multiply instead of x
    proto, left = native_products(proto)           # at load: int8-activation products -> our C QuantizedMatMul
    used = quantize_model(llama, "int4", torch.bfloat16)  # a torch Llama's projections -> QuantizedLinear (GPU)

Each output channel's K inputs are cut into blocks of BLOCK_SIZE (the last one padded with zeros); a block
keeps `bits`-bit unsigned codes q, a float32 scale s and an integer zero point z, and w_hat = (q - z) * s. The
block's range is its min and max with 0 included, s = (max - min) / (2**bits - 1), z = round(-min / s), so 0
is exact and every weight is within s / 2 of w_hat. Worked example, bits 4, one block [-1.0, 0.6, 2.0, 0.3,
0, ...] whose min is -1.0 and max 2.0: s = 3 / 15 = 0.2, z = 5, -1.0 -> q 0, 0.6 -> q 8, 2.0 -> q 15, 0.3 -> q 7
(1.5 rounds to even: w_hat 0.4), 0 -> q 5.

A weight whose rows are exactly GGUF Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K or Q8_0 tensors dequantized (a checkpoint
converted from such a file; Q5 codes in 8-bit blocks) keeps those blocks instead (`gguf_blocks`; docs/design.md
6.9): same numbers, no second rounding; its rows on none of them (Q6_K) are quantized here.

With int8 activations (MatMulNBits accuracy_level 4) each row of the input is cut into the same blocks along K,
and a block holds int8 codes round(x * 127 / amax) with the float scale amax / 127 (amax its largest |x|): the
products are integer dot products per block, as llama.cpp's quantized matmuls take theirs.

The layout is onnxruntime's MatMulNBits (contrib op, CPU): codes [N, blocks, BLOCK_SIZE * bits / 8] with two
4-bit codes per byte low nibble first, scales [N * blocks], zero points [N, blocks] bytes for int8 and two per
byte for int4; a Q4_1 block's m rides beside the node (`mins`). The engine's config.json records the scheme
(engine/format.py); docs/design.md section 6.9.
Imports numpy, onnx (and torch and model.llama for `quantize_activations` and `quantize_model`, kernels.onnx_op for
`native_products`) and engine.format.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from trt_lookahead.engine.format import ACTIVATION_SCHEMES, WEIGHT_SCHEMES
from trt_lookahead.engine.initializers import Weights, held_initializer, initializer_array
from trt_lookahead.errors import UserError

BITS = {"int8": 8, "int4": 4}
ACCURACY_LEVEL = {"int8": 4}  # MatMulNBits' attribute for activations other than float: 4 = int8 blocks
ACTIVATION_CODE = 127  # an int8 activation block's codes are -127 .. 127
BLOCK_SIZE = 32  # weights per (channel, block); a power of two >= 16, as MatMulNBits takes
CHUNK_WEIGHTS = 1 << 22  # weights quantized at once by quantize_blocks (its float transients: a few times this)
# in a quantized build's key, so cached engines are rebuilt: 2 = GGUF Q5_x, K-quant and mixed-row blocks kept,
# 3 = a GGUF weight's rows on no grid quantized here beside its kept rows
BLOCKS_REVISION = 3
CONTRIB_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class QuantizedWeight:
    """One [N, K] weight as MatMulNBits holds it (see the module docstring)."""

    codes: np.ndarray  # uint8 [N, blocks, BLOCK_SIZE * bits / 8]
    scales: np.ndarray  # float32 [N, blocks]
    zero_points: np.ndarray  # uint8 [N, blocks] (int8) or [N, ceil(blocks / 2)] (int4)
    bits: int
    k: int  # the unpadded input size
    grid: str  # where the blocks come from: "int8" / "int4" (quantize_blocks), or a GGUF type kept (gguf_blocks)
    mins: np.ndarray | None = None  # float32 [N, blocks]: each block's m, added to (q - z) * s (GGUF Q4_1, Q5_1)

    def unpacked(self) -> tuple[np.ndarray, np.ndarray]:
        """(codes [N, blocks, BLOCK_SIZE], zero points [N, blocks]) one value per entry."""
        if self.bits == 8:
            return self.codes, self.zero_points
        codes = np.stack([self.codes & 0xF, self.codes >> 4], -1).reshape(*self.codes.shape[:2], -1)
        zeros = np.stack([self.zero_points & 0xF, self.zero_points >> 4], -1).reshape(len(self.zero_points), -1)
        return codes, zeros[:, : self.scales.shape[1]]

    def dequantize(self) -> np.ndarray:
        """[N, K] float32: (q - z) * s (+ m) per block, the padding dropped."""
        codes, zeros = self.unpacked()
        blocks = (codes.astype(np.float32) - zeros[..., None].astype(np.float32)) * self.scales[..., None]
        if self.mins is not None:
            blocks = blocks + self.mins[..., None]
        return blocks.reshape(len(blocks), -1)[:, : self.k]


def _packed(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, bits: int, k: int, grid: str,
            mins: np.ndarray | None = None) -> QuantizedWeight:
    """codes [N, blocks, BLOCK_SIZE] and zero points [N, blocks] one per entry -> MatMulNBits' layout (4-bit codes
    and zero points two per byte, low nibble first)."""
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
        zeros = np.pad(zeros, ((0, 0), (0, zeros.shape[1] % 2)))
        zeros = zeros[:, 0::2] | (zeros[:, 1::2] << 4)
    return QuantizedWeight(codes, scales.astype(np.float32), zeros, bits, k, grid, mins)


def quantize_blocks(weight: np.ndarray, bits: int) -> QuantizedWeight:
    """Quantize a float [N, K] weight (output channels by inputs) in blocks of BLOCK_SIZE along K, CHUNK_WEIGHTS at a
    time (rows are independent; the float transients stay a chunk's, not a vocabulary-sized lm_head's)."""
    fit = _read_rows(partial(_quantized_here, bits=bits), weight, np.arange(len(weight)))
    return _packed(fit.codes, fit.scales, fit.zeros, bits, weight.shape[1], f"int{bits}")


def _quantized_here(w: np.ndarray, bits: int) -> _Fit:
    """Blocks w [N, blocks, BLOCK_SIZE] quantized to `bits` (the module docstring's rule), as a _Fit of every row."""
    top = (1 << bits) - 1
    low, high = np.minimum(w.min(-1), 0.0), np.maximum(w.max(-1), 0.0)  # [N, blocks], 0 inside the range
    scales = ((high - low) / top).astype(np.float32)
    scales[scales == 0] = 1.0  # an all-zero block: any scale represents it
    zeros = np.clip(np.round(-low / scales), 0, top).astype(np.uint8)
    codes = np.clip(np.round(w / scales[..., None]) + zeros[..., None], 0, top).astype(np.uint8)
    return _Fit(codes, scales, zeros, None, np.ones(len(w), bool), bits)


# -- a checkpoint dequantized from GGUF blocks: its own blocks, kept ------------------------------------------------


def _half(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to float16 and back: the precision of a GGUF block's scale and min."""
    return x.astype(np.float16).astype(np.float32)


class _Fit(NamedTuple):
    """A GGUF block type's reading of a weight x [N, blocks, BLOCK_SIZE]: its codes with their zero points, scales,
    mins (None: the type has none), and which rows it reads exactly (`rows`; the others' entries are meaningless)."""

    codes: np.ndarray  # uint8 [N, blocks, BLOCK_SIZE], 0 .. 2 ** code_bits - 1
    scales: np.ndarray  # float32 [N, blocks], never 0
    zeros: np.ndarray  # uint8 [N, blocks]
    mins: np.ndarray | None  # float32 [N, blocks]
    rows: np.ndarray  # bool [N]: every weight of the row is float32((q - z) * s (+ m)) exactly
    bits: int  # the codes' width in the products: 4 or 8


def _read_rows(read: Callable[[np.ndarray], _Fit], weight: np.ndarray, rows: np.ndarray) -> _Fit:
    """`read` (quantize_blocks' rule or a GGUF_GRIDS reader) of a float [N, K] weight's `rows`, CHUNK_WEIGHTS at a
    time, each chunk as float32 blocks [rows, blocks, BLOCK_SIZE], K zero-padded to whole blocks: rows are
    independent, so the float transients stay a chunk's, not a vocabulary-sized lm_head's."""
    k = weight.shape[1]
    blocks = -(-k // BLOCK_SIZE)
    step = max(1, CHUNK_WEIGHTS // (blocks * BLOCK_SIZE))
    fits = []
    for start in range(0, len(rows), step):
        chunk = rows[start : start + step]
        w = np.zeros((len(chunk), blocks * BLOCK_SIZE), np.float32)
        w[:, :k] = weight[chunk]
        fits.append(read(w.reshape(len(chunk), blocks, BLOCK_SIZE)))
    if len(fits) == 1:
        return fits[0]
    codes, scales, zeros, exact = (np.concatenate(parts) for parts in zip(*((fit.codes, fit.scales, fit.zeros, fit.rows)
                                                                           for fit in fits), strict=True))
    mins = None if fits[0].mins is None else np.concatenate([fit.mins for fit in fits if fit.mins is not None])
    return _Fit(codes, scales, zeros, mins, exact, fits[0].bits)


def _on_grid(x: np.ndarray, scales: np.ndarray, offsets: np.ndarray, low: int, high: int) -> tuple[np.ndarray,
                                                                                                   np.ndarray]:
    """(uint8 codes q - low [N, blocks, BLOCK_SIZE], q = round((x - offset) / scale) clipped to low .. high; bool
    [N, blocks]: float32(q * scale + offset) == x for every weight of the block of x [N, blocks, BLOCK_SIZE]), as
    the gguf package dequantizes (a block's scale 0: every q 0). All float32, high - low <= 255; a block that does
    not read (a q off low .. high, or not finite) has codes of no meaning. In place where it can: this runs over
    every weight of a GGUF checkpoint."""
    scale = scales[..., None]
    q = np.subtract(x, offsets[..., None], dtype=np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(q, scale, out=q)
    np.round(q, out=q)
    zero = scales == 0
    if zero.any():
        q[zero] = 0
    inside = ((q >= low) & (q <= high)).all(-1)  # False for NaN
    np.fmin(np.fmax(q, low, out=q), high, out=q)  # NaN -> low
    back = np.multiply(q, scale, dtype=np.float32)
    if offsets.any():
        np.add(back, offsets[..., None], out=back)
    return np.subtract(q, low, out=q).astype(np.uint8), inside & (back == x).all(-1)


def _first_reading(x: np.ndarray, candidates: Iterable[np.ndarray], offsets: np.ndarray, low: int,
                   high: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, scales, bool [N, blocks]): per block of x, the first of the candidate scale arrays [N, blocks] under
    which `_on_grid` reads the block exactly (its codes and that scale; where none does, the first one's). Each
    candidate after the first is tried on the blocks still unread only: most blocks read at the first."""
    tried = iter(candidates)
    scales = next(tried).copy()
    codes, ok = _on_grid(x, scales, offsets, low, high)
    blocks = x.reshape(-1, x.shape[-1])  # [N * blocks, BLOCK_SIZE]; codes, scales, ok and offsets flat alike
    flat_codes, flat_scales, flat_ok, flat_offsets = (a.reshape(len(blocks), *a.shape[2:])
                                                      for a in (codes, scales, ok, offsets))
    for candidate in tried:
        left = np.flatnonzero(~flat_ok)
        if not len(left):
            break
        trial = candidate.reshape(-1)[left]
        q, fits = _on_grid(blocks[left], trial, flat_offsets[left], low, high)
        take = left[fits]  # blocks this candidate reads and the ones before did not
        flat_codes[take], flat_scales[take], flat_ok[take] = q[fits], trial[fits], True
    # the flat arrays, not codes / scales / ok: a reshape may be a copy, which the updates above would not reach
    return flat_codes.reshape(codes.shape), flat_scales.reshape(scales.shape), flat_ok.reshape(ok.shape)


def _q8_0(x: np.ndarray) -> _Fit:
    """Q8_0: w = d * q, q -128 .. 127, d float16: int8 codes q + 128 with zero point 128, exactly."""
    d = _half(np.abs(x).max(-1) / 127)  # the block's largest |w| has |q| = 127
    codes, ok = _on_grid(x, d, np.zeros_like(d), -128, 127)
    return _Fit(codes, np.where(d == 0, 1, d), np.full(d.shape, 128, np.uint8), None,
                ok.all(-1), 8)


def _centred(x: np.ndarray, code_bits: int) -> _Fit:
    """Q4_0 / Q5_0 (`code_bits` 4 / 5): w = d * (q - h), q 0 .. 2h - 1, h = 2 ** (code_bits - 1), d float16
    (negative where the block's largest |w| is positive: it has q = 0): codes q with zero point h, exactly, 4-bit
    for Q4_0 and 8-bit for Q5_0 (the products take 4 or 8 bits)."""
    h = 1 << (code_bits - 1)
    at = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]  # [N, blocks] the largest |w|, signed
    d = _half(at / -h)
    codes, ok = _on_grid(x, d, np.zeros_like(d), -h, h - 1)
    return _Fit(codes, np.where(d == 0, 1, d), np.full(d.shape, h, np.uint8), None, ok.all(-1),
                4 if code_bits == 4 else 8)


def _with_mins(x: np.ndarray, code_bits: int) -> _Fit:
    """Q4_1 / Q5_1 (`code_bits` 4 / 5): w = d * q + m, q 0 .. top = 2 ** code_bits - 1, d and m float16: codes q
    (4-bit for Q4_1, 8-bit for Q5_1) with scale d and zero point 0, and each block's m in `mins`: the graph adds
    the input's block sums times m, as llama.cpp's Q4_1 and Q5_1 products add their activation blocks' sums. (A
    float zero point -m / d would hold m too, but MatMulNBits runs those on a slow path without int8 activations:
    docs/design.md 6.9.) A block's d is float16((max - min) / top) or, where that rounds off the block's own, one
    of its float16 neighbours: the first that reads the block exactly."""
    top = (1 << code_bits) - 1
    low, high = x.min(-1), x.max(-1)  # q = 0 at the block's min (m itself) and top at its max
    d = _half((high - low) / top)
    half = d.astype(np.float16)
    neighbours = (np.nextafter(half, np.float16(np.inf)).astype(np.float32),
                  np.nextafter(half, np.float16(0)).astype(np.float32))
    codes, d, ok = _first_reading(x, (d, *neighbours), low, 0, top)
    return _Fit(codes, np.where(d == 0, 1, d), np.zeros(d.shape, np.uint8), low, ok.all(-1),
                4 if code_bits == 4 else 8)


def _significant(x: np.ndarray, bits: int) -> np.ndarray:
    """float64 values rounded to `bits` significant bits, as float32 (a K-quant block scale d * sc has 11 + 6)."""
    mantissa, exponent = np.frexp(x)
    return np.ldexp(np.round(mantissa * (1 << bits)) / (1 << bits), exponent).astype(np.float32)


def _k_quant(x: np.ndarray, code_bits: int) -> _Fit:
    """Q4_K / Q5_K (`code_bits` 4 / 5): super-blocks of 8 blocks of 32 weights along K, w = s * q - dm with
    q 0 .. top = 2 ** code_bits - 1, s = d * sc and dm = dmin * m (d, dmin float16 a super-block, sc, m 0 .. 63 a
    block): s and dm are float32 exactly, so a block is ours with scale s, zero point 0 and a min (4-bit codes for
    Q4_K, 8-bit for Q5_K). Read from the values: the min is the block's least weight (-dm at q = 0; where the
    block has no q = 0 its codes shift down by its least one, and s * q_min - dm, of two numbers of at most 17
    significant bits, is exact in float32, so the same numbers come back), s its span over the largest code, tried
    from top down and rounded to s's 17 significant bits: the first that reads the block exactly."""
    top = (1 << code_bits) - 1
    low = x.min(-1)  # [N, blocks]
    # s * (the largest code - the least), in float64: the max's difference is the differences' max (monotone rounding)
    span = x.max(-1).astype(np.float64) - low
    candidates = (_significant(span / largest, 17) for largest in range(top, 0, -1))
    codes, scales, ok = _first_reading(x, candidates, low, 0, top)
    return _Fit(codes, np.where(scales == 0, 1, scales), np.zeros(low.shape, np.uint8), low,
                ok.all(-1), 4 if code_bits == 4 else 8)


# llama.cpp's 32-weight block types, fewest bytes first (a Q4_0 block is on Q5_0's grid too)
GGUF_GRIDS: dict[str, Callable[[np.ndarray], _Fit]] = {
    "Q4_0": partial(_centred, code_bits=4),
    "Q4_1": partial(_with_mins, code_bits=4),
    "Q4_K": partial(_k_quant, code_bits=4),
    "Q5_0": partial(_centred, code_bits=5),
    "Q5_1": partial(_with_mins, code_bits=5),
    "Q5_K": partial(_k_quant, code_bits=5),
    "Q8_0": _q8_0,
}


def gguf_blocks(weight: np.ndarray, bits: int) -> QuantizedWeight | None:
    """The blocks of a float [N, K] weight whose rows are exactly GGUF tensors of GGUF_GRIDS types dequantized (a
    checkpoint converted from such a file, model/gguf_convert.py), as MatMulNBits holds them; None if its first
    row is on none of those grids (a float weight: it costs one row's checks). A fused projection's rows come from
    tensors of their own types (a Q4_K_M file's attn_q and attn_k may be Q5_0 or Q4_K, its attn_v Q8_0 or Q6_K):
    each row keeps its own, a row on no grid we hold (Q6_K's 16-weight blocks) is quantized here to `bits`, the
    codes are 8-bit where any row needs them, and the grid names every source ("Q4_K+int4"). GGUF blocks, like
    BLOCK_SIZE, hold 32 weights along K. The first row still unread picks the next type to try on the rest."""
    n, k = weight.shape
    if k % BLOCK_SIZE:
        return None
    fits: dict[str, tuple[np.ndarray, _Fit]] = {}  # source -> (the rows it reads, its reading of them)
    left = np.arange(n)
    while len(left):
        name = next((name for name, find in GGUF_GRIDS.items()
                     if name not in fits and _read_rows(find, weight, left[:1]).rows[0]), None)
        if name is None:
            break
        fit = _read_rows(GGUF_GRIDS[name], weight, left)
        fits[name], left = (left[fit.rows], fit), left[~fit.rows]
    if not fits:
        return None
    if len(left):
        fits[f"int{bits}"] = left, _read_rows(partial(_quantized_here, bits=bits), weight, left)
    codes = np.empty((n, k // BLOCK_SIZE, BLOCK_SIZE), np.uint8)
    scales, zeros = np.empty(codes.shape[:2], np.float32), np.empty(codes.shape[:2], np.uint8)
    mins = None if all(fit.mins is None for _, fit in fits.values()) else np.zeros(codes.shape[:2], np.float32)
    for rows, fit in fits.values():
        codes[rows], scales[rows], zeros[rows] = fit.codes[fit.rows], fit.scales[fit.rows], fit.zeros[fit.rows]
        if fit.mins is not None:
            mins[rows] = fit.mins[fit.rows]  # type: ignore[index]
    sources = [name for name in GGUF_GRIDS if name in fits] + [name for name in fits if name not in GGUF_GRIDS]
    return _packed(codes, scales, zeros, max(fit.bits for _, fit in fits.values()), k, "+".join(sources), mins=mins)


def weight_blocks(weight: np.ndarray, bits: int) -> QuantizedWeight:
    """A float [N, K] weight's blocks: its own GGUF blocks where it has them (`gguf_blocks`), else quantized to
    `bits`."""
    return gguf_blocks(weight, bits) or quantize_blocks(weight, bits)


def quantize_activations(x: Any) -> Any:
    """x [..., K] torch float -> what an int8-activation MatMulNBits multiplies instead: per row, blocks of
    BLOCK_SIZE along K, each round(x * 127 / amax) * amax / 127 (round half to even, as the kernels' conversion)."""
    import torch
    import torch.nn.functional as F

    k = x.shape[-1]
    blocks = F.pad(x, (0, -k % BLOCK_SIZE)).unflatten(-1, (-1, BLOCK_SIZE))  # [..., blocks, BLOCK_SIZE]
    amax = blocks.abs().amax(-1, keepdim=True)  # [..., blocks, 1]
    inverse = torch.where(amax > 0, ACTIVATION_CODE / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / ACTIVATION_CODE)).flatten(-2)[..., :k]


def check_scheme(weights: str, activations: str | None = None) -> tuple[str, str]:
    """(weights, activations) a build can make, activations None taking the default: int8 for quantized weights
    (MatMulNBits' fast kernels; its float-activation path is the slow one, docs/design.md 6.9), float for float
    weights; else UserError."""
    if weights not in WEIGHT_SCHEMES:
        raise UserError(f"unknown --weights {weights!r}; use one of {', '.join(WEIGHT_SCHEMES)}")
    activations = activations or ("float" if weights == "float" else "int8")
    if activations not in ACTIVATION_SCHEMES:
        raise UserError(f"unknown --activations {activations!r}; use one of {', '.join(ACTIVATION_SCHEMES)}")
    if activations != "float" and weights == "float":
        raise UserError(f"--activations {activations} multiplies quantized weights: add --weights int8 or int4")
    return weights, activations


def quantize_model(model: Any, scheme: str, dtype: Any = None, deferred: Mapping[str, Callable[[], Any]] | None = None
                   ) -> dict[str, QuantizedWeight]:
    """Replace every bias-free projection of a torch `Llama` (model/llama.py), the lm_head included (the Gemms
    `quantize_graph` takes), by a QuantizedLinear holding its weight's own GGUF blocks where it has them
    (`gguf_blocks`), else the weight quantized as `scheme`; then cast the float parameters left (embeddings, norms)
    to `dtype` (None: as they are). Quantize a float32 model: a GGUF grid survives no lower precision. `deferred`:
    the readers of the weights a `load_llama_deferred` model has not read (each read here, one at a time).
    -> {the projection's name: its blocks}."""
    from trt_lookahead.model.llama import Linear

    bits = BITS[scheme]
    used: dict[str, QuantizedWeight] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear) or module.bias is not None:
            continue
        read = (deferred or {}).get(f"{name}.weight")
        weight = module.dense_weight() if read is None else read()
        blocks = used[name] = weight_blocks(weight.float().cpu().numpy(), bits)
        model.set_submodule(name, quantized_linear(blocks, model.device))
        del weight
    if not used:
        raise UserError(f"--weights {scheme}: the model has no bias-free projection to quantize")
    if dtype is not None:
        for param in model.parameters():  # QuantizedLinear holds buffers: its float32 scales stay float32
            param.data = param.data.to(dtype)
    return used


def quantized_linear(blocks: QuantizedWeight, device: Any = None) -> Any:
    """A model/llama.py QuantizedLinear holding `blocks` (on the CPU, the very arrays: no copy)."""
    import torch

    from trt_lookahead.model.llama import QuantizedLinear

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    return QuantizedLinear(tensor(blocks.codes.reshape(len(blocks.codes), -1)), tensor(blocks.scales),
                           tensor(blocks.zero_points), None if blocks.mins is None else tensor(blocks.mins),
                           blocks.bits, blocks.k)


class BlockNames(NamedTuple):
    """The initializers `quantize_graph` holds a weight's blocks in (`BlockNames.of(the weight's name, bits)`): its
    codes, scales and zero points (a Q4_1-like weight's mins: `MinsTerm.of(codes).mins`)."""

    codes: str
    scales: str
    zero_points: str

    @classmethod
    def of(cls, weight: str, bits: int) -> BlockNames:
        codes = f"{weight}.q{bits}"
        return cls(codes, f"{codes}.scales", f"{codes}.zero_points")


class MinsTerm(NamedTuple):
    """The names of a Q4_1 product's mins term in the graph `quantize_graph` writes (`MinsTerm.of(codes)`, the
    codes' initializer name): MatMulNBits -> product; Reshape(x, block_shape) -> x_blocks; ReduceSum(x_blocks,
    sum_axis) -> x_sums; MatMul(x_sums, mins) -> offsets; Add(product, offsets) -> the projection's output."""

    product: str
    mins: str
    block_shape: str
    sum_axis: str
    x_blocks: str
    x_sums: str
    offsets: str

    @classmethod
    def of(cls, codes: str) -> MinsTerm:
        return cls(*(f"{codes}.{part}" for part in cls._fields))


def quantize_graph(proto: Any, scheme: str, activations: str = "float", weights: Weights | None = None,
                   on_blocks: Callable[[str, QuantizedWeight], None] | None = None
                   ) -> tuple[Any, dict[str, QuantizedWeight]]:
    """Replace every projection Gemm(x, W, transB=1) whose W is a float initializer by a MatMulNBits node holding W
    in blocks, multiplying float or int8 `activations` (see the module docstring): W's own GGUF blocks where it has
    them (`gguf_blocks`), else W quantized as `scheme` (int8 or int4). -> (the graph, {W's name: its blocks}).

    `weights`: the graph's held initializers (export_graph's), the blocks' arrays held there too, and a float W let go
    of as soon as its blocks are made; None: the graph holds every tensor itself. `on_blocks(W's name, its blocks)`
    is called right then (a build lets go of its own float W there: one float weight at a time is in excess). A W
    that other nodes also read (a tied embedding's lookup) keeps its float initializer for them.
    """
    import onnx
    from onnx import helper, numpy_helper

    def initializer(array: np.ndarray, name: str) -> Any:
        return numpy_helper.from_array(array, name) if weights is None else held_initializer(name, array, weights)

    bits = BITS[scheme]
    accuracy: dict[str, Any] = {"accuracy_level": ACCURACY_LEVEL[activations]} if activations in ACCURACY_LEVEL else {}
    graph = proto.graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    used: dict[str, QuantizedWeight] = {}
    nodes = []
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        weight = initializers.get(node.input[1]) if node.op_type == "Gemm" and len(node.input) == 2 else None
        if (weight is None or attrs.get("transB") != 1 or attrs.get("transA", 0) != 0 or attrs.get("alpha", 1.0) != 1.0
                or weight.data_type != onnx.TensorProto.FLOAT or len(weight.dims) != 2):
            nodes.append(node)
            continue
        name = weight.name
        blocks = weight_blocks(initializer_array(weight, weights or {}), bits)
        n, k, held = blocks.scales.shape[0], blocks.k, BlockNames.of(name, blocks.bits)
        graph.initializer.extend([
            initializer(blocks.codes, held.codes),
            initializer(blocks.scales.reshape(-1), held.scales),
            initializer(blocks.zero_points.reshape(-1), held.zero_points),
        ])
        term = MinsTerm.of(held.codes)
        product = list(node.output) if blocks.mins is None else [term.product]
        nodes.append(helper.make_node(
            "MatMulNBits", [node.input[0], *held], product, name=node.name,
            domain=CONTRIB_DOMAIN, K=k, N=n, bits=blocks.bits, block_size=BLOCK_SIZE, **accuracy,
        ))
        if blocks.mins is not None:  # + x's block sums [M, K/32] @ mins^T [K/32, N]
            graph.initializer.extend([
                initializer(np.ascontiguousarray(blocks.mins.T), term.mins),
                numpy_helper.from_array(np.array([0, -1, BLOCK_SIZE], np.int64), term.block_shape),
                numpy_helper.from_array(np.array([2], np.int64), term.sum_axis),
            ])
            nodes.extend([
                helper.make_node("Reshape", [node.input[0], term.block_shape], [term.x_blocks]),
                helper.make_node("ReduceSum", [term.x_blocks, term.sum_axis], [term.x_sums], keepdims=0),
                helper.make_node("MatMul", [term.x_sums, term.mins], [term.offsets]),
                helper.make_node("Add", [term.product, term.offsets], list(node.output)),
            ])
        used[name] = blocks
        readers[name] -= 1
        if readers[name] == 0 and weights is not None:
            weights.pop(name, None)  # (a weight under INLINE_BYTES was never held)
        if on_blocks is not None:
            on_blocks(name, blocks)
    if not used:
        raise UserError(f"--weights {scheme}: the graph has no projection (Gemm on a float32 weight) to quantize")
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [tensor for tensor in graph.initializer if readers.get(tensor.name, 1) > 0]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    if not any(op.domain == CONTRIB_DOMAIN for op in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))
    return proto, used


NATIVE_PRODUCT = "QuantizedMatMul"  # kernels/onnxruntime_quantized.c's node (its name there, written once more in C)


def native_products(proto: Any) -> tuple[Any, int]:
    """Each MatMulNBits of `quantize_graph` that multiplies int8 activations (accuracy_level 4) by 4- or 8-bit codes
    -> one QuantizedMatMul node of kernels/onnxruntime_quantized.c on the same initializers, its mins term (MinsTerm)
    folded in: one node per product, row-invariant at every row count (docs/design.md 6.9).
    -> (the graph, the MatMulNBits nodes left: float activations, which the kernel does not take)."""
    from onnx import helper

    from trt_lookahead.kernels.onnx_op import NATIVE_DOMAIN, replace_nodes

    graph = proto.graph
    nodes = list(graph.node)
    producers = {output: i for i, node in enumerate(nodes) for output in node.output}
    readers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for name in node.input:
            readers.setdefault(name, []).append(i)
    dropped: set[int] = set()  # the mins terms' nodes (indices), replaced with their product
    unused: set[str] = set()  # the initializers only those nodes read
    replaced: dict[int, list[Any]] = {}
    left = 0
    for i, node in enumerate(nodes):
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("accuracy_level") != ACCURACY_LEVEL["int8"] or attrs["bits"] not in BITS.values():
            left += 1
            continue
        term = MinsTerm.of(node.input[1])
        output, mins = list(node.output), ""
        if node.output[0] == term.product:  # the mins term: the Add of the product and the offsets is the output
            (add,) = readers[term.offsets]
            output, mins = list(nodes[add].output), term.mins
            dropped.update([producers[term.x_blocks], producers[term.x_sums], producers[term.offsets], add])
            unused.update((term.block_shape, term.sum_axis))
        replaced[i] = [helper.make_node(
            NATIVE_PRODUCT, [*node.input[:4], mins], output, name=node.name, domain=NATIVE_DOMAIN,
            K=attrs["K"], N=attrs["N"], bits=attrs["bits"], mins=int(bool(mins)))]
    replace_nodes(proto, nodes, replaced, dropped)
    kept = [tensor for tensor in graph.initializer if tensor.name not in unused]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return proto, left
