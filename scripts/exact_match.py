#!/usr/bin/env python3
"""Exactness figures: lookahead output against greedy output, and batched output against solo, token for token.

    python scripts/exact_match.py [--model smollm2|stories260K] [--dtypes bfloat16,float32] [--exact on,off]
                                  [--sets mt_bench,humaneval,gsm8k,heldout] [--limit 8]
                                  [--configs 4,3,4:15,5,15] [--max-new-tokens 48] [--batch 8]
                                  [--batch-requests 16] [--threads 1] [--json OUT.json]

For each dtype and exact setting, one runtime (max_batch = --batch) runs every prompt alone with greedy and
with every config, and counts the prompts whose token ids equal greedy's (design section 8 `exact`). Then
--batch-requests of those (prompt, config) pairs, the configs mixed (greedy among them), are submitted at
once, so up to --batch of them share every step while others join and leave; each batched answer is
compared with the same request alone and with greedy. `heldout` is scripts/data/exact_heldout.jsonl
(prompts written for this check: stories, code, chat questions; not a tuning or benchmark set). A model
without a chat template (stories260K) gets a chat row's text as a raw prompt. Token identity is not
timing-sensitive; the load average is recorded anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from trt_lookahead.bench.datasets import PromptRow, load_dataset
from trt_lookahead.lookahead.config import GREEDY, LookaheadConfig
from trt_lookahead.runtime import LookaheadRuntime

ROOT = Path(__file__).resolve().parent.parent
HELDOUT = ROOT / "scripts" / "data" / "exact_heldout.jsonl"
MODELS = {"smollm2": "smollm2-135m-instruct", "stories260K": str(ROOT / "tests" / "fixtures" / "stories260K")}


def prompt_of(rt: LookaheadRuntime, row: PromptRow) -> Any:
    """A row as the runtime takes it: chat messages where the model has a chat template, else raw text."""
    if not row.is_chat:
        return row.text
    if getattr(rt.tokenizer, "chat_template", None):
        return row.chat_messages()
    return row.chat_messages()[-1]["content"]


def run_setting(args: argparse.Namespace, dtype: str, exact: bool) -> dict[str, Any]:
    """Solo greedy and configs on every prompt, then the mixed batch, on one runtime."""
    configs: list[str] = [GREEDY, *args.configs.split(":")]
    rt = LookaheadRuntime.from_pretrained(MODELS[args.model], dtype=dtype, lookahead="greedy", threads=args.threads,
                                          max_seq_len=args.max_seq_len, max_batch=args.batch, exact=exact)
    prompts: list[tuple[str, Any]] = []
    for name in args.sets.split(","):
        data = load_dataset(str(HELDOUT) if name == "heldout" else name, args.limit)
        prompts += [(data.name if name != "heldout" else "heldout", prompt_of(rt, row)) for row in data.rows]
    solo: dict[tuple[int, str], list[int]] = {}
    t0, load = time.time(), [os.getloadavg()]
    with rt:
        assert rt.exact == exact, (rt.exact, exact)
        for i, (_, prompt) in enumerate(prompts):
            for config in configs:
                solo[i, config] = rt.generate(prompt, args.max_new_tokens, lookahead=config).token_ids
        by_set: dict[str, dict[str, list[int]]] = {}
        for i, (name, _) in enumerate(prompts):
            for config in configs[1:]:
                by_set.setdefault(name, {}).setdefault(config, [0, 0])
                by_set[name][config][0] += solo[i, config] == solo[i, GREEDY]
                by_set[name][config][1] += 1
        pairs = [(i % len(prompts), configs[i % len(configs)]) for i in range(args.batch_requests)]
        before = rt.scheduler.steps[-1] if rt.scheduler.steps else None  # the log is a bounded deque
        requests = [rt.check_request(prompts[i][1], args.max_new_tokens, lookahead=c) for i, c in pairs]
        handles = rt.submit(requests)
        for h in handles:
            for _ in h:
                pass
        log = list(rt.scheduler.steps)
        rows = [s.rows for s in log[next((k + 1 for k, s in enumerate(log) if s is before), 0):]]
        batched = [h.result.token_ids for h in handles if h.result is not None]
        load.append(os.getloadavg())
    assert len(batched) == len(pairs)
    return {
        "dtype": dtype, "exact": exact, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "lookahead_equals_greedy": {n: {c: f"{m}/{k}" for c, (m, k) in v.items()} for n, v in by_set.items()},
        "batched": {
            "requests": len(pairs), "configs": configs,
            "equal_solo": sum(b == solo[p] for b, p in zip(batched, pairs, strict=True)),
            "equal_greedy": sum(b == solo[p[0], GREEDY] for b, p in zip(batched, pairs, strict=True)),
            "steps": len(rows), "mean_rows_per_step": round(sum(rows) / max(len(rows), 1), 2),
            "max_rows_per_step": max(rows, default=0),
        },
        "seconds": round(time.time() - t0, 1), "load": load,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--exact", default="on", help="on, off or on,off")
    ap.add_argument("--sets", default="mt_bench,humaneval,gsm8k,heldout")
    ap.add_argument("--limit", type=int, default=8, help="prompts per set")
    ap.add_argument("--configs", default="4,3,4:15,5,15", help="lookahead configs W,N,G separated by ':'")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--max-seq-len", type=int, default=None, help="KV length (default: min(context, 4096))")
    ap.add_argument("--batch", type=int, default=8, help="max_batch: requests sharing a step")
    ap.add_argument("--batch-requests", type=int, default=16, help="mixed requests submitted at once")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    for spec in args.configs.split(":"):
        LookaheadConfig.parse(spec)  # a bad config fails here, before any model is loaded
    results = []
    for dtype in args.dtypes.split(","):
        for exact in (s.strip() == "on" for s in args.exact.split(",")):
            results.append(run_setting(args, dtype, exact))
            print(json.dumps(results[-1]), flush=True)
            if args.json:
                args.json.write_text(json.dumps({"model": args.model, "threads": args.threads,
                                                 "cpus": os.cpu_count(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
