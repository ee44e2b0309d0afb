"""A Q4_K_M file's fused QKV whose attn_v is Q6_K: rms error of the int4 weight against the file's numbers, per
part (over the part's rms), quantized all here (the rule before 2026-12-02) and with the kept rows (gguf_blocks now).
python qkv_rows.py FILE.gguf"""
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from trt_lookahead.engine.quantize import gguf_blocks, quantize_blocks

tensors = {t.name: t for t in GGUFReader(sys.argv[1]).tensors}
for layer in range(1000):
    if f"blk.{layer}.attn_q.weight" not in tensors:
        break
    parts, kinds = {}, []
    for p in "qkv":
        t = tensors[f"blk.{layer}.attn_{p}.weight"]
        parts[p] = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(int(t.shape[1]), int(t.shape[0]))
        kinds.append(t.tensor_type.name)
    w = np.concatenate(list(parts.values()))  # rows q, k, v as the exported QKV Gemm holds them
    now = gguf_blocks(w, 4)
    after = (now or quantize_blocks(w, 4)).dequantize()
    kept_whole = now is not None and "+int" not in now.grid  # the rule before kept a weight only whole
    before = after if kept_whole else quantize_blocks(w, 4).dequantize()
    edges = np.cumsum([0] + [len(p) for p in parts.values()])
    errors = []
    for i, p in enumerate(parts):
        rows = slice(edges[i], edges[i + 1])
        scale = np.sqrt(np.mean(w[rows] ** 2))
        errors.append(f"{p} {np.sqrt(np.mean((before[rows] - w[rows]) ** 2)) / scale:.4f} -> "
                      f"{np.sqrt(np.mean((after[rows] - w[rows]) ** 2)) / scale:.4f}")
    grid = now.grid if now else "int4"
    print(f"layer {layer} q/k/v {'/'.join(kinds)}: grid {grid}, rms error / rms weight, before -> now: "
          + ", ".join(errors))
