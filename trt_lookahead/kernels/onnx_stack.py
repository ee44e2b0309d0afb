"""torch.stack in an exported graph as one Concat and a Reshape, for onnxruntime: bit for bit the same values,
in 4 nodes (5 where a > 0) whatever the count of stacked tensors.

The export (model/llama.py through torch.onnx) stacks the new keys and values of every layer into the graph's
present_keys and present_values, and torch.stack(xs, dim=a) exports as an Unsqueeze(x_i, [a]) of each input and
one Concat(axis=a) of them: an Unsqueeze a layer for each (60 nodes for SmolLM2's keys and values) that moves no
data but costs a step onnxruntime's per-node overhead (docs/design.md 6.4). `concat_stacks` puts in their place

    cat   = Concat(x_0, ..., x_{n-1}, axis=a)                     [.., n * d_a, ..]: x_i's d_a slices at i * d_a
    shape = Concat(Shape(x_0, end=a), [n], Shape(x_0, start=a))   [.., n, d_a, ..] (no first Shape where a = 0)
    out   = Reshape(cat, shape, allowzero = 1)                    out[.., i, j, ..] = x_i[.., j, ..]

Worked example: x_0 = [[1, 2]], x_1 = [[3, 4]] (each [1, 2]) stacked at a = 0: cat = [[1, 2], [3, 4]] [2, 2],
shape = [2, 1, 2], out = [[[1, 2]], [[3, 4]]], torch.stack's. The inputs of a valid stack have one shape (Concat
needs every dim but the unsqueezed one equal), so x_0's is every input's. Only where each Concat input is an
Unsqueeze that adds the one constant axis a >= 0, read by that Concat alone, the Concat's axis is a, and the
graph declares the inputs' rank, above a (a stack at the last axis interleaves them), in a graph of opset 15 or
later (Shape's start and end); anything else stays. Standard ops: every onnxruntime engine
takes it, with or without the C kernels. Imports kernels.onnx_op.
"""

from __future__ import annotations

import onnx
from onnx import helper

from trt_lookahead.kernels.onnx_op import Graph, NodeLookup, replace_nodes

SHAPE_START_END = 15  # the first default-domain opset whose Shape takes start and end


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    """The rank of each value the graph declares a shape for (its inputs, outputs and value_info)."""
    graph = model.graph
    return {v.name: len(v.type.tensor_type.shape.dim) for v in (*graph.input, *graph.output, *graph.value_info)
            if v.type.tensor_type.HasField("shape")}


def _stacked(g: NodeLookup, ranks: dict[str, int], concat: onnx.NodeProto) -> tuple[list[onnx.NodeProto], int] | None:
    """(the Unsqueeze nodes that make `concat`'s inputs, the axis a they add) where `concat` is the module
    docstring's stack of inputs of a declared rank above a, else None (a stack at the last axis interleaves its
    inputs: no Concat of them)."""
    if concat.op_type != "Concat" or concat.domain:
        return None
    axis = next((helper.get_attribute_value(a) for a in concat.attribute if a.name == "axis"), None)
    unsqueezes = [g.made(name, "Unsqueeze") for name in concat.input]
    if axis is None or axis < 0 or not unsqueezes or any(
            node is None or len(node.input) != 2 or g.ints.get(node.input[1]) != [axis] for node in unsqueezes):
        return None
    if ranks.get(unsqueezes[0].input[0], 0) <= axis:  # type: ignore[union-attr]
        return None
    return unsqueezes, axis  # type: ignore[return-value]


def concat_stacks(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """(`model` with each stack of the module docstring as one Concat and a Reshape, how many), in place."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < SHAPE_START_END:
        return model, 0
    nodes = list(model.graph.node)  # one list of the nodes throughout: positions name them
    lookup, ranks = NodeLookup(model, nodes), _ranks(model)
    position = {id(node): i for i, node in enumerate(nodes)}
    replaced: dict[int, list[onnx.NodeProto]] = {}
    dropped: set[int] = set()
    for i, concat in enumerate(nodes):
        found = _stacked(lookup, ranks, concat)
        if found is None:
            continue
        unsqueezes, axis = found
        xs = [node.input[0] for node in unsqueezes]
        g = Graph(f"{concat.name or concat.output[0]}/stack")
        cat = g.op("Concat", *xs, axis=axis)
        before = [g.op("Shape", xs[0], end=axis)] if axis else []  # the dims ahead of the stacked axis
        shape = g.op("Concat", *before, g.const([len(xs)]), g.op("Shape", xs[0], start=axis), axis=0)
        # allowzero: a dim of 0 (an empty batch) is that size, not "the input's dim here"
        g.nodes.append(helper.make_node("Reshape", [cat, shape], list(concat.output), name=g.fresh(), allowzero=1))
        model.graph.initializer.extend(g.initializers)
        replaced[i] = g.nodes
        dropped |= {position[id(node)] for node in unsqueezes}
    replace_nodes(model, nodes, replaced, dropped)
    read = {name for node in model.graph.node for name in node.input}
    unread = {name for i in dropped for name in nodes[i].input} - read  # the Unsqueezes' axes, if only theirs
    kept = [t for t in model.graph.initializer if t.name not in unread]  # onnxruntime warns of an unread one
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return model, len(replaced)
