#!/bin/bash
# 1B int4 (float16 checkpoint), the session start (2f531ec) against the sliced reference product, alternating
cd /work/main
R=/work/notes/s66/res
for i in 1 2; do
.venv/bin/python scripts/build_memory.py --shape llama-1b --weights int4 --checkpoint-dtype float16 --checkpoints /work/notes/s66/ckpt \
  --trt-lookahead "env PYTHONPATH=/work/wt_base /work/main/.venv/bin/python -P -m trt_lookahead.cli" \
  --out $R/time-1b-int4-before-$i.json > /dev/null 2>&1
.venv/bin/python scripts/build_memory.py --shape llama-1b --weights int4 --checkpoint-dtype float16 --checkpoints /work/notes/s66/ckpt \
  --out $R/time-1b-int4-after-$i.json > /dev/null 2>&1
done
echo done
