"""Compression of linear candidates against the draft tree at equal T, per source (docs/design.md section 9).

    python scripts/tree_compression.py --prompts 8 --tokens 64 --threads 1 > tree.md

SmolLM2-135M-Instruct, float32, torch executor on the CPU. Compression = generated tokens / forward passes
(prefill counted as one); acceptance per decode step by depth (fraction of steps accepting >= d drafts),
by the rank of the accepted node among its siblings (accepted drafts per step; chain drafts not counted)
and by source; host ms per decode step (wall time outside the executor, median over prompts; give the
machine's load beside it). Every run is checked token for token against the first variant's run of the same prompt.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch

from trt_lookahead.backends.torch import BatchedTorchExecutor
from trt_lookahead.bench.datasets import PromptRow, encode_row, load_dataset
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.decoder import acceptance_counts
from trt_lookahead.lookahead.tree import TREE_DEPTH, Acceptance, TreeTemplate, chain_template, tree_template
from trt_lookahead.model.checkpoint import load_llama
from trt_lookahead.model.fetch import resolve_model
from trt_lookahead.tuning.tune import TUNE_ROW_OFFSET, tuned_tree

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test support, not in the package
from support.ablation import LookaheadDecoder, Switches

# a set that is not MT-Bench, HumanEval or GSM8K: rewriting, extraction and editing tasks that quote their input
ASSEMBLED = [
    "Rewrite this sentence in the passive voice: The committee approved the new budget after a long debate.",
    "Convert to JSON with keys name, age, city: Alice is 34 and lives in Lyon; Bob is 27 and lives in Porto.",
    "Add type hints to this Python function:\ndef area(width, height):\n    return width * height",
    "Summarize in two sentences: The river flooded the valley in spring. Farmers moved their animals to the "
    "hills. When the water went down, the fields were covered in rich mud, and the harvest that year was the "
    "best anyone could remember.",
    "Fix the bug in this code and show the corrected version:\nfor i in range(10)\n    print(i)",
    "List the steps to make a cup of tea, numbered, one line each.",
    "Translate to French: The cat sleeps on the warm windowsill every afternoon.",
    "Write a SQL query that selects the name and email of all users whose signup_date is in 2023 from the "
    "table users, ordered by name.",
    "Turn this list into a Markdown table with columns Fruit and Color: apple red, banana yellow, grape purple.",
    "Explain what this regular expression matches: ^[a-z0-9._%+-]+@[a-z0-9.-]+\\.[a-z]{2,}$",
    "Rename the variable x to count in this code:\nx = 0\nfor item in items:\n    x += 1\nprint(x)",
    "Write the numbers from one to twenty in words, separated by commas.",
    # prompts 12-31, added 2026-11-27 (written before any measurement on them) so that 8 measured prompts and 8
    # warm-up prompts of the set fit: 4 prompts of short answers measured the set within a few steps
    "Rewrite in plain English for a ten-year-old: Photosynthesis is the process by which green plants use "
    "sunlight, water and carbon dioxide to produce glucose and oxygen.",
    "Extract every date from this text as a list: The contract was signed on 3 March 2021, amended on 15 June "
    "2022 and ends on 31 December 2025.",
    "Convert this Python function to JavaScript:\ndef greet(name):\n    return 'Hello, ' + name + '!'",
    "Write a docstring for this function:\ndef mean(values):\n    return sum(values) / len(values)",
    "Correct the grammar and spelling: Their going to the libary tomorow to return there books.",
    "Convert this CSV to a JSON list of objects:\nname,price\npen,1.20\nbook,8.50\nbag,15.00",
    "Write a short email to a colleague asking to move our Tuesday meeting to Thursday at 10 am.",
    "Explain what this shell command does: find . -name '*.log' -mtime +7 -delete",
    "Rewrite this loop as a list comprehension:\nsquares = []\nfor n in range(10):\n    if n % 2 == 0:\n"
    "        squares.append(n * n)",
    "Give three titles for a blog post about growing tomatoes on a balcony.",
    "Write a YAML config with a server section (host localhost, port 8080) and a database section (name app, "
    "user admin).",
    "Describe the water cycle in four short numbered steps.",
    "Turn these notes into a paragraph: met client; discussed budget; agreed on delivery in May; next call Friday.",
    "Write a Python class Point with x and y attributes and a method distance_to(other).",
    "Change every verb in this sentence to the past tense: She walks to the market, buys apples and cooks dinner.",
    "Write a haiku about the first snow of winter.",
    "Classify each animal as mammal, bird or fish: salmon, eagle, dolphin, sparrow, tuna, bat.",
    "Write an HTML page with a heading 'Welcome' and a list of three links.",
    "Shorten this sentence without changing its meaning: Due to the fact that it was raining heavily, we made "
    "the decision to stay at home.",
    "Write unit tests with pytest for this function:\ndef is_even(n):\n    return n % 2 == 0",
]
CONFIGS = {28: LookaheadConfig(4, 5, 3), 56: LookaheadConfig(7, 5, 7), 120: LookaheadConfig(15, 5, 15)}
VARIANTS = {  # name -> (tree: None (linear), "prior" or "fitted", switches)
    "linear (today)": (None, Switches()),
    "tree: pool": ("prior", Switches(suffix=False, recycle=False)),
    "tree: suffix": ("prior", Switches(pool=False, recycle=False)),
    "tree: recycled": ("prior", Switches(pool=False, suffix=False)),
    "tree: pool+suffix": ("prior", Switches(recycle=False)),
    "tree: pool+suffix+recycled by token only": ("prior", Switches(pairs=False)),
    "tree: pool+suffix+recycled": ("prior", Switches()),
    # shaped by the acceptance per depth and rank the prior tree measured on other rows (--fit-offset)
    "fitted tree: pool+suffix+recycled": ("fitted", Switches()),
}


def prompt_sets(tokenizer: object, names: list[str], start: int, stop: int) -> dict[str, list[list[int]]]:
    """Token ids of prompts start .. stop - 1 of each named set ("assembled" = ASSEMBLED), chat-encoded."""
    sets = {}
    for name in names:
        rows = ([PromptRow(f"a{i}", messages=(("user", text),)) for i, text in enumerate(ASSEMBLED)]
                if name == "assembled" else list(load_dataset(name).rows))
        sets[name] = [encode_row(tokenizer, row) for row in rows[start:stop]]
    return sets


def fitted_tree(model: object, cfg: LookaheadConfig, prior: TreeTemplate, sets: dict[str, list[list[int]]],
                tokens: int) -> TreeTemplate:
    """What `tune --tree-out` writes for `cfg`: the prior tree's acceptance on `sets`, all sources on, fitted."""
    executor = BatchedTorchExecutor(model, 1, 2048, cfg.step_tokens, tree=prior)
    accepted, offered = Counter(), Counter()
    for ids in (ids for prompts in sets.values() for ids in prompts):
        stats = LookaheadDecoder(executor, cfg, tree=prior).generate(ids, tokens).stats
        accepted.update(stats.tree_accepted)
        offered.update(stats.tree_offered)
    return tuned_tree(acceptance_counts(accepted, offered), cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--depth", type=int, default=TREE_DEPTH, help="tree template depth")
    ap.add_argument("--decay", type=float, default=0.45, help="tree template rank decay")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", default="28,56,120", help="T values")
    ap.add_argument("--sets", default="mt_bench,humaneval,gsm8k,assembled")
    ap.add_argument("--fit-offset", type=int, default=TUNE_ROW_OFFSET,
                    help="the fitted tree is fitted on --prompts rows from here (tune's rows), not the rows measured")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model("smollm2-135m-instruct")
    model = load_llama(path, weight_layout="auto")[0]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    sets = prompt_sets(tokenizer, args.sets.split(","), 0, args.prompts)
    fit_sets = prompt_sets(tokenizer, [n for n in args.sets.split(",") if n != "assembled"], args.fit_offset,
                           args.fit_offset + args.prompts)
    print(f"SmolLM2-135M-Instruct float32, CPU, torch threads {args.threads}, {args.prompts} prompts x "
          f"{args.tokens} tokens per set, tree depth {args.depth}; load at start {os.getloadavg()}\n")
    print("| T | config | variant | " + " | ".join(sets) + " | all | host ms/step | accept >= depth 1..8 | "
          "accepted by rank 0..3 | sources |")
    print("|---|---|---|" + "---:|" * (len(sets) + 2) + "---|---|---|")
    for T in (int(t) for t in args.steps.split(",")):
        cfg = CONFIGS[T]
        trees = {"prior": tree_template(cfg.G * cfg.levels, args.depth, Acceptance.prior(args.decay)), None: None}
        if "fitted" in {VARIANTS[v][0] for v in args.variants.split(",")}:
            trees["fitted"] = fitted_tree(model, cfg, trees["prior"], fit_sets, args.tokens)
            print(f"<!-- T={T} fitted tree: {trees['fitted']} -->", flush=True)
        linear: dict[tuple[str, int], list[int]] = {}
        for variant in args.variants.split(","):
            kind, switches = VARIANTS[variant]
            t = trees[kind]
            executor = BatchedTorchExecutor(model, 1, 2048, T, tree=t)
            per_set, host, depths, sources, nodes = [], [], Counter(), Counter(), Counter()
            generated = steps = decode_steps = 0
            for name, prompts in sets.items():
                g = s = 0
                for i, ids in enumerate(prompts):
                    result = LookaheadDecoder(executor, cfg, switches=switches, tree=t).generate(ids, args.tokens)
                    first = linear.setdefault((name, i), result.token_ids)  # the first variant's tokens
                    assert result.token_ids == first, f"{variant} differs on {name} prompt {i}"
                    stats = result.stats
                    g, s = g + stats.generated_tokens, s + stats.steps
                    decode_steps += stats.decode_steps
                    host.append(stats.host_ms_per_step)
                    depths.update(stats.depths)
                    sources.update(stats.sources)
                    nodes.update(stats.nodes)
                per_set.append(g / s)
                generated, steps = generated + g, steps + s
            accept = " ".join(f"{depths[d] / decode_steps:.2f}" for d in range(1, 9))
            template = t or chain_template(cfg.G, cfg.levels)
            by_rank: Counter = Counter()
            for v, n in nodes.items():
                if v < template.nodes:  # chain nodes have no rank in the template
                    by_rank[int(template.rank[v])] += n
            ranks = " ".join(f"{by_rank[r] / decode_steps:.2f}" for r in range(4))
            share = ", ".join(f"{k} {v / decode_steps:.2f}" for k, v in sorted(sources.items()))
            cells = " | ".join(f"{c:.3f}" for c in per_set)
            print(f"| {T} | {cfg} | {variant} | {cells} | {generated / steps:.3f} | {statistics.median(host):.3f} | "
                  f"{accept} | {ranks} | {share} |", flush=True)
    print(f"\nload at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
