"""Each GGUF type's reader (engine/quantize.py gguf_blocks) and quantize_blocks on one 1024 x 4096 weight, ns a
weight, the median of 5; run once from each checkout (PYTHONPATH=<worktree> for the other one). Q4_K / Q5_K
values are random super-blocks packed as llama.cpp lays them out (tests/engine/test_quantize.py's helper), the
others the gguf package's own quantizer on Gaussian weights.

    python readers.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "engine"))
from test_quantize import k_quant_blocks

import trt_lookahead.engine.quantize as quantize


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows, k = 1024, 4096
    weights = {}
    for kind, bits in (("Q4_K", 4), ("Q5_K", 5)):
        raw, _ = k_quant_blocks(rng, rows, k, bits)
        weights[kind] = np.asarray(quants.dequantize(raw, T[kind]), np.float32).reshape(rows, k)
    floats = (rng.standard_normal((rows, k)) * 0.02).astype(np.float32)
    for kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        weights[kind] = np.asarray(quants.dequantize(quants.quantize(floats, T[kind]), T[kind]),
                                   np.float32).reshape(rows, k)
    print(f"code: {quantize.__file__}")
    for kind, w in [*weights.items(), ("float (quantize_blocks)", floats)]:
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            blocks = quantize.weight_blocks(w, 4)
            times.append(time.perf_counter() - start)
        print(f"{kind:24s} {statistics.median(times) / w.size * 1e9:6.1f} ns a weight  ({blocks.grid})")


if __name__ == "__main__":
    main()
