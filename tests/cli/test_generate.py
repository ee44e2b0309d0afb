"""`trt-lookahead generate` (and the parser of every command): output, JSON fields, one-line errors."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trt_lookahead.cli import main
from trt_lookahead.cli.main import COMMANDS, build_parser

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"


def messages(err: str) -> list[str]:
    """stderr's lines less the informational `trt-lookahead: ` ones (the backend that runs and why, a build's)."""
    return [line for line in err.strip().splitlines() if not line.startswith("trt-lookahead: ")]


def test_every_command_has_a_parser_and_python_m_runs_the_cli():
    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.dest == "command").choices
    assert set(subcommands) == set(COMMANDS)
    out = subprocess.run([sys.executable, "-m", "trt_lookahead.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and all(name in out.stdout for name in COMMANDS)


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_json_has_every_field(capsys):
    code, out, _ = run_cli(
        capsys, "generate", "--model", str(STORIES), "--prompt", "Once upon a time", "--max-new-tokens", "40",
        "--lookahead_config", "[7,5,7]", "--json",
    )
    assert code == 0
    record = json.loads(out.strip().splitlines()[-1])
    for key in ("text", "token_ids", "prompt_tokens", "generated_tokens", "steps", "compression", "prefill_seconds",
                "decode_seconds", "tokens_per_second", "config", "backend", "dtype"):
        assert key in record, key
    assert record["config"] == "7/5/7" and record["backend"] == "onnxruntime" and record["dtype"] == "float32"
    assert record["weights"] == "float"
    assert record["generated_tokens"] == len(record["token_ids"]) == 40
    assert record["compression"] == pytest.approx(40 / record["steps"], abs=1e-3)
    assert record["prompt_tokens"] == 5


def test_generate_streams_text_then_one_stats_line(capsys):
    argv = ["generate", "--model", str(STORIES), "--prompt", "Once upon a time", "--max-new-tokens", "30"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0
    assert len(messages(err)) == 1 and "[auto " in err and "30 tokens in" in err  # the default, said of nowhere else
    assert "stories260K runs on onnxruntime (the default for float32" in err  # once, with why
    _, as_json, _ = run_cli(capsys, *argv, "--json")
    assert out == json.loads(as_json)["text"] + "\n"


def test_generate_greedy_and_lookahead_print_the_same_text(capsys, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("The cat sat on the")
    texts = []
    for mode in (["--greedy"], ["--lookahead_config", "15/5/15"]):
        code, out, _ = run_cli(capsys, "generate", "--model", str(STORIES), "--prompt-file", str(prompt_file),
                               "--max-new-tokens", "50", "--json", *mode)
        assert code == 0
        texts.append(json.loads(out.strip().splitlines()[-1])["token_ids"])
    assert texts[0] == texts[1]


@pytest.mark.parametrize("prompt", ["Tom had a red ball. He", "The sun was hot and"])
def test_bfloat16_lookahead_equals_greedy_with_exact(capsys, prompt):
    """--exact (the default on the CPU) makes bfloat16 lookahead token-identical to bfloat16 greedy; with
    --no-exact these prompts diverge (15/5/15 against greedy, stories260K, 64 tokens)."""
    ids = []
    for mode in (["--greedy"], ["--lookahead_config", "15/5/15"]):
        code, out, _ = run_cli(capsys, "generate", "--model", str(STORIES), "--prompt", prompt, "--dtype", "bfloat16",
                               "--max-new-tokens", "64", "--exact", "--json", *mode)
        assert code == 0
        ids.append(json.loads(out.strip().splitlines()[-1])["token_ids"])
    assert ids[0] == ids[1]


def broken_copies(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (model dir, expected words in the error line)."""
    cases = {}

    def copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(STORIES, dst)
        return dst

    cases["missing"] = (tmp_path / "nowhere", "nowhere")
    d = copy("nonllama")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (d / "config.json").write_text(json.dumps(cfg))
    cases["nonllama"] = (d, "gpt2")
    d = copy("malformed")
    (d / "config.json").write_text("{not json")
    cases["malformed"] = (d, "config.json")
    d = copy("truncated")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    cases["truncated"] = (d, "model.safetensors")
    d = copy("noweights")
    (d / "model.safetensors").unlink()
    cases["noweights"] = (d, "safetensors")
    return cases


@pytest.mark.parametrize("case", ["missing", "nonllama", "malformed", "truncated", "noweights"])
def test_generate_bad_checkpoints_exit_2_with_one_line(capsys, tmp_path, case):
    model, words = broken_copies(tmp_path)[case]
    code, _, err = run_cli(capsys, "generate", "--model", str(model), "--prompt", "Hi", "--max-new-tokens", "5")
    assert code == 2
    lines = messages(err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err
    assert words.lower() in lines[0].lower()


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--lookahead_config", "0,3,4"], "W=0 is impossible"),
        (["--lookahead_config", "4,3"], "W,N,G"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be positive"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "does not exist"),
        (["--max-seq-len", "64", "--prompt", "Once upon a time " * 40], "leave no room to generate in max_seq_len 64"),
    ],
)
def test_generate_bad_arguments_exit_2_with_one_line(capsys, extra, words):
    argv = ["generate", "--model", str(STORIES), "--max-new-tokens", "5", *extra]
    if "--prompt" not in extra and "--prompt-file" not in extra:
        argv += ["--prompt", "Hi"]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2, err
    assert len(messages(err)) == 1 and words in err and "Traceback" not in err
