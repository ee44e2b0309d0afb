"""The per-step cost of tensor parallelism's collectives on a tiny model (docs/design.md 5.3).

    python scripts/bench_tensor_parallel.py [--model tests/fixtures/stories260K] [--tokens 64] [--rounds 3]

Greedy decoding of one prompt through the runtime, exact steps, at degree 1 (one process, one torch thread) and
degree 2 (two processes, one thread each), alternating, each round a fresh runtime: the median decode ms per token
of each, and their difference. On a model this small every step is mostly fixed costs, so the difference is what
a step's collectives cost (two all-gathers a layer, the vocab gather, the leader's broadcast of each call), not
what sharding saves. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trt_lookahead.bench.machine import load_average, machine_info  # noqa: E402
from trt_lookahead.runtime import LookaheadRuntime  # noqa: E402

PROMPT = "Once upon a time"


def decode_ms_per_token(model: str, world: int, tokens: int) -> float:
    with LookaheadRuntime.from_pretrained(model, backend="torch", exact=True, threads=world,
                                          tensor_parallel=world, lookahead="greedy") as rt:
        rt.generate(PROMPT, max_new_tokens=8)  # first-call costs out
        out = rt.generate(PROMPT, max_new_tokens=tokens)
    return out.decode_seconds * 1000 / max(out.generated_tokens - 1, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "tests" / "fixtures" / "stories260K"))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    times: dict[int, list[float]] = {1: [], 2: []}
    load = load_average()
    for _ in range(args.rounds):
        for world in (1, 2):
            times[world].append(decode_ms_per_token(args.model, world, args.tokens))
    medians = {world: statistics.median(t) for world, t in times.items()}
    print(json.dumps({"machine": machine_info(threads=1), "load_start": load, "load_end": load_average(),
                      "tokens": args.tokens, "ms_per_token": times, "median_ms": medians,
                      "collectives_ms_per_step": round(medians[2] - medians[1], 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
