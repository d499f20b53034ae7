#!/usr/bin/env bash
# Issue 42's GPU figures in one call of at most 8 minutes on an H200 (the `device` tool, ../shared/gpu recipe;
# `.gpu` and `.ptx` carried), in order of value, each stage time-boxed inside one deadline so the later ones
# still run or say they were skipped:
#   1. suite: 31B plain B=1 (fraction of the copy roofline), oracle p=0.8 MTP / plain K=1..6 and auto at B=1,
#      greedy MTP == plain; the 26B-A4B at B=1 and 8 (aggregate B=8 / B=1, K=3 round in plain steps); the
#      31B's auto at B=4 and 8 beside fixed K=3
#   2. fused: issue 42's fused kernels at the released shapes, the 26B-A4B's router and MoE glue among them
#      (correct, rows their own, time, % of copy)
#   3. kernels: the quantized product's weight stream at the 31B's shapes (% of copy)
#   4. env: MLX_USE_CUDA_GRAPHS / MLX_MAX_OPS_PER_BUFFER / MLX_MAX_MB_PER_BUFFER on the tiny dense pair's steps
# Logs, JSON and MLX's compiled-kernel cache under $OUT.   run: bash apps/device/issue42.sh   (carry: .gpu, .ptx)
# DEADLINE (seconds, default 470) and the stages' limits can be set from the environment.
set -uo pipefail
OUT=${OUT:-/tmp/out}
DEADLINE=${DEADLINE:-470}
started=$(date +%s)
. apps/device/setup.sh
elapsed() { echo $(( $(date +%s) - started )); }
stage() {  # stage NAME SECONDS COMMAND...: at most SECONDS, never past the deadline
  local name=$1 limit=$2; shift 2
  local left=$(( DEADLINE - $(elapsed) ))
  if [ "$left" -lt 20 ]; then echo "== $name: skipped (${left}s left)" | tee -a "$OUT/run.log"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s) at $(elapsed)s" | tee -a "$OUT/run.log"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -c 2500 "$OUT/$name.log"
  echo "== $name: exit $rc at $(elapsed)s" | tee -a "$OUT/run.log"
}
stage suite "${SUITE_LIMIT:-250}" python -m apps.bench gpu --stages 31b,26b-a4b,31b-batch --budget "${SUITE_BUDGET:-235}" \
  --no-peers --no-demo --prefill "" --results-dir "$OUT" --out /tmp/suite
stage fused "${FUSED_LIMIT:-60}" python -m apps.device.fused_check --repeats 10
stage kernels "${KERNELS_LIMIT:-50}" python -m apps.bench kernels --shapes 31b --quick --repeats 3 --out /tmp/kernels
cp /tmp/kernels/results.json "$OUT/kernels.json" 2>/dev/null
# The buffer settings on a pair whose steps are all launches (the tiny dense fixture at B=1 and its K=1..6 rounds)
for setting in "" MLX_USE_CUDA_GRAPHS=0 MLX_MAX_OPS_PER_BUFFER=400 MLX_MAX_MB_PER_BUFFER=4000; do
  stage "env-${setting:-default}" "${ENV_LIMIT:-35}" env $setting python -m apps.bench gpu --smoke --stages 31b \
    --no-peers --no-demo --prefill "" --out "/tmp/env-${setting:-default}"
done
grep -h "tok/s\|roofline\|plain" "$OUT"/env-*.log 2>/dev/null | head -40 > "$OUT/env-summary.txt"
tar -C "$MLX_PTX_CACHE_DIR" -czf "$OUT/ptx-cache.tgz" . && ls -la "$OUT"
echo "done at $(elapsed)s"
