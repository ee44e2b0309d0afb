"""kernels/invariant.py and kernels/padded_attention.py's exact mode: each op gives a row the same bits whatever
else the call holds, and computes what the model's op computes. Compiled on a GPU; interpreted (TRITON_INTERPRET=1,
tests/conftest.py) without one.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from trt_lookahead.backends.devices import gpu_count
from trt_lookahead.engine.quantize import quantize_blocks
from trt_lookahead.kernels import invariant, padded_attention, reference
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.model.llama import RMSNorm

DTYPES = pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)],
                                 ids=["float32", "bfloat16"])
DEVICE = "cuda" if gpu_count() else "cpu"


def randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@DTYPES
@pytest.mark.parametrize("span", [None, 128], ids=["whole", "spans"])
def test_linear_gives_a_row_the_same_bits_for_every_m(dtype, tolerance, span, interpreted_float32_dot):
    """The input dim reduced in one chain, or in spans of 128 (200 = 128 + 72) whose sums are added in order."""
    interpreted_float32_dot(dtype)
    x, w, b = randn(130, 200, dtype=dtype), randn(72, 200, dtype=dtype, seed=1), randn(72, dtype=dtype, seed=2)
    expected = torch.nn.functional.linear(x.double(), w.double(), b.double())
    full = invariant.linear(x, w, b, span=span)
    assert full.dtype == dtype and reference.relative_error(full.cpu(), expected.cpu()) <= tolerance
    for M in (1, 2, 3, 17, 33, 64):
        part = invariant.linear(x[:M], w, b, span=span)
        for r in {0, M // 2, M - 1}:
            alone = invariant.linear(x[r : r + 1], w, b, span=span)[0]
            assert torch.equal(part[r], alone) and torch.equal(full[r], alone), (M, r)


def test_linear_tile_grows_with_m_while_half_the_sms_get_a_program():
    """Hand-derived from the rule, at the 1B model's projection widths on a 132-SM GPU."""
    assert invariant.linear_tile(1, 2048, 132) == (16, 32, 128, 4)  # 64-wide: 32 programs < 66
    assert invariant.linear_tile(1, 128256, 132) == (16, 64, 128, 4)  # 2004 programs
    assert invariant.linear_tile(32, 16384, 132) == (16, 64, 128, 4)  # 64-row tiles start above 32 rows
    assert invariant.linear_tile(56, 16384, 132) == (64, 128, 64, 4)  # 128 programs
    assert invariant.linear_tile(64, 128256, 132) == (64, 128, 64, 4)  # 128-row tiles start above 64 rows
    assert invariant.linear_tile(120, 128256, 132) == (128, 256, 64, 8)  # 501 programs
    assert invariant.linear_tile(120, 16384, 132) == (128, 128, 64, 8)  # 128 x 256: 64 programs < 66
    assert invariant.linear_tile(960, 2048, 132) == (128, 128, 64, 8)  # 128 x 256: 64, 128 x 128: 128
    assert invariant.linear_tile(960, 2048, 264) == (64, 128, 64, 4)  # twice the SMs: 240 programs
    assert invariant.linear_tile(1, 8, 132) == invariant.LINEAR_TILES[-1]


@pytest.mark.skipif(DEVICE == "cpu", reason="interpreted tl.dot is numpy's matmul, whose bits follow the tile shape")
@DTYPES
def test_every_linear_tile_gives_the_same_bits(dtype, tolerance):
    """linear_tile may pick any tile for any M only because each gives an output element the same bits."""
    x, w, b = randn(130, 200, dtype=dtype), randn(72, 200, dtype=dtype, seed=1), randn(72, dtype=dtype, seed=2)
    for span in (None, 128):
        first, *others = (invariant.linear(x, w, b, tile=tile, span=span) for tile in invariant.LINEAR_TILES)
        assert reference.relative_error(
            first.cpu(), torch.nn.functional.linear(x.double(), w.double(), b.double()).cpu()) <= tolerance
        for tile, other in zip(invariant.LINEAR_TILES[1:], others, strict=True):
            assert torch.equal(other, first), (tile, span)


def test_linear_span_splits_only_products_too_narrow_to_fill_the_gpu_at_one_row():
    """Hand-derived from the rule on a 132-SM GPU (66 programs wanted; 1 row's narrowest tile is 32 wide)."""
    assert invariant.linear_span(2048, 8192, 132) == 2048  # the 1B down projection: 64 programs, 4 spans
    assert invariant.linear_span(2048, 2048, 132) is None  # 64 programs, but K is one span
    assert invariant.linear_span(3072, 8192, 132) is None  # 96 programs
    assert invariant.linear_span(4096, 11008, 264) == 2048  # the 7B down projection on twice the SMs


@DTYPES
def test_rms_norm_gives_a_row_the_same_bits_in_any_call_and_matches_the_module(dtype, tolerance):
    norm = RMSNorm(200, 1e-5, dtype).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(randn(200, dtype=dtype, seed=3).abs() + 0.5)
    x = randn(40, 200, dtype=dtype)
    full = invariant.rms_norm(x, norm.weight, norm.eps)
    assert reference.relative_error(full.cpu(), norm(x).detach().cpu()) <= tolerance
    for r in (0, 7, 39):
        assert torch.equal(invariant.rms_norm(x[r : r + 1], norm.weight, norm.eps)[0], full[r])


def blocks_as_tensors(blocks) -> tuple[torch.Tensor, ...]:
    """engine/quantize.py's QuantizedWeight as the kernel's tensors: (codes, scales, zero points, mins) on DEVICE."""
    arrays = (blocks.codes.reshape(len(blocks.codes), -1), blocks.scales, blocks.zero_points, blocks.mins)
    return tuple(None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE) for a in arrays)


def test_quantized_linear_dequantizes_a_block_by_hand():
    """engine/quantize.py's worked example, one block [-1.0, 0.6, 2.0, 0.3, 0, ...]: s 0.2, z 5, codes 0, 8, 15, 7,
    5, ..., so w = -1.0, 0.6, 2.0, 0.4 (1.5 rounds to even), 0; x = the identity reads w back column by column."""
    weight = np.zeros((2, 32), np.float32)
    weight[0, :4] = [-1.0, 0.6, 2.0, 0.3]
    weight[1] = 1.0  # a block without negatives: its range starts at 0, so z = 0 and s = 1 / 15
    codes, scales, zeros, _ = blocks_as_tensors(quantize_blocks(weight, 4))
    y = invariant.quantized_linear(torch.eye(32, device=DEVICE), codes, scales, zeros, None, 4).cpu()  # [32, 2]
    np.testing.assert_allclose(y[:5, 0], [-1.0, 0.6, 2.0, 0.4, 0.0], atol=1e-6)
    np.testing.assert_allclose(y[:, 1], np.ones(32), atol=1e-6)


def quantized_case(bits: int, with_mins: bool, outputs: int = 72) -> tuple[tuple[torch.Tensor | None, ...],
                                                                          torch.Tensor]:
    """K = 520: sixteen whole blocks and a padded seventeenth (an odd count: the int4 zero points' last byte is
    half used); mins: a GGUF Q4_1 or Q5_1 block's m added to (q - z) * s. ((codes, scales, zeros, mins) on DEVICE, the
    dequantized float32 weight [outputs, 520] on DEVICE)."""
    rng = np.random.default_rng(bits)
    blocks = quantize_blocks(rng.standard_normal((outputs, 520)).astype(np.float32), bits)
    if with_mins:
        blocks = dataclasses.replace(blocks, mins=rng.standard_normal(blocks.scales.shape).astype(np.float32))
    return blocks_as_tensors(blocks), torch.from_numpy(blocks.dequantize()).to(DEVICE)


QUANTIZED_CASES = pytest.mark.parametrize("bits,with_mins", [(4, False), (8, False), (4, True), (8, True)],
                                          ids=["int4", "int8", "int4-mins", "int8-mins"])


@DTYPES
@QUANTIZED_CASES
@pytest.mark.parametrize("span", [None, 256], ids=["whole", "spans"])
def test_quantized_linear_is_linear_by_the_dequantized_weight_with_a_rows_bits_whatever_m(
        dtype, tolerance, bits, with_mins, span, interpreted_float32_dot):
    """The product by the weight dequantized (QuantizedWeight.dequantize), and a row's bits whatever M. Not the
    bits of `linear` by that weight: the 4-bit product takes the input dims in another order and rounds each
    block's constant once, a GPU may fuse (q - z) * s + m into one rounding, and a dot of weights made in
    registers may take other tensor-core instructions than one of loaded weights (seen on an H200)."""
    (codes, scales, zeros, mins), dense = quantized_case(bits, with_mins)
    x = randn(130, 520, dtype=dtype)
    full = invariant.quantized_linear(x, codes, scales, zeros, mins, bits, span=span)
    assert full.dtype == dtype
    expected = x.double() @ dense.double().t()
    assert reference.relative_error(full.cpu(), expected.cpu()) <= tolerance
    interpreted_float32_dot(dtype)
    for M in (1, 3, 33):
        part = invariant.quantized_linear(x[:M], codes, scales, zeros, mins, bits, span=span)
        alone = invariant.quantized_linear(x[M - 1 : M], codes, scales, zeros, mins, bits, span=span)[0]
        assert torch.equal(part[M - 1], alone) and torch.equal(full[M - 1], alone), M


@pytest.mark.skipif(DEVICE == "cpu", reason="interpreted, every product runs one tile whatever M")
@DTYPES
@QUANTIZED_CASES
def test_a_quantized_products_rows_keep_their_bits_where_linears_tile_would_grow(dtype, tolerance, bits, with_mins):
    """4096 outputs: from 33 rows on, linear_tile would take 64- and 128-row tiles, whose bfloat16 dot of weights
    made in registers gave an element other bits on an H200; the quantized product keeps QUANTIZED_TILES'."""
    (codes, scales, zeros, mins), _ = quantized_case(bits, with_mins, outputs=4096)
    x = randn(130, 520, dtype=dtype)
    full = invariant.quantized_linear(x, codes, scales, zeros, mins, bits)
    for M in (1, 33, 65, 129):
        alone = invariant.quantized_linear(x[M - 1 : M], codes, scales, zeros, mins, bits)[0]
        part = invariant.quantized_linear(x[:M], codes, scales, zeros, mins, bits)
        assert torch.equal(part[M - 1], alone) and torch.equal(full[M - 1], alone), M


def test_a_quantized_product_splits_its_reduction_by_k_alone():
    """quantized_span: whole until K holds two spans; the 7B shapes' K of 4096 and 11008 split."""
    assert invariant.quantized_span(200) is None and invariant.quantized_span(2047) is None
    assert invariant.quantized_span(2048) == invariant.quantized_span(11008) == 1024


def test_quantized_linear_refuses_a_tile_that_splits_a_block():
    codes, scales, zeros, _ = blocks_as_tensors(quantize_blocks(np.ones((4, 64), np.float32), 4))
    x = torch.ones(1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="whole blocks of 32"):
        invariant.quantized_linear(x, codes, scales, zeros, None, 4, tile=(16, 32, 16, 4))


QUANTIZED_COMPILE_PROBE = """
import json
import triton
from triton.backends.compiler import GPUTarget
from trt_lookahead.kernels import invariant
pointers = {"x_ptr": "*{x}", "w_ptr": "*i32", "y_ptr": "*{x}", "s_ptr": "*fp32", "z_ptr": "*u8", "m_ptr": "*fp32"}
ints = ("M", "N", "K", "SPAN_STEPS", "stride_xm", "stride_wn", "stride_ym", "stride_s", "stride_z")
report = []
for x, bits, mins in (("bf16", 4, True), ("bf16", 8, False), ("fp32", 4, False)):
    BM, BN, BK, warps = invariant.QUANTIZED_TILES[bits]
    for split in (False, True):
        consts = dict(SPLIT=split, UPCAST_DOT=False, QBITS=bits, QBLOCK=32, HAS_MINS=mins, BLOCK_M=BM, BLOCK_N=BN,
                      BLOCK_K=BK)
        signature = {**{k: v.format(x=x) for k, v in pointers.items()}, **dict.fromkeys(ints, "i32"),
                     **dict.fromkeys(consts, "constexpr")}
        source = triton.compiler.ASTSource(fn=invariant._quantized_kernel, signature=signature, constexprs=consts)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        report.append({"case": [x, bits, mins, split], "cubin": len(compiled.asm["cubin"]),
                       "shared": compiled.metadata.shared})
print(json.dumps(report))
"""


@pytest.mark.slow  # compiles in a fresh interpreter (seconds)
def test_quantized_linear_compiles_for_a_hopper_gpu():
    """The quantized product's kernel (int4 with Q4_1 mins, int8; bfloat16 and float32 activations; QUANTIZED_TILES,
    one span or several) compiles to a cubin for sm_90 (H100, H200) with Triton's bundled ptxas: no GPU needed,
    so a kernel that cannot compile fails here, not on a lent GPU. In a subprocess: this session interprets."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", QUANTIZED_COMPILE_PROBE], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report) == 6 and all(r["cubin"] > 0 and r["shared"] <= 228 * 1024 for r in report), report


def padded_step(configs: list[tuple[LookaheadConfig, int]], T: int, S: int):
    """mask [B, T, S] over each slot's rows and positions [B, T] of a padded step of (config, cache_len) rows."""
    mask = np.zeros((len(configs), T, S), bool)
    positions = np.zeros((len(configs), T), np.int64)
    for b, (config, cache_len) in enumerate(configs):
        layout = StepLayout(config, padded_tokens=T)
        mask[b, :, :cache_len] = True
        mask[b, :, cache_len : cache_len + T] = layout.mask
        positions[b] = cache_len + layout.rel_positions
    return torch.from_numpy(mask).to(DEVICE), torch.from_numpy(positions).to(DEVICE)


def test_key_rows_lays_each_querys_keys_at_their_positions():
    configs = [(LookaheadConfig(4, 3, 4), 37), (LookaheadConfig(2, 4, 1), 0)]
    T, S = 16, 60
    mask, positions = padded_step(configs, T, S)
    cache_len = torch.tensor([c for _, c in configs], device=DEVICE)
    table = padded_attention.key_rows(mask, cache_len, positions).cpu().numpy()
    m, pos = mask.cpu().numpy(), positions.cpu().numpy()
    for b, (_, p) in enumerate(configs):
        for t in range(T):
            want = np.full(S, -1)
            want[:p] = np.arange(p)
            for j in np.flatnonzero(m[b, t, p : p + T]):
                want[pos[b, j]] = p + j
            assert np.array_equal(table[b, t], want), (b, t)


@DTYPES
def test_padded_attention_is_attention_over_the_keys_each_query_sees(dtype, tolerance):
    configs = [(LookaheadConfig(4, 3, 4), 45), (LookaheadConfig(7, 2, 1), 3), (LookaheadConfig(1, 2, 0), 70)]
    T, S, Hq, Hkv, D = 16, 90, 4, 2, 16
    mask, positions = padded_step(configs, T, S)
    cache_len = torch.tensor([c for _, c in configs], device=DEVICE)
    q = randn(len(configs) * T, Hq, D, dtype=dtype)
    k, v = randn(len(configs) * S, Hkv, D, dtype=dtype, seed=1), randn(len(configs) * S, Hkv, D, dtype=dtype, seed=2)
    qb = q.double().cpu().view(len(configs), T, Hq, D).transpose(1, 2)
    kb, vb = (t.double().cpu().view(len(configs), S, Hkv, D).transpose(1, 2).repeat_interleave(Hq // Hkv, 1)
              for t in (k, v))
    want = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask.cpu()[:, None])
    want = want.transpose(1, 2).reshape(q.shape)
    table = padded_attention.key_rows(mask, cache_len, positions)
    for chunk in (128, 32):  # one program per slot's positions; one per 32 of them, merged in order
        out = padded_attention.padded_attention(q, k, v, table, cache_len, chunk=chunk).cpu()
        assert reference.relative_error(out, want) <= tolerance, chunk


@DTYPES
@pytest.mark.parametrize("Hq,Hkv,chunk", [(4, 1, 64), (6, 2, 128), (2, 2, 32)], ids=["gqa4", "gqa3-whole", "mha"])
def test_padded_attention_gives_a_query_the_bits_of_plain_decoding(dtype, tolerance, Hq, Hkv, chunk,
                                                                interpreted_float32_dot):
    """Each query of a batched lookahead step against the same query alone, its keys laid out as plain decoding
    lays them (row p holds position p: one key tile serves every row), so the step's tiles of other queries,
    its own per-query key tiles and the grouped heads sharing a tile must all leave its bits alone."""
    interpreted_float32_dot(dtype)
    configs = [(LookaheadConfig(4, 3, 4), 29), (LookaheadConfig(2, 4, 1), 62), (LookaheadConfig(1, 2, 0), 5)]
    T, S, D = 16, 100, 16
    mask, positions = padded_step(configs, T, S)
    cache_len = torch.tensor([c for _, c in configs], device=DEVICE)
    q = randn(len(configs) * T, Hq, D, dtype=dtype)
    k, v = randn(len(configs) * S, Hkv, D, dtype=dtype, seed=1), randn(len(configs) * S, Hkv, D, dtype=dtype, seed=2)
    table = padded_attention.key_rows(mask, cache_len, positions)
    out = padded_attention.padded_attention(q, k, v, table, cache_len, chunk=chunk)
    for b, (config, _) in enumerate(configs):
        for t in range(StepLayout(config).step_tokens):
            seen = table[b, t].cpu()
            keys = torch.nonzero(seen >= 0).flatten()  # the positions it sees: 0 .. its own
            assert torch.equal(keys, torch.arange(len(keys))), (b, t)
            rows = b * S + seen[keys].to(DEVICE)
            plain = torch.arange(len(keys), dtype=torch.int32, device=DEVICE)  # cached keys, then its own
            alone = padded_attention.padded_attention(q[b * T + t : b * T + t + 1], k[rows], v[rows], plain[None, None],
                                               torch.tensor([len(keys) - 1], device=DEVICE), chunk=chunk)
            assert torch.equal(alone[0], out[b * T + t]), (b, t)
