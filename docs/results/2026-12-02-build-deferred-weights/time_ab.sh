#!/bin/bash
# 1B int4 build time and memory, the session start (33343ff, a worktree) against this change, alternating
cd /work/main
R=/work/notes/s65/res
for round in 1 2; do
  .venv/bin/python scripts/build_memory.py --shape llama-1b --weights int4 --checkpoints /work/notes/s64/ckpt \
    --trt-lookahead "env PYTHONPATH=/work/wt_base /work/main/.venv/bin/python -P -m trt_lookahead.cli" \
    --out $R/time-1b-int4-before-$round.json > /dev/null 2>&1
  .venv/bin/python scripts/build_memory.py --shape llama-1b --weights int4 --checkpoints /work/notes/s64/ckpt \
    --out $R/time-1b-int4-after-$round.json > /dev/null 2>&1
done
echo done
