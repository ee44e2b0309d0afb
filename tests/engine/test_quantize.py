"""Weight-only int8 / int4 engines: block quantization against hand-computed blocks, the graph pass under real
onnxruntime, and quantized stories260K engines whose lookahead output equals their own greedy output."""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from onnx import TensorProto, helper, numpy_helper

from trt_lookahead.backends.open import open_engine
from trt_lookahead.cli import main
from trt_lookahead.engine import quantize
from trt_lookahead.engine.build import map_saved_blocks, quantize_like_graph
from trt_lookahead.engine.export import export_graph
from trt_lookahead.engine.format import write_engine_config
from trt_lookahead.engine.initializers import is_held, save_graph
from trt_lookahead.engine.quantize import (
    BITS,
    BLOCK_SIZE,
    BLOCKS_REVISION,
    BlockNames,
    MinsTerm,
    gguf_blocks,
    quantize_activations,
    quantize_blocks,
    quantize_graph,
    quantize_model,
    quantized_linear,
)
from trt_lookahead.errors import UserError
from trt_lookahead.model.checkpoint import load_llama, load_llama_deferred
from trt_lookahead.model.llama import DEQUANTIZED_WEIGHTS, Linear, QuantizedLinear
from trt_lookahead.runtime import LookaheadRuntime
from trt_lookahead.serving.openai_api import OpenAIServer

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
BLOCK = np.zeros(BLOCK_SIZE, np.float32)
BLOCK[:4] = [-1.0, 0.6, 2.0, 0.3]  # the module docstring's worked example


def test_an_int4_block_by_hand():
    q = quantize_blocks(BLOCK[None, :], bits=4)
    assert q.scales.shape == (1, 1) and q.scales[0, 0] == pytest.approx(0.2)
    assert q.zero_points.tolist() == [[5]]  # one block: its zero point in the low nibble of one byte
    # codes 0, 8, 15, 7, then 5 (zero) for the rest; two per byte, low nibble first
    assert q.codes[0, 0, :3].tolist() == [0 | 8 << 4, 15 | 7 << 4, 5 | 5 << 4]
    expected = BLOCK.copy()
    expected[3] = 0.4  # 0.3 / 0.2 = 1.5 rounds to even: code 7, (7 - 5) * 0.2
    np.testing.assert_allclose(q.dequantize(), expected[None, :], atol=1e-6)


def test_an_int8_block_by_hand():
    q = quantize_blocks(BLOCK[None, :], bits=8)
    assert q.scales[0, 0] == pytest.approx(3 / 255) and q.zero_points.tolist() == [[85]]
    assert q.codes[0, 0, :4].tolist() == [0, 136, 255, 111]  # round(x * 85) + 85
    np.testing.assert_allclose(q.dequantize()[0, :4], [-1.0, 0.6, 2.0, 26 * 3 / 255], atol=1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_every_weight_is_within_half_a_step_and_the_padding_is_dropped(bits):
    w = np.random.default_rng(bits).standard_normal((6, 40)).astype(np.float32)  # 40: a full block and 8 more
    q = quantize_blocks(w, bits)
    assert q.scales.shape == (6, 2) and q.dequantize().shape == (6, 40)
    step = np.repeat(q.scales, BLOCK_SIZE, axis=1)[:, :40]
    assert np.all(np.abs(q.dequantize() - w) <= step / 2 + 1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_weight_quantized_in_chunks_of_rows_is_the_weight_quantized_at_once(bits, monkeypatch):
    """quantize_blocks works CHUNK_WEIGHTS at a time (its transients stay a chunk's): rows are independent, so chunks
    of 3 rows (the last one short) give the very blocks of one pass, and every row is checked as above."""
    w = np.random.default_rng(bits).standard_normal((50, 200)).astype(np.float32)
    whole = quantize_blocks(w, bits)
    monkeypatch.setattr(quantize, "CHUNK_WEIGHTS", 3 * 224)  # K 200 padded to 7 blocks of 32: 3 rows a chunk
    chunked = quantize_blocks(w, bits)
    for part in ("codes", "scales", "zero_points"):
        assert np.array_equal(getattr(chunked, part), getattr(whole, part)), part
    step = np.repeat(chunked.scales, BLOCK_SIZE, axis=1)[:, :200]
    assert np.all(np.abs(chunked.dequantize() - w) <= step / 2 + 1e-6)


def test_int8_activation_blocks_by_hand():
    x = np.zeros((2, 40), np.float32)  # two rows, blocks of 32 and 8 (padded)
    x[0, :3] = [1.0, -0.5, 0.25]  # amax 1: codes 127, -63.5 -> -64 (half to even), 31.75 -> 32
    x[0, 32:34] = [0.0, -2.0]  # the second block's own scale: amax 2, -2.0 -> -127
    x[1, 5] = 3.0  # another row: its own blocks
    got = quantize_activations(torch.from_numpy(x)).numpy()
    want = np.zeros_like(x)
    want[0, :3] = np.array([127, -64, 32]) / 127
    want[0, 33] = -2.0
    want[1, 5] = 3.0
    np.testing.assert_allclose(got, want, rtol=1e-6)


def matmul_nbits(blocks, accuracy_level: int):
    """A one-node graph: MatMulNBits over `blocks` (QuantizedWeight) at `accuracy_level`."""
    n, k = blocks.scales.shape[0], blocks.k
    node = helper.make_node("MatMulNBits", ["x", "B", "S", "Z"], ["y"], domain="com.microsoft", K=k, N=n,
                            bits=blocks.bits, block_size=BLOCK_SIZE, accuracy_level=accuracy_level)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
        [numpy_helper.from_array(blocks.codes, "B"), numpy_helper.from_array(blocks.scales.reshape(-1), "S"),
         numpy_helper.from_array(blocks.zero_points.reshape(-1), "Z")])
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("bits", [8, 4])
def test_onnxruntime_int8_activations_multiply_what_quantize_activations_gives(bits):
    """The smoke check's torch reference for int8 activations: onnxruntime's accuracy_level 4 products equal
    quantize_activations(x) @ w_hat.T to float rounding, and are far from the float activations' product."""
    rng = np.random.default_rng(bits)
    blocks = quantize_blocks(rng.standard_normal((48, 200)).astype(np.float32) * 0.05, bits)
    x = (rng.standard_normal((5, 200)) * np.exp(rng.standard_normal((5, 200)))).astype(np.float32)
    w = blocks.dequantize().astype(np.float64)
    y = matmul_nbits(blocks, accuracy_level=4).run(None, {"x": x})[0]
    emulated = quantize_activations(torch.from_numpy(x)).numpy().astype(np.float64) @ w.T
    assert np.abs(y - emulated).max() < 1e-4 < np.abs(y - x.astype(np.float64) @ w.T).max()


# -- a checkpoint converted from GGUF blocks keeps them -------------------------------------------------------------


def gguf_roundtrip(x: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(x quantized by the gguf package as `kind` and dequantized, as gguf_convert stores it; the raw blocks)."""
    qtype = GGMLQuantizationType[kind]
    raw = gguf_quants.quantize(x, qtype)
    return np.asarray(gguf_quants.dequantize(raw, qtype), np.float32), raw


def gguf_codes(raw: np.ndarray, kind: str) -> np.ndarray:
    """The unsigned codes of the GGUF blocks `raw` [N, bytes] of 32 weights each, read by hand from llama.cpp's
    layouts: Q8_0 [d, 32 int8] (+ 128); Q4_x [d (, m), 16 bytes: weights j and j + 16 in the low and high nibble of
    byte j]; Q5_x [d (, m), 4 bytes of fifth bits (weight i's in bit i, little-endian), then Q4_x's 16 bytes]."""
    blocks = raw.reshape(len(raw), -1, {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}[kind])
    if kind == "Q8_0":
        return blocks[..., 2:].view(np.int8).astype(np.int32) + 128
    packed = blocks[..., -16:]
    codes = np.concatenate([packed & 0xF, packed >> 4], -1).astype(np.int32)
    if kind.startswith("Q5"):
        fifth = np.unpackbits(blocks[..., -20:-16], axis=-1, bitorder="little").astype(np.int32)  # [.., 32]
        codes += fifth << 4
    return codes


@pytest.mark.parametrize(("kind", "bits"), [("Q4_0", 4), ("Q4_1", 4), ("Q5_0", 8), ("Q5_1", 8), ("Q8_0", 8)])
def test_a_gguf_dequantized_weight_keeps_its_own_blocks(kind, bits):
    """Q5 codes (0 .. 31) ride in 8-bit blocks: the products take 4 or 8 bits."""
    rng = np.random.default_rng(bits)
    x = rng.standard_normal((24, 96)).astype(np.float32) * np.exp(rng.standard_normal((24, 1))).astype(np.float32)
    w, raw = gguf_roundtrip(x, kind)
    blocks = gguf_blocks(w, 4)
    assert blocks is not None and (blocks.grid, blocks.bits) == (kind, bits)
    np.testing.assert_array_equal(blocks.dequantize(), w)  # (q - z) * s (+ m): the gguf package's numbers
    codes, zeros = blocks.unpacked()
    np.testing.assert_array_equal(codes.astype(np.int32), gguf_codes(raw, kind))  # the GGUF's own codes
    assert (zeros == {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128}.get(kind, 0)).all()
    assert (blocks.mins is not None) == kind.endswith("_1")
    # requantizing the same numbers instead moves them by up to half a step
    assert np.abs(quantize_blocks(w, bits).dequantize() - w).max() > 1e3 * np.abs(blocks.dequantize() - w).max()


def k_quant_blocks(rng: np.random.Generator, rows: int, k: int, code_bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw Q4_K / Q5_K super-blocks [rows, k / 256 * bytes] packed by hand as llama.cpp lays them out, their codes
    [rows, k / 32, 32]): d, dmin float16; 12 bytes of 6-bit sc and m (blocks 0-3 in the low 6 bits of bytes 0-3 and
    4-7, blocks 4-7 in the nibbles of bytes 8-11 and the top 2 bits of bytes 0-7); Q5_K: 32 bytes of fifth bits
    (block j's element i in bit j of byte i); 128 bytes of nibbles (blocks 2p and 2p + 1 in the low and high nibble
    of bytes 32p .. 32p + 31). As llama.cpp's quantizer, each super-block has a block of sc 63 and one of m 63; one
    block in 8 has no q = 0 (its min is then not -dm) and one in 3 no q = top."""
    top, supers = (1 << code_bits) - 1, rows * k // 256
    d = (rng.uniform(1e-4, 1e-3, supers)).astype(np.float16)
    dmin = (rng.uniform(1e-4, 1e-3, supers)).astype(np.float16)
    sc, m = rng.integers(1, 64, (supers, 8)), rng.integers(0, 64, (supers, 8))
    sc[:, 3], m[:, 5] = 63, 63
    q = rng.integers(0, top + 1, (supers, 8, 32))
    q[:, ::8] = np.maximum(q[:, ::8], 1)  # no q = 0
    q[:, 1::3] = np.minimum(q[:, 1::3], top - 1)  # no q = top
    scales = np.zeros((supers, 12), np.uint8)
    scales[:, :4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    low = (q & 15).reshape(supers, 4, 2, 32)
    nibbles = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(supers, 128).astype(np.uint8)
    parts = [d.view(np.uint8).reshape(supers, 2), dmin.view(np.uint8).reshape(supers, 2), scales]
    if code_bits == 5:
        parts.append(((q >> 4) << np.arange(8)[None, :, None]).sum(1).astype(np.uint8))  # [supers, 32]
    raw = np.concatenate([*parts, nibbles], -1).reshape(rows, -1)
    return raw, q.reshape(rows, k // 32, 32)


@pytest.mark.parametrize(("kind", "bits"), [("Q4_K", 4), ("Q5_K", 8)])
def test_a_k_quant_weight_keeps_its_blocks_with_float32_scales_and_mins(kind, bits):
    """Q4_K / Q5_K blocks of 32 have scale d * sc and min -dmin * m, float32 exactly: kept as our blocks with float32
    scales and mins, the gguf package's numbers bit for bit, even for the blocks without q = 0 or q = top."""
    rng = np.random.default_rng(bits)
    raw, q = k_quant_blocks(rng, 12, 512, 4 if kind == "Q4_K" else 5)
    w = np.asarray(gguf_quants.dequantize(raw, GGMLQuantizationType[kind]), np.float32).reshape(12, 512)
    blocks = gguf_blocks(w, 4)
    assert blocks is not None and (blocks.grid, blocks.bits) == (kind, bits)
    np.testing.assert_array_equal(blocks.dequantize(), w)
    assert not blocks.unpacked()[1].any() and blocks.mins is not None
    # the file's codes where the block spans 0 .. top; elsewhere other codes (shifted, or a multiple of s) may read
    # the same numbers
    spans = (q.min(-1) == 0) & (q.max(-1) == (1 << (4 if kind == "Q4_K" else 5)) - 1)
    np.testing.assert_array_equal(blocks.unpacked()[0][spans], q[spans])
    w[5, 100] = np.nextafter(w[5, 100], np.float32(np.inf))  # row 5 now on no grid: quantized here, alone
    assert_kept_but(gguf_blocks(w, 4), w, [5], f"{kind}+int4", bits)


def test_a_fused_weight_keeps_each_rows_own_gguf_blocks():
    """A fused projection of tensors of several types (a Q4_K_M file of a model whose rows are not whole K-quant
    super-blocks: attn_q, attn_k Q5_0, attn_v Q8_0) keeps every row's blocks, in 8-bit codes where one type needs
    them; rows of 4-bit types alone stay 4-bit; a row off every grid is quantized here, the others kept."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((40, 64)).astype(np.float32)
    parts = {"Q5_0": x[:16], "Q8_0": x[16:24], "Q4_1": x[24:40]}
    w = np.concatenate([gguf_roundtrip(rows, kind)[0] for kind, rows in parts.items()])
    blocks = gguf_blocks(w, 4)
    assert (blocks.grid, blocks.bits) == ("Q4_1+Q5_0+Q8_0", 8)
    np.testing.assert_array_equal(blocks.dequantize(), w)
    codes, zeros = blocks.unpacked()
    theirs = gguf_codes(gguf_roundtrip(x[16:24], "Q8_0")[1], "Q8_0")
    np.testing.assert_array_equal(codes[16:24].astype(np.int32), theirs)
    assert (zeros[:16] == 16).all() and (zeros[16:24] == 128).all() and (zeros[24:] == 0).all()
    assert not blocks.mins[:24].any() and blocks.mins[24:].all()  # the Q4_1 rows' m, the others none
    four = np.concatenate([gguf_roundtrip(x[:8], "Q4_0")[0], gguf_roundtrip(x[8:], "Q4_1")[0]])
    assert (gguf_blocks(four, 4).grid, gguf_blocks(four, 4).bits) == ("Q4_0+Q4_1", 4)
    np.testing.assert_array_equal(gguf_blocks(four, 4).dequantize(), four)
    w[30, 7] = np.nextafter(w[30, 7], np.float32(np.inf))
    assert_kept_but(gguf_blocks(w, 4), w, [30], "Q4_1+Q5_0+Q8_0+int4", 8)


def test_weights_on_no_gguf_grid_are_quantized_here():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    assert gguf_blocks(x, 4) is None and gguf_blocks(x[:, :40], 4) is None  # float weights; K not whole blocks
    assert gguf_blocks(np.zeros((2, 32), np.float32), 4).dequantize().tolist() == np.zeros((2, 32)).tolist()


def test_a_row_off_its_weights_gguf_grid_is_quantized_here_and_the_rest_kept():
    """The first row decides which grids are checked in full; a later row one ulp off them all is quantized to the
    scheme's bits (8 under int8: then every row rides in 8-bit codes), the others keep their blocks."""
    rng = np.random.default_rng(4)
    w, _ = gguf_roundtrip(rng.standard_normal((6, 64)).astype(np.float32), "Q4_1")
    assert gguf_blocks(w, 4).grid == "Q4_1"
    w[3, 5] = np.nextafter(w[3, 5], np.float32(np.inf))  # one weight one ulp off the grid, in a later row
    assert_kept_but(gguf_blocks(w, 4), w, [3], "Q4_1+int4", 4)
    assert_kept_but(gguf_blocks(w, 8), w, [3], "Q4_1+int8", 8)


def assert_kept_but(blocks, w: np.ndarray, here: list[int], grid: str, bits: int) -> None:
    """`blocks` keeps every row of w but `here` bit for bit; those are quantize_blocks' reading at the scheme's
    bits (the grid's last part), within half its step of w."""
    assert blocks is not None and (blocks.grid, blocks.bits) == (grid, bits)
    kept = np.setdiff1d(np.arange(len(w)), here)
    np.testing.assert_array_equal(blocks.dequantize()[kept], w[kept])
    ours = quantize_blocks(w[here], int(grid.rsplit("+int", 1)[1]))
    np.testing.assert_array_equal(blocks.dequantize()[here], ours.dequantize())
    step = np.repeat(ours.scales, BLOCK_SIZE, axis=1)[:, : w.shape[1]]
    assert (np.abs(ours.dequantize() - w[here]) <= step / 2 + 1e-6).all()


def test_a_q4_k_m_attention_keeps_its_q4_k_rows_beside_q6_k_values_quantized_here():
    """A 7B-class Q4_K_M file holds attn_q and attn_k in Q4_K and, in about half the layers, attn_v in Q6_K
    (16-weight blocks of scale d * sc, q - 32 in -32 .. 31: no block of 32 holds them). Their fused QKV keeps the
    Q4_K rows' numbers and quantizes the Q6_K rows here; quantizing it all here moved the Q4_K rows too."""
    rng = np.random.default_rng(12)
    raw, _ = k_quant_blocks(rng, 16, 256, 4)
    qk = np.asarray(gguf_quants.dequantize(raw, GGMLQuantizationType.Q4_K), np.float32).reshape(16, 256)
    # Q6_K as llama.cpp dequantizes it: float32(d) * float32(sc) per 16 weights, times q - 32
    d = rng.uniform(1e-4, 1e-3, (8, 1, 1)).astype(np.float16).astype(np.float32)
    sc = rng.integers(-128, 128, (8, 16, 1)).astype(np.float32)
    v = ((d * sc) * (rng.integers(0, 64, (8, 16, 16)) - 32).astype(np.float32)).reshape(8, 256)
    w = np.concatenate([qk, v])
    assert_kept_but(gguf_blocks(w, 4), w, list(range(16, 24)), "Q4_K+int4", 4)
    assert np.abs(quantize_blocks(w, 4).dequantize()[:16] - qk).max() > 0  # all of it here: the Q4_K rows move


def test_gguf_blocks_read_in_chunks_of_rows_are_the_blocks_read_at_once(monkeypatch):
    """gguf_blocks reads CHUNK_WEIGHTS at a time too (its float transients stay a chunk's): a fused weight of Q4_K
    rows, Q5_0 rows, rows on no grid (Q6_K's values) and Q4_K rows again, read in chunks of 3 rows that cut across
    its bands, keeps the very blocks of one pass; every row but the Q6_K ones keeps its numbers."""
    rng = np.random.default_rng(13)
    raw, _ = k_quant_blocks(rng, 10, 256, 4)
    k4 = np.asarray(gguf_quants.dequantize(raw, GGMLQuantizationType.Q4_K), np.float32).reshape(10, 256)
    q5, _ = gguf_roundtrip(rng.standard_normal((7, 256)).astype(np.float32), "Q5_0")
    d = rng.uniform(1e-4, 1e-3, (5, 1, 1)).astype(np.float16).astype(np.float32)
    six = ((d * rng.integers(-128, 128, (5, 16, 1)).astype(np.float32))
           * (rng.integers(0, 64, (5, 16, 16)) - 32).astype(np.float32)).reshape(5, 256)
    w = np.concatenate([k4[:8], q5, six, k4[8:]])  # rows 15 .. 19 on no grid
    whole = gguf_blocks(w, 4)
    monkeypatch.setattr(quantize, "CHUNK_WEIGHTS", 3 * 256)
    chunked = gguf_blocks(w, 4)
    for part in ("codes", "scales", "zero_points", "mins", "grid", "bits"):
        assert np.array_equal(getattr(chunked, part), getattr(whole, part)), part
    assert_kept_but(chunked, w, list(range(15, 20)), "Q4_K+Q5_0+int4", 8)


def test_q4_1_keeps_its_mins_beside_the_product_under_int8_activations():
    """A Q4_1 block is d * q with zero point 0 and its m apart: the graph adds x's block sums times m (as llama.cpp's
    Q4_1 x Q8_1 product does), under int8 activations too."""
    rng = np.random.default_rng(8)
    w, _ = gguf_roundtrip(rng.standard_normal((40, 128)).astype(np.float32), "Q4_1")
    blocks = gguf_blocks(w, 4)
    assert blocks.grid == "Q4_1" and blocks.mins is not None and not blocks.unpacked()[1].any()
    np.testing.assert_array_equal(blocks.dequantize(), w)  # d * q + m, as the gguf package computes it
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W"], ["y"], transB=1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 128])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", 40])], [numpy_helper.from_array(w, "W")])
    proto, _ = quantize_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), "int4",
                              activations="int8")
    assert [n.op_type for n in proto.graph.node] == ["MatMulNBits", "Reshape", "ReduceSum", "MatMul", "Add"]
    x = (rng.standard_normal((3, 128)) * 2).astype(np.float32)
    y = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    mins = np.repeat(blocks.mins, BLOCK_SIZE, axis=1).astype(np.float64)  # [N, K]
    x_hat = quantize_activations(torch.from_numpy(x)).numpy().astype(np.float64)
    np.testing.assert_allclose(y, x_hat @ (w - mins).T + x.astype(np.float64) @ mins.T, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_onnxruntime_multiplies_a_kept_gguf_weight_as_the_checkpoint_holds_it(kind):
    """Through the graph pass and onnxruntime: the product is x @ w.T of the checkpoint's own numbers, to float
    rounding, not of a requantized copy."""
    rng = np.random.default_rng(5)
    w, _ = gguf_roundtrip(rng.standard_normal((40, 128)).astype(np.float32), kind)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W"], ["y"], transB=1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 128])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", 40])], [numpy_helper.from_array(w, "W")])
    proto, used = quantize_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), "int4")
    assert used["W"].grid == kind
    x = rng.standard_normal((3, 128)).astype(np.float32)
    y = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x.astype(np.float64) @ w.T.astype(np.float64), rtol=0, atol=1e-4)


def q4_1_checkpoint(tmp_path: Path) -> Path:
    """stories260K with every projection whose K is whole blocks put through Q4_1 (the tied lm_head: Q8_0), as a
    checkpoint converted from such a GGUF holds them."""
    from safetensors.numpy import load_file, save_file

    model = tmp_path / "stories-q4_1"
    shutil.copytree(STORIES, model)
    tensors = load_file(str(model / "model.safetensors"))
    for name, value in tensors.items():
        if value.ndim == 2 and value.shape[1] % BLOCK_SIZE == 0:
            tensors[name] = gguf_roundtrip(value, "Q8_0" if "embed" in name else "Q4_1")[0]
    save_file(tensors, str(model / "model.safetensors"))
    return model


@pytest.mark.export
def test_an_engine_of_a_gguf_dequantized_checkpoint_keeps_its_blocks_and_stays_exact(tmp_path):
    """stories260K with every projection whose K is whole blocks put through Q4_1 (the lm_head, tied: Q8_0), as a
    checkpoint converted from such a GGUF holds them: --weights int4 keeps those blocks, quantizes the rest here,
    and lookahead equals the engine's greedy."""
    model = q4_1_checkpoint(tmp_path)
    out = tmp_path / "engine"
    assert main(["build", "--model", str(model), "--output", str(out), "--weights", "int4", "--activations", "float",
                 "--lookahead_config", "4,3,4", "--max_seq_len", "256"]) == 0
    config = json.loads((out / "config.json").read_text())
    # per layer (5) the fused qkv, o and fused gate/up Gemms keep Q4_1, down (K 172) is quantized here
    assert config["weight_blocks"] == {"Q4_1": 15, "Q8_0": 1, "int4": 5}
    with LookaheadRuntime.from_pretrained(str(out), max_batch=4) as rt:
        greedy = [rt.generate(p, max_new_tokens=48, lookahead="greedy").token_ids for p in PROMPTS]
        assert [rt.generate(p, max_new_tokens=48, lookahead="4,3,4").token_ids for p in PROMPTS] == greedy
    exact = tmp_path / "engine-a8"  # int8 activations, the default: Q4_1 kept too, on the exact graph
    assert main(["build", "--model", str(model), "--output", str(exact), "--weights", "int4", "--lookahead_config",
                 "4,3,4", "--max_seq_len", "256"]) == 0
    assert json.loads((exact / "config.json").read_text())["weight_blocks"] == {"Q4_1": 15, "Q8_0": 1, "int4": 5}
    with LookaheadRuntime.from_pretrained(str(exact), max_batch=4) as rt:
        greedy = [rt.generate(p, max_new_tokens=48, lookahead="greedy").token_ids for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: rt.generate(p, max_new_tokens=48, lookahead="4,3,4").token_ids, PROMPTS))
        assert together == greedy


@pytest.mark.export
def test_an_engine_of_mixed_gguf_types_keeps_every_rows_blocks_and_stays_exact(tmp_path):
    """stories260K as a Q4_K_M file of a model whose rows are not whole K-quant super-blocks holds it (llama.cpp
    falls back to 32-weight types): q and k Q5_0, v Q8_0 (one fused Gemm of both), o Q4_1, gate and up Q5_1, the
    tied lm_head Q8_0. The default int4 build keeps every one (8-bit codes for the Q5 and mixed rows), quantizes
    down (K 172) here, and lookahead equals the engine's greedy, alone and batched."""
    from safetensors.numpy import load_file, save_file

    kinds = {"q_proj": "Q5_0", "k_proj": "Q5_0", "v_proj": "Q8_0", "o_proj": "Q4_1", "gate_proj": "Q5_1",
             "up_proj": "Q5_1", "embed": "Q8_0"}
    model = tmp_path / "stories-mixed"
    shutil.copytree(STORIES, model)
    tensors = load_file(str(model / "model.safetensors"))
    for name, value in tensors.items():
        kind = next((kind for part, kind in kinds.items() if part in name), None)
        if kind is not None:
            tensors[name] = gguf_roundtrip(value, kind)[0]
    save_file(tensors, str(model / "model.safetensors"))
    out = tmp_path / "engine"
    assert main(["build", "--model", str(model), "--output", str(out), "--weights", "int4", "--lookahead_config",
                 "4,3,4", "--max_seq_len", "256"]) == 0
    blocks = json.loads((out / "config.json").read_text())["weight_blocks"]
    assert blocks == {"Q5_0+Q8_0": 5, "Q4_1": 5, "Q5_1": 5, "int4": 5, "Q8_0": 1}
    with LookaheadRuntime.from_pretrained(str(out), max_batch=4) as rt:
        greedy = [rt.generate(p, max_new_tokens=48, lookahead="greedy").token_ids for p in PROMPTS]
        assert [rt.generate(p, max_new_tokens=48, lookahead="4,3,4").token_ids for p in PROMPTS] == greedy
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: rt.generate(p, max_new_tokens=48, lookahead="4,3,4").token_ids, PROMPTS))
        assert together == greedy


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_graph_pass_multiplies_by_the_dequantized_weight_and_keeps_a_tied_lookup(scheme):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((50, 172)).astype(np.float32)  # [N, K], K not a multiple of the block
    nodes = [helper.make_node("Gather", ["W", "ids"], ["emb"]),  # the tied embedding's lookup reads W too
             helper.make_node("Gemm", ["x", "W"], ["y"], transB=1)]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 172]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, ["I"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", 50]),
         helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["I", 172])],
        [numpy_helper.from_array(weight, "W")])
    proto, used = quantize_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), scheme)
    assert [n.op_type for n in proto.graph.node] == ["Gather", "MatMulNBits"] and "W" in used
    assert "W" in {t.name for t in proto.graph.initializer}  # still read by the Gather
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((3, 172)).astype(np.float32)
    y, emb = session.run(None, {"x": x, "ids": np.array([4, 9])})
    np.testing.assert_allclose(y, x @ used["W"].dequantize().T, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(emb, weight[[4, 9]])
    assert np.abs(used["W"].dequantize() - weight).max() > 0  # it really is quantized


def test_a_projection_the_graph_holds_inline_is_quantized_beside_held_ones(tmp_path):
    """With `weights` (a build's held initializers), a projection too small to have been held (under INLINE_BYTES)
    is quantized all the same, its blocks held, and the saved graph multiplies by them."""
    weight = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)  # 512 bytes: inline
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W"], ["y"], transB=1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", 4])], [numpy_helper.from_array(weight, "W")])
    weights: dict = {}
    proto, used = quantize_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), "int8",
                                 weights=weights)
    assert weights["W.q8"] is used["W"].codes and "W" not in {t.name for t in proto.graph.initializer}
    save_graph(proto, tmp_path / "model.onnx", weights)
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    x = np.ones((1, 32), np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], x @ used["W"].dequantize().T, rtol=1e-5, atol=1e-5)


def test_a_build_holds_the_weights_once_and_saves_every_held_value(tmp_path):
    """export_graph copies no weight into the graph: each larger initializer is held, its data a view of the model's
    own parameter; quantize_graph holds the very block arrays it returns; save_graph writes every held value, so the
    saved graph's float initializers are the model's parameters and its blocks the returned ones, bit for bit."""
    model, _ = load_llama(STORIES)
    params = {f"model.{name}": p.detach().numpy() for name, p in model.named_parameters(remove_duplicate=False)}
    proto, weights = export_graph(model, "plugin", 64, 8)
    held = {t.name for t in proto.graph.initializer if is_held(t)}
    assert held == set(weights) and not any(t.raw_data for t in proto.graph.initializer if t.name in held)
    tied = {"model.tok_embeddings.weight", "model.output.weight"}  # one tensor, under either name
    assert "model.layers.0.attention.wqkv.weight" in held and held & tied
    assert all(np.shares_memory(weights[name], params[name]) for name in held if name in params)
    assert proto.ByteSize() < sum(a.nbytes for a in params.values()) / 10  # the graph file's part only

    proto, used = quantize_graph(proto, "int4", weights=weights)
    assert all(weights[f"{name}.q4"] is blocks.codes for name, blocks in used.items())
    save_graph(proto, tmp_path / "model.onnx", weights)
    saved = onnx.load(str(tmp_path / "model.onnx"))  # with the weights file
    assert not any(is_held(t) for t in saved.graph.initializer)
    values = {t.name: numpy_helper.to_array(t) for t in saved.graph.initializer}
    for name, blocks in used.items():
        assert np.array_equal(values[f"{name}.q4"], blocks.codes), name
        assert np.array_equal(values[f"{name}.q4.scales"], blocks.scales.reshape(-1)), name
    floats = [name for name in values if name in params]
    assert set(floats) & tied  # the tied lookup's, kept float
    assert all(np.array_equal(values[name], params[name]) for name in floats)


def test_a_deferred_build_reads_each_projection_once_and_writes_the_same_engine(tmp_path):
    """A quantized build from load_llama_deferred: the exported graph and every saved byte are those of the eagerly
    loaded model's build; quantize_graph reads each deferred projection exactly once, and the float weight it read
    is gone before it reads the next (one float projection in memory at a time)."""
    import weakref

    reads: list[str] = []
    alive: list[weakref.ref] = []

    def counted(name: str, read):
        def read_once():
            assert all(ref() is None for ref in alive), f"a float projection is still held when {name} is read"
            reads.append(name)
            array = read()
            alive.append(weakref.ref(array))  # any view of it kept refers to it
            return array
        return read_once

    def built(model, deferred=None) -> tuple[bytes, bytes]:
        out = tmp_path / ("deferred" if deferred else "eager")
        out.mkdir()
        proto, weights = export_graph(model, "plugin", 64, 8, deferred=deferred)
        weights = {name: counted(name, data) if callable(data) else data for name, data in weights.items()}
        proto, _ = quantize_graph(proto, "int4", "int8", weights)
        save_graph(proto, out / "model.onnx", weights)
        return (out / "model.onnx").read_bytes(), (out / "weights.bin").read_bytes()

    model, _, deferred = load_llama_deferred(STORIES, 0)
    assert len(deferred) == 5 * 4  # wqkv, wo, w13, w2 per layer; the tied head is the embedding
    assert built(model, deferred) == built(load_llama(STORIES)[0])
    assert sorted(reads) == sorted(f"model.{name}" for name in deferred)


def test_the_builds_reference_holds_the_graphs_blocks_and_multiplies_as_the_dequantized_model():
    """quantize_like_graph (the build's smoke-check reference, quantize_graph's on_blocks): each projection becomes a
    QuantizedLinear on the graph's very blocks (no copy) as soon as they are made, the graph letting go of the float
    weight there too, and no float projection is left; yet the logits are bit for bit those of the float model
    holding the dequantized weights. The tied lm_head gets its own, the embedding staying the float one the graph's
    lookup reads."""
    model, _ = load_llama(STORIES)
    dense, _ = load_llama(STORIES)  # the same reference written out: each projection's dequantized weight, in float
    embedding = model.tok_embeddings.weight.clone()
    assert model.output.weight is model.tok_embeddings.weight  # stories260K ties them
    proto, weights = export_graph(model, "plugin", 64, 8)
    seen: list[str] = []

    def reference(name, blocks):
        assert name not in weights or name in {"model.tok_embeddings.weight", "model.output.weight"}  # let go of
        quantize_like_graph(model, name, blocks, "float")
        seen.append(name)

    _, used = quantize_graph(proto, "int4", weights=weights, on_blocks=reference)
    assert seen == list(used)
    del proto
    assert torch.equal(model.tok_embeddings.weight, embedding)
    assert not any(isinstance(module, Linear) for module in model.modules())
    for name, blocks in used.items():
        module_name = name.removeprefix("model.").removesuffix(".weight")
        module = model.get_submodule(module_name)
        assert isinstance(module, QuantizedLinear) and np.shares_memory(module.codes.numpy(), blocks.codes), name
        dense.get_submodule(module_name).weight = torch.nn.Parameter(torch.from_numpy(blocks.dequantize()))
    assert {name.removeprefix("model.") for name in used} >= {"output.weight", "layers.0.attention.wqkv.weight"}
    n = 12
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 512, n))

    def logits(m):
        with torch.no_grad():
            return m(ids, torch.arange(n), *m.new_cache(16), torch.tensor(0), torch.ones(n, n, dtype=bool).tril(),
                     torch.arange(n))

    assert torch.equal(logits(model), logits(dense))
    assert not torch.equal(logits(model), logits(load_llama(STORIES)[0]))  # and not the float model's


def test_the_references_blocks_are_read_from_the_saved_weights_file_mapped(tmp_path):
    """map_saved_blocks: once the graph is saved, every projection of the smoke check's reference multiplies by the
    blocks in weights.bin itself (its codes, scales and Q4_1 mins lie in a mapping of that file), the build's own
    arrays are let go, and the logits are bit for bit the same."""
    import weakref

    model, _, deferred = load_llama_deferred(q4_1_checkpoint(tmp_path), 0)
    proto, weights = export_graph(model, "plugin", 64, 8, deferred=deferred)
    proto, used = quantize_graph(proto, "int4", weights=weights,
                                 on_blocks=partial(quantize_like_graph, model, activations="float"))
    assert {blocks.grid for blocks in used.values() if blocks.mins is not None} == {"Q4_1"}
    n = 12
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 512, n))

    def logits():
        with torch.no_grad():
            return model(ids, torch.arange(n), *model.new_cache(16), torch.tensor(0),
                         torch.ones(n, n, dtype=bool).tril(), torch.arange(n))

    before = logits()
    save_graph(proto, tmp_path / "model.onnx", weights)
    bits = {name: blocks.bits for name, blocks in used.items()}
    held = [weakref.ref(blocks.codes) for blocks in used.values()]
    del proto, weights, used
    map_saved_blocks(model, list(bits), tmp_path / "model.onnx")
    assert all(ref() is None for ref in held)
    mapped = [tuple(int(x, 16) for x in line.split()[0].split("-"))
              for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith("/weights.bin")
              and str(tmp_path) in line]
    assert mapped

    def in_file(t: torch.Tensor) -> bool:
        return any(start <= t.data_ptr() < end for start, end in mapped)

    outside = {t.name for t in onnx.load(str(tmp_path / "model.onnx"), load_external_data=False).graph.initializer
               if t.external_data}  # the small ones stay inside the graph file, read
    checked = 0
    for name, width in bits.items():
        module = model.get_submodule(name.removeprefix("model.").removesuffix(".weight"))
        names = BlockNames.of(name, width)
        stored = {"codes": names.codes, "scales": names.scales, "zero_points": names.zero_points,
                  "mins": MinsTerm.of(names.codes).mins}
        for attr, initializer in stored.items():
            if initializer in outside:
                assert in_file(getattr(module, attr)), initializer
                checked += 1
    assert checked >= len(bits) + 15  # every projection's codes, and the Q4_1 projections' mins
    assert torch.equal(logits(), before)


# -- a torch Llama's projections (the GPU executor's weights) ------------------------------------------------------


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_torch_llama_holds_the_blocks_the_graph_pass_makes_and_keeps_its_tied_lookup(scheme):
    """quantize_model: every projection and the lm_head become QuantizedLinear holding quantize_blocks' blocks, whose
    dense weight is QuantizedWeight.dequantize's bit for bit; the tied embedding stays float (in the asked dtype),
    the scales float32; and the model's logits are those of a float model holding the dequantized weights."""
    model, cfg = load_llama(STORIES)
    source, reference = load_llama(STORIES)[0], load_llama(STORIES, dtype=torch.bfloat16)[0]
    embedding = model.tok_embeddings.weight.clone()
    used = quantize_model(model, scheme, torch.bfloat16)
    names = {f"layers.{i}.{m}" for i in range(cfg.num_layers)
             for m in ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")} | {"output"}
    assert set(used) == names and not any(isinstance(m, Linear) for m in model.modules())
    assert model.quantized and model.weight_layout == "blocks" and model.dtype == torch.bfloat16
    assert torch.equal(model.tok_embeddings.weight, embedding.to(torch.bfloat16))
    for name, blocks in used.items():
        module = model.get_submodule(name)
        assert (blocks.grid, module.bits, module.scales.dtype) == (scheme, BITS[scheme], torch.float32)
        weight = source.get_submodule(name).weight.numpy()
        assert np.array_equal(blocks.dequantize(), quantize_blocks(weight, BITS[scheme]).dequantize())
        assert np.array_equal(module.dense_weight().numpy(), blocks.dequantize())
        dequantized = torch.from_numpy(blocks.dequantize()).to(torch.bfloat16)
        reference.get_submodule(name).weight = torch.nn.Parameter(dequantized, requires_grad=False)
    ids = torch.tensor([1, 300, 411, 20, 7])
    step = (ids, torch.arange(5), None, None, torch.tensor(0), torch.ones(5, 5, dtype=torch.bool).tril())
    assert torch.equal(model(*step), reference(*step))


def test_a_torch_llama_loaded_deferred_quantizes_each_weight_as_read_once():
    """quantize_model on a load_llama_deferred model (the GPU executor's --weights load): each projection is read from
    the checkpoint once, as it is quantized, into the very blocks the eagerly loaded model's make, and the model's
    logits are the eager one's bit for bit."""
    eager = load_llama(STORIES)[0]
    expected = quantize_model(eager, "int4", torch.bfloat16)
    model, _, readers = load_llama_deferred(STORIES, 0)
    reads: list[str] = []

    def counted(name, read):
        return lambda: reads.append(name) or read()

    used = quantize_model(model, "int4", torch.bfloat16, {name: counted(name, r) for name, r in readers.items()})
    assert sorted(reads) == sorted(readers) and len(reads) == 20
    assert set(used) == set(expected)
    for name, blocks in used.items():
        assert np.array_equal(blocks.codes, expected[name].codes) and np.array_equal(blocks.scales,
                                                                                      expected[name].scales), name
    ids = torch.tensor([1, 300, 411, 20, 7])
    step = (ids, torch.arange(5), None, None, torch.tensor(0), torch.ones(5, 5, dtype=torch.bool).tril())
    assert torch.equal(model(*step), eager(*step))


def test_a_torch_llama_keeps_a_gguf_weights_own_blocks():
    """A projection that is a GGUF Q4_1 tensor dequantized keeps its blocks and mins (4-bit under --weights int8):
    its dense weight is the checkpoint's to the bit, not a second rounding."""
    model, _ = load_llama(STORIES)
    module = model.layers[0].attention.wqkv  # K = 64: whole GGUF blocks
    rng = np.random.default_rng(5)
    w, _ = gguf_roundtrip(rng.standard_normal(tuple(module.weight.shape)).astype(np.float32), "Q4_1")
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(w))
    used = quantize_model(model, "int8")
    kept = model.layers[0].attention.wqkv
    assert used["layers.0.attention.wqkv"].grid == "Q4_1" and kept.bits == 4 and kept.mins is not None
    assert np.array_equal(kept.dense_weight().numpy(), w)
    assert used["layers.0.feed_forward.w13"].grid == "int8"  # the others: the scheme asked for


@pytest.mark.parametrize("bits, mins", [(4, False), (4, True), (8, False)])
def test_a_large_quantized_projection_multiplies_a_slice_of_channels_at_a_time_as_its_dense_weight(bits, mins):
    """On a CPU QuantizedLinear.forward multiplies DEQUANTIZED_WEIGHTS weights' worth of whole output channels at a
    time (here two whole slices and a short one): each slice's dense weight is the whole one's rows bit for bit (the
    whole one QuantizedWeight.dequantize's), and the product is the dense weight's to float rounding, every channel
    in place."""
    rng = np.random.default_rng(11)
    k = 2000  # padded to 63 blocks of 32
    n = 2 * (DEQUANTIZED_WEIGHTS // k) + 37  # two whole slices and a short one
    weight = rng.standard_normal((n, k)).astype(np.float32)
    blocks = quantize_blocks(weight, bits)
    if mins:  # a Q4_1-style weight: each block's m added
        blocks = dataclasses.replace(blocks, mins=rng.standard_normal(blocks.scales.shape).astype(np.float32))
    module = quantized_linear(blocks)
    dense = module.dense_weight()
    assert np.array_equal(dense.numpy(), blocks.dequantize())
    rows = DEQUANTIZED_WEIGHTS // k
    for first in range(0, n, rows):
        assert torch.equal(module.dense_weight(slice(first, first + rows)), dense[first : first + rows])
    x = torch.from_numpy(rng.standard_normal((5, k)).astype(np.float32))
    y = module(x)
    assert y.shape == (5, n)
    torch.testing.assert_close(y, x @ dense.T, rtol=1e-5, atol=1e-4)


# -- quantized engines end to end -------------------------------------------------------------------------------

PROMPTS = ["Once upon a time", "The little dog ran to the", "Lily and Ben went to the park"]


@pytest.fixture(scope="module", params=[("int8", "float"), ("int4", None)], ids=["int8-float", "int4-default"])
def quantized(request, tmp_path_factory):
    """(weights, engine dir): int8 weights on float activations (the fast graph), int4 on the default (int8, exact)."""
    weights, activations = request.param
    out = tmp_path_factory.mktemp(weights) / "engine"
    extra = [] if activations is None else ["--activations", activations]
    assert main(["build", "--model", str(STORIES), "--output", str(out), "--weights", weights, *extra,
                 "--lookahead_config", "4,3,4", "--max_seq_len", "256", "--max-batch", "4"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["activations"], config["exact"]) == (activations or "int8", activations is None)
    return weights, out


@pytest.mark.export
def test_a_quantized_engine_records_its_scheme_and_its_smoke_check(quantized):
    scheme, engine = quantized
    config = json.loads((engine / "config.json").read_text())
    assert config["quantization"] == scheme and config["build_key"]["weights"] == scheme
    assert config["build_key"]["blocks"] == BLOCKS_REVISION  # which GGUF blocks a build keeps: a new rule rebuilds
    assert config["targets"]["onnx"]["smoke_check"]  # against the torch model holding the same dequantized weights


@pytest.mark.export
def test_generate_and_bench_name_a_quantized_engines_weights(quantized, capsys, tmp_path):
    """generate's status line and JSON, and bench's JSON and table, say which weights ran: the int8 engine's on
    float activations, the int4 engine's on int8 activations (the fixture's builds); a float engine's say float
    (tests/cli/test_generate.py, tests/bench/test_bench.py)."""
    scheme, engine = quantized
    want = {"int8": "int8", "int4": "int4+int8"}[scheme]
    argv = ["generate", "--engine", str(engine), "--prompt", "Once upon a time", "--max-new-tokens", "8", "--greedy"]
    assert main(argv) == 0
    assert f"[greedy onnxruntime float32 {want} weights] 8 tokens in" in capsys.readouterr().err
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["weights"] == want
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n")
    assert main(["bench", "--engine", str(engine), "--dataset", str(prompts), "--limit", "1", "--max-new-tokens", "8",
                 "--configs", "greedy", "--out", str(tmp_path / "out"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["weights"] == want
    table = (tmp_path / "out" / "results.md").read_text()
    assert f"backend onnxruntime, float32, {want} weights, 8 new tokens max" in table
    with LookaheadRuntime.from_pretrained(str(engine), max_batch=1) as rt:  # serve's /metrics, as rendered
        assert f'weights="{want}"' in OpenAIServer(rt, model_name="q").metrics.exposition().decode()


@pytest.mark.export
def test_a_changed_quantized_code_is_refused_at_load(quantized, tmp_path):
    _, engine = quantized
    copy = tmp_path / "engine"
    shutil.copytree(engine, copy)
    with (copy / "weights.bin").open("r+b") as data:  # one byte of the codes, the scales or the zero points
        data.seek(100)
        byte = data.read(1)
        data.seek(100)
        data.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(UserError, match=r"weights\.bin"):
        open_engine(copy)


@pytest.mark.export
def test_lookahead_on_a_quantized_engine_equals_its_own_greedy_alone_and_batched(quantized):
    _, engine = quantized
    with LookaheadRuntime.from_pretrained(str(engine), max_batch=4) as rt:
        greedy = [rt.generate(p, max_new_tokens=48, lookahead="greedy").token_ids for p in PROMPTS]
        alone = [rt.generate(p, max_new_tokens=48, lookahead="4,3,4").token_ids for p in PROMPTS]
        assert [rt.generate(p, max_new_tokens=48).token_ids for p in PROMPTS] == greedy  # the default, `auto`
        batched: list[list[int] | None] = [None] * len(PROMPTS)
        barrier = threading.Barrier(len(PROMPTS))

        def run(i: int) -> None:  # all in flight together: one batched step per iteration
            barrier.wait()
            batched[i] = rt.generate(PROMPTS[i], max_new_tokens=48, lookahead="4,3,4").token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert alone == greedy and batched == greedy


@pytest.mark.export
def test_quantized_builds_refuse_what_cannot_run_them(quantized, tmp_path):
    _, engine = quantized
    with pytest.raises(UserError, match="TensorRT backend cannot run"):
        LookaheadRuntime.from_pretrained(str(engine), backend="tensorrt")
    code = main(["build", "--model", str(STORIES), "--output", str(tmp_path / "bf16"), "--weights", "int4",
                 "--dtype", "bfloat16"])
    assert code == 2


@pytest.mark.parametrize(("extra", "message"), [
    (["--activations", "int8"], "--activations int8 multiplies quantized weights: add --weights int8 or int4"),
    (["--weights", "int4", "--activations", "int8", "--lookahead_config", "16,5,16"],
     "--weights int4 --activations int8 (the default for quantized weights: an exact graph) cannot build"),
    (["--weights", "int8", "--lookahead_config", "16,5,16"], "cannot build this engine: its steps hold at most 64"),
    (["--weights", "int4", "--attention", "native"], "LookaheadAttention node, not native (--attention plugin); or "
                                                     "add --activations float (the fast graph"),
])
def test_int8_activations_are_refused_where_they_cannot_build(tmp_path, capsys, extra, message):
    assert main(["build", "--model", str(STORIES), "--output", str(tmp_path / "engine"), *extra]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "engine").exists()


@pytest.mark.export
def test_an_int8_activation_engine_is_exact_and_records_both_schemes(tmp_path):
    out = tmp_path / "engine"
    assert main(["build", "--model", str(STORIES), "--output", str(out), "--weights", "int8", "--activations", "int8",
                 "--lookahead_config", "2,3,2", "--max_seq_len", "128"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["quantization"], config["activations"], config["exact"]) == ("int8", "int8", True)
    assert config["build_key"]["activations"] == "int8"
    assert config["targets"]["onnx"]["smoke_check"]["ran"]  # not strict: int8 codes move with rounding upstream
    with LookaheadRuntime.from_pretrained(str(out)) as rt:
        assert rt.exact
        greedy = [rt.generate(p, max_new_tokens=40, lookahead="greedy").token_ids for p in PROMPTS]
        assert [rt.generate(p, max_new_tokens=40, lookahead="2,3,2").token_ids for p in PROMPTS] == greedy
    config["quantization"] = "float"  # int8 activations without quantized weights: an inconsistent config.json
    write_engine_config(out, config)
    with pytest.raises(UserError, match="activations are int8 but the weights are float"):
        open_engine(out)
