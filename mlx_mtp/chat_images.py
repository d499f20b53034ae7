"""The terminal chat once an image, a recording or a video is in it (`/image PATH`, `--image PATH`,
`/audio PATH`, `--audio PATH`, `/video PATH`, `--video PATH`).

An engine conversation takes text turns; a chat with media sends, each turn, one request with the
whole conversation as messages (each image or clip a part of the message it came with). The prefix
cache restores what the turns before computed, media by their content, so a turn prefills only what
is new, as a conversation's does.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

from .formats.chat import Reply
from .formats.images import ImageError
from .engine.requests import Request, TokenEvent
from .decode.stats import Stats


class ImageChat:
    """What the chat's REPL uses of a `Conversation` (reply, reset, cached_tokens, last_stats,
    enable_thinking), for a conversation with images or audio.

    Args:
        engine: the chat's engine.
        messages: the conversation so far (a `Conversation`'s messages, its system message first).
        enable_thinking: the template's switch for reasoning before the answer.
        keep_thinking: earlier replies keep their reasoning in later prompts (`Request.keep_thinking`).
    """

    def __init__(self, engine, messages: Sequence[dict] = (), enable_thinking: bool = False,
                 keep_thinking: bool = False):
        self.engine, self.loaded = engine, engine.loaded
        self.enable_thinking, self.keep_thinking = enable_thinking, keep_thinking
        self.messages = [dict(m) for m in messages]
        self._start = [m for m in self.messages if m.get("role") == "system"]
        self.tokens: list[int] = []
        self.last_stats: Optional[Stats] = None

    def reply(self, text: str, max_tokens: int = 256, images: Sequence = (), media: Sequence = (),
              **options) -> Iterator[TokenEvent]:
        """Add a user message (with `images`: paths, bytes or PIL images, and `media`: image and audio
        parts, before its text) and stream the reply, which joins the conversation as streamed."""
        content = [{"type": "image", "image": i} for i in images] + list(media) + [{"type": "text", "text": text}]
        messages = [*self.messages, {"role": "user", "content": content}]
        request = Request(messages=messages, max_tokens=max_tokens, enable_thinking=self.enable_thinking,
                          keep_thinking=self.keep_thinking, **options)
        handle = self.engine.submit(request)
        self.messages, self.last_stats = messages, handle.stats
        self.tokens = handle.prompt_keys  # as the prefix cache keys them (an image by its content)
        return self._stream(handle)

    def _stream(self, handle) -> Iterator[TokenEvent]:
        reply = Reply()
        try:
            for event in handle.tokens():
                self.tokens.append(event.token)
                reply.add(p for p in event.parts if p.kind != "tool_call")
                yield event
            self.last_stats = handle.done.stats
        finally:
            self.messages.append(reply.message())  # its reasoning too: the engine leaves it out where it goes

    def cached_tokens(self) -> int:
        return self.engine.cached(self.tokens)

    def reset(self) -> None:
        """Forget every turn (the system message stays)."""
        self.messages, self.tokens, self.last_stats = [dict(m) for m in self._start], [], None


def check_image(path: str) -> str:
    """`path` if it is an image file the encoder can read (ImageError saying why not)."""
    from .formats.images import open_image

    open_image(path)
    return path


def check_media(loaded, path: str, kind: str) -> dict:
    """The message part of the image or audio file at `path`, if the model takes it and the file
    reads (ImageError or AudioError saying why not)."""
    if kind in ("image", "video") and loaded.vision is None:
        raise ImageError(f"this model takes no {kind}s (its checkpoint has no vision tower)")
    if kind == "image":
        return {"type": "image", "image": check_image(path)}
    if kind == "video":
        from .formats.video import load_video

        load_video(path)  # (VideoError now, not with the message)
        return {"type": "video", "video": path}
    from .formats.audio import AudioError, load_audio

    if loaded.audio is None:
        raise AudioError("this model takes no audio (its checkpoint has no audio tower: E2B, E4B and the 12B take audio)")
    load_audio(path)
    return {"type": "audio", "audio": path}
