"""gguf_blocks' and quantize_blocks' output on weights of every GGUF type the gguf package can quantize, Q4_K and
Q5_K super-blocks packed by hand, mixed rows, rows on no grid, zero and constant blocks, K not whole blocks: saved
from one checkout, compared bit for bit from another. CHUNK=n sets CHUNK_WEIGHTS (chunks down to one row).

    git stash; python gb_ref.py save ref.pkl; git stash pop
    python gb_ref.py compare ref.pkl; CHUNK=20 python gb_ref.py compare ref.pkl
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "engine"))
from test_quantize import k_quant_blocks

from trt_lookahead.engine import quantize


def outputs() -> dict:
    rng = np.random.default_rng(1)
    rows, k = 96, 1024
    cases = {}
    for bits, kind in ((4, "Q4_K"), (5, "Q5_K")):
        raw, _ = k_quant_blocks(rng, rows, k, bits)
        cases[kind] = np.asarray(quants.dequantize(raw, T[kind]), np.float32).reshape(rows, k)
    f = (rng.standard_normal((rows, k)) * 0.02).astype(np.float32)
    f[3, :64] = 0  # zero blocks
    f[7, 32:64] = 1.5  # a constant block
    for kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        cases[kind] = np.asarray(quants.dequantize(quants.quantize(f, T[kind]), T[kind]), np.float32).reshape(rows, k)
    cases["float"] = f
    cases["mixed"] = np.concatenate([cases["Q4_K"][:20], cases["Q5_0"][:10], cases["Q8_0"][:10], cases["Q4_0"][:10],
                                     f[:10], cases["Q4_1"][:10], cases["Q5_K"][:10]])
    cases["mixed2"] = np.concatenate([cases["Q4_0"][:10], cases["Q5_0"][:10], cases["Q4_K"][:10], f[:5],
                                      cases["Q4_K"][10:20]])
    cases["kplusf"] = np.concatenate([cases["Q4_K"][:40], f[:40]])
    out = {}
    for name, w in cases.items():
        for bits in (4, 8):
            b = quantize.gguf_blocks(w, bits)
            out[name, bits] = None if b is None else (b.codes, b.scales, b.zero_points, b.bits, b.k, b.grid, b.mins)
    for name, w in (("f", f), ("f1000", f[:, :1000]), ("f17", f[:, :17])):
        for bits in (4, 8):
            b = quantize.quantize_blocks(w, bits)
            out["quantize_blocks", name, bits] = (b.codes, b.scales, b.zero_points, b.bits, b.k, b.grid, b.mins)
    return out


def same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    return a == b


def main() -> None:
    if os.environ.get("CHUNK"):
        quantize.CHUNK_WEIGHTS = int(os.environ["CHUNK"])
    action, path = sys.argv[1], Path(sys.argv[2])
    out = outputs()
    if action == "save":
        path.write_bytes(pickle.dumps(out))
        return
    ref = pickle.loads(path.read_bytes())
    assert ref.keys() == out.keys()
    for key, theirs in ref.items():
        ours = out[key]
        assert (theirs is None) == (ours is None), key
        assert theirs is None or all(same(a, b) for a, b in zip(theirs, ours, strict=True)), key
    print(f"identical: {len(ref)} outputs (CHUNK_WEIGHTS {quantize.CHUNK_WEIGHTS})")


if __name__ == "__main__":
    main()
