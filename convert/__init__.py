"""`python -m convert` / `mlx-mtp-convert`: Gemma 4 targets and MTP drafters to MLX."""

from .convert import convert, main

__all__ = ["convert", "main"]
