# alternate: before (worktree at d5c5abc) / after (working tree); wall of one generate each
PY=/work/main/.venv/bin/python
for round in 1 2 3 4; do
  for side in before after; do
    dir=/work/main; [ $side = before ] && dir=/work/notes/s63/wt
    for model in "smollm2-135m-instruct" "smollm2-135m-instruct --weights int4"; do
      s=$(date +%s.%N); (cd $dir && $PY -m trt_lookahead.cli generate --model $model --prompt "def add(a, b):" --max-new-tokens 16 >/dev/null 2>&1); e=$(date +%s.%N)
      echo "$side | $model | $(echo "$e - $s" | bc)"
    done
  done
done
