"""Our greedy token against llama.cpp's on the same weights, same threads, same machine, round by round.

    python scripts/cpu_step_vs_llama.py [--model smollm2-135m-instruct] [--threads 2] [--tokens 64] [--rounds 5]
        [--spinning auto|on|off] [--variants "prepacking=0"] [--llama-bench PATH] [--context 128] [--json]

Each round runs llama.cpp's `llama-bench -p 0 -n TOKENS` (text generation only, F32 GGUF of the checkpoint:
bench/servers.py `cached_gguf`) and then, for the default CPU executor (runtime/load.py, as `generate` opens
it) and each onnxruntime session variant (`--variants`, the syntax of scripts/bench_onnxruntime.py), TOKENS
greedy steps after a `--context`-token prompt, each step followed by its commit: a decode token as a server
runs it, host work included. Rounds alternate the engines so that machine load hits them alike; the table
gives each round's ms per token and the median ratio to llama.cpp's. llama-bench's own spinning threads and
ours compete with whatever else runs: quote the load it prints, compare within one run only. Sessions whose
workers spin (ours does on a quiet machine: SessionSettings.spins) take the cores from the other sessions of
the process after their runs: compare spinning settings one process each (--spinning on, then off, ...), not as
--variants of one run.

llama-bench is looked up as --llama-bench, else beside the llama-server that `bench --peers llama-server`
finds (scripts/build_llama_cpp.sh builds both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the package from this checkout, installed or not
    sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_onnxruntime import parse_variants  # noqa: E402  the --variants syntax of the session settings' bench

from trt_lookahead.bench.machine import machine_info  # noqa: E402
from trt_lookahead.lookahead.executor import StepBatch  # noqa: E402
from trt_lookahead.lookahead.sampling import SamplingParams  # noqa: E402
from trt_lookahead.model.fetch import model_dir  # noqa: E402


def find_llama_bench(path: str | None) -> Path:
    if path:
        return Path(path)
    from trt_lookahead.bench.servers import find_llama_server

    server = find_llama_server(None)
    for folder in (server.parent, server.parent.parent / "build" / "bin"):
        if (folder / "llama-bench").is_file():
            return folder / "llama-bench"
    raise SystemExit(f"no llama-bench beside {server}; give --llama-bench PATH")


def llama_ms_per_token(binary: Path, gguf: Path, threads: int, tokens: int) -> float:
    """llama-bench's mean ms per generated token (one repetition of tg TOKENS)."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", "1",
                          "-o", "json"], check=True, capture_output=True, text=True).stdout
    return 1e3 / float(json.loads(out)[0]["avg_ts"])


def decode_ms_per_token(executor: Any, context: int, tokens: int) -> float:
    """Median ms of TOKENS greedy step + commit pairs after a `context`-token prompt (the slot released after)."""
    rng = np.random.default_rng(0)
    token = executor.prefill(0, rng.integers(0, executor.vocab_size, context), SamplingParams())
    times = []
    for i in range(tokens):
        batch = StepBatch(np.array([0]), np.array([[token]]), np.array([[context + i]]),
                          np.array([[1, 2, 0]], np.int32), np.array([[0]]))
        t0 = time.perf_counter()
        token = int(executor.step(batch)[0, 0])
        executor.commit(0, np.array([0]))
        times.append(time.perf_counter() - t0)
    executor.release(0)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per engine per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--context", type=int, default=128, help="our prompt's length (llama-bench starts empty)")
    parser.add_argument("--spinning", choices=["auto", "on", "off"], default="auto",
                        help="our executor's workers: as the default path decides (auto), or forced")
    parser.add_argument("--variants", default="", help="onnxruntime session settings to time beside the default")
    parser.add_argument("--llama-bench", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from trt_lookahead.backends.onnxruntime import OnnxRuntimeExecutor, SessionSettings
    from trt_lookahead.backends.open import open_engine
    from trt_lookahead.bench.servers import cached_gguf
    from trt_lookahead.lookahead.config import DEFAULT
    from trt_lookahead.runtime.load import load_model

    path = model_dir(args.model)
    binary, gguf = find_llama_bench(args.llama_bench), cached_gguf(path, "float32")
    default = load_model(path, backend=None, dtype="float32", asked=None, max_seq_len=None, max_batch=None,
                         verify=False, exact=None, tree=DEFAULT).executor
    if args.spinning != "auto" and isinstance(default, OnnxRuntimeExecutor):
        forced = SessionSettings(threads=args.threads, spinning=args.spinning == "on")
        default = open_engine(default.config.path, session=forced, max_batch=1, verify=False).executor()
    executors: dict[str, Any] = {f"ours (spinning {args.spinning})": default}
    if isinstance(default, OnnxRuntimeExecutor):
        for name, fields in parse_variants(args.variants).items():
            if fields:
                settings = SessionSettings(threads=args.threads, **fields)  # type: ignore[arg-type]
                engine = open_engine(default.config.path, session=settings, max_batch=1, verify=False)
                executors[f"ours {name}"] = engine.executor()
    for executor in executors.values():  # warm: bindings, arenas
        decode_ms_per_token(executor, args.context, 4)
    rounds: list[dict[str, float]] = []
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        row = {"llama.cpp": llama_ms_per_token(binary, gguf, args.threads, args.tokens)}
        row |= {name: decode_ms_per_token(ex, args.context, args.tokens) for name, ex in executors.items()}
        rounds.append(row)
        load.append(os.getloadavg()[0])
    names = list(rounds[0])
    median = {name: statistics.median(r[name] for r in rounds) for name in names}
    ratio = {name: statistics.median(r[name] / r["llama.cpp"] for r in rounds) for name in names}
    print(f"{path.name} float32, {args.threads} thread(s), {args.tokens} tokens per engine per round, "
          f"load {' -> '.join(f'{v:.1f}' for v in load)}; ms per token")
    print("| round | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for i, r in enumerate(rounds):
        print(f"| {i + 1} | " + " | ".join(f"{r[n]:.2f}" for n in names) + " |")
    print("| median | " + " | ".join(f"{median[n]:.2f}" for n in names) + " |")
    print("| median ratio to llama.cpp | " + " | ".join(f"{ratio[n]:.3f}x" for n in names) + " |")
    if args.json:
        print(json.dumps({"machine": machine_info(args.threads), "load": load, "rounds": rounds, "median": median,
                          "ratio": ratio, "spinning": args.spinning}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
