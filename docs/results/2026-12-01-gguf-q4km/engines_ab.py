"""Scratch: two engines' greedy and lookahead steps, interleaved in one process (spinning off).

    python engines_ab.py BASE_ENGINE NEW_ENGINE CONFIGS BLOCKS
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

base_dir, new_dir, configs, blocks = sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4])
steps = 5

def executor(d):
    engine = open_engine(pathlib.Path(d), session=SessionSettings(threads=2, spinning=False), max_batch=1, verify=False)
    ex = engine.executor()
    ex.prefill(0, np.random.default_rng(0).integers(0, ex.vocab_size, 128), SamplingParams())
    return ex

exs = {"base": executor(base_dir), "new": executor(new_dir)}
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
ratios = {label: [] for label in batches}
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
        ratios[label].append(med["new"] / med["base"])
for label in batches:
    print(label, "ms", {k: round(statistics.median(times[(k, label)]) * 1e3, 3) for k in exs},
          "new/base median of", blocks, "blocks:", round(statistics.median(ratios[label]), 3),
          "quartiles", [round(q, 3) for q in statistics.quantiles(ratios[label], n=4)])
print("load", load, "->", os.getloadavg())
