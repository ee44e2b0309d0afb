"""The record's one-off: one engine's steps under (C library, graph rewrites) variants, interleaved in one process.

    python inprocess_ab.py ENGINE CONFIGS BLOCKS BASE_LIB [spinning]

BASE_LIB: the C library built from the checkout before (its `native_library().path`). Spinning off unless asked,
so that the sessions of one process do not take each other's cores. Variants: base (BASE_LIB, the exported stacks
and Reshapes), kernel (this checkout's library, the same graph), all (this checkout's library and graph).
"""

import os
import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
from trt_lookahead.backends.onnxruntime import SessionSettings
from trt_lookahead.backends.open import open_engine
from trt_lookahead.kernels import onnx_op, onnx_stack
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.executor import StepBatch
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.sampling import SamplingParams

engine_dir, configs, blocks, base_lib = pathlib.Path(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3]), sys.argv[4]
spinning = sys.argv[5:] == ["spinning"]
steps = 7 if spinning else 5
stack, after = onnx_stack.concat_stacks, onnx_op._reshape_after


def variant(lib: str | None, rewrites: bool):
    onnx_stack.concat_stacks = stack if rewrites else (lambda m: (m, 0))
    onnx_op._reshape_after = after if rewrites else (lambda m, native: {} if native else after(m, native))
    engine = open_engine(engine_dir, session=SessionSettings(threads=2, spinning=spinning), max_batch=1, verify=False)
    if lib is not None:
        engine.__dict__["native_library"] = pathlib.Path(lib)
    ex = engine.executor()
    ex.prefill(0, np.random.default_rng(0).integers(0, ex.vocab_size, 128), SamplingParams())
    return ex


exs = {"base": variant(base_lib, False), "all": variant(None, True)}
if not spinning:
    exs["kernel"] = variant(None, False)
batches = {}
for label in configs:
    config = LookaheadConfig.from_label(label)
    layout = StepLayout(config)
    batches[label] = StepBatch(np.array([0]), np.full((1, config.step_tokens), 5), (128 + layout.rel_positions)[None],
                               np.array([[config.W, config.N, config.G]], np.int32), layout.output_slots[None])
for ex in exs.values():
    for batch in batches.values():
        for _ in range(3):
            ex.step(batch)
load = os.getloadavg()
times = {(k, label): [] for k in exs for label in batches}
ratios = {(k, label): [] for k in exs for label in batches if k != "base"}
for block in range(blocks):
    for label, batch in batches.items():
        medians = {}
        for k in list(exs) if block % 2 == 0 else list(exs)[::-1]:
            taken = []
            for _ in range(steps):
                start = time.perf_counter()
                exs[k].step(batch)
                taken.append(time.perf_counter() - start)
            medians[k] = statistics.median(taken)
            times[(k, label)].append(medians[k])
        for k in exs:
            if k != "base":
                ratios[(k, label)].append(medians[k] / medians["base"])
for label in batches:
    print(label, "ms", {k: round(statistics.median(times[(k, label)]) * 1e3, 3) for k in exs},
          "/ base (median of", blocks, "blocks):",
          {k: round(statistics.median(ratios[(k, label)]), 3) for k in exs if k != "base"},
          "quartiles:", {k: [round(q, 3) for q in statistics.quantiles(ratios[(k, label)], n=4)]
                         for k in exs if k != "base"})
print("load", load, "->", os.getloadavg())
