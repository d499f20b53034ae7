"""Benchmark pairs (target + MTP drafter): the tiny dense fixture, the bundled demo pair, and
`mid`, built in-process with random weights.

`mid` is a Gemma-4-shaped dense target of ~313M parameters at fp32, scaled down from the released
31B config (five sliding layers per full layer, the full layers with a 2x global head dim, one
shared K=V global KV head, GQA, logit softcap 30; no per-layer embeddings), and a
`gemma4_assistant` drafter of ~14M parameters (4.4% of the target; the released 31B assistant is
~1.5% of its target) that reads the target's last sliding and last full layers' K/V.
"""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_mtp.loading import load_model
from mlx_mtp.models import model_module

ROOT = Path(__file__).resolve().parents[2]
PAIRS = ("demo", "tiny", "mid")

_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
}
_ATTENTION = dict(  # shared by target and drafter: the drafter attends to the target's K/V
    num_key_value_heads=2, head_dim=128, global_head_dim=256, num_global_key_value_heads=1,
    attention_k_eq_v=True, sliding_window=512, rope_parameters=_ROPE, hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, tie_word_embeddings=True,
    vocab_size=32768,
)
MID_TARGET = dict(
    model_type="gemma4_text", hidden_size=1024, intermediate_size=4096, num_hidden_layers=18,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3, num_attention_heads=8,
    final_logit_softcapping=30.0, **_ATTENTION,
)
MID_DRAFTER = dict(
    model_type="gemma4_assistant", backbone_hidden_size=1024, use_ordered_embeddings=False,
    text_config=dict(
        model_type="gemma4_text", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], num_attention_heads=4,
        final_logit_softcapping=None, **_ATTENTION,
    ),
)


def build(config: dict, seed: int, dtype=mx.float32):
    """A model from a config dict with seed-deterministic random weights, evaluated."""
    mx.random.seed(seed)
    module = model_module(config["model_type"])
    model = module.Model(module.Config.from_dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def mid_pair(seed: int = 0):
    target = build(MID_TARGET, seed)
    drafter = build(MID_DRAFTER, seed + 1)
    drafter.check_target(target)
    return target, drafter


def n_params(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def load_pair(name: str, seed: int = 0, dtype=mx.float32) -> tuple:
    """(target, drafter, description), in fp32 unless `dtype` says otherwise (None: as stored)."""
    started = time.perf_counter()
    if name == "mid":
        target, drafter = mid_pair(seed)
        if dtype is not None and dtype != mx.float32:
            target.set_dtype(dtype)
            drafter.set_dtype(dtype)
        source = f"built in-process, random weights (seed {seed})"
    elif name in ("demo", "tiny"):
        base = ROOT / "mlx_mtp" / "demo" if name == "demo" else ROOT / "tests" / "fixtures" / "tiny" / "dense"
        target = load_model(base / "target", dtype=dtype)[0]
        drafter = load_model(base / "drafter", dtype=dtype)[0]
        source = str(base.relative_to(ROOT))
    else:
        raise SystemExit(f"unknown pair {name!r} ({', '.join(PAIRS)})")
    nt, nd = n_params(target), n_params(drafter)
    kind = str(target.model.embed_tokens.weight.dtype).replace("mlx.core.", "")
    return target, drafter, (f"{name} pair ({source}; {kind}; target {nt / 1e6:.1f}M params, drafter {nd / 1e6:.2f}M "
                             f"= {100 * nd / nt:.1f}%; ready in {time.perf_counter() - started:.1f} s)")
