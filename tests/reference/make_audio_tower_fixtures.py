"""Generate the Gemma 4 audio tower fixtures (`gemma4_audio` conformer + `embed_audio`).

Ground truth is transformers==5.23.0 / torch==2.13.0 on CPU, as for make_fixtures.py. Usage:

    /tmp/ref-venv/bin/python tests/reference/make_audio_tower_fixtures.py [--out tests/fixtures/audio_tower]

Deterministic (fixed seed, one thread). What it writes under <out>:

* ``model.safetensors``: a tiny random E2B-shaped ``Gemma4AudioModel`` and its
  ``Gemma4MultimodalEmbedder`` (fp32), under the checkpoint names ``model.audio_tower.*`` and
  ``model.embed_audio.*``, clip scalars included. ``config.json``: a ``gemma4`` config with that
  ``audio_config`` and ``text_config.hidden_size`` 48.
  The tower keeps the released geometry where it shapes the data path: 128 mel bins and
  ``subsampling_conv_channels[0]`` 128 (transformers sizes ``input_proj_linear`` from it), conv
  kernel 5, chunk 12, context left 13 / right 0, logit cap 50, clipped linears. Small elsewhere:
  hidden 32, 2 heads of 16, 2 layers, channels[1] 8, output_proj_dims 64.
  Weights are well-scaled random; q/k projections carry a gain so that logits reach the softcap,
  and the clip bounds are finite and cut some values.
* ``reference.npz``, for T' in 1, 11, 12, 13, 37 soft tokens (``t{T'}_*``; T = 3, 43, 45, 50, 147
  mel frames, every frame valid) and a padded 2-clip batch (``batch_*``: the 147-frame clip and a
  61-frame clip padded with non-zero junk to 147 frames, mask false there):
  - ``*_features`` (B, T, 128) fp32 and ``*_mask`` (B, T) bool: the inputs;
  - ``*_sscp`` (B, T', 32) the subsample conv projection's output, ``*_sscp_mask`` (B, T');
  - ``*_layer0`` (B, T', 32) conformer layer 0's output;
  - ``*_tower`` (B, T', 64) the tower's ``last_hidden_state`` (padding rows included, as
    transformers leaves them), ``*_tower_mask`` (B, T') its ``attention_mask``;
  - ``*_embed`` (B, T', 48) ``embed_audio`` of ``*_tower`` (``get_audio_features``' pooler output);
  - ``batch_attention`` (2, 37, 37) bool: transformers' attention mask (query, key) of the batch,
    before it is blocked (True = the key is seen).
* ``meta.json``: seed, versions, the shapes above, and the parameter counts of the released
  E2B ``audio_config`` (tests/fixtures/real_configs/google--gemma-4-E2B-it) built on the meta
  device: tower parameters, tower clip buffers, ``embed_audio`` parameters.

The script asserts that the batch's real rows equal single-clip runs (transformers' own padding).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.gemma4.configuration_gemma4 import Gemma4AudioConfig
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4AudioModel,
    Gemma4MultimodalEmbedder,
    sliding_window_mask_function,
)

SEED = 5150
TRANSFORMERS_VERSION, TORCH_VERSION = "5.23.0", "2.13.0"
ROOT = Path(__file__).resolve().parents[2]
REAL = ROOT / "tests" / "fixtures" / "real_configs" / "google--gemma-4-E2B-it" / "config.json"
TEXT_HIDDEN = 48
MEL = 128
FRAMES = {1: 3, 11: 43, 12: 45, 13: 50, 37: 147}  # T' -> mel frames T (ceil(ceil(T / 2) / 2) = T')
SHORT = 61  # the batch's second clip: 16 real soft tokens
QK_GAIN = 3.0


def audio_config() -> Gemma4AudioConfig:
    return Gemma4AudioConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             subsampling_conv_channels=[128, 8], conv_kernel_size=5, attention_chunk_size=12,
                             attention_context_left=13, attention_context_right=0, attention_logit_cap=50.0,
                             use_clipped_linears=True, rms_norm_eps=1e-6, output_proj_dims=64)


@torch.no_grad()
def perturb_(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Well-scaled random values for every parameter and clip bound, in named order."""
    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    for name, p in module.named_parameters():
        if name.endswith("per_dim_scale"):
            p.copy_(0.5 * randn(p.shape))
        elif name.endswith("bias"):
            p.copy_(0.1 * randn(p.shape))
        elif p.ndim == 1:  # RMSNorm / LayerNorm scales
            p.copy_(1.0 + 0.3 * randn(p.shape))
        else:  # Linear (out, in), Conv2d (out, in, 3, 3), depthwise Conv1d (out, 1, k)
            gain = QK_GAIN if name.endswith(("q_proj.linear.weight", "k_proj.linear.weight")) else 1.0
            p.copy_(gain * randn(p.shape) / math.sqrt(p[0].numel()))
    for name, b in module.named_buffers():
        if name.endswith("input_min"):  # inputs are RMS-normalised: bounds near 2 cut a few values
            b.fill_(-1.8 - float(torch.rand((), generator=gen)))
        elif name.endswith("input_max"):
            b.fill_(1.8 + float(torch.rand((), generator=gen)))
        elif name.endswith("output_min"):
            b.fill_(-4.0 - 2 * float(torch.rand((), generator=gen)))
        elif name.endswith("output_max"):
            b.fill_(4.0 + 2 * float(torch.rand((), generator=gen)))


def f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).numpy().astype(np.float32, copy=True)


@torch.no_grad()
def stages(tower: Gemma4AudioModel, embed: Gemma4MultimodalEmbedder, features, mask) -> dict:
    """Outputs of each stage, caught with forward hooks on the real forward."""
    seen = {}
    hooks = [tower.subsample_conv_projection.register_forward_hook(lambda m, a, out: seen.update(sscp=out)),
             tower.layers[0].register_forward_hook(lambda m, a, out: seen.update(layer0=out))]
    try:
        out = tower(features, mask, return_dict=True)
    finally:
        for h in hooks:
            h.remove()
    return {"sscp": seen["sscp"][0], "sscp_mask": seen["sscp"][1], "layer0": seen["layer0"],
            "tower": out.last_hidden_state, "tower_mask": out.attention_mask,
            "embed": embed(out.last_hidden_state)}


def record(ref: dict, prefix: str, models: tuple, features, mask) -> dict:
    got = stages(*models, features, mask)
    ref[f"{prefix}_features"], ref[f"{prefix}_mask"] = f32(features), mask.numpy().copy()
    for key, value in got.items():
        ref[f"{prefix}_{key}"] = value.numpy().copy() if value.dtype == torch.bool else f32(value)
    return got


def real_counts() -> dict:
    """Parameter counts of the released E2B audio path, built on the meta device (no memory)."""
    cfg = json.loads(REAL.read_text())
    with torch.device("meta"):
        tower = Gemma4AudioModel(Gemma4AudioConfig(**cfg["audio_config"]))
        text = SimpleNamespace(hidden_size=cfg["text_config"]["hidden_size"])
        embed = Gemma4MultimodalEmbedder(tower.config, text)
    persistent = tower.state_dict().keys() - dict(tower.named_parameters()).keys()
    return {"real_e2b_audio_tower_params": sum(p.numel() for p in tower.parameters()),
            "real_e2b_audio_tower_clip_buffers": len([k for k in persistent if k.endswith(("_min", "_max"))]),
            "real_e2b_embed_audio_params": sum(p.numel() for p in embed.parameters())}


def build(out: Path) -> None:
    gen = torch.Generator().manual_seed(SEED)
    cfg = audio_config()
    tower = Gemma4AudioModel(cfg).eval()
    embed = Gemma4MultimodalEmbedder(cfg, SimpleNamespace(hidden_size=TEXT_HIDDEN)).eval()
    perturb_(tower, gen)
    perturb_(embed, gen)
    models = (tower, embed)

    ref = {}
    clips = {}
    for n, T in FRAMES.items():
        features = torch.randn(1, T, MEL, generator=gen) * 2.0 - 4.0
        got = record(ref, f"t{n}", models, features, torch.ones(1, T, dtype=torch.bool))
        assert got["tower"].shape[1] == n, (n, got["tower"].shape)
        clips[T] = (features, got)

    long, short = FRAMES[37], SHORT
    short_features = torch.randn(1, short, MEL, generator=gen) * 2.0 - 4.0
    short_got = stages(*models, short_features, torch.ones(1, short, dtype=torch.bool))
    junk = torch.randn(1, long - short, MEL, generator=gen) * 3.0
    features = torch.cat([clips[long][0], torch.cat([short_features, junk], dim=1)])
    mask = torch.ones(2, long, dtype=torch.bool)
    mask[1, short:] = False
    got = record(ref, "batch", models, features, mask)
    n_short = short_got["tower"].shape[1]
    assert int(got["tower_mask"][1].sum()) == n_short and bool(got["tower_mask"][0].all())
    for key in ("sscp", "layer0", "tower", "embed"):  # transformers' own padding: real rows as run alone
        assert (got[key][0] - clips[long][1][key][0]).abs().max() < 1e-5, key
        assert (got[key][1, :n_short] - short_got[key][0]).abs().max() < 1e-5, key
    window = sliding_window_mask_function((cfg.attention_context_left - 1, cfg.attention_context_right))
    attention = create_bidirectional_mask(config=tower.config, inputs_embeds=got["sscp"],
                                          attention_mask=got["sscp_mask"], and_mask_function=window)
    ref["batch_attention"] = (attention[:, 0] == 0).numpy().copy()

    out.mkdir(parents=True, exist_ok=True)
    weights = {f"model.audio_tower.{k}": v.contiguous() for k, v in tower.state_dict().items()}
    weights |= {f"model.embed_audio.{k}": v.contiguous() for k, v in embed.state_dict().items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    drop = ("transformers_version", "dtype", "_name_or_path")
    audio = {k: v for k, v in cfg.to_dict().items() if k not in drop}
    config = {"model_type": "gemma4", "audio_config": audio, "text_config": {"hidden_size": TEXT_HIDDEN}}
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    np.savez_compressed(out / "reference.npz", **ref)
    meta = {"seed": SEED, "transformers": transformers.__version__, "torch": torch.__version__,
            "frames": {str(n): T for n, T in FRAMES.items()}, "batch_frames": [long, short],
            "qk_gain": QK_GAIN,
            "shapes": {k: list(v.shape) for k, v in sorted(ref.items())}, **real_counts()}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "audio_tower"))
    args = ap.parse_args(argv)
    if transformers.__version__ != TRANSFORMERS_VERSION or not torch.__version__.startswith(TORCH_VERSION):
        print(f"warning: fixtures are pinned to transformers=={TRANSFORMERS_VERSION}, torch=={TORCH_VERSION}",
              file=sys.stderr)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    build(Path(args.out))


if __name__ == "__main__":
    main()
