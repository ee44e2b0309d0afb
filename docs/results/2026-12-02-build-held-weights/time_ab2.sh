#!/usr/bin/env bash
# build time at 8d32f76 (fbf85a0's build), nothing else running: 1B int4 after / before alternating, two rounds
cd /work/main
OLD="env PYTHONPATH=/work/notes/s64/wt /work/main/.venv/bin/python -P -m trt_lookahead.cli"
M=/work/notes/s64/mem
for r in 1; do
  .venv/bin/python scripts/build_memory.py --checkpoints /work/notes/s64/ckpt --shape llama-1b --weights int4 --out $M/time2-1b-int4-after-$r.json > /dev/null 2>&1
  .venv/bin/python scripts/build_memory.py --checkpoints /work/notes/s64/ckpt --shape llama-1b --weights int4 --trt-lookahead "$OLD" --out $M/time2-1b-int4-before-$r.json > /dev/null 2>&1
done
echo done > $M/TIME2_DONE
