"""Host overhead per request per step with an instant executor, and the ablation of our additions.

    python scripts/host_overhead.py            # the three tables, Markdown
Host overhead = decode-step wall time outside the executor, per request in the step (docs/design.md section
8), measured by the scheduler (runtime/scheduler.py) with an executor that costs ~1 us per row (a bigram
table lookup), so it is the host's own cost: the policy, the pool, the window, verification, input assembly
and delivery, for B requests in every step. `auto` lets the policy choose each step (explicit otherwise).
The ablation runs a repetitive (induction) oracle. The tree table compares linear candidates with the draft
tree (lookahead/tree.py; pool, suffix and chain sources) at equal T for one request (`LookaheadDecoder`).
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import numpy as np

from trt_lookahead.lookahead.config import AUTO, DEFAULT_LOOKAHEAD, Lookahead, LookaheadConfig
from trt_lookahead.lookahead.decoder import RequestDecoder
from trt_lookahead.lookahead.policy import LookaheadPolicy, Priors, StepCost
from trt_lookahead.lookahead.tree import tree_template
from trt_lookahead.runtime.scheduler import Job, Scheduler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test support, not in the package
from support.ablation import LookaheadDecoder, Switches
from support.oracles import InstantExecutor, OracleExecutor, induction_logits

PRIORS = Priors({"1/3/1": 1.45, "2/3/2": 1.6, "4/3/4": 1.7})  # SmolLM2-like compression


def host_overhead_us(config: str, batch: int, runs: int = 5, tokens: int = 512, vocab: int = 32000) -> float:
    """Median over runs of host microseconds per request per decode step, `batch` requests at a time."""
    auto = config == AUTO
    cfg = DEFAULT_LOOKAHEAD if auto else LookaheadConfig.parse(config)
    rng = np.random.default_rng(0)
    per_run = []
    for seed in range(runs):
        executor = InstantExecutor(vocab, max_batch=batch, step_tokens=cfg.step_tokens, seed=seed)
        scheduler = Scheduler(executor, LookaheadPolicy(StepCost.linear(20.0, 0.5), PRIORS), max_queue=batch)
        for i in range(batch):
            decoder = RequestDecoder(cfg, rng.integers(0, vocab, size=200), tokens, seed=seed + i)
            scheduler.submit(Job(decoder, Lookahead(cfg, auto=auto)))
        while not scheduler.idle:
            scheduler.run_once()
        per_run.append(1000.0 * scheduler.stats.host_ms_per_row)
    return statistics.median(per_run)


def tree_host_us(config: LookaheadConfig, tree: bool, runs: int = 5, tokens: int = 400, vocab: int = 64) -> float:
    """Median over runs of host microseconds per decode step of one request, linear or tree at the same T."""
    template = tree_template(config.G * config.levels, 8) if tree else None
    per_run = []
    for seed in range(runs):
        executor = InstantExecutor(vocab, max_batch=1, step_tokens=config.step_tokens, seed=seed)
        decoder = LookaheadDecoder(executor, config, tree=template)
        decoder.generate(np.random.default_rng(seed).integers(0, vocab, size=200).tolist(), tokens)
        per_run.append(1000.0 * decoder.stats.host_ms_per_step)
    return statistics.median(per_run)


def ablation_compression(config: LookaheadConfig, prompts: int = 12, tokens: int = 96, vocab: int = 48) -> dict:
    variants = {
        "all on": Switches(),
        "no bonus token": Switches(bonus=False),
        "no prompt/output pool": Switches(prompt_pool=False),
        "no column-0 chain": Switches(chain=False),
    }
    rng = np.random.default_rng(1)
    cases = [(induction_logits(vocab, seed), rng.integers(0, vocab, size=40).tolist()) for seed in range(prompts)]
    result = {}
    for name, switches in variants.items():
        generated = steps = 0
        for logits, prompt in cases:
            decoder = LookaheadDecoder(OracleExecutor(logits, vocab, step_tokens=config.step_tokens), config,
                                       switches=switches)
            out = decoder.generate(prompt, tokens)
            generated, steps = generated + len(out.token_ids), steps + decoder.stats.steps
        result[name] = generated / steps
    return result


def main() -> None:
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} cpus\n")
    print("host us per request per step, median of 5 runs x 512 tokens; vocab 64 fills the pool (G candidates")
    print("every step); auto: the policy chooses up to 4/3/4 each step (a cheap step-cost model: it climbs)")
    print("| config | T | batch 1, vocab 32000 | batch 8, vocab 32000 | batch 8, vocab 64 |")
    print("|---|---:|---:|---:|---:|")
    for cfg in ("1/2/0", "4/3/4", "7/5/7", "15/5/15", AUTO):
        T = DEFAULT_LOOKAHEAD.step_tokens if cfg == AUTO else LookaheadConfig.parse(cfg).step_tokens
        one, eight, full = (host_overhead_us(cfg, b, vocab=v) for b, v in ((1, 32000), (8, 32000), (8, 64)))
        print(f"| {cfg} | {T} | {one:.1f} | {eight:.1f} | {full:.1f} |")
    print("\nhost us per decode step, one request, vocab 64, median of 5 runs x 400 tokens: linear vs tree")
    print("| config | T | linear | tree |")
    print("|---|---:|---:|---:|")
    for cfg in ("7/5/7", "15/5/15"):
        config = LookaheadConfig.parse(cfg)
        linear, tree = tree_host_us(config, False), tree_host_us(config, True)
        print(f"| {cfg} | {config.step_tokens} | {linear:.1f} | {tree:.1f} |")
    print("\nAblation, induction oracle (vocab 48, 12 prompts x 96 tokens): compression")
    configs = ("4/3/4", "7/5/7", "15/5/15")
    table = {cfg: ablation_compression(LookaheadConfig.parse(cfg)) for cfg in configs}
    print("| variant | " + " | ".join(configs) + " |")
    print("|---|" + "---:|" * len(configs))
    for variant in table[configs[0]]:
        print(f"| {variant} | " + " | ".join(f"{table[c][variant]:.3f}" for c in configs) + " |")


if __name__ == "__main__":
    main()
