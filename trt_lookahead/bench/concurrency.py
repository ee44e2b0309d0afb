"""`trt-lookahead bench --concurrency 1,4,8,16`: many streams on one runtime (one process, one copy of the
weights), batched greedy against batched `auto` against one request at a time.

    trt-lookahead bench --model smollm2-135m-instruct --dataset humaneval,mt_bench --limit 16 \
        --max-new-tokens 64 --concurrency 1,4,8,16 --out bench-concurrency

For each mode and each concurrency C, C client threads each send --requests requests in turn (closed
loop, stream=True), starting after a seeded random delay of up to 50 ms, prompts dealt round robin in a
seeded order: the same arrival pattern for every mode. Modes:
  greedy   every request greedy, batched by the scheduler
  auto     every request `auto`: the load- and acceptance-aware policy, batched
  serial   every request `auto`, but one at a time (the next waits for the previous): today's
           one-request-at-a-time runtime, on the same weights
With --prefill separate,chunked every (mode, C) runs once per prefill (runtime/scheduler.py), on the same
runtime, the prefills interleaved per level. Per (prefill, mode, C): output tokens/s and requests/s over
the level's wall time, time to first token (from when the client is ready to send: a wait for a slot, or
for the previous request in `serial`, counts) and inter-token latency p50/p95 (a block of k tokens
arriving dt after the previous counts k tokens of dt/k), peak RSS, host ms per request per step and mean
rows per step (from the scheduler), the steps per config the policy chose, and `exact`: the fraction of
answers equal to the greedy mode's for the prompt (measures of docs/design.md section 8).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from trt_lookahead.bench.machine import load_average, machine_info, peak_rss_mb, reset_peak_rss, utc_now
from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import AUTO, GREEDY
from trt_lookahead.lookahead.stepper import Prefill, parse_prefill

if TYPE_CHECKING:
    from trt_lookahead.runtime import LookaheadRuntime

MODES = (GREEDY, AUTO, "serial")
DEFAULT_LEVELS = "1,4,8,16"
SCHEMA_VERSION = 1
MAX_START_DELAY = 0.05  # seconds: each stream starts after a seeded random delay of up to this


def parse_levels(text: str) -> list[int]:
    """`--concurrency 1,4,8,16` -> [1, 4, 8, 16] (positive integers, increasing, no duplicates)."""
    try:
        levels = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise UserError(f"--concurrency takes a comma list of positive integers, e.g. 1,4,8,16; got {text!r}") from None
    if not levels or levels[0] < 1:
        raise UserError(f"--concurrency takes positive integers, e.g. 1,4,8,16; got {text!r}")
    return levels


def parse_modes(text: str) -> list[str]:
    modes = list(dict.fromkeys(t.strip().lower() for t in text.split(",") if t.strip()))
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise UserError(f"--modes: unknown {unknown or text!r}; choose from {', '.join(MODES)}")
    return [m for m in MODES if m in modes]


def parse_prefills(text: str) -> list[Prefill]:
    """`--prefill separate,chunked` -> ["separate", "chunked"] (each `parse_prefill`; no duplicates)."""
    return list(dict.fromkeys(parse_prefill(t) for t in text.split(",") if t.strip())) or [parse_prefill(text)]


@dataclass
class Request:
    """What one request of a level saw, in seconds from when its client was ready to send it."""

    stream: int
    prompt: int  # index into the prompt list
    ttft: float
    latency: float
    tokens: int
    gaps: list[float]  # per emitted token after the first block: its share of the gap before its block
    token_ids: list[int]
    steps: int
    configs: dict[str, int]


@dataclass
class Level:
    mode: str
    prefill: str
    concurrency: int
    requests: int
    seconds: float
    output_tokens: int
    tokens_per_second: float
    requests_per_second: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    itl_p50_ms: float
    itl_p95_ms: float
    peak_rss_mb: float
    host_ms_per_request_step: float
    mean_rows_per_step: float
    compression: float
    exact: float | None  # fraction of answers equal to the greedy mode's answer for the same prompt
    configs: dict[str, int] = field(default_factory=dict)  # decode steps per config (auto: the policy's choice)
    load: list[float] = field(default_factory=list)


def percentile_ms(values: Sequence[float], q: float) -> float:
    """The q-th percentile of `values` (seconds) in milliseconds, rounded to microseconds (NaN when empty)."""
    return round(1000.0 * float(np.percentile(values, q)), 3) if values else float("nan")


def run_level(
    rt: LookaheadRuntime, prompts: Sequence[Sequence[int]], mode: str, concurrency: int, requests: int,
    max_new_tokens: int, seed: int,
) -> tuple[list[Request], float]:
    """C streams x `requests` requests; returns what each request saw and the level's wall seconds."""
    rng = random.Random(seed)
    order = list(range(len(prompts)))
    rng.shuffle(order)
    delays = [rng.uniform(0, MAX_START_DELAY) for _ in range(concurrency)]
    lookahead = GREEDY if mode == GREEDY else AUTO
    one_at_a_time = threading.Lock() if mode == "serial" else None
    seen: list[Request] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def one(stream: int, index: int, start: float) -> Request:
        chunks = rt.stream(list(prompts[index]), max_new_tokens, lookahead=lookahead)
        ttft, last, gaps, ids = None, start, [], []
        output = None
        for chunk in chunks:
            now = time.perf_counter()
            if chunk.token_ids:
                if ttft is None:
                    ttft = now - start
                else:
                    gaps.extend([(now - last) / len(chunk.token_ids)] * len(chunk.token_ids))
                last = now
                ids.extend(chunk.token_ids)
            output = chunk.output or output
        assert output is not None and ttft is not None
        return Request(stream, index, ttft, time.perf_counter() - start, len(output.token_ids), gaps,
                       output.token_ids, output.steps, dict(output.stats.configs))

    def client(stream: int) -> None:
        time.sleep(delays[stream])
        for j in range(requests):
            index = order[(stream * requests + j) % len(order)]
            start = time.perf_counter()  # serial: the wait for the previous request counts, as in a queue
            try:
                if one_at_a_time is None:
                    got = one(stream, index, start)
                else:
                    with one_at_a_time:
                        got = one(stream, index, start)
            except BaseException as exc:  # report after the level; the other streams go on
                with lock:
                    errors.append(exc)
                return
            with lock:
                seen.append(got)

    threads = [threading.Thread(target=client, args=(s,), name=f"stream {s}") for s in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return seen, time.perf_counter() - started


def run_concurrency(
    rt: LookaheadRuntime, prompts: Sequence[Sequence[int]], *, levels: Sequence[int], modes: Sequence[str],
    requests: int, max_new_tokens: int, seed: int = 0, progress: bool = True, prefills: Sequence[Prefill] = (),
) -> dict[str, Any]:
    """Every (prefill, mode, level), interleaved per level; the `bench --concurrency --json` object.

    prefills: the scheduler's prefill for each run of a level (default: the runtime's own)."""
    if max(levels) > rt.max_batch and any(m != "serial" for m in modes):
        raise UserError(f"--concurrency {max(levels)} exceeds the runtime's max_batch {rt.max_batch}")
    result: dict[str, Any] = {
        "schema": SCHEMA_VERSION, "kind": "concurrency", "model": str(rt.model_path), "dtype": rt.dtype,
        "backend": rt.backend, "exact_step": rt.exact,
        "tree": None if rt.tree is None else str(rt.tree), "machine": machine_info(), "date": utc_now(),
        "max_new_tokens": max_new_tokens, "requests_per_stream": requests, "prompts": len(prompts),
        "max_batch": rt.max_batch, "levels": [],
    }
    if AUTO in modes or "serial" in modes:
        result["auto_up_to"] = rt.auto.ceiling.label
    rt.generate(list(prompts[0]), min(8, max_new_tokens), lookahead=GREEDY)  # warm-up
    reference: dict[int, list[int]] = {}
    runs = [(prefill, mode) for prefill in (prefills or [rt.scheduler.prefill]) for mode in modes]
    for concurrency in levels:
        for prefill, mode in runs:
            rt.scheduler.prefill = prefill  # between levels: nothing is in flight
            stats = rt.scheduler.stats
            steps, rows = stats.steps, stats.rows
            host = stats.step_seconds - stats.executor_seconds
            reset_peak_rss()
            load = load_average()
            seen, seconds = run_level(rt, prompts, mode, concurrency, requests, max_new_tokens, seed + concurrency)
            stats = rt.scheduler.stats
            d_steps, d_rows = stats.steps - steps, stats.rows - rows
            d_host = stats.step_seconds - stats.executor_seconds - host
            if mode == GREEDY:
                for r in seen:
                    reference.setdefault(r.prompt, r.token_ids)
            checked = [r.token_ids == reference[r.prompt] for r in seen if r.prompt in reference]
            configs: dict[str, int] = {}
            for r in seen:
                for label, n in r.configs.items():
                    configs[label] = configs.get(label, 0) + n
            tokens = sum(r.tokens for r in seen)
            level = Level(
                mode=mode, prefill=str(prefill), concurrency=concurrency, requests=len(seen), seconds=round(seconds, 3),
                output_tokens=tokens, tokens_per_second=round(tokens / seconds, 3),
                requests_per_second=round(len(seen) / seconds, 4),
                ttft_p50_ms=percentile_ms([r.ttft for r in seen], 50),
                ttft_p95_ms=percentile_ms([r.ttft for r in seen], 95),
                itl_p50_ms=percentile_ms([g for r in seen for g in r.gaps], 50),
                itl_p95_ms=percentile_ms([g for r in seen for g in r.gaps], 95),
                peak_rss_mb=round(peak_rss_mb(), 1),
                host_ms_per_request_step=round(1000.0 * d_host / d_rows, 4) if d_rows else 0.0,
                mean_rows_per_step=round(d_rows / d_steps, 3) if d_steps else 0.0,
                compression=round(tokens / sum(r.steps for r in seen), 4) if seen else 0.0,
                exact=round(sum(checked) / len(checked), 4) if checked else None,
                configs=dict(sorted(configs.items())), load=load,
            )
            result["levels"].append(asdict(level))
            if progress:
                print(f"bench: {mode:>6} {prefill!s:>8} x{concurrency:<3} {level.tokens_per_second:8.1f} tok/s "
                      f"{level.requests_per_second:6.3f} req/s  ttft p50 {level.ttft_p50_ms:.0f} ms  "
                      f"itl p50 {level.itl_p50_ms:.1f} ms  rows/step {level.mean_rows_per_step:.2f}  "
                      f"load {load[0] if load else '?'}", flush=True)
    result["load_end"] = load_average()
    return result


def format_concurrency_markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"{result['model']} ({result['dtype']}, {result['backend']}), {m.get('cpu')} x{m.get('cpus')}, "
        f"{m.get('threads')} torch threads, {result['date']}, max_batch {result['max_batch']}, "
        f"{result['requests_per_stream']} requests per stream x {result['max_new_tokens']} new tokens at most, "
        f"auto up to {result.get('auto_up_to', '-')}, load {m.get('load')} -> {result.get('load_end')}",
        "",
        "| mode | prefill | streams | tok/s | req/s | TTFT p50 / p95 ms | ITL p50 / p95 ms | rows/step | compression "
        "| host ms/req/step | peak RSS MB | exact | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["levels"]:
        exact = "-" if r["exact"] is None else f"{r['exact']:.2f}"
        lines.append(
            f"| {r['mode']} | {r['prefill']} | {r['concurrency']} | {r['tokens_per_second']:.1f} | "
            f"{r['requests_per_second']:.3f} | "
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p95_ms']:.0f} | {r['itl_p50_ms']:.1f} / {r['itl_p95_ms']:.1f} | "
            f"{r['mean_rows_per_step']:.2f} | {r['compression']:.2f} | {r['host_ms_per_request_step']:.3f} | "
            f"{r['peak_rss_mb']:.0f} | {exact} | {r['load'][0] if r['load'] else '?'} |"
        )
    ratios = _ratios(result)
    if ratios:
        lines += ["", ratios]
    return "\n".join(lines)


def _ratios(result: dict[str, Any]) -> str:
    """auto / greedy and greedy, auto / serial tokens per second, per concurrency (and prefill, if several)."""
    by = {(r["prefill"], r["mode"], r["concurrency"]): r["tokens_per_second"] for r in result["levels"]}
    prefills = list(dict.fromkeys(r["prefill"] for r in result["levels"]))
    parts = []
    for c, p in ((c, p) for c in sorted({r["concurrency"] for r in result["levels"]}) for p in prefills):
        g, a, s = by.get((p, GREEDY, c)), by.get((p, AUTO, c)), by.get((p, "serial", c))
        items = []
        if a and g:
            items.append(f"auto/greedy {a / g:.2f}")
        if s and g:
            items.append(f"greedy/serial {g / s:.2f}")
        if s and a:
            items.append(f"auto/serial {a / s:.2f}")
        if items:
            parts.append(f"{c} streams{f' ({p} prefill)' if len(prefills) > 1 else ''}: " + ", ".join(items))
    return "; ".join(parts)
