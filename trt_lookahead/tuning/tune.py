"""`auto` and `trt-lookahead tune`: choose (W, N, G) for a runtime's model, dtype and backend on this machine.

Lookahead trades a wider step (T = (W + G)(N - 1) tokens) for fewer steps. Whether that pays depends
on the machine: on a GPU a 120-token step costs about what a 1-token step costs; on a small CPU it
costs several times more. So we measure rather than guess (docs/design.md section 8):

  1. step cost against T: time the executor's step for the T of greedy and of each candidate, at a
     realistic context length, rounds interleaved so that load changes hit every T alike;
  2. compression (tokens per step) of each candidate on a few prompts of the workload (rows past the
     first 16 of each set, so the bench's prompts are not the ones tuned on): a screening pass over
     every plausible candidate (one prompt per set, half the tokens, cheapest step first), then the best
     four again on all prompts; host time per step is read from the same runs;
  3. predicted time per token = (step_cost(T) + host_ms) / compression; greedy's is step_cost(1) + host;
  4. verify the winner against greedy, interleaved per prompt; if it is not faster, try the next one,
     and when nothing beats greedy, the answer is greedy (`auto` never runs slower on purpose).

`tune(rt)` measures and chooses on a runtime its caller built; `auto_config(rt)` is what the runtime calls
to resolve `auto`: the stored entry for this model, dtype, backend and machine (tuning/file.py), tuning
on first use (saying so on stderr) and storing the result.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from trt_lookahead.bench.machine import load_average, machine_info, machine_key, utc_now
from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import GREEDY, LookaheadConfig
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.tuning.file import (
    TUNING_VERSION,
    config_from_entry,
    model_key,
    read_tuning_file,
    tuning_key,
    tuning_path,
    write_tuning_entry,
)

if TYPE_CHECKING:
    from trt_lookahead.runtime import GenerationOutput, LookaheadRuntime

DEFAULT_TUNE_DATASETS = "mt_bench,humaneval,gsm8k"
DEFAULT_BUDGET = 300.0  # seconds, `trt-lookahead tune`
DEFAULT_AUTO_BUDGET = 240.0  # seconds, when `auto` tunes on first use ($TRT_LOOKAHEAD_TUNE_BUDGET)
TUNE_ROW_OFFSET = 16  # tune on rows after the ones `bench --limit 8/16` measures
TUNING_MAX_SEQ_LEN = 1024  # KV buffers for tuning: the prompts are a few hundred tokens

# Candidates: prompt-lookup-like ones (W = 1: the pool drafts, from the prompt and the output, and the
# column-0 chain), small windows, and the LADE/TensorRT-LLM classics. Ones whose step costs more than
# they could ever save on this machine are not measured beyond their step cost.
CANDIDATES: tuple[LookaheadConfig, ...] = tuple(
    LookaheadConfig(*c)
    for c in (
        (1, 2, 1), (1, 3, 1), (1, 4, 1), (1, 5, 1), (1, 3, 2), (1, 5, 2), (1, 8, 1), (2, 3, 2), (3, 3, 3),
        (4, 3, 4), (3, 4, 3), (5, 4, 5), (7, 5, 7), (15, 5, 15),
    )
)


def check_budget(budget_seconds: float) -> float:
    if not 0 < budget_seconds < math.inf:
        raise UserError(f"--budget-seconds must be a finite number of seconds > 0, got {budget_seconds}")
    return budget_seconds


def tuning_seq_len(path: str | os.PathLike) -> int | None:
    """KV length to tune a checkpoint with (TUNING_MAX_SEQ_LEN or its context); None for an engine dir."""
    from trt_lookahead.engine.format import is_engine_dir
    from trt_lookahead.model.checkpoint import read_config

    if is_engine_dir(path):
        return None
    return min(read_config(path).max_position_embeddings, TUNING_MAX_SEQ_LEN)


def auto_config(rt: LookaheadRuntime, *, budget_seconds: float | None = None) -> LookaheadConfig | None:
    """`auto`: the tuned config for the runtime's model/dtype/backend on this machine, or None for greedy.

    Without a tuning entry, tunes now on `rt` (on stderr: what and for how long) and stores the result.
    """
    key = tuning_key(rt.model_path, rt.dtype, rt.backend)
    entry = read_tuning_file()["entries"].get(key)
    if entry is None:
        budget = budget_seconds or float(os.environ.get("TRT_LOOKAHEAD_TUNE_BUDGET", DEFAULT_AUTO_BUDGET))
        print(
            f"trt-lookahead: no tuning for {model_key(rt.model_path)} ({rt.dtype}, {rt.backend}) on this machine "
            f"({machine_key()}); tuning now, about {budget:.0f} s, result cached in {tuning_path()}",
            file=sys.stderr,
            flush=True,
        )
        entry = tune_and_store(rt, budget_seconds=budget)
    return config_from_entry(entry)


def tune_and_store(
    rt: LookaheadRuntime, *, datasets: str = DEFAULT_TUNE_DATASETS, budget_seconds: float = DEFAULT_BUDGET,
    progress: bool = True,
) -> dict[str, Any]:
    """Tune on `rt`, write the entry to the tuning file and return it."""
    entry = tune(rt, datasets=datasets, budget_seconds=budget_seconds, progress=progress).to_entry()
    path = write_tuning_entry(tuning_key(rt.model_path, rt.dtype, rt.backend), entry)
    _say(progress, f"wrote {path}")
    return entry


@dataclass
class Candidate:
    config: str  # "W/N/G"
    T: int
    prompts: int = 0
    generated_tokens: int = 0
    steps: int = 0
    host_ms_per_step: float | None = None
    measured_ms_per_token: float | None = None  # straight from the compression runs (noisier)
    compression: float | None = None
    predicted_ms_per_token: float | None = None
    skipped: str | None = None  # why it was not measured
    screen_compression: float | None = None  # first pass: one prompt per set, half the tokens
    set_compression: dict[str, float] = field(default_factory=dict)  # per dataset, last measurement
    worst_set_ms_per_token: float | None = None  # predicted on the set it compresses least


@dataclass
class TuneReport:
    model: str
    dtype: str
    backend: str
    machine: dict[str, Any]
    dataset: str
    prompts: int
    max_new_tokens: int
    budget_seconds: float
    step_cost_ms: dict[str, float] = field(default_factory=dict)  # str(T) -> median ms per executor step
    greedy_ms_per_token: float | None = None  # predicted: step_cost(1) + host ms
    greedy_measured_ms_per_token: float | None = None
    candidates: list[Candidate] = field(default_factory=list)
    verified: list[dict[str, Any]] = field(default_factory=list)
    config: str = GREEDY
    reason: str = ""
    elapsed_seconds: float = 0.0
    load_end: list[float] = field(default_factory=list)

    def to_entry(self) -> dict[str, Any]:
        entry = asdict(self)
        entry["date"] = utc_now()
        entry["version"] = TUNING_VERSION
        return entry


def measure_step_cost(
    rt: LookaheadRuntime,
    configs: Sequence[LookaheadConfig],
    context_ids: Sequence[int],
    *,
    rounds: int = 3,
    steps_per_round: int = 3,
    deadline: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[int, float]:
    """Median milliseconds of one executor step per T (configs with equal T are measured once).

    The executor is prefilled with `context_ids`, then each timed iteration is a step (random ids in
    every slot) and a commit of two slots (x_t and one accepted draft; greedy's one slot), as decoding
    does; rounds go over all T in turn, smallest first. Past the deadline only T = 1 and the smallest
    other T are sure to be measured (the others are interpolated).
    """
    by_t: dict[int, LookaheadConfig] = {}
    for cfg in configs:
        by_t.setdefault(cfg.step_tokens, cfg)
    rng = np.random.default_rng(0)
    prompt = np.asarray(context_ids, np.int64)
    times: dict[int, list[float]] = {t: [] for t in by_t}
    for r in range(rounds):
        for i, (t, cfg) in enumerate(sorted(by_t.items())):
            if deadline is not None and clock() > deadline and (r > 0 or i > 1):
                break
            ex, layout = rt.executor_for(cfg)  # the runtime keeps only its few most recent executors
            ex.reset(SamplingParams())
            ex.prefill(prompt)
            ids = rng.integers(0, ex.vocab_size, layout.step_tokens)
            ids[0] = prompt[-1]
            keep = np.array([0] if layout.step_tokens == 1 else [0, layout.step_tokens - 1], np.int64)
            p = len(prompt)
            ex.step(ids, p + np.asarray(layout.rel_positions))  # warm-up (first call may build or allocate)
            for _ in range(steps_per_round):
                t0 = clock()
                ex.step(ids, p + np.asarray(layout.rel_positions))
                ex.commit(keep)
                times[t].append(clock() - t0)
                p += len(keep)
    return {t: 1000.0 * statistics.median(v) for t, v in times.items() if v}


def step_cost_at(costs: dict[int, float], t: int) -> float:
    """Step cost at T, interpolated linearly between measured T (extrapolated from the last two)."""
    if t in costs:
        return costs[t]
    xs = sorted(costs)
    if len(xs) == 1:
        return costs[xs[0]] * max(t, 1) / max(xs[0], 1)
    lo = max((x for x in xs if x < t), default=xs[0])
    hi = min((x for x in xs if x > t), default=xs[-1])
    if lo == hi:
        lo, hi = (xs[-2], xs[-1]) if t > xs[-1] else (xs[0], xs[1])
    return costs[lo] + (costs[hi] - costs[lo]) * (t - lo) / (hi - lo)


def _run(rt: LookaheadRuntime, ids: Sequence[int], max_new_tokens: int,
         config: LookaheadConfig | None) -> GenerationOutput:
    return rt.generate(list(ids), max_new_tokens=max_new_tokens, lookahead=config if config else GREEDY)


def _decoded(out: GenerationOutput) -> tuple[int, float]:
    """(tokens emitted by decode steps, decode seconds) of one output."""
    return max(out.generated_tokens - 1, 0), float(out.stats.decode_seconds)


def tuning_prompts(
    tokenizer: Any, datasets: str, count: int, offset: int = TUNE_ROW_OFFSET
) -> list[tuple[str, list[int]]]:
    """`count` (set name, token ids) spread over the datasets (round robin), from rows past `offset`.

    Chat rows of a model without a chat template are sent as raw text (tuning only needs a realistic
    workload, not the chat format)."""
    from trt_lookahead.bench.datasets import PromptRow, dataset_names, encode_row, load_dataset

    names = dataset_names(datasets)
    per_set = max(1, math.ceil(count / len(names)))
    pools: list[list[tuple[str, list[int]]]] = []
    for name in names:
        ds = load_dataset(name)
        rows = list(ds.rows[offset : offset + per_set]) or list(ds.rows[:per_set])
        encoded = []
        for row in rows:
            try:
                encoded.append((ds.name, encode_row(tokenizer, row)))
            except UserError:  # a chat row, and no chat template: its last message as raw text
                assert row.messages is not None
                encoded.append((ds.name, encode_row(tokenizer, PromptRow(row.id, text=row.messages[-1][1]))))
        pools.append(encoded)
    prompts: list[tuple[str, list[int]]] = []
    for i in range(per_set):
        prompts.extend(pool[i] for pool in pools if i < len(pool))
    return prompts[:count]


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"tune: {msg}", file=sys.stderr, flush=True)


def tune(
    rt: LookaheadRuntime,
    *,
    datasets: str = DEFAULT_TUNE_DATASETS,
    budget_seconds: float = DEFAULT_BUDGET,
    candidates: Sequence[LookaheadConfig] | None = None,
    prompts: int = 6,
    max_new_tokens: int = 96,
    progress: bool = True,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> TuneReport:
    """Measure and choose on a loaded runtime; see the module docstring. Does not write the file."""
    check_budget(budget_seconds)
    start = clock()
    deadline = start + budget_seconds
    candidates = CANDIDATES if candidates is None else candidates
    if rt.max_lookahead is not None:
        fitting = []
        for cfg in candidates:
            with contextlib.suppress(ValueError):
                cfg.check_fits(rt.max_lookahead)
                fitting.append(cfg)
        candidates = fitting
    if prompt_ids is not None:
        named = [("custom", list(p)) for p in prompt_ids]
    else:
        named = tuning_prompts(rt.tokenizer, datasets, prompts)
    keep = rt.max_seq_len - max_new_tokens
    named = [(name, p[-keep:] if keep > 0 else p) for name, p in named if p]
    sets, ids = [name for name, _ in named], [p for _, p in named]
    if not ids:
        raise UserError("no tuning prompts: give a dataset with at least one row")
    report = TuneReport(
        model=model_key(rt.model_path),
        dtype=rt.dtype,
        backend=rt.backend,
        machine=machine_info(),
        dataset=datasets if prompt_ids is None else "custom",
        prompts=len(ids),
        max_new_tokens=max_new_tokens,
        budget_seconds=budget_seconds,
    )

    # 1. step cost against T, at the median prompt length plus half the generation
    context = sorted(ids, key=len)[len(ids) // 2]
    context = (context * (1 + max_new_tokens // max(len(context), 1)))[: len(context) + max_new_tokens // 2]
    greedy = LookaheadConfig.greedy()
    _say(progress, f"step cost for T in {sorted({c.step_tokens for c in [greedy, *candidates]})}")
    costs = measure_step_cost(rt, [greedy, *candidates], context, deadline=start + 0.2 * budget_seconds, clock=clock)
    report.step_cost_ms = {str(t): round(v, 4) for t, v in sorted(costs.items())}
    _say(progress, "ms per step: " + ", ".join(f"T={t}: {v:.1f}" for t, v in sorted(costs.items())))

    # greedy's own time per token (host time included) from one real run
    out = _run(rt, ids[0], max_new_tokens, None)
    greedy_host = out.stats.host_ms_per_step
    greedy_ms = costs[1] + greedy_host
    report.greedy_ms_per_token = round(greedy_ms, 4)
    d, s = _decoded(out)
    report.greedy_measured_ms_per_token = round(1000.0 * s / d, 4) if d else None

    # 2. compression: screen every plausible candidate on one prompt per set and half the tokens
    #    (cheapest step first), then re-measure the best few on all prompts and all tokens
    n_screen = max(1, len(dict.fromkeys(sets)))  # one prompt per set (prompts are round robin over sets)
    ranked = sorted(candidates, key=lambda c: (step_cost_at(costs, c.step_tokens), c.step_tokens))
    by_name: dict[str, LookaheadConfig] = {}
    for cfg in ranked:
        cand = Candidate(config=str(cfg), T=cfg.step_tokens)
        report.candidates.append(cand)
        by_name[cand.config] = cfg
        cost = step_cost_at(costs, cfg.step_tokens)
        if cost >= 0.95 * cfg.N * greedy_ms:
            cand.skipped = f"step costs {cost / greedy_ms:.1f}x greedy; at most {cfg.N} tokens per step"
            continue
        if clock() > start + 0.5 * budget_seconds:
            cand.skipped = "budget"
            continue
        until = start + 0.5 * budget_seconds
        _measure(rt, cand, cfg, cost, ids[:n_screen], sets, max(8, max_new_tokens // 2), until, clock)
        cand.screen_compression = cand.compression
        _say(progress, f"screen {_describe(cand)} (greedy {greedy_ms:.1f})")
    screened = sorted(
        (c for c in report.candidates if c.predicted_ms_per_token), key=lambda c: c.predicted_ms_per_token or 0.0
    )
    for cand in screened[:4]:
        if clock() > start + 0.75 * budget_seconds or len(ids) <= n_screen:
            break
        cfg, until = by_name[cand.config], start + 0.75 * budget_seconds
        _measure(rt, cand, cfg, step_cost_at(costs, cand.T), ids, sets, max_new_tokens, until, clock)
        _say(progress, f"measure {_describe(cand)} (greedy {greedy_ms:.1f})")

    # 3./4. pick, verify against greedy (interleaved), fall back to greedy if nothing wins
    contenders = sorted(
        (
            c
            for c in report.candidates
            if c.predicted_ms_per_token
            and c.predicted_ms_per_token < 0.97 * greedy_ms
            and (c.worst_set_ms_per_token or 0.0) <= greedy_ms  # not slower than greedy on any set
        ),
        key=lambda c: c.predicted_ms_per_token or 0.0,
    )
    report.config, report.reason = GREEDY, "no candidate is predicted to beat greedy on this machine"
    for cand in contenders[:3]:
        if clock() > deadline and report.verified:
            break
        cfg = LookaheadConfig.parse(cand.config)
        g_dec = g_sec = c_dec = c_sec = 0.0
        runs = 0
        for i, prompt in enumerate(ids):
            pair = [(None, "g"), (cfg, "c")] if i % 2 == 0 else [(cfg, "c"), (None, "g")]
            for conf, which in pair:
                d, s = _decoded(_run(rt, prompt, max_new_tokens, conf))
                if which == "g":
                    g_dec, g_sec = g_dec + d, g_sec + s
                else:
                    c_dec, c_sec = c_dec + d, c_sec + s
            runs += 1
            if clock() > deadline and runs >= 1:
                break
        speedup = (g_sec / g_dec) / (c_sec / c_dec) if g_dec and c_dec and g_sec and c_sec else 0.0
        report.verified.append({"config": cand.config, "prompts": runs, "speedup": round(speedup, 4)})
        _say(progress, f"verify {cand.config}: speedup {speedup:.2f}x over greedy on {runs} prompts")
        if speedup >= 1.0:
            report.config = cand.config
            report.reason = (
                f"predicted {cand.predicted_ms_per_token:.1f} ms/token against greedy {greedy_ms:.1f}; "
                f"verified {speedup:.2f}x on {runs} prompts"
            )
            break
        report.reason = "the predicted winners were not faster than greedy when verified"
    report.elapsed_seconds = round(clock() - start, 2)
    report.load_end = load_average()
    _say(progress, f"chose {report.config}: {report.reason} ({report.elapsed_seconds:.0f} s)")
    return report


def _measure(
    rt: LookaheadRuntime,
    cand: Candidate,
    cfg: LookaheadConfig,
    cost: float,
    prompts: Sequence[Sequence[int]],
    sets: Sequence[str],
    max_new_tokens: int,
    until: float,
    clock: Callable[[], float],
) -> None:
    """Compression (overall and per set), host ms per step and predicted ms per token of `cfg` on
    `prompts` (at least one is run; `sets[i]` names the set of prompt i)."""
    generated = steps = runs = 0
    decoded = seconds = host = 0.0
    per_set: dict[str, list[int]] = {}
    for prompt, name in zip(prompts, sets, strict=False):
        out = _run(rt, prompt, max_new_tokens, cfg)
        runs += 1
        generated, steps = generated + out.generated_tokens, steps + out.steps
        counts = per_set.setdefault(name, [0, 0])
        counts[0], counts[1] = counts[0] + out.generated_tokens, counts[1] + out.steps
        d, s = _decoded(out)
        decoded, seconds = decoded + d, seconds + s
        host += out.stats.host_ms_per_step * max(out.steps - 1, 0)
        if clock() > until:
            break
    cand.prompts, cand.generated_tokens, cand.steps = runs, generated, steps
    cand.compression = round(generated / steps, 4) if steps else None
    cand.host_ms_per_step = round(host / max(steps - runs, 1), 4)
    cand.measured_ms_per_token = round(1000.0 * seconds / decoded, 4) if decoded else None
    cand.set_compression = {name: round(g / n, 4) for name, (g, n) in per_set.items() if n}
    if cand.compression:
        per_step = cost + cand.host_ms_per_step
        cand.predicted_ms_per_token = round(per_step / cand.compression, 4)
        cand.worst_set_ms_per_token = round(per_step / min(cand.set_compression.values()), 4)


def _describe(cand: Candidate) -> str:
    sets = " ".join(f"{k} {v:.2f}" for k, v in cand.set_compression.items())
    return (
        f"{cand.config:>8} T={cand.T:<4} compression {cand.compression or 0:.2f} ({sets}) on {cand.prompts} "
        f"prompts, predicted {cand.predicted_ms_per_token or 0:.1f} ms/token (worst set "
        f"{cand.worst_set_ms_per_token or 0:.1f})"
    )


def format_report(entry: dict[str, Any]) -> str:
    lines = [
        f"model {entry['model']} ({entry['dtype']}, {entry['backend']}), machine {entry['machine'].get('cpu')} "
        f"x{entry['machine'].get('cpus')}, {entry['machine'].get('threads')} threads, "
        f"load {entry['machine'].get('load')} -> {entry.get('load_end')}",
        "step cost (ms): " + ", ".join(f"T={t}: {v:.1f}" for t, v in entry["step_cost_ms"].items()),
        f"greedy: predicted {entry['greedy_ms_per_token']:.1f} ms/token, "
        f"measured {_fmt(entry.get('greedy_measured_ms_per_token'), 1)}",
        "| config | T | compression | per set | host ms/step | predicted ms/token (worst set) | measured ms/token "
        "| note |",
        "|---|---:|---:|---|---:|---:|---:|---|",
    ]
    for c in entry["candidates"]:
        sets = ", ".join(f"{k} {v:.2f}" for k, v in (c.get("set_compression") or {}).items())
        lines.append(
            f"| {c['config']} | {c['T']} | {_fmt(c['compression'])} | {sets} | {_fmt(c['host_ms_per_step'])} | "
            f"{_fmt(c['predicted_ms_per_token'], 1)} ({_fmt(c.get('worst_set_ms_per_token'), 1)}) | "
            f"{_fmt(c['measured_ms_per_token'], 1)} | {c['skipped'] or ''} |"
        )
    for v in entry["verified"]:
        lines.append(f"verified {v['config']}: {v['speedup']:.2f}x over greedy on {v['prompts']} prompts")
    lines.append(f"auto = {entry['config']}: {entry['reason']}")
    return "\n".join(lines)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
