"""scripts/profile_step.py on the CPU: the tiny shape's padded step end to end in a fresh interpreter (every
variant x T x batch cell measured or explicitly not available/skipped, kernels per layer by category), the
classifier's rules on real op and kernel names, and the one-line errors. The GPU figures come from a lent GPU."""

from __future__ import annotations

import json
import os

import pytest
from support.scripts import load_script, run_script


@pytest.fixture(scope="module")
def profile_step():
    return load_script("profile_step")


# (op or kernel name, the Python function that called torch) -> category: names the CPU profile (aten::, mkldnn::)
# and a GPU profile (cuBLAS/CUTLASS/flash kernels, Triton kernels of kernels/invariant.py, inductor's) report
KNOWN = (
    ("aten::mm", "", "GEMM"),
    ("aten::linear", "Linear.forward", "GEMM"),
    ("mkldnn::_linear_pointwise", "Linear.forward", "GEMM"),
    ("_linear_kernel", "", "GEMM"),
    ("_quantized_kernel", "", "GEMM"),  # a quantized projection (kernels/invariant.py)
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "", "GEMM"),
    ("aten::scaled_dot_product_attention", "PaddedAttention.__call__", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "", "attention"),  # CUTLASS, but attention's
    ("_padded_attention_kernel", "", "attention"),
    ("aten::bmm", "BlockedAttention.__call__", "attention"),  # a GEMM inside the attention seam
    ("aten::copy_", "PaddedAttention.__call__", "attention"),
    ("aten::rms_norm", "RMSNorm.forward", "norm"),
    ("_rms_norm_kernel", "", "norm"),
    ("aten::rsqrt", "", "norm"),
    ("aten::pow", "RMSNorm.forward", "norm"),
    ("aten::pow", "", "elementwise"),
    ("aten::_to_copy", "RMSNorm.forward", "norm"),  # the norm's casts are the norm's kernels
    ("aten::_to_copy", "", "copy/cast"),
    ("aten::roll", "apply_rope", "RoPE"),
    ("aten::mul", "apply_rope", "RoPE"),
    ("aten::roll", "", "copy/cast"),
    ("aten::mul", "FeedForward.forward", "elementwise"),
    ("aten::cos", "Llama.rope", "RoPE"),
    ("aten::index_copy_", "Attention.forward", "KV write"),
    ("aten::argmax", "BatchedTorchExecutor._run_padded", "argmax"),
    ("aten::topk", "BatchedTorchExecutor._run_padded", "argmax"),
    ("aten::silu", "FeedForward.forward", "elementwise"),
    ("aten::add", "Block.forward", "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "",
     "elementwise"),
    ("aten::_propagate_property", "", "elementwise"),  # "property" holds "rope": not RoPE
    ("triton_poi_fused_add_mul_silu_0", "", "fused"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1", "RMSNorm.forward", "fused"),
    ("aten::copy_", "", "copy/cast"),
    ("aten::embedding", "Llama.forward", "copy/cast"),
    ("Memcpy HtoD (Pinned -> Device)", "", "copy/cast"),
)


@pytest.mark.parametrize(("name", "scope", "category"), KNOWN)
def test_the_classifier_puts_real_op_and_kernel_names_in_their_category(profile_step, name, scope, category):
    assert profile_step.classify(name, scope) == category


def test_every_category_is_reachable_and_unknown_names_are_other(profile_step):
    assert {category for _, _, category in KNOWN} | {"other"} == set(profile_step.CATEGORIES)
    assert profile_step.classify("some_vendor_kernel_v2", "") == "other"


def test_arguments(profile_step, tmp_path, capsys):
    args = profile_step.parse_args(["--out", str(tmp_path), "--device", "cpu"])
    assert (args.shape, args.dtype, args.iters, args.cache_len) == ("tiny", "float32", 3, 512)
    assert profile_step.parse_args(["--out", str(tmp_path)]).shape == "llama-7b"
    for bad, message in ((["--device", "cpu", "--shape", "llama-7b"], "use --shape tiny on the CPU"),
                         (["--budget-seconds", "0"], "--budget-seconds must be positive"),
                         (["--cache-len", "2000"], "--cache-len must be in 1 .."),
                         (["--iters", "0"], "--iters must be at least 1"),
                         (["--device", "cpu", "--weights", "int4"], "use --device cuda")):
        with pytest.raises(SystemExit) as exit_info:
            profile_step.parse_args(["--out", str(tmp_path), *bad])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def tiny_bytes(profile_step, projection) -> int:
    """The tiny shape's step by hand: each layer's QKV, output, gate/up and down projections and the lm_head at
    `projection(n, k)` bytes, and float32 norms (two a layer and the last), no embedding table."""
    cfg = profile_step.SHAPES["tiny"]
    h, q, kv, ffn = (cfg["hidden_size"], cfg["num_heads"] * cfg["head_dim"], cfg["num_kv_heads"] * cfg["head_dim"],
                     cfg["intermediate_size"])
    layer = projection(q + 2 * kv, h) + projection(h, q) + projection(2 * ffn, h) + projection(h, ffn)
    return cfg["num_layers"] * (layer + 2 * h * 4) + h * 4 + projection(cfg["vocab_size"], h)


@pytest.mark.parametrize("bits", [4, 8])
def test_random_blocks_quantize_every_projection_and_the_limit_counts_them_as_held(profile_step, tmp_path, bits):
    from trt_lookahead.model.llama import Linear, QuantizedLinear

    args = profile_step.parse_args(["--out", str(tmp_path), "--device", "cpu"])
    float_model = profile_step.build_model(args, "fast")
    assert profile_step.model_bytes(float_model, 1, 1, 8)["weight_bytes"] == tiny_bytes(
        profile_step, lambda n, k: n * k * 4)
    model = profile_step.random_blocks(profile_step.build_model(args, "fast"), bits)
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(quantized) == 4 * profile_step.SHAPES["tiny"]["num_layers"] + 1
    assert not [m for m in model.modules() if isinstance(m, Linear)] and all(m.bits == bits for m in quantized)

    def blocks(n: int, k: int) -> int:  # codes, a float32 scale a block of 32, zero points (int4: two a byte)
        b = -(-k // 32)
        return n * b * 32 * bits // 8 + n * b * 4 + n * (b if bits == 8 else -(-b // 2))

    found = profile_step.model_bytes(model, 2, 3, 8)
    cfg = profile_step.SHAPES["tiny"]
    assert found == {"weight_bytes": tiny_bytes(profile_step, blocks),
                     "kv_bytes": 2 * cfg["num_layers"] * 2 * (8 + 3) * cfg["num_kv_heads"] * cfg["head_dim"] * 4}


@pytest.mark.slow  # the script in a fresh interpreter (~30 s on 2 cores)
def test_cpu_tiny_run_measures_every_cell_and_counts_kernels_per_layer(profile_step, tmp_path):
    done = run_script("profile_step", "--out", str(tmp_path), "--device", "cpu", "--shape", "tiny", "--iters", "1",
                      "--cache-len", "32", "--max-seq-len", "160", "--budget-seconds", "150")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "profile_step: tiny float32 on cpu" in done.stdout and "kernels per layer" in done.stdout
    report = json.loads((tmp_path / "profile_step.json").read_text())
    assert report["finished"] and report["bandwidth"]["gb_per_s"] > 0 and report["machine"]["loadavg"]
    cells = {(c["variant"], c["T"], c["B"]): c for c in report["steps"]["cells"]}
    expected = {(v, T, B) for v in profile_step.VARIANTS for T in (1, 16, 56, 120) for B in (1, 8)}
    assert set(cells) == expected and len(report["steps"]["cells"]) == len(expected)
    for key, cell in cells.items():
        if cell["status"] == "ok":
            assert cell["ms"] > 0 and cell["limit_ms"] > 0 and cell["ratio"] > 0, key
            assert cell["kernels_per_step"] > 0, key
        else:
            assert cell["status"] in ("not available", "skipped") and cell["error"], key
    # the compiled step (BatchedTorchExecutor compile=True): one graph, or skipped where the budget ran out
    compiled = [cells["fast_compiled", T, B] for T in (1, 16, 56, 120) for B in (1, 8)]
    assert {c["status"] for c in compiled} <= {"ok", "skipped"}, compiled
    assert all(c["graph_breaks"] == 0 and c["compile_seconds"] > 0 for c in compiled if c["status"] == "ok")
    assert report["variants"]["sdpa"]["status"] == "not available"
    fast = [c for c in report["steps"]["cells"] if c["variant"] == "fast" and c["status"] == "ok"]
    assert len(fast) == 8, [c.get("error") for c in report["steps"]["cells"] if c["variant"] == "fast"]
    for cell in fast:
        per_layer = cell["kernels_per_layer"]
        assert per_layer["GEMM"] > 0 and per_layer["attention"] > 0 and per_layer["norm"] > 0, per_layer
        assert per_layer["GEMM"] == 4  # wqkv, wo, w13, w2: one GEMM each
        assert per_layer["KV write"] == 2 and per_layer["RoPE"] > 0  # the K and the V rows
        assert cell["kernels_outside_layers"]["argmax"] >= 1 and cell["kernels_outside_layers"]["GEMM"] == 1
        assert cell["graph_breaks"] is None and cell["compile_seconds"] is None
    exact = [c for c in report["steps"]["cells"] if c["variant"] == "exact" and c["status"] == "ok"]
    assert exact and all(c["kernels_per_layer"]["attention"] > 0 for c in exact)
    # the Triton attention steps are CUDA's: skipped on the CPU with the reason (interpreted, they would time the
    # interpreter); tests/kernels and tests/backends run the kernel interpreted for its values
    for variant in profile_step.TRITON_VARIANTS:
        assert report["variants"][variant]["status"] == "skipped", report["variants"][variant]
        for cell in (c for c in report["steps"]["cells"] if c["variant"] == variant):
            assert cell["status"] == "skipped" and "CUDA" in cell["error"], cell
    # the same context at two max_seq_len: the fast step timed at both, the Triton one skipped as above
    seq_len = report["seq_len"]
    assert seq_len["status"] == "ok" and seq_len["max_seq_lens"] == list(profile_step.SEQ_LEN_PAIRS["cpu"])
    by_variant = {(c["variant"], c["T"]): c for c in seq_len["cells"]}
    assert set(by_variant) == {(v, T) for v in profile_step.SEQ_LEN_VARIANTS for T in profile_step.SEQ_LEN_STEP_TOKENS}
    for T in profile_step.SEQ_LEN_STEP_TOKENS:
        cell = by_variant["fast", T]
        assert cell["status"] == "ok" and set(cell["ms"]) == {"256", "64"} and all(v > 0 for v in cell["ms"].values())
        assert cell["ratio"] == round(cell["ms"]["256"] / cell["ms"]["64"], 3)
        assert cell["within_goal"] == (cell["ms"]["256"] / cell["ms"]["64"] <= profile_step.SEQ_LEN_GOAL)
        assert by_variant["fast_triton", T]["status"] == "skipped"
    assert "seq_len fast T=1: max_seq_len 256" in done.stdout
    peer = report["peer"]
    assert peer["status"] == "ok" and len(peer["cells"]) == 8
    assert all(c["ms"] > 0 for c in peer["cells"] if c["status"] == "ok") and peer["cells"][0]["status"] == "ok"


@pytest.mark.slow  # a fresh interpreter (seconds)
def test_without_a_gpu_cuda_fails_with_one_clear_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the real profile would run")
    done = run_script("profile_step", "--out", str(tmp_path / "out"), "--device", "cuda")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("error: --device cuda but") and "--device cpu" in lines[0]
    assert not (tmp_path / "out").exists()


def test_the_triton_variants_pass_the_attention_choice(profile_step, tmp_path):
    """fast_triton (and the compiled one) build the executor with attention="triton"; both are CUDA's alone,
    skipped on the CPU with the reason."""
    status = profile_step.variant_status("cpu")
    for variant in ("fast_triton", "fast_compiled_triton"):
        assert status[variant]["status"] == "skipped" and "CUDA only" in status[variant]["error"]
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("building a Triton-attention executor on the CPU needs TRITON_INTERPRET=1 (tests/conftest.py)")
    args = profile_step.parse_args(["--out", str(tmp_path), "--device", "cpu", "--cache-len", "8",
                                    "--max-seq-len", "32"])
    model = profile_step.build_model(args, "fast_triton")
    executor = profile_step.make_executor(model, "fast_triton", 1, 16, args, graph=False)
    assert executor.attention == profile_step.TRITON_ATTENTION and not executor.exact and executor.padded
    assert profile_step.make_executor(model, "fast", 1, 16, args, graph=False).attention == "sdpa"
