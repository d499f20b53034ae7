"""The 12B (`gemma4_unified`) with images, audio and video frames in one prompt reproduces transformers
5.23 (tests/fixtures/unified/media.npz, made by tests/reference/make_unified_fixtures.py): the same pixel
and sample inputs go through our request path (`formats.media.place` on
chat_helpers.make_unified_chat_model) and give transformers' float64 logits within 1e-4 relative.

transformers is run with the masks of `Gemma4UnifiedForConditionalGeneration.create_masks_for_generate`
(the official rule: full layers causal; sliding layers window AND (causal OR same image block); audio
causal). Its direct forward ORs the block overlay into both layer kinds, which moves these logits by up
to 5.2 (media.json). So does 5.23's `generate()` with its default DynamicCache; only a compileable
(static) cache makes it call `create_masks_for_generate`.

Resize (Pillow's bicubic, ours, against torchvision's, transformers' 12B processor; run by
`make_unified_fixtures.py --resize-report` in a venv with torchvision 0.29.1, torch 2.14.1, Pillow 13.0,
x86-64), over 4 images (noise and gradients, up- and downscaled) at budgets 70 and 280:
  ours vs the 12B processor: codes differ in 0.39 % of values (0.06-0.69 % by image), by at most 2 LSB;
    float values in 47 % (those and the rescale's 1 ulp), by at most 2/255.
  transformers' Gemma4ImageProcessorPil vs Gemma4ImageProcessor (torchvision): the same figures, value
    for value: ours equals the Pil backend bit for bit, and the 12B processor the torchvision one.
"""

import hashlib
from functools import lru_cache

import mlx.core as mx
import numpy as np
import pytest
from chat_helpers import UNIFIED, make_unified_chat_model
from conftest import BOTH_KERNELS
from PIL import Image

import mlx_mtp
from mlx_mtp.cache.kv import _visible
from mlx_mtp.formats import media, vision
from mlx_mtp.formats.media import AudioPart
from mlx_mtp.formats.vision import ImagePart
from mlx_mtp.models.gemma4_unified import image_patches
from mlx_mtp.models.gemma4_vision import PromptImages, placeholder_runs

TOL = 1e-4  # fp32 against transformers' float64 forward (its own fp32 is 1.1e-5 away)
WINDOW = 8
CHAT_IDS = {258880: 121, 258881: 124, 258884: 126}  # the fixture's placeholders -> the chat model's


@lru_cache(maxsize=None)
def ref() -> dict:
    return dict(np.load(UNIFIED / "media.npz"))


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return mlx_mtp.load(make_unified_chat_model(tmp_path_factory.mktemp("unified-media") / "model"))


def chat_ids(ids) -> list:
    return [CHAT_IDS.get(int(t), int(t)) for t in ids]


def rel_diff(a, b) -> float:
    """Largest difference relative to the reference's largest magnitude (the issue's bar)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def sha256(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, dtype=np.float32).tobytes()).hexdigest()


def sources() -> list:
    r = ref()
    return [ImagePart(Image.fromarray(r["media_image_0"])), AudioPart(r["media_audio_samples"], 16000),
            ImagePart(Image.fromarray(r["media_image_1"]))]


def placed(loaded) -> tuple[list, PromptImages]:
    """The recorded prompt's lone placeholders expanded and its media placed, as a request's are."""
    return media.place(loaded, chat_ids(ref()["media_request"]), sources())


def logits(loaded, ids, images: PromptImages, chunk=None) -> np.ndarray:
    """The prompt's logits, in one forward or in chunks of about `chunk` that cut no image (`cut`)."""
    model, n = loaded.target, len(ids)
    cache, out, start = model.make_cache(), [], 0
    while start < n:
        end = n if chunk is None else images.cut(start, min(start + chunk, n))
        tokens = mx.array([ids[start:end]])
        out.append(model(tokens, cache, images=images.rows(start, end - start)).logits[0])
        start = end
    return np.array(mx.concatenate(out))


# ---- parity ---------------------------------------------------------------------------------------


def test_request_path_places_the_recorded_media(loaded):
    ids, images = placed(loaded)
    assert ids == chat_ids(ref()["media_prompt"])
    assert images.causal == (False, True, False)  # the clip between the two images stays causal
    assert [f.shape[0] for f in images.features] == [56, ref()["media_audio_frames"].shape[0], 63] == [56, 5, 63]


@BOTH_KERNELS  # the mx.fast norms and RoPE (a GPU's) as well as the CPU's
@pytest.mark.parametrize("chunk", [None, 16])
def test_logits_match_transformers(loaded, chunk, fused):
    """Image (56 patches, a flat one), clip (5 frames, the last padded), image (63 patches), text
    around them: every row of the prompt, in one forward and in chunks through the sliding window."""
    ids, images = placed(loaded)
    got = logits(loaded, ids, images, chunk)
    print(f"\n[unified-media] chunk {chunk}: logits rel {rel_diff(got, ref()['media_logits_exact']):.2e}")
    assert rel_diff(got, ref()["media_logits_exact"]) <= TOL


@BOTH_KERNELS
def test_two_video_frames_match_transformers(loaded, fused):
    """Two 12-patch frames (`pixel_values_videos`, rescaled x / 255 as the video processor does), each
    its own bidirectional block, placed here directly (`PromptImages`), not through a request."""
    r, embed = ref(), vision.encoder(loaded).load()
    ids = chat_ids(r["video_prompt"])
    feats = []
    for codes, positions, digest in zip(r["video_frames"], r["video_positions"], r["video_pixel_sha256"]):
        pixels, ours = image_patches(codes)
        pixels = np.rint(pixels * 255).astype(np.float32) / np.float32(255)
        assert sha256(pixels) == str(digest) and np.array_equal(ours, positions[(positions >= 0).all(-1)])
        feats.append(embed.image(pixels, ours))
    runs = placeholder_runs(ids, CHAT_IDS[258884])
    assert [e - s for s, e in runs] == [f.shape[0] for f in feats] == [12, 12]
    images = PromptImages(tuple(s for s, _ in runs), tuple(feats), causal=(False, False))
    got = logits(loaded, ids, images)
    print(f"\n[unified-media] video logits rel {rel_diff(got, r['video_logits_exact']):.2e}")
    assert rel_diff(got, r["video_logits_exact"]) <= TOL


def test_image_inputs_are_transformers_pixels():
    """The recorded images patchified as the 12B's processor does (48-pixel raster, x * fp32(1/255))."""
    r = ref()
    for i, digest in enumerate(r["media_pixel_sha256"]):
        pixels, positions = image_patches(r[f"media_image_{i}"])
        want = r["media_image_positions"][i]
        assert sha256(pixels) == str(digest) and np.array_equal(positions, want[(want >= 0).all(-1)])


def test_request_path_pixels_are_transformers_pixels_within_an_ulp(loaded):
    """The request path does not resize an image at its target size, so the codes are the recorded ones;
    it rescales them as x / 255 (the PIL backend's table), the 12B's processor as x * fp32(1/255): 1 ulp
    apart for 126 of 256 codes, as transformers' own two Gemma 4 backends are."""
    r, encoder = ref(), vision.encoder(loaded)
    for i in range(2):
        patches = encoder.process(sources()[2 * i])
        want, positions = image_patches(r[f"media_image_{i}"])
        assert np.array_equal(patches.positions, positions)
        assert np.abs(patches.pixels - want).max() <= np.spacing(np.float32(1)) / 2  # 1 ulp below 1.0


# ---- masks ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["media", "video"])
def test_masks_are_create_masks_for_generate(loaded, case):
    """Our sliding and full masks over the whole prompt are transformers' official ones, entry for entry."""
    r = ref()
    if case == "media":
        ids, images = placed(loaded)
    else:
        ids = chat_ids(r["video_prompt"])
        runs = placeholder_runs(ids, CHAT_IDS[258884])
        images = PromptImages(tuple(s for s, _ in runs), tuple(mx.zeros((e - s, 1)) for s, e in runs))
    positions = mx.arange(len(ids), dtype=mx.int32)[None]
    blocks = images.rows(0, len(ids)).blocks
    sliding = np.array(_visible(positions, positions, WINDOW, blocks))[0, 0]
    full = np.array(_visible(positions, positions, None))[0, 0]
    assert np.array_equal(sliding, r[f"{case}_mask_sliding"]) and np.array_equal(full, r[f"{case}_mask_full"])


def test_the_audio_span_is_causal_and_images_see_each_other_within_the_window(loaded):
    """In transformers' masks no clip row sees a later one, an image's first row sees all of its image
    and its last row none of it 8 or more back; flipping a span's `causal` moves the logits from the span on."""
    r = ref()
    ids, images = placed(loaded)
    (i0, e0), (a0, a1), _ = images.spans
    sliding = r["media_mask_sliding"]
    assert not np.triu(sliding[a0:a1, a0:a1], 1).any()
    assert sliding[i0, i0:e0].all() and not sliding[e0 - 1, i0: e0 - WINDOW].any()
    base = logits(loaded, ids, images)
    for span, (s, e) in enumerate(images.spans):
        causal = tuple(c != (i == span) for i, c in enumerate(images.causal))
        flipped = logits(loaded, ids, PromptImages(images.starts, images.features, causal=causal))
        assert np.array_equal(flipped[:s], base[:s])  # nothing before the span changes
        assert rel_diff(flipped[s:e - 1], base[s:e - 1]) > 1e-3  # its rows (the last sees the same either way)
        assert rel_diff(flipped, r["media_logits_exact"]) > 1e-2
