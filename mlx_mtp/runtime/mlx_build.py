"""Which MLX build this environment has, and the one line that fixes it when MLX cannot load.

MLX's CPU and CUDA builds (`mlx-cpu`, `mlx-cuda-13`) install the same `mlx/lib/libmlx.so`, so an
environment holding both runs whichever pip wrote last, and a CUDA build on a machine without an
NVIDIA driver cannot load at all (`libcuda.so.1: cannot open shared object file`). `setup.py` installs
exactly one; this module imports nothing of MLX's, so that `mlx_mtp` can check before it does
(`require`) and say how to keep one build instead of failing with a traceback.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Optional

BUILDS = {"cpu": "mlx-cpu", "cuda13": "mlx-cuda-13"}  # the extra of `mlx` -> the package it installs
NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")


class MLXUnavailable(RuntimeError):
    """MLX cannot be imported here; the message says how to fix the install, in one line."""


def installed(name: str) -> Optional[str]:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def installed_builds() -> list[str]:
    """The MLX builds installed in this environment (package names)."""
    return [name for name in BUILDS.values() if installed(name)]


def fix_line(driver: Path = NVIDIA_DRIVER) -> str:
    """The command that leaves exactly one MLX build: the CUDA one where an NVIDIA driver is
    loaded, else the CPU one. Both packages are removed first: either one's uninstall takes the
    shared library file with it."""
    extra = "cuda13" if driver.exists() else "cpu"
    pinned = installed("mlx")
    return (f"pip uninstall -y {' '.join(BUILDS.values())} && "
            f"pip install 'mlx[{extra}]{'==' + pinned if pinned else ''}'")


def install_line(driver: Path = NVIDIA_DRIVER) -> str:
    """The command that installs the MLX build this machine runs (as setup.py chooses it)."""
    if sys.platform == "darwin":
        return "pip install mlx"
    return f"pip install 'mlx[{'cuda13' if driver.exists() else 'cpu'}]'"


def both_installed_line() -> Optional[str]:
    """A warning for an environment holding both builds (None when it holds one)."""
    if len(installed_builds()) < 2:
        return None
    return f"warning: MLX's CPU and CUDA builds are both installed (one overwrote the other); keep one: {fix_line()}"


def require() -> None:
    """Import mlx.core, or raise MLXUnavailable with the one-line fix when the install is at fault
    (a CUDA build that cannot load, or both builds). An uncaught MLXUnavailable prints that line
    alone, without a traceback: what a user of the command-line tools reads."""
    try:
        import mlx.core  # noqa: F401
    except (ImportError, OSError) as e:
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "mlx":
            _print_without_traceback()
            raise MLXUnavailable(f"MLX is not installed: {install_line()}") from None
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        builds = installed_builds()
        if "cuda" not in reason.lower() and "libcu" not in reason and len(builds) < 2:
            raise
        if len(builds) > 1:
            situation = "MLX's CPU and CUDA builds are both installed. "
        elif not NVIDIA_DRIVER.exists():
            situation = "MLX's CUDA build is installed, and this machine has no NVIDIA driver. "
        else:
            situation = ""
        _print_without_traceback()
        raise MLXUnavailable(f"MLX cannot load ({reason}). {situation}Keep one MLX build: {fix_line()}") from None


def _print_without_traceback() -> None:
    previous = sys.excepthook

    def hook(kind, value, tb):
        if isinstance(value, MLXUnavailable):
            print(f"mlx_mtp: {value}", file=sys.stderr)
        else:
            previous(kind, value, tb)

    sys.excepthook = hook
