"""scripts/bench_quantized_gpu.py on the CPU: the projections it times, random weights in the layout the kernel
reads (checked against QuantizedLinear's own dequantization), the step sums, and the one-line error without a
GPU. Its timings come from a lent GPU."""

from __future__ import annotations

import pytest
import torch
from support.scripts import load_script, run_script

from trt_lookahead.backends.devices import gpu_count
from trt_lookahead.kernels import invariant, reference
from trt_lookahead.model.llama import QuantizedLinear


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_quantized_gpu")


def test_the_7b_shapes_projections(bench):
    assert bench.projections(bench.SHAPES["llama-7b"]) == {
        "wqkv": (3 * 4096, 4096), "wo": (4096, 4096), "w13": (2 * 11008, 4096), "w2": (4096, 11008),
        "lm_head": (32000, 4096)}
    assert bench.projections(bench.SHAPES["llama-1b"])["wqkv"] == (2048 + 2 * 512, 2048)  # 8 KV heads of 64


@pytest.mark.parametrize("bits", [4, 8])
def test_random_weights_are_in_the_layout_the_kernel_reads(bench, bits):
    """K = 96: three blocks, an odd count (int4 zero points: the last byte half used)."""
    device = "cuda" if gpu_count() else "cpu"  # where the kernel runs (interpreted on the CPU)
    codes, scales, zeros = bench.quantized_weight(40, 96, bits, device)
    assert codes.shape == (40, 96 * bits // 8) and scales.shape == (40, 3)
    assert zeros.shape == (40, 3 if bits == 8 else 2)
    dense = QuantizedLinear(codes, scales, zeros, None, bits, 96).dense_weight()
    x = torch.randn(3, 96, device=device)
    y = invariant.quantized_linear(x, codes, scales, zeros, None, bits)
    # float32 rounding only: a code read from the wrong place moves it by about 1e-1
    assert reference.relative_error(y.cpu(), (x.double() @ dense.double().t()).cpu()) < 1e-6


def test_step_sums_add_each_layers_projections_and_one_lm_head(bench):
    rows = [{"projection": "wqkv", "variant": "int4", "M": 1, "us": 2.0, "limit_us": 1.0},
            {"projection": "w2", "variant": "int4", "M": 1, "us": 3.0, "limit_us": 2.0},
            {"projection": "lm_head", "variant": "int4", "M": 1, "us": 50.0, "limit_us": 40.0},
            {"projection": "wo", "variant": "int4", "M": 1, "error": "failed"}]
    assert bench.step_sums(rows, layers=10) == [
        {"variant": "int4", "M": 1, "ms": 0.1, "limit_ms": 0.07, "x_limit": 1.43}]  # 20 + 30 + 50 over 10 + 20 + 40


@pytest.mark.skipif(gpu_count() > 0, reason="the error is for machines without a GPU")
def test_without_a_gpu_it_says_so_in_one_line(tmp_path):
    result = run_script("bench_quantized_gpu", "--out", str(tmp_path / "q.json"))
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
    assert "error: no CUDA device" in result.stderr and not (tmp_path / "q.json").exists()
