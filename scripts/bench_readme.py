"""The benchmark behind docs/results/2026-11-22-cpu.md's first table: SmolLM2-135M-Instruct on this machine's CPU.

    python scripts/bench_readme.py                                  # float32 and bfloat16, 8 prompts per set
    python scripts/bench_readme.py --dtypes float32 --limit 2       # a quick look
    python scripts/bench_readme.py --retune --tune-budget 240       # re-measure `auto` first

For each dtype: make sure `auto` is tuned for this machine (tuning where the file has no entry, or with --retune),
then run `trt-lookahead bench` over MT-Bench, HumanEval and GSM8K (greedy, auto, 15/5/15 and
transformers' greedy and prompt lookup 10 on the same token ids), greedy and lookahead interleaved per
prompt. Writes OUT/<dtype>/ (results.json, results.md, PNG plots) and OUT/README_table.md, and prints
the table: every figure sits beside the machine, thread count, load average and date it was taken at.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from trt_lookahead.bench.bench import format_markdown
from trt_lookahead.bench.machine import load_average, machine_key, utc_now
from trt_lookahead.cli.commands import bench_model, tune_model
from trt_lookahead.lookahead.config import AUTO, GREEDY
from trt_lookahead.runtime import checkpoint_tuning_key
from trt_lookahead.runtime.tuning_file import read_tuning_file
from trt_lookahead.tuning.tune import format_report

DATASETS = "mt_bench,humaneval,gsm8k"


def _row(result: dict[str, Any], dataset: str, config: str) -> dict[str, Any] | None:
    return next((r for r in result["results"] if r["dataset"] == dataset and r["config"] == config), None)


def _f(value: Any, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def _exact(row: dict[str, Any] | None) -> str:
    return "-" if row is None or row.get("exact") is None else f"{row['exact_prompts']}/{row['prompts']}"


def summary_table(results: list[dict[str, Any]]) -> str:
    """The results table: one line per (dtype, dataset), then the conditions of each run."""
    lines = [
        "| dtype | set | greedy tok/s | auto = W/N/G | auto speedup | auto compression | auto exact "
        "| 15/5/15 compression | 15/5/15 speedup | 15/5/15 host ms/step | HF prompt lookup 10 compression "
        "| HF PL speedup vs HF greedy | HF PL exact | peak RSS MB greedy / auto / 15/5/15 |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for result in results:
        for dataset in result["datasets"]:
            g, a, w = (_row(result, dataset, c) for c in (GREEDY, AUTO, "15/5/15"))
            pl = _row(result, dataset, "hf-prompt-lookup")
            rss = " / ".join(_f(r and r.get("peak_rss_mb"), 0) for r in (g, a, w))
            lines.append(
                f"| {result['dtype']} | {dataset} | {_f(g and g['tokens_per_second'], 1)} "
                f"| {a['resolved'] if a else '-'} | {_f(a and a['speedup'], 2, 'x')} | {_f(a and a['compression'])} "
                f"| {_exact(a)} | {_f(w and w['compression'])} | {_f(w and w['speedup'], 2, 'x')} "
                f"| {_f(w and w['host_ms_per_step'])} | {_f(pl and pl['compression'])} "
                f"| {_f(pl and pl.get('speedup_vs_hf_greedy'), 2, 'x')} | {_exact(pl)} | {rss} |"
            )
    lines.append("")
    for result in results:
        m = result["machine"]
        lines.append(
            f"- {result['dtype']}: {m['cpu']} ({m['cpus']} cpus), {m['threads']} torch threads, load average "
            f"{'/'.join(f'{x:.2f}' for x in m['load'])} at start and "
            f"{'/'.join(f'{x:.2f}' for x in result['load_end'])} at end, {m['date']} to {result['date_end']} "
            f"({result['limit']} prompts per set, {result['max_new_tokens']} new tokens max, "
            f"{result['elapsed_seconds'] / 60:.0f} min)."
        )
    lines.append(
        "- speedup = greedy decode time per token / the config's, same prompts, interleaved per prompt in one "
        "process; compression = tokens / forward passes; exact = prompts token-identical to our greedy."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--datasets", default=DATASETS)
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--configs", default="greedy,auto,15/5/15")
    p.add_argument("--peers", default="hf-greedy,hf-prompt-lookup")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared 2-core machine)")
    p.add_argument("--retune", action="store_true", help="tune `auto` again before benchmarking")
    p.add_argument("--tune-budget", type=float, default=240.0)
    p.add_argument("--tune-only", action="store_true", help="only (re)tune `auto` for the dtypes")
    p.add_argument("--append", action="store_true", help="add to OUT/results_all.json (replacing same dtypes)")
    p.add_argument("--out", default="bench-out/readme")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for dtype in dtypes:
        if args.tune_only or AUTO in args.configs:
            missing = checkpoint_tuning_key(args.model, dtype) not in read_tuning_file()["entries"]
            if args.retune or missing:
                print(f"== tune {dtype}: load {load_average()} at {utc_now()}, {machine_key()}", file=sys.stderr)
                entry = tune_model(args.model, dtype=dtype, budget_seconds=args.tune_budget, threads=args.threads)
                print(format_report(entry), file=sys.stderr)
    if args.tune_only:
        return 0
    previous = out / "results_all.json"
    results = json.loads(previous.read_text()) if args.append and previous.is_file() else []
    results = [r for r in results if r["dtype"] not in dtypes]
    for dtype in dtypes:
        print(f"== bench {dtype}: load {load_average()} at {utc_now()}, {machine_key()}", file=sys.stderr)
        result, _ = bench_model(
            args.model, datasets=args.datasets, limit=args.limit, max_new_tokens=args.max_new_tokens,
            configs=args.configs, peers=args.peers, backend=None, dtype=dtype, max_seq_len=None,
            threads=args.threads, out=out / dtype,
        )
        print(format_markdown(result), file=sys.stderr)
        results.append(result)
        (out / "results_all.json").write_text(json.dumps(results, indent=1) + "\n")
    results.sort(key=lambda r: r["dtype"] != "float32")
    table = summary_table(results)
    (out / "README_table.md").write_text(table + "\n")
    print(table)
    print(f"\nwrote {out}/<dtype>/ and {out}/README_table.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
