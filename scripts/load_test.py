#!/usr/bin/env python
"""Load test of the Triton lookahead model: requests/s and p50/p95 time to first token and latency.

Writes a model repository for --model, starts tritonserver on loopback (trt_lookahead.serving.server),
then for each concurrency level runs that many gRPC streaming clients, each sending --requests requests
(stream=true) in turn. Each instance serves up to --max-batch requests at once, batched in every step by
its runtime's scheduler. Every answer is compared with LookaheadRuntime.generate of the same prompt and
settings run alone in this process; errors, timeouts and wrong text count as failures.

    python scripts/load_test.py                                  # stories260K, 1/4/8/16 streams
    python scripts/load_test.py --model smollm2-135m-instruct --dataset mt_bench --chat --max-tokens 64 \
        --requests 2 --lookahead_config auto --json

time to first token (ttft) = send -> first response (the prefill's token); latency = send -> final response.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from trt_lookahead.bench.datasets import resolve_dataset_path
from trt_lookahead.serving.repository import write_repository
from trt_lookahead.serving.schema import INPUT
from trt_lookahead.serving.server import TritonServer

ROOT = Path(__file__).resolve().parent.parent

STORY_PROMPTS = [
    "Once upon a time",
    "Lily and Tom went to the park. They",
    "The cat sat on the",
    "Sam had a red ball",
    "One day, a little bird",
    "Mom said to Ben,",
    "The sun was hot and",
    "There was a big dog named",
]
NAME = "lookahead"


def load_prompts(dataset: str | None, limit: int) -> list[str]:
    if not dataset:
        return STORY_PROMPTS[:limit]
    _, path = resolve_dataset_path(dataset)
    prompts = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            prompts.append(row.get("prompt") or (row.get("turns") or [None])[0] or row["question"])
        if len(prompts) == limit:
            break
    return prompts


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def one_request(client, responses, grpcclient, prompt, max_tokens, chat, request_id, timeout):
    """-> (ttft, latency, text, generated_tokens, error) for one request on `client`'s open stream."""
    inputs = []
    for name, value in (("text_input", prompt.encode()), ("max_tokens", max_tokens), ("stream", True)):
        field = INPUT[name]  # the types the served config.pbtxt declares
        datatype = "BYTES" if field.triton_type == "TYPE_STRING" else field.triton_type.removeprefix("TYPE_")
        tensor = grpcclient.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(np.array([value], dtype=field.numpy_dtype))
        inputs.append(tensor)
    start = time.perf_counter()
    client.async_stream_infer(NAME, inputs, request_id=request_id, parameters={"chat": chat} if chat else None,
                              enable_empty_final_response=True)
    ttft, text, generated = None, [], 0
    while True:
        try:
            at, result, error = responses.get(timeout=timeout)
        except queue.Empty:
            return ttft, None, "".join(text), generated, f"timeout after {timeout} s"
        if error is not None:
            return ttft, at - start, "".join(text), generated, str(error)
        piece = result.as_numpy("text_output")
        if piece is not None:
            ttft = at - start if ttft is None else ttft
            text.append(piece.reshape(-1)[0].decode())
            generated = int(result.as_numpy("generated_tokens").reshape(-1)[0])
        if result.get_response().parameters["triton_final_response"].bool_param:
            return ttft, at - start, "".join(text), generated, None


def run_level(server, grpcclient, concurrency, requests, prompts, max_tokens, chat, reference, timeout):
    rows: list[dict] = []
    lock = threading.Lock()

    def client_loop(i: int) -> None:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((time.perf_counter(), result, error)))
        try:
            for j in range(requests):
                prompt = prompts[(i * requests + j) % len(prompts)]
                ttft, latency, text, generated, error = one_request(
                    client, responses, grpcclient, prompt, max_tokens, chat, f"c{concurrency}-{i}-{j}", timeout)
                wrong = error is None and text != reference[prompt]
                with lock:
                    rows.append(dict(ttft=ttft, latency=latency, generated=generated, error=error, wrong=wrong))
        finally:
            client.stop_stream()
            client.close()

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    good = [r for r in rows if r["error"] is None and not r["wrong"]]
    ttfts = [r["ttft"] for r in good]
    latencies = [r["latency"] for r in good]
    errors = [r["error"] for r in rows if r["error"] is not None]
    return {
        "concurrency": concurrency,
        "requests": len(rows),
        "failed": len(errors),
        "wrong": sum(r["wrong"] for r in rows),
        "wall_seconds": round(wall, 3),
        "requests_per_second": round(len(good) / wall, 3),
        "generated_tokens_per_second": round(sum(r["generated"] for r in good) / wall, 1),
        "ttft_p50_ms": round(1000 * percentile(ttfts, 50), 1),
        "ttft_p95_ms": round(1000 * percentile(ttfts, 95), 1),
        "latency_p50_ms": round(1000 * percentile(latencies, 50), 1),
        "latency_p95_ms": round(1000 * percentile(latencies, 95), 1),
        "first_errors": errors[:3],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "tests" / "fixtures" / "stories260K"),
                   help="checkpoint dir or known name (default: stories260K)")
    p.add_argument("--lookahead_config", "--lookahead-config", dest="lookahead_config", default="4,3,4")
    p.add_argument("--instances", type=int, default=1, help="model instances (one runtime each)")
    p.add_argument("--max-batch", "--max_batch", dest="max_batch", type=int, default=None,
                   help="concurrent requests per instance (default: the largest --concurrency)")
    p.add_argument("--concurrency", default="1,4,8,16", help="comma list of concurrent streams")
    p.add_argument("--requests", type=int, default=4, help="requests per stream at each level")
    p.add_argument("--max-tokens", "--max_tokens", dest="max_tokens", type=int, default=64)
    p.add_argument("--dataset", default=None, help="mt_bench, humaneval, gsm8k or a JSONL path (default: stories)")
    p.add_argument("--limit", type=int, default=8, help="distinct prompts")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template (request parameter)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for one response")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = p.parse_args(argv)

    import torch
    import tritonclient.grpc as grpcclient

    from trt_lookahead.runtime import LookaheadRuntime

    prompts = load_prompts(args.dataset, args.limit)
    levels = [int(c) for c in args.concurrency.split(",")]
    max_batch = args.max_batch or max(levels)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.instances))  # as each server instance does
    reference, alone = {}, []
    with LookaheadRuntime.from_pretrained(args.model, lookahead=args.lookahead_config, max_batch=1) as runtime:
        for prompt in prompts:  # each prompt alone: what every answer under load must equal
            out = runtime.generate(prompt, max_new_tokens=args.max_tokens, chat=args.chat)
            reference[prompt] = out.text
            alone.append(out.prefill_seconds + out.decode_seconds)

    work = Path(tempfile.mkdtemp(prefix="trt-lookahead-load-"))
    write_repository(work / "repo", NAME, model=args.model, lookahead_config=args.lookahead_config,
                     instances=args.instances, max_batch=max_batch)
    server = TritonServer(work / "repo", log=work / "server.log", backend_dir=work / "backends")
    start = time.perf_counter()
    server.start()
    try:
        server.wait_ready(timeout=600)
        ready = time.perf_counter() - start
        run_level(server, grpcclient, 1, 1, prompts, args.max_tokens, args.chat, reference, args.timeout)  # warm-up
        results = []
        for level in levels:
            row = run_level(server, grpcclient, level, args.requests, prompts, args.max_tokens, args.chat,
                            reference, args.timeout)
            results.append(row)
            print(f"concurrency {level}: {json.dumps(row)}", file=sys.stderr, flush=True)
    except Exception:
        print(f"server log tail ({work / 'server.log'}):\n{server.log_tail(40)}", file=sys.stderr)
        server.stop()
        raise
    server.stop()
    shutil.rmtree(work, ignore_errors=True)

    summary = {
        "model": args.model,
        "lookahead_config": args.lookahead_config,
        "instances": args.instances,
        "max_batch": max_batch,
        "threads": torch.get_num_threads(),
        "max_tokens": args.max_tokens,
        "prompts": len(prompts),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "load": [round(x, 2) for x in os.getloadavg()]},
        "server_ready_seconds": round(ready, 1),
        "runtime_alone_latency_p50_ms": round(1000 * statistics.median(alone), 1),
        "results": results,
    }
    header = "| streams | requests | failed | wrong | req/s | tok/s | ttft p50 | ttft p95 | latency p50 | latency p95 |"
    print(header)
    print("|---:" * (header.count("|") - 1) + "|")
    for r in results:
        print(f"| {r['concurrency']} | {r['requests']} | {r['failed']} | {r['wrong']} | {r['requests_per_second']} "
              f"| {r['generated_tokens_per_second']} | {r['ttft_p50_ms']} ms | {r['ttft_p95_ms']} ms "
              f"| {r['latency_p50_ms']} ms | {r['latency_p95_ms']} ms |")
    print(f"server ready in {summary['server_ready_seconds']} s; the runtime alone (in process, same prompts): "
          f"p50 {summary['runtime_alone_latency_p50_ms']} ms per request; load {summary['machine']['load']}")
    if args.json:
        print(json.dumps(summary))
    return 1 if any(r["failed"] or r["wrong"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
