#!/usr/bin/env bash
# One call on an NVIDIA GPU machine (the `device` tool, ../shared/gpu recipe; `.gpu` and `.ptx` carried):
# the kernels' correctness and timings first, then the suite's 31B and 26B-A4B figures; logs, JSON and
# MLX's compiled-kernel cache under $OUT (at most 8 files come back). Each stage is time-boxed so that
# the later ones still run.   run: bash apps/device/issue34.sh   (carry: .gpu, .ptx)
set -uo pipefail
OUT=${OUT:-/tmp/out}
started=$(date +%s)
. apps/device/setup.sh
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s) at $(( $(date +%s) - started ))s" | tee -a "$OUT/run.log"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -c 3000 "$OUT/$name.log"
  echo "== $name: exit $rc at $(( $(date +%s) - started ))s" | tee -a "$OUT/run.log"
}
[ -n "${SELFTEST:-}" ] && stage selftest "${SELFTEST_LIMIT:-90}" python -m mlx_mtp.selftest --pairs moe-q4
stage kernels "${KERNELS_LIMIT:-110}" python -m apps.bench kernels --quick --repeats 5 --out /tmp/kernels
cp /tmp/kernels/results.json "$OUT/kernels.json" 2>/dev/null
stage suite "${SUITE_LIMIT:-250}" python -m apps.bench gpu --budget "${SUITE_BUDGET:-235}" --no-demo \
  --results-dir "$OUT" --out /tmp/suite
tar -C "$MLX_PTX_CACHE_DIR" -czf "$OUT/ptx-cache.tgz" . && ls -la "$OUT"
