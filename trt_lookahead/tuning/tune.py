"""`trt-lookahead tune` and `serve --tune`: measure what the load- and acceptance-aware policy needs here.

The policy (lookahead/policy.py) chooses every step how much of the step each request uses, from the
step's predicted cost and each request's expected tokens. Both are measured here, on runtimes of tune's own
over a loaded model (`tune(model)`), for its model, dtype and backend on this machine (docs/design.md section 8):

  1. step cost c(M, B): batches of B identical requests (B = 1, 2, 4, ... max_batch) at each config of a
     ladder (greedy, 1/3/1, 2/3/2, 3/3/5, 8/3/8: M = B T real tokens), steps timed by the scheduler, rounds
     interleaved so that load changes hit every point alike, more of them for one row; medians;
  2. priors: the compression (tokens per step) of every rung of each N's widest config (`widest`: 16 columns,
     5 of them window and 11 tree, or an engine's W and G) at N = 3, 4, 5
     on a few prompts of the workload (rows past the first 16 of each set, so the bench's prompts are not
     the ones tuned on), cheapest first, the prompts of a config run together as one batch;
  3. the largest config `auto` may use: the N whose best rung is predicted fastest for one request;
  4. verification: `auto` against greedy one request at a time, interleaved per prompt, on a second runtime
     whose AutoPolicy is the measured one (built when the first has closed: one scheduler on the executor at a
     time, and nothing else shares their steps); if `auto` is not faster, `auto` is greedy here (it never runs
     slower on purpose).

The priors' runs also count the draft tree's acceptance by depth and rank; `tuned_tree` shapes a template for
any T budget from them (`tune --tree-out FILE`, then `build --tree FILE`).

`tune_and_store` writes the entry to the tuning file (runtime/tuning_file.py), which runtimes read when they
load: nothing is tuned inside a request. Without an entry `auto` runs on the built-in priors (policy.py).
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trt_lookahead.bench.machine import load_average, machine_info, utc_now
from trt_lookahead.engine.format import batch_buckets
from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import AUTO, GREEDY, Lookahead, LookaheadConfig
from trt_lookahead.lookahead.decoder import acceptance_counts
from trt_lookahead.lookahead.policy import (
    NGRAMS,
    TOP,
    TUNED,
    AutoPolicy,
    LookaheadPolicy,
    Priors,
    StepCost,
    budget_split,
    choose_ceiling,
    ladder,
    widest,
)
from trt_lookahead.lookahead.tree import Acceptance, TreeTemplate, tree_template
from trt_lookahead.runtime import GenerationOutput, LookaheadRuntime
from trt_lookahead.runtime.load import LoadedModel, loaded_tuning_key
from trt_lookahead.runtime.scheduler import Result
from trt_lookahead.runtime.tuning_file import TUNING_VERSION, model_key, write_tuning_entry

DEFAULT_TUNE_DATASETS = "mt_bench,humaneval,gsm8k"
DEFAULT_BUDGET = 300.0  # seconds, `trt-lookahead tune` and `serve --tune`
TUNE_ROW_OFFSET = 16  # tune on rows after the ones `bench --limit 8/16` measures
TUNING_MAX_SEQ_LEN = 1024  # KV buffers for tuning: the prompts are a few hundred tokens
COST_LADDER = ladder(LookaheadConfig(TOP, 3, TOP))  # step tokens 1, 4, 8, 16, 32
COST_STEPS = 4  # timed decode steps per (rows, config) point and round
# rounds of the one-row points: a lone request's choices rest on them and they are cheap, while fewer rounds
# leave their ratios c(M) / c(1) too spread on a VM whose speed drifts (docs/design.md section 8; figures:
# docs/results/2026-11-27-cpu.md, "tune's one-row rounds")
ONE_ROW_ROUNDS = 8


def check_budget(budget_seconds: float, flag: str = "--budget-seconds") -> float:
    if not 0 < budget_seconds < math.inf:
        raise UserError(f"{flag} must be a finite number of seconds > 0, got {budget_seconds}")
    return budget_seconds


def tuning_seq_len(path: str | os.PathLike) -> int | None:
    """KV length to tune a checkpoint with (TUNING_MAX_SEQ_LEN or its context); None for an engine dir."""
    from trt_lookahead.engine.format import is_engine_dir
    from trt_lookahead.model.checkpoint import read_config

    if is_engine_dir(path):
        return None
    return min(read_config(path).max_position_embeddings, TUNING_MAX_SEQ_LEN)


def tune_and_store(
    model: LoadedModel, tuning_file: str | os.PathLike | None = None, *, datasets: str = DEFAULT_TUNE_DATASETS,
    budget_seconds: float = DEFAULT_BUDGET, progress: bool = True,
) -> dict[str, Any]:
    """Tune on `model` (`tune`), write the entry to the tuning file (None: the cache's) and return it."""
    entry = tune(model, datasets=datasets, budget_seconds=budget_seconds, progress=progress).to_entry()
    path = write_tuning_entry(loaded_tuning_key(model), entry, None if tuning_file is None else Path(tuning_file))
    _say(progress, f"wrote {path}")
    return entry


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
    step_cost: dict[str, list[list[float]]] = field(default_factory=dict)  # StepCost.to_dict(): rows -> [M, ms]
    priors: dict[str, float] = field(default_factory=dict)  # "W/N/G" -> compression
    set_compression: dict[str, dict[str, float]] = field(default_factory=dict)  # "W/N/G" -> set -> compression
    predicted: dict[str, float] = field(default_factory=dict)  # N -> one request's predicted tokens per second
    acceptance: dict[str, list[int]] = field(default_factory=dict)  # "depth/rank" -> [accepted, offered] tree nodes
    verified: dict[str, Any] = field(default_factory=dict)  # auto vs greedy, one request at a time
    config: str = GREEDY  # the largest config `auto` may use ("greedy": auto is greedy here)
    reason: str = ""
    elapsed_seconds: float = 0.0
    load_end: list[float] = field(default_factory=list)

    def to_entry(self) -> dict[str, Any]:
        entry = asdict(self)
        entry["date"] = utc_now()
        entry["version"] = TUNING_VERSION
        return entry


def run_together(
    rt: LookaheadRuntime, prompts: Sequence[Sequence[int]], max_new_tokens: int, config: LookaheadConfig
) -> list[Result]:
    """Run `prompts` as one batch (submitted together), each with `config` every step; their results."""
    # request scope: tuning runs the same prompts under every config, so a shared pool would hold their outputs
    handles = rt.submit([rt.check_request(list(p), max_new_tokens, lookahead=config, pool_scope="request")
                         for p in prompts])
    for handle in handles:
        for _ in handle:  # blocks arrive as steps accept them; the result comes with the last
            pass
    return [h.result for h in handles if h.result is not None]


def measure_step_cost(
    rt: LookaheadRuntime, context_ids: Sequence[int], *, rows: Sequence[int] | None = None,
    configs: Sequence[LookaheadConfig] = COST_LADDER, rounds: int = 2, one_row_rounds: int = ONE_ROW_ROUNDS,
    deadline: float | None = None, clock: Callable[[], float] = time.perf_counter,
) -> StepCost:
    """c(M, B): median wall ms of a decode step of B identical requests at each config (M = B T).

    Rows go up to the runtime's max_batch by doubling; rounds go over every point in turn, cheapest first, and
    the one-row points have `one_row_rounds` of them. Past the deadline only one row count and two configs are
    sure to be measured.
    """
    rows = rows or batch_buckets(rt.max_batch)
    points = [(b, c) for b in rows for c in configs]
    points.sort(key=lambda p: p[0] * p[1].step_tokens)
    times: dict[tuple[int, int], list[float]] = {}
    context = list(context_ids)
    for r in range(max(rounds, one_row_rounds)):
        for i, (b, config) in enumerate(points):
            if r >= (one_row_rounds if b == 1 else rounds):
                continue
            if deadline is not None and clock() > deadline and (r > 0 or i > 1):
                break
            before = rt.scheduler.stats.steps
            run_together(rt, [context] * b, COST_STEPS + 1, config)
            fresh = list(rt.scheduler.steps)[-(rt.scheduler.stats.steps - before) :]
            seconds = [s.executor_seconds + s.host_seconds for s in fresh if s.rows == b and not s.prefill_rows]
            if seconds:
                times.setdefault((b, b * config.step_tokens), []).extend(seconds)
    measured: dict[int, list[tuple[int, float]]] = {}
    for (b, m), values in times.items():
        measured.setdefault(b, []).append((m, 1000.0 * statistics.median(values)))
    return StepCost({b: pts for b, pts in measured.items() if len(pts) >= 2})


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


def measure_priors(
    rt: LookaheadRuntime, named: Sequence[tuple[str, Sequence[int]]], configs: Sequence[LookaheadConfig],
    max_new_tokens: int, *, deadline: float | None = None, clock: Callable[[], float] = time.perf_counter,
) -> tuple[dict[str, float], dict[str, dict[str, float]], dict[str, list[int]]]:
    """Compression (generated tokens / steps) of each config on the prompts, overall and per set, cheapest first;
    and the draft tree's acceptance by depth and rank over all of them (`acceptance_counts`)."""
    compression: dict[str, float] = {}
    per_set: dict[str, dict[str, float]] = {}
    accepted: Counter = Counter()
    offered: Counter = Counter()
    for config in sorted(configs, key=lambda c: c.step_tokens):
        if deadline is not None and clock() > deadline and compression:
            break
        results = run_together(rt, [p for _, p in named], max_new_tokens, config)
        for r in results:
            accepted.update(r.stats.tree_accepted)
            offered.update(r.stats.tree_offered)
        generated, steps = sum(r.stats.generated_tokens for r in results), sum(r.stats.steps for r in results)
        compression[str(config)] = round(generated / steps, 4)
        sets: dict[str, list[int]] = {}
        for (name, _), r in zip(named, results, strict=True):
            counts = sets.setdefault(name, [0, 0])
            counts[0], counts[1] = counts[0] + r.stats.generated_tokens, counts[1] + r.stats.steps
        per_set[str(config)] = {name: round(g / n, 4) for name, (g, n) in sets.items()}
    return compression, per_set, acceptance_counts(accepted, offered)


def acceptance_cells(acceptance: Mapping[str, Sequence[int]]) -> dict[tuple[int, int], tuple[int, int]]:
    """{"depth/rank": [accepted, offered]} (JSON) -> {(depth, rank): (accepted, offered)}."""
    return {(int(d), int(r)): (int(a), int(n)) for key, (a, n) in acceptance.items() for d, r in [key.split("/")]}


def tuned_tree(acceptance: Mapping[str, Sequence[int]], config: LookaheadConfig) -> TreeTemplate:
    """The G(N-1)-node template for `config` shaped by measured acceptance (a tuning entry's "acceptance"), as deep
    as the measured tree was."""
    counts = acceptance_cells(acceptance)
    if not counts:
        raise UserError("tuning measured no draft-tree acceptance: tune with a tree (the default), not --tree off")
    return tree_template(config.G * config.levels, max(d for d, _ in counts), Acceptance.fit(counts))


def budget_config(step_tokens: int, predicted: Mapping[str, float]) -> LookaheadConfig:
    """`budget_split` at the N tune predicted fastest (`predicted`: N -> tokens per second)."""
    n = int(max(predicted, key=lambda k: predicted[k])) if predicted else NGRAMS[-1]
    return budget_split(step_tokens, n)


def _decode_ms_per_token(outs: Sequence[GenerationOutput]) -> float:
    tokens = sum(max(o.generated_tokens - 1, 0) for o in outs)
    return 1000.0 * sum(o.decode_seconds for o in outs) / tokens if tokens else math.inf


def _runs_on(rt: LookaheadRuntime, config: LookaheadConfig) -> bool:
    """Whether `config` fits the runtime's executor (its step tokens, and an engine dir's W, N and G)."""
    try:
        rt.narrow(Lookahead(config))
    except ValueError:  # UserError is one
        return False
    return True


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"tune: {msg}", file=sys.stderr, flush=True)


def tune(
    model: LoadedModel,
    *,
    datasets: str = DEFAULT_TUNE_DATASETS,
    budget_seconds: float = DEFAULT_BUDGET,
    prompts: int = 6,
    max_new_tokens: int = 64,
    progress: bool = True,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> TuneReport:
    """Measure and choose on runtimes of tune's own over `model`, one after the other (see the module docstring);
    no other runtime may be running on its executor meanwhile. Does not write the file."""
    start = clock()
    untuned = AutoPolicy.untuned(model.executor.step_tokens, model.max_lookahead)  # never used: greedy and configs
    with LookaheadRuntime(model, lookahead=Lookahead.greedy(), auto=untuned) as rt:
        named = ([("custom", list(p)) for p in prompt_ids] if prompt_ids is not None
                 else tuning_prompts(rt.tokenizer, datasets, prompts))
        keep = rt.max_seq_len - max_new_tokens - 1
        named = [(name, p[-keep:]) for name, p in named if p and keep > 0]
        if not named:
            raise UserError("no tuning prompts: give a dataset with at least one row (and max_seq_len above 64)")
        report = TuneReport(
            model=model_key(rt.model_path), dtype=rt.dtype, backend=rt.backend, machine=machine_info(),
            dataset=datasets if prompt_ids is None else "custom", prompts=len(named), max_new_tokens=max_new_tokens,
            budget_seconds=budget_seconds,
        )
        context = sorted((p for _, p in named), key=len)[len(named) // 2]
        fitting = [c for c in COST_LADDER if _runs_on(rt, c)]
        _say(progress, f"step cost for rows up to {rt.max_batch} x step tokens {[c.step_tokens for c in fitting]}")
        cost = measure_step_cost(rt, context, configs=fitting, deadline=start + 0.35 * budget_seconds, clock=clock)
        report.step_cost = cost.to_dict()
        _say(progress, "ms per step, one row: " + ", ".join(f"M={m}: {ms:.1f}" for m, ms in cost.points[1]))

        tops = [widest(n, rt.executor.step_tokens, rt.max_lookahead) for n in NGRAMS]
        rungs = sorted({rung for top in tops for rung in ladder(top)[1:] if _runs_on(rt, rung)},
                       key=lambda c: (c.step_tokens, c.N))
        report.priors, report.set_compression, report.acceptance = measure_priors(
            rt, named, rungs, max_new_tokens, deadline=start + 0.8 * budget_seconds, clock=clock
        )
    _say(progress, "compression: " + ", ".join(f"{c} {v:.2f}" for c, v in report.priors.items()))
    policy = LookaheadPolicy(cost, Priors(report.priors))
    ceiling, report.predicted = choose_ceiling(policy, model.executor.step_tokens, model.max_lookahead)

    # verify, one request at a time: auto (this policy, up to the ceiling) against greedy, interleaved, on a
    # runtime of its own whose `auto` is the measured one
    greedy_outs: list[GenerationOutput] = []
    auto_outs: list[GenerationOutput] = []
    with LookaheadRuntime(model, lookahead=Lookahead.greedy(), auto=AutoPolicy(ceiling, policy, TUNED)) as rt:
        for i, (_, p) in enumerate(named):
            order = [(GREEDY, greedy_outs), (AUTO, auto_outs)][:: 1 if i % 2 == 0 else -1]
            for mode, outs in order:
                outs.append(rt.generate(list(p), max_new_tokens, lookahead=mode, pool_scope="request"))
            if clock() > start + budget_seconds:
                break
    greedy_ms, auto_ms = _decode_ms_per_token(greedy_outs), _decode_ms_per_token(auto_outs)
    speedup = greedy_ms / auto_ms if auto_ms > 0 else 0.0
    steps: dict[str, int] = {}
    for o in auto_outs:
        for label, n in o.stats.configs.items():
            steps[label] = steps.get(label, 0) + n
    report.verified = {"prompts": len(auto_outs), "speedup": round(speedup, 4), "auto_steps": steps,
                       "greedy_ms_per_token": round(greedy_ms, 4), "auto_ms_per_token": round(auto_ms, 4)}
    if speedup >= 1.0:
        report.config = str(ceiling)
        report.reason = f"auto up to {ceiling}: verified {speedup:.2f}x over greedy on {len(auto_outs)} prompts"
    else:
        report.reason = f"auto was {speedup:.2f}x greedy's speed on {len(auto_outs)} prompts: auto is greedy here"
    _say(progress, report.reason)
    report.elapsed_seconds = round(clock() - start, 2)
    report.load_end = load_average()
    return report


def format_report(entry: dict[str, Any]) -> str:
    machine = entry["machine"]
    cost = StepCost.from_dict(entry["step_cost"])
    lines = [
        f"model {entry['model']} ({entry['dtype']}, {entry['backend']}), machine {machine.get('cpu')} "
        f"x{machine.get('cpus')}, {machine.get('threads')} threads, load {machine.get('load')} -> "
        f"{entry.get('load_end')}",
        "step cost (ms) by rows: " + "; ".join(
            f"B={b}: " + ", ".join(f"M={m} {ms:.1f}" for m, ms in pts) for b, pts in cost.points.items()
        ),
        "| config | T | compression | per set |",
        "|---|---:|---:|---|",
    ]
    for config, value in entry["priors"].items():
        sets = ", ".join(f"{k} {v:.2f}" for k, v in entry["set_compression"].get(config, {}).items())
        lines.append(f"| {config} | {LookaheadConfig.parse(config).step_tokens} | {value:.2f} | {sets} |")
    cells = acceptance_cells(entry.get("acceptance") or {})
    if cells:
        ranks = range(max(r for _, r in cells) + 1)
        lines += ["draft tree: accepted / offered nodes by depth (rows) and rank among siblings (columns)",
                  "| depth | " + " | ".join(f"rank {r}" for r in ranks) + " |", "|---:|" + "---:|" * len(ranks)]
        for d in sorted({d for d, _ in cells}):
            row = (cells.get((d, r), (0, 0)) for r in ranks)
            lines.append(f"| {d} | " + " | ".join(f"{a / n:.2f} of {n}" if n else "" for a, n in row) + " |")
    v = entry["verified"]
    lines.append(f"verified: auto {v.get('speedup', 0):.2f}x greedy on {v.get('prompts', 0)} prompts, "
                 f"steps per config {v.get('auto_steps', {})}")
    lines.append(f"auto = {entry['config']}: {entry['reason']}")
    return "\n".join(lines)
