"""Time the GPU's quantized projections against the bfloat16 ones and the memory limit (docs/design.md 6.9).

On a lent GPU machine, from the repository root (nothing to install or carry; a minute or two):

    python scripts/bench_quantized_gpu.py --out OUT/quantized.json [--shape llama-7b] [--rows 1,16,64]

For each projection of a random-weight Llama shape (scripts/gpu_check.py SHAPES: the fused QKV, the attention
output, the fused gate/up, the down projection and the lm_head) and each row count M, the time of one product:
cuBLAS bfloat16 (F.linear, the fast step's), kernels/invariant.py `linear` in bfloat16 (the exact step's) and
`quantized_linear` with int8 and int4 blocks of 32 (the quantized steps' but for int4 weights in bfloat16 on a GPU
of compute capability 9.0+, whose product scripts/int4_register_dequant.py times; random codes, float32 scales and
zero points, so the bytes are a real checkpoint's). `limit_us` is the weight's bytes (codes, scales and zero
points) at --peak-gbps (H200 4,800; H100 SXM 3,350), and `x_limit` the time over it.

Weights are read from HBM, as in a real step, never from the L2 cache: a step streams every layer's own weights
(4.2 GB a 7B int4 step) through an L2 of 50 MB, but one projection's weight called again and again would stay
there (a 7B int4 attention output is 10.7 MB). So a projection's calls cycle through `cold_copies` distinct random
weights, together L2_PASSES times the GPU's L2, at least CALLS calls captured in one CUDA graph, replayed REPS
times: the median over replays per call is its time. And `step` times the whole step as it runs, one CUDA graph
of every layer's four projections by that layer's own weights, in order, then the lm_head (the launches' gaps
included): the figure issue 44's goal is about (the 7B int4 step at 1.3x its limit or less); `projection_sums`
adds the projections' own times over the layers, to say which projection costs what.

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
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from gpu_check import SHAPES  # noqa: E402

from trt_lookahead.kernels import invariant  # noqa: E402

BLOCK = 32  # engine/quantize.py BLOCK_SIZE: input dims per scale and zero point
CALLS = 20  # a projection's calls in one graph, at least
REPS = 30
L2_PASSES = 4  # a projection's timing cycles through weights filling the L2 cache this many times over
COPIES_MAX = 64  # ... but never more copies than this: any real projection needs fewer (see cold_copies)
SWEEP_TILES = tuple((16, n, k, w) for n in (32, 64, 128) for k in (128, 256) for w in (4, 8))
SWEEP_SPANS = (None, 1024)

Product = Callable[[torch.Tensor, Any], torch.Tensor]  # (x [M, K], a weight) -> x @ weight^T [M, N]


class Kind(NamedTuple):
    """One way of holding a weight: a random one of [N, K] on a device, its bytes, the products timed by it."""

    make: Callable[[int, int, str], Any]
    nbytes: Callable[[Any], int]
    products: dict[str, Product]


def projections(shape: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """{name: (N, K)} of one layer's projections, in the order a layer runs them, and the lm_head."""
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


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def quantized_product(bits: int, tile: tuple[int, int, int, int] | None = None,
                      span: int | str | None = "auto") -> Product:
    """invariant.quantized_linear by a `quantized_weight` (at its own tile and span unless given)."""
    def product(x: torch.Tensor, w: tuple[torch.Tensor, ...]) -> torch.Tensor:
        codes, scales, zero_points = w
        return invariant.quantized_linear(x, codes, scales, zero_points, None, bits, tile=tile, span=span)
    return product


def quantized_kind(bits: int) -> Kind:
    """int8 or int4 blocks, multiplied by invariant.quantized_linear."""
    return Kind(lambda N, K, device: quantized_weight(N, K, bits, device), lambda w: tensor_bytes(*w),
                {f"int{bits}": quantized_product(bits)})


KINDS = {
    "bf16": Kind(lambda N, K, device: torch.randn(N, K, device=device, dtype=torch.bfloat16) / K**0.5, tensor_bytes,
                 {"bf16_cublas": F.linear, "bf16_invariant": invariant.linear}),
    "int8": quantized_kind(8),
    "int4": quantized_kind(4),
}


def cold_copies(nbytes: int, l2_bytes: int) -> int:
    """How many distinct weights of nbytes a projection's timing cycles through: enough to fill an L2 of
    l2_bytes L2_PASSES times over, so that each call finds its weight evicted, as every call of a real step does;
    at most COPIES_MAX, which still fill a 50 MB L2 three times over with the smallest projection of gpu_check's
    shapes (a 1B model's int4 attention output, 2.6 MB) and keep the tests' tiny weights quick."""
    return max(1, min(COPIES_MAX, -(-L2_PASSES * l2_bytes // nbytes)))


def cold_weights(kind: Kind, N: int, K: int, device: str) -> list[Any]:
    """`cold_copies` random [N, K] weights of `kind` on `device`, for `call_us` to cycle through."""
    first = kind.make(N, K, device)
    return [first] + [kind.make(N, K, device) for _ in range(cold_copies(kind.nbytes(first), l2_bytes(device)) - 1)]


def l2_bytes(device: str) -> int:
    """The L2 cache a timing on `device` reads past: the GPU's; none on the CPU (see replay_us)."""
    if torch.device(device).type != "cuda":
        return 0
    return torch.cuda.get_device_properties(torch.device(device)).L2_cache_size


def replay_us(fns: Sequence[Callable[[], Any]], passes: int = 1) -> float:
    """Median microseconds of one pass over fns, called in order: `passes` passes captured in one CUDA graph
    (after two passes outside it, which compile and warm up), replayed REPS times. Without a GPU (the tests, which
    check the script's wiring, not its figures) one pass, timed by the clock."""
    if not torch.cuda.is_available():
        start_s = time.perf_counter()
        for fn in fns:
            fn()
        return (time.perf_counter() - start_s) * 1e6
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(passes):
            for fn in fns:
                fn()
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / passes)
    return statistics.median(times)


def call_us(product: Product, x: torch.Tensor, weights: Sequence[Any]) -> float:
    """Median microseconds of one product of x by each of `weights` in turn (cold_copies of one weight), over at
    least CALLS calls."""
    passes = -(-CALLS // len(weights))
    return replay_us([functools.partial(product, x, w) for w in weights], passes) / len(weights)


def step_weights(shape: dict[str, Any], make: Callable[[int, int, str], Any],
                 device: str) -> list[tuple[str, Any]]:
    """(projection, weight) of a whole step in the order it runs them: each layer's four projections by that
    layer's own random weights, then the lm_head."""
    sizes = projections(shape)
    layer = [name for name in sizes if name != "lm_head"]
    step = [(name, make(*sizes[name], device)) for _ in range(shape["num_layers"]) for name in layer]
    return [*step, ("lm_head", make(*sizes["lm_head"], device))]


def step_calls(weights: Sequence[tuple[str, Any]], product: Product,
               inputs: dict[str, torch.Tensor]) -> list[Callable[[], torch.Tensor]]:
    """The step's products in order, each projection by its weight of `weights` on its input of `inputs`."""
    return [functools.partial(product, inputs[name], w) for name, w in weights]


def step_inputs(shape: dict[str, Any], M: int, device: str) -> dict[str, torch.Tensor]:
    """A random bfloat16 input [M, K] per projection."""
    return {name: torch.randn(M, K, device=device, dtype=torch.bfloat16) for name, (_, K) in projections(shape).items()}


def shape_of(name: str) -> dict[str, Any]:
    return cast(dict[str, Any], SHAPES[name])


def bench(shape: dict[str, Any], rows: list[int], peak_gbps: float, device: str = "cuda") -> dict[str, Any]:
    """Every projection x KINDS' products x M, cold (`call_us`), then the whole steps (`steps`)."""
    l2 = l2_bytes(device)
    out: list[dict[str, Any]] = []
    for name, (N, K) in projections(shape).items():
        for kind in KINDS.values():
            weights = cold_weights(kind, N, K, device)
            size = kind.nbytes(weights[0])
            for M in rows:
                x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
                for variant, product in kind.products.items():
                    try:
                        us = call_us(product, x, weights)
                    except Exception as exc:  # one failed timing is a row, not the end of the run
                        out.append({"projection": name, "M": M, "variant": variant, "error": f"{exc}"[:300]})
                        continue
                    limit = size / (peak_gbps * 1e3)  # bytes / (GB/s) in microseconds
                    out.append({"projection": name, "N": N, "K": K, "M": M, "variant": variant, "us": round(us, 2),
                                "bytes": size, "copies": len(weights), "limit_us": round(limit, 2),
                                "x_limit": round(us / limit, 2), "gbps": round(size / us / 1e3, 1)})
                    print(json.dumps(out[-1]), flush=True)
            del weights
    return {"l2_bytes": l2, "rows": out, "step": steps(shape, rows, peak_gbps, device),
            "projection_sums": step_sums(out, shape["num_layers"])}


def steps(shape: dict[str, Any], rows: list[int], peak_gbps: float, device: str = "cuda") -> list[dict[str, Any]]:
    """Per variant and M: the whole step's projections timed as one CUDA graph (`step_weights`), and its limit."""
    out: list[dict[str, Any]] = []
    for kind in KINDS.values():
        weights = step_weights(shape, kind.make, device)
        limit = sum(kind.nbytes(w) for _, w in weights) / (peak_gbps * 1e3)
        for M in rows:
            inputs = step_inputs(shape, M, device)
            for variant, product in kind.products.items():
                entry: dict[str, Any] = {"variant": variant, "M": M, "limit_ms": round(limit / 1e3, 3)}
                try:
                    us = replay_us(step_calls(weights, product, inputs))
                    entry |= {"ms": round(us / 1e3, 3), "x_limit": round(us / limit, 2)}
                except Exception as exc:  # one failed step is a row, not the end of the run
                    entry["error"] = f"{exc}"[:300]
                out.append(entry)
                print(json.dumps(entry), flush=True)
        del weights
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def sweep(shape_name: str, rows: list[int], bits: int, peak_gbps: float) -> list[dict[str, Any]]:
    """Each projection x M x SWEEP_TILES x SWEEP_SPANS at `bits` (weights cold, as `bench`'s): us and x_limit, best
    first per (projection, M), with `default` the time of quantized_linear's own choice."""
    out: list[dict[str, Any]] = []
    for name, (N, K) in projections(shape_of(shape_name)).items():
        weights = cold_weights(quantized_kind(bits), N, K, "cuda")
        size = tensor_bytes(*weights[0])
        limit = size / (peak_gbps * 1e3)
        for M in rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            default = call_us(quantized_product(bits), x, weights)
            timed: list[dict[str, Any]] = []
            for tile in SWEEP_TILES:
                for span in SWEEP_SPANS:
                    if span is not None and span >= K:
                        continue
                    try:
                        us = call_us(quantized_product(bits, tile, span), x, weights)
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
    """Per (variant, M): the projections' own times added over a whole step (layers x the four, plus the
    lm_head), and their limit."""
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
    """Write the result, print its measured whole-step lines; main's exit status."""
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
    result = {"shape": args.shape, "device": torch.cuda.get_device_name(),
              **bench(shape_of(args.shape), [int(r) for r in args.rows.split(",")], args.peak_gbps)}
    if args.sweep:
        write_result(args.out, result)  # the main table, if the sweep dies
        result["sweep"] = sweep(args.shape, [int(r) for r in args.sweep_rows.split(",")], args.sweep, args.peak_gbps)
    return finish(args.out, result)


if __name__ == "__main__":
    raise SystemExit(main())
