#!/usr/bin/env bash
# after = the working tree, before = a worktree of 29c6eef (the session's start); one build at a time
cd /work/main
OLD="env PYTHONPATH=/work/notes/s64/wt /work/main/.venv/bin/python -P -m trt_lookahead.cli"
M=/work/notes/s64/mem
run() {  # name, extra args...
  local name=$1; shift
  .venv/bin/python scripts/build_memory.py --checkpoints /work/notes/s64/ckpt --stop-above-mb 20000 --out $M/$name.json "$@" > $M/$name.log 2>&1
}
run 1b-int4-after --shape llama-1b --weights int4
run 1b-int4-before --shape llama-1b --weights int4 --trt-lookahead "$OLD"
run 1b-gguf-int4-after --shape llama-1b --weights int4 --gguf
run 1b-gguf-int4-before --shape llama-1b --weights int4 --gguf --trt-lookahead "$OLD"
run 1b-float-after --shape llama-1b --weights float
run 1b-float-before --shape llama-1b --weights float --trt-lookahead "$OLD"
run 3b-int4-after --shape llama-3b --weights int4
run 3b-int4-before --shape llama-3b --weights int4 --trt-lookahead "$OLD"
run 3b-gguf-int4-after --shape llama-3b --weights int4 --gguf
run 3b-gguf-int4-before --shape llama-3b --weights int4 --gguf --trt-lookahead "$OLD"
echo done > $M/DONE
