"""`python -m apps.bench`: speed comparisons of mlx_mtp against mlx-lm on the same weights.

Subcommands (see apps/README.md):
  speed    ours plain / ours MTP (K sweep, auto) / mlx-lm generate / mlx-lm speculative,
           B in {1,2,4,8}, prompt classes; markdown + JSON + PNG
  oracle   controlled-acceptance drafter (the old apps/bench_mtp.py)
  experts  MoE expert union per verify forward, and SwitchGLU's sorted-indices path
  cost     released shapes with random weights: per-layer step cost vs tokens per forward,
           drafter step cost, and a *projected* MTP speedup
  stepcost a pair's forward cost vs tokens per row and drafter step: MTP round cost in plain steps

Every subcommand takes --regime stock|mkl (which BLAS serves fp32 matmuls; regime.py).
"""
