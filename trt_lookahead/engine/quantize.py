"""Weight-only quantization of an exported graph's projections: int8 or int4 blocks, activations in float.

    blocks = quantize_blocks(w, bits=4)            # w [N, K] float32 (out, in) -> QuantizedWeight
    w_hat = blocks.dequantize()                    # [N, K]: exactly what the quantized graph multiplies by
    proto, used = quantize_graph(proto, "int4")    # every Gemm(x, W^T) on a weight -> com.microsoft MatMulNBits

Each output channel's K inputs are cut into blocks of BLOCK_SIZE (the last one padded with zeros); a block
keeps `bits`-bit unsigned codes q, a float32 scale s and an integer zero point z, and w_hat = (q - z) * s. The
block's range is its min and max with 0 included, s = (max - min) / (2**bits - 1), z = round(-min / s), so 0
is exact and every weight is within s / 2 of w_hat. Worked example, bits 4, one block [-1.0, 0.6, 2.0, 0.3,
0, ...] whose min is -1.0 and max 2.0: s = 3 / 15 = 0.2, z = 5, -1.0 -> q 0, 0.6 -> q 8, 2.0 -> q 15, 0.3 -> q 7
(1.5 rounds to even: w_hat 0.4), 0 -> q 5.

The layout is onnxruntime's MatMulNBits (contrib op, CPU): codes [N, blocks, BLOCK_SIZE * bits / 8] with two
4-bit codes per byte low nibble first, scales [N * blocks], zero points [N, blocks] bytes for int8 and two per
byte for int4. The engine's config.json records the scheme (engine/format.py); docs/design.md section 6.9.
Imports numpy, onnx and engine.format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from trt_lookahead.engine.format import WEIGHT_SCHEMES
from trt_lookahead.errors import UserError

BITS = {"int8": 8, "int4": 4}
BLOCK_SIZE = 32  # weights per (channel, block); a power of two >= 16, as MatMulNBits takes
CONTRIB_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class QuantizedWeight:
    """One [N, K] weight as MatMulNBits holds it (see the module docstring)."""

    codes: np.ndarray  # uint8 [N, blocks, BLOCK_SIZE * bits / 8]
    scales: np.ndarray  # float32 [N, blocks]
    zero_points: np.ndarray  # uint8 [N, blocks] (int8) or [N, ceil(blocks / 2)] (int4)
    bits: int
    k: int  # the unpadded input size

    def unpacked(self) -> tuple[np.ndarray, np.ndarray]:
        """(codes [N, blocks, BLOCK_SIZE], zero points [N, blocks]) one value per entry."""
        if self.bits == 8:
            return self.codes, self.zero_points
        codes = np.stack([self.codes & 0xF, self.codes >> 4], -1).reshape(*self.codes.shape[:2], -1)
        zeros = np.stack([self.zero_points & 0xF, self.zero_points >> 4], -1).reshape(len(self.zero_points), -1)
        return codes, zeros[:, : self.scales.shape[1]]

    def dequantize(self) -> np.ndarray:
        """[N, K] float32: (q - z) * s per block, the padding dropped."""
        codes, zeros = self.unpacked()
        blocks = (codes.astype(np.float32) - zeros[..., None].astype(np.float32)) * self.scales[..., None]
        return blocks.reshape(len(blocks), -1)[:, : self.k]


def quantize_blocks(weight: np.ndarray, bits: int) -> QuantizedWeight:
    """Quantize a float [N, K] weight (output channels by inputs) in blocks of BLOCK_SIZE along K."""
    n, k = weight.shape
    blocks = -(-k // BLOCK_SIZE)
    w = np.zeros((n, blocks * BLOCK_SIZE), np.float32)
    w[:, :k] = weight
    w = w.reshape(n, blocks, BLOCK_SIZE)  # [N, blocks, BLOCK_SIZE]
    top = (1 << bits) - 1
    low, high = np.minimum(w.min(-1), 0.0), np.maximum(w.max(-1), 0.0)  # [N, blocks], 0 inside the range
    scales = ((high - low) / top).astype(np.float32)
    scales[scales == 0] = 1.0  # an all-zero block: any scale represents it
    zeros = np.clip(np.round(-low / scales), 0, top).astype(np.uint8)
    codes = np.clip(np.round(w / scales[..., None]) + zeros[..., None], 0, top).astype(np.uint8)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
        zeros = np.pad(zeros, ((0, 0), (0, blocks % 2)))
        zeros = zeros[:, 0::2] | (zeros[:, 1::2] << 4)
    return QuantizedWeight(codes, scales, zeros, bits, k)


def check_scheme(scheme: str) -> str:
    if scheme not in WEIGHT_SCHEMES:
        raise UserError(f"unknown --weights {scheme!r}; use one of {', '.join(WEIGHT_SCHEMES)}")
    return scheme


def quantize_graph(proto: Any, scheme: str) -> tuple[Any, dict[str, np.ndarray]]:
    """Replace every projection Gemm(x, W, transB=1) whose W is a float initializer by a MatMulNBits node holding W
    quantized (`scheme` int8 or int4). -> (the graph, {W's name: the dequantized [N, K] it now multiplies by}).

    A W that other nodes also read (a tied embedding's lookup) keeps its float initializer for them.
    """
    import onnx
    from onnx import helper, numpy_helper

    bits = BITS[scheme]
    graph = proto.graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    used: dict[str, np.ndarray] = {}
    nodes = []
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        weight = initializers.get(node.input[1]) if node.op_type == "Gemm" and len(node.input) == 2 else None
        if (weight is None or attrs.get("transB") != 1 or attrs.get("transA", 0) != 0 or attrs.get("alpha", 1.0) != 1.0
                or weight.data_type != onnx.TensorProto.FLOAT or len(weight.dims) != 2):
            nodes.append(node)
            continue
        name = weight.name
        blocks = quantize_blocks(numpy_helper.to_array(weight), bits)
        n, k = blocks.scales.shape[0], blocks.k
        graph.initializer.extend([
            numpy_helper.from_array(blocks.codes, f"{name}.q{bits}"),
            numpy_helper.from_array(blocks.scales.reshape(-1), f"{name}.q{bits}.scales"),
            numpy_helper.from_array(blocks.zero_points.reshape(-1), f"{name}.q{bits}.zero_points"),
        ])
        nodes.append(helper.make_node(
            "MatMulNBits", [node.input[0], f"{name}.q{bits}", f"{name}.q{bits}.scales", f"{name}.q{bits}.zero_points"],
            list(node.output), name=node.name, domain=CONTRIB_DOMAIN, K=k, N=n, bits=bits, block_size=BLOCK_SIZE,
        ))
        used[name] = blocks.dequantize()
        readers[name] -= 1
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
