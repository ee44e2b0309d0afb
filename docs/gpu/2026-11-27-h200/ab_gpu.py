"""The A/B behind run2_attention_linear_ab.json and run3_attention_ab.json, kept as run (2026-11-27, H200).

Padded attention (the earlier per-query kernel vs the tiled one, by chunk), the 1B down projection (the
earlier kernel, one chain, spans, cuBLAS), each captured in a CUDA graph and timed over 20 replays (medians of
5); then the host CPU's projection row probe. It imports the earlier kernels as ab/invariant_old.py, a copy of
trt_lookahead/kernels/invariant.py at c22730b; run from the repository root, JSON to argv[1]. Run 2 passed
chunk None (one program per slot's keys, since removed); run 3 timed the attention part only, chunks 1024 and
256, after the single-chunk slots were normalised in place."""

import json
import sys

import numpy as np
import torch

sys.path.insert(0, "ab")
import invariant_old as old

from trt_lookahead.kernels import invariant as new
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.layout import StepLayout

dev = "cuda"
out = {"gpu": torch.cuda.get_device_name(), "attention": [], "linear": [], "bits": [], "probe": {}}
CONFIGS = {1: (1, 2, 0), 4: (1, 3, 1), 16: (4, 3, 4), 56: (7, 5, 7), 120: (15, 5, 15)}
Hq, Hkv, D, CACHED, ROOM = 32, 8, 64, 512, 1024


def save() -> None:
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


def graph_ms(fn, replays: int = 20) -> float:
    """Median over 5 of one graph replay of `replays` calls, per call."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(replays):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / replays)
    return round(float(np.median(ts)), 5)


def step(B: int, T: int):
    S = ROOM + T
    layout = StepLayout(LookaheadConfig(*CONFIGS[T]), padded_tokens=T)
    mask = np.zeros((B, T, S), bool)
    pos = np.zeros((B, T), np.int64)
    mask[:, :, :CACHED] = True
    mask[:, :, CACHED : CACHED + T] = layout.mask
    pos[:] = CACHED + layout.rel_positions
    cl = torch.full((B,), CACHED, device=dev)
    table = new.key_rows(torch.from_numpy(mask).to(dev), cl, torch.from_numpy(pos).to(dev))
    return S, table, cl


def run(row: dict, name: str, fn) -> None:
    try:
        row[name] = graph_ms(fn)
    except Exception as e:  # one failed timing is a field
        row[name + "_error"] = repr(e)[:400]


g = torch.Generator(device=dev).manual_seed(0)
for B in (1, 8):
    for T in CONFIGS:
        S, table, cl = step(B, T)
        q = torch.randn(B * T, Hq, D, device=dev, generator=g).to(torch.bfloat16)
        k = torch.randn(B * S, Hkv, D, device=dev, generator=g).to(torch.bfloat16)
        v = torch.randn(B * S, Hkv, D, device=dev, generator=g).to(torch.bfloat16)
        row = {"B": B, "T": T}
        ref = old.padded_attention(q, k, v, table)
        run(row, "old", lambda q=q, k=k, v=v, table=table: old.padded_attention(q, k, v, table))
        for chunk in (1024, 256):
            name = f"new_{chunk}"
            run(row, name, lambda q=q, k=k, v=v, table=table, cl=cl, c=chunk: new.padded_attention(q, k, v, table, cl,
                                                                                                    chunk=c))
            o = new.padded_attention(q, k, v, table, cl, chunk=chunk)
            row[name + "_maxdiff"] = float((o.float() - ref.float()).abs().max())
        qb = q.view(B, T, Hq, D).transpose(1, 2)
        kb = k.view(B, S, Hkv, D).transpose(1, 2)
        vb = v.view(B, S, Hkv, D).transpose(1, 2)
        m = (table >= 0)[:, None]
        run(row, "sdpa_gqa", lambda qb=qb, kb=kb, vb=vb, m=m: torch.nn.functional.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=m, enable_gqa=True))
        out["attention"].append(row)
        print(row, flush=True)
        save()

print('done', flush=True)
