#!/bin/bash
# 8B-shaped float16 checkpoint -> int4 engine: this change (engine kept, moved aside), then the session start's
# build (stopped past 20 GB)
cd /work/main
C=/work/notes/s65/ckpt
R=/work/notes/s65/res
.venv/bin/python scripts/build_memory.py --shape llama-8b --checkpoint-dtype float16 --weights int4 --checkpoints $C \
  --stop-above-mb 20000 --keep-engine --out $R/8b-int4-after.json > $R/8b-int4-after.log 2>&1
rm -rf $C/engine-8b-int4 && mv $C/llama-8b-int4-engine $C/engine-8b-int4
.venv/bin/python scripts/build_memory.py --shape llama-8b --checkpoint-dtype float16 --weights int4 --checkpoints $C \
  --stop-above-mb 20000 --trt-lookahead "env PYTHONPATH=/work/wt_base /work/main/.venv/bin/python -P -m trt_lookahead.cli" \
  --out $R/8b-int4-before.json > $R/8b-int4-before.log 2>&1
echo done
