#!/bin/bash
# int4 builds with deferred projections and the smaller smoke-check caches: 8B (float16 checkpoint), 1B, 3B
cd /work/main
R=/work/notes/s65/res
.venv/bin/python scripts/build_memory.py --shape llama-8b --checkpoint-dtype float16 --weights int4 \
  --checkpoints /work/notes/s65/ckpt --stop-above-mb 20000 --keep-engine --out $R/8b-int4-final.json > $R/8b-int4-final.log 2>&1
for shape in llama-1b llama-3b; do
  .venv/bin/python scripts/build_memory.py --shape $shape --weights int4 --checkpoints /work/notes/s64/ckpt \
    --stop-above-mb 20000 --out $R/${shape#llama-}-int4-final.json > $R/${shape#llama-}-int4-final.log 2>&1
done
echo done
