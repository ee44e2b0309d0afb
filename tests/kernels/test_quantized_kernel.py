"""kernels/onnxruntime_quantized.c's QuantizedMatMul under real onnxruntime: the product of the int8-quantized rows
and the dequantized weight for every block scheme and odd shape, a row's bits the same at every row count and
thread count, and the graph rewrite (engine/quantize.native_products) that puts it in place of MatMulNBits."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from onnx import TensorProto, helper, numpy_helper

from trt_lookahead.engine.quantize import (
    NATIVE_PRODUCT,
    QuantizedWeight,
    native_products,
    quantize_activations,
    quantize_graph,
)
from trt_lookahead.kernels.onnxruntime_library import _cpu_flags, build_library, native_library

pytestmark = pytest.mark.skipif(not native_library().quantized,
                                reason=f"no QuantizedMatMul here: {native_library().why or 'no AVX2, FMA and F16C'}")


def weight(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """A float [n, k] weight: random (int4 / int8 quantize it here), or exactly a GGUF `kind` tensor dequantized."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    if kind in ("int4", "int8"):
        return w
    qtype = GGMLQuantizationType[kind]
    return np.asarray(gguf_quants.dequantize(gguf_quants.quantize(w, qtype), qtype), np.float32)


def quantized_graph(w: np.ndarray, kind: str, activations: str = "int8") -> tuple[object, QuantizedWeight]:
    """One Gemm(x, w^T) through the build's graph pass: MatMulNBits (and a Q4_1 weight's mins term)."""
    n, k = w.shape
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W"], ["y"], transB=1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], [numpy_helper.from_array(w, "W")])
    proto, used = quantize_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                 "int8" if kind in ("int8", "Q8_0") else "int4", activations=activations)
    assert used["W"].grid == kind
    return proto, used["W"]


def native_session(proto: object, threads: int = 2, library: Path | None = None) -> ort.InferenceSession:
    proto, left = native_products(copy.deepcopy(proto))
    assert left == 0 and [node.op_type for node in proto.graph.node] == [NATIVE_PRODUCT]
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(str(library or native_library().path))
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize(("kind", "n", "k"), [("int4", 200, 96), ("int4", 7, 40), ("int8", 130, 70), ("int8", 5, 33),
                                              ("Q4_1", 67, 128), ("Q4_0", 64, 96), ("Q8_0", 33, 64), ("Q5_0", 40, 96),
                                              ("Q5_1", 21, 64)])
def test_the_product_is_the_quantized_rows_times_the_dequantized_weight(kind, n, k):
    """Odd channel counts (a last group of 4 or 8 channels repeating its last), K off the blocks (a zero-padded last
    block), zero points, GGUF mins: y == quantize_activations(x) @ w_hat^T to float32 rounding, and not the product
    of the float rows (the codes are what it multiplies)."""
    proto, blocks = quantized_graph(weight(kind, n, k, seed=n), kind)
    rng = np.random.default_rng(k)
    x = (rng.standard_normal((9, k)) * np.exp(rng.standard_normal((9, k)))).astype(np.float32)
    y = native_session(proto).run(None, {"x": x})[0]
    w_hat = blocks.dequantize().astype(np.float64)  # d * q + m, or (q - z) * d
    want = quantize_activations(torch.from_numpy(x)).numpy().astype(np.float64) @ w_hat.T
    scale = np.abs(want).max()
    assert y.shape == (9, n) and np.abs(y - want).max() < 2e-6 * scale
    assert np.abs(y - x.astype(np.float64) @ w_hat.T).max() > 1e-4 * scale


@pytest.mark.parametrize("kind", ["Q4_1", "int8"])
def test_a_row_has_the_same_bits_at_every_row_count_and_thread_count(kind):
    """The exact step's premise: row r of a product of M rows is the bits of row r alone, for every M (the kernel
    tiles rows 4 or 8 at a time, those left through other code) and on 1 or 2 threads (channels split across them)."""
    proto, _ = quantized_graph(weight(kind, 70, 160, seed=3), kind)
    x = np.random.default_rng(4).standard_normal((40, 160)).astype(np.float32)
    sessions = [native_session(proto, threads) for threads in (1, 2)]
    full = sessions[1].run(None, {"x": x})[0]
    for session in sessions:
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 17, 40):
            np.testing.assert_array_equal(session.run(None, {"x": x[:m]})[0], full[:m])
        for r in range(0, 40, 9):
            np.testing.assert_array_equal(session.run(None, {"x": x[r:r + 1]})[0][0], full[r])


CPU = set(_cpu_flags().split())
# the same sources built for less of this CPU: flags, and the CPU flags without which they leave this build's path
NARROWER = {
    "vnni256": (("-mno-avx512bw",), {"avx512_vnni", "avx512bw"}),  # VNNI on 256-bit vectors only: 8-channel records
    "avx2": (("-mno-avx512f", "-mno-avxvnni"), None),  # AVX2's byte products and widening, 4 channels, 4-row tiles
}


@pytest.mark.parametrize("path", sorted(NARROWER))
@pytest.mark.parametrize(("kind", "n", "k"), [("Q4_1", 70, 160), ("int4", 37, 72), ("int8", 45, 100),
                                              ("Q8_0", 33, 64), ("Q5_1", 45, 96), ("Q5_0", 21, 64)])
def test_every_vector_width_gives_the_bits_of_the_avx2_path(path, kind, n, k):
    """This CPU's build (with AVX-512 BW and VNNI: 4-bit weights in 16-channel records on 512-bit vectors, 8-bit
    ones in 8-channel records on 256-bit; VNNI byte products, a row's code dwords broadcast, 8-row tiles) against
    the same sources built for a narrower path: the same bits for every row count, so an engine's tokens do not
    depend on which of these CPUs runs it. Odd channel counts leave a last group partly filled at every width."""
    flags, needs = NARROWER[path]
    wider = needs <= CPU if needs else {"avx512vl", "avx512_vnni", "avx_vnni"} & CPU
    if not wider:
        pytest.skip(f"this CPU has no wider code path than {path}'s")
    narrow = build_library(flags)
    assert narrow.quantized and narrow.path != native_library().path
    proto, _ = quantized_graph(weight(kind, n, k, seed=n), kind)
    rng = np.random.default_rng(k)
    x = (rng.standard_normal((19, k)) * np.exp(rng.standard_normal((19, k)))).astype(np.float32)
    wide, other = native_session(proto), native_session(proto, library=narrow.path)
    for m in (1, 3, 4, 8, 12, 19):
        np.testing.assert_array_equal(wide.run(None, {"x": x[:m]})[0], other.run(None, {"x": x[:m]})[0])


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1"])
def test_five_bit_records_give_the_bits_of_eight_bit_ones(kind):
    """A weight whose 8-bit codes are all below 32 (a GGUF's Q5 blocks) streams from 5-bit records (4-bit codes and
    a plane of fifth bits); one Q8_0 row beside the same rows keeps the whole weight's records 8-bit. A channel's
    output depends on its own codes alone, so the Q5 channels of both products have the same bits, at every row
    count (1-row and 8-row tiles, the rows left) and on 1 and 2 threads."""
    q5 = weight(kind, 45, 160, seed=5)
    mixed = np.concatenate([q5, weight("Q8_0", 3, 160, seed=6)])
    five, _ = quantized_graph(q5, kind)
    eight, _ = quantized_graph(mixed, f"{kind}+Q8_0")
    x = np.random.default_rng(7).standard_normal((21, 160)).astype(np.float32)
    for threads in (1, 2):
        fives, eights = native_session(five, threads), native_session(eight, threads)
        for m in (1, 3, 8, 13, 21):
            np.testing.assert_array_equal(fives.run(None, {"x": x[:m]})[0], eights.run(None, {"x": x[:m]})[0][:, :45])


def test_native_products_fold_the_mins_term_and_leave_float_activations():
    """A Q4_1 product's five nodes become one QuantizedMatMul reading the mins; MatMulNBits of float activations
    (accuracy_level unset) are left and counted, so an engine knows it still pads 1-row steps."""
    w = weight("Q4_1", 24, 64, seed=1)
    proto, _ = quantized_graph(w, "Q4_1")
    assert [node.op_type for node in proto.graph.node] == ["MatMulNBits", "Reshape", "ReduceSum", "MatMul", "Add"]
    native, left = native_products(copy.deepcopy(proto))
    (node,) = native.graph.node
    assert left == 0 and node.op_type == NATIVE_PRODUCT and node.input[4] == "W.q4.mins" and node.output == ["y"]
    assert {tensor.name for tensor in native.graph.initializer} == {"W.q4", "W.q4.scales", "W.q4.zero_points",
                                                                   "W.q4.mins"}
    floats, _ = quantized_graph(w, "Q4_1", activations="float")
    kept, left = native_products(copy.deepcopy(floats))
    assert left == 1 and [node.op_type for node in kept.graph.node] == [node.op_type for node in floats.graph.node]
