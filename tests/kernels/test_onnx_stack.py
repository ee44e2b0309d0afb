"""kernels/onnx_stack.concat_stacks under real onnxruntime: torch.stack's exported Unsqueeze-per-input and Concat
as one Concat and a Reshape gives np.stack's values bit for bit at every axis (an empty dim too), leaves anything
off the pattern as it is, and on a real stories260K engine takes every layer's Unsqueeze out of the step with the
logits, tokens and caches of the exported nodes, bit for bit."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from trt_lookahead.backends.open import open_engine
from trt_lookahead.kernels import onnx_stack
from trt_lookahead.kernels.onnx_stack import concat_stacks

INPUTS = 3  # tensors stacked by the hand-built graphs


def stack_graph(axis: int, concat_axis: int | None = None, opset: int = 17, rank: int | None = 3) -> onnx.ModelProto:
    """torch.stack of INPUTS float32 inputs x0.. of `rank` dims (None: undeclared) at `axis` as the export writes
    it: an Unsqueeze of each at `axis` (a constant input), one Concat of them along `concat_axis` (default:
    `axis`)."""
    nodes = [helper.make_node("Unsqueeze", [f"x{i}", "axes"], [f"u{i}"], name=f"unsqueeze{i}")
             for i in range(INPUTS)]
    nodes.append(helper.make_node("Concat", [f"u{i}" for i in range(INPUTS)], ["y"], name="stack",
                                  axis=axis if concat_axis is None else concat_axis))
    graph = helper.make_graph(
        nodes, "stack", [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, rank and [None] * rank)
                         for i in range(INPUTS)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, rank and [None] * (rank + 1))],
        [numpy_helper.from_array(np.array([axis], np.int64), "axes")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def run(model: onnx.ModelProto, xs: list[np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {f"x{i}": x for i, x in enumerate(xs)})[0]


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_a_stack_at_any_axis_is_one_concat_and_a_reshape_with_the_same_bits(axis):
    rng = np.random.default_rng(axis)
    xs = [rng.standard_normal((2, 3, 4)).astype(np.float32) for _ in range(INPUTS)]
    model = stack_graph(axis)
    plain = run(model, xs)
    model, stacks = concat_stacks(model)
    ops = [node.op_type for node in model.graph.node]
    assert stacks == 1 and "Unsqueeze" not in ops and ops.count("Concat") == 2 and ops.count("Reshape") == 1
    assert not model.graph.initializer[1:] and model.graph.initializer[0].name != "axes"  # only the count
    assert ops.count("Shape") == (2 if axis else 1)  # the dims ahead of the axis, where there are any
    stacked = run(model, xs)
    assert stacked.shape == plain.shape == np.stack(xs, axis).shape
    assert stacked.tobytes() == plain.tobytes() == np.stack(xs, axis).tobytes()
    onnx.checker.check_model(model)


def test_an_empty_dim_stacks_to_an_empty_tensor_of_the_right_shape():
    """A 0 in Shape's dims is that size (the Reshape's allowzero), not a copy of the Concat's dim there."""
    xs = [np.zeros((0, 3, 4), np.float32) for _ in range(INPUTS)]
    model, stacks = concat_stacks(stack_graph(0))
    assert stacks == 1 and run(model, xs).shape == (INPUTS, 0, 3, 4)


@pytest.mark.parametrize("change", ["concat axis", "negative axis", "last axis", "rank unknown", "unsqueeze read",
                                    "graph output", "opset 13"])
def test_a_graph_off_the_pattern_keeps_its_nodes(change):
    axis = {"negative axis": -1, "last axis": 3}.get(change, 1)
    model = stack_graph(axis, concat_axis=0 if change == "concat axis" else None,
                        opset=13 if change == "opset 13" else 17, rank=None if change == "rank unknown" else 3)
    if change in ("last axis", "rank unknown"):  # the graph runs, and stacks as np.stack does
        xs = [np.full((2, 3, 4), i, np.float32) for i in range(INPUTS)]
        assert run(model, xs).tobytes() == np.stack(xs, axis).tobytes()
    if change == "unsqueeze read":  # another node reads an Unsqueeze's output
        model.graph.node.append(helper.make_node("Neg", ["u1"], ["z"]))
        model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    if change == "graph output":
        model.graph.output.append(helper.make_tensor_value_info("u0", TensorProto.FLOAT, None))
    before = [node.SerializeToString() for node in model.graph.node]
    model, stacks = concat_stacks(model)
    assert stacks == 0 and [node.SerializeToString() for node in model.graph.node] == before


def test_an_engine_stacking_by_one_concat_has_the_bits_of_its_exported_nodes(engine_dir, greedy_run):
    """Both stacks (keys and values) rewritten: 2 Unsqueezes a layer fewer, 3 nodes more each; the same bits."""
    plain = greedy_run(lambda patch: patch.setattr(onnx_stack, "concat_stacks", lambda model: (model, 0)))
    stacked = greedy_run()
    layers = open_engine(engine_dir, verify=False).config.num_layers
    assert plain.ops.count("Unsqueeze") - stacked.ops.count("Unsqueeze") == 2 * layers
    assert len(plain.ops) - len(stacked.ops) == 2 * layers - 2 * 3
    assert stacked.tokens == plain.tokens
    assert stacked.logits.tobytes() == plain.logits.tobytes() and stacked.keys.tobytes() == plain.keys.tobytes()
    assert np.abs(stacked.keys).max() > 0  # the cache holds the committed keys, not zeros
