#!/bin/bash
# The 8B shape: write the K-quant checkpoint once, then one int4 build after (this checkout) and one before (a
# worktree of the session's start, PYTHONPATH), each engine kept, and the two engines' files compared by sha256.
# bash ab_8b.sh CHECKPOINT BASE_WORKTREE OUT_DIR [ARMS, default "after before"]
set -u
ckpt=$1 base=$2 out=$3 arms=${4:-after before} here=$(dirname "$0")
mkdir -p "$out"
[ -f "$ckpt/config.json" ] || python "$here/k_quant_checkpoint.py" --shape llama-8b --out "$ckpt"
for arm in $arms; do
  rm -rf "$out/engine-$arm"
  if [ $arm = before ]; then export PYTHONPATH=$base; else unset PYTHONPATH; fi
  /usr/bin/time -v trt-lookahead build --model "$ckpt" --output "$out/engine-$arm" --weights int4 > "$out/$arm-8b.log" 2>&1
  echo "$arm 8b: $(grep -o 'built in [0-9.]* s' "$out/$arm-8b.log") $(grep -o '[0-9]*/[0-9]* next tokens equal' "$out/$arm-8b.log") \
user/sys/elapsed/minor faults: $(grep -E 'Minor|User time|System time|Elapsed' "$out/$arm-8b.log" | awk -F': ' '{printf "%s ", $2}') \
max RSS $(grep 'Maximum resident' "$out/$arm-8b.log" | awk '{print $NF}') kB load $(cut -d' ' -f1 /proc/loadavg)"
done
[ -d "$out/engine-before" ] || exit 0
(cd "$out/engine-after" && find . -type f ! -name config.json | sort | xargs sha256sum) > "$out/after.sha"
(cd "$out/engine-before" && find . -type f ! -name config.json | sort | xargs sha256sum) > "$out/before.sha"
if cmp -s "$out/after.sha" "$out/before.sha"; then echo "engines: every file but config.json identical"; else echo "engines differ"; fi
diff <(python -m json.tool "$out/engine-after/config.json") <(python -m json.tool "$out/engine-before/config.json")
