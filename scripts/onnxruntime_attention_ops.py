#!/usr/bin/env python3
"""Which onnxruntime CPU ops does the exact decomposition rely on, and are they row-invariant? Bit for bit.

    python scripts/onnxruntime_attention_ops.py [--threads 1,2]

MatMul of two activations (no prepacked weight), as attention runs it (kernels/onnx_op.py, exact=True):
  rows       row r of an M-row product against row r of a 4-row one, 2-D, batched 3-D/4-D, broadcast B
  columns    one dot product at any row and column of products of M x N (M, N >= 2), 2-D and batched
  zeros      K-reductions: a row's nonzero terms in the same order with zeros anywhere in between, K <= 128,
             against the compact product (a key block with step keys placed among its cached keys)
  wide K     the same for K > 128 (expected to differ: K is split into panels)
  tail       a ones row times blocks (the block sum): a row's nonzero prefix followed by zeros to any K, 128 and
             more included, against the compact product (expected: none differ)
Exp of a value at any position of any length; exp(-inf). Prints one JSON line per check: the failing cases
(expected: M = 1 and N = 1, which take another path, and wide K).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper


def session(op: str, inputs: list[str], threads: int):
    graph = helper.make_graph([helper.make_node(op, inputs, ["c"])], op,
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in inputs],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for threads in (int(t) for t in args.threads.split(",")):
        mm = session("MatMul", ["a", "b"], threads)

        def run(a: np.ndarray, b: np.ndarray, mm=mm) -> np.ndarray:
            return mm.run(None, {"a": a, "b": b})[0]

        rows = []
        for K, N in [(64, 16), (64, 65), (8, 64), (64, 1), (128, 65)]:
            b = rng.standard_normal((K, N)).astype(np.float32)
            a = rng.random((300, K)).astype(np.float32)
            a[a < 0.5] = 0  # probabilities: many exact zeros
            for M in (1, 2, 3, 4, 5, 17, 56, 200, 300):
                got = {"2d": run(a[:M], b), "3d": run(np.stack([a[:M]] * 3), np.stack([b] * 3))[1],
                       "4d": run(np.stack([a[:M]] * 6).reshape(2, 3, M, K),
                                 np.stack([b] * 6).reshape(2, 3, K, N))[1, 2],
                       "broadcast": run(np.stack([a[:M]] * 3), b)[2]}
                for r in {0, M // 2, M - 1}:
                    ref = run(np.vstack([a[r : r + 1], a[:3]]), b)[0]  # row r first of a 4-row product
                    rows += [(K, N, M, r, how) for how, c in got.items() if not np.array_equal(c[r], ref)]
        print(json.dumps({"threads": threads, "check": "rows", "differing (K, N, M, row, how)": rows}), flush=True)

        columns = []
        for D in (8, 64):
            q, k = rng.standard_normal(D).astype(np.float32), rng.standard_normal(D).astype(np.float32)
            for N in (1, 2, 3, 17, 64, 65, 120):
                for M in (1, 2, 3, 100):
                    A = rng.standard_normal((M, D)).astype(np.float32)
                    B = rng.standard_normal((D, N)).astype(np.float32)
                    r, c = int(rng.integers(M)), int(rng.integers(N))
                    A[r], B[:, c] = q, k
                    ref = run(np.stack([q, q]), np.stack([k, k], 1))[0, 0]
                    if run(A, B)[r, c] != ref:
                        columns.append((D, M, N))
        print(json.dumps({"threads": threads, "check": "columns", "differing (D, M, N)": columns}), flush=True)

        for name, widths in (("zeros", (64, 65, 80, 100, 120, 128)), ("wide K", (200, 256, 300, 1024))):
            differ = []
            for nz in (5, 40, 64):
                v, p = rng.standard_normal((nz, 65)).astype(np.float32), rng.random(nz).astype(np.float32)
                compact = np.vstack([p, rng.random((2, nz), np.float32)])
                ref = run(compact, v)[0]
                for K in (k for k in widths if k >= nz):
                    idx = np.sort(rng.choice(K, nz, replace=False))
                    a = rng.random((int(rng.integers(2, 100)), K)).astype(np.float32)
                    a[0], a[0, idx] = 0, p
                    b = rng.standard_normal((K, 65)).astype(np.float32)
                    b[idx] = v
                    if not np.array_equal(run(a, b)[0], ref):
                        differ.append((nz, K))
            print(json.dumps({"threads": threads, "check": name, "differing (nonzeros, K)": differ}), flush=True)

        tail = []
        for nz in (1, 2, 5, 17, 100, 129, 200):
            blocks = (rng.standard_normal((nz, 390)) * np.exp(rng.uniform(-8, 8, (nz, 390)))).astype(np.float32)
            ref = run(np.ones((2, nz), np.float32), blocks)[0]
            for K in (k for k in (nz + 1, nz + 3, 128, 130, 256, 300) if k >= nz):
                padded = np.vstack([blocks, np.zeros((K - nz, 390), np.float32)])
                if not np.array_equal(run(np.ones((2, K), np.float32), padded)[0], ref):
                    tail.append((nz, K))
        print(json.dumps({"threads": threads, "check": "tail", "differing (nonzeros, K)": tail}), flush=True)

        ex = session("Exp", ["a"], threads)
        x = (rng.standard_normal(100000) * 10).astype(np.float32)
        full = ex.run(None, {"a": x})[0]
        moved = [(s, n) for s, n in [(0, 1), (3, 5), (7, 13), (1, 64), (5, 1000), (17, 33333)]
                 if not np.array_equal(ex.run(None, {"a": x[s : s + n]})[0], full[s : s + n])]
        zero = ex.run(None, {"a": np.array([-np.inf], np.float32)})[0][0]
        print(json.dumps({"threads": threads, "check": "exp", "differing (start, length)": moved,
                          "exp(-inf)": float(zero)}), flush=True)


if __name__ == "__main__":
    main()
