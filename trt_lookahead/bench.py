"""`trt-lookahead bench`: greedy and lookahead side by side on prompt sets, one process, one machine.

    trt-lookahead bench --model smollm2-135m-instruct --dataset mt_bench,humaneval,gsm8k --limit 8 \
        --configs greedy,auto,15/5/15 --peers hf-greedy,hf-prompt-lookup --out bench-out --json

Per dataset, every prompt runs every config back to back (greedy first on even prompts, last on odd
ones) after one warm-up generation per config, so load drift hits all configs alike. All methods get
the same token ids (raw `prompt` text, or turn 1 / `question` through the chat template) and stop at
the model's eos ids. Greedy always runs: it is the reference for `speedup` and `exact`.

Measures (DESIGN.md section 7), per (dataset, config) row:
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
(our runtime freed first) and carry speedup_vs_hf_greedy too.

Outputs: a Markdown table on stdout (or, with --json, one JSON object on the last line); with --out DIR
also results.json, results.md and PNG plots (see trt_lookahead.plots).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trt_lookahead.config import LookaheadConfig
from trt_lookahead.errors import UserError
from trt_lookahead.machine import load_average, machine_info, peak_rss_mb, reset_peak_rss, utc_now

GREEDY = "greedy"
AUTO = "auto"
PEERS = ("hf-greedy", "hf-prompt-lookup")
PROMPT_LOOKUP_TOKENS = 10
DEFAULT_MODEL = "smollm2-135m-instruct"
SCHEMA_VERSION = 1


# ---------------------------------------------------------------------------------------------
# what to run


@dataclass(frozen=True)
class ConfigSpec:
    """One `--configs` entry: its label, and the config it runs (None = greedy)."""

    label: str  # "greedy", "W/N/G" or "auto"
    config: LookaheadConfig | None

    @property
    def resolved(self) -> str:
        return GREEDY if self.config is None or self.config.is_greedy else str(self.config)

    @property
    def tokens_per_step(self) -> int:
        return 1 if self.config is None else self.config.tokens_per_step


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
        labels.append(GREEDY if cfg.is_greedy else str(cfg))
    labels = list(dict.fromkeys(labels))
    if not labels:
        raise UserError("--configs is empty; give e.g. greedy,4/3/4,auto")
    return [GREEDY] + [label for label in labels if label != GREEDY]


def parse_peers(text: str | None) -> list[str]:
    peers = list(dict.fromkeys(p.strip().lower() for p in (text or "").split(",") if p.strip()))
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise UserError(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEERS)}")
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
    """One row per (dataset, config) in first-seen order, with the measures of DESIGN.md section 7."""
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
    pairs = [(reference.get((r.dataset, r.prompt_index)), r) for r in recs]
    pairs = [(g, r) for g, r in pairs if g is not None and g.decoded and r.decoded]
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
    lines = [
        f"**{Path(str(result['model'])).name}**, backend {result['backend']}, {result['dtype']}, "
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
    lines += [
        "",
        "compression = generated tokens / forward passes (prefill included); speedup = greedy decode time per "
        "token / this row's, same prompts, interleaved per prompt (median over prompts in brackets); exact = "
        "prompts whose token ids equal our greedy's; peak RSS = process peak during the row's calls.",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# running


def _runtime_generate(rt: Any, ids: Sequence[int], max_new_tokens: int, spec: ConfigSpec) -> Any:
    return rt.generate(list(ids), max_new_tokens=max_new_tokens, lookahead=spec.config or GREEDY)


def run_ours(
    rt: Any,
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
        T=spec.tokens_per_step,
        prompt_tokens=len(ids),
        generated_tokens=out.generated_tokens,
        steps=out.steps,
        decode_seconds=float(stats.decode_seconds),
        prefill_seconds=float(stats.prefill_seconds),
        executor_seconds=float(getattr(stats, "executor_seconds", 0.0)),
        peak_rss_mb=peak,
        accepted_histogram={str(k): int(v) for k, v in sorted(stats.accepted_histogram.items())},
        finish_reason=out.finish_reason,
        token_ids=list(out.token_ids),
    )


class HFPeers:
    """transformers' LlamaForCausalLM on the same checkpoint: greedy and prompt-lookup `generate`."""

    def __init__(self, path: Path, dtype: str, stop_token_ids: Sequence[int]) -> None:
        import torch
        from transformers import LlamaForCausalLM

        class CountingLlama(LlamaForCausalLM):
            """Counts forward passes (one per decoding step, prefill included) on our own subclass."""

            forward_calls = 0

            def forward(self, *args: Any, **kwargs: Any) -> Any:
                self.forward_calls += 1
                return super().forward(*args, **kwargs)

        self.torch = torch
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        self.model = CountingLlama.from_pretrained(str(path), dtype=torch_dtype).eval()
        self.stop = [int(t) for t in stop_token_ids]
        self.pad = self.stop[0] if self.stop else 0

    def generate(self, ids: Sequence[int], max_new_tokens: int, peer: str) -> dict[str, Any]:
        from transformers.generation.streamers import BaseStreamer

        torch = self.torch
        times: dict[str, Any] = {"first": None, "first_count": 0, "end": None, "puts": 0}

        class Clock(BaseStreamer):
            def put(self, value: Any) -> None:
                times["puts"] += 1
                if times["puts"] == 2:  # the first put is the prompt, the second the first forward's tokens
                    times["first"] = time.perf_counter()
                    times["first_count"] = int(value.numel())

            def end(self) -> None:
                times["end"] = time.perf_counter()

        kwargs: dict[str, Any] = {}
        if peer == "hf-prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        input_ids = torch.tensor([list(ids)], dtype=torch.long)
        self.model.forward_calls = 0
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=self.stop or None,
                pad_token_id=self.pad,
                streamer=Clock(),
                **kwargs,
            )
        end = times["end"] or time.perf_counter()
        first = times["first"] or end
        tokens = out[0, input_ids.shape[1] :].tolist()
        return {
            "token_ids": tokens,
            "steps": int(self.model.forward_calls),
            "prefill_seconds": first - start,
            "decode_seconds": end - first,
            "decoded_tokens": max(len(tokens) - times["first_count"], 0),
        }


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
        resolved=f"transformers prompt lookup {PROMPT_LOOKUP_TOKENS}" if peer == "hf-prompt-lookup" else "transformers",
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


def _load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise UserError(f"{path} has no tokenizer (tokenizer.json); copy the model's tokenizer files into it")
    return AutoTokenizer.from_pretrained(str(path))


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


def bench(
    source: str,
    *,
    datasets: str,
    limit: int | None = 8,
    max_new_tokens: int = 128,
    configs: str = "greedy,4/3/4,7/5/7,15/5/15",
    peers: str = "",
    backend: str | None = None,
    dtype: str = "float32",
    max_seq_len: int | None = None,
    threads: int | None = None,
    progress: bool = True,
    warmup: bool = True,
) -> dict[str, Any]:
    """Run the benchmark and return the result object (the `bench --json` schema)."""
    from trt_lookahead.datasets import dataset_names, encode_row, load_dataset
    from trt_lookahead.models.fetch import resolve_model
    from trt_lookahead.runtime import LookaheadRuntime

    if max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be positive, got {max_new_tokens}")
    labels = parse_configs(configs)
    peer_list = parse_peers(peers)
    sets = [load_dataset(name, limit) for name in dataset_names(datasets)]
    path = resolve_model(source)
    if peer_list and not (path / "model.safetensors").exists() and not list(path.glob("*.safetensors")):
        raise UserError(f"--peers need a HF checkpoint directory (safetensors), and {path} has none; use --model")
    tokenizer = _load_tokenizer(path)
    prompts = {ds.name: [encode_row(tokenizer, row) for row in ds.rows] for ds in sets}
    if max_seq_len is None and not _is_engine_dir(path):
        max_seq_len = _seq_len_for([p for ps in prompts.values() for p in ps], max_new_tokens, path)

    rt = LookaheadRuntime.from_pretrained(
        str(path), backend=backend, dtype=dtype, lookahead=None, max_seq_len=max_seq_len, threads=threads
    )
    machine = machine_info()
    specs = []
    for label in labels:
        if label == GREEDY:
            specs.append(ConfigSpec(GREEDY, None))
        elif label == AUTO:
            from trt_lookahead.tune import resolve_auto

            specs.append(ConfigSpec(AUTO, resolve_auto(str(path), rt.dtype, rt.backend)))
        else:
            specs.append(ConfigSpec(label, LookaheadConfig.parse(label)))
    if rt.engine_config is not None:
        for spec in specs:
            if spec.config is not None:
                spec.config.check_fits(rt.engine_config)

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

    total = sum(len(p) for p in prompts.values()) * (len(unique) + len(peer_list))
    bar = _progress(total, progress)
    records: list[RunRecord] = []
    started = time.perf_counter()
    try:
        if warmup:
            first = next(iter(prompts.values()))[0]
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
        stop_ids = list(rt.stop_token_ids)
        model_dtype, rt_backend = rt.dtype, rt.backend
        del rt
        gc.collect()
        if peer_list:
            hf = HFPeers(path, model_dtype, stop_ids)
            if warmup:
                first = next(iter(prompts.values()))[0]
                for peer in peer_list:
                    hf.generate(first, min(16, max_new_tokens), peer)
            for ds in sets:
                for i, (row, ids) in enumerate(zip(ds.rows, prompts[ds.name], strict=True)):
                    order = peer_list if i % 2 == 0 else peer_list[::-1]
                    for peer in order:
                        bar.set_postfix_str(f"{ds.name} #{i} {peer}")
                        records.append(run_peer(hf, peer, ds.name, i, row.id, ids, max_new_tokens))
                        bar.update(1)
            del hf
            gc.collect()
    finally:
        bar.close()

    mark_exact(records)
    order = {label: k for k, label in enumerate([*labels, *peer_list])}
    records.sort(key=lambda r: ([ds.name for ds in sets].index(r.dataset), order[r.config], r.prompt_index))
    return {
        "schema": SCHEMA_VERSION,
        "model": str(path),
        "model_name": source,
        "backend": rt_backend,
        "dtype": model_dtype,
        "machine": machine,
        "load_end": load_average(),
        "date_end": utc_now(),
        "elapsed_seconds": round(time.perf_counter() - started, 2),
        "max_new_tokens": max_new_tokens,
        "limit": limit,
        "max_seq_len": max_seq_len,
        "datasets": [ds.name for ds in sets],
        "configs": labels,
        "peers": peer_list,
        "stop_token_ids": stop_ids,
        "results": aggregate(records),
        "runs": [r.to_dict() for r in records],
    }


def _is_engine_dir(path: Path) -> bool:
    try:
        return "trt_lookahead_engine" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False


def write_outputs(
    result: dict[str, Any], out_dir: str | Path, step_cost_ms: dict[str, float] | None = None
) -> list[Path]:
    """results.json, results.md and the PNG plots in out_dir."""
    from trt_lookahead.plots import write_plots

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (out / "results.md").write_text(format_markdown(result) + "\n", encoding="utf-8")
    return [out / "results.json", out / "results.md", *write_plots(result, out, step_cost_ms)]


def _tuned_step_cost(result: dict[str, Any]) -> dict[str, float] | None:
    try:
        from trt_lookahead.machine import machine_key
        from trt_lookahead.tune import read_tuning_file, tuning_key

        machine = machine_key(result["machine"].get("threads"))
        key = tuning_key(result["model"], result["dtype"], result["backend"], machine)
        entry = read_tuning_file()["entries"].get(key)
    except Exception:  # the overlay is optional
        return None
    return entry.get("step_cost_ms") if entry else None


def run_bench(args: argparse.Namespace) -> int:
    engine = getattr(args, "engine", None)
    if args.model and engine:
        raise UserError("give one of --model or --engine, not both")
    source = engine or args.model or DEFAULT_MODEL
    result = bench(
        source,
        datasets=args.dataset,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        configs=args.configs,
        peers=getattr(args, "peers", ""),
        backend=args.backend,
        dtype=args.dtype,
        max_seq_len=args.max_seq_len,
        threads=args.threads,
    )
    if args.out:
        paths = write_outputs(result, args.out, _tuned_step_cost(result))
        print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    else:
        print(format_markdown(result))
    return 0
