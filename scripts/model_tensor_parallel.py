"""The 70B step under tensor parallelism, on paper: weights per rank over HBM, the collectives over NVLink, and what
lookahead's compression buys (issue 45's model; docs/results/2026-11-29-tensor-parallel.md).

    python scripts/model_tensor_parallel.py [--degrees 4,8] [--context 1024] [--latency-us 10]

One decode step of one row holding T tokens at degree W:
    weights    the model's bf16 bytes / W over HBM bandwidth x efficiency (or its FLOPs over the bf16 rate, if longer)
    kv         the cached keys and values read (context x per-token KV bytes / W: the KV heads are split)
    reduce     2 per layer (after wo and w2) of an [T, hidden] bf16 partial sum, plus one gather of the vocab slices
               ring all-reduce (NCCL):   latency + 2 (W - 1) / W x S / link
               exact (all-gather, then adds in rank order; backends/tensor_parallel.py reduce_seconds, GATHER):
                                          latency + (W - 1) x S / link + W x S / HBM
               exact in two phases (all-to-all of 1/W chunks, adds in rank order, all-gather; TWO_PHASE):
                                          2 latency + 2 (W - 1) / W x S / link + S / HBM
The weights and KV part grows with T as our H200's 7B step did (GROWTH); the collectives as above.
Lookahead's projected speedup = compression(config) x t(1) / t(T) (exact: the cheaper exact reduction at each T,
`exact_ms`), compression from docs/results/README.md's table
(tokens per forward, CPU, 8 prompts a set; the same tokens on any device, as lookahead equals greedy).
Every input is a flag; the defaults are H100 SXM's datasheet figures, our H200 step's measured share of its
bandwidth, and a stated guess for NCCL's small-message latency: leads to check on a lent multi-GPU machine.
"""

from __future__ import annotations

import argparse

from trt_lookahead.backends.tensor_parallel import GATHER, TWO_PHASE, Link, reduce_seconds

# Llama-3.1-70B (config.json): the shape the issue names
LLAMA_70B = dict(hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128, ffn=28672, vocab=128256)
# docs/results/README.md, "Compression of fixed configs", overall column: T = (W + G)(N - 1) -> tokens per forward
COMPRESSION = {"4/3/4 (T = 16)": (16, 1.70), "7/5/7 (T = 56)": (56, 2.05), "15/5/15 (T = 120)": (120, 2.18)}
# the one-GPU step's time at T over T = 1: the 7B Triton step, batch 1, CUDA graph (docs/gpu/2026-11-27-h200/
# run4_all_sections.json, as ../shared/reference/gpu_step.md tabulates it)
GROWTH = {1: 1.0, 16: 6.92 / 5.95, 56: 7.14 / 5.95, 120: 8.06 / 5.95}
REDUCTIONS = ("nccl", "exact", "exact2")
EXACT = {"exact": GATHER, "exact2": TWO_PHASE}


def parameters(m: dict[str, int]) -> int:
    """Weights of a Llama of this shape (embedding and head untied)."""
    h, d = m["hidden"], m["head_dim"]
    attention = h * (m["heads"] * d) * 2 + h * (m["kv_heads"] * d) * 2  # q, o; k, v
    mlp = 3 * h * m["ffn"]
    return m["layers"] * (attention + mlp + 2 * h) + 2 * m["vocab"] * h + h


def step_ms(m: dict[str, int], W: int, T: int, a: argparse.Namespace, reduction: str) -> dict[str, float]:
    """One step's parts in ms at degree W with T tokens (bf16 weights and activations), `reduction` one of
    REDUCTIONS."""
    hbm, link = a.hbm_tbps * 1e12 * a.efficiency, a.link_gbps * 1e9
    weights = parameters(m) * 2 / W
    flops = 2 * parameters(m) * T / W
    weights_ms = max(weights / hbm, flops / (a.tflops * 1e12)) * 1e3 * GROWTH[T]
    kv_ms = a.context * m["layers"] * 2 * m["kv_heads"] * m["head_dim"] * 2 / W / hbm * 1e3 * GROWTH[T]
    S = T * m["hidden"] * 2  # one partial sum's bytes
    latency = a.latency_us * 1e-6
    if W == 1:
        one = 0.0
    elif reduction in EXACT:  # the package's own cost of each exact form (backends/tensor_parallel.py)
        one = reduce_seconds(EXACT[reduction], S, W, Link(latency, link, hbm))
    else:
        one = latency + 2 * (W - 1) / W * S / link
    gather = 0.0 if W == 1 else a.latency_us * 1e-6 + (W - 1) * T * m["vocab"] // W * 2 / link
    reduce_ms = (2 * m["layers"] * one + gather) * 1e3
    return {"weights": weights_ms, "kv": kv_ms, "reduce": reduce_ms, "total": weights_ms + kv_ms + reduce_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--degrees", default="1,4,8")
    ap.add_argument("--context", type=int, default=1024, help="cached tokens a step attends over")
    ap.add_argument("--hbm-tbps", type=float, default=3.35, help="HBM bandwidth per GPU (H100 SXM: 3.35)")
    ap.add_argument("--efficiency", type=float, default=0.47,
                    help="share of it a step reaches (our H200 Triton step: 0.47; SGLang-class: 0.76)")
    ap.add_argument("--link-gbps", type=float, default=450.0, help="NVLink per direction per GPU (H100: 450)")
    ap.add_argument("--latency-us", type=float, default=10.0, help="a small collective's latency (a guess)")
    ap.add_argument("--tflops", type=float, default=989.0, help="dense bf16 rate per GPU")
    a = ap.parse_args()
    m = LLAMA_70B
    print(f"Llama-3.1-70B shape, {parameters(m) / 1e9:.1f}e9 parameters, bf16; {a.hbm_tbps} TB/s x "
          f"{a.efficiency} per GPU, NVLink {a.link_gbps} GB/s, collective latency {a.latency_us} us, "
          f"context {a.context}\n")
    print("| W | T | weights + KV ms | collectives ms, NCCL / exact / exact2 | step ms, NCCL / exact / exact2 |")
    print("|---:|---:|---:|---:|---:|")
    for W in (int(w) for w in a.degrees.split(",")):
        for T in GROWTH:
            parts = [step_ms(m, W, T, a, r) for r in REDUCTIONS]
            reduce = " / ".join(f"{p['reduce']:.2f}" for p in parts)
            total = " / ".join(f"{p['total']:.2f}" for p in parts)
            print(f"| {W} | {T} | {parts[0]['weights'] + parts[0]['kv']:.2f} | {reduce} | {total} |")
    print("\n| W | config | compression | t(T) / t(1), NCCL / exact | projected speedup, NCCL / exact | "
          "greedy tok/s, exact |")
    print("|---:|---|---:|---:|---:|---:|")
    for W in (int(w) for w in a.degrees.split(",")):
        for label, (T, compression) in COMPRESSION.items():
            ratios = [step_ms(m, W, T, a, "nccl")["total"] / step_ms(m, W, 1, a, "nccl")["total"],
                      exact_ms(m, W, T, a) / exact_ms(m, W, 1, a)]
            print(f"| {W} | {label} | {compression:.2f} | {' / '.join(f'{r:.3f}' for r in ratios)} | "
                  f"{' / '.join(f'{compression / r:.2f}x' for r in ratios)} | {1e3 / exact_ms(m, W, 1, a):.1f} |")


def exact_ms(m: dict[str, int], W: int, T: int, a: argparse.Namespace) -> float:
    """The step with the cheaper exact reduction at this T: both add a row's partials in rank order, so a step may
    take either by its size and keep its bits."""
    return min(step_ms(m, W, T, a, r)["total"] for r in EXACT)

if __name__ == "__main__":
    main()
