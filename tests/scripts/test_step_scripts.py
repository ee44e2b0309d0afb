"""scripts/cpu_step_parts.py, scripts/bench_attention_kernel.py, scripts/bench_quantized_kernel.py and
scripts/step_ab.py run end to end on what they measure: the step parts on stories260K's default CPU executor (its
weights-only graph holds every weight product of the model: four a layer and the tied lm_head), the kernels' timing
loops on the package's C sources and on a variant given by path, and a stories260K engine's steps under two
checkouts in alternating processes."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trt_lookahead.kernels.onnxruntime_library import native_library

ROOT = Path(__file__).resolve().parents[2]
STORIES = ROOT / "tests" / "fixtures" / "stories260K"


def run_script(name: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args, "--json"], check=True,
                         capture_output=True, text=True, timeout=600).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_shapes_are_parsed_as_rows_and_configs():
    spec = importlib.util.spec_from_file_location("cpu_step_parts", ROOT / "scripts" / "cpu_step_parts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.parse_shapes("1x4/3/4,8x2/2/2") == [(1, (4, 3, 4)), (8, (2, 2, 2))]
    assert module.parse_shapes("") == []


@pytest.mark.export
def test_step_parts_time_every_part_on_stories260k():
    config = json.loads((STORIES / "config.json").read_text())
    result = run_script("cpu_step_parts.py", "--model", str(STORIES), "--steps", "3", "--contexts", "4,9",
                        "--shapes", "2x2/2/2", "--shape-contexts", "5", "--tiny-nodes", "0,3")
    # q/k/v fused, o, gate/up fused, down: 4 projections a layer, and the lm_head
    assert result["gemms"] == 4 * config["num_hidden_layers"] + 1
    # the chains follow the products as wide as the hidden state: o and down, two a layer
    assert set(result["weights_only_ms"]) == {"0", str(3 * 2 * config["num_hidden_layers"])}
    assert set(result["greedy"]) == {"4", "9"} and set(result["shapes"]) == {"2x2/2/2"}
    assert set(result["shapes"]["2x2/2/2"]) == {"5"}
    assert all(parts["session"] > 0 and parts["commit"] > 0 for parts in result["greedy"].values())
    assert all(ms > 0 for ms in result["weights_only_ms"].values()) and result["shapes"]["2x2/2/2"]["5"] > 0


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_attention_kernel_bench_times_the_package_source_and_a_variant(tmp_path):
    package = run_script("bench_attention_kernel.py", "--cases", "16x1,8x4", "--heads", "4,2,8")
    assert set(package["ns_per_pair"]) == {"16x1", "8x4"} and all(v > 0 for v in package["ns_per_pair"].values())
    source = (ROOT / "trt_lookahead" / "kernels" / "onnxruntime_attention.c").read_text()
    failing = tmp_path / "failing.c"  # the variant is what runs: one whose every task fails is reported as such
    failing.write_text(source.replace("if (L < 0 || L > p->S) return 1;", "return 1;"))
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    for variant, message in ((failing, "failing.c: the kernel reported a failed task at 16x1"),
                             (broken, f"{broken} does not compile")):
        failed = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_attention_kernel.py"), "--source",
                                 str(variant), "--cases", "16x1"], capture_output=True, text=True, timeout=600)
        assert failed.returncode != 0 and "Traceback" not in failed.stderr and message in failed.stderr


@pytest.mark.skipif(not native_library().quantized, reason="QuantizedMatMul is not built here (no AVX2, FMA, F16C)")
def test_quantized_kernel_bench_times_each_row_count_and_names_a_source_that_does_not_build(tmp_path):
    timed = run_script("bench_quantized_kernel.py", "--shapes", "64x8x4,40x5x8,96x20x5", "--rows", "1,5")
    assert set(timed["us"]) == {"64x8x4", "40x5x8", "96x20x5"}
    assert all(set(times) == {"1", "5"} and min(times.values()) > 0 for times in timed["us"].values())
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    for argv, message in ((["--source", str(broken)], f"{broken} does not compile"),
                          (["--shapes", "64x8x3"], "64x8x3: BITS must be 4, 5 or 8")):
        failed = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_quantized_kernel.py"), *argv],
                                capture_output=True, text=True, timeout=600)
        assert failed.returncode != 0 and "Traceback" not in failed.stderr and message in failed.stderr


def test_step_ab_times_each_config_under_both_checkouts_round_by_round(tmp_path):
    """This checkout as both BEFORE and AFTER (what two worktrees are to the script): every round times every
    config in both processes, and a directory without the package is refused by name."""
    from trt_lookahead.cli import main

    engine = tmp_path / "engine"
    assert main(["build", "--model", str(STORIES), "--output", str(engine), "--lookahead_config", "2,3,2",
                 "--max_seq_len", "64"]) == 0
    result = run_script("step_ab.py", "--engine", str(engine), "--code", f"{ROOT},{ROOT}", "--configs",
                        "greedy,2/3/2", "--rounds", "2", "--steps", "3", "--context", "20")
    assert len(result["rounds"]) == 2 and set(result["median_ratio"]) == {"greedy", "2/3/2"}
    for row in result["rounds"]:
        assert set(row["before"]) == set(row["after"]) == {"greedy", "2/3/2"}
        assert all(ms > 0 for ms in (*row["before"].values(), *row["after"].values()))
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "step_ab.py"), "--engine", str(engine), "--code",
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "each a directory holding the trt_lookahead package" in done.stderr
