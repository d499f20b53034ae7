"""A request's media in its prompt: the image, audio and video parts of chat messages, in the order
the template renders them, each placeholder expanded into its soft tokens, all placed in one pass.

Message parts are as transformers' chat templates take them: images as `formats.vision` says;
audio as `{"type": "audio", "audio": <path, bytes, data URL or samples>}` (`"url"` / `"path"` too;
samples are 16 kHz mono unless the part says `"sampling_rate"`); video as `{"type": "video", "video":
<path, bytes or data URL>}` (or vLLM's `{"type": "video_url", "video_url": {"url": ...}}`). The
template renders each as one `<|image|>` / `<|audio|>` / `<|video|>`; an image becomes `<|image>` +
N x `<|image|>` + `<image|>`, a clip `<|audio>` + N x `<|audio|>` + `<audio|>`, and a video, for each
of its sampled frames (`formats.video`), `mm:ss <|image>` + N x `<|video|>` + `<image|>`, the frames
joined by spaces, as `Gemma4Processor` expands them; each frame goes through the model's image path
at 70 soft tokens. E2B/E4B audio longer than 30 s becomes one block per piece (`audio.segments`:
never cut short); the 12B's raw frames take any length. An image's (and a frame's) soft tokens see
each other on the sliding layers of the 26B, 31B and 12B; audio's stay causal (transformers' token
types: blocks are runs of image and video tokens only). A frame's timestamp is tokenized as text on
its own (transformers tokenizes it with the text around it: the same ids wherever that text ends
with a control token or a character no token joins across, as Gemma's digits are).
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import mlx.core as mx
import numpy as np

from . import audio as audio_io, vision
from .audio import AudioError
from .images import ImageError
from .vision import ImagePart

AUDIO_PART_TYPES = ("audio",)
VIDEO_PART_TYPES = ("video", "video_url")
FRAME_BUDGET = 70  # a video frame's soft tokens (transformers' video processors' default)


class AudioPart(NamedTuple):
    """A clip of a message: its source and, for samples, their rate (None: 16 kHz)."""

    source: Any
    sampling_rate: Optional[int] = None


class VideoPart(NamedTuple):
    """A video of a message: its source (a path, bytes or a data URL)."""

    source: Any


class AudioEncoder:
    """The audio path of one checkpoint: its tower (`loading.Tower`: the E2B/E4B conformer, or the
    12B's frame embedder; read with the first clip), how a clip becomes its input, and its token ids."""

    def __init__(self, tower):
        config = tower.config
        self.tower = tower
        self.unified = config.get("model_type") == "gemma4_unified"  # raw 640-sample frames, no tower
        self.audio_token = int(config.get("audio_token_id", 258881))
        self.boa = int(config.get("boa_token_id", 256000))
        self.eoa = int(config.get("eoa_token_id", config.get("eoa_token_index", 258883)))

    def clips(self, part: AudioPart) -> list[np.ndarray]:
        """A part's audio decoded to 16 kHz mono, in the pieces the model reads (AudioError if unusable)."""
        rate = part.sampling_rate
        if rate is None and isinstance(part.source, np.ndarray):  # samples: at the processor's rate, as transformers
            rate = audio_io.SAMPLE_RATE
        samples = audio_io.load_audio(part.source, rate)
        return [samples] if self.unified else [c for c in audio_io.segments(samples) if self.count(c)]

    def count(self, clip: np.ndarray) -> int:
        """The soft tokens of one clip."""
        return audio_io.unified_tokens(len(clip)) if self.unified else audio_io.audio_tokens(len(clip))

    def soft_tokens(self, clip: np.ndarray) -> mx.array:
        """(count(clip), text hidden) soft tokens of one clip."""
        tower = self.tower.get()
        if self.unified:
            return tower.audio(mx.array(audio_io.unified_frames(clip)[0]))
        features, mask = audio_io.log_mel(clip)
        tokens = tower.soft_tokens(mx.array(features[None]), mx.array(mask[None]))[0]
        if tokens.shape[0] != self.count(clip):  # (the processor's count is what the prompt holds)
            raise AudioError(f"the audio encoder gave {tokens.shape[0]} soft tokens for a clip the processor "
                             f"counts {self.count(clip)}")
        return tokens


def audio_encoder(loaded) -> Optional[AudioEncoder]:
    """The audio path of a `load()`ed model (made once, kept on its tower), or None without one."""
    tower = getattr(loaded, "audio", None)
    if tower is None:
        return None
    if "audio encoder" not in tower.extras:
        tower.extras["audio encoder"] = AudioEncoder(tower)
    return tower.extras["audio encoder"]


def message_media(messages: Optional[Sequence[Mapping]]) -> tuple[list, Optional[list]]:
    """The media of `messages` in the order the template renders them (`vision.ImagePart`s and
    `AudioPart`s), and the messages with each media part bare (`{"type": "image"}`, `{"type":
    "audio"}`; None when there is none: the messages as they are)."""
    sources, out = [], []
    for m in messages or ():
        content = m.get("content") if isinstance(m, Mapping) else None
        if not isinstance(content, (list, tuple)) or not any(_kind(p) for p in content):
            out.append(m)
            continue
        parts = []
        for p in content:
            kind = _kind(p)
            if kind == "image":
                sources.append(ImagePart(vision.image_source(p), vision.part_budget(p)))
            elif kind == "audio":
                sources.append(AudioPart(_audio_source(p), p.get("sampling_rate")))
            elif kind == "video":
                sources.append(VideoPart(_video_source(p)))
            parts.append({"type": kind} if kind else p)
        out.append({**m, "content": parts})
    return sources, (out if sources else None)


def place(loaded, tokens: Sequence[int], sources: Sequence) -> tuple[list, Any]:
    """A rendered prompt's tokens with its lone media placeholders expanded, and the media's soft
    tokens (`gemma4_vision.PromptImages`, computed and evaluated here) placed in them."""
    from ..models.gemma4_vision import PromptImages

    blocks = _blocks(loaded, sources)  # per source: [(text before, open, soft tokens, close, digest, causal)]
    queues = {token: [b for s, b in zip(sources, blocks) if _token(loaded, s) == token] for token in
              {_token(loaded, s) for s in sources}}
    ids, starts, feats, digests, causal = [], [], [], [], []
    for t in tokens:
        if t not in queues:
            ids.append(int(t))
            continue
        if not queues[t]:
            raise ValueError(f"the prompt has more placeholders of token {t} than the media given")
        for before, open_, soft, close, digest, is_causal in queues[t].pop(0):
            ids += before + [open_]
            if soft.shape[0]:
                starts.append(len(ids))
                feats.append(soft)
                digests.append(digest)
                causal.append(is_causal)
            ids += [t] * soft.shape[0] + [close]
    if any(queues.values()):
        raise ValueError("the prompt has fewer media placeholders than the media given")
    mx.eval(feats)  # on this thread: the worker reads them as evaluated arrays
    return ids, PromptImages(tuple(starts), tuple(feats), tuple(digests), tuple(causal))


def count(loaded, sources: Sequence) -> int:
    """The prompt tokens the media add to their placeholders (the placeholders' own aside), from
    their sizes: nothing is encoded."""
    n = 0
    for s in sources:
        if isinstance(s, AudioPart):
            clips = _audio(loaded).clips(s)
            n += sum(_audio(loaded).count(c) + 2 for c in clips) - 1
        elif isinstance(s, VideoPart):
            clip, enc = _video(s), _images(loaded)
            n += sum(len(_frame_text(loaded, i, t)) + enc.process(f, FRAME_BUDGET).tokens + 2
                     for i, (t, f) in enumerate(zip(clip.timestamps, clip.images()))) - 1
        else:
            n += _images(loaded).process(s).tokens + 1  # <|image|> becomes boi, N, eoi
    return n


def _blocks(loaded, sources: Sequence) -> list[list[tuple]]:
    out = []
    for s in sources:
        if isinstance(s, AudioPart):
            enc = _audio(loaded)
            out.append([([], enc.boa, enc.soft_tokens(c), enc.eoa, _digest(c), True) for c in enc.clips(s)])
        elif isinstance(s, VideoPart):
            enc, clip, frames = _images(loaded), _video(s), []
            for i, (stamp, image) in enumerate(zip(clip.timestamps, clip.images())):
                patches = enc.process(image, FRAME_BUDGET)
                frames.append((_frame_text(loaded, i, stamp), enc.boi, enc.soft_tokens(patches), enc.eoi,
                               patches.digest, False))
            out.append(frames)
        else:
            enc = _images(loaded)
            patches = enc.process(s)
            out.append([([], enc.boi, enc.soft_tokens(patches), enc.eoi, patches.digest, False)])
    return out


def _token(loaded, source) -> int:
    if isinstance(source, AudioPart):
        return _audio(loaded).audio_token
    if isinstance(source, VideoPart):
        return int(_images(loaded).config.get("video_token_id", 258884))
    return _images(loaded).image_token


def _video(part: VideoPart):
    from . import video

    return video.load_video(part.source)


def _frame_text(loaded, i: int, stamp: str) -> list[int]:
    """The ids of the text before a frame's `<|image>`: its timestamp (after the space that joins it
    to the frame before)."""
    from .chat import tokenizer_markup

    return tokenizer_markup(loaded.tokenizer).text_ids((" " if i else "") + stamp + " ")


def _images(loaded) -> vision.VisionEncoder:
    found = vision.encoder(loaded)
    if found is None:
        raise ImageError("this model takes no images (its checkpoint has no vision tower)")
    return found


def _audio(loaded) -> AudioEncoder:
    found = audio_encoder(loaded)
    if found is None:
        raise AudioError("this model takes no audio (its checkpoint has no audio tower: E2B, E4B and the 12B "
                         "take audio)")
    return found


def _digest(clip: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(clip, dtype=np.float32).tobytes()).hexdigest()


def _kind(part) -> Optional[str]:
    if not isinstance(part, Mapping):
        return None
    if part.get("type") in vision.IMAGE_PART_TYPES:
        return "image"
    if part.get("type") in VIDEO_PART_TYPES:
        return "video"
    return "audio" if part.get("type") in AUDIO_PART_TYPES else None


def _audio_source(part: Mapping) -> Any:
    for key in ("audio", "url", "path"):
        if part.get(key) is not None:
            return part[key]
    raise AudioError('an audio part is {"type": "audio", "audio": <path, bytes, data URL or samples>}')


def _video_source(part: Mapping) -> Any:
    if part.get("type") == "video_url":
        url = part.get("video_url")
        url = url.get("url") if isinstance(url, Mapping) else url
        if isinstance(url, str):
            return url
    for key in ("video", "url", "path"):
        if part.get(key) is not None:
            return part[key]
    from .video import VideoError

    raise VideoError('a video part is {"type": "video", "video": <path, bytes or data URL>}')
