"""Images in requests: a checkpoint's vision encoder (loaded with the first image, so text-only use
pays no memory for it), the image parts of chat messages, and a rendered prompt's placeholders
expanded and filled with the images' soft tokens.

Message parts are as transformers' chat templates take them: `{"type": "image", "image": <path, bytes,
data URL or PIL image>}` beside `{"type": "text", "text": ...}`; `{"type": "image", "url": ...}` and
OpenAI's `{"type": "image_url", "image_url": {"url": ...}}` are the same (`apply_chat_template` rewrites
`image_url` parts so too). A part may ask for its own soft-token budget (`"max_soft_tokens": 70..1120`;
OpenAI's `"detail": "low"` is 70). The template renders each image as one `<|image|>`; it becomes
`<|image>` + N x `<|image|>` + `<image|>` (N: the image's soft tokens), as `Gemma4Processor` does.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import mlx.core as mx

from . import images as image_io
from .images import ImageError

IMAGE_PART_TYPES = ("image", "image_url")
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
        self.unified = config.get("model_type") == "gemma4_unified"  # the 12B: encoder-free, not wired yet
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
        if self.unified:
            raise ImageError("images on the 12B (gemma4_unified) do not reach its embedders yet: send text")
        if isinstance(source, ImagePart):
            source, budget = source.source, source.budget or budget
        cfg = self.vision_config
        if self.fetch_urls and isinstance(source, str) and source.startswith(("http://", "https://")):
            source = image_io.fetch(source)
        return image_io.process(source, budget or self.budget, patch=cfg.patch_size, pool=cfg.pooling_kernel_size)

    def place(self, tokens: Sequence[int], sources: Sequence, budget: Optional[int] = None) -> tuple[list, Any]:
        """A rendered prompt's tokens with its lone image placeholders expanded, and the images
        (`gemma4_vision.PromptImages`, soft tokens computed and evaluated here) placed in them."""
        from ..models.gemma4_vision import expand_placeholders, prompt_images

        patches = [self.process(s, budget) for s in sources]
        lone = sum(1 for t in tokens if t == self.image_token)
        if lone != len(patches):
            raise ValueError(f"the prompt has {lone} image placeholder(s) for {len(patches)} image(s)")
        ids = expand_placeholders(tokens, [p.tokens for p in patches], self.boi, self.image_token, self.eoi)
        placed = prompt_images(self.load(), ids, patches, self.image_token)
        mx.eval(list(placed.features))  # on this thread: the worker reads them as evaluated arrays
        return ids, placed


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


def message_images(messages: Optional[Sequence[Mapping]]) -> tuple[list, Optional[list]]:
    """The image sources of `messages` in the order the template renders them, and the messages
    with each image part as `{"type": "image"}` (None when there is no image: the messages as they are)."""
    sources, out = [], []
    for m in messages or ():
        content = m.get("content") if isinstance(m, Mapping) else None
        if not isinstance(content, (list, tuple)) or not any(_is_image(p) for p in content):
            out.append(m)
            continue
        parts = []
        for p in content:
            if _is_image(p):
                sources.append(ImagePart(image_source(p), part_budget(p)))
                parts.append({"type": "image"})
            else:
                parts.append(p)
        out.append({**m, "content": parts})
    return sources, (out if sources else None)


def part_budget(part: Mapping) -> Optional[int]:
    """The budget an image part asks for: `max_soft_tokens` (70, 140, 280, 560, 1120), or OpenAI's
    `detail: "low"` (70); None for the checkpoint's."""
    budget = part.get("max_soft_tokens")
    if budget is None and isinstance(part.get("image_url"), Mapping):
        budget = DETAIL_BUDGETS.get(part["image_url"].get("detail"))
    if budget is not None and budget not in image_io.BUDGETS:
        raise ImageError(f"max_soft_tokens must be one of {', '.join(map(str, image_io.BUDGETS))}, not {budget!r}")
    return budget


def _is_image(part) -> bool:
    return isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES
