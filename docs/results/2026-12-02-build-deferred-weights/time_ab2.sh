#!/bin/bash
# 1B int4, the session start against this change, one more round with each phase's start time
cd /work/main
R=/work/notes/s65/res
.venv/bin/python scripts/build_memory.py --shape llama-1b --weights int4 --checkpoints /work/notes/s64/ckpt \
  --trt-lookahead "env PYTHONPATH=/work/wt_base /work/main/.venv/bin/python -P -m trt_lookahead.cli" \
  --out $R/time-1b-int4-before-3.json > /dev/null 2>&1
.venv/bin/python scripts/build_memory.py --shape llama-1b --weights int4 --checkpoints /work/notes/s64/ckpt \
  --out $R/time-1b-int4-after-3.json > /dev/null 2>&1
echo done
