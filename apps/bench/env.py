"""Where a benchmark ran: device, MLX version, regime (which BLAS serves fp32 matmuls), CPU model.
Imported only after regime.setup (it imports mlx)."""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Callable

import mlx.core as mx

from mlx_mtp.runtime.memory import BACKENDS, Device

from . import regime


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info() -> dict:
    import mlx_lm

    preload = os.environ.get("LD_PRELOAD", "")
    info = {
        "device": str(mx.default_device()),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "python": platform.python_version(),
        "ld_preload": preload,
        "regime": regime.describe(),
    }
    info["mkl_preloaded"] = bool(info["regime"]["mkl"])  # stock with an MKL LD_PRELOAD is refused
    info["backend"] = Device.current().backend
    if mx.default_device() == mx.gpu:
        info["gpu"] = mx.device_info().get("device_name", info["backend"])
    return info


def device_line(info: dict) -> str:
    blas = f"regime {info['regime']['label']}"
    gpu = f", GPU {info['gpu']}" if info.get("gpu") else ""
    return (f"device {info['device']} ({info['cpu']}, {info['cpu_count']} cores{gpu}), MLX "
            f"{BACKENDS[info['backend']]} backend, {info['platform']}, mlx {info['mlx']}, "
            f"mlx-lm {info['mlx_lm']}, {blas}")


def reset_peak() -> None:
    mx.reset_peak_memory()


def peak_mb() -> float:
    return mx.get_peak_memory() / 2**20


def time_fn(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median seconds of `fn()` (which must evaluate its own result) after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rss_gib(field: str = "VmRSS") -> float:
    """This process's resident memory (VmRSS) or its high-water mark since `reset_peak_rss`
    (VmHWM), GiB. Linux reads /proc; elsewhere the peak is getrusage's, since the start."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**30  # macOS: bytes


def reset_peak_rss() -> None:
    """Restart VmHWM from the current RSS (Linux: `5` into /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
