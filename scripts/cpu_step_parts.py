"""Where a CPU step's time goes: the weight products alone, the session, the host work, and step shapes by context.

    python scripts/cpu_step_parts.py [--model smollm2-135m-instruct] [--threads 2] [--steps 64]
        [--contexts 8,128,1024] [--shapes "1x4/3/4,8x2/2/2"] [--shape-contexts 16,300,1000] [--tiny-nodes 0,13]
        [--json]

On the default CPU executor of a float32 checkpoint (runtime/load.py, as `generate` opens it: the cached
onnxruntime engine), one process, medians of --steps:
- `weights`: a graph of just the engine's weight Gemms (the same initializers and attributes, one row of
  activations each, no other node), run by a session with the engine's threads and spinning: the step's
  memory-bound floor. With --tiny-nodes K,..., one such session per K with a chain of K elementwise nodes after
  each product as wide as the hidden state: the slope is what one small node costs among the streaming weights
  (a graph step has hundreds: norms, RoPE, reshapes, splits).
- per context in --contexts, a greedy step + commit in slot 0 after that many cached tokens, split into the
  session run (the step's binding run again by itself), the executor's host work around it, and the commit.
- per shape in --shapes (ROWS x W/N/G) and context in --shape-contexts, one executor step of ROWS rows of that
  lookahead config (random tokens; never committed): the cost of the wider steps `auto` chooses.
The weights-only session spins like the engine's, and a spinning session takes the cores from the other sessions
of its process after its runs: it is timed first, apart from the rest. Quote the load this prints; compare
within one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the package from this checkout, installed or not
    sys.path.insert(0, str(ROOT))

from trt_lookahead.bench.machine import machine_info  # noqa: E402
from trt_lookahead.lookahead.executor import StepBatch, row_tokens  # noqa: E402
from trt_lookahead.lookahead.sampling import SamplingParams  # noqa: E402
from trt_lookahead.model.fetch import resolve_model  # noqa: E402


def weights_only_ms(engine_dir: Path, settings: Any, steps: int, tiny: int = 0) -> tuple[float, int, int]:
    """Median ms of a session running just the engine's Gemms with a weight, one activation row each, and after each
    product as wide as the hidden state a chain of `tiny` elementwise nodes (Add and Mul by constant vectors, in
    turn): what a node costs where the weights stream through the caches. -> (ms, Gemms, tiny nodes)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    proto = onnx.load(str(engine_dir / "model.onnx"))
    weights = {init.name: init for init in proto.graph.initializer}
    gemms = [n for n in proto.graph.node if n.op_type == "Gemm" and n.input[1] in weights]
    attrs = [{a.name: helper.get_attribute_value(a) for a in node.attribute} for node in gemms]
    dims = [weights[node.input[1]].dims for node in gemms]
    widths = [(d[1], d[0]) if a.get("transB") else (d[0], d[1]) for d, a in zip(dims, attrs, strict=True)]  # (K, N)
    hidden = widths[-1][0]  # the last product is the lm_head, reading the hidden state
    nodes, outputs, used = [], [], []
    inputs: dict[int, Any] = {}  # activation width -> its graph input
    for i, (node, attr, (k, n)) in enumerate(zip(gemms, attrs, widths, strict=True)):
        inputs.setdefault(k, helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [1, k]))
        nodes.append(helper.make_node("Gemm", [f"x{k}", node.input[1]], [f"y{i}"], **attr))
        used.append(weights[node.input[1]])
        last = f"y{i}"
        for j in range(tiny if n == hidden else 0):
            constant = helper.make_tensor(f"c{i}_{j}", TensorProto.FLOAT, [n], np.full(n, 1 + 1e-3 * j, np.float32))
            nodes.append(helper.make_node("Mul" if j % 2 else "Add", [last, constant.name], [f"z{i}_{j}"]))
            used.append(constant)
            last = f"z{i}_{j}"
        outputs.append(helper.make_tensor_value_info(last, TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "weights_only", list(inputs.values()), outputs, used)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "weights.onnx"
        onnx.save(model, str(path), save_as_external_data=True, location="weights.data")
        session = ort.InferenceSession(str(path), settings.options(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feed = {f"x{k}": rng.random((1, k), np.float32) for k in inputs}
    for _ in range(5):
        session.run(None, feed)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, len(gemms), len(nodes) - len(gemms)


def greedy_parts(executor: Any, context: int, steps: int) -> dict[str, float]:
    """Median ms of greedy steps + commits after `context` tokens, and of the session run alone: after each step,
    its binding runs once more by itself (the same inputs; the next step rewrites every output), so the host
    work around the run is the step's median less the run's."""
    rng = np.random.default_rng(0)
    token = executor.prefill(0, rng.integers(0, executor.vocab_size, context), SamplingParams())
    session, step, commit = [], [], []
    for i in range(steps + 4):
        batch = StepBatch(np.array([0]), np.array([[token]]), np.array([[context + i]]),
                          np.array([[1, 2, 0]], np.int32), np.array([[0]]))
        start = time.perf_counter()
        token = int(executor.step(batch)[0, 0])
        middle = time.perf_counter()
        executor.commit(0, np.array([0]))
        end = time.perf_counter()
        binding = executor._binding(1, 1, 1)[0]  # the greedy step's own IOBinding
        executor._session.run_with_iobinding(binding)
        step.append(middle - start)
        commit.append(end - middle)
        session.append(time.perf_counter() - end)
    executor.release(0)
    timed = {"session": session, "step": step, "commit": commit}
    ms = {name: statistics.median(values[4:]) * 1e3 for name, values in timed.items()}
    return {"session": ms["session"], "host": ms["step"] - ms["session"], "commit": ms["commit"],
            "total": ms["step"] + ms["commit"]}


def shape_ms(executor: Any, rows: int, config: tuple[int, int, int], context: int, steps: int) -> float:
    """Median ms of one executor step of `rows` rows of lookahead `config` after `context` cached tokens each."""
    rng = np.random.default_rng(0)
    for slot in range(rows):
        executor.prefill(slot, rng.integers(0, executor.vocab_size, context), SamplingParams())
    configs = np.array([config] * rows, np.int32)
    T = int(row_tokens(configs, 1)[0])
    slots = np.arange(T)[None].repeat(rows, 0)
    times = []
    for _ in range(steps + 4):
        batch = StepBatch(np.arange(rows), rng.integers(0, executor.vocab_size, (rows, T)), context + slots, configs,
                          slots)
        start = time.perf_counter()
        executor.step(batch)
        times.append(time.perf_counter() - start)
    for slot in range(rows):
        executor.release(slot)
    return statistics.median(times[4:]) * 1e3


def parse_shapes(text: str) -> list[tuple[int, tuple[int, int, int]]]:
    """"1x4/3/4,8x2/2/2" -> [(1, (4, 3, 4)), (8, (2, 2, 2))]."""
    shapes = []
    for item in filter(None, text.split(",")):
        rows, config = item.split("x")
        W, N, G = (int(v) for v in config.split("/"))
        shapes.append((int(rows), (W, N, G)))
    return shapes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=64, help="timed steps per measurement")
    parser.add_argument("--contexts", default="8,128,1024", help="cached tokens of the greedy steps")
    parser.add_argument("--shapes", default="1x4/3/4,8x2/2/2", help="lookahead steps: ROWSxW/N/G, comma-separated")
    parser.add_argument("--shape-contexts", default="16,300,1000")
    parser.add_argument("--tiny-nodes", default="0", help="elementwise nodes after each hidden-wide weight product, "
                        "one weights-only session per value (0,13,26: the cost of a node among the Gemms)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from trt_lookahead.backends.onnxruntime import OnnxRuntimeExecutor
    from trt_lookahead.lookahead.config import DEFAULT
    from trt_lookahead.runtime.load import load_model

    shapes = parse_shapes(args.shapes)
    rows = max([1, *(r for r, _ in shapes)])
    executor = load_model(resolve_model(args.model), backend=None, dtype="float32", asked=None, max_seq_len=None,
                          max_batch=rows, verify=False, exact=None, tree=DEFAULT).executor
    if not isinstance(executor, OnnxRuntimeExecutor):
        raise SystemExit(f"the default CPU executor here is {type(executor).__name__}, not onnxruntime's")
    load = [os.getloadavg()[0]]
    weights, gemms = {}, 0  # tiny nodes -> ms; the weight products
    for chain in [int(v) for v in args.tiny_nodes.split(",") if v] or [0]:
        ms, gemms, tiny = weights_only_ms(executor.config.path, executor._engine.settings, args.steps, chain)
        weights[tiny] = ms
    greedy = {int(c): greedy_parts(executor, int(c), args.steps) for c in args.contexts.split(",") if c}
    shaped = {f"{r}x{'/'.join(map(str, cfg))}": {int(c): shape_ms(executor, r, cfg, int(c), args.steps)
                                                 for c in args.shape_contexts.split(",") if c} for r, cfg in shapes}
    load.append(os.getloadavg()[0])
    print(f"{args.model} float32, {args.threads} thread(s), load {load[0]:.2f} -> {load[1]:.2f}; medians, ms")
    for tiny, ms in weights.items():
        print(f"weights only ({gemms} Gemms, one row) and {tiny} tiny nodes among them: {ms:.2f}")
    if len(weights) > 1:
        counts = sorted(weights)
        slope = (weights[counts[-1]] - weights[counts[0]]) / (counts[-1] - counts[0]) * 1e3
        print(f"a tiny node among the Gemms: {slope:.2f} us")
    print("| cached tokens | session run | host | commit | step + commit |")
    print("|---:|---:|---:|---:|---:|")
    for context, parts in greedy.items():
        print(f"| {context} | {parts['session']:.2f} | {parts['host']:.3f} | {parts['commit']:.3f} "
              f"| {parts['total']:.2f} |")
    if shaped:
        contexts = list(next(iter(shaped.values())))
        print("| rows x config | " + " | ".join(f"{c} cached" for c in contexts) + " |")
        print("|---|" + "---:|" * len(contexts))
        for name, row in shaped.items():
            print(f"| {name} | " + " | ".join(f"{row[c]:.2f}" for c in contexts) + " |")
    if args.json:
        print(json.dumps({"machine": machine_info(args.threads), "load": load, "weights_only_ms": weights,
                          "gemms": gemms, "greedy": greedy, "shapes": shaped}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
