"""Which kernel each product of a forward takes on an NVIDIA GPU, and why: the one place that decides.

On MLX's CUDA backend, a decode step's and a verify's products (at most `qmm.MAX_ROWS` rows per
weight, at most `sdpa.MAX_QUERIES` query positions) take mlx_mtp's kernels: each weight read
once for all rows, every row computed as if alone. Larger products (prompt chunks) keep MLX's, as
do Metal and the CPU. `MLX_MTP_KERNELS=mlx` (or `using("mlx")`) keeps MLX's kernels everywhere, for
comparisons and bug reports. Every decision is counted (`decisions`), so the selftest and the
benchmarks can say which kernels ran.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from typing import Iterator, Optional

import mlx.core as mx

from . import attn_input, ffn, glue, qmm, routing, sdpa


SWITCH = "MLX_MTP_KERNELS"
MODES = ("auto", "mlx")
OURS = "mlx_mtp"

_forced: Optional[str] = None
_lock = threading.Lock()
decisions: collections.Counter = collections.Counter()  # (family, kernel or MLX's with the reason) -> count


def mode() -> str:
    """'auto' (mlx_mtp's kernels where they apply) or 'mlx' (MLX's everywhere)."""
    if _forced is not None:
        return _forced
    chosen = os.environ.get(SWITCH, "auto").strip().lower() or "auto"
    if chosen not in MODES:
        raise ValueError(f"{SWITCH} must be one of {', '.join(MODES)}, not {chosen!r}")
    return chosen


@contextlib.contextmanager
def using(chosen: Optional[str]) -> Iterator[None]:
    """Within the block `mode()` is `chosen` (None: the environment's). Process-wide: for tests,
    benchmarks and the selftest."""
    global _forced
    if chosen is not None and chosen not in MODES:
        raise ValueError(f"kernels must be one of {', '.join(MODES)}, not {chosen!r}")
    before, _forced = _forced, chosen
    try:
        yield
    finally:
        _forced = before


def cuda() -> bool:
    """MLX's default device is an NVIDIA GPU (its CUDA backend)."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def _why_not(family: str, reason: str) -> str:
    """`reason` ('' for mlx_mtp's kernel) after the switch and the backend, counted."""
    if not cuda():
        return "not CUDA"  # Metal and the CPU: MLX's kernels, nothing to count
    if mode() == "mlx":
        reason = f"{SWITCH}=mlx"
    with _lock:
        decisions[(family, OURS if not reason else f"MLX's ({reason})")] += 1
    return reason


def quantized(rows: int, x_dtype: mx.Dtype, layer) -> str:
    """Why a quantized layer's product over `rows` rows keeps MLX's kernel ('' if it takes ours)."""
    reason = "" if 0 < rows <= qmm.MAX_ROWS else f"{rows} rows"
    reason = reason or qmm.supports_layer(x_dtype, layer)
    return _why_not("quantized matmul", reason)


def experts(tokens: int, top_k: int, x_dtype: mx.Dtype, glu) -> str:
    """Why a SwitchGLU's experts over `tokens` tokens keep MLX's gather_qmm ('' if they take ours)."""
    projections = _projections(glu)
    reason = ""
    if not 0 < tokens <= qmm.MAX_ROWS or tokens * top_k > qmm.MAX_PAIRS:
        reason = f"{tokens} tokens"
    elif getattr(glu.activation, "kind", None) != "gelu_tanh":
        reason = f"activation {type(glu.activation).__name__}"
    elif any("scales" not in p or "bias" in p for p in projections):
        reason = "unquantized or biased experts"
    elif len({(p.bits, p.group_size, p.mode) for p in projections}) > 1:
        reason = "mixed quantization"
    else:
        reason = next((r for p in projections if (r := qmm.supports_layer(x_dtype, p))), "")
    if not reason and "gate_up_proj" in glu:  # the joined gate/up take the fused kernel (ffn), without a norm
        reason = ffn.supports(tokens, x_dtype, None, glu.gate_up_proj)
    return _why_not("MoE experts", reason)


def _projections(glu) -> tuple:
    """A SwitchGLU's projections: gate, up and down, or the joined gate/up and down."""
    return (glu.gate_up_proj, glu.down_proj) if "gate_up_proj" in glu else (glu.gate_proj, glu.up_proj, glu.down_proj)


def prefill_experts(tokens: int, glu) -> str:
    """Why a SwitchGLU's experts over a prompt chunk of `tokens` keep MLX's gather_qmm ('' where they
    go by expert)."""
    reason = "" if tokens > qmm.MAX_ROWS else f"{tokens} tokens (a decode step)"
    if not reason and any("scales" not in p for p in _projections(glu)):
        reason = "unquantized experts"
    return _why_not("MoE experts by expert (prompt)", reason)


def attention(q: mx.array, keys: mx.array, values: mx.array, mask: Optional[mx.array], scale: float) -> str:
    """Why an attention keeps MLX's scaled_dot_product_attention ('' if it takes ours)."""
    return _why_not("attention", sdpa.supports(q, keys, values, mask, scale))


def _fused(family: str, why) -> str:
    """`_why_not` for a fused kernel, its conditions `why()` checked on CUDA only: models call these for
    every layer on every backend (a quantization check would fail on an unquantized layer)."""
    return "not CUDA" if not cuda() else _why_not(family, why())


def attention_input(x: mx.array, norm_w: mx.array, qkv, q_norm: mx.array, k_norm: Optional[mx.array],
                    inverse: mx.array, n_heads: int, head_dim: int, kv: int) -> str:
    """Why an attention layer's input (norm, q/k/v, head norms, RoPE) keeps MLX's ops ('' if it takes
    the fused kernel)."""
    return _fused("attention input",
                  lambda: attn_input.supports(x, norm_w, qkv, q_norm, k_norm, inverse, n_heads, head_dim, kv))


def mlp_input(rows: int, x_dtype: mx.Dtype, norm_w: Optional[mx.array], gate, up=None) -> str:
    """Why a dense MLP's input (norm, gate/up, GLU) keeps MLX's ops ('' if it takes the fused kernel);
    `gate` the joined gate/up layer when `up` is None."""
    return _fused("MLP input", lambda: ffn.supports(rows, x_dtype, norm_w, gate, up))


def experts_input(tokens: int, top_k: int, x_dtype: mx.Dtype, norm_w: Optional[mx.array], glu) -> str:
    """Why a SwitchGLU's experts behind their input norm keep MLX's ops ('' if they take the fused
    kernels: norm, gate/up and GLU in one, then down)."""
    return _fused("experts input", lambda: _experts_input(tokens, top_k, x_dtype, norm_w, glu))


def _experts_input(tokens: int, top_k: int, x_dtype: mx.Dtype, norm_w: Optional[mx.array], glu) -> str:
    reason = "" if tokens * top_k <= qmm.MAX_PAIRS else f"{tokens} tokens"
    if not reason and getattr(glu.activation, "kind", None) != "gelu_tanh":
        reason = f"activation {type(glu.activation).__name__}"
    gate_up = (glu.gate_up_proj, None) if "gate_up_proj" in glu else (glu.gate_proj, glu.up_proj)
    reason = reason or ffn.supports(tokens, x_dtype, norm_w, *gate_up)
    down = glu.down_proj
    if not reason and ("scales" not in down or "bias" in down):
        reason = "unquantized or biased experts"
    return reason or qmm.supports_layer(x_dtype, down)


def residual(x: mx.array, y: mx.array, w: mx.array, scalar: Optional[mx.array], *more,
             route: Optional[mx.array] = None) -> str:
    """Why a residual block's glue (post-norms, add, layer scalar, next norm; the experts' weighted sum
    with `route`) keeps MLX's ops ('' if it takes the fused kernel); `more`: its other operands."""
    rows = x.size // x.shape[-1]
    return _fused("residual", lambda: ("" if 0 < rows <= qmm.MAX_ROWS else f"{rows} rows")
                  or glue.supports(x, y, w, scalar, *more, route=route))


def router(x: mx.array, scale: mx.array, proj, per_expert: mx.array, top_k: int) -> str:
    """Why an MoE router (norm, scores, top-k, softmax, expert scales) keeps MLX's ops ('' if it takes the
    fused kernel)."""
    return _fused("router", lambda: routing.supports(x, scale, proj, per_expert, top_k))


def summary() -> str:
    """Which kernels ran, per family, since the counts were last cleared ('' if none was counted)."""
    with _lock:
        items = sorted(decisions.items())
    families = collections.defaultdict(list)
    for (family, kernel), count in items:
        families[family].append(f"{kernel} x{count}")
    return "; ".join(f"{family}: {', '.join(kernels)}" for family, kernels in families.items())
