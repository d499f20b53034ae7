"""Images in requests: a checkpoint's image path (its tower, `loading.Tower`, read with the first image,
so text-only use pays no memory for it; how an image becomes its patches; its token ids) and the image
parts of chat messages. `media` expands a prompt's placeholders and places the soft tokens.

Message parts are as transformers' chat templates take them: `{"type": "image", "image": <path, bytes,
data URL or PIL image>}` beside `{"type": "text", "text": ...}`; `{"type": "image", "url": ...}` and
OpenAI's `{"type": "image_url", "image_url": {"url": ...}}` are the same (`apply_chat_template` rewrites
`image_url` parts so too). A part may ask for its own soft-token budget (`"max_soft_tokens": 70..1120`;
OpenAI's `"detail": "low"` is 70). The template renders each image as one `<|image|>`; it becomes
`<|image>` + N x `<|image|>` + `<image|>` (N: the image's soft tokens), as `Gemma4Processor` does. The
12B has no tower: an image's 48-pixel patches go through its embedders (`models.gemma4_unified`), one
soft token each, resized as the other checkpoints' are (Pillow's bicubic; transformers' 12B processor
has only a torchvision backend).
"""

from __future__ import annotations

import json
from typing import Any, Mapping, NamedTuple, Optional

import mlx.core as mx
import numpy as np

from . import images as image_io
from .images import ImageError

IMAGE_PART_TYPES = ("image", "image_url")
UNIFIED_PATCH = 48  # the 12B's patch side in pixels
DETAIL_BUDGETS = {"low": 70}  # OpenAI's `detail`: "low" takes the smallest budget; others the checkpoint's


class ImagePart(NamedTuple):
    """An image of a message and the soft-token budget its part asks for (None: the checkpoint's)."""

    source: Any
    budget: Optional[int] = None


class VisionEncoder:
    """The image path of one checkpoint: its tower (`loading.Tower`, read the first time an image
    comes), how images become its patches (the checkpoint's soft-token budget) and its token ids."""

    def __init__(self, tower, budget: int = image_io.DEFAULT_BUDGET):
        from ..models.gemma4_vision import VisionConfig

        config = tower.config
        self.tower, self.config = tower, config
        self.unified = config.get("model_type") == "gemma4_unified"  # the 12B: encoder-free embedders
        self.vision_config = None if self.unified else VisionConfig.from_dict(config["vision_config"])
        self.image_token = int(config.get("image_token_id", 258880))
        self.boi = int(config.get("boi_token_id", 255999))
        self.eoi = int(config.get("eoi_token_id", 258882))
        self.budget = budget
        self.fetch_urls = False  # http(s) image URLs are fetched only where the server is told to

    @property
    def loaded(self) -> bool:
        return self.tower.loaded

    def load(self):
        """The tower, read now if it was not yet (once, whichever thread asks first)."""
        return self.tower.get()

    def process(self, source, budget: Optional[int] = None) -> image_io.Patches:
        """One image source (or `ImagePart`, with its own budget) opened and patchified for this
        encoder (ImageError if unusable)."""
        if isinstance(source, ImagePart):
            source, budget = source.source, source.budget or budget
        if self.fetch_urls and isinstance(source, str) and source.startswith(("http://", "https://")):
            source = image_io.fetch(source)
        # The 12B reads raw 48-pixel patches (16-pixel patches merged 3 x 3): one a soft token.
        if self.unified:  # its processor rescales as x * fp32(1/255), in float32
            from ..models.gemma4_unified import RESCALE

            table = np.arange(256, dtype=np.float32) * RESCALE
            return image_io.process(source, budget or self.budget, patch=UNIFIED_PATCH, pool=1, rescale=table)
        cfg = self.vision_config
        return image_io.process(source, budget or self.budget, patch=cfg.patch_size, pool=cfg.pooling_kernel_size)

    def soft_tokens(self, patches: image_io.Patches) -> mx.array:
        """(patches.tokens, text hidden) soft tokens of one processed image."""
        tower = self.load()
        return tower.image(patches.pixels, patches.positions) if self.unified else tower(patches.pixels,
                                                                                         patches.positions)


def encoder(loaded) -> Optional[VisionEncoder]:
    """The image path of a `load()`ed model (made once, kept on its tower), or None when it has no
    vision tower. Its soft-token budget is the checkpoint's `processor_config.json`
    `max_soft_tokens` (else 280)."""
    tower = getattr(loaded, "vision", None)
    if tower is None:
        return None
    if "encoder" not in tower.extras:
        budget = image_io.DEFAULT_BUDGET
        processor = tower.path / "processor_config.json"
        if processor.is_file():
            record = json.loads(processor.read_text())
            budget = (record.get("image_processor") or record).get("max_soft_tokens", budget)
        tower.extras["encoder"] = VisionEncoder(tower, budget)
    return tower.extras["encoder"]


def image_source(part: Mapping) -> Any:
    """What an image part holds: a path, bytes, a data URL, an http(s) URL or a PIL image."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, Mapping) else url
        if not isinstance(url, str):
            raise ImageError('an image_url part is {"type": "image_url", "image_url": {"url": ...}}')
        return url
    for key in ("image", "url", "path"):
        if part.get(key) is not None:
            return part[key]
    raise ImageError('an image part is {"type": "image", "image": <path, bytes or PIL image>}')


def part_budget(part: Mapping) -> Optional[int]:
    """The budget an image part asks for: `max_soft_tokens` (70, 140, 280, 560, 1120), or OpenAI's
    `detail: "low"` (70); None for the checkpoint's."""
    budget = part.get("max_soft_tokens")
    if budget is None and isinstance(part.get("image_url"), Mapping):
        budget = DETAIL_BUDGETS.get(part["image_url"].get("detail"))
    if budget is not None and budget not in image_io.BUDGETS:
        raise ImageError(f"max_soft_tokens must be one of {', '.join(map(str, image_io.BUDGETS))}, not {budget!r}")
    return budget
