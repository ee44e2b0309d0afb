"""The record's one-off: engines' greedy and lookahead steps, interleaved in one process (spinning off).

    python engines_ab.py CONFIGS BLOCKS BASE_ENGINE OTHER_ENGINE [MORE_ENGINES ...]

Each engine's median step per block, and its ratio to BASE_ENGINE's in the same block; the order of the engines
reversed every block.
"""
import os
import pathlib
import statistics
import sys
import time

import numpy as np

from trt_lookahead.backends.onnxruntime import SessionSettings
from trt_lookahead.backends.open import open_engine
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.executor import StepBatch
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.sampling import SamplingParams

configs, blocks, dirs = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3:]
steps = 5

def executor(d):
    engine = open_engine(pathlib.Path(d), session=SessionSettings(threads=2, spinning=False), max_batch=1, verify=False)
    ex = engine.executor()
    ex.prefill(0, np.random.default_rng(0).integers(0, ex.vocab_size, 128), SamplingParams())
    return ex

exs = {pathlib.Path(d).name: executor(d) for d in dirs}
base = pathlib.Path(dirs[0]).name
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
ratios = {(k, label): [] for k in exs for label in batches if k != base}
for block in range(blocks):
    for label, batch in batches.items():
        med = {}
        for k in (list(exs) if block % 2 == 0 else list(exs)[::-1]):
            taken = []
            for _ in range(steps):
                start = time.perf_counter()
                exs[k].step(batch)
                taken.append(time.perf_counter() - start)
            med[k] = statistics.median(taken)
            times[(k, label)].append(med[k])
        for k in exs:
            if k != base:
                ratios[(k, label)].append(med[k] / med[base])
for label in batches:
    print(label, "ms", {k: round(statistics.median(times[(k, label)]) * 1e3, 3) for k in exs},
          f"/ {base}, median of {blocks} blocks (quartiles):",
          {k: (round(statistics.median(ratios[(k, label)]), 3),
               [round(q, 3) for q in statistics.quantiles(ratios[(k, label)], n=4)]) for k in exs if k != base})
print("load", load, "->", os.getloadavg())
