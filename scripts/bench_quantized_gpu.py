"""Time the GPU's quantized projections against the bfloat16 ones and the memory limit (docs/design.md 6.9).

On a lent GPU machine, from the repository root (nothing to install or carry; about a minute):

    python scripts/bench_quantized_gpu.py --out OUT/quantized.json [--shape llama-7b] [--rows 1,16,64]

For each projection of a random-weight Llama shape (scripts/gpu_check.py SHAPES: the fused QKV, the attention
output, the fused gate/up, the down projection and the lm_head) and each row count M, the time of one product:
cuBLAS bfloat16 (F.linear, the fast step's), kernels/invariant.py `linear` in bfloat16 (the exact step's) and
`quantized_linear` with int8 and int4 blocks of 32 (every quantized step's; random codes, float32 scales and
zero points, so the bytes are a real checkpoint's). Each call is captured CALLS times in one CUDA graph, replayed
REPS times; the median over replays / CALLS is a call's time. `limit_us` is the weight's bytes (codes, scales
and zero points) at --peak-gbps (H200 4,800; H100 SXM 3,350), and `x_limit` the time over it: issue 44's goal
is the 7B int4 step at 1.3x its limit or less. Then the whole step's sum over layers (each layer's four
projections, times num_layers, plus the lm_head) per variant and M.

--sweep BITS also times `quantized_linear` at BITS over a grid of tiles (SWEEP_TILES: BLOCK_M, BLOCK_N, BLOCK_K,
warps) and spans (SWEEP_SPANS: None is one chain over all of K) for each projection and M, under "sweep": the
evidence for invariant.py's QUANTIZED_TILES and QUANTIZED_SPAN. A row's bits depend on the tile and the span
(both fixed per code width and K, never per M).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from gpu_check import SHAPES  # noqa: E402

from trt_lookahead.kernels import invariant  # noqa: E402

BLOCK = 32  # engine/quantize.py BLOCK_SIZE: input dims per scale and zero point
CALLS = 20
REPS = 30
SWEEP_TILES = tuple((16, n, k, w) for n in (32, 64, 128) for k in (128, 256) for w in (4, 8))
SWEEP_SPANS = (None, 1024)


def projections(shape: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """{name: (N, K)} of one layer's projections and the lm_head."""
    h, d = shape["hidden_size"], shape["head_dim"]
    q, kv, ffn = shape["num_heads"] * d, shape["num_kv_heads"] * d, shape["intermediate_size"]
    return {"wqkv": (q + 2 * kv, h), "wo": (h, q), "w13": (2 * ffn, h), "w2": (h, ffn),
            "lm_head": (shape["vocab_size"], h)}


def quantized_weight(N: int, K: int, bits: int, device: str) -> tuple[torch.Tensor, ...]:
    """Random (codes, scales, zero points) of an [N, K] weight in engine/quantize.py's layout."""
    blocks = -(-K // BLOCK)
    codes = torch.randint(0, 256, (N, blocks * BLOCK * bits // 8), dtype=torch.uint8, device=device)
    scales = torch.rand(N, blocks, device=device) / 64
    zeros = torch.randint(0, 256, (N, blocks if bits == 8 else -(-blocks // 2)), dtype=torch.uint8, device=device)
    return codes, scales, zeros


def graph_time_us(fn) -> float:
    """Median microseconds of one fn() call: CALLS calls captured in one CUDA graph, replayed REPS times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    return statistics.median(times)


def bench(shape_name: str, rows: list[int], peak_gbps: float) -> dict[str, Any]:
    shape = SHAPES[shape_name]
    device = "cuda"
    out: list[dict[str, Any]] = []
    for name, (N, K) in projections(shape).items():
        w = torch.randn(N, K, device=device, dtype=torch.bfloat16) / K**0.5
        quantized = {bits: quantized_weight(N, K, bits, device) for bits in (8, 4)}
        for M in rows:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            variants = {
                "bf16_cublas": (functools.partial(F.linear, x, w), w.numel() * 2),
                "bf16_invariant": (functools.partial(invariant.linear, x, w), w.numel() * 2),
            }
            for bits, (codes, scales, zeros) in quantized.items():
                size = codes.numel() + scales.numel() * 4 + zeros.numel()
                variants[f"int{bits}"] = (
                    functools.partial(invariant.quantized_linear, x, codes, scales, zeros, None, bits), size)
            for variant, (fn, size) in variants.items():
                try:
                    us = graph_time_us(fn)
                except Exception as exc:  # one failed timing is a row, not the end of the run
                    out.append({"projection": name, "M": M, "variant": variant, "error": f"{exc}"[:300]})
                    continue
                limit = size / (peak_gbps * 1e3)  # bytes / (GB/s) in microseconds
                out.append({"projection": name, "N": N, "K": K, "M": M, "variant": variant, "us": round(us, 2),
                            "bytes": size, "limit_us": round(limit, 2), "x_limit": round(us / limit, 2),
                            "gbps": round(size / us / 1e3, 1)})
                print(json.dumps(out[-1]), flush=True)
    return {"shape": shape_name, "rows": out, "step": step_sums(out, shape["num_layers"])}


def sweep(shape_name: str, rows: list[int], bits: int, peak_gbps: float) -> list[dict[str, Any]]:
    """Each projection x M x SWEEP_TILES x SWEEP_SPANS at `bits`: us and x_limit, best first per (projection, M),
    with `default` the time of quantized_linear's own choice."""
    out: list[dict[str, Any]] = []
    for name, (N, K) in projections(SHAPES[shape_name]).items():
        codes, scales, zeros = quantized_weight(N, K, bits, "cuda")
        limit = (codes.numel() + scales.numel() * 4 + zeros.numel()) / (peak_gbps * 1e3)
        for M in rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            default = graph_time_us(functools.partial(invariant.quantized_linear, x, codes, scales, zeros, None, bits))
            timed = []
            for tile in SWEEP_TILES:
                for span in SWEEP_SPANS:
                    if span is not None and span >= K:
                        continue
                    fn = functools.partial(invariant.quantized_linear, x, codes, scales, zeros, None, bits, tile=tile,
                                           span=span)
                    try:
                        us = graph_time_us(fn)
                    except Exception as exc:  # a tile the GPU cannot hold (registers, shared memory) is a row
                        timed.append({"tile": tile, "span": span, "error": f"{exc}"[:120]})
                        continue
                    timed.append({"tile": tile, "span": span, "us": round(us, 2), "x_limit": round(us / limit, 2)})
            timed.sort(key=lambda t: t.get("us", float("inf")))
            out.append({"projection": name, "N": N, "K": K, "M": M, "bits": bits, "limit_us": round(limit, 2),
                        "default_us": round(default, 2), "best": timed[:12], "all": timed})
            print(json.dumps({k: v for k, v in out[-1].items() if k != "all"}), flush=True)
    return out


def step_sums(rows: list[dict[str, Any]], layers: int) -> list[dict[str, Any]]:
    """Per (variant, M): the projections of a whole step (layers x the four, plus the lm_head) and their limit."""
    sums: dict[tuple[str, int], dict[str, float]] = {}
    for r in rows:
        if "error" in r:
            continue
        times = layers if r["projection"] != "lm_head" else 1
        entry = sums.setdefault((r["variant"], r["M"]), {"us": 0.0, "limit_us": 0.0})
        entry["us"] += r["us"] * times
        entry["limit_us"] += r["limit_us"] * times
    return [{"variant": v, "M": m, "ms": round(e["us"] / 1e3, 3), "limit_ms": round(e["limit_us"] / 1e3, 3),
             "x_limit": round(e["us"] / e["limit_us"], 2)} for (v, m), e in sorted(sums.items())]


def gpu_parser(description: str, rows: str) -> argparse.ArgumentParser:
    """The arguments of a script timing the quantized products here: --out, --shape, --rows, --peak-gbps."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-7b")
    parser.add_argument("--rows", default=rows, help="comma list of row counts M")
    parser.add_argument("--peak-gbps", type=float, default=4800.0, help="the GPU's HBM bandwidth (H200: 4800)")
    return parser


def no_gpu() -> bool:
    """Whether there is no CUDA device, said in one line on stderr."""
    if torch.cuda.is_available():
        return False
    print("error: no CUDA device: this script times GPU kernels; run it on a GPU machine", file=sys.stderr)
    return True


def write_result(out: Path, result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1), encoding="utf-8")


def finish(out: Path, result: dict[str, Any]) -> int:
    """Write the result, print its whole-step lines; main's exit status."""
    write_result(out, result)
    for entry in result["step"]:
        print(json.dumps(entry))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = gpu_parser(__doc__.splitlines()[0], "1,16,64")
    parser.add_argument("--sweep", type=int, choices=(4, 8), help="also time quantized_linear's tiles at BITS")
    parser.add_argument("--sweep-rows", default="1,16", help="comma list of the sweep's row counts M")
    args = parser.parse_args(argv)
    if no_gpu():
        return 2
    result = bench(args.shape, [int(r) for r in args.rows.split(",")], args.peak_gbps)
    result["device"] = torch.cuda.get_device_name()
    if args.sweep:
        write_result(args.out, result)  # the main table, if the sweep dies
        result["sweep"] = sweep(args.shape, [int(r) for r in args.sweep_rows.split(",")], args.sweep, args.peak_gbps)
    return finish(args.out, result)


if __name__ == "__main__":
    raise SystemExit(main())
