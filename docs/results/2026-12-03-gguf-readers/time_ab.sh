#!/bin/bash
# 1B int4 builds of the K-quant checkpoint, after (this checkout) and before (a worktree of the session's start,
# run with PYTHONPATH), alternating, two rounds; the build's own "built in" line and peak memory.
# bash time_ab.sh CHECKPOINT BASE_WORKTREE OUT_DIR
set -u
ckpt=$1 base=$2 out=$3
mkdir -p "$out"
for round in 1 2; do
  for arm in after before; do
    rm -rf /tmp/k_engine
    if [ $arm = before ]; then export PYTHONPATH=$base; else unset PYTHONPATH; fi
    /usr/bin/time -v trt-lookahead build --model "$ckpt" --output /tmp/k_engine --weights int4 \
      > "$out/$arm-$round.log" 2>&1
    echo "$arm $round: $(grep -o 'built in [0-9.]* s' "$out/$arm-$round.log") \
max RSS $(grep 'Maximum resident' "$out/$arm-$round.log" | awk '{print $NF}') kB \
$(grep -o '[0-9]*/[0-9]* next tokens equal' "$out/$arm-$round.log") load $(cut -d' ' -f1 /proc/loadavg)"
  done
done
