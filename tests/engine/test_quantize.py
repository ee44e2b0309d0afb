"""Weight-only int8 / int4 engines: block quantization against hand-computed blocks, the graph pass under real
onnxruntime, and quantized stories260K engines whose lookahead output equals their own greedy output."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from trt_lookahead.backends.open import open_engine
from trt_lookahead.cli import main
from trt_lookahead.engine.quantize import BLOCK_SIZE, quantize_blocks, quantize_graph
from trt_lookahead.errors import UserError
from trt_lookahead.runtime import LookaheadRuntime

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
BLOCK = np.zeros(BLOCK_SIZE, np.float32)
BLOCK[:4] = [-1.0, 0.6, 2.0, 0.3]  # the module docstring's worked example


def test_an_int4_block_by_hand():
    q = quantize_blocks(BLOCK[None, :], bits=4)
    assert q.scales.shape == (1, 1) and q.scales[0, 0] == pytest.approx(0.2)
    assert q.zero_points.tolist() == [[5]]  # one block: its zero point in the low nibble of one byte
    # codes 0, 8, 15, 7, then 5 (zero) for the rest; two per byte, low nibble first
    assert q.codes[0, 0, :3].tolist() == [0 | 8 << 4, 15 | 7 << 4, 5 | 5 << 4]
    expected = BLOCK.copy()
    expected[3] = 0.4  # 0.3 / 0.2 = 1.5 rounds to even: code 7, (7 - 5) * 0.2
    np.testing.assert_allclose(q.dequantize(), expected[None, :], atol=1e-6)


def test_an_int8_block_by_hand():
    q = quantize_blocks(BLOCK[None, :], bits=8)
    assert q.scales[0, 0] == pytest.approx(3 / 255) and q.zero_points.tolist() == [[85]]
    assert q.codes[0, 0, :4].tolist() == [0, 136, 255, 111]  # round(x * 85) + 85
    np.testing.assert_allclose(q.dequantize()[0, :4], [-1.0, 0.6, 2.0, 26 * 3 / 255], atol=1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_every_weight_is_within_half_a_step_and_the_padding_is_dropped(bits):
    w = np.random.default_rng(bits).standard_normal((6, 40)).astype(np.float32)  # 40: a full block and 8 more
    q = quantize_blocks(w, bits)
    assert q.scales.shape == (6, 2) and q.dequantize().shape == (6, 40)
    step = np.repeat(q.scales, BLOCK_SIZE, axis=1)[:, :40]
    assert np.all(np.abs(q.dequantize() - w) <= step / 2 + 1e-6)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_graph_pass_multiplies_by_the_dequantized_weight_and_keeps_a_tied_lookup(scheme):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((50, 172)).astype(np.float32)  # [N, K], K not a multiple of the block
    nodes = [helper.make_node("Gather", ["W", "ids"], ["emb"]),  # the tied embedding's lookup reads W too
             helper.make_node("Gemm", ["x", "W"], ["y"], transB=1)]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 172]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, ["I"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", 50]),
         helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["I", 172])],
        [numpy_helper.from_array(weight, "W")])
    proto, used = quantize_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), scheme)
    assert [n.op_type for n in proto.graph.node] == ["Gather", "MatMulNBits"] and "W" in used
    assert "W" in {t.name for t in proto.graph.initializer}  # still read by the Gather
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((3, 172)).astype(np.float32)
    y, emb = session.run(None, {"x": x, "ids": np.array([4, 9])})
    np.testing.assert_allclose(y, x @ used["W"].T, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(emb, weight[[4, 9]])
    assert np.abs(used["W"] - weight).max() > 0  # it really is quantized


# -- quantized engines end to end -------------------------------------------------------------------------------

PROMPTS = ["Once upon a time", "The little dog ran to the", "Lily and Ben went to the park"]


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "engine"
    assert main(["build", "--model", str(STORIES), "--output", str(out), "--weights", request.param,
                 "--lookahead_config", "4,3,4", "--max_seq_len", "256", "--max-batch", "4"]) == 0
    return request.param, out


@pytest.mark.export
def test_a_quantized_engine_records_its_scheme_and_its_smoke_check(quantized):
    scheme, engine = quantized
    config = json.loads((engine / "config.json").read_text())
    assert config["quantization"] == scheme and config["build_key"]["weights"] == scheme
    assert config["targets"]["onnx"]["smoke_check"]  # against the torch model holding the same dequantized weights


@pytest.mark.export
def test_a_changed_quantized_code_is_refused_at_load(quantized, tmp_path):
    _, engine = quantized
    copy = tmp_path / "engine"
    shutil.copytree(engine, copy)
    with (copy / "weights.bin").open("r+b") as data:  # one byte of the codes, the scales or the zero points
        data.seek(100)
        byte = data.read(1)
        data.seek(100)
        data.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(UserError, match=r"weights\.bin"):
        open_engine(copy)


@pytest.mark.export
def test_lookahead_on_a_quantized_engine_equals_its_own_greedy_alone_and_batched(quantized):
    _, engine = quantized
    with LookaheadRuntime.from_pretrained(str(engine), max_batch=4) as rt:
        greedy = [rt.generate(p, max_new_tokens=48, lookahead="greedy").token_ids for p in PROMPTS]
        alone = [rt.generate(p, max_new_tokens=48, lookahead="4,3,4").token_ids for p in PROMPTS]
        batched: list[list[int] | None] = [None] * len(PROMPTS)
        barrier = threading.Barrier(len(PROMPTS))

        def run(i: int) -> None:  # all in flight together: one batched step per iteration
            barrier.wait()
            batched[i] = rt.generate(PROMPTS[i], max_new_tokens=48, lookahead="4,3,4").token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert alone == greedy and batched == greedy


@pytest.mark.export
def test_quantized_builds_refuse_what_cannot_run_them(quantized, tmp_path):
    _, engine = quantized
    with pytest.raises(UserError, match="TensorRT backend cannot run"):
        LookaheadRuntime.from_pretrained(str(engine), backend="tensorrt")
    code = main(["build", "--model", str(STORIES), "--output", str(tmp_path / "bf16"), "--weights", "int4",
                 "--dtype", "bfloat16"])
    assert code == 2
