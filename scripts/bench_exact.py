#!/usr/bin/env python3
"""The cost of the exact (row-invariant) step against the fastest step of the CPU torch executor, or of the
exact onnxruntime engine against the fast one.

    python scripts/bench_exact.py [--model smollm2|stories260K] [--dtypes float32,bfloat16]
                                  [--tokens 1,4,16,56,120] [--batches 1,8] [--context 300]
                                  [--threads 1] [--repeats 9] [--json OUT.json] [--backend torch|onnxruntime]
                                  [--prefill 64,256,1024]

One `BatchedTorchExecutor.step` of B rows, each the lookahead layout of T tokens (T = 1 is greedy), every row's
slot holding --context cached tokens. fast = exact=False (SDPA per row), exact = exact=True (`BlockedAttention`
per row, planned inside the step as the runtime runs it); both on the same model in the runtime's 'auto'
projection layout (oneDNN on x86), so the difference is attention and the exact step's projection calls (a
1-row input as 2 rows, calls of at most the rows the probe proves: backends/row_probe.py). --backend
onnxruntime: two float32 engines of the model built for 7,5,7 (T = 56) under engines/ (once), one with
--exact; a step of each engine's executor. The two are timed alternately; medians of --repeats; ms per token
= step ms / (B * T). The load average is recorded because this machine is shared.

--prefill P1,P2,..: instead of steps, one `prefill` of a P-token prompt on each torch executor (exact: the
step's row-invariant attention and projections, in causal chunks; fast: one SDPA call). --model random-gqa: a
random-weight Llama with grouped-query attention (RANDOM_GQA), for a model with KV heads < query heads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from trt_lookahead.backends.torch import BatchedTorchExecutor
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.executor import Executor, StepBatch
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.model.checkpoint import load_llama
from trt_lookahead.model.llama import Llama, ModelConfig

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {1: (1, 2, 0), 4: (2, 3, 0), 16: (4, 3, 4), 56: (7, 5, 7), 120: (15, 5, 15)}
# --model random-gqa: 12 query heads over 4 KV heads, SmolLM2-135M's head size, 4 layers
RANDOM_GQA = dict(hidden_size=384, num_layers=4, num_heads=12, num_kv_heads=4, head_dim=64, intermediate_size=1024,
                  vocab_size=4096, max_position_embeddings=4096)


def checkpoint(name: str) -> Path:
    if name == "stories260K":
        return ROOT / "tests" / "fixtures" / "stories260K"
    from trt_lookahead.model.fetch import resolve_model

    return resolve_model("smollm2-135m-instruct")


def load_model(name: str, dtype: str) -> Llama:
    """The model in the runtime's 'auto' projection layout: a checkpoint, or RANDOM_GQA's random weights."""
    if name != "random-gqa":
        return load_llama(checkpoint(name), dtype=dtype, weight_layout="auto")[0]
    torch.manual_seed(0)
    model = Llama(ModelConfig(**RANDOM_GQA))
    return model.to(getattr(torch, dtype)).eval().requires_grad_(False).set_weight_layout("auto")


def prefill_timer(ex: Executor, tokens: int):
    """A function timing one prefill of a random `tokens`-token prompt into slot 0."""
    prompt = np.random.default_rng(0).integers(3, ex.vocab_size, tokens)

    def run() -> float:
        t0 = time.perf_counter()
        ex.prefill(0, prompt, SamplingParams())
        return time.perf_counter() - t0

    return run


def step_timer(ex: Executor, rows: int, tokens: int, context: int):
    """A function timing one step of `rows` rows of `tokens` tokens over `context` cached tokens each."""
    layout = StepLayout(LookaheadConfig(*LAYOUTS[tokens]))
    rng = np.random.default_rng(0)
    for slot in range(rows):
        ex.prefill(slot, rng.integers(3, ex.vocab_size, context), SamplingParams())
    batch = StepBatch(
        np.arange(rows), rng.integers(3, ex.vocab_size, (rows, tokens)),
        np.tile(context + layout.rel_positions, (rows, 1)), np.tile(LAYOUTS[tokens], (rows, 1)).astype(np.int32),
        np.tile(layout.output_slots, (rows, 1)),
    )

    def run() -> float:
        t0 = time.perf_counter()
        ex.step(batch)
        return time.perf_counter() - t0

    return run


def engine(name: str, max_seq_len: int, exact: bool, threads: int):
    """The model's float32 engine for 7,5,7 (T = 56) and 8 rows under engines/, built on first use; opened."""
    from trt_lookahead.backends.open import open_engine
    from trt_lookahead.engine.build import build, build_request

    out = ROOT / "engines" / f"bench-{name}-{max_seq_len}{'-exact' if exact else ''}"
    build(build_request(checkpoint(name), out, lookahead=LookaheadConfig(7, 5, 7), max_seq_len=max_seq_len,
                        max_batch=8, exact=exact, force=True, tree=None))  # the linear engines measured
    return open_engine(out, threads=threads)


def executors(args: argparse.Namespace, dtype: str) -> tuple[str, Callable[[int, bool], Executor]]:
    """(the projection layout, a maker of a B-slot executor, fast or exact) for --backend."""
    if args.backend == "onnxruntime":
        opened = {exact: engine(args.model, args.context + 128, exact, args.threads) for exact in (False, True)}
        return "onnxruntime", lambda B, exact: opened[exact].executor(max_batch=B)
    model = load_model(args.model, dtype)
    max_seq_len = max([args.context + 128, *args.prefill])
    return model.weight_layout, lambda B, exact: BatchedTorchExecutor(model, B, max_seq_len, 128, exact=exact)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "stories260K", "random-gqa"])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tokens", default="1,4,16,56,120")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--backend", default="torch", choices=["torch", "onnxruntime"])
    ap.add_argument("--prefill", default="", help="prompt lengths: time prefill instead of steps (torch only)")
    args = ap.parse_args()
    args.prefill = [int(p) for p in args.prefill.split(",") if p]
    if args.prefill and args.backend != "torch":
        ap.error("--prefill times the torch executor's prefill; drop --backend onnxruntime")
    torch.set_num_threads(args.threads)
    rows, load_before = [], os.getloadavg()
    dtypes = args.dtypes.split(",") if args.backend == "torch" else ["float32"]
    for dtype in dtypes:
        layout, executor = executors(args, dtype)
        cells = ([(1, P) for P in args.prefill] if args.prefill else
                 [(int(b), int(t)) for b in args.batches.split(",") for t in args.tokens.split(",")])
        for B, T in cells:  # T: a step's tokens, or a prefill's prompt
            timers = {name: prefill_timer(executor(1, exact), T) if args.prefill else
                      step_timer(executor(B, exact), B, T, args.context)
                      for name, exact in (("fast", False), ("exact", True))}
            times: dict[str, list[float]] = {name: [] for name in timers}
            for i in range(args.repeats + 1):  # the first round warms up
                for name, run in timers.items():
                    seconds = run()
                    if i:
                        times[name].append(seconds)
            med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
            row = {"dtype": dtype, "B": B, "T": T, "fast_ms": round(med["fast"], 2),
                   "exact_ms": round(med["exact"], 2), "ratio": round(med["exact"] / med["fast"], 3),
                   "fast_ms_per_token": round(med["fast"] / (B * T), 3),
                   "exact_ms_per_token": round(med["exact"] / (B * T), 3), "layout": layout}
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"model": args.model, "backend": args.backend, "context": args.context, "threads": args.threads,
              "prefill": bool(args.prefill),
              "repeats": args.repeats, "load_before": load_before, "load_after": os.getloadavg(),
              "cpus": os.cpu_count(), "rows": rows}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
