"""Generate the tiny Gemma 4 12B (`gemma4_unified`) reference fixtures of tests/test_unified{,_media}.py.

Ground truth is transformers==5.23.0 / torch==2.13.0 (CPU, float32, one thread). Usage:

    /tmp/ref-venv/bin/python tests/reference/make_unified_fixtures.py [--out tests/fixtures/unified]
    <a venv with torchvision>/bin/python tests/reference/make_unified_fixtures.py --resize-report

Deterministic: two runs give identical arrays. Modelled on make_fixtures.py (read its docstring for
the conventions shared here: `perturb_`, the float64 `*_exact` references, the first MTP round).

What it builds (fp32, vocab 128, pad/eos/bos 0/1/2):

* ``target/``: a real tiny ``Gemma4UnifiedForConditionalGeneration`` (the 12B's class), 12B-shaped:
  hidden 32, 6 layers [S,S,S,S,S,F] (the 12B's 5:1 block), 4 q-heads, 2 KV heads of 8 on sliding
  layers, ``attention_k_eq_v`` with 1 global KV head of 16 on the full layer, sliding window 8,
  softcap 30. No PLE / MoE keys at all (transformers writes none for these classes), and
  ``max_position_embeddings`` and ``use_bidirectional_attention`` at the class defaults, which
  `drop_default_keys` removes from config.json: the loader must supply the unified defaults. Its encoder-free embedders: image patches stay 48x48x3 = 6912
  wide, ``mm_embed_dim`` 8, a 16-entry position table; audio frames stay 640 samples.
  ``generation_config.json`` suppresses two tokens, as the 12B's does ([258883, 258882] there):
  here the two most frequent tokens of the unsuppressed greedy continuation, so suppression
  changes the output (``greedy_unsuppressed`` records the difference).
* ``drafter/``: a ``Gemma4UnifiedAssistantForCausalLM`` with random weights independent of the
  target (hidden 16, 4 layers [S,S,S,F], every layer KV-shared), so drafts are often rejected.

transformers 5.23's ``Gemma4UnifiedTextConfig.kv_sharing_modes`` repeats both bugs that
apps/hf_compat.py patches on ``Gemma4TextConfig`` (research gemma4-audio-unified.md §0.6): the
assistant cannot be built, and the target (nothing shared) publishes no store layers. It is a
separate class, so `patch_unified_kv_sharing_modes` applies the same rule to it.

reference.npz (T = 20 prompt tokens, bonus position p = 20):
  prompt int32 [T]; logits_full [T, V], hidden_full [T, H] (post-final-norm), logits_step [T, V]
  (token by token through the HF cache); kv_{sliding,full}_{k,v} [n_kv, T, d] (the store layers);
  greedy, greedy_assisted int32 [48] (generate(), the generation config's suppress_tokens applied;
  asserted equal); greedy_unsuppressed int32 [48]; suppress_tokens int32 [2];
  draft_logits [4, V], draft_hidden [4, H], draft_tokens int32 [4] (the first MTP round, as the
  real SinglePositionMultiTokenCandidateGenerator computes it: asserted bitwise);
  *_exact: the same forwards in float64 on the same weights.
  Embedders: image_codes uint8 [2, 6, 6912] (pixel codes, rescaled x * fp32(1/255) as the
  processor does), image_positions int32 [2, 6, 2] ((x, y), -1 on padding rows; image 1 has a
  flat patch, where LayerNorm's eps dominates, and reaches the table's last rows), image_features
  [9, H] (get_image_features: real rows only) and image_features_exact; audio_frames float32
  [2, 5, 640] (a zero frame among them), audio_mask bool [2, 5], audio_features [2, 5, H] and
  audio_features_exact.
processor.npz (the image arithmetic, exact; transformers' processor module imports torchvision and
Pillow, which the reference venv lacks, so `processor_functions` runs its functions from its source):
  sizes int32 [N, 5]: (height, width, budget, target height, target width) from
  ``get_aspect_ratio_preserving_size``; merge_codes uint8 [96, 144, 3] an image at a target size,
  merge_pixels_sha256 (of the float32 bytes of the [6, 6912] patches) and merge_positions int32 [6, 2]
  from ``convert_image_to_patches`` + ``patches_merge`` after the processor's rescale.
media.npz (tests/test_unified_media.py; media.json: its shapes, the platform and the figures below):
  Two prompts with media, their inputs exactly as the 12B's processors hand them to the model, and
  transformers' float64 logits (f32-stored) computed with the masks of
  `Gemma4UnifiedForConditionalGeneration.create_masks_for_generate` passed as ``attention_mask``:
  full layers causal, sliding layers window AND (causal OR same image block). The direct forward
  (``mm_token_type_ids``, no mask dict) ORs the block overlay into both kinds instead (5.2 away here),
  and so does 5.23's ``generate()`` with its default DynamicCache: only a static cache makes it call
  ``create_masks_for_generate`` (both asserted). Placeholders are the config's real ids (image 258880,
  audio 258881, video 258884: pad before embedding); the delimiters are tests/chat_helpers.py's
  in-vocabulary ids (boi 120, eoi 122, boa 123, eoa 125), the released ones being past the 128 tokens.
  media_*: T = 144, <bos> text, image 0 (336x384: 56 blocks, block (0, 0) flat), text, a clip of 2860
    samples (5 frames, the last zero-padded, causal), text, image 1 (336x432: 63 blocks), text. Each
    image is at its own target size for budget 70 (chat_helpers' budget), so no resize: media_image_{0,1}
    uint8 [H, W, 3] are what a request sends. media_request int32 (lone placeholders, before expansion),
    media_prompt int32 [T], media_image_positions int32 [2, 70, 2] (-1 padding), media_pixel_sha256
    [2] (of each image's real pixel_values rows, x * fp32(1/255)), media_audio_samples float32 [2860],
    media_audio_frames float32 [5, 640], media_logits_exact [T, V], media_mask_{sliding,full} bool [T, T]
    (True = visible; the full layers' None, sdpa's causal, as causal).
  video_*: T = 41, two 144x192 frames (12 blocks each) as `pixel_values_videos` with
    ``num_frames_per_video`` [2] (what the model needs; torchvision is only the processor's), each its
    own block (type 2) behind a 3-token stand-in timestamp and its delimiters; rescaled float32(x) / 255
    as the video processor's fused normalize does. video_prompt, video_frames uint8 [2, 144, 192, 3],
    video_positions, video_pixel_sha256, video_logits_exact, video_mask_{sliding,full}.

``--resize-report`` (run where torchvision is installed; writes nothing) prints how far Pillow's bicubic
(mlx_mtp/formats/images.py at patch 48, pool 1) is from the 12B's processor, against how far
transformers' own Gemma4ImageProcessorPil and Gemma4ImageProcessor (torchvision) are apart.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import platform
import shutil
import sys

import numpy as np
import torch

import transformers
from transformers import (
    Gemma4UnifiedAssistantConfig,
    Gemma4UnifiedAssistantForCausalLM,
    Gemma4UnifiedAudioConfig,
    Gemma4UnifiedConfig,
    Gemma4UnifiedForConditionalGeneration,
    Gemma4UnifiedTextConfig,
    Gemma4UnifiedVisionConfig,
)

sys.path.insert(0, os.path.dirname(__file__))
from make_fixtures import f32, i32, perturb_, record_candidates, safetensor_keys, softcap  # noqa: E402

SEED = 4321
TRANSFORMERS_VERSION = "5.23.0"
S, F = "sliding_attention", "full_attention"
VOCAB, HIDDEN, PROMPT_LEN, NEW_TOKENS, NUM_DRAFT = 128, 32, 20, 48, 4
RESCALE = 0.00392156862745098  # the processor's rescale_factor (1/255)
BUDGETS = (70, 140, 280, 560, 1120)


def patch_unified_kv_sharing_modes() -> None:
    """`Gemma4UnifiedTextConfig.kv_sharing_modes` as it should be: every layer "reuse" when all are
    shared (an assistant), the last layer of each type "store" when none is (a 12B target)."""
    original = Gemma4UnifiedTextConfig.kv_sharing_modes

    def modes(self):
        n, shared = self.num_hidden_layers, self.num_kv_shared_layers or 0
        if n and shared >= n:
            return ["reuse"] * n
        if shared == 0:
            last = {kind: i for i, kind in enumerate(self.layer_types)}
            return ["store" if last[kind] == i else None for i, kind in enumerate(self.layer_types)]
        return original.fget(self)

    Gemma4UnifiedTextConfig.kv_sharing_modes = property(modes)


patch_unified_kv_sharing_modes()


def processor_functions(*names: str) -> dict:
    """Functions of transformers' `image_processing_gemma4_unified.py`, run as written there. The module
    itself needs torchvision and Pillow at import (the reference venv has neither); these need torch."""
    import ast
    import transformers.models.gemma4_unified as package

    path = os.path.join(os.path.dirname(package.__file__), "image_processing_gemma4_unified.py")
    tree = ast.parse(open(path).read())
    wanted = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    scope = {"math": math, "torch": torch}
    exec(compile(ast.Module(wanted, type_ignores=[]), path, "exec"), scope)
    return {name: scope[name] for name in names}

TEXT = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=6,
    layer_types=[S] * 5 + [F], num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
    final_logit_softcapping=30.0, pad_token_id=0, eos_token_id=1, bos_token_id=2,
)


def target_config() -> Gemma4UnifiedConfig:
    vision = Gemma4UnifiedVisionConfig(mm_embed_dim=8, mm_posemb_size=16, output_proj_dims=8)
    return Gemma4UnifiedConfig(text_config=Gemma4UnifiedTextConfig(**TEXT), vision_config=vision,
                               audio_config=Gemma4UnifiedAudioConfig())


def drafter_config() -> Gemma4UnifiedAssistantConfig:
    text = dict(TEXT, hidden_size=16, intermediate_size=32, num_hidden_layers=4, layer_types=[S, S, S, F],
                final_logit_softcapping=None, num_kv_shared_layers=4)
    return Gemma4UnifiedAssistantConfig(text_config=Gemma4UnifiedTextConfig(**text), backbone_hidden_size=HIDDEN)


@torch.no_grad()
def perturb_embedders_(model, gen: torch.Generator) -> None:
    """The embedders' LayerNorm biases, patch bias and position table: well-scaled values, not
    the 1 + 0.3 N(0, 1) `perturb_` gives every vector."""
    for name, p in model.named_parameters():
        if "embed_vision" in name and name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith("pos_embedding"):
            p.copy_(torch.randn(p.shape, generator=gen))


def greedy_ids(model, prompt, **kw) -> torch.Tensor:
    out = model.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=0,
                         pad_token_id=0, eos_token_id=1, **kw)
    return out[0, prompt.shape[1]:]


@torch.no_grad()
def text_references(target, drafter, gen) -> dict:
    """Prompt, forwards, store-layer K/V, greedy (plain, suppressed, assisted) and the first MTP round."""
    for _ in range(200):  # a prompt whose greedy continuations, with and without suppression, avoid
        prompt = torch.randint(3, VOCAB, (1, PROMPT_LEN), generator=gen)  # ids < 3 and are varied
        free = greedy_ids(target, prompt)
        counts = np.bincount(free.numpy(), minlength=VOCAB)
        suppress = sorted(int(t) for t in np.argsort(-counts, kind="stable")[:2])  # its two most frequent
        greedy = greedy_ids(target, prompt, suppress_tokens=suppress)
        if all(not bool((g < 3).any()) and len(set(g.tolist())) >= 16 for g in (free, greedy)):
            break
    else:
        raise RuntimeError("no prompt with usable greedy continuations")
    target.generation_config.suppress_tokens = suppress  # saved: generate() applies it from here on
    assert torch.equal(greedy_ids(target, prompt), greedy) and not set(greedy.tolist()) & set(suppress)

    out = target(prompt, use_cache=True, output_hidden_states=True, return_shared_kv_states=True)
    logits, hidden, kv = out.logits[0], out.hidden_states[-1][0], out.shared_kv_states
    assert set(kv) == {S, F}
    assert (softcap(target.lm_head(hidden), 30.0) - logits).abs().max() < 1e-5
    cache, steps = None, []
    for i in range(PROMPT_LEN):
        o = target(prompt[:, i: i + 1], past_key_values=cache, use_cache=True)
        cache = o.past_key_values
        steps.append(o.logits[0, -1])
    logits_step = torch.stack(steps)
    assert (logits_step - logits).abs().max() < 1e-3

    rounds: list = []
    with record_candidates(rounds):
        assisted = greedy_ids(target, prompt, assistant_model=drafter)
    assert torch.equal(assisted, greedy) and rounds

    emb, p = target.get_input_embeddings(), PROMPT_LEN
    kv_p = {t: (k[:, :, :p], v[:, :, :p]) for t, (k, v) in kv.items()}
    tok, h = greedy[:1].view(1, 1), hidden[-1].view(1, 1, HIDDEN)
    d_logits, d_hidden, d_tokens = [], [], []
    for _ in range(NUM_DRAFT):
        o = drafter(inputs_embeds=torch.cat([emb(tok), h], -1), attention_mask=torch.ones(1, p + 1, dtype=torch.long),
                    position_ids=torch.tensor([[p]]), shared_kv_states=kv_p, use_cache=False)
        tok, h = o.logits.argmax(-1), o.last_hidden_state
        d_logits.append(o.logits[0, 0])
        d_hidden.append(h[0, 0])
        d_tokens.append(int(tok))
    pos0, cand_tokens, cand_logits = rounds[0]
    assert pos0 == p + 1 and cand_tokens.tolist() == d_tokens and torch.equal(cand_logits, torch.stack(d_logits))

    ref = {
        "prompt": i32(prompt[0]), "logits_full": f32(logits), "hidden_full": f32(hidden),
        "logits_step": f32(logits_step), "greedy": i32(greedy), "greedy_assisted": i32(assisted),
        "greedy_unsuppressed": i32(free), "suppress_tokens": i32(suppress),
        "draft_logits": f32(torch.stack(d_logits)), "draft_hidden": f32(torch.stack(d_hidden)),
        "draft_tokens": i32(d_tokens),
        **{f"kv_{n}_{x}": f32(kv[kind][j][0]) for kind, n in ((S, "sliding"), (F, "full"))
           for j, x in ((0, "k"), (1, "v"))},
    }
    ref.update(exact_text(target, drafter, prompt, greedy, d_tokens))
    return ref


@torch.no_grad()
def exact_text(target, drafter, prompt, greedy, d_tokens) -> dict:
    """The prefill and the teacher-forced first draft round in float64 (fp32 noise in transformers
    itself is ~1e-5, too close to the 1e-4 bar to compare against)."""
    t64, d64 = copy.deepcopy(target).double(), copy.deepcopy(drafter).double()
    out = t64(prompt, use_cache=True, output_hidden_states=True, return_shared_kv_states=True)
    hidden, p = out.hidden_states[-1], prompt.shape[1]
    kv = {t: (k[:, :, :p], v[:, :, :p]) for t, (k, v) in out.shared_kv_states.items()}
    tok, h, logits, hiddens = greedy[:1].view(1, 1), hidden[:, -1:], [], []
    for d in d_tokens:
        o = d64(inputs_embeds=torch.cat([t64.get_input_embeddings()(tok), h], -1),
                attention_mask=torch.ones(1, p + 1, dtype=torch.long), position_ids=torch.tensor([[p]]),
                shared_kv_states=kv, use_cache=False)
        logits.append(o.logits[0, 0])
        hiddens.append(o.last_hidden_state[0, 0])
        tok, h = torch.tensor([[d]]), o.last_hidden_state
    return {
        "logits_exact": f32(out.logits[0]), "hidden_exact": f32(hidden[0]),
        "draft_logits_exact": f32(torch.stack(logits)), "draft_hidden_exact": f32(torch.stack(hiddens)),
        **{f"kv_{n}_{x}_exact": f32(out.shared_kv_states[kind][j][0]) for kind, n in ((S, "sliding"), (F, "full"))
           for j, x in ((0, "k"), (1, "v"))},
    }


@torch.no_grad()
def embedder_references(target, gen) -> dict:
    """Two images of 12 patch rows (7 and 12 real, (x, y) inside the 16-entry table; image 1's
    first patch flat) and two clips of 5 audio frames (3 and 5 real; frame 1 of clip 0 all zeros)."""
    codes = torch.randint(0, 256, (2, 6, 6912), generator=gen, dtype=torch.uint8)
    codes[0, 3:] = 0
    codes[1, 0] = 117  # a flat patch: zero variance, LayerNorm's eps sets the scale
    positions = torch.full((2, 6, 2), -1, dtype=torch.long)
    positions[0, :3] = torch.tensor([[0, 0], [1, 0], [0, 1]])
    positions[1] = torch.tensor([[x + 13, y + 12] for y in range(2) for x in range(3)])  # the table's far end
    pixels = codes * RESCALE  # the processor's rescale (TorchvisionBackend.rescale)
    assert pixels.dtype == torch.float32
    frames = 0.3 * torch.randn((2, 5, 640), generator=gen)
    frames[0, 1] = 0.0
    frames[0, 3:] = 0.0
    mask = torch.tensor([[True] * 3 + [False] * 2, [True] * 5])

    def run(model, dtype):
        m = model.model
        image = torch.cat(m.get_image_features(pixels.to(dtype), positions).pooler_output)
        audio = m.get_audio_features(frames.to(dtype), mask).pooler_output
        return image, audio

    image, audio = run(target, torch.float32)
    image64, audio64 = run(copy.deepcopy(target).double(), torch.float64)
    assert image.shape == (9, HIDDEN) and audio.shape == (2, 5, HIDDEN)
    assert bool((audio[0, 1] == 0).all())  # digital silence embeds to zero
    return {
        "image_codes": codes.numpy(), "image_positions": i32(positions), "image_features": f32(image),
        "image_features_exact": f32(image64), "audio_frames": f32(frames), "audio_mask": mask.numpy(),
        "audio_features": f32(audio), "audio_features_exact": f32(audio64),
    }


def processor_references(gen) -> dict:
    """Target sizes over many image sizes and every budget, and one image patchified the processor's
    way (16-px patches merged 3x3 by `patches_merge`)."""
    fns = processor_functions("get_aspect_ratio_preserving_size", "convert_image_to_patches", "patches_merge")
    rng = np.random.default_rng(SEED)
    sides = sorted({1, 2, 47, 48, 49, 95, 96, 97, 300, 767, 768, 1024, 4000, *rng.integers(1, 5000, 20).tolist()})
    sizes = []
    for h in sides:
        for w in sides:
            for budget in BUDGETS:
                try:
                    th, tw = fns["get_aspect_ratio_preserving_size"](h, w, 16, budget * 9, 3)
                except ValueError:
                    th = tw = -1  # transformers refuses it
                sizes.append((h, w, budget, th, tw))
    codes = torch.randint(0, 256, (96, 144, 3), generator=gen, dtype=torch.uint8)
    image = codes.permute(2, 0, 1) * RESCALE  # (C, H, W), as the processor holds it
    teacher = fns["convert_image_to_patches"](image, 16)
    grid = torch.meshgrid(torch.arange(144 // 16), torch.arange(96 // 16), indexing="xy")
    positions = torch.stack(grid, -1).reshape(-1, 2)
    merged, merged_positions = fns["patches_merge"](teacher[None], positions[None], teacher.shape[0] // 9)
    digest = hashlib.sha256(f32(merged[0]).tobytes()).hexdigest()
    return {"sizes": np.asarray(sizes, dtype=np.int32), "merge_codes": codes.numpy(),
            "merge_pixels_sha256": np.array(digest), "merge_positions": i32(merged_positions[0])}


# ---- a prompt with images, audio and video (media.npz) ----------------------------------------------

IMAGE, AUDIO, VIDEO = 258880, 258881, 258884  # the fixture config's placeholders (pad before embedding)
BOI, EOI, BOA, EOA = 120, 122, 123, 125  # the delimiters: tests/chat_helpers.py's ids (the released ones are
TOKEN_TYPES = {IMAGE: 1, VIDEO: 2, AUDIO: 3}  # past the 128-token vocabulary; to the model they are text)
MEDIA_BUDGET = 70  # the chat model's max_soft_tokens: its images are not resized at this budget
MEDIA_IMAGES = ((336, 384), (336, 432))  # 7 x 8 = 56 and 7 x 9 = 63 blocks, at their own target size
AUDIO_SAMPLES = 4 * 640 + 300  # 5 frames, the last zero-padded
FRAME_SIZE = (144, 192)  # a video frame of 3 x 4 = 12 blocks


def mosaic(rng: np.random.Generator, h: int, w: int, flat: bool = False) -> np.ndarray:
    """(h, w, 3) uint8 tiles of 6 x 6 pixels in random colours (small once compressed: 64 tiles a
    48-pixel block); `flat`: block (0, 0) one colour, where LayerNorm's eps sets the scale."""
    tiles = rng.integers(0, 256, (h // 6, w // 6, 3), dtype=np.uint8)
    codes = np.ascontiguousarray(tiles.repeat(6, axis=0).repeat(6, axis=1))
    if flat:
        codes[:48, :48] = (203, 117, 64)
    return codes


def processor_patches(codes: np.ndarray, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An image at its target size through the 12B processor's steps 3-6: 16-pixel patches, merged 3 x 3
    (`patches_merge`), padded to MEDIA_BUDGET rows ((-1, -1) positions). `pixels`: (C, H, W) rescaled."""
    fns = processor_functions("convert_image_to_patches", "patches_merge", "pad_along_first_dim")
    h, w = codes.shape[:2]
    teacher = fns["convert_image_to_patches"](pixels, 16)
    grid = torch.meshgrid(torch.arange(w // 16), torch.arange(h // 16), indexing="xy")
    merged, positions = fns["patches_merge"](teacher[None], torch.stack(grid, -1).reshape(-1, 2)[None],
                                             teacher.shape[0] // 9)
    return fns["pad_along_first_dim"](merged[0], positions[0].long(), MEDIA_BUDGET)


def expand(lone: list, counts: dict) -> list:
    """A prompt's lone placeholders expanded as `Gemma4UnifiedProcessor` does: each `counts[token]`
    pops its block's soft-token count, and the block is wrapped in its delimiters."""
    out = []
    for t in lone:
        if t in counts:
            open_, close = (BOA, EOA) if t == AUDIO else (BOI, EOI)
            out += [open_] + [t] * counts[t].pop(0) + [close]
        else:
            out.append(t)
    return out


def official_forward(model, ids: torch.Tensor, dtype, **inputs) -> tuple[torch.Tensor, dict]:
    """Logits of one forward with the masks of the model class's `create_masks_for_generate` (the
    official rule: full layers causal; sliding layers window AND (causal OR same image block)) passed
    as `attention_mask`. Without them the forward ORs the block overlay into both layer kinds."""
    types = torch.zeros_like(ids)
    for token, kind in TOKEN_TYPES.items():
        types[ids == token] = kind
    T = ids.shape[1]
    masks = type(model).create_masks_for_generate(
        model.config, torch.empty((1, T, 0), dtype=dtype), torch.ones_like(ids), None, torch.arange(T)[None],
        mm_token_type_ids=types)
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    return model(ids, attention_mask=masks, **inputs).logits[0], dict(masks, types=types)


def check_generate(model, ids, logits, types, **inputs) -> float:
    """`generate()` with a static cache (compileable: the only kind for which it calls
    `create_masks_for_generate`) gives `logits`' last row as its first step; with the default
    DynamicCache it gives the direct forward's. Returns how far the direct forward is from `logits`."""
    kw = dict(mm_token_type_ids=types, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
              output_logits=True, return_dict_in_generate=True, **inputs)
    static = model.generate(ids, cache_implementation="static", **kw).logits[0][0]
    assert (static - logits[-1]).abs().max() < 1e-5
    direct = model(ids, mm_token_type_ids=types, **inputs).logits[0]
    dynamic = model.generate(ids, **kw).logits[0][0]
    assert (dynamic - direct[-1]).abs().max() < 1e-5
    return float((direct - logits).abs().max())


def masks_as_arrays(masks: dict, T: int) -> tuple[np.ndarray, np.ndarray]:
    """(sliding, full) [T, T] bool, True = visible; None (sdpa's own causal mask) as causal."""
    causal = np.tril(np.ones((T, T), dtype=bool))
    return tuple(causal if masks[k] is None else masks[k][0, 0].numpy().astype(bool).copy() for k in (S, F))


@torch.no_grad()
def reference_case(target, t64, ids: torch.Tensor, **inputs) -> tuple[dict, dict]:
    """One prompt's float64 logits and official masks (fp32 forward checked against `generate()`), and
    its figures: transformers' own fp32 error, the direct forward's distance."""
    logits, masks = official_forward(target, ids, torch.float32, **inputs)
    gap = check_generate(target, ids, logits, masks["types"], **inputs)
    exact, masks64 = official_forward(t64, ids, torch.float64, **inputs)
    sliding, full = masks_as_arrays(masks64, ids.shape[1])
    assert np.array_equal((sliding, full), masks_as_arrays(masks, ids.shape[1]))
    arrays = {"prompt": i32(ids[0]), "logits_exact": f32(exact), "mask_sliding": sliding, "mask_full": full}
    figures = {"prompt_length": int(ids.shape[1]),
               "fp32_vs_float64_rel": float((logits.double() - exact).abs().max() / exact.abs().max()),
               "direct_forward_vs_official_max_abs": gap}
    return arrays, figures


def sha256(a: torch.Tensor) -> str:
    return hashlib.sha256(f32(a).tobytes()).hexdigest()


def media_references(target) -> tuple[dict, dict]:
    """The media prompt (image, clip, image) and the video prompt (two frames): their inputs as the 12B's
    processors make them, transformers' float64 logits and the official masks."""
    config = target.config
    assert (config.image_token_id, config.audio_token_id, config.video_token_id) == (IMAGE, AUDIO, VIDEO)
    gen = torch.Generator().manual_seed(SEED + 50)  # apart from the generators above, which stay as they were
    rng = np.random.default_rng(SEED + 50)
    size = processor_functions("get_aspect_ratio_preserving_size")["get_aspect_ratio_preserving_size"]
    t64 = copy.deepcopy(target).double()

    def text(n):
        return torch.randint(3, 100, (n,), generator=gen).tolist()

    def real(positions):
        return [int((p >= 0).all(-1).sum()) for p in positions]

    # image 0 (56 blocks, a flat one), a 5-frame clip, image 1 (63 blocks), text around and between
    images = [mosaic(rng, h, w, flat=i == 0) for i, (h, w) in enumerate(MEDIA_IMAGES)]
    for codes in images:  # at its own target size: the processor does not resize it
        assert size(*codes.shape[:2], 16, MEDIA_BUDGET * 9, 3) == codes.shape[:2]
    patched = [processor_patches(c, torch.from_numpy(c).permute(2, 0, 1) * RESCALE) for c in images]
    pixels, positions = (torch.stack(x) for x in zip(*patched))
    assert pixels.dtype == torch.float32
    samples = (0.3 * torch.randn(AUDIO_SAMPLES, generator=gen)).numpy()
    n_frames = -(-AUDIO_SAMPLES // 640)
    frames = np.zeros((n_frames, 640), np.float32)
    frames.reshape(-1)[:AUDIO_SAMPLES] = samples  # Gemma4UnifiedAudioFeatureExtractor: pad, reshape
    lone = [2, *text(4), IMAGE, *text(2), AUDIO, *text(3), IMAGE, *text(4)]
    ids = torch.tensor([expand(lone, {IMAGE: real(positions), AUDIO: [n_frames]})])
    mask = torch.ones(1, n_frames, dtype=torch.bool)
    arrays, figures = reference_case(target, t64, ids, pixel_values=pixels, image_position_ids=positions,
                                     input_features=torch.from_numpy(frames)[None], input_features_mask=mask)
    ref = {f"media_{k}": v for k, v in arrays.items()}
    ref.update(media_request=i32(lone), media_image_0=images[0], media_image_1=images[1],
               media_image_positions=i32(positions), media_audio_samples=samples, media_audio_frames=frames,
               media_pixel_sha256=np.array([sha256(p[:n]) for p, n in zip(pixels, real(positions))]))

    # two video frames, each its own block (the timestamp and delimiters between them break the run);
    # rescaled float32(x) / 255 by the video processor's fused normalize
    first = mosaic(rng, *FRAME_SIZE)
    second = np.roll(first, 6, axis=1)  # the first moved right by a tile, two tiles changed
    second[12:24, 60:66] = (250, 10, 10)
    video = np.stack([first, second])
    patched = [processor_patches(c, torch.from_numpy(c).permute(2, 0, 1).float() / 255.0) for c in video]
    pixels, positions = (torch.stack(x) for x in zip(*patched))
    stamp = text(3)  # "00:00 ": timestamps are ordinary text
    lone = [2, *text(3), *stamp, VIDEO, *stamp, VIDEO, *text(3)]
    ids = torch.tensor([expand(lone, {VIDEO: real(positions)})])
    video_inputs = dict(pixel_values_videos=pixels, video_position_ids=positions,
                        num_frames_per_video=torch.tensor([2]))
    arrays, video_figures = reference_case(target, t64, ids, **video_inputs)
    ref.update({f"video_{k}": v for k, v in arrays.items()})
    ref.update(video_frames=video, video_positions=i32(positions),
               video_pixel_sha256=np.array([sha256(p[:n]) for p, n in zip(pixels, real(positions))]))
    tokens = {"images": real(torch.from_numpy(ref["media_image_positions"])), "audio": n_frames,
              "video_frames": real(positions)}
    return ref, {"media": figures, "video": video_figures, "soft_tokens": tokens}


# ---- resize backends (--resize-report: needs torchvision) -------------------------------------------


def resize_report() -> dict:
    """How far Pillow's bicubic (ours: mlx_mtp/formats/images.py at patch 48, pool 1) is from the 12B's
    processor (torchvision only), against how far transformers' own two Gemma 4 image backends
    (`Gemma4ImageProcessorPil`, `Gemma4ImageProcessor` on torchvision) are from each other: on noise and
    gradients, up- and downscaled, at budgets 70 and 280. Printed; nothing is written."""
    import importlib.util

    from PIL import Image
    from transformers import Gemma4ImageProcessor, Gemma4ImageProcessorPil, Gemma4UnifiedImageProcessor

    path = os.path.join(os.path.dirname(__file__), "..", "..", "mlx_mtp", "formats", "images.py")
    spec = importlib.util.spec_from_file_location("mlx_mtp_images", path)  # Pillow and numpy: no MLX here
    ours = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ours)
    processors = {"12b": (Gemma4UnifiedImageProcessor, 48), "tv": (Gemma4ImageProcessor, 16),
                  "pil": (Gemma4ImageProcessorPil, 16)}
    pairs = (("ours", "12b"), ("pil", "tv"), ("ours", "pil"), ("12b", "tv"))

    def gradient(h, w):
        y, x = np.mgrid[0:h, 0:w]
        rgb = [255 * x / w, 255 * y / h, 127 + 120 * np.sin(x / 9 + y / 13)]
        return np.stack(rgb, -1).round().astype(np.uint8)

    rng = np.random.default_rng(SEED)
    sources = {
        "noise 200x300 (up)": rng.integers(0, 256, (200, 300, 3), dtype=np.uint8),
        "noise 640x480 (down)": rng.integers(0, 256, (640, 480, 3), dtype=np.uint8),
        "gradient 53x77 (up)": gradient(53, 77),
        "gradient 1000x700 (down)": gradient(1000, 700),
    }

    def image(pixels, positions, patch):
        """(H, W, 3) from patches (n, patch * patch * 3), RGB innermost, at (x, y) patch positions."""
        pixels, positions = np.asarray(pixels), np.asarray(positions)
        real = (positions >= 0).all(-1)
        w, h = (positions[real].max(0) + 1) * patch
        out = np.zeros((h, w, 3), pixels.dtype)
        for (x, y), p in zip(positions[real], pixels[real]):
            out[y * patch:(y + 1) * patch, x * patch:(x + 1) * patch] = p.reshape(patch, patch, 3)
        return out

    rows = {pair: [] for pair in pairs}  # per image, budget: values, codes apart, values apart, LSB, |diff|
    for name, codes in sources.items():
        pil = Image.fromarray(codes)
        for budget in (70, 280):
            patches = ours.process(pil, budget, patch=48, pool=1)
            got = {"ours": image(patches.pixels, patches.positions, 48)}
            for key, (processor, patch) in processors.items():
                out = processor(max_soft_tokens=budget)(images=[pil], return_tensors="np")
                got[key] = image(out["pixel_values"][0], out["image_position_ids"][0], patch)
            line = []
            for a, b in pairs:
                lsb = np.abs(np.rint(got[a] * 255).astype(int) - np.rint(got[b] * 255).astype(int))
                n, codes_apart, values_apart = lsb.size, (lsb > 0).sum(), (got[a] != got[b]).sum()
                rows[a, b].append((n, codes_apart, values_apart, lsb.max(), np.abs(got[a] - got[b]).max()))
                line.append(f"{a} vs {b} {lsb.max()} LSB in {100 * codes_apart / n:.3f}% "
                            f"(values {100 * values_apart / n:.1f}%)")
            h, w = got["ours"].shape[:2]
            print(f"{name:26s} budget {budget:4d} -> {h}x{w}: " + "; ".join(line))
    summary = {}
    for (a, b), r in rows.items():
        n, codes_apart, values_apart, lsb, diff = np.array(r, dtype=np.float64).T
        summary[f"{a} vs {b}"] = {"max_lsb": int(lsb.max()), "share_codes": codes_apart.sum() / n.sum(),
                                  "share_values": values_apart.sum() / n.sum(), "max_abs": diff.max()}
    print(f"platform {platform.platform()}, torch {torch.__version__}, Pillow {Image.__version__}")
    print(json.dumps(summary, indent=1))
    return summary


def drop_default_keys(path: str) -> None:
    """Leave the unified text defaults (max positions 262144, bidirectional "vision") out of a
    written config.json, as a hand-made or future file may: a loader must supply them. transformers
    writes no PLE or MoE keys for these classes (it has none); the released 12B files do."""
    config = json.load(open(path))
    text = config["text_config"]
    assert text.pop("max_position_embeddings") == 262144 and text.pop("use_bidirectional_attention") == "vision"
    assert not {"hidden_size_per_layer_input", "vocab_size_per_layer_input", "enable_moe_block"} & set(text)
    with open(path, "w") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
        fh.write("\n")


@torch.no_grad()
def build(out: str) -> None:
    gen = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    target = Gemma4UnifiedForConditionalGeneration(target_config()).eval()
    perturb_(target, gen)
    perturb_embedders_(target, gen)
    drafter = Gemma4UnifiedAssistantForCausalLM(drafter_config()).eval()
    perturb_(drafter, gen)
    drafter.generation_config.num_assistant_tokens = NUM_DRAFT
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    modes = target.config.text_config.kv_sharing_modes
    assert modes == [None] * 4 + ["store"] * 2, modes

    ref = text_references(target, drafter, gen)
    ref.update(embedder_references(target, gen))
    processor = processor_references(gen)
    media, media_figures = media_references(target)

    if os.path.isdir(out):
        shutil.rmtree(out)
    tdir, ddir = os.path.join(out, "target"), os.path.join(out, "drafter")
    target.save_pretrained(tdir)
    drafter.save_pretrained(ddir)
    for directory in (tdir, ddir):
        drop_default_keys(os.path.join(directory, "config.json"))
    t2 = Gemma4UnifiedForConditionalGeneration.from_pretrained(tdir, dtype=torch.float32).eval()
    assert torch.equal(t2(torch.tensor(ref["prompt"][None].astype(np.int64))).logits[0],
                       torch.tensor(ref["logits_full"]))
    d2 = Gemma4UnifiedAssistantForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
    assert {**d2.config.text_config.to_dict(), "dtype": None} == {**drafter.config.text_config.to_dict(), "dtype": None}
    np.savez_compressed(os.path.join(out, "reference.npz"), **ref)
    np.savez_compressed(os.path.join(out, "processor.npz"), **processor)
    np.savez_compressed(os.path.join(out, "media.npz"), **media)
    meta = {
        "seed": SEED, "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "kv_sharing_modes": modes, "suppress_tokens": ref["suppress_tokens"].tolist(),
        "greedy_distinct_tokens": len(set(ref["greedy"].tolist())),
        "arrays": {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in ref.items()},
        "files": {"target": safetensor_keys(tdir), "drafter": safetensor_keys(ddir)},
    }
    with open(os.path.join(out, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=1, sort_keys=True)
        fh.write("\n")
    media_meta = {
        "versions": meta["versions"], "platform": platform.platform(), "figures": media_figures,
        "token_ids": dict(image=IMAGE, audio=AUDIO, video=VIDEO, boi=BOI, eoi=EOI, boa=BOA, eoa=EOA),
        "arrays": {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in media.items()},
    }
    with open(os.path.join(out, "media.json"), "w") as fh:
        json.dump(media_meta, fh, indent=1, sort_keys=True)
        fh.write("\n")
    print(f"media: {json.dumps(media_figures)}")
    print(f"suppress={ref['suppress_tokens'].tolist()} greedy[:8]={ref['greedy'][:8].tolist()} "
          f"unsuppressed[:8]={ref['greedy_unsuppressed'][:8].tolist()} drafts={ref['draft_tokens'].tolist()}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("tests", "fixtures", "unified"))
    ap.add_argument("--resize-report", action="store_true",
                    help="print Pillow's bicubic against torchvision's (needs torchvision); write nothing")
    args = ap.parse_args(argv)
    if args.resize_report:
        resize_report()
        return
    if transformers.__version__ != TRANSFORMERS_VERSION:
        print(f"warning: fixtures are pinned to transformers=={TRANSFORMERS_VERSION}", file=sys.stderr)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    build(args.out)


if __name__ == "__main__":
    main()
