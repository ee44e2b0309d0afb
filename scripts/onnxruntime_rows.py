#!/usr/bin/env python3
"""Is onnxruntime's CPU MatMul row-invariant? Row r of an M-row product against the same row alone, bit for bit.

    python scripts/onnxruntime_rows.py [--dtype float32] [--threads 1,2]

The projections of SmolLM2-135M (576 -> 576, 576 -> 1536, 1536 -> 576, 576 -> 49152), random weights and
inputs, M = 1 .. 128, rows 0, M // 2 and M - 1. Prints each shape's differing (M, row, max |diff|), none if
invariant: the evidence for what the engine path would need besides attention (docs/design.md section 4.2).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

SHAPES = [(576, 576), (576, 1536), (1536, 576), (576, 49152)]
ROWS = [1, 2, 3, 4, 5, 8, 16, 17, 56, 120, 128]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    elem = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[args.dtype]
    rng = np.random.default_rng(0)
    for K, N in SHAPES:
        w = (rng.standard_normal((K, N)) * 0.05).astype(args.dtype)
        graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "matmul",
                                  [helper.make_tensor_value_info("x", elem, ["M", K])],
                                  [helper.make_tensor_value_info("y", elem, ["M", N])],
                                  [numpy_helper.from_array(w, "w")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
        x = rng.standard_normal((max(ROWS), K)).astype(args.dtype)
        for threads in (int(t) for t in args.threads.split(",")):
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
            differ = []
            for M in ROWS:
                y = session.run(None, {"x": x[:M]})[0]
                for r in sorted({0, M // 2, M - 1}):
                    alone = session.run(None, {"x": x[r : r + 1]})[0][0]
                    if not np.array_equal(y[r], alone):
                        differ.append((M, r, float(np.abs(y[r].astype(np.float64) - alone).max())))
            print(json.dumps({"onnxruntime": ort.__version__, "dtype": args.dtype, "K": K, "N": N,
                              "threads": threads, "differing": differ}), flush=True)


if __name__ == "__main__":
    main()
