#!/bin/bash
# build each config with the base worktree and with main; compare engine files
cd /work/main
S=../shared/models/stories260K
M=$HOME/.cache/trt-lookahead/models/smollm2-135m-instruct
i=0
while read -r model args; do
  i=$((i+1))
  rm -rf /tmp/cmp_a$i /tmp/cmp_b$i
  env PYTHONPATH=/work/wt_base .venv/bin/python -P -m trt_lookahead.cli build --model $model --output /tmp/cmp_a$i $args > /tmp/cmp_a$i.log 2>&1
  /usr/bin/time -f "%e s %M KB" .venv/bin/trt-lookahead build --model $model --output /tmp/cmp_b$i $args > /tmp/cmp_b$i.log 2>&1
  r=""; for f in model.onnx weights.bin; do cmp -s /tmp/cmp_a$i/$f /tmp/cmp_b$i/$f && r="$r $f=same" || r="$r $f=DIFF"; done
  echo "$i $model $args:$r $(grep -h 'next tokens' /tmp/cmp_b$i.log)"
done <<LIST
$S --weights int8
$S --weights int4 --activations float
$S --weights int4 --attention native --activations float
$M --weights int4
$M --weights int8
LIST
