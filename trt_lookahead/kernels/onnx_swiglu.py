"""A Llama MLP's gate-up activation as one SwiGLU node of onnxruntime_swiglu.c, for onnxruntime.

The export (model/llama.py through torch.onnx) spends 4 nodes of a layer between its fused gate-up product and
its down product:

    gate, up = Split(h, axis, num_outputs = 2)        h [rows, 2F]: the gate's F columns, then the up's
    y        = Mul(Mul(gate, Sigmoid(gate)), up)      silu(gate) * up, [rows, F]

each a pass over the product and a step's per-node overhead (docs/design.md 6.4). `native_swiglu` finds exactly
that pattern (either operand order of each Mul) and puts one SwiGLU(h) -> y with Split's axis in its place.
Anything else (a Split into other sizes, an intermediate read by another node or a graph output, another dtype)
stays as it is. The kernel's sigmoid is its own approximation, so a graph's results move by a few units in the
last place against the standard nodes' (onnxruntime_swiglu.c), the same for every row. Imports kernels.onnx_op.
"""

from __future__ import annotations

import onnx
from onnx import helper

from trt_lookahead.kernels.onnx_op import NATIVE_DOMAIN, NodeLookup, fuse_nodes

NATIVE_SWIGLU = "SwiGLU"  # the node onnxruntime_swiglu.c registers (its name there, written once more in C)


def _match(g: NodeLookup, product: onnx.NodeProto) -> tuple[list[onnx.NodeProto], onnx.NodeProto] | None:
    """(the Split, Sigmoid and Mul nodes that make the Mul `product`'s operands and `product`, the SwiGLU node
    that replaces them), or None where `product` is no Mul or they are not the module docstring's pattern."""
    if product.op_type != "Mul" or product.domain:
        return None
    for silu, up in (product.input, product.input[::-1]):
        scaled = g.made(silu, "Mul")
        if scaled is None:
            continue
        for gate, sigmoid_out in (scaled.input, scaled.input[::-1]):
            sigmoid = g.made(sigmoid_out, "Sigmoid")
            split = g.made(gate, "Split", reads=2)
            if sigmoid is None or split is None or sigmoid.input[0] != gate or list(split.output) != [gate, up]:
                continue
            attrs = {a.name: helper.get_attribute_value(a) for a in split.attribute}
            sizes = (len(split.input) > 1 and split.input[1]) or "split" in attrs  # other cuts than two halves
            if g.made(up, "Split") is not split or sizes or attrs.get("num_outputs", 2) != 2:
                continue
            fused = helper.make_node(NATIVE_SWIGLU, [split.input[0]], list(product.output),
                                     name=f"{product.name}/swiglu", domain=NATIVE_DOMAIN, axis=attrs.get("axis", 0))
            return [split, sigmoid, scaled, product], fused
    return None


def native_swiglu(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """(`model` with each layer's pattern (module docstring) one SwiGLU node, how many it fused), in place. A
    float32 graph only: the kernel's dtype."""
    return fuse_nodes(model, _match)
