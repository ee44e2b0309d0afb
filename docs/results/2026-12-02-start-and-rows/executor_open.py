"""Time opening an executor (its KV cache) on the cached float32 SmolLM2 engine, at 1 and 8 slots, and the peak
resident memory after. python executor_open.py ENGINE_DIR"""
import resource
import sys
import time

from trt_lookahead.backends.open import open_engine

engine = open_engine(sys.argv[1], threads=2)
for slots in (1, 8):
    start = time.perf_counter()
    executor = engine.executor(slots)
    seconds = time.perf_counter() - start
    print(f"max_batch {slots}: KV {2 * executor.k_cache.nbytes / 1e9:.2f} GB, open {seconds:.2f} s", flush=True)
    del executor
print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")
