"""Profile the default CPU path's greedy step (one stream, T = 1): where a token's time goes.

    python scripts/profile_cpu_step.py [--model smollm2-135m-instruct|stories260K|DIR] [--threads 2]
        [--context 128] [--steps 60] [--torch eager,compiled] [--variants "spinning=0"] [--max-seq-len 512] [--json]

Reports, for the executor the default CPU path runs on a float32 checkpoint (runtime/load.py's
`checkpoint_backend`; its cached engine, built first if needed):
- which executor and why, and the engine dir;
- the graph's node count by op type: as stored (model.onnx), as onnxruntime receives it (LookaheadAttention
  decomposed, backends/onnxruntime.py `OnnxRuntimeEngine.graph`) and after onnxruntime's own graph
  optimisations at the session's level (its optimised model, written to a temporary file);
- per greedy step, from onnxruntime's profiler (a second session of the same engine with
  SessionSettings(profile_prefix=...)): kernel time by op type, node count per run, and the time in the
  projections (Gemm, MatMul and FusedMatMul with a weight initializer) against the weights' bytes / this
  machine's read bandwidth (trt_lookahead/bench/machine.py `read_bandwidth_gbps`);
- the split of a step's wall time: the executor's `step` (host work: staging, binding, token choice) against
  the session's `run_with_iobinding` alone, and onnxruntime's model_run against the sum of its kernels
  (its executor's per-node overhead);
- the torch CPU executor's greedy step on the same checkpoint (--torch: `eager`, the packed step; `compiled`,
  the padded step under torch.compile, compiled before timing), and onnxruntime sessions of the same engine
  with other SessionSettings (--variants, as scripts/bench_onnxruntime.py takes them: `spinning=1` has the
  intra-op workers spin instead of sleep between parallel sections), timed interleaved with the default step,
  round by round, so machine load hits every variant alike. A variant that fails is reported with its reason.
  torch's variants share the process with onnxruntime's, and torch's OpenMP workers spin after each parallel
  region, taking the cores from onnxruntime's next node (and onnxruntime's spinning workers from torch): time
  them in a run of their own (`--torch eager,compiled --variants ""`), onnxruntime's variants with `--torch ""`
  (the default). Spinning onnxruntime sessions (the default executor's spins on a quiet machine,
  SessionSettings.spins) take the cores from the other sessions here too: compare spinning settings in
  processes of their own (scripts/cpu_step_vs_llama.py --variants, one setting per run).

Every slot holds `--context` random tokens; every timed step is the same greedy step, never committed.
Quote the load it prints (the machine is often shared): compare variants within one run only.
--json prints one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the package from this checkout, installed or not
    sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_onnxruntime import parse_variants  # noqa: E402  the --variants syntax of the session settings' bench

from trt_lookahead.bench.machine import machine_info, read_bandwidth_gbps  # noqa: E402
from trt_lookahead.lookahead.executor import StepBatch  # noqa: E402
from trt_lookahead.lookahead.sampling import SamplingParams  # noqa: E402

ROUND = 3  # steps per variant per turn
# op types that multiply by a weight when one input is one: float, onnxruntime's quantized and our C kernel's
PROJECTIONS = ("Gemm", "MatMul", "FusedMatMul", "MatMulNBits", "QuantizedMatMul")


def model_dir(name: str) -> Path:
    if name == "stories260K":
        return ROOT / "tests" / "fixtures" / "stories260K"
    from trt_lookahead.model.fetch import resolve_model

    return resolve_model(name)


def greedy_batch(context: int) -> StepBatch:
    """One greedy row (1, 2, 0) of one token at position `context` in slot 0."""
    return StepBatch(np.array([0]), np.array([[5]]), np.array([[context]]), np.array([[1, 2, 0]], np.int32),
                     np.array([[0]]))


def op_counts(proto: Any) -> dict[str, int]:
    counts = collections.Counter((f"{n.domain}:" if n.domain else "") + n.op_type for n in proto.graph.node)
    return dict(counts.most_common())


def optimized_counts(engine: Any, proto: Any) -> dict[str, int]:
    """Node counts of the graph after onnxruntime's optimisations at the engine's settings."""
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        options = engine.session_options(engine.settings)
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return op_counts(onnx.load(options.optimized_model_filepath, load_external_data=False))


def projections(proto: Any) -> tuple[set[str], int]:
    """(the names of the nodes that multiply by a weight initializer, the bytes of those weights): what a greedy
    token must stream from memory (the lm_head included)."""
    from onnx.helper import tensor_dtype_to_np_dtype

    sizes = {t.name: int(np.prod(t.dims)) * tensor_dtype_to_np_dtype(t.data_type).itemsize
             for t in proto.graph.initializer}
    nodes = [n for n in proto.graph.node if n.op_type in PROJECTIONS and len(n.input) > 1 and n.input[1] in sizes]
    # a quantized product's scales, zero points and mins are initializers it streams too
    weights = {name for n in nodes for name in n.input[1:] if name in sizes}
    return {n.name for n in nodes}, sum(sizes[name] for name in weights)


def profile_by_op(path: str, runs: int, weighted: set[str]) -> dict[str, Any]:
    """onnxruntime's profile JSON -> per-run kernel time and node count by op type (the projections, nodes named in
    `weighted`, apart as "<op> (weights)"), and model_run's time."""
    events = json.loads(Path(path).read_text())
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    model_runs = [e["dur"] for e in events if e.get("cat") == "Session" and e["name"] == "model_run"][-runs:]
    us: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    total_runs = sum(1 for e in events if e.get("cat") == "Session" and e["name"] == "model_run")
    for e in nodes:
        op = e["args"]["op_name"]
        if e["name"].removesuffix("_kernel_time") in weighted:
            op = f"{op} (weights)"
        us[op] += e["dur"]
        count[op] += 1
    per_run = {op: {"nodes": round(count[op] / total_runs, 1), "ms": round(us[op] / total_runs / 1e3, 3)}
               for op in sorted(us, key=lambda k: -us[k])}
    kernels_ms = sum(us.values()) / total_runs / 1e3
    return {"by_op": per_run, "kernels_ms": round(kernels_ms, 3),
            "model_run_ms": round(statistics.median(model_runs) / 1e3, 3),
            "nodes_per_run": round(sum(count.values()) / total_runs, 1)}


def onnxruntime_profile(engine_dir: Path, threads: int, context: int, runs: int, max_seq_len: int,
                        weighted: set[str]) -> dict[str, Any]:
    """A profiled session of the engine: the greedy step's kernels by op type (see the module docstring)."""
    from trt_lookahead.backends.onnxruntime import OnnxRuntimeEngine, SessionSettings
    from trt_lookahead.backends.open import open_engine

    with tempfile.TemporaryDirectory() as tmp:
        engine = open_engine(engine_dir, session=SessionSettings(threads=threads, profile_prefix=f"{tmp}/ort"),
                             max_seq_len=max_seq_len, max_batch=1, verify=False)
        assert isinstance(engine, OnnxRuntimeEngine)
        ex = engine.executor()
        ex.prefill(0, np.random.default_rng(0).integers(0, ex.vocab_size, context), SamplingParams())
        batch = greedy_batch(context)
        for _ in range(runs):
            ex.step(batch)
        return profile_by_op(engine.session().end_profiling(), runs, weighted)


class Variant:
    """One executor and how to time its greedy step; `run_only` times the bare session run (onnxruntime)."""

    def __init__(self, name: str, executor: Any, context: int, run_only: Any = None) -> None:
        self.name, self.ex, self.batch, self.run_only = name, executor, greedy_batch(context), run_only
        executor.prefill(0, np.random.default_rng(0).integers(0, executor.vocab_size, context), SamplingParams())
        executor.step(self.batch)  # first step: bindings, or the compile
        self.times: list[float] = []

    def turn(self) -> None:
        for _ in range(ROUND):
            t0 = time.perf_counter()
            if self.run_only is None:
                self.ex.step(self.batch)
            else:
                self.run_only()
            self.times.append(time.perf_counter() - t0)

    def median_ms(self) -> float:
        return round(statistics.median(self.times) * 1e3, 3)


def torch_variant(kind: str, model: Path, threads: int, context: int, max_seq_len: int) -> Variant:
    from trt_lookahead.runtime.load import load_model

    t0 = time.perf_counter()
    loaded = load_model(model, backend="torch", dtype="float32", asked=None, max_seq_len=max_seq_len, max_batch=1,
                        verify=False, exact=False, tree=None, compile=kind == "compiled", device="cpu")
    variant = Variant(f"torch_{kind}", loaded.executor, context)
    variant.setup_s = round(time.perf_counter() - t0, 1)  # type: ignore[attr-defined]
    return variant


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=128, help="cached tokens in the slot while timing")
    parser.add_argument("--steps", type=int, default=60, help="timed greedy steps per variant")
    parser.add_argument("--torch", default="", help="torch executor variants to time: eager, compiled")
    parser.add_argument("--variants", default="", help="onnxruntime session settings to time too")
    parser.add_argument("--max-seq-len", type=int, default=512, help="the torch executors' KV length")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from trt_lookahead.lookahead.config import DEFAULT
    from trt_lookahead.runtime.load import checkpoint_backend, load_model

    path = model_dir(args.model)
    backend, why = checkpoint_backend(None, "float32")
    report: dict[str, Any] = {"model": path.name, "threads": args.threads, "context": args.context,
                              "default_cpu_backend": backend, "why": why, "machine": machine_info(args.threads)}
    if backend != "onnxruntime":
        raise SystemExit(f"the default CPU path runs {backend} ({why}); this script profiles onnxruntime's step")
    # the default path exactly as `generate` opens it (its cached engine, the runtime's max_seq_len and max_batch)
    default = load_model(path, backend=None, dtype="float32", asked=None, max_seq_len=None, max_batch=None,
                         verify=False, exact=None, tree=DEFAULT)
    from trt_lookahead.backends.onnxruntime import OnnxRuntimeEngine, OnnxRuntimeExecutor, SessionSettings
    from trt_lookahead.backends.open import open_engine

    ex = default.executor
    assert isinstance(ex, OnnxRuntimeExecutor)
    engine_dir = ex.config.path
    report["engine"] = str(engine_dir)
    session = ex._session  # the executor's own session: its bare run, for the host split
    binding = ex._binding(1, 1, 1)[0]  # (B, T, K) = (1, 1, 1): the greedy step's binding
    import onnx

    opened = open_engine(engine_dir, verify=False, threads=args.threads)
    assert isinstance(opened, OnnxRuntimeEngine)
    stored = onnx.load(str(opened.config.graph), load_external_data=False)
    decomposed = opened.graph()
    report["nodes"] = {"stored": sum(op_counts(stored).values()), "decomposed": sum(op_counts(decomposed).values())}
    optimized = optimized_counts(opened, decomposed)
    report["nodes"]["optimized"] = sum(optimized.values())
    report["nodes_by_op"] = {"stored": op_counts(stored), "decomposed": op_counts(decomposed), "optimized": optimized}

    variants = [Variant("onnxruntime_step", ex, args.context),
                Variant("onnxruntime_session_run", ex, args.context, lambda: session.run_with_iobinding(binding))]
    for name, fields in parse_variants(args.variants).items():
        if fields:  # "default" is the executor above
            settings = SessionSettings(threads=args.threads, **fields)  # type: ignore[arg-type]
            engine = open_engine(engine_dir, session=settings, max_seq_len=args.max_seq_len, max_batch=1, verify=False)
            variants.append(Variant(f"onnxruntime_{name}", engine.executor(), args.context))
    failed: dict[str, str] = {}
    for kind in filter(None, args.torch.split(",")):
        try:
            variants.append(torch_variant(kind, path, args.threads, args.context, args.max_seq_len))
        except Exception as exc:  # a variant that cannot run is reported, not fatal
            failed[f"torch_{kind}"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            traceback.print_exc(file=sys.stderr)
    report["load_start"] = os.getloadavg()
    for _ in range(-(-args.steps // ROUND)):
        for variant in variants:
            variant.turn()
    report["load_end"] = os.getloadavg()
    report["ms_per_step"] = {v.name: v.median_ms() for v in variants}
    report["setup_s"] = {v.name: v.setup_s for v in variants if hasattr(v, "setup_s")}
    report["failed"] = failed
    step, run = report["ms_per_step"]["onnxruntime_step"], report["ms_per_step"]["onnxruntime_session_run"]
    report["host_ms_outside_run"] = round(step - run, 3)

    weighted, weight_bytes = projections(decomposed)
    profile = onnxruntime_profile(engine_dir, args.threads, args.context, args.steps, args.max_seq_len, weighted)
    report["profile"] = profile
    bandwidth = read_bandwidth_gbps()
    projection_ms = sum(v["ms"] for op, v in profile["by_op"].items() if op.endswith("(weights)"))
    limit_ms = weight_bytes / bandwidth / 1e6
    report["memory"] = {"read_bandwidth_gbps": round(bandwidth, 1), "weight_bytes": weight_bytes,
                        "projection_limit_ms": round(limit_ms, 3), "projection_ms": round(projection_ms, 3),
                        "projection_ms_over_limit": round(projection_ms / limit_ms, 2),
                        "step_ms_over_limit": round(step / limit_ms, 2),
                        "other_kernels_ms": round(profile["kernels_ms"] - projection_ms, 3),
                        "run_overhead_ms": round(profile["model_run_ms"] - profile["kernels_ms"], 3)}

    print(f"{path.name}: greedy step at context {args.context}, {args.threads} thread(s), "
          f"{report['machine']['cpu']}, load {report['load_start']} -> {report['load_end']}")
    print(f"default CPU executor: {backend} ({why}); engine {engine_dir}")
    print(f"nodes: stored {report['nodes']['stored']}, decomposed {report['nodes']['decomposed']}, "
          f"after onnxruntime's optimisations {report['nodes']['optimized']} (profiled: "
          f"{profile['nodes_per_run']} per run)")
    print("ms per greedy step: " + ", ".join(f"{k} {v}" for k, v in report["ms_per_step"].items()))
    for name, reason in failed.items():
        print(f"  {name} failed: {reason}")
    print(f"host outside the session run: {report['host_ms_outside_run']} ms; profiled model_run "
          f"{profile['model_run_ms']} ms, its kernels {profile['kernels_ms']} ms")
    mem = report["memory"]
    print(f"projections (nodes with a weight): {len(weighted)}, {mem['projection_ms']} ms against "
          f"{weight_bytes / 1e6:.0f} MB / {mem['read_bandwidth_gbps']} GB/s = {mem['projection_limit_ms']} ms "
          f"({mem['projection_ms_over_limit']}x); other kernels {mem['other_kernels_ms']} ms")
    print("| op | nodes per step | ms per step |")
    print("|---|---:|---:|")
    for op, v in profile["by_op"].items():
        print(f"| {op} | {v['nodes']} | {v['ms']} |")
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
