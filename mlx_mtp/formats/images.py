"""Images in, as Gemma 4's vision encoder takes them: open, resize, patchify (Pillow + numpy, no torch).

The arithmetic is transformers' `Gemma4ImageProcessorPil` (5.23), bit for bit: the largest size
with sides a multiple of 48 (16-pixel patches, 3x3 pooling) within the soft-token budget, Pillow's
bicubic resize on uint8 RGB, x / 255 through float64 to float32, 16x16x3 patches in row-major
order with RGB innermost, and each patch's (x, y). Only real patches are returned: the encoder
runs an image alone, so transformers' padding rows would only be dropped again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math
import warnings
from pathlib import Path
from typing import Any, Union

import numpy as np

from . import dataurl

BUDGETS = (70, 140, 280, 560, 1120)  # soft tokens an image may take (`max_soft_tokens`)
DEFAULT_BUDGET = 280
PATCH, POOL = 16, 3
MAX_PIXELS = 50_000_000  # larger images are refused before they are decoded
# The rescale of transformers: uint8 -> float64 * (1/255) -> float32, as a table.
_RESCALE = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)


class ImageError(ValueError):
    """An image that cannot be read or used (the message says why, in one line)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Patches:
    """One processed image: what the encoder reads and how many soft tokens it gives."""

    pixels: np.ndarray  # (n, patch * patch * 3) float32 in [0, 1]
    positions: np.ndarray  # (n, 2) int32 (x, y) of each patch
    tokens: int  # soft tokens: n / pool^2
    digest: str  # sha256 of the resized pixels, the grid and the budget: the image's cache key

    @property
    def grid(self) -> tuple[int, int]:
        """(patches across, patches down)."""
        return int(self.positions[:, 0].max()) + 1, int(self.positions[:, 1].max()) + 1


ImageSource = Union[str, Path, bytes, bytearray, Any]  # a path, a data URL, raw bytes or a PIL image


def open_image(source: ImageSource):
    """A PIL image from a path, raw file bytes, a `data:image/...;base64,` URL or a PIL image. Files
    and bytes are loaded as transformers' `load_image` does (EXIF orientation applied, then RGB);
    a PIL image is taken as it is. Raises ImageError for anything that is not a usable image."""
    from PIL import Image, ImageOps

    if isinstance(source, Image.Image):
        _check_size(source.size)
        return source
    if isinstance(source, str) and source.startswith("data:"):
        source = decode_data_url(source)
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        raise ImageError("image URLs are not fetched: send the image as base64 data")
    if isinstance(source, (bytes, bytearray)):
        stream, name = io.BytesIO(bytes(source)), "image bytes"
    elif isinstance(source, (str, Path)):
        if not Path(source).is_file():
            raise ImageError(f"no image file at {source}")
        stream, name = str(source), str(source)
    else:
        raise ImageError(f"an image is a path, bytes, a data URL or a PIL image, not {type(source).__name__}")
    try:
        with warnings.catch_warnings():  # our own size limit speaks instead of Pillow's warning
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(stream)
        _check_size(image.size)
        image.load()
        image = ImageOps.exif_transpose(image)
        return image.convert("RGB")
    except ImageError:
        raise
    except Image.UnidentifiedImageError:  # its message names the stream object, no use to anyone
        raise ImageError(f"{name} is not a readable image (not in a format Pillow reads: PNG, JPEG, GIF, "
                         "WebP, ...)") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ImageError(f"{name} is not a readable image ({reason})") from None


def decode_data_url(url: str) -> bytes:
    """The bytes of a `data:image/<type>;base64,<data>` URL (ImageError for any other form)."""
    return dataurl.decode(url, "image", ImageError)


def media_type(url: str) -> str:
    """The media type a `data:` URL declares ('' for none), lower-cased: `image/png`."""
    return dataurl.media_type(url)


def is_image_type(media: str) -> bool:
    return dataurl.is_type(media, "image")


MAX_FETCH_BYTES = 32 << 20


def fetch(url: str, timeout: float = 15.0) -> bytes:
    """The bytes at an http(s) image URL (ImageError when it cannot be had, or is over 32 MB)."""
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "mlx-mtp"}),
                                    timeout=timeout) as response:
            data = response.read(MAX_FETCH_BYTES + 1)
    except (OSError, ValueError) as e:
        raise ImageError(f"cannot fetch the image at {url}: {e}") from None
    if len(data) > MAX_FETCH_BYTES:
        raise ImageError(f"the image at {url} is over {MAX_FETCH_BYTES >> 20} MB")
    return data


def _check_size(size: tuple[int, int]) -> None:
    w, h = size
    if w < 1 or h < 1:
        raise ImageError(f"the image is {w}x{h} pixels: empty")
    if w * h > MAX_PIXELS:
        raise ImageError(f"the image is {w}x{h} pixels ({w * h / 1e6:.0f} MP); at most {MAX_PIXELS / 1e6:.0f} MP")


def target_size(height: int, width: int, budget: int = DEFAULT_BUDGET, patch: int = PATCH,
                pool: int = POOL) -> tuple[int, int]:
    """(height, width) the image is resized to: as transformers' `get_aspect_ratio_preserving_size`
    (sides multiples of 48, at most 9 * budget patches; a side that would round to 0 becomes 48)."""
    if budget not in BUDGETS:
        raise ImageError(f"image token budget must be one of {', '.join(map(str, BUDGETS))}, not {budget}")
    side, max_patches = patch * pool, budget * pool**2
    factor = math.sqrt(max_patches * patch**2 / (height * width))
    h = int(math.floor(factor * height / side)) * side
    w = int(math.floor(factor * width / side)) * side
    longest = (max_patches // pool**2) * side
    if h == 0:
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        h, w = min(int(math.floor(height / width)) * side, longest), side
    return h, w


def soft_tokens(height: int, width: int, budget: int = DEFAULT_BUDGET, patch: int = PATCH, pool: int = POOL) -> int:
    """Soft tokens an image of this size takes at this budget."""
    h, w = target_size(height, width, budget, patch, pool)
    return (h // (patch * pool)) * (w // (patch * pool))


def process(source: ImageSource, budget: int = DEFAULT_BUDGET, patch: int = PATCH, pool: int = POOL,
            rescale: np.ndarray = _RESCALE) -> Patches:
    """Open (see `open_image`), resize and patchify one image for the encoder (`patch`, `pool`: its
    config's `patch_size` and `pooling_kernel_size`; Gemma 4's are 16 and 3; `rescale`: each uint8
    code's float32 value, as the checkpoint's processor computes it)."""
    from PIL import Image

    image = _rgb(open_image(source))
    h, w = target_size(image.height, image.width, budget, patch, pool)
    if (h, w) != (image.height, image.width):
        image = image.resize((w, h), Image.Resampling.BICUBIC)
    codes = np.asarray(image, dtype=np.uint8)
    hp, wp = h // patch, w // patch
    patches = codes.reshape(hp, patch, wp, patch, 3).transpose(0, 2, 1, 3, 4).reshape(hp * wp, -1)
    gx, gy = np.meshgrid(np.arange(wp), np.arange(hp), indexing="xy")
    positions = np.stack([gx, gy], axis=-1).reshape(-1, 2).astype(np.int32)
    digest = hashlib.sha256(codes.tobytes() + f"|{w}x{h}|{budget}|{patch}".encode()).hexdigest()
    return Patches(rescale[patches], positions, hp * wp // pool**2, digest)


def _rgb(image):
    """RGB as transformers' `convert_to_rgb`: transparency composited onto white."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image).convert("RGB")
    return image.convert("RGB")
