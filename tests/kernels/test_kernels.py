"""LookaheadAttention: closed-form mask, torch reference, Triton kernel (interpreter), AOT PTX, ONNX node,
each over a batch of mixed rows (own cache length and step config per row).

Without a GPU the Triton kernel runs under TRITON_INTERPRET=1 on CPU (tests/conftest.py decides once per
session, before triton is imported; small shapes, the interpreter is slow); with one it runs compiled.
GPU and TensorRT tests gate on backends.devices and skip with the reason.
"""

import os

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from trt_lookahead.backends.devices import gpu_count, tensorrt_unavailable_reason
from trt_lookahead.kernels import mask, onnx_op, reference
from trt_lookahead.kernels.onnxruntime_library import native_library
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.tree import TreeTemplate, chain_template, tree_template
from trt_lookahead.model.llama import sdpa_attention

MASK_CONFIGS = [(w, n, g) for w in (1, 2, 3, 5) for n in (2, 3, 4, 6) for g in (0, 1, 2, 5)]
MASK_CONFIGS += [(4, 3, 4), (7, 5, 7), (15, 5, 15), (1, 2, 0), (33, 2, 0)]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def random_case(T, Hq, Hkv, D, S, lengths, dtype=torch.float32, seed=0):
    """Random q, k, v [B, T, H, D], caches [B, Hkv, S, D] and cache_len [B] for rows of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    q, k, v = (torch.randn(B, T, h, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
    kc, vc = (torch.randn(B, Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v, kc, vc, torch.tensor(lengths, dtype=torch.int32)


def layout_masks(configs, T, tree=None):
    """[B, T, T] masks of StepLayout (causal for (0, 0, 0)): what the closed form must reproduce per row."""
    return np.stack([StepLayout(LookaheadConfig(*c), padded_tokens=T, tree=tree).mask if c[0]
                     else np.tril(np.ones((T, T), bool)) for c in configs])


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

SEAM_ROWS = [((4, 3, 4), 0), ((4, 3, 4), 19), ((2, 2, 1), 7), ((1, 2, 0), 5), ((0, 0, 0), 11)]


def test_reference_rows_equal_the_models_attention_seam():
    """Each row of a mixed batch is the model's seam on that row alone: its own cache rows 0..p-1, its
    step rows by its own mask (T = 16, smaller configs padded)."""
    T, Hq, Hkv, D, S = 16, 8, 4, 8, 40
    configs, lengths = zip(*SEAM_ROWS, strict=True)
    q, k, v, kc, vc, p = random_case(T, Hq, Hkv, D, S, lengths)
    ours = reference.lookahead_attention(q, k, v, kc, vc, p, np.array(configs))
    masks = layout_masks(configs, T)
    for b, P in enumerate(lengths):
        seam_k, seam_v = kc[b].transpose(0, 1).clone(), vc[b].transpose(0, 1).clone()  # [S, Hkv, D]
        seam_k[P : P + T], seam_v[P : P + T] = k[b], v[b]
        theirs = sdpa_attention(q[b], seam_k, seam_v, torch.tensor(P), torch.from_numpy(masks[b]))
        assert reference.relative_error(ours[b], theirs) < 1e-5, SEAM_ROWS[b]


# -- the Triton kernel (interpreter on CPU, compiled on a GPU) -------------------------------------

KERNEL_CASES = [
    # (T, Hq, Hkv, D, S, rows: (step_config, cache_len) per batch row)
    (16, 8, 4, 8, 48, [((4, 3, 4), 23), ((2, 2, 1), 0), ((0, 0, 0), 47), ((1, 2, 0), 5)]),  # stories260K heads
    (19, 9, 3, 64, 40, [((4, 3, 4), 33), ((0, 0, 0), 0)]),  # SmolLM2 heads (GQA 9/3, D=64), padded to 19 slots
    (2, 4, 4, 16, 8, [((2, 2, 0), 0)]),  # N=2, G=0, MHA, empty cache, one row
    (21, 6, 2, 32, 70, [((5, 4, 2), 64), ((5, 4, 2), 3)]),  # cache exactly two blocks; a short row beside it
    (1, 8, 4, 8, 16, [((1, 2, 0), 9), ((0, 0, 0), 0), ((1, 2, 0), 15)]),  # greedy rows
    (37, 4, 2, 16, 40, [((0, 0, 0), 0), ((0, 0, 0), 3)]),  # causal prefill chunks, three query blocks
]


def _kernel_device() -> str:
    if INTERPRETED:
        return "cpu"
    if gpu_count() == 0:
        pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device (cudaGetDeviceCount found none)")
    return "cuda"


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"T{c[0]}-H{c[1]}/{c[2]}-D{c[3]}-B{len(c[5])}")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_triton_kernel_matches_reference(case, dtype, tolerance):
    from trt_lookahead.kernels import triton_kernel

    T, Hq, Hkv, D, S, rows = case
    configs, lengths = zip(*rows, strict=True)
    device = _kernel_device()
    q, k, v, kc, vc, p = random_case(T, Hq, Hkv, D, S, lengths, dtype)
    expected = reference.lookahead_attention(*(t.double() for t in (q, k, v, kc, vc)), p, configs,
                                             masks=layout_masks(configs, T))
    args = [t.to(device) for t in (q, k, v, kc, vc, p, reference.as_config_tensor(configs))]
    out = triton_kernel.lookahead_attention(*args).cpu()
    assert out.dtype == dtype
    for b, row in enumerate(rows):
        assert reference.relative_error(out[b], expected[b]) <= tolerance, row


def test_triton_kernel_row_alone_equals_row_in_the_batch():
    """A row's program reads only its own length and config: the same bits alone as in a mixed batch."""
    from trt_lookahead.kernels import triton_kernel

    T, Hq, Hkv, D, S, rows = KERNEL_CASES[0]
    configs, lengths = zip(*rows, strict=True)
    device = _kernel_device()
    tensors = [*random_case(T, Hq, Hkv, D, S, lengths), reference.as_config_tensor(configs)]
    batched = triton_kernel.lookahead_attention(*(t.to(device) for t in tensors)).cpu()
    for b in range(len(rows)):
        alone = triton_kernel.lookahead_attention(*(t[b : b + 1].contiguous().to(device) for t in tensors)).cpu()
        assert torch.equal(alone[0], batched[b]), rows[b]


PROBE_CONFIGS = [(1, 2, 0), (3, 2, 0), (2, 2, 1), (4, 3, 4), (3, 4, 0), (2, 3, 3), (5, 4, 2), (1, 6, 1), (0, 0, 0)]


def test_in_kernel_masks_equal_step_layout():
    """With q = 0 every visible key weighs the same and V = identity: output row i of batch row b is row i of
    b's mask. One launch holds every config (padded to the largest T plus 2 pad slots) and a causal row."""
    from trt_lookahead.kernels import triton_kernel

    T = max(LookaheadConfig(*c).step_tokens for c in PROBE_CONFIGS if c[0]) + 2
    assert np.array_equal(kernel_masks(triton_kernel, PROBE_CONFIGS, T), layout_masks(PROBE_CONFIGS, T))


def kernel_masks(triton_kernel, configs, T: int, template: TreeTemplate | None = None) -> np.ndarray:
    """[B, T, T] the kernel's masks: with q = 0 every visible key weighs the same and V = identity, so output
    row i of batch row b is row i of b's mask."""
    device = _kernel_device()
    B = len(configs)
    q = torch.zeros(B, T, 1, T)
    v = torch.eye(T)[None, :, None, :].repeat(B, 1, 1, 1)
    cache = torch.zeros(B, 1, 4, T)
    args = [t.to(device) for t in (q, torch.zeros(B, T, 1, T), v, cache, cache, torch.zeros(B, dtype=torch.int32),
                                   reference.as_config_tensor(configs))]
    ends = None if template is None else tree_table(template, T, device)
    return triton_kernel.lookahead_attention(*args, tree_ends=ends).cpu()[:, :, 0, :].numpy() > 0


# -- the Triton kernel with a draft tree (tree_ends table from a device tensor) ------------------------


def random_template(rng: np.random.Generator, nodes: int) -> TreeTemplate:
    """A random tree (each node's parent x_t or any earlier node: preorder or not), or tree_template's shape."""
    if rng.integers(2):
        return tree_template(nodes, int(rng.integers(1, 6)))
    return TreeTemplate(tuple(int(rng.integers(-1, i)) for i in range(nodes)))


def random_tree_rows(rng: np.random.Generator, nodes: int, rows: int) -> list[tuple[int, int, int]]:
    """Random (W, N, G) with G(N-1) <= nodes (G = 0 included), and one CAUSAL row."""
    configs: list[tuple[int, int, int]] = [mask.CAUSAL]
    while len(configs) < rows:
        W, N = int(rng.integers(1, 5)), int(rng.integers(2, 6))
        configs.append((W, N, int(rng.integers(0, nodes // (N - 1) + 1))))
    rng.shuffle(configs)
    return configs


def tree_table(template: TreeTemplate, T: int, device: str) -> torch.Tensor:
    return torch.from_numpy(onnx_op.tree_ends_input(template.table, T)).to(device)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_triton_kernel_with_a_tree_matches_reference(seed, dtype, tolerance):
    """Random templates, rows of random configs (a causal one among them) and cache lengths, GQA and MHA."""
    from trt_lookahead.kernels import triton_kernel

    rng = np.random.default_rng(seed)
    device = _kernel_device()
    template = random_template(rng, int(rng.integers(4, 16)))
    configs = random_tree_rows(rng, template.nodes, 3)
    T = max(LookaheadConfig(*c).step_tokens for c in configs if c[0]) + int(rng.integers(0, 4))
    Hq, Hkv = [(4, 2), (6, 2), (4, 4)][seed]
    D, S = int(rng.choice([8, 16])), 40
    lengths = [int(x) for x in rng.integers(0, S + 1, len(configs))]
    q, k, v, kc, vc, p = random_case(T, Hq, Hkv, D, S, lengths, dtype, seed=seed)
    expected = reference.lookahead_attention(*(t.double() for t in (q, k, v, kc, vc)), p, configs,
                                             tree_ends=template.table)
    args = [t.to(device) for t in (q, k, v, kc, vc, p, reference.as_config_tensor(configs))]
    out = triton_kernel.lookahead_attention(*args, tree_ends=tree_table(template, T, device)).cpu()
    assert out.dtype == dtype
    for b, row in enumerate(zip(configs, lengths, strict=True)):
        assert reference.relative_error(out[b], expected[b]) <= tolerance, (template, row)


@pytest.mark.parametrize("seed", range(2))
def test_in_kernel_tree_masks_equal_step_layout(seed):
    """q = 0 and V = identity (as test_in_kernel_masks_equal_step_layout): row b's output shows its mask, which
    must be StepLayout's with the tree template, for random templates and configs padded to one T."""
    from trt_lookahead.kernels import triton_kernel

    rng = np.random.default_rng(100 + seed)
    template = random_template(rng, int(rng.integers(6, 20)))
    configs = random_tree_rows(rng, template.nodes, 5)
    T = max(LookaheadConfig(*c).step_tokens for c in configs if c[0]) + 2
    assert np.array_equal(kernel_masks(triton_kernel, configs, T, template), layout_masks(configs, T, template)), (
        template, configs)


@pytest.mark.parametrize("cfg", [(4, 3, 4), (2, 4, 3), (3, 2, 5)])
def test_triton_kernel_with_the_chain_template_is_the_linear_kernel(cfg):
    """chain_template(G, N-1) is the linear branch: the tree kernel gives the linear kernel's bits."""
    from trt_lookahead.kernels import triton_kernel

    _, N, G = cfg
    T, Hq, Hkv, D, S = LookaheadConfig(*cfg).step_tokens + 1, 4, 2, 16, 40
    device = _kernel_device()
    configs = [cfg, mask.CAUSAL, (1, 2, 0)]
    args = [t.to(device) for t in (*random_case(T, Hq, Hkv, D, S, [33, 5, 0]), reference.as_config_tensor(configs))]
    linear = triton_kernel.lookahead_attention(*args).cpu()
    tree = triton_kernel.lookahead_attention(*args, tree_ends=tree_table(chain_template(G, N - 1), T, device)).cpu()
    assert torch.equal(tree, linear)


def test_triton_kernel_refuses_a_tree_table_shorter_than_the_step():
    from trt_lookahead.kernels import triton_kernel

    T, Hq, Hkv, D, S, rows = KERNEL_CASES[0]
    configs, lengths = zip(*rows, strict=True)
    args = [*random_case(T, Hq, Hkv, D, S, lengths), reference.as_config_tensor(configs)]
    with pytest.raises(ValueError, match=r"tree_ends must be int32 \[>= 32\]"):
        triton_kernel.lookahead_attention(*args, tree_ends=tree_table(tree_template(12, 3), T - 1, "cpu"))


AOT_PROBE = """
import json, re
from triton.backends.compiler import GPUTarget
from trt_lookahead.errors import UserError
from trt_lookahead.kernels.tensorrt_plugin import compile_aot_kernel, kernel_signature
report = {}
for dtype, head_dim, tree in (("float32", 64, False), ("float32", 128, False), ("bfloat16", 128, False),
                              ("float32", 256, False), ("float32", 64, True), ("bfloat16", 128, True)):
    name = f"{dtype} {head_dim}" + (" tree" if tree else "")
    try:
        kernel = compile_aot_kernel(dtype, 9, 3, head_dim, 0.125, tree=tree, target=GPUTarget("cuda", 90, 32))
    except UserError as exc:
        report[name] = {"refused": str(exc)}
        continue
    entry = re.search(r"\\.visible \\.entry (\\w+)\\(([^)]*)\\)", kernel.ptx)
    report[name] = {
        "entry": entry.group(1), "name": kernel.name, "ptx": re.search(r"\\.version (\\S+)", kernel.ptx).group(1),
        "params": re.findall(r"\\.param \\.(\\w+)", entry.group(2)),
        "signature": list(kernel_signature(dtype).values()),
        "shared": kernel.shared_mem, "block_n": kernel.block_n, "threads": kernel.threads,
        "reads_tree_ends": "[lookahead_attention_kernel_param_7]" in kernel.ptx,  # ld.param of the 8th pointer
    }
print(json.dumps(report))
"""


@pytest.mark.slow  # compiles in a fresh interpreter (seconds)
def test_aot_kernel_is_what_tensorrt_can_launch():
    """PTX ISA 8.7 (not the 9.4 of Triton 3.9's default), explicit parameters (8 inputs, int32 T, int32 S,
    output) then Triton's two hidden scratch pointers, and at most 48 KiB of shared memory: float32 with
    head_dim 128 needs 75,776 bytes at BLOCK_N 32, so it gets BLOCK_N 16; head_dim 256 in float32 cannot fit.
    The draft-tree kernel (HAS_TREE, reading tree_ends) has the same parameters and needs no scratch either.

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
        assert kernel["params"] == ["u64"] * 8 + ["u32", "u32"] + ["u64"] + ["u64", "u64"], case
        assert kernel["signature"][5:10] == ["*i32", "*i32", "*i32", "i32", "i32"], case
        assert kernel["shared"] <= 48 * 1024 and kernel["threads"] == 128, case
    assert [report[c]["block_n"] for c in ("float32 64", "float32 128", "bfloat16 128")] == [32, 16, 32]
    assert [report[c]["block_n"] for c in ("float32 64 tree", "bfloat16 128 tree")] == [32, 32]
    # only the tree kernel reads its table; the linear one never touches the dummy
    assert {case: kernel["reads_tree_ends"] for case, kernel in report.items()} == {
        "float32 64": False, "float32 128": False, "bfloat16 128": False, "float32 64 tree": True,
        "bfloat16 128 tree": True}


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

OP_INPUTS = ["query", "key", "value", "key_cache", "value_cache", "cache_len", "step_config", "tree_ends"]
FED = OP_INPUTS[:7]  # the graph's inputs; tree_ends is an initializer


def single_op_model(B, T, Hq, Hkv, D, S, dtype=TensorProto.FLOAT, tree=None, max_tokens=128):
    """One LookaheadAttention node; `tree`: its template (the tree_ends initializer over max_tokens)."""
    shapes = [[B, T, Hq, D], [B, T, Hkv, D], [B, T, Hkv, D], [B, Hkv, S, D], [B, Hkv, S, D], [B], [B, 3]]
    types = [dtype] * 5 + [TensorProto.INT32] * 2
    node = onnx_op.make_node(OP_INPUTS, "out", "attention", num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                             scale=reference.default_scale(D), tree=tree is not None)
    ends = onnx_op.tree_ends_input(None if tree is None else tree.table, max_tokens)
    graph = helper.make_graph(
        [node], "lookahead_attention",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in zip(FED, types, shapes, strict=True)],
        [helper.make_tensor_value_info("out", dtype, [B, T, Hq, D])],
        initializer=[numpy_helper.from_array(ends, "tree_ends")],
    )
    return helper.make_model(graph, opset_imports=onnx_op.opset_imports(23), ir_version=10)


@pytest.mark.parametrize("tree", [None, tree_template(28, 6)], ids=["linear", "tree"])
def test_onnx_node_contract(tree):
    """8 inputs, the last the tree_ends initializer: a tree's subtree ends over the graph's most tokens, or a
    linear graph's [1] dummy; the `tree` attribute says which."""
    model = single_op_model("B", "T", 9, 3, 64, 1040, tree=tree, max_tokens=40)
    onnx.checker.check_model(model)
    (node,) = onnx_op.attention_nodes(model)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert (node.op_type, node.domain) == ("LookaheadAttention", "trt_lookahead")
    assert list(node.input) == OP_INPUTS
    assert attrs == {"num_q_heads": 9, "num_kv_heads": 3, "head_dim": 64, "scale": pytest.approx(0.125),
                     "tree": int(tree is not None), "plugin_namespace": b"trt_lookahead", "plugin_version": b"1",
                     "aot": 1}
    (table,) = (numpy_helper.to_array(t) for t in model.graph.initializer if t.name == node.input[7])
    assert table.dtype == np.int32
    expected = [0] if tree is None else [*tree.table, *[0] * 2 * (40 - 28)]
    assert table.tolist() == expected


ORT_CASES = [  # (T, rows: (step_config, cache_len))
    (16, [((4, 3, 4), 0), ((4, 3, 4), 21), ((2, 2, 1), 9), ((0, 0, 0), 3), ((1, 2, 0), 30)]),
    (1, [((1, 2, 0), 30), ((0, 0, 0), 0)]),
    (11, [((0, 0, 0), 0), ((0, 0, 0), 17)]),
    (120, [((15, 5, 15), 40)]),
]


def decomposed_session(Hq, Hkv, D, S, exact=False, tree=None, native=False):
    import onnxruntime as ort

    decomposed = onnx_op.decompose(single_op_model("B", "T", Hq, Hkv, D, S, tree=tree), exact=exact, native=native)
    assert not onnx_op.attention_nodes(decomposed)
    # a tree graph reads its table; a linear one's dummy is gone (onnxruntime warns about unread initializers)
    assert [t.name for t in decomposed.graph.initializer if t.name == "tree_ends"] == (["tree_ends"] if tree else [])
    options = ort.SessionOptions()
    if native:
        options.register_custom_ops_library(str(native_library_path()))
    else:
        onnx.checker.check_model(decomposed)
    return ort.InferenceSession(decomposed.SerializeToString(), options, providers=["CPUExecutionProvider"])


def native_library_path():
    """onnxruntime_attention.c built here: every machine the tests run on has a C compiler (the README's install)."""
    built = native_library()
    assert built.path is not None, built.why
    return built.path


def op_feeds(tensors):
    q, k, v, kc, vc, p, configs = tensors
    feeds = dict(zip(FED[:5], (t.numpy() for t in (q, k, v, kc, vc)), strict=True))
    return feeds | {"cache_len": p.numpy(), "step_config": np.asarray(configs, np.int32).reshape(-1, 3)}


@pytest.mark.parametrize("native", [False, True], ids=["ops", "native"])
@pytest.mark.parametrize("T,rows", ORT_CASES, ids=lambda c: str(c) if isinstance(c, int) else f"B{len(c)}")
def test_decomposition_runs_on_onnxruntime_like_the_reference(T, rows, native):
    Hq, Hkv, D, S = 8, 4, 8, 64
    configs, lengths = zip(*rows, strict=True)
    session = decomposed_session(Hq, Hkv, D, S, native=native)
    q, k, v, kc, vc, p = random_case(T, Hq, Hkv, D, S, lengths)
    (out,) = session.run(None, op_feeds((q, k, v, kc, vc, p, configs)))
    expected = reference.lookahead_attention(q, k, v, kc, vc, p, np.array(configs))
    for b, row in enumerate(rows):
        assert reference.relative_error(torch.from_numpy(out[b]), expected[b]) < 1e-5, row


@pytest.mark.parametrize("native", [False, True], ids=["ops", "native"])
@pytest.mark.parametrize("seed", range(3))
def test_tree_decomposition_runs_on_onnxruntime_like_the_reference(seed, native):
    """The node's tree_ends initializer masks the decomposition: random templates, configs and cache lengths."""
    rng = np.random.default_rng(seed)
    Hq, Hkv, D, S = 8, 4, 8, 64
    template = random_template(rng, int(rng.integers(4, 24)))
    configs = random_tree_rows(rng, template.nodes, 4)
    T = max(LookaheadConfig(*c).step_tokens for c in configs if c[0]) + int(rng.integers(0, 4))
    lengths = [int(x) for x in rng.integers(0, S + 1, len(configs))]
    session = decomposed_session(Hq, Hkv, D, S, tree=template, native=native)
    q, k, v, kc, vc, p = random_case(T, Hq, Hkv, D, S, lengths, seed=seed)
    (out,) = session.run(None, op_feeds((q, k, v, kc, vc, p, configs)))
    expected = reference.lookahead_attention(q, k, v, kc, vc, p, np.array(configs), tree_ends=template.table)
    for b, row in enumerate(zip(configs, lengths, strict=True)):
        assert reference.relative_error(torch.from_numpy(out[b]), expected[b]) < 1e-5, (template, row)


EXACT_CASES = [  # (T, rows): cache lengths around 64-key blocks
    (16, [((4, 3, 4), 63), ((4, 3, 4), 64), ((2, 2, 1), 127), ((0, 0, 0), 0), ((1, 2, 0), 190)]),
    (1, [((1, 2, 0), 64), ((0, 0, 0), 0), ((1, 2, 0), 1)]),
    (64, [((0, 0, 0), 0), ((0, 0, 0), 100), ((4, 3, 4), 63)]),
]


@pytest.mark.parametrize("T,rows", EXACT_CASES, ids=lambda c: str(c) if isinstance(c, int) else f"B{len(c)}")
def test_exact_decomposition_is_attention_like_the_reference(T, rows):
    Hq, Hkv, D, S = 9, 3, 16, 256
    configs, lengths = zip(*rows, strict=True)
    session = decomposed_session(Hq, Hkv, D, S, exact=True)
    q, k, v, kc, vc, p = random_case(T, Hq, Hkv, D, S, lengths)
    (out,) = session.run(None, op_feeds((q, k, v, kc, vc, p, configs)))
    expected = reference.lookahead_attention(q, k, v, kc, vc, p, np.array(configs))
    for b, row in enumerate(rows):
        assert reference.relative_error(torch.from_numpy(out[b]), expected[b]) < 1e-5, row


@pytest.mark.parametrize("native", [False, True], ids=["ops", "native"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tree", [None, tree_template(8, 3)], ids=["linear", "tree"])
def test_exact_decomposition_gives_each_slot_the_bits_of_a_1_token_step_at_its_context(seed, tree, native):
    """Every slot of every row of a mixed batch == the op run for that token alone (T = 1, greedy), its chain's
    step keys stored in the cache at their positions: what plain decoding computes; with a draft tree too. The
    native kernel (any heads) likewise."""
    rng = np.random.default_rng(seed)
    Hq, Hkv, D = [(8, 4, 8), (9, 3, 64), (4, 4, 12)][seed % (2 + native)]
    T, S = 16, 400
    configs = [(4, 3, 4), (2, 2, 1), (0, 0, 0), (1, 2, 0), (2, 3, 2)]
    rng.shuffle(configs)
    lengths = [int(rng.choice([0, 1, 62, 63, 64, 65, 127, 128, int(rng.integers(1, 300))])) for _ in configs]
    exact = decomposed_session(Hq, Hkv, D, S, exact=True, tree=tree, native=native)
    q, k, v, kc, vc, p = random_case(T, Hq, Hkv, D, S, lengths, seed=seed)
    (out,) = exact.run(None, op_feeds((q, k, v, kc, vc, p, configs)))
    for b, (config, P) in enumerate(zip(configs, lengths, strict=True)):
        visible = mask.step_mask(T, config, None if tree is None else tree.table)
        for i in range(T):
            chain = np.flatnonzero(visible[i])  # slot order is position order along a chain; itself last
            caches = [c[b : b + 1].clone() for c in (kc, vc)]
            for cache, new in zip(caches, (k, v), strict=True):
                cache[0, :, P : P + len(chain) - 1] = new[b, chain[:-1]].transpose(0, 1)
            one = (q[b : b + 1, i : i + 1], k[b : b + 1, i : i + 1], v[b : b + 1, i : i + 1], *caches,
                   torch.tensor([P + len(chain) - 1], dtype=torch.int32), [(1, 2, 0)])
            (alone,) = exact.run(None, op_feeds(one))
            assert np.array_equal(alone[0, 0], out[b, i]), (config, P, i)


def test_exact_decomposition_refuses_a_graph_without_grouped_query_heads():
    with pytest.raises(ValueError, match="needs grouped-query attention"):
        onnx_op.decompose(single_op_model("B", "T", 4, 4, 8, 64), exact=True)


@pytest.mark.parametrize("native", [False, True], ids=["ops", "native"])
def test_decomposition_gives_a_row_the_same_bits_alone_and_batched(native):
    """The batch's longest prefix pads a shorter row's cache columns; the row's result must not move by a bit."""
    Hq, Hkv, D, S = 9, 3, 64, 300
    session = decomposed_session(Hq, Hkv, D, S, native=native)
    configs = [(4, 3, 4), (0, 0, 0), (2, 2, 1), (1, 2, 0)]
    for seed, lengths in enumerate([(5, 280, 0, 77), (1, 2, 3, 4), (129, 17, 64, 200)]):
        tensors = (*random_case(16, Hq, Hkv, D, S, lengths, seed=seed), configs)
        (batched,) = session.run(None, op_feeds(tensors))
        for b in range(len(lengths)):
            (alone,) = session.run(None, {k: v[b : b + 1] for k, v in op_feeds(tensors).items()})
            assert np.array_equal(alone[0], batched[b]), (lengths, b)


def test_native_kernel_keeps_a_nan_in_its_row():
    """A NaN in one row's query is NaN in that query's output (not a silently finite softmax), and the other
    rows keep their bits."""
    Hq, Hkv, D, S = 9, 3, 64, 100
    session = decomposed_session(Hq, Hkv, D, S, native=True)
    configs = [(2, 2, 1), (0, 0, 0)]
    tensors = (*random_case(8, Hq, Hkv, D, S, (40, 70), seed=3), configs)
    (clean,) = session.run(None, op_feeds(tensors))
    tensors[0][0, 2, 4, 7] = float("nan")
    (out,) = session.run(None, op_feeds(tensors))
    assert np.isnan(out[0, 2, 4]).all() and not np.isnan(np.delete(out[0], 2, axis=0)).any()
    assert np.array_equal(out[1], clean[1])


# -- GPU / TensorRT (skip here, run on a GPU host with TensorRT) -----------------------------------

GPU_ROWS = [((4, 3, 4), 40), ((0, 0, 0), 0), ((2, 2, 1), 100)]


@pytest.mark.gpu
def test_compiled_kernel_replays_in_a_cuda_graph():
    if gpu_count() == 0:
        pytest.skip("no CUDA device (cuda-python cudaGetDeviceCount found none)")
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA support")
    from trt_lookahead.kernels import triton_kernel

    configs, lengths = zip(*GPU_ROWS, strict=True)
    q, k, v, kc, vc, p = (t.cuda() for t in random_case(16, 8, 4, 64, 256, lengths))
    cfg = reference.as_config_tensor(configs).cuda()
    out = torch.empty_like(q)
    triton_kernel.lookahead_attention(q, k, v, kc, vc, p, cfg, out=out)  # compile + warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_kernel.lookahead_attention(q, k, v, kc, vc, p, cfg, out=out)
    for new_lengths, new_configs in (((41, 7, 0), configs), ((100, 200, 3), [(1, 2, 0), (4, 3, 4), (0, 0, 0)])):
        p.copy_(torch.tensor(new_lengths, dtype=torch.int32))  # device memory only: the same graph stays right
        cfg.copy_(reference.as_config_tensor(new_configs))
        graph.replay()
        torch.cuda.synchronize()
        expected = reference.lookahead_attention(q.cpu(), k.cpu(), v.cpu(), kc.cpu(), vc.cpu(), p.cpu(),
                                                 np.array(new_configs))
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
@pytest.mark.parametrize("tree", [None, tree_template(8, 4)], ids=["linear", "tree"])
def test_tensorrt_plugin_runs_the_onnx_node(tree):
    """The parser maps the node (its tree_ends initializer a constant input) to the AOT plugin."""
    reason = tensorrt_unavailable_reason()
    if reason:
        pytest.skip(f"TensorRT plugin test needs TensorRT and a GPU: {reason}")
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from trt_lookahead.kernels import tensorrt_plugin

    tensorrt_plugin.register(trt, trtp)
    configs, lengths = zip(*GPU_ROWS, strict=True)
    B, T, Hq, Hkv, D, S = len(lengths), 16, 8, 4, 64, 128
    model = single_op_model(B, T, Hq, Hkv, D, S, tree=tree, max_tokens=T)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse(model.SerializeToString()), [str(parser.get_error(i)) for i in range(parser.num_errors)]
    plan = builder.build_serialized_network(network, builder.create_builder_config())
    engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
    ctx = engine.create_execution_context()
    tensors = [t.cuda() for t in random_case(T, Hq, Hkv, D, S, lengths)]
    tensors.append(reference.as_config_tensor(configs).cuda())
    out = torch.empty(B, T, Hq, D, device="cuda")
    for name, t in zip([*FED, "out"], [*tensors, out], strict=True):
        ctx.set_tensor_address(name, t.data_ptr())
    stream = torch.cuda.Stream()
    assert ctx.execute_async_v3(stream.cuda_stream)
    stream.synchronize()
    expected = reference.lookahead_attention(*(t.cpu() for t in tensors[:6]), np.array(configs),
                                             tree_ends=None if tree is None else tree.table)
    assert reference.relative_error(out.cpu(), expected) < 1e-5
