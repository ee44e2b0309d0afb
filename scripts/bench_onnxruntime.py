"""Step time of the onnxruntime executor against the torch executor on this CPU, per step size T.

    python scripts/bench_onnxruntime.py [--model stories260K|smollm2-135m-instruct|DIR]
        [--configs greedy,4/3/4,7/5/7,15/5/15] [--context 128] [--steps 50] [--threads N]
        [--attention plugin|native] [--engines engines/bench] [--json]

For each config it builds (once, reused later) an engine dir with `trt-lookahead build`, makes a
torch executor and an onnxruntime executor for the same StepLayout, prefills the same `--context`
random tokens, and times `--steps` calls of step() at that context (no commit, so every call does the
same work); the two executors take turns step by step so that the machine's load hits both alike.
greedy is T = 1: the runtime's greedy path (prefill graph at one token) on the first
config's engine. Prints a table of median milliseconds per step and onnxruntime's speed relative to
torch (> 1: onnxruntime is faster); --json prints one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from trt_lookahead.lookahead.config import DEFAULT_LOOKAHEAD, GREEDY, LookaheadConfig
from trt_lookahead.lookahead.layout import StepLayout

REPO = Path(__file__).resolve().parent.parent


def model_dir(name: str) -> Path:
    if name == "stories260K":
        return REPO / "tests" / "fixtures" / "stories260K"
    from trt_lookahead.model.fetch import resolve_model

    return resolve_model(name)


def ensure_engine(
    model: Path, config: LookaheadConfig, root: Path, attention: str, max_seq_len: int
) -> tuple[Path, float]:
    from trt_lookahead.cli import main

    out = root / f"{model.name}-{config.W}-{config.N}-{config.G}-{attention}"
    start = time.perf_counter()
    code = main([
        "build", "--model", str(model), "--output", str(out), "--lookahead_config", f"{config.W},{config.N},{config.G}",
        "--max_seq_len", str(max_seq_len), "--max_input_len", str(min(512, max_seq_len)), "--attention", attention,
    ])
    if code != 0:
        raise SystemExit(f"build of {out} failed")
    return out, time.perf_counter() - start


def time_steps(executors: list, layout: StepLayout, prompt: np.ndarray, steps: int, rng) -> list[list[float]]:
    """Seconds per step() of each executor, the executors taking turns step by step (shared load hits both)."""
    from trt_lookahead.lookahead.sampling import SamplingParams

    ids = rng.integers(0, executors[0].vocab_size, layout.step_tokens)
    positions = len(prompt) + layout.rel_positions
    for executor in executors:
        executor.reset(SamplingParams())
        ids[0] = executor.prefill(prompt)
        for _ in range(3):
            executor.step(ids, positions)
    times: list[list[float]] = [[] for _ in executors]
    for _ in range(steps):
        for executor, record in zip(executors, times, strict=True):
            t0 = time.perf_counter()
            executor.step(ids, positions)
            record.append(time.perf_counter() - t0)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stories260K")
    parser.add_argument("--configs", default="greedy,4/3/4,7/5/7,15/5/15")
    parser.add_argument("--context", type=int, default=128, help="tokens in the KV cache while timing")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None, help="torch and onnxruntime threads (default: torch's)")
    parser.add_argument("--attention", default="plugin", choices=["plugin", "native"])
    parser.add_argument("--engines", default=str(REPO / "engines" / "bench"))
    parser.add_argument("--max-seq-len", type=int, default=None, help="default: min(1024, the model context)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch

    from trt_lookahead.backends.open import open_engine
    from trt_lookahead.backends.torch import TorchExecutor
    from trt_lookahead.model.checkpoint import load_llama

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    model_path = model_dir(args.model)
    model, cfg = load_llama(model_path)
    args.max_seq_len = args.max_seq_len or min(1024, cfg.max_position_embeddings)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    lookaheads = [LookaheadConfig.parse(c) for c in names if c != GREEDY]
    if not lookaheads:
        lookaheads = [DEFAULT_LOOKAHEAD]
    root = Path(args.engines)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, args.context)
    rows = []
    builds = {}
    for name in names:
        lookahead = LookaheadConfig.greedy() if name == GREEDY else LookaheadConfig.parse(name)
        engine_cfg = lookaheads[0] if name == GREEDY else lookahead
        engine_dir, seconds = ensure_engine(model_path, engine_cfg, root, args.attention, args.max_seq_len)
        builds[str(engine_cfg)] = {"dir": str(engine_dir), "seconds": round(seconds, 1)}
        layout = StepLayout(lookahead)
        ours = open_engine(engine_dir, threads=threads).make_executor(layout)
        theirs = TorchExecutor(model, layout.mask, args.max_seq_len, output_slots=layout.output_slots)
        ort_times, torch_times = time_steps([ours, theirs], layout, prompt, args.steps, rng)
        ort_ms, torch_ms = statistics.median(ort_times) * 1e3, statistics.median(torch_times) * 1e3
        rows.append({"config": name, "T": layout.step_tokens, "torch_ms": round(torch_ms, 3),
                     "onnxruntime_ms": round(ort_ms, 3),
                     "speed_vs_torch": round(torch_ms / ort_ms, 2)})
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(f"model {model_path.name}, attention {args.attention}, context {args.context} tokens, {threads} threads, "
          f"load {load:.1f}" if load is not None else "")
    print("| config | T | torch ms/step | onnxruntime ms/step | onnxruntime speed vs torch |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['T']} | {r['torch_ms']:.2f} | {r['onnxruntime_ms']:.2f} "
              f"| {r['speed_vs_torch']:.2f}x |")
    if args.json:
        print(json.dumps({"model": model_path.name, "attention": args.attention, "context": args.context,
                          "threads": threads, "load": load, "builds": builds, "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
