"""`auto` against greedy on one `serve`, alternating round by round: paired tok/s ratios under the same load.

    python scripts/served_ab.py [--model smollm2-135m-instruct] [--dataset humaneval,mt_bench] [--limit 8]
        [--max-new-tokens 128] [--concurrency 8] [--rounds 8] [--threads 2] [--weights float|int8|int4] [--json]

`trt-lookahead bench` measures each arm once, a minute apart, and this VM's speed drifts 5-15% between minutes:
too much to tell 0.95x from 1.0x. Here one server (bench's own `serve` command line, `auto` by default, greedy
requests sending `"lookahead": false`) runs both arms, each round every set once per arm, the arms' order swapped
every round, each level `--concurrency` client threads in a closed loop over the set's prompts (streaming,
temperature 0). Per set it prints each round's `auto` / greedy speed (greedy seconds / `auto` seconds: the
answers are the same tokens), their median, and whether every `auto` answer equalled greedy's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the package from this checkout, installed or not
    sys.path.insert(0, str(ROOT))

from trt_lookahead.bench.bench import plan_bench  # noqa: E402
from trt_lookahead.bench.machine import machine_info  # noqa: E402
from trt_lookahead.bench.openai_stream import run_level, stream_completion  # noqa: E402
from trt_lookahead.bench.servers import ServerProcess, serve_argv  # noqa: E402
from trt_lookahead.files import free_port  # noqa: E402

ARMS = {"greedy": False, "auto": True}  # the request's "lookahead" field


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dataset", default="humaneval,mt_bench")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weights", default="float", help="the served engine's weights (serve --weights)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    plan = plan_bench(args.model, datasets=args.dataset, limit=args.limit, max_new_tokens=args.max_new_tokens)
    port = free_port()
    argv = serve_argv(plan.model_path, port, args.threads, args.concurrency, "float32", plan.max_seq_len,
                      extra=["--weights", args.weights])
    body = {"temperature": 0.0, "seed": 0, "model": plan.model_path.name, "max_tokens": args.max_new_tokens}
    seconds: dict[tuple[str, str], list[float]] = {}
    texts: dict[tuple[str, str], list[list[str]]] = {}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as logs, ServerProcess("serve", argv, port, Path(logs)) as server:
        first = next(iter(plan.prompts.values()))[0]
        for lookahead in ARMS.values():  # warm both paths
            stream_completion(server.url, {**body, "prompt": list(first), "max_tokens": 8, "lookahead": lookahead})
        for r in range(args.rounds):
            arms = list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]
            for dataset, prompts in plan.prompts.items():
                for arm in arms:
                    answers, wall = run_level(server.url, prompts, args.concurrency, {**body, "lookahead": ARMS[arm]})
                    seconds.setdefault((dataset, arm), []).append(wall)
                    texts.setdefault((dataset, arm), []).append([a.text for a in answers])
            load.append(os.getloadavg()[0])
            print(f"round {r + 1}: " + ", ".join(f"{d} {a} {seconds[(d, a)][-1]:.2f} s" for d, a in seconds)
                  + f"; load {load[-1]:.2f}", flush=True)
    summary = {}
    for dataset in plan.prompts:
        greedy, auto = seconds[(dataset, "greedy")], seconds[(dataset, "auto")]
        ratios = [g / a for g, a in zip(greedy, auto, strict=True)]
        same = texts[(dataset, "greedy")] == texts[(dataset, "auto")]
        summary[dataset] = {"ratios": ratios, "median": statistics.median(ratios), "identical": same}
        print(f"{dataset}: auto / greedy median {statistics.median(ratios):.3f}x (rounds "
              f"{min(ratios):.3f}-{max(ratios):.3f}), every answer identical: {same}")
    print(f"{args.concurrency} streams, {args.rounds} rounds, load {load[0]:.2f} -> {load[-1]:.2f}")
    if args.json:
        print(json.dumps({"machine": machine_info(args.threads), "load": load, "summary": summary,
                          "seconds": {f"{d}/{a}": v for (d, a), v in seconds.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
