"""`auto`'s speed over greedy as a tuning entry's step cost predicts it: an A/B of policy changes free of load.

    python scripts/modeled_speed.py TUNING_JSON [--flat] [--sets humaneval,mt_bench,gsm8k] [--limit 8]

Decodes each set's first --limit prompts (or the assembled set's, scripts/tree_compression.py) greedily and with
`auto` (one request at a time, request scope), on the default backend (or --backend) at 1 thread, with the policy
of the tuning file's one entry (`trt-lookahead tune --tuning-file F`; the entry is used whatever machine, backend
or threads it was tuned on). Each decode step of `auto` is charged the entry's c(T of the config it ran, 1 row); a
greedy step c(1, 1). Modeled speedup = greedy's charge / auto's for the same tokens (checked equal), overall, the
median prompt's and the slowest prompt's. `--flat` replaces the cost by 30 + 0.01 M ms (a GPU-like step, where
tokens per step is the speedup). Which configs the policy chose depends on the tokens and the entry only, so two
runs of one commit give the same figures on any machine and load.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from pathlib import Path

import torch
from tree_compression import prompt_sets  # scripts/ is on sys.path when this file runs as a script

from trt_lookahead.lookahead.config import DEFAULT, GREEDY, Lookahead, LookaheadConfig
from trt_lookahead.lookahead.policy import AutoPolicy, StepCost
from trt_lookahead.runtime import LookaheadRuntime
from trt_lookahead.runtime.load import load_model
from trt_lookahead.runtime.tuning_file import read_tuning_file

FLAT = (30.0, 0.01)  # ms: a step's base and per-token cost with --flat


def charge(cost: StepCost, configs: Counter) -> float:
    """Predicted ms of the decode steps `configs` counts (DecodeStats.configs: label -> steps), one row each."""
    return sum(n * cost(LookaheadConfig.from_label(label).step_tokens, 1) for label, n in configs.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tuning", type=Path, help="a tuning file with one entry")
    ap.add_argument("--flat", action="store_true", help=f"charge {FLAT[0]} + {FLAT[1]} M ms per step instead")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--backend", default=None, help="the runtime's (default: the model's default backend)")
    ap.add_argument("--sets", default="humaneval,mt_bench,gsm8k", help="dataset names, or assembled")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()
    (entry,) = read_tuning_file(args.tuning)["entries"].values()
    if args.flat:
        entry["step_cost"] = {b: [[m, FLAT[0] + FLAT[1] * m] for m, _ in pts] for b, pts in entry["step_cost"].items()}
    cost = StepCost.from_dict(entry["step_cost"])
    torch.set_num_threads(1)
    model = load_model(args.model, backend=args.backend, dtype="float32", asked=None, max_seq_len=None,
                       max_batch=None, verify=True, exact=None, tree=DEFAULT)
    with LookaheadRuntime(model, lookahead=Lookahead.greedy(), auto=AutoPolicy.from_entry(entry, learn=False)) as rt:
        print(f"{args.model} float32 on {rt.backend}, auto up to {entry['config']}, "
              f"{'flat' if args.flat else 'the entry'}'s step cost: c(1) = {cost(1, 1):.1f} ms\n")
        print("| set | steps | greedy / window-only steps | modeled speedup (median, slowest prompt) | steps per "
              "config |")
        print("|---|---:|---:|---:|---|")
        totals = [0.0, 0.0]
        for name, prompts in prompt_sets(rt.tokenizer, args.sets.split(","), 0, args.limit).items():
            configs: Counter = Counter()
            charged, ratios = [0.0, 0.0], []
            for i, ids in enumerate(prompts):
                greedy = rt.generate(list(ids), args.tokens, lookahead=GREEDY)
                auto = rt.generate(list(ids), args.tokens, lookahead="auto", pool_scope="request")
                if auto.token_ids != greedy.token_ids:
                    raise AssertionError(f"{name} prompt {i}: auto's tokens differ from greedy's")
                ms = (charge(cost, greedy.stats.configs), charge(cost, auto.stats.configs))  # decode steps only
                ratios.append(ms[0] / ms[1])
                charged = [charged[0] + ms[0], charged[1] + ms[1]]
                configs.update(auto.stats.configs)
            window_only = sum(n for label, n in configs.items() if label.endswith("/0"))  # greedy is "greedy"
            speedup = charged[0] / charged[1]
            print(f"| {name} | {sum(configs.values())} | {configs[GREEDY]} / {window_only} | {speedup:.3f} "
                  f"({statistics.median(ratios):.3f}, {min(ratios):.3f}) | {dict(sorted(configs.items()))} |",
                  flush=True)
            totals = [totals[0] + charged[0], totals[1] + charged[1]]
        print(f"\noverall modeled speedup {totals[0] / totals[1]:.3f}")


if __name__ == "__main__":
    main()
