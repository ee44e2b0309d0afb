"""A build's peak resident memory at a larger Llama's shape: write a random-weight checkpoint of the shape, float32 or
float16 (SmolLM2's tokenizer and vocabulary), run `trt-lookahead build` on it, and sample the build's resident memory
(its children included) every 20 ms, all of it and the anonymous part, reporting the peaks in each of the build's
progress phases.

    python scripts/build_memory.py --shape llama-1b --weights int4 --checkpoints /tmp/ckpt --out mem.json
    python scripts/build_memory.py --shape llama-1b --gguf ...   # from a float16 GGUF of it, converted first
    python scripts/build_memory.py --shape llama-8b --checkpoint-dtype float16 ...   # 16-bit weights, as published

The checkpoint is written tensor by tensor (this script never holds the model) and kept for the next run, as is
the GGUF (`write_gguf`, which holds the model once). With --gguf the build converts it into a fresh cache first:
the "start" phase is the conversion.
Random weights: a smoke check against them compares near-uniform logits, so a build may stop there; the
memory up to that point is still reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from trt_lookahead.model.checkpoint import expected_tensors, hf_key
from trt_lookahead.model.gguf_convert import write_gguf, write_weights
from trt_lookahead.model.llama import ModelConfig

# the layers of Meta's Llama 3.2 1B and 3B and Llama 3.1 8B; the vocabulary is the tokenizer donor's
SHAPES = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8),
    "llama-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                     num_key_value_heads=8),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8),
}
DONOR = Path.home() / ".cache" / "trt-lookahead" / "models" / "smollm2-135m-instruct"


def write_checkpoint(out: Path, name: str, donor: Path, seed: int = 0, dtype: str = "float32") -> int:
    """The checkpoint dir (written once), its weights of `dtype`; -> their bytes in float32."""
    config = {**json.loads((donor / "config.json").read_text()), **SHAPES[name], "tie_word_embeddings": True,
              "torch_dtype": dtype, "max_position_embeddings": 2048}
    config.pop("head_dim", None)
    shapes = {hf_key(key): dims for key, dims in expected_tensors(ModelConfig.from_hf(config)).items()}
    total = sum(4 * int(np.prod(s)) for s in shapes.values())
    if (out / "config.json").is_file():  # written last: the checkpoint is complete
        return total
    out.mkdir(parents=True, exist_ok=True)
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (donor / file).is_file():
            shutil.copyfile(donor / file, out / file)
    rng = np.random.default_rng(seed)

    def read(name: str) -> np.ndarray:  # norms 1, matrices N(0, 1/fan-in): activations keep their scale
        dims = shapes[name]
        weights = (np.ones(dims, np.float32) if len(dims) == 1
                   else rng.standard_normal(dims, np.float32) / np.float32(np.sqrt(dims[1])))
        return weights.astype(dtype, copy=False)

    write_weights(out, shapes, read, metadata={"format": "pt"}, dtype=dtype)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return total


def resident_mb(pid: int) -> tuple[int, int]:
    """(VmRSS, RssAnon) of pid and its direct children, MB. RssAnon leaves out file-backed pages (the checkpoint's
    tensors mapped from model.safetensors), which the kernel can drop and read again: it is what must fit."""
    try:
        pids = [pid, *map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]
    except OSError:
        return 0, 0
    total, anon = 0, 0
    for p in pids:
        with contextlib.suppress(OSError, KeyError):  # a child gone (or a zombie: no memory lines) since the listing
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{p}/status").read_text().splitlines())
            total += int(fields["VmRSS"].split()[0])
            anon += int(fields["RssAnon"].split()[0])
    return total // 1024, anon // 1024


def measured_build(command: list[str], stop_above_mb: int | None = None, env: dict | None = None) -> dict:
    """Run the build, killed if its anonymous memory passes stop_above_mb (this machine would soon run out); ->
    {"phases": [[progress line, peak resident MB, peak anonymous MB, seconds from the start to the line], ...],
    "peak_mb", "peak_anon_mb", "stopped", "rc", "seconds", "tail"}."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    phases: list[list] = [["start", 0, 0, 0.0]]
    tail: list[str] = []
    stopped = threading.Event()

    def sample() -> None:
        while proc.poll() is None:
            total, anon = resident_mb(proc.pid)
            phase = phases[-1]
            phase[1], phase[2] = max(phase[1], total), max(phase[2], anon)
            if stop_above_mb is not None and anon > stop_above_mb:
                stopped.set()
                proc.kill()
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    assert proc.stderr is not None
    for line in proc.stderr:
        tail = [*tail[-4:], line.rstrip()]
        if line.startswith("["):  # a progress line: a new phase
            phases.append([line.strip(), 0, 0, round(time.perf_counter() - start, 1)])
    proc.wait()
    sampler.join()
    return {"phases": phases, "peak_mb": max(p[1] for p in phases), "peak_anon_mb": max(p[2] for p in phases),
            "stopped": stopped.is_set(), "rc": proc.returncode,
            "seconds": round(time.perf_counter() - start, 1), "tail": tail}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--weights", default="int4")
    parser.add_argument("--checkpoints", type=Path, default=Path("/tmp/trt-lookahead-build-memory"))
    parser.add_argument("--donor", type=Path, default=DONOR, help="the checkpoint whose tokenizer and vocab to take")
    parser.add_argument("--trt-lookahead", default=str(Path(sys.executable).with_name("trt-lookahead")),
                        help="the command that builds (e.g. another checkout's)")
    parser.add_argument("--checkpoint-dtype", choices=("float32", "float16"), default="float32",
                        help="the checkpoint's weights (a build computes in float32 either way)")
    parser.add_argument("--gguf", action="store_true", help="build from a float16 GGUF of the checkpoint")
    parser.add_argument("--stop-above-mb", type=int, help="kill the build when its anonymous memory passes this")
    parser.add_argument("--keep-engine", action="store_true", help="leave the engine dir for a run after")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    suffix = "" if args.checkpoint_dtype == "float32" else f"-{args.checkpoint_dtype}"
    model = args.checkpoints / (args.shape + suffix)
    weight_bytes = write_checkpoint(model, args.shape, args.donor, dtype=args.checkpoint_dtype)
    source = model
    if args.gguf:
        source = args.checkpoints / f"{model.name}-f16.gguf"
        if not source.is_file():
            write_gguf(model, source.with_suffix(".partial"), dtype="float16")
            source.with_suffix(".partial").rename(source)
    engine = args.checkpoints / f"{args.shape}-{args.weights}-engine"
    shutil.rmtree(engine, ignore_errors=True)
    command = [*args.trt_lookahead.split(), "build", "--model", str(source), "--output", str(engine),
               "--weights", args.weights]
    with tempfile.TemporaryDirectory(dir=args.checkpoints) as cache:  # a GGUF is converted again each run
        env = {**os.environ, "TRT_LOOKAHEAD_CACHE": cache}
        result = {"shape": args.shape, "weights": args.weights, "gguf": args.gguf, "checkpoint": args.checkpoint_dtype,
                  "float32_weights_mb": weight_bytes // 2**20, "command": command,
                  **measured_build(command, args.stop_above_mb, env)}
    if not args.keep_engine:
        shutil.rmtree(engine, ignore_errors=True)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
