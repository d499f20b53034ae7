"""`python -m convert` / `mlx-mtp-convert`: Gemma 4 targets and MTP drafters to MLX."""

import mlx_mtp  # noqa: F401  (first: an MLX that cannot load is explained in one line)
from .convert import convert, main

__all__ = ["convert", "main"]
