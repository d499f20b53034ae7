"""`python -m apps.bench MODE`: what a user of mlx_mtp decides on, measured against plain decoding,
mlx-lm and mlx-vlm on the same weights (`python -m apps.bench --help` lists the modes, one line each;
apps/README.md documents each with its figures).

Every mode takes --regime stock|mkl (which BLAS serves fp32 matmuls; regime.py).
"""
