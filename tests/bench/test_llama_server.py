"""`bench --peers llama-server` (bench/served.py, servers.py, openai_stream.py) against a stand-in llama-server
(tests/bench/stand_in_llama_server.py: llama-server's arguments, /health and streamed token-id /v1/completions
answered by our runtime's greedy on stories260K), with our real `serve` beside it, on 127.0.0.1 only.

The CLI runs in a subprocess (its servers are its children); every test checks that no process it started is
left: each one's command line names the test's tmp_path (the wrapper, the model copy, the cache).
"""

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from trt_lookahead.bench.openai_stream import Answer
from trt_lookahead.bench.served import aggregate_served, common_prefix
from trt_lookahead.bench.servers import ServerProcess, find_llama_server, llama_server_argv, parse_specs
from trt_lookahead.errors import UserError
from trt_lookahead.files import free_port
from trt_lookahead.model.gguf_convert import write_gguf

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
STAND_IN = Path(__file__).with_name("stand_in_llama_server.py")
PROMPTS = ["Once upon a time", "Lily and Tom went to the park. They", "The cat sat on the", "Sam had a red"]
MAX_TOKENS = 12
TIMEOUT = 600  # seconds for a whole bench run (three servers start; a loaded 2-core machine)

pytestmark = pytest.mark.server


@pytest.fixture
def setup(tmp_path):
    """A model copy, a prompt set, an executable stand-in, a cache dir and the environment, all under tmp_path."""
    model = tmp_path / "stories260K"
    shutil.copytree(STORIES, model)
    data = tmp_path / "stories.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    binary.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STAND_IN}" "$@"\n')
    binary.chmod(0o755)
    env = {**os.environ, "TRT_LOOKAHEAD_CACHE": str(tmp_path / "cache"), "STAND_IN_CHECKPOINT": str(model),
           "STAND_IN_RECORD": str(tmp_path / "starts.jsonl")}
    yield {"model": model, "data": data, "binary": binary, "env": env, "tmp": tmp_path}
    assert leftovers(tmp_path) == [], "a server outlived the bench"


def leftovers(tmp_path: Path) -> list[str]:
    """Command lines of live processes that name tmp_path (the servers a bench started)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(line for line in (proc / "status").read_text().splitlines() if line.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if str(tmp_path) in cmdline and "zombie" not in state:
            found.append(cmdline)
    return found


def bench(s: dict, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trt_lookahead.cli", "bench", "--model", str(s["model"]), "--dataset",
           str(s["data"]), "--max-new-tokens", str(MAX_TOKENS), "--threads", "1", "--backend", "torch",
           "--peers", "llama-server", "--llama-server", str(s["binary"]), *argv]
    return subprocess.run(cmd, env={**s["env"], **(env or {})}, capture_output=True, text=True, timeout=TIMEOUT)


def greedy_texts(model: Path, max_tokens: int) -> list[str]:
    """Our runtime's greedy answer text per prompt (what the stand-in and `ours greedy` answer)."""
    from trt_lookahead.bench.datasets import encode_row, load_dataset
    from trt_lookahead.model.checkpoint import load_tokenizer
    from trt_lookahead.runtime import LookaheadRuntime

    tokenizer = load_tokenizer(model)
    with LookaheadRuntime.from_pretrained(model, lookahead="greedy", backend="torch") as rt:
        return [rt.generate(encode_row(tokenizer, row), max_new_tokens=max_tokens, lookahead="greedy").text
                        for row in load_dataset(str(model.parent / "stories.jsonl"), None).rows]


def test_served_rows_agree_and_a_differing_server_is_measured_so(setup):
    """Plain stand-in = our greedy (agreement 1.0 at 1 and 2 streams); the --spec-type start answers odd-length
    prompts with half of greedy's answer, so its agreement is what that rule gives."""
    run = bench(setup, "--concurrency", "1,2", "--llama-spec", "ngram-map-k", "--json",
                env={"STAND_IN_MODE": "differ", "STAND_IN_ONLY_SPEC": "ngram-map-k"})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    rows = {(r["server"], r["streams"]): r for r in result["rows"]}
    servers = ["ours greedy", "ours auto", "llama-server", "llama-server --spec-type ngram-map-k"]
    assert sorted(rows) == sorted((s, n) for s in servers for n in (1, 2))
    for r in result["rows"]:
        assert r["prompts"] == len(PROMPTS) and r["dataset"] == "stories"
        assert r["output_tokens"] > 0 and r["tokens_per_second"] > 0 and r["ttft_p50_ms"] > 0
        assert 0 < r["itl_p50_ms"] <= r["itl_p95_ms"]
    for server in servers[:3]:
        for n in (1, 2):
            assert (rows[server, n]["identical"], rows[server, n]["prefix"]) == (1.0, 1.0), (server, n)

    from trt_lookahead.bench.datasets import encode_row, load_dataset
    from trt_lookahead.model.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(setup["model"])
    prompt_ids = [encode_row(tokenizer, row) for row in load_dataset(str(setup["data"]), None).rows]  # as sent
    full, half = greedy_texts(setup["model"], MAX_TOKENS), greedy_texts(setup["model"], MAX_TOKENS // 2)
    identical, prefix = [], []
    for ids, a, b in zip(prompt_ids, full, half, strict=True):
        ours = tokenizer.encode(a, add_special_tokens=False)
        theirs = tokenizer.encode(b if len(ids) % 2 else a, add_special_tokens=False)
        pairs = enumerate(zip(ours, theirs, strict=False))
        same = next((k for k, (x, y) in pairs if x != y), min(len(ours), len(theirs)))
        identical.append(ours == theirs)
        prefix.append(same / max(len(ours), len(theirs)))
    assert 0 < sum(identical) < len(PROMPTS), "the prompts should include odd and even lengths"
    spec = rows["llama-server --spec-type ngram-map-k", 1]
    assert spec["identical"] == pytest.approx(sum(identical) / len(PROMPTS), abs=1e-4)
    assert spec["prefix"] == pytest.approx(sum(prefix) / len(PROMPTS), abs=1e-4)
    assert spec["prefix"] < 1.0

    starts = [json.loads(line) for line in (setup["tmp"] / "starts.jsonl").read_text().splitlines()]
    assert len(starts) == 2 and "--spec-type" not in starts[0] and starts[1][-2:] == ["--spec-type", "ngram-map-k"]
    for argv in starts:
        opts = dict(itertools.pairwise(argv))
        assert (opts["--host"], opts["-t"], opts["-tb"], opts["-np"]) == ("127.0.0.1", "1", "1", "2")
        assert int(opts["-c"]) == 2 * 256  # two slots of the longest prompt + 12 tokens, rounded up to 256
        assert Path(opts["-m"]).parent == setup["tmp"] / "cache" / "gguf"
    assert "| llama-server --spec-type ngram-map-k | stories | 1 |" in format_of(result)


def format_of(result: dict) -> str:
    from trt_lookahead.bench.served import format_served_markdown

    return format_served_markdown(result)


def test_without_concurrency_both_tables_print(setup):
    """No --concurrency: the in-process rows (--configs) and then the served table at 1 stream."""
    run = bench(setup, "--configs", "greedy", "--llama-spec", "none", "--limit", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| stories | greedy |" in run.stdout  # the in-process table
    assert "**Served over the OpenAI API**" in run.stdout
    for server in ("ours greedy", "ours auto", "llama-server"):
        assert f"| {server} | stories | 1 | 2 |" in run.stdout
    assert "--spec-type" not in run.stdout.split("**Served")[1].split("tok/s =")[0]


def test_quantized_served_rows_run_the_given_gguf_beside_serve_weights(setup):
    """--weights int4 --llama-gguf: llama-server runs that file, our `serve` runs --weights int4 (the checkpoint's
    cached int4 engine: int8 activations, exact, so `ours auto` answers as `ours greedy`), and the table says so."""
    gguf = write_gguf(setup["model"], setup["tmp"] / "mine.gguf")
    cmd = [sys.executable, "-m", "trt_lookahead.cli", "bench", "--model", str(setup["model"]), "--dataset",
           str(setup["data"]), "--max-new-tokens", str(MAX_TOKENS), "--threads", "1", "--peers", "llama-server",
           "--llama-server", str(setup["binary"]), "--llama-spec", "none", "--concurrency", "1", "--weights", "int4",
           "--llama-gguf", str(gguf), "--json"]
    run = subprocess.run(cmd, env=setup["env"], capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    starts = [json.loads(line) for line in (setup["tmp"] / "starts.jsonl").read_text().splitlines()]
    assert [dict(itertools.pairwise(argv))["-m"] for argv in starts] == [str(gguf)]
    assert result["gguf"] == str(gguf) and result["serve_extra"] == ["--weights", "int4"]
    serve = result["servers"][-1]["argv"]
    assert serve[serve.index("--weights") + 1] == "int4"
    rows = {r["server"]: r for r in result["rows"]}
    assert set(rows) == {"ours greedy", "ours auto", "llama-server"}
    assert rows["ours auto"]["identical"] == 1.0 and rows["ours auto"]["output_tokens"] > 0
    assert "stories260K, float32 --weights int4 (llama-server: mine.gguf)" in format_of(result)


@pytest.mark.parametrize(("argv", "message"), [
    (["--weights", "int4", "--concurrency", "1"], "--weights int4 with --peers llama-server needs --llama-gguf PATH"),
    (["--weights", "int4", "--concurrency", "1", "--llama-gguf", "nowhere.gguf"], "--llama-gguf nowhere.gguf is not"),
    (["--weights", "int8"], "bench --weights/--activations quantize the served rows"),
])
def test_quantized_served_rows_refuse_what_cannot_run(setup, argv, message):
    cmd = [sys.executable, "-m", "trt_lookahead.cli", "bench", "--model", str(setup["model"]), "--dataset",
           str(setup["data"]), "--peers", "llama-server", "--llama-server", str(setup["binary"]), *argv]
    run = subprocess.run(cmd, env=setup["env"], capture_output=True, text=True, timeout=TIMEOUT, cwd=setup["tmp"])
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and message in run.stderr, run.stderr
    assert not (setup["tmp"] / "starts.jsonl").exists()  # refused before any server started


def test_an_engines_weights_are_its_builds_in_bench_too(setup, tmp_path):
    """--weights beside --engine: the engine's build chose them, so the fix is to drop the flag (not to build one)."""
    cmd = [sys.executable, "-m", "trt_lookahead.cli", "bench", "--engine", str(tmp_path / "engine"), "--dataset",
           str(setup["data"]), "--weights", "int4"]
    run = subprocess.run(cmd, env=setup["env"], capture_output=True, text=True, timeout=TIMEOUT, cwd=setup["tmp"])
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "an engine dir's weights were set by its build: drop --weights and --activations" in run.stderr


def test_missing_binary_is_one_error_line(setup, tmp_path):
    run = bench(setup, "--llama-server", str(tmp_path / "nowhere" / "llama-server"))
    assert run.returncode == 2
    assert run.stderr.startswith("error: --llama-server") and run.stderr.count("\n") == 1
    assert "does not exist" in run.stderr and "scripts/build_llama_cpp.sh" in run.stderr
    # neither on PATH nor built into the cache dir: both places named
    cmd = [sys.executable, "-m", "trt_lookahead.cli", "bench", "--model", str(setup["model"]), "--dataset",
           str(setup["data"]), "--peers", "llama-server"]
    run = subprocess.run(cmd, env={**setup["env"], "PATH": str(tmp_path / "empty")}, capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert run.returncode == 2 and run.stderr.startswith("error: no llama-server found (not on PATH, not at ")
    assert str(tmp_path / "cache" / "llama.cpp") in run.stderr and "build_llama_cpp.sh" in run.stderr


def test_server_that_exits_at_start_up_names_it_with_its_log(setup):
    run = bench(setup, "--concurrency", "1", env={"STAND_IN_MODE": "exit"})
    assert run.returncode == 2
    assert run.stderr.splitlines()[0].startswith("error: llama-server exited at start-up (status 1); check the "
                                                 "binary, or build it with `bash scripts/build_llama_cpp.sh`")
    assert "stand-in: error: exiting at start-up" in run.stderr
    assert "Traceback" not in run.stderr


def test_refused_request_names_the_server_and_its_log(setup):
    run = bench(setup, "--concurrency", "1", env={"STAND_IN_MODE": "refuse"})
    assert run.returncode == 2 and "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: llama-server failed a request (http://127.0.0.1:")
    assert "answered 400" in run.stderr and "refused as STAND_IN_MODE=refuse asks" in run.stderr
    assert "llama-server.log" in run.stderr


def test_server_never_healthy_is_stopped_and_named(setup):
    gguf = write_gguf(setup["model"], setup["tmp"] / "stories.gguf")
    port = free_port()
    argv = llama_server_argv(setup["binary"], gguf, port, 1, 1, 256)
    server = ServerProcess("llama-server", argv, port, setup["tmp"], hint="the hint", start_timeout=3,
                           env={**setup["env"], "STAND_IN_MODE": "unhealthy"})
    with pytest.raises(UserError, match=r"llama-server was not healthy \(GET /health\) within 3 s; the hint"), server:
        pass
    assert server.proc is None


def test_a_server_is_stopped_when_its_block_raises(setup):
    gguf = write_gguf(setup["model"], setup["tmp"] / "stories.gguf")
    port = free_port()
    server = ServerProcess("llama-server", llama_server_argv(setup["binary"], gguf, port, 1, 1, 256), port,
                           setup["tmp"], env=setup["env"])
    with pytest.raises(KeyboardInterrupt), server:
        pid = server.proc.pid
        raise KeyboardInterrupt
    assert server.proc is None and not Path(f"/proc/{pid}").exists()


def test_a_server_is_stopped_when_the_bench_is_interrupted(setup):
    """Ctrl-C (SIGINT to the bench) while a server runs: the bench stops it and exits."""
    cmd = [sys.executable, "-m", "trt_lookahead.cli", "bench", "--model", str(setup["model"]), "--dataset",
           str(setup["data"]), "--max-new-tokens", "400", "--threads", "1", "--peers", "llama-server",
           "--llama-server", str(setup["binary"]), "--llama-spec", "none", "--concurrency", "1"]
    proc = subprocess.Popen(cmd, env=setup["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # type: ignore[union-attr]
            if line.startswith("bench: llama-server on "):
                break
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0


def test_find_llama_server_and_specs(tmp_path):
    with pytest.raises(UserError, match="is not executable"):
        plain = tmp_path / "llama-server"
        plain.write_text("")
        find_llama_server(str(plain))
    assert parse_specs("ngram-map-k, ngram-simple,ngram-map-k") == ["ngram-map-k", "ngram-simple"]
    assert parse_specs("none") == [] and parse_specs("") == []


def test_agreement_measures():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 0.5 and common_prefix([], []) == 1.0
    from trt_lookahead.bench.served import Run

    def answers(*texts: str) -> list[Answer]:
        return [Answer(i, 0.1, 0.1 + 0.01 * (len(t) - 1), len(t), t, "length") for i, t in enumerate(texts)]

    runs = [Run("ours greedy", "d", 1, answers("abcd", "xy"), 1.0, []),
            Run("llama-server", "d", 1, answers("abcd", "xz"), 2.0, [])]
    rows = aggregate_served(runs, lambda text: [ord(c) for c in text])
    assert (rows[1]["identical"], rows[1]["prefix"]) == (0.5, 0.75)
    assert rows[1]["tokens_per_second"] == 3.0 and rows[0]["itl_p50_ms"] == pytest.approx(10.0)
