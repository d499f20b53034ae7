"""Which MLX build a Linux install gets (README: "NVIDIA GPUs (Linux)").

MLX's CPU and CUDA builds (`mlx-cpu`, `mlx-cuda-13`) both install `mlx/lib/libmlx.so`, and pip adds
an extra's packages to the base ones: with `mlx[cpu]` among the base dependencies and `mlx[cuda13]`
in an extra, `pip install '.[cuda]'` installs the CUDA build and then the CPU build over it. So the
backend is chosen here, on the machine the package is installed on: the CUDA 13 build where an
NVIDIA driver is loaded, else the CPU build; `MLX_MTP_BACKEND=cpu|cuda` overrides the choice.
"""

import os
from pathlib import Path

from setuptools import setup

COMMON = [
    "mlx-lm>=0.32", "numpy", "huggingface_hub", "sentencepiece", "starlette>=0.37", "uvicorn>=0.30",
    "llguidance>=1.9",
]
BUILDS = {"cpu": "mlx[cpu]>=0.32", "cuda": "mlx[cuda13]>=0.32"}
NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")


def linux_backend(env=os.environ, driver: Path = NVIDIA_DRIVER) -> str:
    """'cpu' or 'cuda': MLX_MTP_BACKEND if set, else 'cuda' where an NVIDIA driver is loaded."""
    chosen = env.get("MLX_MTP_BACKEND", "").strip().lower()
    if chosen and chosen not in BUILDS:
        raise SystemExit(f"MLX_MTP_BACKEND must be one of {', '.join(BUILDS)}, not {chosen!r}")
    return chosen or ("cuda" if driver.exists() else "cpu")


def dependencies(env=os.environ, driver: Path = NVIDIA_DRIVER) -> list:
    """The base requirements: Metal MLX on macOS, the chosen build on Linux."""
    return ["mlx>=0.32; sys_platform == 'darwin'",
            f"{BUILDS[linux_backend(env, driver)]}; sys_platform == 'linux'", *COMMON]


if __name__ == "__main__":
    setup(install_requires=dependencies())
