"""The `mid` benchmark pair (target + MTP drafter), built in-process with random weights (`agent
--pair mid`, tests/long_context_pair.py), and `build`, any model from a config with random weights.

`mid` is a Gemma-4-shaped dense target of ~313M parameters at fp32, scaled down from the released
31B config (five sliding layers per full layer, the full layers with a 2x global head dim, one
shared K=V global KV head, GQA, logit softcap 30; no per-layer embeddings), and a
`gemma4_assistant` drafter of ~14M parameters (4.4% of the target; the released 31B assistant is
~1.5% of its target) that reads the target's last sliding and last full layers' K/V.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_mtp.models import model_module

ROOT = Path(__file__).resolve().parents[2]

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


def n_params(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))
