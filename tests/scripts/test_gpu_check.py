"""scripts/gpu_check.py on a CPU: arguments, report schema, projection arithmetic, plots and table, JUnit
parsing, and the one-line failure where no GPU exists. The GPU sections themselves run on a lent GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.scripts import load_script, run_script

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check")


def latency_rows() -> list[dict]:
    """Two shapes; T = 1, 16, 56 timed; one failed timing (no median) that must be ignored."""
    ms = {("a", 1): 10.0, ("a", 16): 12.5, ("a", 56): 20.0, ("b", 1): 4.0, ("b", 16): 8.0}
    rows = [{"model": m, "T": T, "config": "-", "attention": "triton", "mode": "graph", "median_ms": v, "min_ms": v}
            for (m, T), v in ms.items()]
    rows.append({"model": "b", "T": 56, "config": "-", "attention": "triton", "mode": "graph", "error": "boom"})
    return rows


def test_arguments(gpu_check, tmp_path, capsys):
    args = gpu_check.parse_args(["--out", str(tmp_path / "o")])
    assert (args.sections, args.quick, args.budget_s) == (list(gpu_check.SECTIONS), False, 540.0)
    assert gpu_check.parse_args(["--out", "x", "--quick", "--sections", "aot, latency"]).sections == ["aot", "latency"]
    for bad, message in ((["--sections", "tests,speed"], "unknown section speed"),
                         (["--budget-s", "0"], "--budget-s must be positive"),
                         (["--summarize", str(tmp_path / "none.json")], "does not exist")):
        with pytest.raises(SystemExit) as exit_info:
            gpu_check.parse_args(["--out", str(tmp_path), *bad])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--out", str(tmp_path / "file")])
    assert "is a file" in capsys.readouterr().err


def test_projection_is_compression_times_t1_over_tT(gpu_check):
    cpu = {"source": "a table", "compression": {"4/3/4": 2.0, "7/5/7": 2.5, "15/5/15": 3.0}}
    rows = gpu_check.projection({"rows": latency_rows()}, cpu)["rows"]
    got = {(r["model"], r["config"]): (r["T"], r["step_cost_ratio"], r["projected_speedup"]) for r in rows}
    # a: 2.0 x 10 / 12.5 = 1.6 at T=16, 2.5 x 10 / 20 = 1.25 at T=56; b: 2.0 x 4 / 8 = 1.0; b at T=56 failed,
    # T=120 (15/5/15) was not measured: no rows
    assert got == {("a", "4/3/4"): (16, 1.25, 1.6), ("a", "7/5/7"): (56, 2.0, 1.25), ("b", "4/3/4"): (16, 2.0, 1.0)}


def test_readme_compression_table(gpu_check):
    text = "Measured so (2026-11-22):\n\n| config | A | overall | x |\n|---|---:|---:|---:|\n" \
           "| 4/3/4 | 1.4 | 1.70 | - |\n| 15/5/15 | 1.7 | 2.18 | 1.8 |\n| prompt lookup | 1.2 | 1.63 | |\n\nafter\n"
    parsed = gpu_check.readme_compression(text)
    assert parsed["compression"] == {"4/3/4": 1.70, "15/5/15": 2.18}
    assert "Measured so (2026-11-22)" in parsed["source"]
    real = gpu_check.readme_compression(gpu_check.RESULTS.read_text(encoding="utf-8"))["compression"]
    assert {"4/3/4", "7/5/7", "15/5/15"} <= set(real) and all(v > 1 for v in real.values())
    with pytest.raises(ValueError, match="overall"):
        gpu_check.readme_compression("| config | A |\n|---|---|\n| 4/3/4 | 1 |\n")


def test_token_comparison(gpu_check):
    result = gpu_check.compare([[1, 2, 3], [1, 2, 3], [4, 5]], [[1, 2, 3], [1, 9, 3], [4, 5, 6]])
    assert result["identical"] == 1 and result["first_divergence"] == [None, 1, 2]
    assert (result["tokens_equal"], result["tokens"]) == (7, 9)


def test_junit_outcomes_of_a_real_pytest_run(gpu_check, tmp_path):
    (tmp_path / "test_three.py").write_text(
        "import pytest\n\ndef test_ok():\n    pass\n\ndef test_bad():\n    assert 1 == 2, 'one is not two'\n\n"
        "def test_later():\n    pytest.skip('needs a GPU')\n"
    )
    junit = tmp_path / "out.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                    f"--junitxml={junit}", str(tmp_path / "test_three.py")], capture_output=True, cwd=tmp_path)
    outcomes = {o["test"].split("::")[-1]: o for o in gpu_check.junit_outcomes(junit)}
    assert {k: o["outcome"] for k, o in outcomes.items()} == {"test_ok": "passed", "test_bad": "failed",
                                                              "test_later": "skipped"}
    assert "one is not two" in outcomes["test_bad"]["message"] and "GPU" in outcomes["test_later"]["message"]


def test_report_schema_names_what_is_wrong(gpu_check, tmp_path):
    report = gpu_check.new_report(gpu_check.parse_args(["--out", str(tmp_path)]))
    gpu_check.check_report(report)
    report["latency"] = {"status": "done", "seconds": 1.0}
    with pytest.raises(ValueError, match="latency"):
        gpu_check.check_report(report)
    report["latency"] = {"status": "failed", "seconds": 1.0}
    with pytest.raises(ValueError, match="without an error"):
        gpu_check.check_report(report)
    del report["machine"]
    with pytest.raises(ValueError, match="lacks machine"):
        gpu_check.check_report(report)


def test_summarize_writes_plots_table_and_a_valid_report(gpu_check, tmp_path):
    report = gpu_check.new_report(gpu_check.parse_args(["--out", str(tmp_path)]))
    report["machine"] = {"gpu": "Test GPU", "torch": "0", "triton": "0"}
    report["latency"] = {"status": "ok", "seconds": 3.0, "rows": latency_rows()}
    source = tmp_path / "in.json"
    source.write_text(json.dumps(report))
    done = run_script("gpu_check", "--summarize", str(source), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-2000:]
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["gpu_check.json", "latency.png", "projection.png", "readme_table.md"]
    for name in ("latency.png", "projection.png"):
        data = (tmp_path / "out" / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) < 16 * 2**20
    final = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    gpu_check.check_report(final)
    assert final["files"] == ["gpu_check.json", "latency.png", "projection.png", "readme_table.md"]
    table = (tmp_path / "out" / "readme_table.md").read_text()
    assert "| a | 16 | - | - | - | 12.500 | - | 1.25 |" in table and "Test GPU" in table
    assert any(r["config"] == "4/3/4" and r["model"] == "a" for r in final["projection"]["rows"])


@pytest.mark.slow  # runs the script in a fresh interpreter (seconds)
def test_without_a_gpu_it_fails_with_one_clear_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the real check would run")
    done = run_script("gpu_check", "--out", str(tmp_path / "out"), "--quick")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("error: no CUDA device") and "GPU machine" in lines[0]
    assert not (tmp_path / "out").exists()


def test_the_latency_sections_exact_step_is_the_sdpa_step_on_row_invariant_kernels(gpu_check):
    """StepInputs.exact (timed against sdpa per T on a GPU) computes the same step's logits: interpreted here,
    on a one-layer random Llama over the section's 512 cached keys."""
    import torch

    from trt_lookahead.model.llama import Llama, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
                      vocab_size=64, max_position_embeddings=2048)
    model = Llama(cfg).eval().requires_grad_(False)
    step = gpu_check.StepInputs(model, "4,3,4")
    with torch.inference_mode():
        exact, fast = step.exact(), step.sdpa()
    assert exact.shape == fast.shape == (16, 64)
    assert torch.allclose(exact, fast, rtol=1e-4, atol=1e-5), (exact - fast).abs().max()
