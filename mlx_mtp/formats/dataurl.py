"""`data:` URLs, as requests carry images, audio and video: `data:<kind>/<type>;base64,<data>`."""

from __future__ import annotations

import base64
import binascii


def media_type(url: str) -> str:
    """The media type a `data:` URL declares ('' for none), lower-cased: `image/png`."""
    return url.partition(",")[0].removeprefix("data:").split(";")[0].strip().lower()


def is_type(media: str, kind: str) -> bool:
    """Whether `media` is a `kind` ("image", "audio", "video") type with a subtype."""
    return media.startswith(kind + "/") and len(media) > len(kind) + 1


def decode(url: str, kind: str, error: type) -> bytes:
    """The bytes of a base64 `data:` URL of a `kind` media type; `error` (ImageError, AudioError,
    VideoError: a ValueError) saying what is wrong in one line for any other form."""
    head, _, data = url.partition(",")
    name = f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} data URL"
    if not head.startswith("data:") or not head.endswith(";base64") or not data:
        raise error(f"{name} must be data:<media type>;base64,<data>")
    if not is_type(media_type(url), kind):
        raise error(f"{name}'s media type must be {kind}/..., not {media_type(url) or 'none'}")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise error(f"the {kind} data URL is not valid base64") from None
