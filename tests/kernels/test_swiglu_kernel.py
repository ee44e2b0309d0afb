"""kernels/onnxruntime_swiglu.c's SwiGLU under real onnxruntime, and kernels/onnx_swiglu.native_swiglu that puts it
in place of each exported layer's Split, Sigmoid, Mul and Mul: silu(gate) * up within a few units in the last place
of float64's, a row's bits the same alone, batched and on any thread count, any split axis, every layer of a real
stories260K engine fused (its logits and tokens as the unfused graph's, to float32 rounding), a layer off the
pattern left as it is, and an odd split refused with the op's own message."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from trt_lookahead.backends.open import open_engine
from trt_lookahead.kernels import onnx_swiglu
from trt_lookahead.kernels.onnx_op import NATIVE_DOMAIN, attention_nodes
from trt_lookahead.kernels.onnx_swiglu import NATIVE_SWIGLU, native_swiglu
from trt_lookahead.kernels.onnxruntime_library import native_library

pytestmark = pytest.mark.skipif(native_library().path is None, reason=f"no C kernels here: {native_library().why}")
EPS = float(np.finfo(np.float32).eps)


def swiglu_session(axis: int, rank: int, threads: int = 1) -> ort.InferenceSession:
    """One SwiGLU node splitting a float32 input of `rank` dims along `axis`."""
    node = helper.make_node(NATIVE_SWIGLU, ["x"], ["y"], domain=NATIVE_DOMAIN, axis=axis)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None] * rank)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(NATIVE_DOMAIN, 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(str(native_library().path))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def silu_times_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """float64's silu(gate) * up, the function the node approximates."""
    g = gate.astype(np.float64)
    return g / (1.0 + np.exp(-g)) * up.astype(np.float64)


def test_silu_times_up_is_float64s_within_three_units_in_the_last_place():
    """Gates over the whole range the sigmoid bends in (and past it, where it saturates): each result within 3
    float32 units of the float64 value (relative), and far gates saturate to g * u or to about zero, not to NaN."""
    rng = np.random.default_rng(0)
    gate = np.concatenate([rng.standard_normal((7, 64)) * 6, np.linspace(-30, 30, 7 * 64).reshape(7, 64)])
    up = rng.standard_normal(gate.shape) * 3
    x = np.concatenate([gate, up], axis=1).astype(np.float32)
    y = swiglu_session(1, 2).run(None, {"x": x})[0]
    want = silu_times_up(x[:, :64], x[:, 64:])
    assert y.shape == (14, 64)
    assert np.all(np.abs(y - want) <= 3 * EPS * np.abs(want))
    far = np.array([[-1e4, -200.0, -88.0, 88.0, 200.0, 1e4, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]], np.float32)
    y = swiglu_session(1, 2).run(None, {"x": far})[0][0]
    assert np.all(np.abs(y[:3]) < 1e-30) and np.array_equal(y[3:], far[0, 3:6] * 2.0)


def test_a_row_has_the_same_bits_alone_batched_and_on_two_threads():
    """The exact step's premise: a row of a batch of 300 (parallel tasks on two threads) is the bits of the same
    row alone on one thread."""
    x = (np.random.default_rng(1).standard_normal((300, 2 * 96)) * 4).astype(np.float32)
    full = swiglu_session(-1, 2, threads=2).run(None, {"x": x})[0]
    alone = swiglu_session(-1, 2)
    for r in (0, 1, 150, 299):
        np.testing.assert_array_equal(alone.run(None, {"x": x[r:r + 1]})[0][0], full[r])
    np.testing.assert_array_equal(alone.run(None, {"x": x})[0], full)


def test_any_axis_splits_into_gate_then_up():
    """A [2, 6, 5] input split along its middle dim: the first 3 of it the gate, the last 3 the up values."""
    x = np.random.default_rng(2).standard_normal((2, 6, 5)).astype(np.float32)
    y = swiglu_session(1, 3).run(None, {"x": x})[0]
    want = silu_times_up(x[:, :3], x[:, 3:])
    assert y.shape == (2, 3, 5) and np.all(np.abs(y - want) <= 3 * EPS * np.abs(want))


def test_an_odd_split_dim_is_refused_by_name():
    with pytest.raises(Exception, match="SwiGLU: the input's split dim is odd"):
        swiglu_session(1, 2).run(None, {"x": np.zeros((2, 7), np.float32)})


def test_an_engine_with_swiglu_nodes_gives_the_tokens_of_its_own_nodes(engine_dir, greedy_run):
    """Every layer of a real stories260K engine fused (Split, Sigmoid and both Muls gone): the same greedy tokens,
    and logits within float32 rounding of the unfused graph's."""
    plain = greedy_run(lambda patch: patch.setattr(onnx_swiglu, "native_swiglu", lambda model: (model, 0)))
    fused = greedy_run()
    layers = open_engine(engine_dir, verify=False).config.num_layers
    assert plain.ops.count(NATIVE_SWIGLU) == 0 and "Sigmoid" in plain.ops
    assert fused.ops.count(NATIVE_SWIGLU) == layers and "Sigmoid" not in fused.ops
    assert fused.tokens == plain.tokens
    np.testing.assert_allclose(fused.logits, plain.logits, rtol=1e-4, atol=1e-4 * np.abs(plain.logits).max())


def test_a_layer_off_the_pattern_keeps_its_nodes(engine_dir):
    """Layer 0's gate read by a graph output, or its Split cut by given sizes: that layer keeps its 4 nodes, the
    others are fused; a non-float32 graph is left alone."""
    for change in ("read", "sizes", "float16"):
        model = onnx.load(str(engine_dir / "model.onnx"), load_external_data=False)
        layers = len(attention_nodes(model))
        split = next(node for node in model.graph.node if node.op_type == "Split")
        if change == "read":
            model.graph.output.append(helper.make_tensor_value_info(split.output[0], TensorProto.FLOAT, None))
        elif change == "sizes":
            attrs = [a for a in split.attribute if a.name != "num_outputs"]
            del split.attribute[:]
            split.attribute.extend(attrs)
            split.input.append("sizes")
        else:
            for value in model.graph.input:
                if value.name.startswith("key_cache"):
                    value.type.tensor_type.elem_type = TensorProto.FLOAT16
        before = len(model.graph.node)
        model, fused = native_swiglu(model)
        if change == "float16":
            assert fused == 0 and len(model.graph.node) == before
            continue
        assert fused == layers - 1 and len(model.graph.node) == before - 3 * (layers - 1)
        assert split in model.graph.node
