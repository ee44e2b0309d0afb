"""Where a GPU int4 product's instructions go, read without a GPU: each kernel compiled for sm_90 (H100, H200) by
Triton's bundled ptxas, disassembled by its nvdisasm, and the SASS of its main loop (the longest backward branch)
counted by opcode (docs/results/2026-11-30-int4-register-dequant.md).

    python scripts/sass_census.py [--out census.json]

Kernels: the blocks layout's int4 product (kernels/invariant.py `_quantized_kernel` at QUANTIZED_TILES[4], "landed")
and the words layout's (kernels/quantized_words.py `_words_kernel` at each of scripts/int4_register_dequant.py's
TILES, "words"), bfloat16 activations, zero points without mins and Q4_1 mins, one span, K a whole number of
128-dim steps, the divisibility a launch on real tensors gives (pointers, N,
K and the strides multiples of 16). Per kernel: registers a thread, shared memory, whether the weight operand
reaches the tensor cores from registers (wgmma's A operand) or through shared memory, the loop's instructions a
thread and per weight, its wgmmas (HGMMA) and their arrives and waits (WARPGROUP: two a wgmma where ptxas
serializes them), and its most frequent opcodes. Counts are static: a loop instruction issues once per
iteration, and an iteration covers BLOCK_N x BLOCK_K weights over the program's threads. They depend on the
installed Triton; the lent GPUs run Triton 3.6.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import int4_register_dequant as sweep  # noqa: E402

from trt_lookahead.kernels import invariant, quantized_words  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
LABEL = re.compile(r"^\s*\.L_x_(\d+):")
BRANCH = re.compile(r"\bBRA\b.*`\(\.L_x_(\d+)\)")
SPAN_STEPS = 8  # the words product's steps a program: the loop's trip count is a constant of the kernel


def loop_census(sass: str) -> collections.Counter[str]:
    """Opcodes (without modifiers) of the instructions from the target of the longest backward branch to the branch
    itself, in nvdisasm's text; empty without a loop."""
    labels: dict[str, int] = {}
    pending: list[str] = []
    instructions: list[tuple[int, str, str]] = []  # (address, opcode, line)
    for line in sass.splitlines():
        label = LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        found = INSTRUCTION.match(line)
        if found:
            address = int(found.group(1), 16)
            labels.update(dict.fromkeys(pending, address))
            pending = []
            instructions.append((address, found.group(2).split(".")[0], line))
    loop: tuple[int, int] | None = None
    for address, _, line in instructions:
        branch = BRANCH.search(line)
        start = labels.get(branch.group(1)) if branch else None
        if start is not None and start <= address and (loop is None or address - start > loop[1] - loop[0]):
            loop = (start, address)
    if loop is None:
        return collections.Counter()
    return collections.Counter(op for address, op, _ in instructions if loop[0] <= address <= loop[1])


def compile_sm90(fn: Any, pointers: dict[str, str], ints: tuple[str, ...], constexprs: dict[str, Any],
                 warps: int, divisible: tuple[str, ...], stages: int | None = None) -> Any:
    """fn compiled for sm_90, the arguments named in `divisible` hinted as multiples of 16 (a launch's hints)."""
    names = [*pointers, *ints]
    signature = {**pointers, **dict.fromkeys(ints, "i32"), **dict.fromkeys(constexprs, "constexpr")}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": warps} if stages is None else {"num_warps": warps, "num_stages": stages}
    return triton.compile(source, target=TARGET, options=options)


def describe(compiled: Any, weights_per_iteration: int, warps: int) -> dict[str, Any]:
    """Registers, shared memory, the weight operand's path and the loop's census of one compiled kernel."""
    with tempfile.TemporaryDirectory() as scratch:
        cubin = Path(scratch) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(TOOLS / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([str(TOOLS / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    census = loop_census(sass)
    ttgir = compiled.asm["ttgir"]
    per_thread = weights_per_iteration / (warps * 32)
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),  # type: ignore[union-attr]
            "shared_bytes": compiled.metadata.shared,
            "weights_from_registers": "warp_group_dot" in ttgir and "dot_op<{opIdx = 0" in ttgir,
            "loop_instructions": sum(census.values()), "wgmmas": census["HGMMA"], "wgmma_syncs": census["WARPGROUP"],
            "weights_per_thread": per_thread,
            "per_weight": round(sum(census.values()) / per_thread, 2), "top": census.most_common(12)}


def landed(mins: bool) -> dict[str, Any]:
    BM, BN, BK, warps = invariant.QUANTIZED_TILES[4]
    pointers = {"x_ptr": "*bf16", "w_ptr": "*i32", "y_ptr": "*bf16", "s_ptr": "*fp32", "z_ptr": "*u8",
                "m_ptr": "*fp32"}
    ints = ("M", "N", "K", "SPAN_STEPS", "stride_xm", "stride_wn", "stride_ym", "stride_s", "stride_z")
    consts = dict(SPLIT=False, UPCAST_DOT=False, QBITS=4, QBLOCK=32, HAS_MINS=mins, BLOCK_M=BM, BLOCK_N=BN,
                  BLOCK_K=BK)
    compiled = compile_sm90(invariant._quantized_kernel, pointers, ints, consts, warps,
                            (*pointers, "N", "K", "stride_xm", "stride_wn", "stride_ym", "stride_s", "stride_z"))
    return {"kernel": "landed", "tile": [BM, BN, BK, warps], "mins": mins, **describe(compiled, BN * BK, warps)}


def compile_words(tile: tuple[int, int, int], mins: bool, split: bool = False, pdl: bool = False) -> Any:
    """The words layout's product at `tile` compiled for sm_90, one span of SPAN_STEPS steps: K whole steps (EVEN),
    or with split, K past the span's end and float32 sums out."""
    BN, warps, stages = tile
    pointers = {"x_ptr": "*bf16", "w_ptr": "*i32", "y_ptr": "*fp32" if split else "*bf16", "p_ptr": "*i32",
                "m_ptr": "*bf16"}
    ints = ("M", "N", "K", "stride_xm", "stride_wn", "stride_ym", "stride_p")
    consts = dict(SPAN_STEPS=SPAN_STEPS, SPLIT=split, HAS_MINS=mins, INTERPRETED=False,
                  BLOCK_M=quantized_words.BLOCK_M, BLOCK_N=BN, EVEN=not split, PDL=pdl)
    return compile_sm90(quantized_words._words_kernel, pointers, ints, consts, warps,
                        (*pointers, "N", "K", "stride_xm", "stride_wn", "stride_ym", "stride_p"), stages)


def words(tile: tuple[int, int, int], mins: bool) -> dict[str, Any]:
    """The words layout's product at `tile`, one span of SPAN_STEPS steps."""
    return {"kernel": "words", "tile": list(tile), "mins": mins,
            **describe(compile_words(tile, mins), tile[0] * quantized_words.STEP, tile[1])}


GLOBAL_ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:ld|st|atom|red|cp\.async|prefetch)[.\w]*)", re.MULTILINE)
GRID_WAIT = "griddepcontrol.wait"


def before_grid_wait(ptx: str) -> dict[str, Any]:
    """The PTX of a kernel launched as a programmatic dependent, up to its first griddepcontrol.wait: whether it
    lets its own dependents launch there, and its global-memory instructions (shared memory's and the kernel
    parameters' left out) by opcode; the wait is where the kernel before it on the stream is done."""
    wait = ptx.find(GRID_WAIT)
    head = ptx[: len(ptx) if wait < 0 else wait]
    ops = collections.Counter(op for op in GLOBAL_ACCESS.findall(head)
                              if (".shared" not in op and ".param" not in op) or op.startswith("cp.async"))
    return {"waits": wait >= 0, "launches_dependents": "griddepcontrol.launch_dependents" in head,
            "global_before_wait": dict(ops)}


def pdl_prologues() -> list[dict[str, Any]]:
    """`before_grid_wait` of the kernels a PDL launch of the words product runs: the product (split, with mins)
    and its span sums."""
    product = compile_words(quantized_words.WORDS_TILE, mins=True, split=True, pdl=True)
    sums = compile_sm90(invariant._span_sum_kernel, {"part_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": "*bf16"},
                        ("M", "N"), dict(SPANS=4, HAS_BIAS=False, BLOCK=invariant.SPAN_SUM_BLOCK, PDL=True),
                        invariant.NUM_WARPS, ("part_ptr", "b_ptr", "y_ptr"))
    return [{"kernel": "words, pdl", **before_grid_wait(product.asm["ptx"])},
            {"kernel": "span sums, pdl", **before_grid_wait(sums.asm["ptx"])}]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the census as JSON here")
    parser.add_argument("--tiles", type=int, default=len(sweep.TILES), help="the words product's first TILES only")
    args = parser.parse_args(argv)
    rows = [landed(False), landed(True)]
    rows += [words(tile, mins) for tile in sweep.TILES[: args.tiles] for mins in (False, True)]
    rows += pdl_prologues()
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"triton": triton.__version__, "kernels": rows}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
