"""The fast LookaheadAttention decomposition's size per layer (onnxruntime pays per node, and SmolLM2 has 30
layers: scripts/profile_cpu_step.py) and that its shortcuts keep the reference's values.

A graph of L attention nodes, each read by one Reshape as the export's layers are: the masks, their casts and
the step + cache column count are built once per graph, and the Reshape after each node is merged into the
decomposition's own last one, or (the C kernel's MaskedAttention) into the node as its merged heads.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from trt_lookahead.backends.open import open_engine
from trt_lookahead.kernels import onnx_op, reference
from trt_lookahead.kernels.onnxruntime_library import native_library

Hq, Hkv, D, S = 8, 4, 8, 64
PER_LAYER = 22  # nodes the fast decomposition writes per layer, in place of the node and the Reshape after it


def layered_model(layers: int, shape: list[int]) -> onnx.ModelProto:
    """`layers` LookaheadAttention nodes over their own q/k/v and caches, sharing cache_len, step_config and
    tree_ends, each read by one Reshape to `shape` (the graph's outputs y0, y1, ..)."""
    names = ["cache_len", "step_config"]
    inputs = [helper.make_tensor_value_info("cache_len", TensorProto.INT32, ["B"]),
              helper.make_tensor_value_info("step_config", TensorProto.INT32, ["B", 3])]
    nodes, outputs = [], []
    for layer in range(layers):
        fed = [f"{n}{layer}" for n in ("q", "k", "v", "kc", "vc")]
        shapes: list[list[str | int]] = [["B", "T", Hq, D], ["B", "T", Hkv, D], ["B", "T", Hkv, D],
                                         ["B", Hkv, S, D], ["B", Hkv, S, D]]
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in zip(fed, shapes, strict=True)]
        nodes.append(onnx_op.make_node([*fed, *names, "tree_ends"], f"a{layer}", f"attention{layer}", num_q_heads=Hq,
                                       num_kv_heads=Hkv, head_dim=D, scale=reference.default_scale(D)))
        nodes.append(helper.make_node("Reshape", [f"a{layer}", "shape"], [f"y{layer}"]))
        outputs.append(helper.make_tensor_value_info(f"y{layer}", TensorProto.FLOAT, [None] * len(shape)))
    initializers = [numpy_helper.from_array(onnx_op.tree_ends_input(None, 16), "tree_ends"),
                    numpy_helper.from_array(np.array(shape, np.int64), "shape")]
    graph = helper.make_graph(nodes, "layers", inputs, outputs, initializer=initializers)
    return helper.make_model(graph, opset_imports=onnx_op.opset_imports(23), ir_version=10)


def op_counts(model: onnx.ModelProto) -> collections.Counter[str]:
    return collections.Counter(n.op_type for n in model.graph.node)


def test_the_fast_decomposition_adds_a_bounded_node_count_per_layer_and_casts_once():
    one, three = (onnx_op.decompose(layered_model(n, [-1, Hq * D])) for n in (1, 3))
    per_layer = (len(three.graph.node) - len(one.graph.node)) // 2
    assert per_layer <= PER_LAYER, op_counts(three) - op_counts(one)
    casts = [op_counts(m)["Cast"] + op_counts(m)["CastLike"] for m in (one, three)]
    assert casts[0] == casts[1]  # the masks are cast (float32: not at all) once per graph, not per layer
    assert not any(f"a{layer}" in n.input for n in three.graph.node for layer in range(3))  # Reshapes merged


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    native_library().path is None, reason=f"no C kernels here: {native_library().why}"))], ids=["ops", "native"])
@pytest.mark.parametrize("shape", [[-1, Hq * D], [0, 0, Hq * D], [-1, 2, Hq * D // 2]],
                         ids=["merged-heads", "shape-with-zero", "other-shape"])
def test_a_reshape_after_the_node_keeps_the_references_values(shape, native):
    """The merged Reshape (a constant shape without zeros, which the decomposition or the C kernel (native) writes)
    and one that is kept (a zero copies a dimension of its input, so it depends on the node's own output shape)
    both give the reference's values."""
    import onnxruntime as ort

    layers, rows = 2, [((4, 3, 4), 0), ((1, 2, 0), 30), ((0, 0, 0), 5)]
    T = 16
    model = onnx_op.decompose(layered_model(layers, shape), native=native)
    onnx.checker.check_model(model)
    merged = not any(f"a{layer}" in n.input for n in model.graph.node for layer in range(layers))
    assert merged == (0 not in shape)
    options = ort.SessionOptions()
    if native:
        options.register_custom_ops_library(str(native_library().path))
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    configs = np.array([c for c, _ in rows], np.int32)
    lengths = np.array([p for _, p in rows], np.int32)
    feeds: dict[str, np.ndarray] = {"cache_len": lengths, "step_config": configs}
    B = len(rows)
    for layer in range(layers):
        for name, dims in (("q", (B, T, Hq, D)), ("k", (B, T, Hkv, D)), ("v", (B, T, Hkv, D)),
                           ("kc", (B, Hkv, S, D)), ("vc", (B, Hkv, S, D))):
            feeds[f"{name}{layer}"] = rng.standard_normal(dims).astype(np.float32)
    outputs = session.run(None, feeds)
    for layer, out in enumerate(outputs):
        tensors = [torch.from_numpy(feeds[f"{n}{layer}"]) for n in ("q", "k", "v", "kc", "vc")]
        q, k, v, kc, vc = tensors
        expected = reference.lookahead_attention(q, k, v, kc, vc, torch.from_numpy(lengths), configs)
        dims = [(B, T, Hq, D)[i] if d == 0 else d for i, d in enumerate(shape)]  # ONNX's 0: the input's dim
        assert out.shape == np.empty((B, T, Hq, D)).reshape(dims).shape
        got = torch.from_numpy(out.reshape(B, T, Hq, D))
        for b in range(B):
            assert reference.relative_error(got[b], expected[b]) < 1e-5, (layer, rows[b])


@pytest.mark.skipif(native_library().path is None, reason=f"no C kernels here: {native_library().why}")
def test_an_engine_with_merged_heads_has_the_bits_of_its_reshapes(engine_dir, greedy_run):
    """A real stories260K engine's MaskedAttention nodes write the merged heads the output projection reads, one
    Reshape a layer fewer, with the bits of the kept Reshapes."""
    kept = greedy_run(lambda patch: patch.setattr(onnx_op, "_reshape_after", lambda model: {}))
    merged = greedy_run()
    layers = open_engine(engine_dir, verify=False).config.num_layers
    assert kept.ops.count("Reshape") - merged.ops.count("Reshape") == layers
    assert merged.tokens == kept.tokens and merged.logits.tobytes() == kept.logits.tobytes()
    assert merged.keys.tobytes() == kept.keys.tobytes()
    graph = open_engine(engine_dir, verify=False).graph().graph
    readers = {name: node.op_type for node in graph.node for name in node.input}
    attention = [node for node in graph.node if node.op_type == onnx_op.NATIVE_OP]
    assert len(attention) == layers and all(readers[node.output[0]] == "Gemm" for node in attention)
