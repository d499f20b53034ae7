"""Which MLX build a Linux install gets (README: "NVIDIA GPUs (Linux)").

MLX's CPU and CUDA builds (`mlx-cpu`, `mlx-cuda-13`) both install `mlx/lib/libmlx.so`, so an
environment must hold exactly one, and no extra may add the other: pip adds an extra's packages to
the base ones, in an order of its choosing. So the build is chosen here alone, on the machine the
package is installed on: the CUDA 13 build where an NVIDIA driver is loaded, else the CPU build;
`MLX_MTP_BACKEND=cpu|cuda` overrides the choice (an image built on a machine without the GPU).
An environment that already holds the other build is fixed by the line `mlx_mtp.runtime.mlx_build.fix_line`
gives (both removed, then one installed), which mlx_mtp prints when MLX cannot load.
"""

import os
from pathlib import Path

from setuptools import setup

COMMON = [
    "mlx-lm>=0.32", "numpy", "huggingface_hub", "sentencepiece", "starlette>=0.37", "uvicorn>=0.30",
    "llguidance>=1.9", "Pillow>=10",
    "soundfile>=0.13", "soxr>=0.3",  # audio: libsndfile with MP3 comes in soundfile's wheels
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
