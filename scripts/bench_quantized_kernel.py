"""The C quantized product alone: microseconds per product of M rows, one thread, the weight in the caches.

    python scripts/bench_quantized_kernel.py [--source trt_lookahead/kernels/onnxruntime_quantized.c]
        [--shapes "576x3072x4,1536x576x4,576x8192x8"] [--rows 1,2,3,4,6,8,16] [--cflags "-mno-avx512f -mno-avxvnni"]
        [--json]

Compiles a timing loop that #includes the kernel's source (the package's, or a variant given by --source) with
the flags the package builds it with (scripts/c_harness.py), and runs every channel group's task of one product
KxNxBITS (K inputs, N outputs, 4-, 5- or 8-bit records with float16 scales, as a GGUF's) on one thread for each row
count M, best of 200 calls on random records and rows. The records of SmolLM2's products fit this machine's
caches, so this times the kernel's arithmetic (what a step of several rows pays), not the memory a one-row product
streams (a product larger than the caches, e.g. 576x131072x4, shows that). Comparing a variant of the kernel
against the package's is what this is for: run both in one invocation of each, alternating, and quote the load.
--cflags adds compiler flags after the package's: "-mno-avx512f -mno-avxvnni" times the AVX2 code path on a CPU
that has AVX-512 or VNNI.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from c_harness import ROOT, build_harness  # the timing loop's build, shared with bench_attention_kernel

SOURCE = ROOT / "trt_lookahead" / "kernels" / "onnxruntime_quantized.c"

HARNESS = r"""
#include SOURCE_FILE
#include <stdio.h>
#include <time.h>
#if !QUANTIZED_KERNEL
int main(void) { fprintf(stderr, "no AVX2, FMA and F16C: the kernel is not built here\n"); return 2; }
#else
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    const int64_t K = atoll(argv[1]), N = atoll(argv[2]), bits = atoll(argv[3]), half = 1;
    const int64_t blocks = (K + BLOCK - 1) / BLOCK, group = group_of(bits), groups = (N + group - 1) / group;
    const size_t record = (size_t)record_bytes(bits, half);
    uint8_t *records = aligned_alloc(64, (size_t)(groups * blocks) * record);
    srand(1);
    for (size_t i = 0; i < (size_t)(groups * blocks) * record; i++) records[i] = (uint8_t)rand();
    for (int64_t i = 0; i < groups * blocks; i++) { /* d and e: small normal float16s */
        uint16_t *scales = (uint16_t *)(records + i * record + group * CODE_BYTES(bits));
        for (int c = 0; c < 2 * group; c++) scales[c] = (uint16_t)(0x2c00 + (rand() & 0xff));
    }
    for (int arg = 4; arg < argc; arg++) {
        const int64_t M = atoll(argv[arg]);
        float *x = malloc(sizeof(float) * (size_t)(M * K)), *y = malloc(sizeof(float) * (size_t)(M * N));
        for (int64_t i = 0; i < M * K; i++) x[i] = (float)rand() / (float)RAND_MAX - 0.5f;
        uint8_t *a = aligned_alloc(32, (size_t)(M * blocks * A_BYTES(bits)));
        float *s = malloc(sizeof(float) * (size_t)(M * blocks)), *sums = malloc(sizeof(float) * (size_t)(M * blocks));
        for (int64_t r = 0; r < M; r++)
            quantize_row(x + r * K, K, blocks, bits, a + r * blocks * A_BYTES(bits), s + r * blocks, sums + r * blocks);
        Product p = {records, a, s, sums, y, M, N, blocks, bits, half};
        const size_t tasks = (size_t)((N + TASK_CHANNELS - 1) / TASK_CHANNELS);
        double best = 1e30;
        for (int rep = 0; rep < 200; rep++) {
            const double start = now();
            for (size_t task = 0; task < tasks; task++) multiply_task(&p, task);
            const double seconds = now() - start;
            best = seconds < best ? seconds : best;
        }
        printf("%lld %.3f\n", (long long)M, best * 1e6);
        free(x), free(y), free(a), free(s), free(sums);
    }
    return 0;
}
#endif
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=SOURCE, help="the kernel's C source (a variant to compare)")
    parser.add_argument("--shapes", default="576x3072x4,1536x576x4,576x8192x8", help="KxNxBITS, comma-separated")
    parser.add_argument("--rows", default="1,2,3,4,6,8,16", help="row counts M, comma-separated")
    parser.add_argument("--cflags", default="", help="compiler flags after the package's (e.g. -mno-avx512f)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [str(int(m)) for m in args.rows.split(",") if m]
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        binary = build_harness(HARNESS, args.source, Path(tmp), tuple(args.cflags.split()))
        for shape in filter(None, args.shapes.split(",")):
            K, N, bits = shape.split("x")
            if bits not in ("4", "5", "8"):
                raise SystemExit(f"{shape}: BITS must be 4, 5 or 8")
            run = subprocess.run([str(binary), K, N, bits, *rows], capture_output=True, text=True)
            if run.returncode:
                raise SystemExit(f"{args.source.name} at {shape}: {run.stderr.strip() or 'the timing loop failed'}")
            results[shape] = {m: float(us) for m, us in (line.split() for line in run.stdout.splitlines())}
    flags = f" {args.cflags}" if args.cflags else ""
    print(f"{args.source.name}{flags}, load {os.getloadavg()[0]:.2f}: microseconds per product of M rows, one thread")
    for shape, times in results.items():
        print(f"  {shape}: " + ", ".join(f"M={m} {us:.1f} ({us / times[rows[0]]:.2f}x)" for m, us in times.items()))
    if args.json:
        print(json.dumps({"source": str(args.source), "cflags": args.cflags, "us": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
