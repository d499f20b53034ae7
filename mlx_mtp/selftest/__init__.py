"""`python -m mlx_mtp.selftest` / `mlx-mtp-selftest`: does MLX on this machine run mlx_mtp
right (checks.py), with tiny random pairs (tiny.py), kernels compiled ahead of use
(warm.py) and primitives counted in a forward's graph (primitives.py)."""

from .checks import main
