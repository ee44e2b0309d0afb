"""The query, key and value of an exported Llama layer as one RotaryQKV node of onnxruntime_rotary.c, for onnxruntime.

The export (model/llama.py through torch.onnx) spends 14 nodes of a layer between its fused QKV product and its
LookaheadAttention node:

    heads = Reshape(qkv, [-1, Hq + 2 Hkv, D])
    qk    = Slice(heads, 0, Hq + Hkv, axis 1)                                   the heads that rotate
    roped = Add(Mul(qk, cos), Mul(Concat(Slice(qk, D/2, D), Slice(qk, 0, D/2), axis -1), sin))
    q     = Reshape(Slice(roped, 0, Hq, axis 1), q_shape)                        [B, T, Hq, D]
    k     = Reshape(Slice(roped, Hq, .., axis 1), kv_shape)                      [B, T, Hkv, D]
    v     = Reshape(Slice(heads, Hq + Hkv, .., axis 1), kv_shape)

and each costs a step onnxruntime's per-node overhead, a sizeable share of a small model's step at one token
(docs/design.md 6.4). `native_rotary` finds exactly that pattern in front of each LookaheadAttention node and puts
one RotaryQKV(qkv, cos, sin, q_shape, kv_shape) -> (q, k, v) in its place; the kernel computes the same float32
products and sums in the same order, so every result keeps its bits. Anything else (another split or rotation, an
intermediate read by another node or a graph output, another dtype) stays as it is. Imports kernels.onnx_op.
"""

from __future__ import annotations

import onnx
from onnx import helper

from trt_lookahead.kernels.onnx_op import NATIVE_DOMAIN, NodeLookup, fuse_nodes
from trt_lookahead.kernels.reference import OP_DOMAIN, OP_NAME

NATIVE_ROTARY = "RotaryQKV"  # the node onnxruntime_rotary.c registers (its name there, written once more in C)


def _match(g: NodeLookup, attention: onnx.NodeProto) -> tuple[list[onnx.NodeProto], onnx.NodeProto] | None:
    """(the 14 nodes that make `attention`'s query, key and value, the RotaryQKV node that replaces them), or None
    where `attention` is no LookaheadAttention node or they are not the module docstring's pattern."""
    if attention.op_type != OP_NAME or attention.domain != OP_DOMAIN:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in attention.attribute}
    hq, hkv, d = attrs["num_q_heads"], attrs["num_kv_heads"], attrs["head_dim"]
    q, k, v = attention.input[:3]
    rq, rk, rv = (g.made(name, "Reshape", reads=None) for name in (q, k, v))
    if rq is None or rk is None or rv is None or rk.input[1] != rv.input[1]:
        return None
    sq, sk, sv = (g.made(r.input[0], "Slice") for r in (rq, rk, rv))
    roped = g.sliced(sq, (1,), 0, hq)
    keys = g.sliced(sk, (1,), hq, hq + hkv, open_end=True)
    add = g.made(roped, "Add", reads=2) if roped is not None and roped == keys else None
    if add is None:
        return None
    direct, turned = (g.made(name, "Mul") for name in add.input)
    roll = g.made(turned.input[0], "Concat") if turned is not None else None
    if direct is None or roll is None or len(roll.input) != 2:
        return None
    if [a.i for a in roll.attribute if a.name == "axis"] not in ([2], [-1]):
        return None
    qk = direct.input[0]
    second, first = (g.made(name, "Slice") for name in roll.input)
    if g.sliced(second, (2, -1), d // 2, d, open_end=True) != qk or g.sliced(first, (2, -1), 0, d // 2) != qk:
        return None
    pre = g.made(qk, "Slice", reads=3)
    if sq is None or sk is None or sv is None or turned is None or second is None or first is None or pre is None:
        return None  # none is: `sliced` finds nothing in a missing node
    heads = g.sliced(pre, (1,), 0, hq + hkv)
    values = g.sliced(sv, (1,), hq + hkv, hq + 2 * hkv, open_end=True)
    split = g.made(heads, "Reshape", reads=2) if heads is not None and heads == values else None
    if split is None or g.ints.get(split.input[1]) != [-1, hq + 2 * hkv, d]:
        return None
    replaced = [split, pre, second, first, roll, direct, turned, add, sq, sk, sv, rq, rk, rv]
    fused = helper.make_node(NATIVE_ROTARY, [split.input[0], direct.input[1], turned.input[1], rq.input[1],
                                             rk.input[1]], [q, k, v], name=f"{attention.name}/rotary",
                             domain=NATIVE_DOMAIN, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    return replaced, fused


def native_rotary(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """(`model` with each layer's pattern (module docstring) one RotaryQKV node, how many layers it fused), in
    place. A float32 graph only: the kernel's dtype."""
    return fuse_nodes(model, _match)
