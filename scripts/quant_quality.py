"""Quality of quantized engines against the float engine of the same checkpoint (docs/design.md 6.9).

    python scripts/quant_quality.py --engines float=engines/f32,int4=engines/q4,int4a8=engines/q4a8 --prompts 30

The first engine is the reference. Per engine, on held-out prompts (the bench's code, chat and math sets, taken
round robin):
- greedy: the share of prompts whose greedy continuation (--tokens) equals the reference's, and the mean share
  of continuation tokens before the first difference;
- top-1: the share of positions, teacher-forced along the reference's continuation, where the engine's argmax is
  the reference's token;
- NLL gap: the mean negative log-likelihood per token of the prompts themselves (real text and chat templates,
  not generated) minus the reference's, in nats.
Teacher forcing runs causal rows of at most the engine's step tokens through the executor and reads every slot's
logits, so it measures the engine as served. Prints a markdown table and, with --json, the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np

from trt_lookahead.backends.open import open_engine
from trt_lookahead.bench.datasets import encode_row, load_dataset
from trt_lookahead.lookahead.executor import StepBatch
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.runtime import LookaheadRuntime

SETS = ("humaneval", "mt_bench", "gsm8k")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def teacher_forced(executor, ids: list[int]) -> np.ndarray:
    """Log-probabilities [len(ids) - 1, V] of ids[1:], each given the ids before it: ids[:-1] fed from an empty
    cache as causal rows of at most the executor's step tokens, every slot read."""
    executor.claim(0, SamplingParams())
    out = []
    for lo in range(0, len(ids) - 1, executor.step_tokens):
        part = np.array(ids[lo : min(lo + executor.step_tokens, len(ids) - 1)])
        n = len(part)
        executor.step(StepBatch(np.array([0]), part[None], (lo + np.arange(n))[None], np.zeros((1, 3), np.int32),
                                np.arange(n)[None]))
        out.append(log_softmax(executor.step_logits()[0]))
        executor.commit(0, np.arange(n))
    executor.release(0)
    return np.concatenate(out)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def measure(engine: Path, prompts: list[list[int]], tokens: int, reference: dict | None) -> dict:
    """This engine's greedy continuations and mean prompt NLL, and against `reference` (an earlier result) the
    greedy agreement, teacher-forced top-1 agreement and NLL gap."""
    executor = open_engine(engine).executor(max_batch=1)
    with LookaheadRuntime.from_pretrained(str(engine), max_batch=1) as rt:
        greedy = [rt.generate(ids, max_new_tokens=tokens, lookahead="greedy").token_ids for ids in prompts]
    nll = [float(-teacher_forced(executor, ids)[np.arange(len(ids) - 1), ids[1:]].mean()) for ids in prompts]
    result: dict = {"greedy": greedy, "nll": statistics.mean(nll)}
    if reference is None:
        return result
    theirs = reference["greedy"]
    top1 = [teacher_forced(executor, ids + cont)[len(ids) - 1 :].argmax(-1) == np.array(cont)
            for ids, cont in zip(prompts, theirs, strict=True)]
    return result | {
        "identical": float(np.mean([g == r for g, r in zip(greedy, theirs, strict=True)])),
        "prefix": float(np.mean([common_prefix(g, r) / max(1, len(r)) for g, r in zip(greedy, theirs, strict=True)])),
        "top1": float(np.concatenate(top1).mean()),
        "nll_gap": result["nll"] - reference["nll"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", required=True, help="name=engine_dir,...; the first is the reference")
    parser.add_argument("--prompts", type=int, default=30, help="held-out prompts, round robin over the sets")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    engines = dict(item.split("=", 1) for item in args.engines.split(","))
    first = next(iter(engines.values()))
    with LookaheadRuntime.from_pretrained(first, max_batch=1) as rt:
        tokenizer = rt.tokenizer
    pools = [load_dataset(name).rows for name in SETS]
    prompts = [encode_row(tokenizer, pools[i % len(pools)][i // len(pools)]) for i in range(args.prompts)]
    reference: dict | None = None
    rows = {}
    for name, path in engines.items():
        rows[name] = measure(Path(path), prompts, args.tokens, reference)
        reference = reference or rows[name]
        print(f"{name}: done", file=sys.stderr, flush=True)
    print(f"{len(prompts)} prompts ({', '.join(SETS)}), {args.tokens} greedy tokens, load {os.getloadavg()[0]:.1f}")
    print("| engine | identical greedy | greedy prefix | teacher-forced top-1 | NLL (nats/token) | NLL gap |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        if "top1" not in r:
            print(f"| {name} (reference) | 1 | 1 | 1 | {r['nll']:.4f} | 0 |")
        else:
            print(f"| {name} | {r['identical']:.3f} | {r['prefix']:.3f} | {r['top1']:.4f} | {r['nll']:.4f} | "
                  f"{r['nll_gap']:+.4f} |")
    if args.json:
        print(json.dumps({name: {k: v for k, v in r.items() if k != "greedy"} for name, r in rows.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
