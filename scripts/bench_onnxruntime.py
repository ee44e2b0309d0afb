"""Step time of the batched onnxruntime executor against B and T, and against the single-request engine.

    python scripts/bench_onnxruntime.py [--model smollm2-135m-instruct|stories260K|DIR] [--batches 1,2,4,8]
        [--tokens 1,4,16] [--context 128] [--steps 30] [--threads N] [--engines engines/bench]
        [--baseline-code DIR] [--variants "spinning=0;arena=0"] [--json]

Builds (once, reused later) a float32 engine dir for 4,3,4 (T = 16) with --max-batch max(--batches), then for
every (B, T) prefills B slots with `--context` random tokens each and times steps of B rows of T tokens
(T = 1: greedy rows (1, 2, 0); T = 4: (2, 3, 0); T = 16: the built 4,3,4) at that context, without
committing, so every call does the same work. Prints the median ms per step, the ms per row, and the
speed of one batched step against B single-request steps.

--baseline-code: a checkout of trt-lookahead from before the batch dimension (engine format 2; e.g.
`git worktree add /tmp/before 2254ad5`). A worker process runs that code on its own engine dirs (4,3,4 for
T = 16 and T = 1, 2,3,0 for T = 4) and times its single-request step; the worker and this process take turns
round by round, so the machine's load hits both alike. A single-request engine serves B requests with B
steps, so its cost for B rows is B times its step.

--variants: onnxruntime session settings to compare (backends/onnxruntime.py's SessionSettings fields,
`name=value` joined by `,`, variants by `;`; the defaults always run first, as "default"). Each variant opens
its own session and executor on the same engine dir, and they take turns round by round. The peak RSS of
the process is reported (it covers every variant: compare memory with one variant per run).
--json prints one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from trt_lookahead.bench.machine import machine_info
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.executor import StepBatch
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.sampling import SamplingParams

REPO = Path(__file__).resolve().parent.parent
ROW_CONFIGS = {1: LookaheadConfig(1, 2, 0), 4: LookaheadConfig(2, 3, 0), 16: LookaheadConfig(4, 3, 4)}  # T -> row
BUILT = ROW_CONFIGS[16]
ROUND = 3  # steps per turn

# The single-request engine, timed with the API of trt-lookahead before the batch dimension (format 2):
# reads "T steps" lines, answers one JSON list of seconds per line.
BASELINE_WORKER = r"""
import json, sys, time
from pathlib import Path
import numpy as np
from trt_lookahead.backends.open import open_engine
from trt_lookahead.cli import main
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.sampling import SamplingParams
model, root, context, threads, max_seq_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
configs = {1: (4, 3, 4), 4: (2, 3, 0), 16: (4, 3, 4)}
executors = {}
for T, (W, N, G) in configs.items():
    out = f"{root}/before-{Path(model).name}-{W}-{N}-{G}"
    args = ["build", "--model", model, "--output", out, "--lookahead_config", f"{W},{N},{G}", "--max_seq_len",
            max_seq_len, "--max_input_len", str(context)]
    if main(args) != 0:
        sys.exit(f"baseline build of {out} failed")
    cfg = LookaheadConfig.greedy() if T == 1 else LookaheadConfig(W, N, G)
    layout = StepLayout(cfg)
    ex = open_engine(out, threads=threads).make_executor(layout)
    ex.reset(SamplingParams())
    rng = np.random.default_rng(0)
    ex.prefill(rng.integers(0, ex.vocab_size, context))
    executors[T] = (ex, rng.integers(0, ex.vocab_size, T), context + layout.rel_positions)
print("ready", flush=True)
for line in sys.stdin:
    T, steps = (int(v) for v in line.split())
    ex, ids, positions = executors[T]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        ex.step(ids, positions)
        times.append(time.perf_counter() - t0)
    print(json.dumps(times), flush=True)
"""


def model_dir(name: str) -> Path:
    if name == "stories260K":
        return REPO / "tests" / "fixtures" / "stories260K"
    from trt_lookahead.model.fetch import resolve_model

    return resolve_model(name)


def ensure_engine(model: Path, root: Path, max_batch: int, max_seq_len: int, context: int) -> Path:
    from trt_lookahead.cli import main

    config = f"{BUILT.W},{BUILT.N},{BUILT.G}"
    out = root / f"{model.name}-{config.replace(',', '-')}-b{max_batch}"
    args = ["build", "--model", str(model), "--output", str(out), "--lookahead_config", config,
            "--max_seq_len", str(max_seq_len), "--max_input_len", str(context), "--max-batch", str(max_batch)]
    if main(args) != 0:
        raise SystemExit(f"build of {out} failed")
    return out


def parse_variants(text: str | None) -> dict[str, dict[str, object]]:
    """{"default": {}, "spinning=0": {"spinning": False}, ...} from --variants."""
    from trt_lookahead.backends.onnxruntime import SessionSettings

    types = {f.name: f.type for f in dataclasses.fields(SessionSettings) if f.name != "threads"}  # --threads
    variants: dict[str, dict[str, object]] = {"default": {}}
    for variant in filter(None, (text or "").split(";")):
        fields: dict[str, object] = {}
        for item in variant.split(","):
            name, _, value = item.partition("=")
            if name not in types:
                raise SystemExit(f"--variants: {name!r} is not a session setting; use {sorted(types)}")
            fields[name] = value if types[name] == "str" else value.lower() in ("1", "true", "on")
        variants[variant] = fields
    return variants


def step_batch(B: int, T: int, context: int, vocab: int, rng: np.random.Generator) -> StepBatch:
    """B rows of the T-token row config, every slot at `context` cached tokens."""
    layout = StepLayout(ROW_CONFIGS[T])
    cfg = layout.config
    return StepBatch(np.arange(B), rng.integers(0, vocab, (B, T)), np.tile(context + layout.rel_positions, (B, 1)),
                     np.tile(np.array([cfg.W, cfg.N, cfg.G], np.int32), (B, 1)), np.tile(layout.output_slots, (B, 1)))


class Baseline:
    """The worker process running the single-request engine (see BASELINE_WORKER)."""

    def __init__(self, code: Path, model: Path, root: Path, context: int, threads: int, max_seq_len: int) -> None:
        env = dict(os.environ, PYTHONPATH=str(code))
        args = [sys.executable, "-c", BASELINE_WORKER, str(model), str(root), str(context), str(threads),
                str(max_seq_len)]
        self.proc = subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit("the baseline worker failed to start (see its output above)")

    def time(self, T: int, steps: int) -> list[float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{T} {steps}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--tokens", default="1,4,16")
    parser.add_argument("--context", type=int, default=128, help="tokens in every slot's KV cache while timing")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per (B, T)")
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    parser.add_argument("--engines", default=str(REPO / "engines" / "bench"))
    parser.add_argument("--baseline-code", default=None, help="checkout of trt-lookahead before batching")
    parser.add_argument("--variants", default=None, help="session settings to compare, e.g. 'spinning=0;arena=0'")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from trt_lookahead.backends.onnxruntime import SessionSettings
    from trt_lookahead.backends.open import open_engine

    batches = [int(b) for b in args.batches.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    unknown = [t for t in tokens if t not in ROW_CONFIGS]
    if unknown:
        raise SystemExit(f"--tokens takes values of {sorted(ROW_CONFIGS)}, not {unknown}")
    variants = parse_variants(args.variants)
    model, root = model_dir(args.model), Path(args.engines)
    max_seq_len = args.context + 64
    engine_dir = ensure_engine(model, root, max(batches), max_seq_len, args.context)
    executors = {}
    for name, fields in variants.items():
        settings = SessionSettings(threads=args.threads, **fields)  # type: ignore[arg-type]
        ex = open_engine(engine_dir, session=settings).executor()
        rng = np.random.default_rng(0)
        for slot in range(max(batches)):
            ex.prefill(slot, rng.integers(0, ex.vocab_size, args.context), SamplingParams())
        executors[name] = ex
    rng = np.random.default_rng(1)
    steps = {(B, T): step_batch(B, T, args.context, ex.vocab_size, rng) for B in batches for T in tokens}
    baseline = None
    if args.baseline_code:
        baseline = Baseline(Path(args.baseline_code), model, root, args.context, args.threads, max_seq_len)
    for ex in executors.values():
        for batch in steps.values():  # warm up every shape once
            ex.step(batch)
    conditions = {"start": machine_info(args.threads)}
    new: dict[tuple[str, int, int], list[float]] = {(v, *key): [] for v in executors for key in steps}
    old: dict[int, list[float]] = {T: [] for T in tokens}
    for _ in range(-(-args.steps // ROUND)):  # rounds: every variant, shape and the baseline take turns
        for (B, T), batch in steps.items():
            for name, ex in executors.items():
                for _ in range(ROUND):
                    t0 = time.perf_counter()
                    ex.step(batch)
                    new[(name, B, T)].append(time.perf_counter() - t0)
        for T in tokens if baseline else []:
            old[T] += baseline.time(T, ROUND)
    if baseline:
        baseline.close()
    conditions["end"] = machine_info(args.threads)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    rows = []
    for (name, B, T), times in new.items():
        ms = statistics.median(times) * 1e3
        row = {"variant": name, "B": B, "T": T, "row_config": str(ROW_CONFIGS[T]), "ms_per_step": round(ms, 2),
               "ms_per_row": round(ms / B, 2)}
        if old[T]:
            single = statistics.median(old[T]) * 1e3
            row |= {"single_request_ms": round(single, 2), "speed_vs_single_requests": round(B * single / ms, 2)}
        rows.append(row)
    start, end = conditions["start"], conditions["end"]
    print(f"model {model.name} float32, context {args.context}, onnxruntime {args.threads} thread(s), "
          f"{start['cpu']} x{start['cpus']}, load {start['load']} -> {end['load']}, {start['date']}, "
          f"peak RSS {peak_rss_mb:.0f} MB")
    print("| variant | B | T | row | ms/step | ms/row | single-request ms/step | B single steps / one batched step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        single = "- | -"
        if "single_request_ms" in r:
            single = f"{r['single_request_ms']:.2f} | {r['speed_vs_single_requests']:.2f}x"
        print(f"| {r['variant']} | {r['B']} | {r['T']} | {r['row_config']} | {r['ms_per_step']:.2f} "
              f"| {r['ms_per_row']:.2f} | {single} |")
    if args.json:
        print(json.dumps({"model": model.name, "context": args.context, "threads": args.threads,
                          "peak_rss_mb": round(peak_rss_mb), "conditions": conditions, "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
