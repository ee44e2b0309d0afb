"""One engine dir's step time under two checkouts of this code, in alternating processes: per-round ratios.

    python scripts/step_ab.py --engine DIR --code BEFORE[,AFTER] [--configs greedy,2/3/2,4/3/4] [--rounds 6]
        [--steps 60] [--context 128] [--threads 2] [--json]

A checkout is a directory holding the trt_lookahead package (e.g. `git worktree add /tmp/before 38cdb72`); AFTER
defaults to this one. Each round runs one process per checkout, the package imported from it (its C kernels built
from its own sources), in an order that swaps every round: the process opens the engine dir on onnxruntime with
`--threads` threads, prefills one slot with `--context` random tokens and times `--steps` steps of one row of
each lookahead config (greedy = one token, (1, 2, 0); W/N/G its (W + G)(N - 1) tokens at the layout's relative
positions, its logits at the layout's output slots, as the decoder asks for them), never committed, so every step
does the same work; it reports the median ms per config. Prints each round's medians and AFTER / BEFORE, and the
median of the rounds' ratios: machines whose speed drifts between processes (this project's VMs) make a single
pair of runs unreliable, a ratio within a round less so. Quote the load it prints. --json prints one JSON object
on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def worker(engine: Path, configs: list[str], steps: int, context: int, threads: int) -> dict[str, float]:
    """Median ms per step of each config, with the trt_lookahead that PYTHONPATH finds (the checkout's)."""
    import numpy as np

    from trt_lookahead.backends.onnxruntime import SessionSettings
    from trt_lookahead.backends.open import open_engine
    from trt_lookahead.lookahead.config import LookaheadConfig
    from trt_lookahead.lookahead.executor import StepBatch
    from trt_lookahead.lookahead.layout import StepLayout
    from trt_lookahead.lookahead.sampling import SamplingParams

    widest = max(LookaheadConfig.from_label(label).step_tokens for label in configs)
    ex = open_engine(engine, session=SessionSettings(threads=threads), max_seq_len=context + widest, max_batch=1,
                     verify=False).executor()
    ex.prefill(0, np.random.default_rng(0).integers(0, ex.vocab_size, context), SamplingParams())
    medians = {}
    for label in configs:
        config = LookaheadConfig.from_label(label)
        tokens, layout = config.step_tokens, StepLayout(config)
        batch = StepBatch(np.array([0]), np.full((1, tokens), 5), (context + layout.rel_positions)[None],
                          np.array([[config.W, config.N, config.G]], np.int32), layout.output_slots[None])
        for _ in range(3):  # first steps: the binding, the caches
            ex.step(batch)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            ex.step(batch)
            times.append(time.perf_counter() - start)
        medians[label] = round(statistics.median(times) * 1e3, 3)
    return medians


def run(code: Path, args: argparse.Namespace) -> dict[str, float]:
    """One worker process on `code`'s package."""
    command = [sys.executable, str(HERE), "--worker", "--engine", str(args.engine), "--configs", args.configs,
               "--steps", str(args.steps), "--context", str(args.context), "--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": str(code)}
    done = subprocess.run(command, env=env, cwd=code, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"the worker on {code} failed:\n{done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", type=Path, required=True, help="an engine dir written by `trt-lookahead build`")
    parser.add_argument("--code", default="", help="BEFORE[,AFTER]: checkouts of this code (AFTER: this one)")
    parser.add_argument("--configs", default="greedy,2/3/2,4/3/4", help="lookahead configs, comma-separated")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per config and process")
    parser.add_argument("--context", type=int, default=128, help="cached tokens in the slot while timing")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    configs = [label for label in args.configs.split(",") if label]
    if args.worker:
        print(json.dumps(worker(args.engine, configs, args.steps, args.context, args.threads)))
        return 0
    named = [Path(path).resolve() for path in args.code.split(",") if path]
    if not 1 <= len(named) <= 2 or not all((path / "trt_lookahead").is_dir() for path in named):
        raise SystemExit("--code takes one or two checkouts, each a directory holding the trt_lookahead package")
    before, after = named[0], named[1] if len(named) == 2 else HERE.parent.parent
    report: dict = {"engine": str(args.engine), "before": str(before), "after": str(after), "threads": args.threads,
                    "context": args.context, "load_start": os.getloadavg()[0], "rounds": []}
    for r in range(args.rounds):
        order = (before, after) if r % 2 == 0 else (after, before)
        times = {code: run(code, args) for code in order}
        ratios = {label: round(times[after][label] / times[before][label], 3) for label in configs}
        report["rounds"].append({"before": times[before], "after": times[after], "ratio": ratios})
        print(f"round {r + 1}: before {times[before]}, after {times[after]}, after / before {ratios}", flush=True)
    report["load_end"] = os.getloadavg()[0]
    report["median_ratio"] = {label: round(statistics.median(row["ratio"][label] for row in report["rounds"]), 3)
                              for label in configs}
    print(f"median after / before over {args.rounds} rounds: {report['median_ratio']} (load {report['load_start']:.2f}"
          f" -> {report['load_end']:.2f})")
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
