"""LookaheadAttention: closed-form mask, torch reference, Triton kernel (interpreter), AOT PTX, ONNX node.

Without a GPU the Triton kernel runs under TRITON_INTERPRET=1 on CPU (tests/conftest.py decides once per
session, before triton is imported; small shapes, the interpreter is slow); with one it runs compiled.
GPU and TensorRT tests gate on backends.devices and skip with the reason.
"""

import os

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from trt_lookahead.backends.devices import gpu_count, tensorrt_unavailable_reason
from trt_lookahead.kernels import mask, onnx_op, reference
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.model.llama import sdpa_attention

MASK_CONFIGS = [(w, n, g) for w in (1, 2, 3, 5) for n in (2, 3, 4, 6) for g in (0, 1, 2, 5)]
MASK_CONFIGS += [(4, 3, 4), (7, 5, 7), (15, 5, 15), (1, 2, 0), (33, 2, 0)]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def random_case(T, Hq, Hkv, D, S, P, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, h, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
    kc, vc = (torch.randn(Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v, kc, vc, torch.tensor([P], dtype=torch.int32)


# -- the closed-form mask -----------------------------------------------------------------------


@pytest.mark.parametrize("cfg", MASK_CONFIGS)
@pytest.mark.parametrize("pad", [0, 3])
def test_closed_form_mask_equals_step_layout(cfg, pad):
    lay = StepLayout(LookaheadConfig(*cfg))
    padded = StepLayout(LookaheadConfig(*cfg), padded_tokens=lay.step_tokens + pad)
    assert np.array_equal(mask.step_mask(padded.step_tokens, cfg), padded.mask)


def test_causal_mask_and_bad_configs():
    assert np.array_equal(mask.step_mask(5, mask.CAUSAL), np.tril(np.ones((5, 5), bool)))
    with pytest.raises(ValueError, match="does not describe"):
        mask.step_mask(10, (4, 3, 4))  # needs 16 slots


# -- the torch reference ------------------------------------------------------------------------


@pytest.mark.parametrize("cfg,P", [((4, 3, 4), 0), ((4, 3, 4), 19), ((2, 2, 1), 7), ((1, 2, 0), 5)])
def test_reference_equals_the_models_attention_seam(cfg, P):
    """The op's semantics are the model's seam: cache rows 0..p-1 for all, step rows by the mask."""
    lay = StepLayout(LookaheadConfig(*cfg))
    T, Hq, Hkv, D, S = lay.step_tokens, 8, 4, 8, 40
    q, k, v, kc, vc, p = random_case(T, Hq, Hkv, D, S, P)
    ours = reference.lookahead_attention(q, k, v, kc, vc, p, cfg)
    seam_k, seam_v = kc.transpose(0, 1).clone(), vc.transpose(0, 1).clone()  # [S, Hkv, D], step rows at p..
    seam_k[P : P + T], seam_v[P : P + T] = k, v
    theirs = sdpa_attention(q, seam_k, seam_v, torch.tensor(P), torch.from_numpy(lay.mask.copy()))
    assert reference.relative_error(ours, theirs) < 1e-5


# -- the Triton kernel (interpreter on CPU, compiled on a GPU) -------------------------------------

KERNEL_CASES = [
    # (step_config, T, Hq, Hkv, D, S, P)
    ((4, 3, 4), 16, 8, 4, 8, 48, 23),  # stories260K heads, cache tail not a multiple of BLOCK_N
    ((4, 3, 4), 19, 9, 3, 64, 40, 33),  # SmolLM2 heads (GQA 9/3, D=64), padded to 19 slots
    ((2, 2, 0), 2, 4, 4, 16, 8, 0),  # N=2, G=0, MHA, empty cache
    ((5, 4, 2), 21, 6, 2, 32, 70, 64),  # cache exactly two blocks
    ((1, 2, 0), 1, 8, 4, 8, 16, 9),  # greedy
    ((0, 0, 0), 37, 4, 2, 16, 40, 0),  # causal prefill, three query blocks
    ((0, 0, 0), 5, 4, 2, 16, 40, 12),  # causal chunk after a cached prefix
]


def _kernel_device() -> str:
    if INTERPRETED:
        return "cpu"
    if gpu_count() == 0:
        pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device (cudaGetDeviceCount found none)")
    return "cuda"


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"{c[0]}-T{c[1]}-H{c[2]}/{c[3]}-D{c[4]}-P{c[6]}")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_triton_kernel_matches_reference(case, dtype, tolerance):
    from trt_lookahead.kernels import triton_kernel

    cfg, T, Hq, Hkv, D, S, P = case
    device = _kernel_device()
    q, k, v, kc, vc, p = random_case(T, Hq, Hkv, D, S, P, dtype)
    step_mask = StepLayout(LookaheadConfig(*cfg), padded_tokens=T).mask if cfg[0] else np.tril(np.ones((T, T), bool))
    expected = reference.lookahead_attention(*(t.double() for t in (q, k, v, kc, vc)), p, mask=step_mask)
    args = [t.to(device) for t in (q, k, v, kc, vc, p, reference.as_config_tensor(cfg))]
    out = triton_kernel.lookahead_attention(*args).cpu()
    assert out.dtype == dtype
    assert reference.relative_error(out, expected) <= tolerance


PROBE_CONFIGS = [(1, 2, 0), (3, 2, 0), (2, 2, 1), (4, 3, 4), (3, 4, 0), (2, 3, 3), (5, 4, 2), (1, 6, 1)]


@pytest.mark.parametrize("cfg", PROBE_CONFIGS)
def test_in_kernel_mask_equals_step_layout(cfg):
    """With q = 0 every visible key weighs the same and V = identity: the output row is the mask row."""
    from trt_lookahead.kernels import triton_kernel

    device = _kernel_device()
    lay = StepLayout(LookaheadConfig(*cfg), padded_tokens=StepLayout(LookaheadConfig(*cfg)).step_tokens + 2)
    T = lay.step_tokens
    q = torch.zeros(T, 1, T)
    v = torch.eye(T)[:, None, :]
    cache = torch.zeros(1, 4, T)
    args = [t.to(device) for t in (q, torch.zeros(T, 1, T), v, cache, cache, torch.tensor([0], dtype=torch.int32),
                                   reference.as_config_tensor(cfg))]
    out = triton_kernel.lookahead_attention(*args).cpu()[:, 0, :]
    assert np.array_equal(out.numpy() > 0, lay.mask)


AOT_PROBE = """
import json, re
from triton.backends.compiler import GPUTarget
from trt_lookahead.errors import UserError
from trt_lookahead.kernels.tensorrt_plugin import compile_aot_kernel, kernel_signature
report = {}
for dtype, head_dim in (("float32", 64), ("float32", 128), ("bfloat16", 128), ("float32", 256)):
    try:
        kernel = compile_aot_kernel(dtype, 9, 3, head_dim, 0.125, target=GPUTarget("cuda", 90, 32))
    except UserError as exc:
        report[f"{dtype} {head_dim}"] = {"refused": str(exc)}
        continue
    entry = re.search(r"\\.visible \\.entry (\\w+)\\(([^)]*)\\)", kernel.ptx)
    report[f"{dtype} {head_dim}"] = {
        "entry": entry.group(1), "name": kernel.name, "ptx": re.search(r"\\.version (\\S+)", kernel.ptx).group(1),
        "params": re.findall(r"\\.param \\.(\\w+)", entry.group(2)),
        "signature": list(kernel_signature(dtype).values()),
        "shared": kernel.shared_mem, "block_n": kernel.block_n, "threads": kernel.threads,
    }
print(json.dumps(report))
"""


@pytest.mark.slow  # compiles in a fresh interpreter (seconds)
def test_aot_kernel_is_what_tensorrt_can_launch():
    """PTX ISA 8.7 (not the 9.4 of Triton 3.9's default), explicit parameters (7 inputs, int32 T, int32 S,
    output) then Triton's two hidden scratch pointers, and at most 48 KiB of shared memory: float32 with
    head_dim 128 needs 75,776 bytes at BLOCK_N 32, so it gets BLOCK_N 16; head_dim 256 in float32 cannot fit.

    Compiled for sm_90 without a GPU, in a subprocess (on CPU this session runs Triton's interpreter).
    """
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", AOT_PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    refused = report.pop("float32 256")["refused"]
    assert "float32" in refused and "head_dim 256" in refused and "49152" in refused
    for case, kernel in report.items():
        assert kernel["entry"] == kernel["name"] == "lookahead_attention_kernel", case
        assert kernel["ptx"] == "8.7", case
        assert kernel["params"] == ["u64"] * 7 + ["u32", "u32"] + ["u64"] + ["u64", "u64"], case
        assert kernel["signature"][7:9] == ["i32", "i32"], case
        assert kernel["shared"] <= 48 * 1024 and kernel["threads"] == 128, case
    assert [report[c]["block_n"] for c in ("float32 64", "float32 128", "bfloat16 128")] == [32, 16, 32]


@pytest.mark.slow  # a fresh interpreter imports torch (seconds)
def test_registering_the_plugin_imports_no_triton():
    """Running an AOT plan registers the plugin; that must work where triton is not installed."""
    import subprocess
    import sys

    probe = ("import sys, trt_lookahead.kernels.tensorrt_plugin, trt_lookahead.backends.tensorrt; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


# -- the ONNX node and its onnxruntime decomposition -----------------------------------------------


def single_op_model(T, Hq, Hkv, D, S, dtype=TensorProto.FLOAT):
    names = ["query", "key", "value", "key_cache", "value_cache", "cache_len", "step_config"]
    shapes = [[T, Hq, D], [T, Hkv, D], [T, Hkv, D], [Hkv, S, D], [Hkv, S, D], [1], [3]]
    types = [dtype] * 5 + [TensorProto.INT32] * 2
    node = onnx_op.make_node(names, "out", "attention", num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                             scale=reference.default_scale(D))
    graph = helper.make_graph(
        [node], "lookahead_attention",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in zip(names, types, shapes, strict=True)],
        [helper.make_tensor_value_info("out", dtype, [T, Hq, D])],
    )
    return helper.make_model(graph, opset_imports=onnx_op.opset_imports(23), ir_version=10)


def test_onnx_node_contract():
    model = single_op_model("T", 9, 3, 64, 1040)
    onnx.checker.check_model(model)
    (node,) = onnx_op.attention_nodes(model)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert (node.op_type, node.domain) == ("LookaheadAttention", "trt_lookahead")
    assert list(node.input) == ["query", "key", "value", "key_cache", "value_cache", "cache_len", "step_config"]
    assert attrs == {"num_q_heads": 9, "num_kv_heads": 3, "head_dim": 64, "scale": pytest.approx(0.125),
                     "plugin_namespace": b"trt_lookahead", "plugin_version": b"1", "aot": 1}


ORT_CASES = [((4, 3, 4), 16, 0), ((4, 3, 4), 16, 21), ((2, 2, 1), 16, 9), ((1, 2, 0), 1, 30), ((0, 0, 0), 11, 0),
             ((0, 0, 0), 3, 17), ((15, 5, 15), 120, 40)]


@pytest.mark.parametrize("cfg,T,P", ORT_CASES)
def test_decomposition_runs_on_onnxruntime_like_the_reference(cfg, T, P):
    import onnxruntime as ort

    Hq, Hkv, D, S = 8, 4, 8, 64
    decomposed = onnx_op.decompose(single_op_model("T", Hq, Hkv, D, S))
    assert not onnx_op.attention_nodes(decomposed)
    onnx.checker.check_model(decomposed)
    session = ort.InferenceSession(decomposed.SerializeToString(), providers=["CPUExecutionProvider"])
    q, k, v, kc, vc, p = random_case(T, Hq, Hkv, D, S, P)
    feeds = dict(zip(["query", "key", "value", "key_cache", "value_cache"], (t.numpy() for t in (q, k, v, kc, vc)),
                     strict=True))
    feeds.update(cache_len=p.numpy(), step_config=np.array(cfg, np.int32))
    (out,) = session.run(None, feeds)
    expected = reference.lookahead_attention(q, k, v, kc, vc, p, cfg)
    assert reference.relative_error(torch.from_numpy(out), expected) < 1e-5


# -- GPU / TensorRT (skip here, run on a GPU host with TensorRT) -----------------------------------


@pytest.mark.gpu
def test_compiled_kernel_replays_in_a_cuda_graph():
    if gpu_count() == 0:
        pytest.skip("no CUDA device (cuda-python cudaGetDeviceCount found none)")
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA support")
    from trt_lookahead.kernels import triton_kernel

    q, k, v, kc, vc, p = (t.cuda() for t in random_case(16, 8, 4, 64, 256, 40))
    cfg = reference.as_config_tensor((4, 3, 4)).cuda()
    out = torch.empty_like(q)
    triton_kernel.lookahead_attention(q, k, v, kc, vc, p, cfg, out=out)  # compile + warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_kernel.lookahead_attention(q, k, v, kc, vc, p, cfg, out=out)
    for P in (40, 41, 100):  # p changes in device memory only: the same graph stays right
        p.fill_(P)
        graph.replay()
        torch.cuda.synchronize()
        expected = reference.lookahead_attention(q.cpu(), k.cpu(), v.cpu(), kc.cpu(), vc.cpu(), P, (4, 3, 4))
        assert reference.relative_error(out.cpu(), expected) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int32"])
def test_device_tensor_views_memory_tensorrt_owns(dtype):
    """The JIT plugin's view of TensorRT's buffers: bfloat16 too (__cuda_array_interface__ cannot name it)."""
    if gpu_count() == 0 or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device and a CUDA build of torch")
    from trt_lookahead.kernels.tensorrt_plugin import device_tensor

    source = (torch.arange(24, device="cuda") * 3 - 7).to(getattr(torch, dtype)).reshape(2, 3, 4)
    part = source[:, 1:]  # strided: elements, as TensorRT gives them
    view = device_tensor(part.data_ptr(), part.shape, part.stride(), dtype)
    assert view.dtype == source.dtype and view.data_ptr() == part.data_ptr() and torch.equal(view, part)
    view.zero_()  # a view, not a copy
    assert not source[:, 1:].any() and source[:, 0].any()


@pytest.mark.gpu
def test_tensorrt_plugin_runs_the_onnx_node():
    reason = tensorrt_unavailable_reason()
    if reason:
        pytest.skip(f"TensorRT plugin test needs TensorRT and a GPU: {reason}")
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from trt_lookahead.kernels import tensorrt_plugin

    tensorrt_plugin.register(trt, trtp)
    T, Hq, Hkv, D, S, P = 16, 8, 4, 64, 128, 40
    model = single_op_model(T, Hq, Hkv, D, S)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse(model.SerializeToString()), [str(parser.get_error(i)) for i in range(parser.num_errors)]
    plan = builder.build_serialized_network(network, builder.create_builder_config())
    engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
    ctx = engine.create_execution_context()
    tensors = [t.cuda() for t in random_case(T, Hq, Hkv, D, S, P)]
    tensors.append(reference.as_config_tensor((4, 3, 4)).cuda())
    out = torch.empty(T, Hq, D, device="cuda")
    for name, t in zip(["query", "key", "value", "key_cache", "value_cache", "cache_len", "step_config", "out"],
                       [*tensors, out], strict=True):
        ctx.set_tensor_address(name, t.data_ptr())
    stream = torch.cuda.Stream()
    assert ctx.execute_async_v3(stream.cuda_stream)
    stream.synchronize()
    expected = reference.lookahead_attention(*(t.cpu() for t in tensors[:6]), (4, 3, 4))
    assert reference.relative_error(out.cpu(), expected) < 1e-5
