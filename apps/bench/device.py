"""`python -m apps.bench.device wheels`: the Python packages, at this environment's versions, that a
machine with only Python, NumPy and PyTorch needs to run the GPU suite, the server and mlx-vlm
beside them (for a packing step such as `GPU_EXTRA="$(python -m apps.bench.device wheels)"`; MLX,
its CUDA build and mlx-lm are packed on their own).

Found by importing what the suite imports and naming the distributions of the modules loaded.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import sys

ENTRY_POINTS = ("apps.bench.gpu", "mlx_mtp.server.app", "mlx_mtp.server.cli", "uvicorn",
                "mlx_vlm.generate.ar", "mlx_vlm.speculative.drafters", "mlx_vlm.utils")
PACKED_APART = {"mlx", "mlx-cpu", "mlx-cuda-13", "mlx-metal", "mlx-lm", "mlx-mtp", "numpy", "setuptools",
                "pip"}


def wheels() -> list[str]:
    """`name==version` of every distribution the entry points load, but those packed apart."""
    for name in ENTRY_POINTS:
        importlib.import_module(name)
    owners = metadata.packages_distributions()
    found = {d for module in list(sys.modules) for d in owners.get(module.split(".")[0], [])}
    return sorted(f"{d}=={metadata.version(d)}" for d in found if d.lower() not in PACKED_APART)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m apps.bench.device", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["wheels"], help="wheels: print `name==version` of each, space-separated")
    ap.parse_args(argv)
    print(" ".join(wheels()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
