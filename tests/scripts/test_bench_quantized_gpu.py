"""scripts/bench_quantized_gpu.py on the CPU: the projections it times, random weights in the layout the kernel
reads (checked against QuantizedLinear's own dequantization), how many copies keep a weight out of L2, a whole
step's products each by its own layer's weight, every variant run on a small shape, the step sums, and the
one-line error without a GPU. Its timings come from a lent GPU."""

from __future__ import annotations

import pytest
import torch
from support.scripts import load_script, run_script

from trt_lookahead.backends.devices import gpu_count
from trt_lookahead.engine.quantize import BLOCK_SIZE
from trt_lookahead.kernels import invariant, reference
from trt_lookahead.model.llama import QuantizedLinear

DEVICE = "cuda" if gpu_count() else "cpu"  # where the kernels run (interpreted on the CPU)
# a small GQA Llama: K of 64 (hidden, heads x head_dim) and 96 (the MLP's), three blocks of 32
SMALL = {"hidden_size": 64, "head_dim": 16, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 96,
         "vocab_size": 128, "num_layers": 2}
ORDER = ["wqkv", "wo", "w13", "w2"] * 2 + ["lm_head"]
SIZES = {"wqkv": (128, 64), "wo": (64, 64), "w13": (192, 64), "w2": (64, 96), "lm_head": (128, 64)}


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_quantized_gpu")


def dense(weight, bits: int, k: int) -> torch.Tensor:
    codes, scales, zeros = weight
    return QuantizedLinear(codes, scales, zeros, None, bits, k).dense_weight()


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
    weight = dense((codes, scales, zeros), bits, 96)
    x = torch.randn(3, 96, device=device)
    y = invariant.quantized_linear(x, codes, scales, zeros, None, bits)
    # float32 rounding only: a code read from the wrong place moves it by about 1e-1
    assert reference.relative_error(y.cpu(), (x.double() @ weight.double().t()).cpu()) < 1e-6


def test_cold_copies_fill_the_l2_four_times_over(bench):
    mib = 1 << 20
    assert bench.cold_copies(8 * mib, 50 * mib) == 25  # 200 / 8
    assert bench.cold_copies(60 * mib, 50 * mib) == 4  # 200 / 60 = 3.3: one more
    assert bench.cold_copies(200 * mib, 50 * mib) == 1
    assert bench.cold_copies(300 * mib, 50 * mib) == 1
    assert bench.cold_copies(mib, 0) == 1  # no L2 to read past: the CPU
    assert bench.cold_copies(1024, 50 * mib) == 64  # COPIES_MAX


def test_a_step_runs_each_layers_own_weights_in_order_then_the_lm_head(bench):
    made = []

    def make(n, k, device):
        made.append((n, k, device))
        return len(made)  # a distinct weight each call

    weights = bench.step_weights(SMALL, make, "cpu")
    assert [name for name, _ in weights] == ORDER
    assert [w for _, w in weights] == list(range(1, 10))  # nine weights, none shared
    assert made == [(*SIZES[name], "cpu") for name in ORDER]
    inputs = {name: torch.full((1, k), float(i)) for i, (name, (_, k)) in enumerate(SIZES.items())}
    calls = bench.step_calls(weights, lambda x, w: (x, w), inputs)
    for (name, w), call in zip(weights, calls, strict=True):
        x, used = call()
        assert x is inputs[name] and used == w


def test_a_step_multiplies_each_projections_input_by_its_own_weight(bench):
    """The real int4 product over a small step: each output is the float64 product by that slot's weight."""
    weights = bench.step_weights(SMALL, bench.KINDS["int4"].make, DEVICE)
    inputs = bench.step_inputs(SMALL, 3, DEVICE)
    outputs = [call() for call in bench.step_calls(weights, bench.KINDS["int4"].products["int4"], inputs)]
    for (name, w), y in zip(weights, outputs, strict=True):
        x = inputs[name]
        want = x.double() @ dense(w, 4, SIZES[name][1]).double().t()
        assert y.shape == (3, SIZES[name][0])
        assert reference.relative_error(y.double().cpu(), want.cpu()) < 1e-2  # bfloat16 rows and outputs


def int4_step_bytes() -> int:
    """SMALL's whole step in int4 blocks of 32, by hand: codes N * K / 2, a float32 scale a block, zero points two
    a byte."""
    total = 0
    for name in ORDER:
        n, k = SIZES[name]
        blocks = -(-k // BLOCK_SIZE)
        total += n * k // 2 + n * blocks * 4 + n * -(-blocks // 2)
    return total


def test_bench_times_every_variant_and_whole_step_on_a_small_shape(bench):
    """The script's whole flow (main's, without its GPU check): a projection row per variant and M, a measured
    step per variant and M against the bytes of every layer's weights."""
    result = bench.bench(SMALL, [1, 3], peak_gbps=1.0, device=DEVICE)
    variants = ["bf16_cublas", "bf16_invariant", "int8", "int4"]
    assert not [r for r in result["rows"] if "error" in r]
    assert sorted((r["projection"], r["variant"], r["M"]) for r in result["rows"]) == sorted(
        (name, v, m) for name in SIZES for v in variants for m in (1, 3))
    assert not [s for s in result["step"] if "error" in s]
    assert sorted((s["variant"], s["M"]) for s in result["step"]) == sorted((v, m) for v in variants for m in (1, 3))
    int4 = [s for s in result["step"] if s["variant"] == "int4"]
    assert all(s["limit_ms"] == round(int4_step_bytes() / 1e6, 3) and s["ms"] > 0 for s in int4)
    assert len(result["projection_sums"]) == 8


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
