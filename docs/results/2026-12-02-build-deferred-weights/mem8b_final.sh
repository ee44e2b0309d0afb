#!/bin/bash
# the 8B int4 build with every change of this session, then a generate run on the engine it made
cd /work/main
R=/work/notes/s65/res
C=/work/notes/s65/ckpt
rm -rf $C/llama-8b-int4-engine $C/engine-8b-int4
.venv/bin/python scripts/build_memory.py --shape llama-8b --checkpoint-dtype float16 --weights int4 \
  --checkpoints $C --stop-above-mb 20000 --keep-engine --out $R/8b-int4-mapped.json > $R/8b-int4-mapped.log 2>&1
.venv/bin/python - > $R/8b-generate.json 2> $R/8b-generate.log <<'PY'
import json, sys
sys.path.insert(0, "scripts")
import build_memory
command = [".venv/bin/trt-lookahead", "generate", "--engine", "/work/notes/s65/ckpt/llama-8b-int4-engine",
           "--prompt", "def fibonacci(n):", "--max-new-tokens", "32"]
print(json.dumps({"command": command, **build_memory.measured_build(command)}, indent=1))
PY
echo done
