"""Generate the Gemma 4 image fixtures (vision tower, image processor, prompts with images).

Ground truth is transformers==5.23.0 / torch==2.13.0 on CPU, as for make_fixtures.py. Usage:

    python tests/reference/make_vision_fixtures.py [--out tests/fixtures/vision]

Deterministic (fixed seeds, one thread). What it writes under <out>:

* ``<variant>/`` a real tiny ``Gemma4ForConditionalGeneration`` (save_pretrained, fp32), with
  vocab 128 and the image token ids inside it (boi 120, image 121, eoi 122):
  - ``bidir``: 26B-A4B/31B-like. Text as make_fixtures' ``dense`` target (window 8) plus
    ``use_bidirectional_attention="vision"``; vision tower with ``standardize`` (random
    std_bias/std_scale), no clipping, head_dim 12, MLP width 40.
  - ``causal``: E2B-like. Text as make_fixtures' ``e2b`` target (per-layer embeddings, KV-shared
    layers; causal everywhere); vision tower with clipped linears (random finite bounds), head_dim 8.
  Both towers: patch size 4 (48 values a patch), pooling 3, position table 32, 2 layers.
* ``<variant>/reference.npz``:
  - ``pixel_values`` (3, 108, 48) and ``image_position_ids`` (3, 108, 2): three images of 9x6,
    3x12 and 12x9 patches (6, 4 and 12 soft tokens), padded to 108 patches as the processor pads;
    pixels are k/255.
  - ``features_{i}`` / ``features_{i}_exact``: image i's ``get_image_features`` pooler output
    (soft tokens in the text width) from the fp32 model / the same model in float64;
    ``tower_{i}_exact``: the vision tower's output (before ``embed_vision``).
  - ``prompt_{n}`` (int32) with n = 1, 2, 3 images, and ``logits_{n}_exact`` (float64 forward, as
    make_fixtures' ``*_exact``): one forward with ``mm_token_type_ids`` (the processor's: 1 at the
    image token) so the bidirectional overlay applies. ``images_{n}``: which images, in order.
    Image 2 has 12 soft tokens, more than the window 8 (the look-back-only window rule).
  - ``greedy_2`` (int32, 24 new tokens): ``generate`` after prompt 2, past the window.
* ``bidir/`` is a chat model too (``chat``: `chat_helpers.write_vision_chat_files`): tokenizer, the
  released 26B/31B chat template, ``processor_config.json`` with budget 70.
* ``processor.npz``: ``Gemma4ImageProcessorPil`` outputs for images made by ``case_image`` (an
  integer formula; the test builds the same PIL images), at every budget: for each
  case ``{name}_{budget}_pixels_sha256`` (the float32 bytes of the real patch rows; small cases also
  whole as ``_pixels``), ``_positions_sha256`` (int64 (x, y) of the real rows), ``_grid`` (patches
  across, down), ``_tokens`` and ``_padded`` (rows with padding). Padding is asserted zero / -1.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402  (its configs, perturbation, kv_sharing patch)

SEED = 4321
BOI, IMAGE, EOI = 120, 121, 122
TOKEN_IDS = dict(boi_token_id=BOI, image_token_id=IMAGE, eoi_token_id=EOI, video_token_id=123,
                 audio_token_id=124, boa_token_id=125, eoa_token_id=126)
GRIDS = [(9, 6), (3, 12), (12, 9)]  # (width, height) in patches
PATCH, POOL = 4, 3
PROMPTS = {1: [0], 2: [1, 2], 3: [2, 0, 1]}  # images in each prompt
NEW_TOKENS = 24


def vision_config(variant: str) -> Gemma4VisionConfig:
    common = dict(hidden_size=24, num_hidden_layers=2, patch_size=PATCH, pooling_kernel_size=POOL,
                  position_embedding_size=32, rms_norm_eps=1e-6)
    if variant == "bidir":
        return Gemma4VisionConfig(**common, intermediate_size=40, num_attention_heads=2, num_key_value_heads=2,
                                  head_dim=12, standardize=True, use_clipped_linears=False)
    return Gemma4VisionConfig(**common, intermediate_size=48, num_attention_heads=3, num_key_value_heads=3,
                              head_dim=8, standardize=False, use_clipped_linears=True)


@torch.no_grad()
def build_model(variant: str, gen: torch.Generator) -> Gemma4ForConditionalGeneration:
    text = mf.target_config("dense" if variant == "bidir" else "e2b").to_dict()
    for k in ("architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path", "model_type"):
        text.pop(k, None)
    text["use_bidirectional_attention"] = "vision" if variant == "bidir" else None
    cfg = Gemma4Config(text_config=text, vision_config=vision_config(variant), audio_config=None, **TOKEN_IDS)
    model = Gemma4ForConditionalGeneration(cfg).eval()
    mf.perturb_(model, gen)
    for name, b in model.named_buffers():
        if name.endswith("std_bias"):
            b.copy_(torch.randn(b.shape, generator=gen))
        elif name.endswith("std_scale"):
            b.copy_(0.5 + torch.rand(b.shape, generator=gen))
        elif name.endswith(("input_min", "output_min")):  # finite bounds some values cross
            b.fill_(-1.5 - float(torch.rand((), generator=gen)))
        elif name.endswith(("input_max", "output_max")):
            b.fill_(1.5 + float(torch.rand((), generator=gen)))
    return model


def images(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Three padded images: pixel_values (3, 108, 48) of k/255, positions (3, 108, 2)."""
    longest = max(w * h for w, h in GRIDS)
    pixels = torch.zeros(len(GRIDS), longest, 3 * PATCH * PATCH)
    positions = torch.full((len(GRIDS), longest, 2), -1, dtype=torch.long)
    for i, (w, h) in enumerate(GRIDS):
        codes = torch.randint(0, 256, (w * h, 3 * PATCH * PATCH), generator=gen)
        pixels[i, : w * h] = torch.from_numpy((codes.numpy().astype(np.float64) / 255).astype(np.float32))
        gy, gx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        positions[i, : w * h] = torch.stack([gx.reshape(-1), gy.reshape(-1)], dim=-1)
    return pixels, positions


def prompt_ids(which: list, gen: torch.Generator) -> list:
    ids = [2]
    for i in which:
        ids += torch.randint(3, BOI, (3,), generator=gen).tolist()
        ids += [BOI] + [IMAGE] * (GRIDS[i][0] * GRIDS[i][1] // POOL**2) + [EOI]
    return ids + torch.randint(3, BOI, (4,), generator=gen).tolist()


@torch.no_grad()
def build_variant(variant: str, out: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    model = build_model(variant, gen)
    pixels, positions = images(gen)
    m64 = copy.deepcopy(model).double()
    ref = {"pixel_values": mf.f32(pixels), "image_position_ids": positions.numpy().astype(np.int32)}
    for i in range(len(GRIDS)):
        one = (pixels[i : i + 1], positions[i : i + 1])
        ref[f"features_{i}"] = mf.f32(model.model.get_image_features(*one).pooler_output[0])
        f64 = m64.model.get_image_features(one[0].double(), one[1])
        ref[f"features_{i}_exact"] = mf.f32(f64.pooler_output[0])
        ref[f"tower_{i}_exact"] = mf.f32(f64.last_hidden_state)
    batched = model.model.get_image_features(pixels, positions).pooler_output  # padding and mixed sizes
    for i, feats in enumerate(batched):
        assert (feats - torch.from_numpy(ref[f"features_{i}"])).abs().max() < 1e-5
    for n, which in PROMPTS.items():
        ids = torch.tensor([prompt_ids(which, gen)])
        kw = dict(pixel_values=pixels[which], image_position_ids=positions[which],
                  mm_token_type_ids=(ids == IMAGE).long())
        ref[f"prompt_{n}"] = mf.i32(ids[0])
        ref[f"images_{n}"] = np.array(which, dtype=np.int32)
        ref[f"logits_{n}"] = mf.f32(model(ids, **kw).logits[0])
        kw64 = dict(kw, pixel_values=kw["pixel_values"].double())
        ref[f"logits_{n}_exact"] = mf.f32(m64(ids, **kw64).logits[0])
        if n == 2:
            gen_ids = model.generate(ids, **kw, max_new_tokens=NEW_TOKENS, do_sample=False)
            ref["greedy_2"] = mf.i32(gen_ids[0, ids.shape[1]:])
    vdir = os.path.join(out, variant)
    if os.path.isdir(vdir):
        shutil.rmtree(vdir)
    model.save_pretrained(vdir)
    np.savez_compressed(os.path.join(vdir, "reference.npz"), **ref)
    meta = {"seed": seed, "transformers": transformers.__version__, "torch": torch.__version__,
            "grids": GRIDS, "prompts": PROMPTS, "token_ids": TOKEN_IDS}
    with open(os.path.join(vdir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)


PROCESSOR_CASES = {  # name: (width, height, mode)
    "square": (64, 64, "RGB"), "photo": (97, 73, "RGB"), "wide": (300, 9, "RGB"), "tall": (5, 211, "RGB"),
    "tiny": (1, 1, "RGB"), "rgba": (40, 30, "RGBA"), "gray": (33, 50, "L"), "big": (517, 389, "RGB"), "pano": (1200, 130, "RGB"),
}
BUDGETS = (70, 140, 280, 560, 1120)


def case_image(w: int, h: int, mode: str) -> Image.Image:
    """A deterministic test image (integer formula, no RNG: the test rebuilds it the same way):
    gradients plus a hashed texture, so resampling sees edges and smooth regions."""
    bands = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    yy, xx, cc = np.mgrid[0:h, 0:w, 0:bands].astype(np.int64)
    codes = ((xx * 7 + yy * 3 + cc * 50 + (xx * 31 + yy * 17 + cc * 5) ** 2 % 61) % 256).astype(np.uint8)
    return Image.fromarray(codes[..., 0] if bands == 1 else codes, mode)


def sha256(a: np.ndarray) -> np.ndarray:
    return np.array(hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest())


def build_processor(out: str) -> None:
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    ref = {}
    for name, (w, h, mode) in PROCESSOR_CASES.items():
        image = case_image(w, h, mode)
        for budget in BUDGETS:
            got = Gemma4ImageProcessorPil(max_soft_tokens=budget)(image, return_tensors="np")
            pos = got["image_position_ids"][0]
            real = pos[:, 0] >= 0
            pv = got["pixel_values"][0]
            assert pv.dtype == np.float32 and (pv[~real] == 0).all() and (pos[~real] == -1).all()
            key = f"{name}_{budget}"
            ref[f"{key}_pixels_sha256"] = sha256(pv[real])
            ref[f"{key}_positions_sha256"] = sha256(pos[real].astype(np.int64))
            ref[f"{key}_grid"] = np.array([pos[real][:, 0].max() + 1, pos[real][:, 1].max() + 1], dtype=np.int32)
            ref[f"{key}_tokens"] = np.array(got["num_soft_tokens_per_image"][0], dtype=np.int32)
            ref[f"{key}_padded"] = np.array(pv.shape[0], dtype=np.int32)
            if real.sum() <= 64:  # small cases whole, for a readable failure
                ref[f"{key}_pixels"] = pv[real]
    np.savez_compressed(os.path.join(out, "processor.npz"), **ref)


def build_chat_files(out: str) -> None:
    """`bidir/` as a chat model too: the Gemma 4 character tokenizer of tests/chat_helpers.py with the
    image tokens at the fixture's ids, the released 26B/31B chat template, and budget 70 (the tiny
    tower's position table holds 32 patches a side). The README's image example runs on it."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from chat_helpers import write_vision_chat_files

    write_vision_chat_files(Path(out) / "bidir")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("tests", "fixtures", "vision"))
    ap.add_argument("--parts", default="bidir,causal,processor,chat")
    args = ap.parse_args(argv)
    if transformers.__version__ != mf.TRANSFORMERS_VERSION or not torch.__version__.startswith(mf.TORCH_VERSION):
        print(f"warning: fixtures are pinned to transformers=={mf.TRANSFORMERS_VERSION}, torch=={mf.TORCH_VERSION}",
              file=sys.stderr)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    os.makedirs(args.out, exist_ok=True)
    for i, part in enumerate(args.parts.split(",")):
        if part == "processor":
            build_processor(args.out)
        elif part == "chat":
            build_chat_files(args.out)
        else:
            build_variant(part, args.out, SEED + i)


if __name__ == "__main__":
    main()
