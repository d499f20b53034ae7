"""Gemma 4's mixture of experts (the 26B-A4B's `enable_moe_block` layers): the router, the experts, and
their weighted sum, which the layer's residual glue takes (`gemma4.residual`: on NVIDIA GPUs in the glue's
kernel, elsewhere `weighted` in MLX's ops). Each part tries its fused CUDA kernel first (`kernels`); a call
off CUDA returns None at once and MLX's ops run.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchLinear

from .. import kernels
from .base import gelu_tanh_glu, rms_norm
from .quantized import Linear, gathered_glu, switch_glu

# Opt-in instrumentation (apps/bench experts): when set to a list, every Router call appends
# its (tokens, top_k) expert ids, in layer order. None (the default) records nothing.
ROUTER_RECORD: Optional[list] = None


class Router(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.proj = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = mx.ones((cfg.hidden_size,))
        self.per_expert_scale = mx.ones((cfg.num_experts,))
        self.top_k = cfg.top_k_experts
        self.eps = cfg.rms_norm_eps

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(idx, weights) of x (N, H), both (N, top_k): the experts chosen and their weights (float32).
        On CUDA in one kernel (`kernels.router`: int32 ids, in order of score)."""
        fused = kernels.router(x, self.scale, self.proj, self.per_expert_scale, self.top_k, self.eps)
        if fused is not None:
            idx, weights = fused
        else:
            z = rms_norm(x, None, self.eps) * self.scale * (x.shape[-1] ** -0.5)
            scores = self.proj(z).astype(mx.float32)
            idx = mx.argpartition(-scores, self.top_k - 1, axis=-1)[..., : self.top_k]
            # softmax over the top-k scores == softmax, top-k, renormalise
            weights = mx.softmax(mx.take_along_axis(scores, idx, axis=-1), axis=-1) * self.per_expert_scale[idx]
        if ROUTER_RECORD is not None:
            ROUTER_RECORD.append(idx)
        return idx, weights


class GeGLU(nn.Module):
    """SwitchGLU's activation slot: called as activation(up, gate)."""

    kind = "gelu_tanh"  # what a fused experts kernel computes in its place (kernels.switch_glu)

    def __call__(self, up, gate):
        return gelu_tanh_glu(gate, up)


class SwitchGLU(nn.Module):
    """mlx-lm's SwitchGLU with the experts' gate and up as one projection, `gate_up_proj` (E, 2I, H): each
    expert's gate rows, then its up rows (`layout.join`; checkpoints keep them apart, or joined as HF's)."""

    def __init__(self, hidden: int, inter: int, experts: int, activation: nn.Module):
        super().__init__()
        self.gate_up_proj = SwitchLinear(hidden, 2 * inter, experts, bias=False)
        self.down_proj = SwitchLinear(inter, hidden, experts, bias=False)
        self.activation = activation

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return gathered_glu(self, x, indices)


class Experts(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.switch_glu = SwitchGLU(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, GeGLU())

    def __call__(self, x: mx.array, norm, idx: mx.array) -> mx.array:
        """The experts `idx` (..., k) of norm(x), each alone: (..., k, H), to be summed with their weights
        (`weighted`). The norm, gate/up and GLU in one CUDA kernel where it applies."""
        y = kernels.experts_input(self.switch_glu, x, norm.weight, idx, norm.eps)
        return switch_glu(self.switch_glu, norm(x), idx) if y is None else y


def weighted(y: mx.array, weights: mx.array) -> mx.array:
    """The experts' outputs y (..., k, H) summed with their weights (..., k)."""
    return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)
