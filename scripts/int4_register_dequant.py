"""Time the two GPU products by int4 weights against each other on a Llama shape: kernels/invariant.py's
`quantized_linear` (QuantizedLinear's blocks layout) and kernels/quantized_words.py's `words_linear` (its words
layout, the executor's on a GPU of compute capability 9.0+ in bfloat16), the latter over tiles and spans.

On a lent GPU machine, from the repository root (nothing to install or carry; a minute or two):

    python scripts/int4_register_dequant.py --out OUT/words.json [--shape llama-7b] [--rows 1,16]
                                            [--tile BLOCK_N,WARPS,STEPS,STAGES ...] [--tiles N] [--step-configs N]

Evidence so far: docs/gpu/2026-12-04-h200/ (run 1: the product when it was this script's candidate, with its spans'
sums also added inside the launch, which did not pay; run 2: deeper pipelines), read in
docs/results/2026-12-04-h200-int4-words.md; docs/gpu/2026-12-04-h200-b/ (the product with a step's wgmmas issued
together), read in docs/results/2026-12-04-h200-int4-pipelined.md.

`main` times both products on every projection of the shape at each row count (CUDA graphs, weights read from HBM
as bench_quantized_gpu.py does: each product cycles through its own `cold_copies`), the words product at each of
TILES (or the --tile ones) x SPANS, checking each against the float64 product by the layout's own dense weight and
a row against itself alone; adds each configuration's projections over a step (`step_sums`); then times whole
steps as they run (`steps`: every layer's own weights, one CUDA graph), the landed product's and the words
product's at the STEP_CONFIGS best configurations of each of RULES by those sums, and writes one JSON, fastest
first, each launched plainly and as programmatic dependents (`words_linear`'s pdl: the next product's launch and
its weights' first reads overlap the end of the one before; `pdl_same_bits` checks it gives the same bits). A
configuration is a tile and each projection's span, by one of RULES: "fixed", one span for every
projection; "per shape", each projection's fastest over every M measured (a choice per weight shape, never per
M); "words_span", the package's own rule (quantized_words.words_span), so the JSON says how the shipped choice
ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import bench_quantized_gpu as bench  # noqa: E402

from trt_lookahead.kernels.quantized_words import STEP, WORDS_TILE, words_linear, words_span  # noqa: E402
from trt_lookahead.model.llama import QuantizedLinear  # noqa: E402

# (BLOCK_N, warps, pipeline stages), the shipped tile first; BLOCK_N >= 64 (one warpgroup's wgmma A operand)
TILES = (WORDS_TILE, (256, 8, 3), (256, 8, 4), (128, 8, 4), (128, 4, 3), (256, 8, 2), (128, 8, 2), (64, 4, 3))
SPANS = (512, 1024, 2048, None)  # the spans main times at each tile (None: all of K)
CHECK_TOLERANCE = 1e-2  # a product's relative error: bfloat16 rows and outputs give about 2^-9, a misplaced code ~1
STEP_CONFIGS = 5  # configurations of each rule main times as whole steps per M, the best by their projections' sums
RULES = ("fixed", "per shape", "words_span")

Tile = tuple[int, int, int]


def words_weight(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, mins: torch.Tensor | None,
                 K: int) -> QuantizedLinear:
    """The blocks (MatMulNBits' layout) as a QuantizedLinear in the words layout."""
    module = QuantizedLinear(codes, scales, zeros, mins, 4, K)
    module.set_layout("words")
    return module


def random_words(N: int, K: int, device: str) -> QuantizedLinear:
    """A random int4 [N, K] weight in the words layout (bench_quantized_gpu's random blocks, repacked)."""
    return words_weight(*bench.quantized_weight(N, K, 4, device), None, K)


def words_bytes(module: QuantizedLinear) -> int:
    """The bytes one product reads for the weight: words, the (scale, offset) pairs (and mins)."""
    return bench.tensor_bytes(module.codes, module.scales, module.mins)


def words_product(tile: Tile, spans: dict[tuple[int, int], int | None], pdl: bool = False) -> bench.Product:
    """`words_linear` at a tile, with the span `spans` gives a weight's shape (N, K), as bench_quantized_gpu times
    a product: one choice per shape, whatever M, so row-invariant; pdl: launched as programmatic dependents."""
    def product(x: torch.Tensor, w: QuantizedLinear) -> torch.Tensor:
        span = spans[(w.out_features, w.in_features)]
        return words_linear(x, w.codes, w.scales, w.mins, tile, span, pdl)
    return product


def pdl_same_bits(calls: list[Any], pdl_calls: list[Any]) -> bool:
    """Whether a step's products give the same bits launched as programmatic dependents as launched plainly,
    each pass's launches back to back on one stream."""
    plain = [call() for call in calls]
    return all(torch.equal(a, b) for a, b in zip(plain, [call() for call in pdl_calls], strict=True))


def check(x: torch.Tensor, module: QuantizedLinear, tile: Tile, span: int | None) -> dict[str, Any]:
    """The product against the float64 one by the layout's dense weight, and row 0 against itself alone; `passed`
    if both hold (the error under CHECK_TOLERANCE)."""
    args = (module.codes, module.scales, module.mins, tile, span)
    y = words_linear(x, *args)
    want = x.double() @ module.dense_weight().double().t()
    err = ((y.double() - want).norm() / want.norm()).item()
    alone = bool(torch.equal(words_linear(x[:1], *args)[0], y[0]))
    return {"relative_error": err, "row_alone_same_bits": alone, "passed": bool(err < CHECK_TOLERANCE and alone)}


def variants(tiles: tuple[Tile, ...], spans: tuple[int | None, ...], K: int) -> list[tuple[Tile, int | None]]:
    """(tile, span) main times for K: spans shorter than K (whole steps); all of K once."""
    return [(tile, span) for tile in tiles for span in spans if span is None or (span < K and span % STEP == 0)]


def run(shape: dict[str, Any], rows: list[int], peak_gbps: float, tiles: tuple[Tile, ...],
        spans: tuple[int | None, ...], device: str = "cuda") -> list[dict[str, Any]]:
    """Per projection and M: the landed int4 product's time, and the words product's at each tile and span with
    its checks (random weights in MatMulNBits' layout, repacked; bfloat16 rows); the checks once more with mins."""
    out: list[dict[str, Any]] = []
    for name, (N, K) in bench.projections(shape).items():
        landed_weights = bench.cold_weights(bench.KINDS["int4"], N, K, device)
        codes, scales, zeros = first = landed_weights[0]
        words_weights = [words_weight(c, s, z, None, K) for c, s, z in landed_weights]
        with_mins = words_weight(codes, scales, zeros, torch.rand_like(scales) - 0.5, K)  # a Q4_1 weight: m added
        landed_limit = bench.tensor_bytes(*first) / (peak_gbps * 1e3)
        limit = words_bytes(words_weights[0]) / (peak_gbps * 1e3)
        for M in rows:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            landed = bench.call_us(bench.quantized_product(4), x, landed_weights)
            check_rows = torch.randn(max(M, 2), K, device=device, dtype=torch.bfloat16)
            row: dict[str, Any] = {"projection": name, "N": N, "K": K, "M": M, "copies": len(landed_weights),
                                   "landed_us": round(landed, 2), "landed_x_limit": round(landed / landed_limit, 2),
                                   "limit_us": round(limit, 2),
                                   "mins_check": check(check_rows, with_mins, tiles[0], words_span(N, K, tiles[0][0])),
                                   "candidates": []}
            for tile, span in variants(tiles, spans, K):
                entry: dict[str, Any] = {"tile": tile, "span": span}
                try:
                    us = bench.call_us(words_product(tile, {(N, K): span}), x, words_weights)
                    entry |= {"us": round(us, 2), "x_limit": round(us / limit, 2),
                              **check(check_rows, words_weights[0], tile, span)}
                except Exception as exc:  # a tile the GPU cannot hold is a row, not the end of the run
                    entry["error"] = f"{exc}"[:200]
                row["candidates"].append(entry)
            row["candidates"].sort(key=lambda e: e.get("us", float("inf")))
            out.append(row)
            print(json.dumps({**row, "candidates": row["candidates"][:3]}), flush=True)
        del landed_weights, words_weights
    return out


def steps(shape: dict[str, Any], sums: list[dict[str, Any]], peak_gbps: float, configs: int,
          device: str = "cuda") -> list[dict[str, Any]]:
    """Per M of `sums` (step_sums'): the whole step timed as it runs (bench_quantized_gpu.step_weights, one CUDA
    graph) with the landed product, and with the words product at the `configs` best configurations of each rule
    by their projections' sums, fastest first."""
    landed = bench.step_weights(shape, bench.KINDS["int4"].make, device)
    held = bench.step_weights(shape, random_words, device)
    landed_limit = sum(bench.tensor_bytes(*w) for _, w in landed) / (peak_gbps * 1e3)
    limit = sum(words_bytes(w) for _, w in held) / (peak_gbps * 1e3)
    sizes = bench.projections(shape)
    out: list[dict[str, Any]] = []
    for entry in sums:
        inputs = bench.step_inputs(shape, entry["M"], device)
        us = bench.replay_us(bench.step_calls(landed, bench.quantized_product(4), inputs))
        timed = []
        for rule in RULES:
            for best in [b for b in entry["best"] if b["rule"] == rule][:configs]:
                spans = {sizes[name]: span for name, span in best["spans"].items()}
                plain = bench.step_calls(held, words_product(tuple(best["tile"]), spans), inputs)
                for pdl in (False, True):
                    row: dict[str, Any] = {**best, "pdl": pdl, "sum_ms": best["ms"]}
                    try:
                        calls = plain
                        if pdl:
                            calls = bench.step_calls(held, words_product(tuple(best["tile"]), spans, pdl), inputs)
                            row["pdl_same_bits"] = pdl_same_bits(plain, calls)
                        step_us = bench.replay_us(calls)
                        row |= {"ms": round(step_us / 1e3, 3), "x_limit": round(step_us / limit, 2)}
                    except Exception as exc:  # a launch this GPU or driver refuses is a row, not the end of the run
                        row |= {"ms": None, "error": f"{exc}"[:200]}
                    timed.append(row)
        timed.sort(key=lambda t: float("inf") if t["ms"] is None else t["ms"])
        out.append({"M": entry["M"], "limit_ms": round(limit / 1e3, 3), "landed_ms": round(us / 1e3, 3),
                    "landed_x_limit": round(us / landed_limit, 2), "best": timed})
        print(json.dumps(out[-1]), flush=True)
    return out


def step_sums(rows: list[dict[str, Any]], layers: int) -> list[dict[str, Any]]:
    """Per M: the projections' own times added over a whole step (layers x each layer's four, plus the lm_head):
    landed, the memory limit of the words layout's bytes, and the configurations (see the module docstring) that
    ran and passed their checks on every projection at every M, fastest first."""
    times = {r["projection"]: layers if r["projection"] != "lm_head" else 1 for r in rows}
    shapes = {r["projection"]: (r["N"], r["K"]) for r in rows}
    Ms = sorted({r["M"] for r in rows})
    us: dict[tuple[Any, ...], float] = {}  # (M, projection, tile, span) -> microseconds of one call
    failed = set()  # (tile, span) that failed a check anywhere: a fault may show on any shape, so out
    for r in rows:
        for c in r["candidates"]:
            if "us" in c:
                us[(r["M"], r["projection"], tuple(c["tile"]), c["span"])] = c["us"]
                if not c["passed"]:
                    failed.add((tuple(c["tile"]), c["span"]))
    # a projection's variant counts where it ran at every M (one choice serves every M) and never failed
    usable = {key[1:] for key in us if all((M, *key[1:]) in us for M in Ms) and key[2:] not in failed}
    configs: list[tuple[str, Tile, dict[str, int | None]]] = []
    for tile, span in sorted({key[1:] for key in usable}, key=str):
        configs.append(("fixed", tile, {name: span for name in times}))
    for tile in sorted({key[1] for key in usable}):
        choice: dict[str, int | None] = {}
        for name in times:
            options = [key[2] for key in usable if key[:2] == (name, tile)]
            if options:
                choice[name] = min(options, key=lambda o: (sum(us[(M, name, tile, o)] for M in Ms), str(o)))
        configs.append(("per shape", tile, choice))
        configs.append(("words_span", tile, {name: words_span(*shapes[name], tile[0]) for name in times}))
    out = []
    for M in Ms:
        at_m = [r for r in rows if r["M"] == M]
        landed = sum(r["landed_us"] * times[r["projection"]] for r in at_m)
        limit = sum(r["limit_us"] * times[r["projection"]] for r in at_m)
        ranked: list[dict[str, Any]] = []
        for rule, tile, spans in configs:
            keys = [(M, name, tile, spans[name]) for name in times if name in spans]
            if len(keys) == len(times) and all(k[1:] in usable for k in keys):
                total = sum(us[k] * times[k[1]] for k in keys)
                ranked.append({"tile": list(tile), "rule": rule, "spans": {name: spans[name] for name in times},
                               "ms": round(total / 1e3, 3), "x_limit": round(total / limit, 2)})
        ranked.sort(key=lambda w: (w["ms"], w["rule"]))
        out.append({"M": M, "landed_ms": round(landed / 1e3, 3), "limit_ms": round(limit / 1e3, 3), "best": ranked})
    return out


def parse_tile(text: str) -> Tile:
    """A tile from --tile's "BLOCK_N,WARPS,STAGES"."""
    try:
        BN, warps, stages = (int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"error: --tile {text!r} is not three integers BLOCK_N,WARPS,STAGES, e.g. 128,8,3") from None
    return BN, warps, stages


def main(argv: list[str] | None = None) -> int:
    parser = bench.gpu_parser(__doc__.splitlines()[0], "1,16")
    parser.add_argument("--tiles", type=int, default=len(TILES), help="time the first TILES only")
    parser.add_argument("--tile", action="append", default=[], metavar="BLOCK_N,WARPS,STAGES",
                        help="time this tile instead of TILES (repeatable)")
    parser.add_argument("--step-configs", type=int, default=STEP_CONFIGS,
                        help="whole steps timed per M and rule: the best configurations by their projections' sums")
    args = parser.parse_args(argv)
    tiles = tuple(parse_tile(t) for t in args.tile) or TILES[: args.tiles]
    if bench.no_gpu():
        return 2
    shape = bench.shape_of(args.shape)
    rows = run(shape, [int(r) for r in args.rows.split(",")], args.peak_gbps, tiles, SPANS)
    sums = step_sums(rows, shape["num_layers"])
    result = {"shape": args.shape, "device": torch.cuda.get_device_name(), "l2_bytes": bench.l2_bytes("cuda"),
              "projection_sums": sums, "rows": rows}
    bench.write_result(args.out, result)  # the projections, if the steps die
    result["step"] = steps(shape, sums, args.peak_gbps, args.step_configs)
    return bench.finish(args.out, result)


if __name__ == "__main__":
    raise SystemExit(main())
