"""MLX on this machine: which build is installed (mlx_build.py), compiled functions (jit.py),
MLX on threads (threads.py), and device memory (memory.py)."""
