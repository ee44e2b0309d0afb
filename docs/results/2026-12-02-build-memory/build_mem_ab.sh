# peak RSS of an int4 build of SmolLM2's Q4_K_M GGUF (converted checkpoint cached), before (worktree at the commit before the change) and
# after, alternating; memtrace.py samples the process's RSS every 0.1 s
for round in 1 2; do
  for side in before after; do
    dir=/work/main; [ $side = before ] && dir=/work/notes/s63/wt
    rm -rf /work/notes/s63/cachetest/engines
    peak=$(cd $dir && TRT_LOOKAHEAD_CACHE=/work/notes/s63/cachetest /work/main/.venv/bin/python /work/notes/s63/memtrace.py /work/main/.venv/bin/python -m trt_lookahead.cli generate --model /work/notes/s60/q/smollm2-q4km.gguf --weights int4 --prompt "hi" --max-new-tokens 4 2>&1 | grep "final peak")
    echo "$side | $peak"
  done
done
