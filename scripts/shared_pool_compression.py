"""Compression with the request's own pool only against the shared pool after a warm-up of other requests.

    python scripts/shared_pool_compression.py --prompts 4 --tokens 48 --warmup 32 --threads 2 > shared.md

SmolLM2-135M-Instruct float32 on one LookaheadRuntime (torch executor, as scripts/tree_compression.py), 7/5/7
with linear candidates or `--tree auto` (the shared scope then also shares recycled successors), requests one at
a time, or all queued at once and decoded `--batch` at a time. Each set's first `--prompts` prompts run in
request scope (reading and feeding no shared pool); then `--warmup` OTHER prompts (the next ones of each set, in
turn) run in shared scope to fill the pool; then the measured prompts run again in shared scope. Tokens must be
equal in both scopes (checked). Compression = generated tokens / forward passes (prefill counted); sources =
accepted drafts per decode step.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter

import torch
from tree_compression import prompt_sets  # scripts/ is on sys.path when this file runs as a script

from trt_lookahead.lookahead.decoder import DecodeStats
from trt_lookahead.runtime import LookaheadRuntime

SETS = "mt_bench,humaneval,gsm8k,assembled"


def decode(rt: LookaheadRuntime, prompts: list[list[int]], tokens: int, scope: str, batch: int
           ) -> list[tuple[list[int], DecodeStats]]:
    """(token ids, stats) of each prompt: one after another (batch 1), else all queued at once, `batch` decoding."""
    if batch == 1:
        return [(out.token_ids, out.stats) for out in (rt.generate(p, tokens, pool_scope=scope) for p in prompts)]
    handles = rt.submit([rt.check_request(p, tokens, pool_scope=scope) for p in prompts])
    for h in handles:
        for _ in h:
            pass
        h.drain()
    return [(list(h.request.decoder.tokens), h.request.decoder.stats) for h in handles]


def run(rt: LookaheadRuntime, sets: dict[str, list[list[int]]], tokens: int, scope: str, batch: int
        ) -> tuple[dict[str, float], float, Counter, dict[tuple[str, int], list[int]]]:
    """(compression per set, overall, accepted drafts per decode step by source, tokens per prompt)."""
    order = [(name, i) for name, prompts in sets.items() for i in range(len(prompts))]
    results = dict(zip(order, decode(rt, [sets[n][i] for n, i in order], tokens, scope, batch), strict=True))
    generated, steps, sources = Counter(), Counter(), Counter()
    for (name, _), (_, stats) in results.items():
        generated[name] += stats.generated_tokens
        steps[name] += stats.steps
        sources.update(stats.sources)
    decode_steps = sum(steps.values()) - len(results)  # the prefill is a step, not a decode step
    per_set = {name: generated[name] / steps[name] for name in sets}
    outputs = {key: ids for key, (ids, _) in results.items()}
    overall = sum(generated.values()) / sum(steps.values())
    return per_set, overall, Counter({k: v / decode_steps for k, v in sources.items()}), outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4, help="measured prompts per set")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=32, help="other requests run before the shared measurement")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lookahead", default="7,5,7")
    ap.add_argument("--tree", default="off", help="off (linear candidates), auto or parents: the runtime's draft tree")
    ap.add_argument("--sets", default=SETS)
    ap.add_argument("--batch", type=int, default=1, help="requests decoded together (warm-up and measured)")
    args = ap.parse_args()
    names = args.sets.split(",")
    rt = LookaheadRuntime.from_pretrained("smollm2-135m-instruct", backend="torch", lookahead=args.lookahead,
                                          threads=args.threads, max_seq_len=1024, tree=args.tree,
                                          max_batch=args.batch)
    measured = prompt_sets(rt.tokenizer, names, 0, args.prompts)
    per = -(-args.warmup // len(names))  # warm-up prompts per set, after the measured ones
    others = prompt_sets(rt.tokenizer, names, args.prompts, args.prompts + per)
    warmup = [ids for group in zip(*others.values(), strict=False) for ids in group][: args.warmup]
    print(f"SmolLM2-135M-Instruct float32, torch, {torch.get_num_threads()} threads, {args.lookahead} "
          f"tree {args.tree}, {args.prompts} prompts x {args.tokens} tokens per set, warm-up {len(warmup)} other "
          f"requests, {args.batch} at a time; load at start {os.getloadavg()}\n")
    rows = [("request", *run(rt, measured, args.tokens, "request", args.batch))]
    decode(rt, warmup, args.tokens, "shared", args.batch)
    rows.append(("shared", *run(rt, measured, args.tokens, "shared", args.batch)))
    assert rows[0][4] == rows[1][4], "the shared pool changed a request's tokens"
    print("| scope | " + " | ".join(names) + " | all | accepted drafts per step by source |")
    print("|---|" + "---:|" * (len(names) + 1) + "---|")
    for scope, per_set, overall, sources, _ in rows:
        share = ", ".join(f"{k} {v:.2f}" for k, v in sorted(sources.items()))
        print(f"| {scope} | " + " | ".join(f"{per_set[n]:.3f}" for n in names) + f" | {overall:.3f} | {share} |")
    print(f"\nshared pool entries {len(rt.shared_pool)}, recycled successors {len(rt.successors)}; "
          f"load at end {os.getloadavg()}")
    rt.close()


if __name__ == "__main__":
    main()
