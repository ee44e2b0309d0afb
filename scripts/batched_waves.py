#!/usr/bin/env python
"""Batched greedy against batched `auto` in alternating waves on one runtime, with the step times by kind.

    python scripts/batched_waves.py --waves greedy,auto,greedy,auto,greedy,auto

Each wave sends the same prompts (HumanEval and MT-Bench, `--limit` each) from `--streams` threads at once
and prints its output tok/s, the load, and per row count the decode steps that ran one token per row
("greedy") or wider ("wide"), with their median ms. One process, waves alternating: on a shared machine
compare neighbouring waves as ratios (`trt-lookahead bench --concurrency` measures one mode at a time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from trt_lookahead.bench.datasets import encode_row, load_dataset
from trt_lookahead.model.fetch import resolve_model
from trt_lookahead.runtime import LookaheadRuntime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--waves", default="greedy,auto,greedy,auto", help="comma list of greedy, auto or W,N,G")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--limit", type=int, default=8, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    with LookaheadRuntime.from_pretrained(resolve_model(args.model), threads=args.threads,
                                          max_batch=args.streams) as rt:
        prompts = [encode_row(rt.tokenizer, row) for name in ("humaneval", "mt_bench")
                   for row in load_dataset(name, args.limit).rows]
        for mode in args.waves.split(","):
            before, load, start = len(rt.scheduler.steps), os.getloadavg()[0], time.perf_counter()
            with ThreadPoolExecutor(args.streams) as pool:
                outs = list(pool.map(lambda ids, m=mode: rt.generate(ids, args.max_new_tokens, lookahead=m), prompts))
            seconds = time.perf_counter() - start
            steps = [s for s in list(rt.scheduler.steps)[before:] if not s.prefill_rows]
            tokens = sum(len(o.token_ids) for o in outs)
            print(f"{mode:8s} {tokens / seconds:6.1f} tok/s  {seconds:5.1f} s  load {load:.2f}  {len(steps)} steps",
                  flush=True)
            kinds: dict[tuple[int, str], list[float]] = {}
            for s in steps:
                kinds.setdefault((s.rows, "greedy" if s.tokens == s.rows else "wide"), []).append(
                    1000.0 * (s.executor_seconds + s.host_seconds))
            for (rows, kind), ms in sorted(kinds.items()):
                print(f"    {rows} rows {kind:6s} {len(ms):4d} steps  median {statistics.median(ms):6.1f} ms")


if __name__ == "__main__":
    main()
