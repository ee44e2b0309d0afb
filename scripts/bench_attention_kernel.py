"""The C attention kernel alone: ns per query-key pair by cached keys and queries a head, one thread.

    python scripts/bench_attention_kernel.py [--source trt_lookahead/kernels/onnxruntime_attention.c]
        [--cases "1024x16,512x4,128x1,1024x1"] [--heads 9,3,64] [--json]

Compiles a timing loop that #includes the kernel's source (the package's, or a variant given by --source) with
the flags the package builds it with (scripts/c_harness.py), and
runs every (row, query head) task of one layer on one thread for each case KEYSxQUERIES: KEYS cached keys, QUERIES
causal step queries a head (SmolLM2's 9 query heads, 3 KV heads, head_dim 64 unless --heads says otherwise), best
of 50 runs with the caches warm. Comparing a variant of the kernel against the package's is what this is for:
run both in one invocation of each, alternating, and quote the load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the package from this checkout, installed or not
    sys.path.insert(0, str(ROOT))

from trt_lookahead.kernels.onnxruntime_library import SOURCE  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from c_harness import build_harness  # noqa: E402  the timing loop's build, shared with bench_quantized_kernel.py

HARNESS = r"""
#include SOURCE_FILE
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    const int64_t L = atoll(argv[1]), T = atoll(argv[2]), Hq = atoll(argv[3]), Hkv = atoll(argv[4]), D = atoll(argv[5]);
    const int64_t S = L + T;
    float *kc = malloc(sizeof(float) * Hkv * S * D), *vc = malloc(sizeof(float) * Hkv * S * D);
    for (int64_t i = 0; i < Hkv * S * D; i++) kc[i] = (float)(i % 97) * 0.01f, vc[i] = (float)(i % 89) * 0.01f;
    float *q = calloc(T * Hq * D, sizeof(float)), *k = calloc(T * Hkv * D, sizeof(float));
    float *v = calloc(T * Hkv * D, sizeof(float)), *out = calloc(T * Hq * D, sizeof(float));
    for (int64_t i = 0; i < T * Hq * D; i++) q[i] = (float)(i % 13) * 0.01f;
    int32_t cache_len[1] = {(int32_t)L};
    uint8_t *visible = calloc(T * T, 1);
    for (int64_t t = 0; t < T; t++) for (int64_t j = 0; j <= t; j++) visible[t * T + j] = 1;
    Problem p = {q, k, v, kc, vc, cache_len, visible, out, T, Hq, Hkv, D, S, 0.125f, 0};
    double best = 1e30;
    for (int r = 0; r < 50; r++) {
        double start = now();
        for (size_t item = 0; item < (size_t)Hq; item++) attend_item(&p, item);
        double seconds = now() - start;
        best = seconds < best ? seconds : best;
    }
    printf("%.6f\n", best / (double)(T * Hq * L) * 1e9);
    return p.failed;
}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=SOURCE, help="the kernel's C source (a variant to compare)")
    parser.add_argument("--cases", default="1024x16,512x4,128x1,1024x1", help="KEYSxQUERIES, comma-separated")
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head_dim")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        binary = build_harness(HARNESS, args.source, Path(tmp))
        results = {}
        for case in filter(None, args.cases.split(",")):
            keys, queries = case.split("x")
            run = subprocess.run([str(binary), keys, queries, *args.heads.split(",")], capture_output=True, text=True)
            if run.returncode:
                raise SystemExit(f"{args.source.name}: the kernel reported a failed task at {case} (a cache_len out of "
                                 "range, or no memory for a row's scores)")
            results[case] = float(run.stdout)
    print(f"{args.source.name}, heads {args.heads}, load {os.getloadavg()[0]:.2f}: ns per query-key pair, one thread")
    for case, ns in results.items():
        keys, queries = case.split("x")
        print(f"  {keys} cached keys, {queries} queries a head: {ns:.2f}")
    if args.json:
        print(json.dumps({"source": str(args.source), "heads": args.heads, "ns_per_pair": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
