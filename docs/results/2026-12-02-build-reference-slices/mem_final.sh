#!/bin/bash
# the landed code (sliced reference, dense slices made in place): 8B then 1B, float16 checkpoints -> int4
cd /work/main
R=/work/notes/s66/res
.venv/bin/python scripts/build_memory.py --shape llama-8b --weights int4 --checkpoint-dtype float16 --checkpoints /work/notes/s66/ckpt \
  --out $R/8b-int4-final.json > $R/8b-int4-final.log 2>&1
.venv/bin/python scripts/build_memory.py --shape llama-1b --weights int4 --checkpoint-dtype float16 --checkpoints /work/notes/s66/ckpt \
  --out $R/1b-int4-final.json > $R/1b-int4-final.log 2>&1
echo done
