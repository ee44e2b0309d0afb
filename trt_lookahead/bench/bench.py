"""`trt-lookahead bench`: greedy and lookahead side by side on prompt sets, one process, one machine.

    plan = plan_bench("smollm2-135m-instruct", datasets="mt_bench,humaneval", configs="greedy,auto,15/5/15")
    opener = lambda: LookaheadRuntime.from_pretrained(plan.model_path, lookahead=None, max_seq_len=plan.max_seq_len)
    result = run_bench(opener, plan)     # the `bench --json` object; write_outputs(result, "bench-out")

Per dataset, every prompt runs every config back to back (greedy first on even prompts, last on odd
ones) after one warm-up generation per config, so load drift hits all configs alike. All methods get
the same token ids (raw `prompt` text, or turn 1 / `question` through the chat template) and stop at
the model's eos ids. Greedy always runs: it is the reference for `speedup` and `exact`.

Measures (docs/design.md section 8), per (dataset, config) row:
  compression       generated tokens / steps (steps include the prefill's forward pass, so greedy = 1.0)
  speedup           greedy decode time per token / this row's (= greedy decode seconds / lookahead decode
                    seconds when the outputs are identical); speedup_median is the median over prompts
  exact             fraction of prompts whose token ids equal greedy's (same executor and dtype)
  host_ms_per_step  (decode seconds - seconds inside executor calls) / decode steps
  tokens_per_second tokens emitted by decode steps / decode seconds (the prefill's token is prefill time)
  peak_rss_mb       the largest process peak RSS over the row's generate calls (reset before each call)
  ms_per_step       median over prompts of decode seconds per decode step (for the step latency plot)
Peers (--peers): transformers' LlamaForCausalLM `generate` on the same checkpoint, greedy
(`hf-greedy`) and prompt lookup with 10 drafted tokens (`hf-prompt-lookup`); steps = forward calls
counted by a subclass of LlamaForCausalLM, exact = against our greedy ids; they run after our rows
(our runtime closed first) and carry speedup_vs_hf_greedy too.

Outputs: a Markdown table on stdout (or, with --json, one JSON object on the last line); with --out DIR
also results.json, results.md and PNG plots (see trt_lookahead.bench.plots).
"""

from __future__ import annotations

import gc
import json
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trt_lookahead.bench.datasets import Dataset, dataset_names, encode_row, load_dataset
from trt_lookahead.bench.machine import (
    load_average,
    machine_info,
    peak_rss_mb,
    read_bandwidth_gbps,
    reset_peak_rss,
    utc_now,
)
from trt_lookahead.bench.peers import PEERS, HFPeers, describe
from trt_lookahead.bench.servers import LLAMA_SERVER
from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import AUTO, GREEDY, Lookahead, LookaheadConfig
from trt_lookahead.model.checkpoint import weight_bytes

if TYPE_CHECKING:
    from trt_lookahead.runtime import GenerationOutput, LookaheadRuntime

DEFAULT_CONFIGS = "greedy,auto,4/3/4,7/5/7,15/5/15"  # greedy, the default (auto), and fixed configs
SCHEMA_VERSION = 1


# ---------------------------------------------------------------------------------------------
# what to run


@dataclass(frozen=True)
class ConfigSpec:
    """One `--configs` entry: its label, and the config it runs."""

    label: str  # "greedy", "W/N/G" or "auto"
    lookahead: Lookahead  # as the runtime narrowed it: for auto, up to the largest config the policy may use

    @property
    def resolved(self) -> str:
        ceiling = self.lookahead.ceiling.label
        return f"{AUTO} (up to {ceiling})" if self.lookahead.auto else ceiling

    @property
    def step_tokens(self) -> int:
        return self.lookahead.ceiling.step_tokens


def parse_configs(text: str) -> list[str]:
    """Validate a `--configs` list (greedy, W/N/G, auto); returns labels, greedy first, no duplicates."""
    labels: list[str] = []
    for raw in re.findall(r"\[[^\]]*\]|[^,]+", text):  # entries split on commas outside [W,N,G]
        item = raw.strip()
        if not item:
            continue
        low = item.lower()
        if low in (GREEDY, AUTO):
            labels.append(low)
            continue
        try:
            cfg = LookaheadConfig.parse(item)
        except ValueError as exc:
            raise UserError(f"--configs entry {item!r}: {exc}; entries are greedy, auto or W/N/G") from None
        labels.append(cfg.label)
    labels = list(dict.fromkeys(labels))
    if not labels:
        raise UserError("--configs is empty; give e.g. greedy,4/3/4,auto")
    return [GREEDY] + [label for label in labels if label != GREEDY]


def parse_peers(text: str | None) -> list[str]:
    """`--peers`: the in-process transformers peers (peers.PEERS) and llama-server (served.py, over HTTP)."""
    known = (*PEERS, LLAMA_SERVER)
    peers = list(dict.fromkeys(p.strip().lower() for p in (text or "").split(",") if p.strip()))
    unknown = [p for p in peers if p not in known]
    if unknown:
        raise UserError(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return peers


# ---------------------------------------------------------------------------------------------
# one generation, and rows out of many


@dataclass
class RunRecord:
    """One generation of one prompt by one config (or peer)."""

    dataset: str
    prompt_index: int
    prompt_id: str
    config: str  # label: greedy, W/N/G, auto, hf-greedy, hf-prompt-lookup
    resolved: str  # what actually ran: greedy, W/N/G, or the peer's description
    T: int | None  # tokens per step (None for peers)
    prompt_tokens: int
    generated_tokens: int
    steps: int  # forward passes that emitted tokens, the prefill's included
    decode_seconds: float
    prefill_seconds: float = 0.0
    executor_seconds: float | None = None
    peak_rss_mb: float | None = None
    accepted_histogram: dict[str, int] = field(default_factory=dict)
    finish_reason: str = ""
    exact: bool | None = None  # token ids == greedy's
    decoded_tokens: int | None = None  # tokens emitted after the first forward pass (default generated - 1)
    token_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def decoded(self) -> int:
        return self.decoded_tokens if self.decoded_tokens is not None else max(self.generated_tokens - 1, 0)

    @property
    def decode_steps(self) -> int:
        return max(self.steps - 1, 0)

    @property
    def ms_per_token(self) -> float | None:
        return 1000.0 * self.decode_seconds / self.decoded if self.decoded and self.decode_seconds > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "prompt_index": self.prompt_index,
            "prompt_id": self.prompt_id,
            "config": self.config,
            "resolved": self.resolved,
            "T": self.T,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "steps": self.steps,
            "compression": _round(self.generated_tokens / self.steps if self.steps else None),
            "decode_seconds": _round(self.decode_seconds, 6),
            "prefill_seconds": _round(self.prefill_seconds, 6),
            "executor_seconds": _round(self.executor_seconds, 6),
            "peak_rss_mb": _round(self.peak_rss_mb, 1),
            "accepted_histogram": self.accepted_histogram,
            "finish_reason": self.finish_reason,
            "exact": self.exact,
        }


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(float(value), digits)


def _median(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def mark_exact(records: Sequence[RunRecord]) -> None:
    """Set `exact` on every non-greedy record: token ids equal to greedy's for the same prompt."""
    greedy = {(r.dataset, r.prompt_index): r.token_ids for r in records if r.config == GREEDY}
    for r in records:
        if r.config == GREEDY:
            r.exact = True
        else:
            ref = greedy.get((r.dataset, r.prompt_index))
            r.exact = None if ref is None else list(r.token_ids) == list(ref)


def aggregate(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """One row per (dataset, config) in first-seen order, with the measures of docs/design.md section 8."""
    groups: dict[tuple[str, str], list[RunRecord]] = {}
    for r in records:
        groups.setdefault((r.dataset, r.config), []).append(r)
    greedy_by_prompt = {(r.dataset, r.prompt_index): r for r in records if r.config == GREEDY}
    hf_greedy_by_prompt = {(r.dataset, r.prompt_index): r for r in records if r.config == "hf-greedy"}
    rows = []
    for (dataset, label), recs in groups.items():
        generated = sum(r.generated_tokens for r in recs)
        steps = sum(r.steps for r in recs)
        decoded = sum(r.decoded for r in recs)
        decode_s = sum(r.decode_seconds for r in recs)
        hist: Counter = Counter()
        for r in recs:
            hist.update({str(k): int(v) for k, v in r.accepted_histogram.items()})
        ours = recs[0].T is not None
        host = None
        if ours and all(r.executor_seconds is not None for r in recs):
            decode_steps = sum(r.decode_steps for r in recs)
            inside = sum(r.executor_seconds or 0.0 for r in recs)
            host = 1000.0 * (decode_s - inside) / decode_steps if decode_steps else None
        row: dict[str, Any] = {
            "dataset": dataset,
            "config": label,
            "resolved": recs[0].resolved,
            "kind": "ours" if ours else "peer",
            "T": recs[0].T,
            "prompts": len(recs),
            "generated_tokens": generated,
            "steps": steps,
            "compression": _round(generated / steps if steps else None),
            "decode_seconds": _round(decode_s, 4),
            "tokens_per_second": _round(decoded / decode_s if decode_s > 0 else None, 3),
            "speedup": _round(_speedup(greedy_by_prompt, recs)),
            "speedup_median": _round(_median_speedup(greedy_by_prompt, recs)),
            "exact": _round(_fraction([r.exact for r in recs])),
            "exact_prompts": sum(1 for r in recs if r.exact),
            "host_ms_per_step": _round(host, 4),
            "peak_rss_mb": _round(max((r.peak_rss_mb or 0.0) for r in recs) or None, 1),
            "ms_per_step": _round(
                _median([1000.0 * r.decode_seconds / r.decode_steps for r in recs if r.decode_steps]), 3
            ),
            "prefill_seconds": _round(sum(r.prefill_seconds for r in recs), 4),
            "accepted_histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
        }
        if label == "hf-prompt-lookup":
            row["speedup_vs_hf_greedy"] = _round(_speedup(hf_greedy_by_prompt, recs))
        rows.append(row)
    return rows


def _fraction(flags: Sequence[bool | None]) -> float | None:
    known = [f for f in flags if f is not None]
    return sum(known) / len(known) if known else None


def _speedup(reference: dict[tuple[str, int], RunRecord], recs: Sequence[RunRecord]) -> float | None:
    """Reference decode time per token over this group's, summed over the prompts both have."""
    pairs = [(g, r) for r in recs if (g := reference.get((r.dataset, r.prompt_index))) and g.decoded and r.decoded]
    g_s, g_t = sum(g.decode_seconds for g, _ in pairs), sum(g.decoded for g, _ in pairs)
    r_s, r_t = sum(r.decode_seconds for _, r in pairs), sum(r.decoded for _, r in pairs)
    if not pairs or g_s <= 0 or r_s <= 0:
        return None
    return (g_s / g_t) / (r_s / r_t)


def _median_speedup(reference: dict[tuple[str, int], RunRecord], recs: Sequence[RunRecord]) -> float | None:
    ratios = []
    for r in recs:
        g = reference.get((r.dataset, r.prompt_index))
        if g is not None and g.ms_per_token and r.ms_per_token:
            ratios.append(g.ms_per_token / r.ms_per_token)
    return _median(ratios)


# ---------------------------------------------------------------------------------------------
# the Markdown table


def _f(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    load = "/".join(f"{x:.2f}" for x in m.get("load") or [])
    load_end = "/".join(f"{x:.2f}" for x in result.get("load_end") or [])
    weights = result.get("weights", "float")  # results written before it was recorded: float
    lines = [
        f"**{Path(str(result['model'])).name}**, backend {result['backend']}, {result['dtype']}, "
        f"{'' if weights == 'float' else f'{weights} weights, '}"
        f"{result['max_new_tokens']} new tokens max, {result.get('limit')} prompts per set",
        "",
        f"Machine: {m.get('cpu')} ({m.get('cpus')} cpus), {m.get('threads')} threads, load average {load} at start, "
        f"{load_end} at end; {m.get('date')}.",
        "",
        "| dataset | config | T | prompts | tokens | steps | compression | tok/s | speedup (median) | exact "
        "| host ms/step | ms/step | peak RSS MB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["results"]:
        config = f"{r['config']} = {r['resolved']}" if r["config"] == AUTO else r["config"]
        exact = "-" if r["exact"] is None else f"{r['exact_prompts']}/{r['prompts']}"
        speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f} ({_f(r['speedup_median'])})"
        lines.append(
            f"| {r['dataset']} | {config} | {_f(r['T'])} | {r['prompts']} | {r['generated_tokens']} | {r['steps']} "
            f"| {_f(r['compression'])} | {_f(r['tokens_per_second'], 1)} | {speed} | {exact} "
            f"| {_f(r['host_ms_per_step'])} | {_f(r['ms_per_step'], 1)} | {_f(r['peak_rss_mb'], 0)} |"
        )
    limit = result.get("memory_limit")
    if limit:
        ratios = ", ".join(f"{r['dataset']} {r['ms_per_step'] / limit['ms_per_step']:.2f}x" for r in result["results"]
                           if r["config"] == GREEDY and r["ms_per_step"])
        lines += ["", f"Memory limit: {limit['weight_mb']:.0f} MB of weights / {limit['read_gbps']:.1f} GB/s read = "
                      f"{limit['ms_per_step']:.1f} ms per step; greedy ms/step over it: {ratios or '-'}."]
    lines += [
        "",
        "compression = generated tokens / forward passes (prefill included); speedup = greedy decode time per "
        "token / this row's, same prompts, interleaved per prompt (median over prompts in brackets); exact = "
        "prompts whose token ids equal our greedy's; peak RSS = process peak during the row's calls.",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# running


def _runtime_generate(rt: LookaheadRuntime, ids: Sequence[int], max_new_tokens: int,
                      spec: ConfigSpec) -> GenerationOutput:
    return rt.generate(list(ids), max_new_tokens=max_new_tokens, lookahead=spec.lookahead)


def run_ours(
    rt: LookaheadRuntime,
    spec: ConfigSpec,
    dataset: str,
    index: int,
    prompt_id: str,
    ids: Sequence[int],
    max_new_tokens: int,
) -> RunRecord:
    reset_peak_rss()
    out = _runtime_generate(rt, ids, max_new_tokens, spec)
    peak = peak_rss_mb()
    stats = out.stats
    return RunRecord(
        dataset=dataset,
        prompt_index=index,
        prompt_id=prompt_id,
        config=spec.label,
        resolved=spec.resolved,
        T=spec.step_tokens,
        prompt_tokens=len(ids),
        generated_tokens=out.generated_tokens,
        steps=out.steps,
        decode_seconds=float(stats.decode_seconds),
        prefill_seconds=float(stats.prefill_seconds),
        executor_seconds=float(stats.executor_seconds),
        peak_rss_mb=peak,
        accepted_histogram={str(k): int(v) for k, v in sorted(stats.accepted_histogram.items())},
        finish_reason=out.finish_reason,
        token_ids=list(out.token_ids),
    )


def run_peer(
    peers: HFPeers, peer: str, dataset: str, index: int, prompt_id: str, ids: Sequence[int], max_new_tokens: int
) -> RunRecord:
    reset_peak_rss()
    res = peers.generate(ids, max_new_tokens, peer)
    tokens = res["token_ids"]
    return RunRecord(
        dataset=dataset,
        prompt_index=index,
        prompt_id=prompt_id,
        config=peer,
        resolved=describe(peer),
        T=None,
        prompt_tokens=len(ids),
        generated_tokens=len(tokens),
        steps=res["steps"],
        decode_seconds=res["decode_seconds"],
        prefill_seconds=res["prefill_seconds"],
        peak_rss_mb=peak_rss_mb(),
        finish_reason="stop" if tokens and tokens[-1] in peers.stop else "length",
        decoded_tokens=res["decoded_tokens"],
        token_ids=tokens,
    )


def _progress(total: int, enabled: bool = True) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, file=sys.stderr, unit="run", dynamic_ncols=True, mininterval=0.5, disable=not enabled)


def _seq_len_for(prompts: Sequence[Sequence[int]], max_new_tokens: int, model_path: Path) -> int | None:
    """KV length that holds the longest prompt plus the generation (rounded up to 256), within the model's."""
    need = max(len(p) for p in prompts) + max_new_tokens
    size = -(-need // 256) * 256
    try:
        limit = json.loads((model_path / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        limit = None
    if limit and need > limit:
        raise UserError(
            f"the longest prompt ({max(len(p) for p in prompts)} tokens) + --max-new-tokens {max_new_tokens} "
            f"exceeds the model's context of {limit}; lower --max-new-tokens or --limit the set"
        )
    return min(size, limit) if limit else size


@dataclass(frozen=True)
class BenchPlan:
    """What a bench runs, validated and encoded before any model is loaded (`plan_bench`)."""

    model_path: Path
    model_name: str
    sets: tuple[Dataset, ...]
    prompts: dict[str, list[list[int]]]  # dataset name -> token ids of its rows
    labels: list[str]  # greedy first, then W/N/G and auto
    peers: list[str]  # the in-process peers (transformers); llama-server is served.py's
    max_new_tokens: int
    limit: int | None
    max_seq_len: int | None  # for the runtime: the longest prompt + max_new_tokens (None: an engine's)

    @property
    def widest(self) -> LookaheadConfig | None:
        """The smallest config every explicit W/N/G entry fits (None: greedy and auto only)."""
        configs = [LookaheadConfig.parse(label) for label in self.labels if label not in (GREEDY, AUTO)]
        return LookaheadConfig.cover(configs) if configs else None


def plan_bench(
    source: str,
    *,
    datasets: str,
    limit: int | None = 8,
    max_new_tokens: int = 128,
    configs: str = DEFAULT_CONFIGS,
    peers: str = "",
    max_seq_len: int | None = None,
) -> BenchPlan:
    """Validate the request and encode every prompt (UserError naming the problem before any model loads)."""
    from trt_lookahead.engine.format import is_engine_dir
    from trt_lookahead.model.checkpoint import load_tokenizer
    from trt_lookahead.model.fetch import resolve_model

    if max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be positive, got {max_new_tokens}")
    labels = parse_configs(configs)
    peer_list = parse_peers(peers)
    sets = tuple(load_dataset(name, limit) for name in dataset_names(datasets))
    path = resolve_model(source)
    if peer_list and not (path / "model.safetensors").exists() and not list(path.glob("*.safetensors")):
        raise UserError(f"--peers need a HF checkpoint directory (safetensors), and {path} has none; use --model")
    tokenizer = load_tokenizer(path)
    prompts = {ds.name: [encode_row(tokenizer, row) for row in ds.rows] for ds in sets}
    if max_seq_len is None and not is_engine_dir(path):
        max_seq_len = _seq_len_for([p for ps in prompts.values() for p in ps], max_new_tokens, path)
    in_process = [p for p in peer_list if p in PEERS]
    return BenchPlan(path, source, sets, prompts, labels, in_process, max_new_tokens, limit, max_seq_len)


def memory_limit(model_path: Path, dtype: str) -> dict[str, float]:
    """The fastest a memory-bound greedy step can be on this machine: the weights' bytes (a checkpoint's in
    `dtype`, an engine dir's weights file) over the measured read bandwidth (docs/design.md section 8)."""
    from trt_lookahead.engine.format import WEIGHTS_FILE, is_engine_dir

    engine = is_engine_dir(model_path)
    weights = (model_path / WEIGHTS_FILE).stat().st_size if engine else weight_bytes(model_path, dtype)
    bandwidth = read_bandwidth_gbps()
    return {"weight_mb": round(weights / 1e6, 1), "read_gbps": round(bandwidth, 2),
            "ms_per_step": round(weights / bandwidth / 1e6, 2)}


def run_bench(
    open_runtime: Callable[[], LookaheadRuntime], plan: BenchPlan, *, progress: bool = True, warmup: bool = True
) -> dict[str, Any]:
    """Open a runtime with `open_runtime`, run the plan on it, close it, then run the peers; returns the `bench
    --json` object. The runtime is closed before the peers run (their peak RSS is theirs alone), and on any error:
    run_bench closes the runtime it opened, never one of the caller's."""
    machine = machine_info()
    rt = open_runtime()
    try:
        memory = memory_limit(plan.model_path, rt.dtype)
        specs = [ConfigSpec(label, rt.narrow(Lookahead.parse(label))) for label in plan.labels]

        # an `auto` that resolved to a config already in the list reuses those runs
        runs_of: dict[str, ConfigSpec] = {}
        aliases: dict[str, str] = {}
        for spec in specs:
            same = next((s for s in runs_of.values() if s.resolved == spec.resolved), None)
            if same is not None:
                aliases[spec.label] = same.label
            else:
                runs_of[spec.label] = spec
        unique = list(runs_of.values())

        prompts, sets, max_new_tokens = plan.prompts, plan.sets, plan.max_new_tokens
        first = next(iter(prompts.values()))[0]
        total = sum(len(p) for p in prompts.values()) * (len(unique) + len(plan.peers))
        bar = _progress(total, progress)
        records: list[RunRecord] = []
        started = time.perf_counter()
        stop_ids, dtype, backend, exact_step = list(rt.stop_token_ids), rt.dtype, rt.backend, rt.exact
        weights = rt.weights  # "float" or the quantized weights, as GenerationOutput.weights
        device = str(getattr(rt.executor, "device", "cpu"))  # the peers run where our executor ran
        tree = None if rt.tree is None else str(rt.tree)  # the draft tree's parents (None: linear)
        try:
            if warmup:
                for spec in unique:
                    bar.set_postfix_str(f"warm-up {spec.label}")
                    _runtime_generate(rt, first, min(16, max_new_tokens), spec)
            for ds in sets:
                for i, (row, ids) in enumerate(zip(ds.rows, prompts[ds.name], strict=True)):
                    order = unique if i % 2 == 0 else unique[::-1]
                    for spec in order:
                        bar.set_postfix_str(f"{ds.name} #{i} {spec.label}")
                        records.append(run_ours(rt, spec, ds.name, i, row.id, ids, max_new_tokens))
                        bar.update(1)
            for label, target in aliases.items():
                spec = next(s for s in specs if s.label == label)
                records.extend(
                    RunRecord(**{**r.__dict__, "config": label, "resolved": spec.resolved})
                    for r in list(records)
                    if r.config == target
                )
        except BaseException:
            bar.close()
            raise
    finally:
        rt.close()
    del rt
    gc.collect()
    try:
        if plan.peers:
            hf = HFPeers(plan.model_path, dtype, stop_ids, device)
            if warmup:
                for peer in plan.peers:
                    hf.generate(first, min(16, max_new_tokens), peer)
            for ds in sets:
                for i, (row, ids) in enumerate(zip(ds.rows, prompts[ds.name], strict=True)):
                    for peer in plan.peers if i % 2 == 0 else plan.peers[::-1]:
                        bar.set_postfix_str(f"{ds.name} #{i} {peer}")
                        records.append(run_peer(hf, peer, ds.name, i, row.id, ids, max_new_tokens))
                        bar.update(1)
            del hf
            gc.collect()
    finally:
        bar.close()

    mark_exact(records)
    rank = {label: k for k, label in enumerate([*plan.labels, *plan.peers])}
    names = [ds.name for ds in sets]
    records.sort(key=lambda r: (names.index(r.dataset), rank[r.config], r.prompt_index))
    return {
        "schema": SCHEMA_VERSION,
        "model": str(plan.model_path),
        "model_name": plan.model_name,
        "backend": backend,
        "dtype": dtype,
        "weights": weights,
        "exact_step": exact_step,
        "tree": tree,
        "machine": machine,
        "memory_limit": memory,
        "load_end": load_average(),
        "date_end": utc_now(),
        "elapsed_seconds": round(time.perf_counter() - started, 2),
        "max_new_tokens": max_new_tokens,
        "limit": plan.limit,
        "max_seq_len": plan.max_seq_len,
        "datasets": names,
        "configs": plan.labels,
        "peers": plan.peers,
        "stop_token_ids": stop_ids,
        "results": aggregate(records),
        "runs": [r.to_dict() for r in records],
    }


def write_outputs(
    result: dict[str, Any], out_dir: str | Path, step_cost_ms: dict[str, float] | None = None
) -> list[Path]:
    """results.json, results.md and the PNG plots in out_dir."""
    from trt_lookahead.bench.plots import write_plots

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (out / "results.md").write_text(format_markdown(result) + "\n", encoding="utf-8")
    return [out / "results.json", out / "results.md", *write_plots(result, out, step_cost_ms)]
