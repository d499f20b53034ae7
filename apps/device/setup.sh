# Sourced by the device scripts (issue34.sh, issue42.sh) from the repository root, with OUT set and
# $OUT/run.log to start: the machine's environment (.gpu/on-device.sh, carried), MLX's compiled kernels
# restored (a previous call's .ptx/ptx-cache.tgz, carried, else the committed one of MLX 0.32.4 on an H200:
# its CuTe matmuls take tens of seconds each to compile on a fresh machine), and the card named in the log.
mkdir -p "$OUT"
. .gpu/on-device.sh > "$OUT/run.log" 2>&1 || { cat "$OUT/run.log"; exit 1; }
cache=.ptx/ptx-cache.tgz; [ -f "$cache" ] || cache=apps/device/ptx-cache-mlx-0.32.4-h200.tgz
if [ -f "$cache" ]; then
  mkdir -p "$MLX_PTX_CACHE_DIR" && tar -C "$MLX_PTX_CACHE_DIR" -xzf "$cache"
  echo "PTX cache: $(ls "$MLX_PTX_CACHE_DIR" | wc -l) files restored from $cache" >> "$OUT/run.log"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv >> "$OUT/run.log" 2>&1
cat "$OUT/run.log"
