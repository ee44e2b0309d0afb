"""A float32 checkpoint runs by default on the onnxruntime backend (issue 13): a cached engine, built once (stderr
says so and why), reused, rebuilt when damaged, giving the torch backend's tokens."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import DEFAULT, LookaheadConfig
from trt_lookahead.lookahead.decoder import step_tables
from trt_lookahead.runtime import checkpoint_backend, checkpoint_tree, engine_cover

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"


def generate(cache: Path, *extra: str) -> subprocess.CompletedProcess:
    """`trt-lookahead generate --model stories260K` in a subprocess with its own cache dir (the engine cache)."""
    argv = [sys.executable, "-m", "trt_lookahead.cli", "generate", "--model", str(STORIES), "--prompt",
            "Once upon a time", "--max-new-tokens", "40", "--json", "--threads", "1", *extra]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "TRT_LOOKAHEAD_CACHE": str(cache)})
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def tokens(result: subprocess.CompletedProcess) -> list[int]:
    return json.loads(result.stdout.strip().splitlines()[-1])["token_ids"]


@pytest.mark.export
def test_a_checkpoint_runs_on_a_cached_engine_built_once_with_the_torch_tokens(tmp_path):
    cache = tmp_path / "cache"
    mode = ("--temperature", "0.8", "--seed", "5")  # seeded, the default 4,3,4, the default backend
    first = generate(cache, *mode)
    assert "building the engine of stories260K once, cached in " in first.stderr and "(not built yet)" in first.stderr
    assert "stories260K runs on onnxruntime (the default for float32: a compiled engine" in first.stderr
    assert "exporting the network" in first.stderr  # built now, with its progress lines
    assert json.loads(first.stdout.strip().splitlines()[-1])["backend"] == "onnxruntime"
    engines = [p for p in (cache / "engines").iterdir() if not p.name.startswith(".")]
    assert len(engines) == 1

    again = generate(cache, *mode)
    assert "exporting the network" not in again.stderr and tokens(again) == tokens(first)  # reused

    with open(engines[0] / "weights.bin", "r+b") as f:  # damaged: rebuilt, never used
        f.seek(100)
        f.write(b"\xff" * 64)
    rebuilt = generate(cache, *mode)
    assert "the cached engine is unusable" in rebuilt.stderr and "weights.bin" in rebuilt.stderr
    assert "exporting the network" in rebuilt.stderr and tokens(rebuilt) == tokens(first)

    torch = generate(cache, *mode, "--backend", "torch")
    assert "stories260K runs on torch (asked for)" in torch.stderr
    assert json.loads(torch.stdout.strip().splitlines()[-1])["backend"] == "torch" and tokens(torch) == tokens(first)


def test_the_backend_of_a_checkpoint():
    assert [checkpoint_backend(b, "float32")[0] for b in (None, "torch", "onnxruntime")] == ["onnxruntime", "torch",
                                                                                              "onnxruntime"]
    backend, why = checkpoint_backend(None, "bfloat16")  # onnxruntime's CPU kernels: no bfloat16 MatMul
    assert backend == "torch" and "float32 only" in why
    # the standard cached engine covers 4,3,4 and auto's 8,5,8; a wider runtime config runs on torch by default
    # (no second engine built unasked) and on an engine covering it when onnxruntime is asked for
    assert checkpoint_backend(None, "float32", LookaheadConfig(7, 5, 7))[0] == "onnxruntime"
    backend, why = checkpoint_backend(None, "float32", LookaheadConfig(15, 5, 15))
    assert backend == "torch" and "15/5/15 is wider than the standard cached engine's 8/5/8" in why
    assert engine_cover(LookaheadConfig(15, 2, 1)) == LookaheadConfig(15, 5, 8)
    with pytest.raises(UserError, match="runs float32 engines"):  # onnxruntime's CPU kernels: no bfloat16 MatMul
        checkpoint_backend("onnxruntime", "bfloat16")
    with pytest.raises(UserError, match="runs engine dirs"):
        checkpoint_backend("tensorrt", "float32")
    # on CUDA a checkpoint runs on the torch executor, float32 too; onnxruntime (a CPU engine) is refused
    backend, why = checkpoint_backend(None, "float32", device="cuda")
    assert backend == "torch" and "CUDA graphs" in why
    with pytest.raises(UserError, match="runs on CUDA through the torch executor, not onnxruntime"):
        checkpoint_backend("onnxruntime", "float32", device="cuda")
    # quantized weights: on CUDA the torch executor's product (any dtype); on the CPU an onnxruntime engine
    for dtype in ("bfloat16", "float32"):
        backend, why = checkpoint_backend(None, dtype, device="cuda", weights="int4")
        assert backend == "torch" and "dequantized inside its product" in why
    assert checkpoint_backend(None, "float32", weights="int8")[0] == "onnxruntime"
    with pytest.raises(UserError, match="--weights int4 on CUDA runs on the torch executor, not onnxruntime"):
        checkpoint_backend("onnxruntime", "float32", device="cuda", weights="int4")


def test_the_device_of_a_checkpoint(tmp_path):
    """--device: by default CUDA where a GPU is visible, else the CPU; each refusal names the fix; a loaded model's
    tuning key says its device (a step costs otherwise on a GPU)."""
    from dataclasses import replace

    from trt_lookahead.backends.devices import gpu_count
    from trt_lookahead.runtime import LookaheadRuntime
    from trt_lookahead.runtime.load import checkpoint_device, loaded_tuning_key

    assert checkpoint_device(None) == ("cuda" if gpu_count() else "cpu") and checkpoint_device("cpu") == "cpu"
    with pytest.raises(UserError, match="device must be one of cpu, cuda, got 'tpu'"):
        checkpoint_device("tpu")
    if not gpu_count():
        with pytest.raises(UserError, match="sees no CUDA device; use --device cpu"):
            checkpoint_device("cuda")
    with LookaheadRuntime.from_pretrained(STORIES, backend="torch", device="cpu", max_batch=1) as rt:
        assert rt.model.device == "cpu" and next(rt.model.executor.model.parameters()).device.type == "cpu"
        on_gpu = replace(rt.model, device="cuda")
        assert loaded_tuning_key(on_gpu) != loaded_tuning_key(rt.model)
        assert loaded_tuning_key(replace(on_gpu, device="cpu")) == loaded_tuning_key(rt.model)


def test_a_torch_checkpoint_tree_covers_every_config_auto_may_use():
    """On torch `auto` may go up to 5/N/11 (16 columns, 1.2 sqrt(16) = 4.8 of them window): the default tree has its
    11 x 4 nodes, so no `auto` step falls back to linear candidates. onnxruntime's cached 8/5/8 engine keeps 8 x 4."""
    tree = checkpoint_tree(DEFAULT, None, "torch")
    assert tree is not None and tree.nodes == 44
    assert not step_tables(LookaheadConfig(5, 5, 11), tree).linear
    assert step_tables(LookaheadConfig(5, 5, 12), tree).linear  # one node short: linear candidates
    assert checkpoint_tree(DEFAULT, None, "onnxruntime").nodes == 32
    assert checkpoint_tree(DEFAULT, LookaheadConfig(7, 5, 7), "torch").nodes == 28  # sized for the config asked for


@pytest.mark.export
def test_a_checkpoint_runs_quantized_on_its_own_cached_engine(tmp_path, monkeypatch):
    """`--weights int4 --activations int8` with --model: a second cached engine beside the float one, exact (its
    lookahead tokens are its greedy tokens), named in the status line, with a tuning key of its own."""
    from trt_lookahead.runtime import LookaheadRuntime
    from trt_lookahead.runtime.load import loaded_tuning_key

    cache = tmp_path / "cache"
    quantized = ("--weights", "int4", "--activations", "int8")
    lookahead = generate(cache, *quantized)
    assert "stories260K runs on onnxruntime (int4 weights: an onnxruntime engine (MatMulNBits)" in lookahead.stderr
    greedy = generate(cache, *quantized, "--greedy")
    assert "exporting the network" not in greedy.stderr and tokens(greedy) == tokens(lookahead)
    floats = generate(cache)
    assert "building the engine of stories260K once" in floats.stderr  # another build: the float engine
    configs = [json.loads((p / "config.json").read_text()) for p in (cache / "engines").iterdir()
               if not p.name.startswith(".")]
    assert sorted((c["quantization"], c["activations"], c["exact"]) for c in configs) == [
        ("float", "float", False), ("int4", "int8", True)]
    monkeypatch.setenv("TRT_LOOKAHEAD_CACHE", str(cache))  # the engines built above, used as they are
    with LookaheadRuntime.from_pretrained(STORIES, weights="int4", activations="int8") as rt:
        assert loaded_tuning_key(rt.model).endswith("|weights=int4+int8") and rt.exact
    with LookaheadRuntime.from_pretrained(STORIES) as rt:
        assert "weights=" not in loaded_tuning_key(rt.model)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"backend": "torch", "weights": "int4"}, "--weights int4 on the CPU runs a checkpoint as a float32 onnxruntime.*"
                                              "drop --backend torch, or run it on a GPU"),
    ({"dtype": "bfloat16", "weights": "int8"}, "--weights int8 on the CPU runs a checkpoint as a float32 onnxruntime.*"
                                               "drop --dtype bfloat16, or run it on a GPU"),
    ({"exact": True, "weights": "int4", "activations": "float"}, "exact steps on quantized weights come with int8"),
    ({"exact": False, "weights": "int4"}, r"--activations int8 \(the default with --weights\) runs only on the exact "
                                          r"graph: add --activations float for the fast one, or drop --no-exact"),
    ({"activations": "int8"}, "--activations int8 multiplies quantized weights: add --weights int8 or int4"),
])
def test_quantized_checkpoint_runs_refuse_what_cannot_run_them(kwargs, message):
    from trt_lookahead.runtime import LookaheadRuntime

    with pytest.raises(UserError, match=message):
        LookaheadRuntime.from_pretrained(STORIES, **kwargs)


@pytest.mark.export
def test_an_engine_dir_keeps_the_weights_of_its_build(tmp_path):
    from trt_lookahead.cli import main
    from trt_lookahead.runtime import LookaheadRuntime

    engine = tmp_path / "engine"
    assert main(["build", "--model", str(STORIES), "--output", str(engine), "--max_seq_len", "128"]) == 0
    with pytest.raises(UserError, match="an engine dir's weights were set by its build"):
        LookaheadRuntime.from_pretrained(engine, weights="int4")
