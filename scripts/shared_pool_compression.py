"""Compression with the request's own pool only against the shared pool after a warm-up of other requests.

    python scripts/shared_pool_compression.py --prompts 4 --tokens 48 --warmup 32 --threads 2 > shared.md

SmolLM2-135M-Instruct float32 on one LookaheadRuntime (torch executor, as scripts/tree_compression.py), 7/5/7
with linear candidates or `--tree auto` (the shared scope then also shares recycled successors), requests one
at a time. Each set's first `--prompts` prompts run in request scope (reading and feeding no
shared pool); then `--warmup` OTHER prompts (the next ones of each set, in turn) run in shared scope to fill the
pool; then the measured prompts run again in shared scope. Tokens must be equal in both scopes (checked).
Compression = generated tokens / forward passes (prefill counted); sources = accepted drafts per decode step.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter

import torch
from tree_compression import prompt_sets  # scripts/ is on sys.path when this file runs as a script

from trt_lookahead.runtime import LookaheadRuntime

SETS = "mt_bench,humaneval,gsm8k,assembled"


def run(rt: LookaheadRuntime, sets: dict[str, list[list[int]]], tokens: int, scope: str
        ) -> tuple[dict[str, float], float, Counter, dict[tuple[str, int], list[int]]]:
    """(compression per set, overall, accepted drafts per decode step by source, tokens per prompt)."""
    per_set, sources, outputs = {}, Counter(), {}
    generated = steps = decode_steps = 0
    for name, prompts in sets.items():
        g = s = 0
        for i, ids in enumerate(prompts):
            out = rt.generate(ids, tokens, pool_scope=scope)
            outputs[(name, i)] = out.token_ids
            g, s = g + out.stats.generated_tokens, s + out.stats.steps
            decode_steps += out.stats.decode_steps
            sources.update(out.stats.sources)
        per_set[name] = g / s
        generated, steps = generated + g, steps + s
    return per_set, generated / steps, Counter({k: v / decode_steps for k, v in sources.items()}), outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4, help="measured prompts per set")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=32, help="other requests run before the shared measurement")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lookahead", default="7,5,7")
    ap.add_argument("--tree", default="off", help="off (linear candidates), auto or parents: the runtime's draft tree")
    ap.add_argument("--sets", default=SETS)
    args = ap.parse_args()
    names = args.sets.split(",")
    rt = LookaheadRuntime.from_pretrained("smollm2-135m-instruct", backend="torch", lookahead=args.lookahead,
                                          threads=args.threads, max_seq_len=1024, tree=args.tree)
    measured = prompt_sets(rt.tokenizer, names, 0, args.prompts)
    per = -(-args.warmup // len(names))  # warm-up prompts per set, after the measured ones
    others = prompt_sets(rt.tokenizer, names, args.prompts, args.prompts + per)
    warmup = [ids for group in zip(*others.values(), strict=False) for ids in group][: args.warmup]
    print(f"SmolLM2-135M-Instruct float32, torch, {torch.get_num_threads()} threads, {args.lookahead} "
          f"tree {args.tree}, {args.prompts} prompts x {args.tokens} tokens per set, warm-up {len(warmup)} other "
          f"requests; load at start {os.getloadavg()}\n")
    rows = [("request", *run(rt, measured, args.tokens, "request"))]
    for ids in warmup:
        rt.generate(ids, args.tokens)
    rows.append(("shared", *run(rt, measured, args.tokens, "shared")))
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
