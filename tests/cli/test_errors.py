"""Hostile arguments to every command: one `error:` line naming the problem, exit 2, before any work (issue 10)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trt_lookahead.cli import main

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"


def one_error_line(capsys, argv: list[str]) -> str:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's errors exit from inside parse_args
        code = exc.code
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if not x.startswith("trt-lookahead: ")]  # less the backend line
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["generate", "--model", "M", "--prompt", "hi", "--max-new-tokens", "abc"], "invalid int value: 'abc'"),
        (["generate", "--model", "M"], "--prompt"),
        (["generate", "--model", "M", "--prompt", "hi", "--lookahead_config", "-1,2,0"], "--lookahead_config"),
        (["generate", "--model", "M", "--prompt", "hi", "--bogus"], "unrecognized arguments: --bogus"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "COMMAND"),
    ],
)
def test_argument_errors_are_one_line_naming_the_help(capsys, argv, words):
    line = one_error_line(capsys, argv)
    assert words in line and "--help" in line


def test_the_installed_entry_point_prints_no_usage_block():
    out = subprocess.run([sys.executable, "-m", "trt_lookahead.cli", "generate", "--model", "M", "--max-new-tokens",
                          "x", "--prompt", "hi"], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and out.stderr.startswith("error: ")


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--threads", "0"], "threads must be in [1, "),  # issue 10: RuntimeError traceback
        (["--threads", "-1"], "threads must be in [1, "),
        (["--threads", "100000"], "(the CPUs this process may run on), got 100000"),  # minutes of thread starts
        (["--seed", "-1"], "seed must be in [0, 2**64)"),  # issue 10: "expected non-negative integer"
        (["--seed", "-1", "--greedy"], "seed must be in [0, 2**64)"),
        (["--temperature", "inf", "--top-k", "5"], "temperature must be a finite number"),  # issue 10: ids all 0
        (["--temperature", "nan"], "temperature must be a finite number"),
        (["--top-p", "nan"], "top_p must be a finite number"),
        (["--lookahead_config", "100000,100000,100000"], "above the limit of 1024"),  # issue 10: numpy OOM
        (["--lookahead_config", "٤,3,4"], "W,N,G"),
        (["--backend", "tensorrt"], "runs engine dirs"),  # --model on onnxruntime: a cached engine
        (["--tree", "0,1"], "parents must be -1 (x_t) or an earlier node"),
        (["--tree=-1,0", "--lookahead_config", "4,3,4", "--backend", "torch"], "cannot fill the 8 verification slots"),
        (["--tree=-1,0"], "cannot fill the 32 verification slots"),  # the default: the cached engine's 8/5/8
        (["--attention", "flash"], "attention must be one of sdpa, triton, got 'flash'"),
        (["--attention", "triton", "--backend", "onnxruntime"], "drop them or the backend"),
    ],
)
def test_generate_refuses_bad_values_naming_them(capsys, extra, words):
    argv = ["generate", "--model", str(STORIES), "--prompt", "Once", "--max-new-tokens", "4", *extra]
    assert words in one_error_line(capsys, argv)


def test_prompt_file_messages_say_what_is_there(capsys, tmp_path):
    # issue 10: a directory was reported as missing; a non-UTF-8 file gave a bare codec message
    base = ["generate", "--model", str(STORIES), "--max-new-tokens", "4"]
    assert "is a directory" in one_error_line(capsys, [*base, "--prompt-file", str(tmp_path)])
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 au lait")
    line = one_error_line(capsys, [*base, "--prompt-file", str(tmp_path / "latin1.txt")])
    assert "latin1.txt is not UTF-8 text" in line and "byte 3" in line


def test_a_checkpoint_passed_as_engine_is_refused(capsys):
    line = one_error_line(capsys, ["generate", "--engine", str(STORIES), "--prompt", "Once", "--max-new-tokens", "4"])
    assert "is not an engine dir" in line and "--model" in line


def test_outputs_under_a_file_are_refused_before_the_benchmark(capsys, tmp_path):
    # issue 10: NotADirectoryError after the whole benchmark ran. --out is checked first, even before the model
    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "file", tmp_path / "file" / "sub"):
        argv = ["bench", "--model", "/nonexistent/model", "--dataset", "humaneval", "--out", str(out)]
        assert "--out" in one_error_line(capsys, argv)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--output", "{file}"], "is a file"),  # issue 10: NotADirectoryError traceback
        (["--output", "{file}/repo"], "is a file"),
        (["--max_seq_len", "100000"], "exceeds the model's context of 512"),  # issue 10: exit 0, server failed later
        (["--lookahead_config", "100000,100000,100000"], "above the limit of 1024"),
        (["--max_batch_size", "100000000000"], "--max_batch_size must be in [0, 2147483647]"),
        (["--instances", "0"], "--instances must be in [1, 2147483647]"),
    ],
)
def test_triton_repo_refuses_what_the_server_would_refuse(capsys, tmp_path, argv, words):
    (tmp_path / "file").write_text("x")
    argv = [a.format(file=tmp_path / "file") for a in argv]
    if "--output" not in argv:
        argv += ["--output", str(tmp_path / "repo")]
    assert words in one_error_line(capsys, ["triton-repo", "--model", str(STORIES), *argv])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("command", [["generate", "--prompt", "Once"], ["serve", "--port", "0"]])
def test_exact_on_the_onnxruntime_backend_of_a_checkpoint_is_refused(capsys, command):
    """--exact reaches the runtime from every command that loads a model; a checkpoint's cached engine is not
    exact (an engine dir built with --exact is: tests/backends/test_engine_exact.py)."""
    line = one_error_line(capsys, [*command, "--model", str(STORIES), "--backend", "onnxruntime", "--exact"])
    assert "onnxruntime runs exact steps only on an engine dir built with `trt-lookahead build --exact`" in line


def test_triton_attention_without_cuda_says_so():
    """--attention triton reaches the torch executor (`generate`, `bench` and `serve` share the loading path);
    without CUDA (or TRITON_INTERPRET=1, which this test suite sets) it is refused in one line naming the fix."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "trt_lookahead.cli", "generate", "--model", str(STORIES), "--prompt",
                          "Once", "--attention", "triton"], capture_output=True, text=True, env=env, timeout=300)
    lines = [x for x in out.stderr.strip().splitlines() if not x.startswith("trt-lookahead: ")]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "attention='triton' runs Triton kernels, on CUDA" in lines[0] and "use attention='sdpa'" in lines[0]


@pytest.mark.parametrize("budget", ["nan", "inf", "0", "-5"])
def test_tune_budget_must_be_finite_and_positive(capsys, budget):
    # issue 10: nan and inf were taken and tuned
    line = one_error_line(capsys, ["tune", "--model", str(STORIES), "--budget-seconds", budget])
    assert "--budget-seconds must be a finite number of seconds > 0" in line


@pytest.mark.parametrize(("extra", "words"), [
    (["--tree-out", "no/such/dir/tree.txt"], "give a file path in an existing directory"),
    (["--tree-out", ".", "--tree-for", "4,3,4"], "give a file path in an existing directory"),
    (["--tree-out", "tree.txt", "--tree-for", "4,3,0"], "has no verification slots to shape a tree for: give G >= 1"),
    (["--tree-out", "tree.txt", "--tree-for", "7"], "a step budget T must be between 8 and 1024 tokens"),
    (["--tree-out", "tree.txt", "--tree-for", "4096"], "a step budget T must be between 8 and 1024 tokens"),
    (["--tree-out", "tree.txt", "--tree-for", "4,3"], "is not of the form W,N,G"),
])
def test_tune_checks_where_its_tree_goes_before_tuning(capsys, extra, words):
    line = one_error_line(capsys, ["tune", "--model", str(STORIES), *extra])
    assert words in line


def test_triton_serve_checks_its_ports_before_starting(capsys, tmp_path):
    # issue 10: --http-port -1 waited 600 s; a port in use made the readiness probe reach the other server
    (tmp_path / "repo" / "m").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "config.pbtxt").write_text('name: "m"\n')
    base = ["triton-serve", "--repo", str(tmp_path / "repo"), "--http-port", "0", "--grpc-port", "0",
            "--metrics-port", "0"]  # 0: any free port; each case overrides one or two
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        for ports, words in (
            (["--http-port", "-1"], "--http-port -1 is not a TCP port"),
            (["--grpc-port", "70000"], "--grpc-port 70000 is not a TCP port"),
            (["--http-port", str(taken)], f"--http-port {taken} is not free on 127.0.0.1"),
            (["--http-port", "18771", "--grpc-port", "18771"], "is given twice"),
        ):
            assert words in one_error_line(capsys, [*base, *ports])


def test_an_interrupt_that_passed_through_an_exec_still_exits_130(tmp_path):
    # CI flake at 5afcf74: a SIGINT landing in a lazy import (dataclass creation execs a string) made
    # `python -m trt_lookahead.cli build` die by SIGINT (-2) after printing "interrupted", instead of exiting 130
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib\n"
        "commands = importlib.import_module('trt_lookahead.cli.main').COMMANDS\n"
        "commands['build'] = lambda args: exec('raise KeyboardInterrupt')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "trt_lookahead.cli", "build", "--model", str(STORIES), "--output",
                          str(tmp_path / "out")], capture_output=True, text=True, env=env)
    assert (out.returncode, out.stderr) == (130, "interrupted\n")
