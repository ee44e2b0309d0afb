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
from onnx import TensorProto, helper, numpy_helper

from trt_lookahead.kernels.onnx_op import NATIVE_DOMAIN, attention_nodes, elem_type, replace_nodes

NATIVE_ROTARY = "RotaryQKV"  # the node onnxruntime_rotary.c registers (its name there, written once more in C)


class _Graph:
    """Lookups over a graph: who makes and who reads each value, and its small int64 constants."""

    def __init__(self, model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> None:
        self.maker = {name: node for node in nodes for name in node.output}
        self.readers: dict[str, int] = {}
        for node in nodes:
            for name in node.input:
                self.readers[name] = self.readers.get(name, 0) + 1
        self.outputs = {value.name for value in model.graph.output}
        self.ints = {t.name: numpy_helper.to_array(t).reshape(-1).tolist() for t in model.graph.initializer
                     if t.data_type == TensorProto.INT64 and t.data_location != TensorProto.EXTERNAL}

    def made(self, name: str, op_type: str, reads: int | None = 1) -> onnx.NodeProto | None:
        """The node of `op_type` that makes `name`, where `name` is no graph output and (unless `reads` is None)
        exactly `reads` node inputs read it, so that the node may go; else None."""
        node = self.maker.get(name)
        if node is None or node.op_type != op_type or node.domain or name in self.outputs:
            return None
        return node if reads is None or self.readers.get(name, 0) == reads else None

    def sliced(self, node: onnx.NodeProto | None, axes: tuple[int, ...], start: int, end: int,
               open_end: bool = False) -> str | None:
        """The input `node` slices along one of `axes` from `start` to `end` (open_end: to `end` or past it, where
        the data ends), step 1; else None."""
        if node is None or node.op_type != "Slice" or len(node.input) < 4:
            return None
        starts, ends, axis = (self.ints.get(name) for name in node.input[1:4])
        steps = self.ints.get(node.input[4]) if len(node.input) > 4 and node.input[4] else [1]
        if starts != [start] or axis is None or len(axis) != 1 or axis[0] not in axes or steps != [1]:
            return None
        if ends is None or len(ends) != 1 or not (ends[0] >= end if open_end else ends[0] == end):
            return None
        return node.input[0]


def _match(g: _Graph, attention: onnx.NodeProto) -> tuple[list[onnx.NodeProto], onnx.NodeProto] | None:
    """(the 14 nodes that make `attention`'s query, key and value, the RotaryQKV node that replaces them), or None
    where they are not the module docstring's pattern."""
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
    nodes = attention_nodes(model)
    if not nodes or elem_type(model, nodes[0].input[3]) != TensorProto.FLOAT:
        return model, 0
    listed = list(model.graph.node)  # one list of the nodes throughout: positions name them
    g = _Graph(model, listed)
    position = {id(node): i for i, node in enumerate(listed)}
    gone: set[int] = set()
    at: dict[int, onnx.NodeProto] = {}  # fused nodes by position: their last replaced node's
    for attention in nodes:
        found = _match(g, attention)
        if found is None:
            continue
        replaced, fused = found
        spots = {position[id(node)] for node in replaced}
        last = max(spots)
        if any(set(node.input) & set(fused.output) for node in listed[:last]):
            continue  # a reader of q, k or v ahead of the fused node's place: the graph's order would break
        gone |= spots
        at[last] = fused
    replace_nodes(model, listed, at, gone - set(at))
    return model, len(at)
