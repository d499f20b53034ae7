"""Video in, as Gemma 4's video processors take it: decoded with PyAV, frames sampled and
timestamped, each frame then an image for the model's own image path. numpy and PyAV (the optional
`video` extra: pip install 'mlx-mtp[video]'); no torch.

Sampling, timestamps and the prompt are those of transformers' (5.23) `Gemma4VideoProcessor` (E2B,
E4B, 26B, 31B) and `Gemma4UnifiedVideoProcessor` (the 12B), which agree on all three, and of their
processors' `replace_video_token`:

* a clip of T frames gives frames `arange(n) * T // n`, n = 32 (`num_frames`); or, sampled at
  `sample_fps` frames a second, n = max(1, int(T / fps * sample_fps)) (a processor made with
  `num_frames=None, fps=...`: with the released config a per-call `fps=` is ignored);
* frame i's timestamp is `mm:ss` of i / fps seconds, both truncated (`00:00` up to frame 29 of a
  30 fps clip; the minutes go on past 59: `61:05`);
* the template's `<|video|>` becomes, frame after frame joined by spaces,
  `mm:ss <|image>` + N x `<|video|>` + `<image|>`, N the soft tokens of one frame at the video budget
  of 70 (`max_soft_tokens`) by the image rule: 63 for 4:3, 66 for 16:9, 70 at most.

Decoding follows transformers' default decoder (torchcodec, `seek_mode="exact"`), which reads the
whole stream first: T is the number of packets in the video stream, fps is T over the time from the
first packet's timestamp to the end of the last, frame k is the k-th frame shown, turned upright by
the stream's display rotation, RGB as FFmpeg's `rgb24`. That fps is not quite the header's
`average_rate`, which transformers' other decoder (`read_video_pyav`) takes along with the header's
frame count (0 in MKV and WebM files). The two agree on a constant-rate stream up to rounding.
Every packet must decode to a frame, or the video is refused as corrupt. On an MP4 whose video
starts after 0 s, FFmpeg 5.1 (under torchcodec here) and 8.1 (in PyAV's wheel) read the last
packet's duration differently: the same T, but fps can differ (by 0.5 % on a 40-frame test clip).

Each frame is then an image: `Video.images()` gives them for `images.process(image, budget=70)` on
the E2B/E4B/26B/31B. The 12B's video processor takes the same frames into its own image path
(48-pixel patches), with the same N; the rescale to [0, 1] is the image path's, exactly.

Where mlx_mtp differs from transformers:

* Short clips. transformers refuses a clip with fewer frames than it samples (T = 31 raises a
  ValueError, as does a `sample_fps` above the clip's rate); mlx_mtp takes every frame
  (n = min(n, T): the same rule at n = T), so a 1 s clip is a prompt, not an error.
* Resizing. transformers resizes video frames with torchvision's antialiased bicubic on uint8, and
  `images.process` uses Pillow's bicubic. They differ by at most 2 in 0.32 % of the values on the
  test clip's 32 frames (32x24 up to 432x336) and in 0.21 % on a 640x480 clip (down to 432x336) on
  x86 (tests/fixtures/video/video.json, `resize`).
* Limits. A clip is refused, in one line, when it is longer than `MAX_SECONDS` (10 minutes) or
  `MAX_FRAMES` (36,000), when a frame is over `MAX_PIXELS` (4K UHD), or when the sampled frames
  would take over `MAX_SAMPLED_BYTES` (1 GiB). transformers takes anything.
* No frame rate is guessed: an array of frames needs its fps (transformers falls back to 24).
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import dataurl

NUM_FRAMES = 32  # frames sampled from a clip (the processors' num_frames)
FRAME_BUDGET = 70  # soft tokens a frame may take (the processors' max_soft_tokens)
MAX_SECONDS = 600  # longer clips are refused while they are scanned
MAX_FRAMES = 36_000  # 600 s at 60 fps: a scan stops here whatever the timestamps say
MAX_PIXELS = 3840 * 2160  # a frame's pixels (4K UHD)
MAX_SAMPLED_BYTES = 1 << 30  # the sampled frames' RGB bytes
BOI, EOI, VIDEO_TOKEN = "<|image>", "<image|>", "<|video|>"  # a frame's delimiters and its placeholder


class VideoError(ValueError):
    """Video that cannot be read or used (the message says why, in one line)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Video:
    """The frames sampled from one clip, in order, and where in the clip they come from."""

    frames: np.ndarray  # (n, height, width, 3) uint8 RGB, upright
    indices: np.ndarray  # (n,) int64: each frame's index in the clip
    total: int  # frames in the clip (T)
    fps: float  # the clip's frame rate

    @property
    def timestamps(self) -> list[str]:
        """Each frame's `mm:ss` (its index / fps, truncated)."""
        return [timestamp(int(i) / self.fps) for i in self.indices]

    def images(self) -> list:
        """The frames as PIL images, for the model's image path (`images.process(image, budget=70)`)."""
        from PIL import Image

        return [Image.fromarray(frame) for frame in self.frames]

    def tokens(self, budget: int = FRAME_BUDGET) -> int:
        """Soft tokens each frame takes (the frames of a clip share one size)."""
        from .images import BUDGETS, soft_tokens

        if budget not in BUDGETS:
            raise VideoError(f"a frame's token budget must be one of {', '.join(map(str, BUDGETS))}, "
                             f"not {budget}")
        return soft_tokens(self.frames.shape[1], self.frames.shape[2], budget)

    def prompt(self, budget: int = FRAME_BUDGET) -> str:
        """What the template's `<|video|>` becomes for this clip (see `prompt_text`)."""
        return prompt_text(self.timestamps, self.tokens(budget))


VideoSource = str | Path | bytes | bytearray | memoryview


def load_video(source: VideoSource, num_frames: int | None = NUM_FRAMES,
               sample_fps: float | None = None) -> Video:
    """Decode a clip and sample its frames (`sample_indices`), from a path, the bytes of a file or a
    `data:video/...;base64,` URL; any container and codec FFmpeg reads (MP4, MOV, WebM, MKV, AVI,
    animated GIF, ...). Needs PyAV. Raises VideoError for anything that is not a usable video: not a
    video, a still image, no video stream, corrupt or truncated, no frames, over the limits."""
    av = _pyav()
    data, name = _read(source)
    with _open(av, data, name) as container:
        total, fps = _scan(av, container, _video_stream(av, container, name), name)
    indices = sample_indices(total, fps, num_frames, sample_fps)
    with _open(av, data, name) as container:
        frames = _decode(av, container, _video_stream(av, container, name), indices, total, name)
    return Video(frames, indices, total, fps)


def from_frames(frames: np.ndarray, fps: float, num_frames: int | None = NUM_FRAMES,
                sample_fps: float | None = None) -> Video:
    """Sample frames decoded elsewhere: (T, height, width, 3) uint8 RGB, shown at `fps` a second."""
    is_rgb = isinstance(frames, np.ndarray) and frames.ndim == 4 and frames.shape[-1] == 3
    if not is_rgb or frames.dtype != np.uint8:
        what = f"{frames.dtype} {frames.shape}" if isinstance(frames, np.ndarray) else type(frames).__name__
        raise VideoError(f"video frames are a (frames, height, width, 3) uint8 RGB array, not {what}")
    _check_frame_size(frames.shape[2], frames.shape[1], "the video")
    indices = sample_indices(len(frames), fps, num_frames, sample_fps)
    return Video(frames[indices], indices, len(frames), float(fps))


def sample_indices(total: int, fps: float, num_frames: int | None = NUM_FRAMES,
                   sample_fps: float | None = None) -> np.ndarray:
    """Indices (n,) int64 of the frames taken from a clip of `total` frames at `fps`: `num_frames`
    spread evenly, or `sample_fps` frames a second (`num_frames=None`); every frame when the clip has
    fewer (where transformers raises)."""
    if (num_frames is None) == (sample_fps is None):
        raise VideoError("sample a video by num_frames or by sample_fps: one of the two")
    if not _positive(fps):
        raise VideoError(f"a video's fps must be a positive number, not {fps!r}")
    if total < 1:
        raise VideoError("the video holds no frames")
    if sample_fps is not None:
        if not _positive(sample_fps):
            raise VideoError(f"sample_fps must be a positive number, not {sample_fps!r}")
        num_frames = max(1, int(total / fps * sample_fps))
    elif isinstance(num_frames, bool) or not isinstance(num_frames, (int, np.integer)) or num_frames < 1:
        raise VideoError(f"num_frames must be a whole number of at least 1, not {num_frames!r}")
    n = min(int(num_frames), total)
    return np.arange(n, dtype=np.int64) * total // n


def timestamp(seconds: float) -> str:
    """`mm:ss`, both truncated, as transformers writes a frame's time: 61.9 -> `01:01`."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def prompt_text(timestamps: Sequence[str], tokens: int) -> str:
    """The text one `<|video|>` of the template becomes: for each frame `mm:ss <|image>`, `tokens`
    `<|video|>` placeholders and `<image|>`, the frames joined by single spaces."""
    return " ".join(f"{t} {BOI}{VIDEO_TOKEN * tokens}{EOI}" for t in timestamps)


def decode_data_url(url: str) -> bytes:
    """The bytes of a `data:video/<type>;base64,<data>` URL (VideoError for any other form)."""
    return dataurl.decode(url, "video", VideoError)


def _pyav():
    try:
        import av
    except ImportError:
        raise VideoError("video needs PyAV: pip install 'mlx-mtp[video]'") from None
    return av


def _positive(value) -> bool:
    return (isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def _read(source) -> tuple[Any, str]:
    """What `av.open` reads (a path, or bytes for a fresh BytesIO each time) and the source's name."""
    if isinstance(source, str) and source.startswith("data:"):
        return decode_data_url(source), "the video file"
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        raise VideoError("video URLs are not fetched: send the video as base64 data")
    if isinstance(source, (bytes, bytearray, memoryview)):
        if not len(source):
            raise VideoError("the video file is empty")
        return bytes(source), "the video file"
    if isinstance(source, (str, Path)):
        if not Path(source).is_file():
            raise VideoError(f"no video file at {str(source)[:200]}")
        return str(source), str(source)[:200]
    raise VideoError(f"a video is a path, bytes or a data URL, not {type(source).__name__}")


def _open(av, data, name: str):
    try:
        return av.open(io.BytesIO(data) if isinstance(data, bytes) else data, metadata_errors="ignore")
    except av.error.FFmpegError as e:
        raise VideoError(f"{name} is not a video FFmpeg can read ({_reason(e)})") from None
    except OSError as e:
        raise VideoError(f"cannot read {name} ({e.strerror or e})") from None


def _video_stream(av, container, name: str):
    """The first video stream that is not a cover picture."""
    fmt = container.format.name
    if fmt == "image2" or fmt.endswith("_pipe"):  # FFmpeg's demuxers of single images
        raise VideoError(f"{name} is a still image ({fmt.removesuffix('_pipe')}), not a video: "
                         "send it as an image")
    streams = [s for s in container.streams.video if not s.disposition & av.stream.Disposition.attached_pic]
    if not streams:
        kinds = ", ".join(sorted({s.type for s in container.streams})) or "nothing"
        raise VideoError(f"{name} has no video stream (it holds {kinds})")
    _check_frame_size(streams[0].codec_context.width, streams[0].codec_context.height, name)
    return streams[0]


def _check_frame_size(width: int, height: int, name: str) -> None:
    if width < 1 or height < 1:
        raise VideoError(f"{name}'s frames are {width}x{height} pixels: empty")
    if width * height > MAX_PIXELS:
        raise VideoError(f"{name}'s frames are {width}x{height} pixels; a frame is taken up to "
                         f"{MAX_PIXELS / 1e6:.1f} MP")


def _scan(av, container, stream, name: str) -> tuple[int, float]:
    """(T, fps) from the stream's packets, as torchcodec's exact mode counts them (see the module
    docstring); stops, refusing the clip, once it is over MAX_SECONDS or MAX_FRAMES."""
    base = stream.time_base
    total, first, end = 0, None, None
    try:
        for packet in container.demux(stream):
            if (packet.dts is None and packet.size == 0) or packet.is_discard:  # PyAV's empty last packet
                continue
            total += 1
            t = packet.pts if packet.pts is not None else packet.dts
            if t is not None:
                first = t if first is None else min(first, t)
                end = max(t if end is None else end, t + (packet.duration or 0))
            if total > MAX_FRAMES or (base and end is not None and _seconds(end - first, base) > MAX_SECONDS):
                raise VideoError(_too_long(name))
    except av.error.FFmpegError as e:
        raise VideoError(f"{name} is corrupt or truncated ({_reason(e)})") from None
    if total == 0:
        raise VideoError(f"{name} holds no video frames (empty or truncated)")
    span = _seconds(end, base) - _seconds(first, base) if base and end is not None else 0.0
    if span > 0:
        fps = total / span
    else:  # one frame with no duration, or no timestamps at all: the header's rate
        rate = stream.average_rate or stream.guessed_rate
        if not rate:
            raise VideoError(f"{name} has no frame rate: its frames carry no timestamps")
        fps = float(rate)
    if total / fps > MAX_SECONDS:
        raise VideoError(_too_long(name))
    return total, fps


def _seconds(pts: int, base) -> float:
    """A timestamp in seconds as torchcodec's pts_to_seconds has it: pts * num / den, rounded once."""
    return pts * base.numerator / base.denominator


def _too_long(name: str) -> str:
    return f"{name} is longer than {MAX_SECONDS} s or {MAX_FRAMES:,} frames: a video is taken up to that"


def _decode(av, container, stream, indices: np.ndarray, total: int, name: str) -> np.ndarray:
    """The frames at `indices` (increasing), decoding the whole stream to check it holds `total`."""
    width, height = stream.codec_context.width, stream.codec_context.height
    if len(indices) * width * height * 3 > MAX_SAMPLED_BYTES:
        raise VideoError(f"{len(indices)} frames of {width}x{height} take over "
                         f"{MAX_SAMPLED_BYTES / 2**30:g} GiB: sample fewer frames")
    stream.thread_type = "AUTO"
    wanted = iter(indices.tolist())
    target, frames, k = next(wanted), [], 0
    try:
        for frame in container.decode(stream):
            if k == target:
                frames.append(_upright(frame.to_ndarray(format="rgb24"), frame.rotation))
                target = next(wanted, None)
            k += 1
    except av.error.FFmpegError as e:
        raise VideoError(f"{name} is corrupt or truncated ({_reason(e)})") from None
    if k != total:
        raise VideoError(f"{name} is corrupt: {k} of its {total} frames decode")
    sizes = sorted({f"{f.shape[1]}x{f.shape[0]}" for f in frames})
    if len(sizes) > 1:
        raise VideoError(f"{name} changes frame size midway ({', '.join(sizes)})")
    return np.stack(frames)


def _upright(rgb: np.ndarray, rotation: float) -> np.ndarray:
    """A frame turned as its display matrix says (degrees counter-clockwise, multiples of 90)."""
    quarters = round(rotation / 90)
    if quarters % 4 == 0 or quarters * 90 != rotation:
        return rgb
    return np.ascontiguousarray(np.rot90(rgb, quarters))


def _reason(error) -> str:
    text = getattr(error, "strerror", None) or str(error) or type(error).__name__
    return text.splitlines()[0]
