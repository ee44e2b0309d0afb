#!/usr/bin/env python
"""Load test of `trt-lookahead serve` over its OpenAI API: output tokens/s, TTFT and ITL p50/p95 per concurrency.

Starts `trt-lookahead serve` on 127.0.0.1 (any free port) for --model, or measures the server at --url. At
each concurrency level that many client threads (the official openai client, streaming with include_usage,
greedy) share --requests requests, and stop taking new ones after --level-seconds. Every answer is compared
with the answer to the same prompt at concurrency 1 (greedy answers never depend on the load).

    python scripts/openai_load.py                                     # SmolLM2, mt_bench, 1/4/8/16 streams
    python scripts/openai_load.py --lookahead_config 1,2,0 --json     # the same, greedy

ttft = send -> first text; itl = (last chunk - first text) / (completion tokens - 1) per request; output
tokens/s = the level's completion tokens / its wall time. HTTP overhead (concurrency 1): the client's decode
time (first text -> last chunk) minus the runtime's decode_seconds (the response's `lookahead` extension),
per token, and as a fraction of the runtime's decode time. Server-side means come from /metrics.
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from trt_lookahead.bench.datasets import PromptRow, load_dataset
from trt_lookahead.bench.machine import machine_info

READY = re.compile(r"on (http://127\.0\.0\.1:\d+)/v1")


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def start_server(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "trt_lookahead.cli", "serve", "--model", args.model, "--port", "0",
            "--threads", str(args.threads), "--max-batch", str(args.max_batch or max(args.levels)),
            "--max-queue", str(max(args.levels))]
    if args.lookahead_config:
        argv += ["--lookahead_config", args.lookahead_config]
    out = open(log, "wb")  # noqa: SIM115 - the server's log, kept for the run
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while not (match := READY.search(log.read_text(errors="replace"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"serve did not start; its log:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    return proc, match.group(1)


def model_name(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def server_means(url: str) -> dict[str, float]:
    """Sums and counts of the server's TTFT and ITL histograms."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    wanted = ("time_to_first_token_seconds", "inter_token_latency_seconds")
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in lines if line[:1] != "#")
            if any(name == f"trt_lookahead_{w}_{k}" for w in wanted for k in ("sum", "count"))}


def one_request(client, model: str, row: PromptRow, max_tokens: int) -> dict:
    """One streamed greedy request -> timings (perf_counter seconds), text, tokens, the runtime's decode time."""
    kwargs = dict(model=model, temperature=0.0, seed=0, stream=True, stream_options={"include_usage": True})
    start = time.perf_counter()
    if row.is_chat:
        stream = client.chat.completions.create(messages=row.chat_messages(), max_completion_tokens=max_tokens,
                                                **kwargs)
    else:
        stream = client.completions.create(prompt=row.text, max_tokens=max_tokens, **kwargs)
    first = last = None
    text, tokens, extension = [], 0, {}
    for chunk in stream:
        now = time.perf_counter()
        for choice in chunk.choices:
            piece = (choice.delta.content if row.is_chat else choice.text) or ""
            if piece and first is None:
                first = now
            text.append(piece)
            if choice.finish_reason is not None:
                last, extension = now, chunk.model_extra["lookahead"]
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    assert first is not None and last is not None, "a stream without text or without its final chunk"
    return {"id": row.id, "ttft": first - start, "decode": last - first, "tokens": tokens, "text": "".join(text),
            "server_decode": extension["decode_seconds"], "steps": extension["steps"]}


def run_level(url: str, model: str, level: int, rows: list[PromptRow], args: argparse.Namespace,
              reference: dict[str, str]) -> tuple[dict, list[dict]]:
    import openai

    work: queue.Queue[PromptRow] = queue.Queue()
    for i in range(args.requests):
        work.put(rows[i % len(rows)])
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + args.level_seconds

    def client_loop() -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=args.timeout, max_retries=0)
        while time.monotonic() < deadline:
            try:
                row = work.get_nowait()
            except queue.Empty:
                return
            try:
                result = one_request(client, model, row, args.max_tokens)
            except Exception as exc:  # counted and shown, the level goes on
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
                continue
            with lock:
                results.append(result)

    before = server_means(url)
    start = time.perf_counter()
    with ThreadPoolExecutor(level) as pool:
        for done in [pool.submit(client_loop) for _ in range(level)]:
            done.result()
    wall = time.perf_counter() - start
    after = server_means(url)
    if level == 1:
        for r in results:
            reference.setdefault(r["id"], r["text"])
    wrong = sum(r["text"] != reference.get(r["id"], r["text"]) for r in results)
    ttfts = [r["ttft"] for r in results]
    itls = [r["decode"] / (r["tokens"] - 1) for r in results if r["tokens"] > 1]

    def server_mean(name: str) -> float:
        count = after[f"trt_lookahead_{name}_count"] - before[f"trt_lookahead_{name}_count"]
        return (after[f"trt_lookahead_{name}_sum"] - before[f"trt_lookahead_{name}_sum"]) / count if count else 0.0

    tokens = sum(r["tokens"] for r in results)
    row = {
        "concurrency": level,
        "requests": len(results),
        "failed": len(errors),
        "wrong": wrong,
        "wall_seconds": round(wall, 2),
        "output_tokens_per_second": round(tokens / wall, 2),
        "tokens_per_step": round(tokens / max(sum(r["steps"] for r in results), 1), 3),
        "ttft_p50_ms": round(1000 * percentile(ttfts, 50), 1),
        "ttft_p95_ms": round(1000 * percentile(ttfts, 95), 1),
        "itl_p50_ms": round(1000 * percentile(itls, 50), 2),
        "itl_p95_ms": round(1000 * percentile(itls, 95), 2),
        "server_ttft_mean_ms": round(1000 * server_mean("time_to_first_token_seconds"), 1),
        "server_itl_mean_ms": round(1000 * server_mean("inter_token_latency_seconds"), 2),
        "first_errors": errors[:3],
    }
    return row, results


def http_overhead(results: list[dict]) -> dict:
    """Client decode time minus the runtime's, per token and as a fraction of the runtime's (concurrency 1)."""
    rows = [r for r in results if r["tokens"] > 1 and r["server_decode"] > 0]
    per_token = [1000 * (r["decode"] - r["server_decode"]) / (r["tokens"] - 1) for r in rows]
    fraction = [(r["decode"] - r["server_decode"]) / r["server_decode"] for r in rows]
    client, server = sum(r["decode"] for r in rows), sum(r["server_decode"] for r in rows)
    return {
        "requests": len(rows),
        "overhead_ms_per_token_median": round(statistics.median(per_token), 3) if rows else None,
        "overhead_fraction_median": round(statistics.median(fraction), 4) if rows else None,
        "overhead_fraction_total": round((client - server) / server, 4) if rows else None,
        "runtime_decode_ms_per_token_median": round(statistics.median(
            1000 * r["server_decode"] / (r["tokens"] - 1) for r in rows), 2) if rows else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="checkpoint dir or known name")
    p.add_argument("--url", default=None, help="measure a running server (http://127.0.0.1:PORT) instead")
    p.add_argument("--lookahead_config", "--lookahead-config", dest="lookahead_config", default=None,
                   help="the served W,N,G (default: serve's)")
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    p.add_argument("--max-batch", "--max_batch", dest="max_batch", type=int, default=None,
                   help="the server's --max-batch (default: the largest concurrency)")
    p.add_argument("--concurrency", default="1,4,8,16", help="comma list of concurrent streams")
    p.add_argument("--requests", type=int, default=16, help="requests per level (shared by its streams)")
    p.add_argument("--level-seconds", "--level_seconds", dest="level_seconds", type=float, default=240.0,
                   help="a level takes no new request after this")
    p.add_argument("--max-tokens", "--max_tokens", dest="max_tokens", type=int, default=64)
    p.add_argument("--dataset", default="mt_bench", help="mt_bench, humaneval, gsm8k or a JSONL path")
    p.add_argument("--limit", type=int, default=16, help="distinct prompts")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = p.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",")]
    rows = list(load_dataset(args.dataset, args.limit).rows)

    machine = machine_info(threads=args.threads)
    proc = None
    log = Path(tempfile.mkdtemp(prefix="trt-lookahead-openai-load-")) / "serve.log"
    url = args.url
    if url is None:
        proc, url = start_server(args, log)
    try:
        model = model_name(url)
        reference: dict[str, str] = {}
        run_level(url, model, 1, rows[:1], argparse.Namespace(**{**vars(args), "requests": 1}), {})  # warm-up
        levels, overhead = [], None
        for level in args.levels:
            row, results = run_level(url, model, level, rows, args, reference)
            levels.append(row)
            if level == 1:
                overhead = http_overhead(results)
            print(f"concurrency {level}: {json.dumps(row)}", file=sys.stderr, flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)
    report = {"model": model, "lookahead_config": args.lookahead_config or "serve's default",
              "max_batch": args.max_batch or max(args.levels),
              "dataset": args.dataset, "max_tokens": args.max_tokens, "machine": machine,
              "load_end": machine_info()["load"], "levels": levels, "http_overhead_concurrency_1": overhead}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{model}, {args.dataset}, {args.max_tokens} tokens, lookahead {report['lookahead_config']}, "
              f"max_batch {report['max_batch']}, "
              f"{machine['cpu']} x{machine['cpus']}, server threads {args.threads}, load {machine['load']} -> "
              f"{report['load_end']}, {machine['date']}")
        print("| streams | requests | wrong | out tok/s | tok/step | TTFT p50 / p95 ms | ITL p50 / p95 ms |")
        print("|---:|---:|---:|---:|---:|---|---|")
        for r in levels:
            print(f"| {r['concurrency']} | {r['requests']} | {r['wrong']} | {r['output_tokens_per_second']} | "
                  f"{r['tokens_per_step']} | {r['ttft_p50_ms']} / {r['ttft_p95_ms']} | "
                  f"{r['itl_p50_ms']} / {r['itl_p95_ms']} |")
        print(f"HTTP overhead at concurrency 1: {json.dumps(overhead)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
