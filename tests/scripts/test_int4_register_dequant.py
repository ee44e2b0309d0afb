"""scripts/int4_register_dequant.py (the candidate GPU int4 product) and scripts/sass_census.py on the CPU: where
`repack` puts each code (hand-computed), its weight against the engine's, the interpreted product against float64
and a row alone, the step sums, and (slow) the sm_90 compile: the weight operand from registers, fewer loop
instructions a weight than the landed kernel. The candidate's timings come from a lent GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from support.scripts import ROOT, load_script, run_script

from trt_lookahead.backends.devices import gpu_count
from trt_lookahead.model.llama import QuantizedLinear

DEVICE = "cuda" if gpu_count() else "cpu"  # where the kernel runs (interpreted on the CPU)


@pytest.fixture(scope="module")
def cand():
    return load_script("int4_register_dequant")


@pytest.fixture(scope="module")
def census():
    return load_script("sass_census")


def int4_buffers(n: int, k: int, seed: int, exact: bool = False):
    """Random int4 (codes, scales, zero points, mins) in MatMulNBits' layout; exact: scales powers of two and
    mins multiples of 1/64, so bfloat16 holds them and every weight exactly."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-k // 32)
    codes = torch.randint(0, 256, (n, blocks * 16), dtype=torch.uint8, generator=g)
    zeros = torch.randint(0, 256, (n, -(-blocks // 2)), dtype=torch.uint8, generator=g)
    if exact:
        scales = 2.0 ** -torch.randint(3, 7, (n, blocks), generator=g).float()  # weights below 4 in steps of 1/64
        mins = torch.randint(-64, 64, (n, blocks), generator=g).float() / 64
    else:
        scales = torch.rand(n, blocks, generator=g) / 16
        mins = torch.rand(n, blocks, generator=g) - 0.5
    return codes.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), mins.to(DEVICE)


def test_repack_puts_each_code_where_the_docstring_says(cand):
    """Dim d of a step sits in word (d % 32) // 2, nibble d // 32 + 4 * (d % 2): dim 37 -> word 2, nibble 5;
    dim 127 (block 3, the last odd dim) -> word 15, nibble 7, the int32's sign bit."""
    codes = torch.zeros(2, 64, dtype=torch.uint8)  # two outputs, K = 128: one step
    codes[0, 37 // 2] = 9 << 4  # dim 37: the high nibble of byte 18
    codes[1, 0] = 3  # dim 0
    codes[1, 33 // 2] = 5 << 4  # dim 33
    codes[1, 127 // 2] = 12 << 4  # dim 127
    packed = cand.repack(codes, torch.ones(2, 4), torch.zeros(2, 2, dtype=torch.uint8), None, 128)
    want = torch.zeros(2, 16, dtype=torch.int64)
    want[0, 2] = 9 << 20
    want[1, 0] = 3 | 5 << 20
    want[1, 15] = 12 << 28
    assert torch.equal(packed.words.long() & 0xFFFFFFFF, want)
    assert packed.words.dtype == torch.int32 and packed.words[1, 15] < 0


@pytest.mark.parametrize("k", [96, 128, 300])
def test_dense_is_the_engine_weight_where_bfloat16_holds_it(cand, k):
    """Scales, zero points and mins bfloat16 holds exactly: the candidate's weight is the engine's, every element
    (K = 96 and 300 pad the last step); a code read from the wrong dim moves an element by a scale."""
    codes, scales, zeros, mins = int4_buffers(7, k, seed=k, exact=True)
    for m in (None, mins):
        engine = QuantizedLinear(codes, scales, zeros, m, 4, k).dense_weight()
        assert torch.equal(cand.dense(cand.repack(codes, scales, zeros, m, k)), engine)


def test_dense_rounds_the_engine_weight_to_bfloat16(cand):
    codes, scales, zeros, mins = int4_buffers(9, 200, seed=1)
    engine = QuantizedLinear(codes, scales, zeros, mins, 4, 200).dense_weight()
    got = cand.dense(cand.repack(codes, scales, zeros, mins, 200))
    # s and m rounded to bfloat16, then the weight: a few units of bfloat16's 2^-8 against the block's range
    scale = (scales * 15 + mins.abs()).repeat_interleave(32, 1)[:, :200]
    assert 0 < ((got - engine).abs() / scale).max() < 2**-7


@pytest.mark.parametrize(("dtype", "k", "tile", "span", "tolerance"), [
    (torch.float32, 96, None, "auto", 1e-6),  # one step, K padded (a GPU's float32 dot: not tensor cores)
    (torch.float32, 1000, (64, 4, 2, 3), 256, 1e-6),  # two steps an iteration, four spans, a half-used last step
    (torch.bfloat16, 512, (128, 8, 1, 3), None, 8e-3),  # bfloat16 out: its rounding
])
def test_product_is_the_float64_product_by_its_weight(cand, dtype, k, tile, span, tolerance):
    """Interpreted (float32 weights holding the bfloat16 values the GPU's pairs hold); 70 outputs: a partial
    BLOCK_N; Q4_1 mins and zero points."""
    codes, scales, zeros, mins = int4_buffers(70, k, seed=3)
    for m in (None, mins):
        packed = cand.repack(codes, scales, zeros, m, k)
        x = torch.randn(5, k, device=DEVICE).to(dtype)
        y = cand.int4_linear(x, packed, tile or cand.TILE, span)
        want = x.double() @ cand.dense(packed).double().t()
        assert y.dtype == dtype and y.shape == (5, 70)
        assert ((y.double() - want).norm() / want.norm()).item() < tolerance


def test_a_row_has_the_same_bits_alone_and_in_any_batch(cand):
    """M = 1, 2 and 17 (two programs of 16 rows): row i's bits never depend on the rows beside it."""
    codes, scales, zeros, mins = int4_buffers(64, 384, seed=4)
    packed = cand.repack(codes, scales, zeros, mins, 384)
    x = torch.randn(17, 384, device=DEVICE).to(torch.bfloat16)
    together = cand.int4_linear(x, packed, span=128)
    for i in (0, 1, 16):
        assert torch.equal(cand.int4_linear(x[i : i + 1], packed, span=128)[0], together[i])
    assert torch.equal(cand.int4_linear(x[:2], packed, span=128), together[:2])


def test_spans_added_inside_the_launch_give_the_same_bits_and_leave_the_counters_zero(cand):
    """Four spans of 256 (K = 1000), 17 rows: two row programs x two output programs, each tile's last span adding
    all four in span order, as the second launch does; twice, as a CUDA graph's replays reuse the counters."""
    codes, scales, zeros, mins = int4_buffers(70, 1000, seed=6)
    packed = cand.repack(codes, scales, zeros, mins, 1000)
    x = torch.randn(17, 1000, device=DEVICE).to(torch.bfloat16)
    two_launches = cand.int4_linear(x, packed, (64, 4, 1, 3), 256)
    for _ in range(2):
        assert torch.equal(cand.int4_linear(x, packed, (64, 4, 1, 3), 256, fused_sum=True), two_launches)
        assert not cand.counters(x.device, 4).any()


def test_refuses_a_span_that_splits_an_iteration_and_codes_that_are_not_blocks(cand):
    codes, scales, zeros, _ = int4_buffers(4, 256, seed=5)
    packed = cand.repack(codes, scales, zeros, None, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        cand.int4_linear(torch.ones(1, 256, device=DEVICE), packed, (64, 4, 2, 3), span=128)
    with pytest.raises(ValueError, match="do not hold 8 blocks"):
        cand.repack(codes[:, :100], scales, zeros, None, 256)


def test_step_sums_rank_fixed_and_per_shape_configurations(cand):
    """Two layers, M 1 and 16. Tile A runs (None, False) and (512, True) everywhere, and (1024, False) fastest of
    all but failing a check on wqkv at M 16, so counted nowhere; tile B misses the lm_head (an error row), so it has
    no whole step. A's per-shape choice by the sums over both M: wqkv (512, True) 150 < 300,
    w2 (None, False) 300 < 700, lm_head (None, False) 1200 < 1350. At M 1: per shape 50 x 2 + 100 x 2 + 400 = 700
    us, fixed None 800, fixed 512 850; at M 16: 1400, 1600, 2200. Limit (50 + 50) x 2 + 300 = 500, landed (300 +
    300) x 2 + 1000 = 2200."""
    A, B = [64, 4, 1, 3], [128, 4, 1, 3]
    times = {  # (projection, M): (A None, A 512 fused, B None or None for an error)
        ("wqkv", 1): (100, 50, 70), ("w2", 1): (100, 200, 70), ("lm_head", 1): (400, 350, None),
        ("wqkv", 16): (200, 100, 100), ("w2", 16): (200, 500, 100), ("lm_head", 16): (800, 1000, None)}
    rows = [{"projection": name, "M": M, "landed_us": 1000.0 if name == "lm_head" else 300.0,
             "limit_us": 300.0 if name == "lm_head" else 50.0,
             "candidates": [{"tile": A, "span": None, "fused_sum": False, "us": a, "passed": True},
                            {"tile": A, "span": 512, "fused_sum": True, "us": a512, "passed": True},
                            {"tile": A, "span": 1024, "fused_sum": False, "us": 1.0,
                             "passed": (name, M) != ("wqkv", 16)},
                            {"tile": B, "span": None, "fused_sum": False,
                             **({"us": b, "passed": True} if b else {"error": "x"})}]}
            for (name, M), (a, a512, b) in times.items()]
    names = ("wqkv", "w2", "lm_head")

    def config(rule, spans, ms, x_limit):
        return {"tile": A, "rule": rule, "spans": dict(zip(names, spans, strict=True)), "ms": ms, "x_limit": x_limit}

    per_shape = ([512, True], [None, False], [None, False])
    every_none, every_512 = ([None, False],) * 3, ([512, True],) * 3
    assert cand.step_sums(rows, layers=2) == [
        {"M": 1, "landed_ms": 2.2, "limit_ms": 0.5,
         "best": [config("per shape", per_shape, 0.7, 1.4), config("fixed", every_none, 0.8, 1.6),
                  config("fixed", every_512, 0.85, 1.7)]},
        {"M": 16, "landed_ms": 2.2, "limit_ms": 0.5,
         "best": [config("per shape", per_shape, 1.4, 2.8), config("fixed", every_none, 1.6, 3.2),
                  config("fixed", every_512, 2.2, 4.4)]}]


# a small Llama whose K (256) splits into spans of 128: every variant main times, in small
SMALL = {"hidden_size": 256, "head_dim": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256,
         "vocab_size": 64, "num_layers": 2}


def test_run_and_steps_check_and_time_every_variant_on_a_small_shape(cand):
    """main's flow without its GPU check: each variant (a whole-K chain, spans of 128 added by a second launch and
    inside the first) timed and checked on every projection, then whole steps of the best two fixed configurations
    by their sums and the per-shape one, the
    limit the candidate's bytes by hand (16 words of 4 bytes and 4 blocks' bfloat16 scale and offset a step of 128
    input dims an output)."""
    rows = cand.run(SMALL, [2], 1.0, ((64, 4, 1, 3),), (128, None), device=DEVICE)
    assert len(rows) == 5 and all(r["mins_check"]["row_alone_same_bits"] for r in rows)
    for r in rows:
        assert [(c["span"], c["fused_sum"]) for c in sorted(r["candidates"], key=lambda c: (c["span"] or 0,
                c["fused_sum"]))] == [(None, False), (128, False), (128, True)]
        for c in r["candidates"]:
            assert c["us"] > 0 and c["passed"] and c["row_alone_same_bits"] and c["relative_error"] < 1e-2
            assert c.get("same_bits_as_two_launches", True)
    sums = cand.step_sums(rows, SMALL["num_layers"])
    steps = cand.steps(SMALL, sums, 1.0, configs=2, device=DEVICE)  # two fixed, one per shape (one tile)
    step_bytes = sum(n * -(-k // 128) * (16 * 4 + 4 * 2 * 2) * (2 if name != "lm_head" else 1)
                     for name, (n, k) in {"wqkv": (512, 256), "wo": (256, 256), "w13": (512, 256),
                                          "w2": (256, 256), "lm_head": (64, 256)}.items())
    assert [s["M"] for s in steps] == [2]
    for s in steps:
        assert s["limit_ms"] == round(step_bytes / 1e6, 3) and s["landed_ms"] > 0
        assert sorted(b["rule"] for b in s["best"]) == ["fixed", "fixed", "per shape"]
        assert all(b["ms"] > 0 and b["sum_ms"] > 0 for b in s["best"])


@pytest.mark.skipif(gpu_count() > 0, reason="the error is for machines without a GPU")
def test_without_a_gpu_it_says_so_in_one_line(tmp_path):
    result = run_script("int4_register_dequant", "--out", str(tmp_path / "c.json"))
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
    assert "error: no CUDA device" in result.stderr and not (tmp_path / "c.json").exists()


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
.L_x_1:
        /*0020*/                   LOP3.LUT R4, R5, 0xf000f, RZ, 0xc0, !PT ;
        /*0030*/                   HFMA2.BF16_V2 R4, R4, R6, R7 ;
.L_x_2:
        /*0040*/              @!P0 BRA `(.L_x_2) ;
        /*0050*/                   HGMMA.64x16x16.F32.BF16 R24, R32, gdesc[UR4], R24, gsb0 ;
        /*0060*/               @P1 BRA `(.L_x_1) ;
        /*0070*/                   EXIT ;
"""


def test_loop_census_counts_the_longest_loop_by_opcode(census):
    """The loop from .L_x_1 to the branch back to it, not the shorter one at .L_x_2, nor what lies outside."""
    assert census.loop_census(SASS) == {"LOP3": 1, "HFMA2": 1, "BRA": 2, "HGMMA": 1}
    assert census.loop_census(SASS.replace("@P1 BRA `(.L_x_1)", "NOP")) == {"BRA": 1}
    assert census.loop_census("") == {}


@pytest.mark.slow  # compiles seven kernels for sm_90 in a fresh interpreter (seconds)
def test_the_candidate_takes_its_weights_from_registers_in_fewer_instructions(tmp_path):
    """The claim the candidate stands on, read from its sm_90 compile here: wgmma takes the dequantized weights
    from registers (the landed kernel's go through shared memory), in fewer loop instructions a weight; and the
    spans added inside the launch compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "census.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "sass_census.py"), "--tiles", "2", "--out",
                           str(out)], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    kernels = json.loads(out.read_text())["kernels"]
    landed = [k for k in kernels if k["kernel"] == "landed"]
    proposed = [k for k in kernels if k["kernel"] == "candidate"]
    assert len(landed) == 2 and len(proposed) == 5 and sum(k["fused_sum"] for k in proposed) == 1
    assert not any(k["weights_from_registers"] for k in landed)
    assert all(k["weights_from_registers"] for k in proposed)
    assert max(k["per_weight"] for k in proposed) < min(k["per_weight"] for k in landed)
