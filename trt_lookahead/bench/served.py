"""`trt-lookahead bench --peers llama-server`: our `serve` and llama.cpp's `llama-server` side by side over the
same OpenAI API, on the same weights, prompts, threads and slots.

    trt-lookahead bench --model smollm2-135m-instruct --dataset humaneval,mt_bench --limit 8 \
        --max-new-tokens 128 --peers llama-server --llama-spec ngram-map-k --concurrency 1,8 --threads 2

    plan = plan_bench("smollm2-135m-instruct", datasets="humaneval,mt_bench", limit=8, max_new_tokens=128)
    setup = ServedSetup(levels=[1, 8], threads=2, dtype="float32", llama_server=find_llama_server(None),
                        specs=["ngram-map-k"])
    result = run_served(plan, setup)                  # the "served" object of `bench --json`
    print(format_served_markdown(result))

The servers run one at a time on 127.0.0.1 (a free port each), with the same threads and slots (= the largest
--concurrency): llama-server on a GGUF of the checkpoint in the run's dtype (servers.cached_gguf; the same
numbers our runtime holds) or on the one given (`--llama-gguf`, with `--weights`: llama.cpp's quantized file
beside our quantized engine, `serve --weights`), plain and once per n-gram --spec-type in --llama-spec; then
our `serve` (`auto` served), whose rows are `ours greedy` (`"lookahead": false`) and `ours auto`, interleaved per
level and set.
llama-server runs first, so a broken binary fails before minutes of our rows.

Every request is a streamed `/v1/completions` with the prompt as token ids (the bench sets' ids: raw prompts,
and chat prompts already through our chat template, so the template and tokenizer are ours for both servers;
llama-server takes a token-id array as `prompt`, tools/server/server-common.cpp tokenize_input_prompts),
temperature 0, the same max_tokens, stopping at the model's eos; llama-server also gets `cache_prompt: false`
(its KV prefix reuse would otherwise serve repeated prompts from cache). Per (server row, set, level), after one
warm-up request per server: each prompt once from N client threads in a closed loop (openai_stream.run_level);
output tok/s = the servers' usage.completion_tokens / the level's wall time, TTFT p50, ITL p50/p95 (per request:
(last chunk - first text) / (tokens - 1)), and greedy agreement with `ours greedy` at the first level.

Token ids for agreement: neither server's OpenAI stream carries them (llama-server's partial chunks send text
only; its `tokens` come only outside the OpenAI format, with `"verbose": true` one id per partial, skipping the
tokens held back while a UTF-8 character is incomplete, and `return_tokens` leaves a stream's final `tokens`
empty), so every row's answer text is encoded with our tokenizer (no special tokens added): `identical` is the
fraction of prompts whose ids equal ours greedy's (= identical text), `prefix` the mean over prompts of the
common prefix over the longer answer's length.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trt_lookahead.backends.cpu_load import usable_cpus
from trt_lookahead.bench.concurrency import percentile_ms
from trt_lookahead.bench.machine import load_average, machine_info, utc_now
from trt_lookahead.bench.openai_stream import Answer, StreamError, stream_completion
from trt_lookahead.bench.openai_stream import run_level as run_stream_level
from trt_lookahead.bench.servers import (
    BUILD_HINT,
    LLAMA_SERVER,
    START_TIMEOUT,
    ServerProcess,
    cached_gguf,
    llama_server_argv,
    log_tail,
    serve_argv,
)
from trt_lookahead.errors import UserError
from trt_lookahead.files import free_port
from trt_lookahead.lookahead.config import AUTO, GREEDY

if TYPE_CHECKING:
    from trt_lookahead.bench.bench import BenchPlan

SCHEMA_VERSION = 1
OURS = "ours"
TOKEN_IDS_FROM = "our tokenizer on each row's streamed text (no OpenAI stream carries token ids)"
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class ServedSetup:
    """How the servers run: levels (client threads at once), threads, dtype, the llama-server binary and the
    --spec-type values it runs with (besides plain)."""

    levels: list[int]
    threads: int
    dtype: str
    llama_server: Path
    specs: list[str] = field(default_factory=list)
    serve_extra: tuple[str, ...] = ()  # more `serve` arguments (--backend, --tuning-file, --weights)
    gguf: Path | None = None  # the GGUF llama-server runs (None: servers.cached_gguf of the checkpoint in dtype)
    start_timeout: float = START_TIMEOUT

    @property
    def slots(self) -> int:
        return max(self.levels)


@dataclass
class Run:
    """One (server row, set, level): its answers and wall seconds."""

    row: str
    dataset: str
    level: int
    answers: list[Answer]
    seconds: float
    load: list[float]


def llama_row(spec: str | None) -> str:
    return f"{LLAMA_SERVER} --spec-type {spec}" if spec else LLAMA_SERVER


def _measure(server: ServerProcess, rows: dict[str, dict[str, Any]], plan: BenchPlan,
             levels: Sequence[int]) -> list[Run]:
    """Every level x set x row on one server (rows: name -> request fields), rows interleaved per set; a refused
    or broken request is a UserError naming the server, with its log's last lines."""
    try:
        return _measure_rows(server.url, rows, plan, levels)
    except (StreamError, OSError) as exc:
        raise UserError(f"{server.name} failed a request ({exc}); last lines of {server.log}:\n"
                        f"{log_tail(server.log)}") from None


def _measure_rows(url: str, rows: dict[str, dict[str, Any]], plan: BenchPlan, levels: Sequence[int]) -> list[Run]:
    runs = []
    first = next(iter(plan.prompts.values()))[0]
    for body in rows.values():  # warm-up: first-call costs out of the first level
        stream_completion(url, {**body, "prompt": list(first), "max_tokens": WARMUP_TOKENS})
    for level in levels:
        for dataset, prompts in plan.prompts.items():
            for name, body in rows.items():
                load = load_average()
                answers, seconds = run_stream_level(url, prompts, level, {**body, "max_tokens": plan.max_new_tokens})
                runs.append(Run(name, dataset, level, answers, seconds, load))
    return runs


def run_served(plan: BenchPlan, setup: ServedSetup, log_dir: Path | None = None,
               progress: bool = True) -> dict[str, Any]:
    """Start each server in turn, measure it, stop it; returns the `served` result object."""
    common = {"temperature": 0.0, "seed": 0}
    per_slot = plan.max_seq_len or 4096
    logs = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="trt-lookahead-served-"))
    machine = machine_info(threads=setup.threads)
    gguf = setup.gguf or cached_gguf(plan.model_path, setup.dtype)
    runs: list[Run] = []
    servers: list[dict[str, Any]] = []
    started = time.perf_counter()
    for spec in [None, *setup.specs]:
        name = llama_row(spec)
        port = free_port()
        argv = llama_server_argv(setup.llama_server, gguf, port, setup.threads, setup.slots,
                                 setup.slots * per_slot, spec)
        with ServerProcess(name, argv, port, logs, hint=f"check the binary, or {BUILD_HINT}",
                           start_timeout=setup.start_timeout) as server:
            if progress:
                print(f"bench: {name} on {server.url} (log {server.log})", file=sys.stderr, flush=True)
            runs += _measure(server, {name: {**common, "cache_prompt": False}}, plan,
                             setup.levels)
        servers.append({"row": name, "argv": argv, "log": str(server.log)})
    port = free_port()
    argv = serve_argv(plan.model_path, port, setup.threads, setup.slots, setup.dtype, plan.max_seq_len,
                      setup.serve_extra)
    with ServerProcess("trt-lookahead serve", argv, port, logs, hint="see its log",
                       start_timeout=setup.start_timeout) as server:
        if progress:
            print(f"bench: trt-lookahead serve on {server.url} (log {server.log})", file=sys.stderr, flush=True)
        model = plan.model_path.name
        rows = {f"{OURS} {GREEDY}": {**common, "model": model, "lookahead": False},
                f"{OURS} {AUTO}": {**common, "model": model, "lookahead": True}}
        runs += _measure(server, rows, plan, setup.levels)
    servers.append({"row": f"{OURS} {GREEDY}, {OURS} {AUTO}", "argv": argv, "log": str(server.log)})

    order = [llama_row(s) for s in [None, *setup.specs]]
    rank = {name: k for k, name in enumerate([f"{OURS} {GREEDY}", f"{OURS} {AUTO}", *order])}
    names = list(plan.prompts)
    runs.sort(key=lambda r: (r.level, names.index(r.dataset), rank[r.row]))
    return {
        "schema": SCHEMA_VERSION, "kind": "served", "model": str(plan.model_path), "dtype": setup.dtype,
        "threads": setup.threads, "slots": setup.slots, "levels": setup.levels, "datasets": names,
        "max_new_tokens": plan.max_new_tokens, "limit": plan.limit, "gguf": str(gguf),
        "serve_extra": list(setup.serve_extra), "servers": servers,
        "token_ids": TOKEN_IDS_FROM, "machine": machine, "load_end": load_average(), "date_end": utc_now(),
        "elapsed_seconds": round(time.perf_counter() - started, 2),
        "rows": aggregate_served(runs, _encoder(plan.model_path)),
    }


def _encoder(model: Path) -> Any:
    from trt_lookahead.model.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(model)
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> float:
    """Length of the common prefix over the longer sequence's length (1.0 for two empty ones)."""
    longest = max(len(a), len(b))
    if not longest:
        return 1.0
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n / longest


def aggregate_served(runs: Sequence[Run], encode: Any) -> list[dict[str, Any]]:
    """One row per run with the measures (module docstring); agreement against `ours greedy` at the first level."""
    reference_level = min((r.level for r in runs), default=0)
    reference = {(r.dataset, a.prompt): encode(a.text) for r in runs
                 if r.row == f"{OURS} {GREEDY}" and r.level == reference_level for a in r.answers}
    rows = []
    for r in runs:
        ids = [(encode(a.text), reference.get((r.dataset, a.prompt))) for a in r.answers]
        known = [(got, ref) for got, ref in ids if ref is not None]
        tokens = sum(a.tokens for a in r.answers)
        itls = [itl for a in r.answers if (itl := a.itl) is not None]
        rows.append({
            "server": r.row, "dataset": r.dataset, "streams": r.level, "prompts": len(r.answers),
            "output_tokens": tokens, "seconds": round(r.seconds, 3),
            "tokens_per_second": round(tokens / r.seconds, 2) if r.seconds > 0 else None,
            "ttft_p50_ms": percentile_ms([a.ttft for a in r.answers], 50),
            "itl_p50_ms": percentile_ms(itls, 50), "itl_p95_ms": percentile_ms(itls, 95),
            "identical": round(sum(got == ref for got, ref in known) / len(known), 4) if known else None,
            "prefix": round(sum(common_prefix(got, ref) for got, ref in known) / len(known), 4) if known else None,
            "finish_reasons": {f: sum(a.finish_reason == f for a in r.answers) for f in
                               sorted({a.finish_reason for a in r.answers})},
            "load": r.load,
        })
    return rows


def format_served_markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    ours = " ".join([result["dtype"], *result.get("serve_extra", [])])  # e.g. "float32 --weights int4"
    lines = [
        f"**Served over the OpenAI API**: {Path(result['model']).name}, {ours} "
        f"(llama-server: {Path(result['gguf']).name}), "
        f"{result['threads']} threads and {result['slots']} slots each, "
        f"{result['max_new_tokens']} new tokens max, streaming, temperature 0, one server at a time; "
        f"{m.get('cpu')} ({m.get('cpus')} cpus), load {m.get('load')} at start, {result.get('load_end')} at end.",
        "",
        "| server | dataset | streams | prompts | tokens | tok/s | TTFT p50 ms | ITL p50 / p95 ms "
        "| identical to ours greedy | common prefix | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(value: Any, digits: int) -> str:
        return "-" if value is None or value != value else f"{value:.{digits}f}"

    for r in result["rows"]:
        lines.append(
            f"| {r['server']} | {r['dataset']} | {r['streams']} | {r['prompts']} | {r['output_tokens']} "
            f"| {f(r['tokens_per_second'], 1)} | {f(r['ttft_p50_ms'], 0)} "
            f"| {f(r['itl_p50_ms'], 1)} / {f(r['itl_p95_ms'], 1)} | {f(r['identical'], 2)} | {f(r['prefix'], 2)} "
            f"| {r['load'][0] if r['load'] else '-'} |"
        )
    lines += [
        "",
        f"tok/s = completion tokens (the servers' usage) / the level's wall time, N client threads in a closed "
        f"loop; TTFT = send to first text; ITL = per request (last chunk - first text) / (tokens - 1). Agreement "
        f"with `ours greedy` at {min(result['levels'])} stream(s): token ids from {result['token_ids']}; identical "
        f"= fraction of prompts, common prefix = mean over prompts of the common prefix / the longer answer.",
    ]
    return "\n".join(lines)


def default_threads() -> int:
    """Threads for both servers when --threads is not given: every CPU this process may use."""
    return usable_cpus()
