"""kernels/onnxruntime_rotary.c's RotaryQKV under real onnxruntime, and kernels/onnx_rotary.native_rotary that puts
it in place of each exported layer's QKV split and rotary embedding: the same bits as numpy's float32 products and
sums, and as the graph it replaces (a real stories260K engine, alone and in a lookahead step), every layer fused,
a layer off the pattern left as it is, and shapes that disagree refused with the op's own message."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from trt_lookahead.backends.onnxruntime import SessionSettings
from trt_lookahead.backends.open import open_engine
from trt_lookahead.kernels import onnx_rotary
from trt_lookahead.kernels.onnx_op import NATIVE_DOMAIN, attention_nodes
from trt_lookahead.kernels.onnx_rotary import NATIVE_ROTARY, native_rotary
from trt_lookahead.kernels.onnxruntime_library import native_library
from trt_lookahead.lookahead.executor import StepBatch
from trt_lookahead.lookahead.sampling import SamplingParams

pytestmark = pytest.mark.skipif(native_library().path is None, reason=f"no C kernels here: {native_library().why}")
HQ, HKV, D = 3, 2, 8


def rotary_session() -> ort.InferenceSession:
    """One RotaryQKV node of HQ query and HKV key/value heads of D."""
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["R", (HQ + 2 * HKV) * D]),
              helper.make_tensor_value_info("cos", TensorProto.FLOAT, ["R", 1, D]),
              helper.make_tensor_value_info("sin", TensorProto.FLOAT, ["R", 1, D]),
              helper.make_tensor_value_info("q_shape", TensorProto.INT64, [4]),
              helper.make_tensor_value_info("kv_shape", TensorProto.INT64, [4])]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in "qkv"]
    node = helper.make_node(NATIVE_ROTARY, [i.name for i in inputs], ["q", "k", "v"], domain=NATIVE_DOMAIN,
                            num_q_heads=HQ, num_kv_heads=HKV, head_dim=D)
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(NATIVE_DOMAIN, 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(native_library().path))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_heads_rotate_as_float32_products_and_a_sum():
    """q and k: x * cos + roll(x, D/2) * sin, each product and the sum rounded to float32 (numpy's float32 ops:
    the Mul, Mul and Add nodes' own arithmetic), bit for bit; v: the value heads as they are."""
    B, T = 2, 3
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((B * T, (HQ + 2 * HKV) * D)) * 3).astype(np.float32)
    cos, sin = (rng.standard_normal((B * T, 1, D)).astype(np.float32) for _ in range(2))
    q, k, v = rotary_session().run(None, {"x": x, "cos": cos, "sin": sin, "q_shape": np.array([B, T, HQ, D]),
                                          "kv_shape": np.array([B, T, HKV, D])})
    heads = x.reshape(B * T, HQ + 2 * HKV, D)
    rotated = heads[:, : HQ + HKV] * cos + np.concatenate([heads[:, : HQ + HKV, D // 2:],
                                                           heads[:, : HQ + HKV, : D // 2]], axis=2) * sin
    assert q.shape == (B, T, HQ, D) and k.shape == v.shape == (B, T, HKV, D)
    np.testing.assert_array_equal(q.reshape(B * T, HQ, D), rotated[:, :HQ])
    np.testing.assert_array_equal(k.reshape(B * T, HKV, D), rotated[:, HQ:])
    np.testing.assert_array_equal(v.reshape(B * T, HKV, D), heads[:, HQ + HKV:])


def test_an_inferred_batch_or_token_dim_is_inferred_as_reshape_does():
    """q_shape (-1, T, ..) and kv_shape (B, -1, ..), as an export may write them: the outputs' dims B and T."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, (HQ + 2 * HKV) * D)).astype(np.float32)
    table = rng.standard_normal((6, 1, D)).astype(np.float32)
    q, k, v = rotary_session().run(None, {"x": x, "cos": table, "sin": table, "q_shape": np.array([-1, 3, HQ, D]),
                                          "kv_shape": np.array([2, -1, HKV, D])})
    assert q.shape == (2, 3, HQ, D) and k.shape == v.shape == (2, 3, HKV, D)
    np.testing.assert_array_equal(v.reshape(6, HKV * D), x[:, (HQ + HKV) * D:])


def test_shapes_that_disagree_are_refused_by_name():
    x = np.zeros((6, (HQ + 2 * HKV) * D), np.float32)
    table = np.zeros((6, 1, D), np.float32)
    with pytest.raises(Exception, match="RotaryQKV: input shapes disagree"):
        rotary_session().run(None, {"x": x, "cos": table, "sin": table, "q_shape": np.array([2, 3, HQ + 1, D]),
                                    "kv_shape": np.array([2, 3, HKV, D])})
    with pytest.raises(Exception, match="RotaryQKV: input shapes disagree"):  # B x T not the rows
        rotary_session().run(None, {"x": x, "cos": table, "sin": table, "q_shape": np.array([4, -1, HQ, D]),
                                    "kv_shape": np.array([4, -1, HKV, D])})
    with pytest.raises(Exception, match="RotaryQKV: input shapes disagree"):  # a row short of cos
        rotary_session().run(None, {"x": x, "cos": table[:5], "sin": table, "q_shape": np.array([2, 3, HQ, D]),
                                    "kv_shape": np.array([2, 3, HKV, D])})


def run_steps(engine_dir, monkeypatch, fused: bool) -> list[np.ndarray]:
    """The first tokens of two prefills, the logits of a greedy step and of a lookahead step of both rows, and the KV
    caches after both steps' commits (their keys and values), on an engine
    whose graph has RotaryQKV nodes (fused) or the exported layers' own nodes."""
    if not fused:
        monkeypatch.setattr(onnx_rotary, "native_rotary", lambda model: (model, 0))
    engine = open_engine(engine_dir, session=SessionSettings(threads=2))
    layers = engine.config.num_layers
    ops = [node.op_type for node in engine.graph().graph.node]
    assert ops.count(NATIVE_ROTARY) == (layers if fused else 0) and ("Slice" in ops) != fused
    ex = engine.executor()
    got = []
    for slot, prompt in enumerate((np.arange(1, 30), np.arange(40, 51))):
        got.append(np.array(ex.prefill(slot, prompt, SamplingParams())))
    ex.step(StepBatch(np.array([0]), np.array([[7]]), np.array([[29]]), np.array([[1, 2, 0]], np.int32),
                      np.array([[0]])))
    got.append(ex.step_logits().copy())
    ex.commit(0, np.array([0]))
    T = (2 + 2) * (3 - 1)
    ex.step(StepBatch(np.array([0, 1]), np.arange(2 * T).reshape(2, T) % 500 + 3,
                      np.array([np.arange(30, 30 + T), np.arange(11, 11 + T)]), np.array([[2, 3, 2]] * 2, np.int32),
                      np.tile(np.arange(T), (2, 1))))
    got.append(ex.step_logits().copy())
    ex.commit(0, np.array([0, 2, 5]))
    ex.commit(1, np.arange(T))
    got += [ex.k_cache.copy(), ex.v_cache.copy()]
    monkeypatch.undo()
    return got


def test_an_engine_with_rotary_nodes_keeps_every_bit(engine_dir, monkeypatch):
    """Every layer of a real stories260K engine fused (its 14 nodes gone), and the prefill, greedy and two-row
    lookahead logits and the KV caches the bits of the unfused graph's."""
    plain, fused = run_steps(engine_dir, monkeypatch, False), run_steps(engine_dir, monkeypatch, True)
    for a, b in zip(plain, fused, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_layer_off_the_pattern_keeps_its_nodes(engine_dir):
    """Layer 0's rotation read by a graph output, or rotating the other way: that layer keeps its 14 nodes, the
    others are fused."""
    for change in ("read", "turn"):
        model = onnx.load(str(engine_dir / "model.onnx"), load_external_data=False)
        layers = len(attention_nodes(model))
        makers = {name: node.op_type for node in model.graph.node for name in node.output}
        roll = next(node for node in model.graph.node if node.op_type == "Concat" and len(node.input) == 2
                    and all(makers.get(name) == "Slice" for name in node.input))
        if change == "read":
            model.graph.output.append(helper.make_tensor_value_info(roll.output[0], TensorProto.FLOAT, None))
        else:
            roll.input[:] = list(reversed(roll.input))
        before = len(model.graph.node)
        model, fused = native_rotary(model)
        assert fused == layers - 1 and len(model.graph.node) == before - 13 * (layers - 1)
        assert roll in model.graph.node


def test_a_non_float32_graph_is_left_alone(engine_dir):
    model = onnx.load(str(engine_dir / "model.onnx"), load_external_data=False)
    for value in model.graph.input:
        if value.name.startswith("key_cache"):
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    assert native_rotary(model)[1] == 0
