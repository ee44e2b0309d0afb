#!/bin/bash
# 8B-shaped float16 checkpoint -> int4: this change, then the session start (2f531ec)
cd /work/main
R=/work/notes/s66/res
.venv/bin/python scripts/build_memory.py --shape llama-8b --weights int4 --checkpoint-dtype float16 --checkpoints /work/notes/s66/ckpt \
  --out $R/8b-int4-after.json > $R/8b-int4-after.log 2>&1
.venv/bin/python scripts/build_memory.py --shape llama-8b --weights int4 --checkpoint-dtype float16 --checkpoints /work/notes/s66/ckpt \
  --trt-lookahead "env PYTHONPATH=/work/wt_base /work/main/.venv/bin/python -P -m trt_lookahead.cli" \
  --out $R/8b-int4-before.json > $R/8b-int4-before.log 2>&1
echo done
