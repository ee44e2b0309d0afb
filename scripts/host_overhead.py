"""Host overhead per lookahead step with an instant executor, and the ablation of our additions.

    python scripts/host_overhead.py            # both tables, Markdown
Host overhead = decode wall time outside the executor per step (docs/design.md section 8), here with an
executor that costs ~1 us (a bigram table lookup), so it is the decoder's own cost: pool, window,
verification and input assembly. The ablation runs a repetitive (induction) oracle.
"""

from __future__ import annotations

import os
import statistics

import numpy as np

from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.decoder import LookaheadDecoder, Switches
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.oracles import InstantExecutor, OracleExecutor, induction_logits


def host_overhead_us(config: LookaheadConfig, runs: int = 30, tokens: int = 512, vocab: int = 32000) -> float:
    """Median over runs of the mean host microseconds per decode step."""
    layout = StepLayout(config)
    rng = np.random.default_rng(0)
    per_run = []
    for seed in range(runs):
        decoder = LookaheadDecoder(InstantExecutor(vocab, layout.step_tokens, seed=seed), layout, seed=seed)
        decoder.generate(rng.integers(0, vocab, size=200).tolist(), tokens)
        per_run.append(1000.0 * decoder.stats.host_ms_per_step)
    return statistics.median(per_run)


def ablation_compression(config: LookaheadConfig, prompts: int = 12, tokens: int = 96, vocab: int = 48) -> dict:
    layout = StepLayout(config)
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
            decoder = LookaheadDecoder(OracleExecutor(logits, vocab, layout.mask), layout, switches=switches)
            out = decoder.generate(prompt, tokens)
            generated, steps = generated + len(out.token_ids), steps + decoder.stats.steps
        result[name] = generated / steps
    return result


def main() -> None:
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} cpus\n")
    print("host us/step, median of 30 runs x 512 tokens; vocab 64 fills the pool (G candidates every step)")
    print("| config | T | vocab 32000 | vocab 64 |")
    print("|---|---:|---:|---:|")
    for cfg in ("1/2/0", "4/3/4", "7/5/7", "15/5/15"):
        config = LookaheadConfig.parse(cfg)
        sparse, full = host_overhead_us(config), host_overhead_us(config, vocab=64)
        print(f"| {cfg} | {config.step_tokens} | {sparse:.1f} | {full:.1f} |")
    print("\nAblation, induction oracle (vocab 48, 12 prompts x 96 tokens): compression")
    configs = ("4/3/4", "7/5/7", "15/5/15")
    table = {cfg: ablation_compression(LookaheadConfig.parse(cfg)) for cfg in configs}
    print("| variant | " + " | ".join(configs) + " |")
    print("|---|" + "---:|" * len(configs))
    for variant in table[configs[0]]:
        print(f"| {variant} | " + " | ".join(f"{table[c][variant]:.3f}" for c in configs) + " |")


if __name__ == "__main__":
    main()
