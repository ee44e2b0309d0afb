#!/usr/bin/env python3
"""Benchmark the torch executor: greedy ms/token vs transformers' generate, and step latency vs T.

    python scripts/bench_executor.py [--models stories260K,smollm2] [--dtypes float32,bfloat16]
                                     [--threads 1] [--repeats 3] [--json OUT.json]

Greedy: our TorchExecutor (tests/support) with T = 1 (prefill, then step + commit per token) against
`LlamaForCausalLM.generate(do_sample=False)` on the same checkpoint, dtype and thread count. Decode
ms/token excludes prefill for both (transformers: (t(N new) - t(1 new)) / (N - 1)). Token ids are
compared (exact = identical ids). Step latency: one `step` of the StepLayout for T = 1, 16, 36, 120
after a ~100-token prompt, with logits only at the layout's output slots and at all slots.
Medians over --repeats runs; the load average is recorded because these machines are shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.model.checkpoint import load_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test support, not in the package
from support.torch_executor import TorchExecutor

ROOT = Path(__file__).resolve().parent.parent

STORIES = ROOT / "tests" / "fixtures" / "stories260K"
STEP_CONFIGS = {1: None, 16: LookaheadConfig(4, 3, 4), 36: LookaheadConfig(6, 4, 6), 120: LookaheadConfig(15, 5, 15)}
SMOLLM2_PROMPT = "Once upon a time, there was a little girl named Lily who"


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def resolve(name: str) -> tuple[Path, list[int], int]:
    """(checkpoint dir, prompt ids, new tokens) for a model name."""
    if name == "stories260K":
        return STORIES, [1], 256
    from transformers import AutoTokenizer

    from trt_lookahead.model.fetch import resolve_model

    path = resolve_model("smollm2-135m-instruct")
    ids = AutoTokenizer.from_pretrained(path)(SMOLLM2_PROMPT)["input_ids"]
    return path, list(ids), 64


def ours_greedy(model, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    ex = TorchExecutor(model, np.ones((1, 1), bool), len(prompt) + n + 1)
    t0 = time.perf_counter()
    x = ex.prefill(np.array(prompt))
    t1 = time.perf_counter()
    out = [x]
    one, slot0 = np.zeros(1, np.int64), np.zeros(1, np.int64)
    pos = np.zeros(1, np.int64)
    for _ in range(n - 1):
        one[0], pos[0] = x, ex.cache_len
        x = int(ex.step(one, pos)[0])
        ex.commit(slot0)
        out.append(x)
    t2 = time.perf_counter()
    return out, (t1 - t0) * 1e3, (t2 - t1) * 1e3 / (n - 1)


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], float]:
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)[0, len(prompt) :].tolist()
        t2 = time.perf_counter()
    return out, ((t2 - t1) - (t1 - t0)) * 1e3 / (n - 1)


def bench_greedy(name: str, dtype: str, repeats: int, weight_layout: str = "auto") -> dict:
    from transformers import LlamaForCausalLM

    path, prompt, n = resolve(name)
    model, _ = load_llama(path, dtype=dtype, weight_layout=weight_layout)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    load_before = load()
    ours_ms, hf_ms, prefill_ms = [], [], []
    ours_ids = hf_ids = None
    ours_greedy(model, prompt, 8)  # warm-up
    hf_greedy(hf, prompt, 4)
    for _ in range(repeats):
        ours_ids, pf, ms = ours_greedy(model, prompt, n)
        ours_ms.append(ms)
        prefill_ms.append(pf)
        hf_ids, ms = hf_greedy(hf, prompt, n)
        hf_ms.append(ms)
    same = next((i for i, (a, b) in enumerate(zip(ours_ids, hf_ids, strict=True)) if a != b), n)
    ours, theirs = statistics.median(ours_ms), statistics.median(hf_ms)
    return {
        "kind": "greedy",
        "model": name,
        "dtype": dtype,
        "weight_layout": model.weight_layout,
        "new_tokens": n,
        "prompt_tokens": len(prompt),
        "ours_ms_per_token": round(ours, 3),
        "transformers_ms_per_token": round(theirs, 3),
        "speedup": round(theirs / ours, 2),
        "speedup_best_runs": round(min(hf_ms) / min(ours_ms), 2),
        "ours_prefill_ms": round(statistics.median(prefill_ms), 2),
        "identical_tokens": ours_ids == hf_ids,
        "matching_prefix": same,
        "runs_ms": {"ours": [round(x, 2) for x in ours_ms], "transformers": [round(x, 2) for x in hf_ms]},
        "load": [load_before, load()],
    }


def bench_steps(
    name: str, dtype: str, repeats: int, weight_layout: str = "auto", context: int = 100, iters: int = 5
) -> list[dict]:
    path, _, _ = resolve(name)
    model, cfg = load_llama(path, dtype=dtype, weight_layout=weight_layout)
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, context)
    rows = []
    for T, la in STEP_CONFIGS.items():
        layout = StepLayout(la) if la else None
        mask = layout.mask if layout else np.ones((1, 1), bool)
        rel = layout.rel_positions if layout else np.zeros(1, np.int64)
        row = {"kind": "step", "model": name, "dtype": dtype, "weight_layout": model.weight_layout, "T": T}
        row.update(config=str(la or "greedy"), context=context)
        for label, slots in (("output_slots", layout.output_slots if layout else None), ("all_slots", None)):
            ex = TorchExecutor(model, mask, context + T + 8, output_slots=slots)
            ids = np.random.default_rng(1).integers(3, cfg.vocab_size, T)
            ex.prefill(prompt)
            ex.step(ids, context + rel)  # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(iters):
                    ex.step(ids, context + rel)
                times.append((time.perf_counter() - t0) * 1e3 / iters)
            row[f"ms_{label}"] = round(statistics.median(times), 2)
            if label == "output_slots":
                row["outputs"] = T if slots is None else len(slots)
        row["load"] = load()
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="stories260K,smollm2")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--weight-layout", default="auto", choices=["auto", "out_in", "in_out"])
    ap.add_argument("--no-steps", action="store_true", help="skip the step-latency sweep")
    ap.add_argument("--json", type=Path, help="write all rows to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "threads": args.threads,
        "torch": torch.__version__,
        "load_start": load(),
    }
    print(json.dumps({"machine": machine}), flush=True)
    rows = []
    for name in args.models.split(","):
        for dtype in args.dtypes.split(","):
            row = bench_greedy(name, dtype, args.repeats, args.weight_layout)
            print(json.dumps(row), flush=True)
            rows.append(row)
        if name == "smollm2" and not args.no_steps:
            for dtype in args.dtypes.split(","):
                for row in bench_steps(name, dtype, args.repeats, args.weight_layout):
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    print("\nmodel        dtype     ours ms/tok  HF ms/tok  speedup  identical")
    for r in rows:
        if r["kind"] == "greedy":
            print(
                f"{r['model']:<12} {r['dtype']:<9} {r['ours_ms_per_token']:>11.2f}"
                f" {r['transformers_ms_per_token']:>10.2f}"
                f" {r['speedup']:>7.2f}x  {r['identical_tokens']} ({r['matching_prefix']}/{r['new_tokens']})"
            )
    steps = [r for r in rows if r["kind"] == "step"]
    if steps:
        print("\nmodel        dtype       T  config    outputs  ms(step, output slots)  ms(step, all slots)")
        for r in steps:
            print(
                f"{r['model']:<12} {r['dtype']:<9} {r['T']:>4}  {r['config']:<9} {r['outputs']:>7}"
                f"  {r['ms_output_slots']:>22.2f}  {r['ms_all_slots']:>19.2f}"
            )
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
