"""The OpenAI wire format: request bodies in, engine requests and response objects out.

Plain Python with no MLX and no HTTP, so every rule here reads (and tests) on its own.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, Optional, Sequence

from ..engine import Request
from ..sample import SamplingParams
from ..stats import Stats

# OpenAI's newer "developer" role is the system message of older models.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Fields whose meaning we cannot honour: refused unless left at their default, never silently ignored.
UNSUPPORTED = ("n", "best_of", "logprobs", "top_logprobs", "echo", "suffix", "logit_bias", "presence_penalty",
               "frequency_penalty", "tools", "functions", "response_format")
MAX_DRAFT_TOKENS = 16


class APIError(Exception):
    """An error answered as an OpenAI error object with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers or {}
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: Optional[str], message: str, code: Optional[str] = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What the parsers need to know about the model behind the server."""

    id: str
    context: int  # max_position_embeddings: the default (and largest) max_tokens
    vocab_size: int
    draft_tokens: object = "auto"  # the server's default for requests that do not say


@dataclasses.dataclass(frozen=True)
class Job:
    """One parsed request: what the engine runs and how the answer is shaped."""

    object: str  # "chat.completion" or "text_completion"
    request: Request
    stop: tuple
    stream: bool
    include_usage: bool
    model: str
    id: str = ""
    created: int = 0

    @property
    def chat(self) -> bool:
        return self.object == "chat.completion"


# ---- requests ----------------------------------------------------------------------------------


def parse_chat(body: Any, model: ServedModel) -> Job:
    """POST /v1/chat/completions: `messages` are rendered with the model's chat template by the engine."""
    body = _object(body)
    return _job(body, "chat.completion", model, messages=_messages(body.get("messages")))


def parse_completion(body: Any, model: ServedModel) -> Job:
    """POST /v1/completions: `prompt` is text or token ids, continued as they are."""
    body = _object(body)
    return _job(body, "text_completion", model, prompt=_prompt(body.get("prompt"), model.vocab_size))


def check_model(name: Any, model: ServedModel) -> None:
    if name is not None and name != model.id:
        raise APIError(404, f"the model `{name}` does not exist; this server serves `{model.id}`",
                       param="model", code="model_not_found")


def _job(body: dict, kind: str, model: ServedModel, **prompt) -> Job:
    check_model(body.get("model"), model)
    for name in UNSUPPORTED:
        if not _is_default(name, body.get(name)):
            raise invalid(name, f"`{name}` is not supported by this server"
                          + (" (one choice per request)" if name in ("n", "best_of") else ""), "unsupported")
    max_tokens = _integer(body, "max_completion_tokens", low=1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", low=1)
    stream = _flag(body, "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise invalid("stream_options", "`stream_options` must be an object")
    request = Request(
        **prompt, max_tokens=min(max_tokens or model.context, model.context), sampling=_sampling(body),
        draft_tokens=_draft_tokens(body, model.draft_tokens), mtp=_flag(body, "mtp", True), seed=_seed(body),
    )
    prefix = "chatcmpl-" if kind == "chat.completion" else "cmpl-"
    include_usage = stream and _flag(options, "include_usage", False)
    return Job(kind, request, _stop(body.get("stop")), stream, include_usage, model.id,
               prefix + uuid.uuid4().hex[:24], int(time.time()))


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    return body


def _is_default(name: str, value: Any) -> bool:
    if name in ("n", "best_of"):
        return value in (None, 1)
    if name == "response_format":
        return value is None or value == {"type": "text"}
    return not value


def _messages(messages: Any) -> list:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "`messages` must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise invalid(f"messages[{i}]", f"messages[{i}] needs a `role` among {', '.join(ROLES)}")
        out.append({"role": ROLES[message["role"]], "content": _content(message.get("content"), i)})
    return out


def _content(content: Any, i: int) -> str:
    """A message's text: a string, or a list of text parts (images and audio are not supported)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise invalid(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts")


def _prompt(prompt: Any, vocab_size: int):
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise invalid("prompt", f"token ids must be in [0, {vocab_size})")
        return prompt
    raise invalid("prompt", "`prompt` must be one non-empty string or list of token ids")


def _stop(stop: Any) -> tuple:
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop", "`stop` must be a non-empty string or a list of them")
    return tuple(stops)


def _sampling(body: dict) -> SamplingParams:
    top_k = _integer(body, "top_k", low=-1)
    try:
        return SamplingParams(
            temperature=_number(body, "temperature", 1.0, low=0.0),
            top_p=_number(body, "top_p", 1.0, low=0.0, high=1.0),
            top_k=max(top_k or 0, 0),  # -1 (vLLM's "off") and 0 both turn top-k off
            min_p=_number(body, "min_p", 0.0, low=0.0, high=1.0),
        )
    except ValueError as e:  # e.g. top_p = 0
        raise invalid(None, str(e)) from None


def _draft_tokens(body: dict, default):
    value = body.get("draft_tokens")
    if value is None:
        return default
    if value == "auto" or (type(value) is int and 0 <= value <= MAX_DRAFT_TOKENS):
        return value
    raise invalid("draft_tokens", f"`draft_tokens` must be \"auto\" or an integer in [0, {MAX_DRAFT_TOKENS}]")


def _seed(body: dict) -> Optional[int]:
    seed = _integer(body, "seed")
    return None if seed is None else seed % 2**64  # any integer, like OpenAI; MLX keys take uint64


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"`{name}` must be true or false")
    return value


def _integer(body: dict, name: str, low: Optional[int] = None) -> Optional[int]:
    value = body.get(name)
    if value is not None and type(value) is not int:
        raise invalid(name, f"`{name}` must be an integer")
    if value is not None and low is not None and value < low:
        raise invalid(name, f"`{name}` must be >= {low}, got {value}")
    return value


def _number(body: dict, name: str, default: float, low: float, high: Optional[float] = None) -> float:
    value = body.get(name)
    if value is None:
        return default
    if type(value) not in (int, float) or value < low or (high is not None and value > high):
        limits = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise invalid(name, f"`{name}` must be a number {limits}, got {value!r}")
    return float(value)


# ---- answers -----------------------------------------------------------------------------------


def usage(stats: Optional[Stats], completion_tokens: int) -> dict:
    """OpenAI's usage: the whole prompt, of which `cached_tokens` came from the prefix cache."""
    cached = stats.cached_tokens if stats else 0
    prompt_tokens = stats.prompt_tokens + cached if stats else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def timings(stats: Stats) -> dict:
    """llama.cpp's `timings`: the engine's work on this request, speculative counts included.
    `prompt_n` counts the prompt tokens prefilled, `cache_n` those restored from the prefix cache;
    `predicted_per_second` counts the tokens after the first (which comes out of the prefill)."""
    prompt_ms, predicted_ms = stats.prompt_seconds * 1000, stats.decode_seconds * 1000
    return {
        "cache_n": stats.cached_tokens, "prompt_n": stats.prompt_tokens, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / stats.prompt_tokens if stats.prompt_tokens else 0.0,
        "prompt_per_second": stats.prompt_tps,
        "predicted_n": stats.emitted, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": 1000 / stats.decode_tps if stats.decode_tps else 0.0,
        "predicted_per_second": stats.decode_tps,
        "draft_n": stats.drafted, "draft_n_accepted": stats.accepted,
    }


def response(job: Job, text: str, finish_reason: str, usage: dict, timings: dict) -> dict:
    if job.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {**_head(job, job.object), "choices": [choice], "usage": usage, "timings": timings}


def chunk(job: Job, text: Optional[str] = None, finish_reason: Optional[str] = None, first: bool = False,
          **extra) -> dict:
    """One streamed piece; a chat stream's first chunk carries the role."""
    if job.chat:
        delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**_head(job, "chat.completion.chunk"), "choices": [choice], **extra}
    choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    return {**_head(job, "text_completion"), "choices": [choice], **extra}


def usage_chunk(job: Job, usage: dict) -> dict:
    """The extra last chunk that `stream_options.include_usage` asks for."""
    return {**_head(job, "chat.completion.chunk" if job.chat else "text_completion"), "choices": [],
            "usage": usage}


def _head(job: Job, kind: str) -> dict:
    return {"id": job.id, "object": kind, "created": job.created, "model": job.model}


class StopMatcher:
    """Cuts streamed text at the first stop string. A tail that could still grow into a stop
    string is held back, so text past a stop string is never sent, even when the string is
    split across tokens."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.pending = ""
        self.hit = False

    def feed(self, text: str) -> str:
        """Add streamed text; returns what is safe to send now (`hit` is set at a stop string)."""
        self.pending += text
        found = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit = True
            out, self.pending = self.pending[: min(found)], ""
            return out
        safe = len(self.pending) - self._partial()
        out, self.pending = self.pending[:safe], self.pending[safe:]
        return out

    def flush(self) -> str:
        """The held-back text, once the stream ended without completing a stop string."""
        out, self.pending = self.pending, ""
        return out

    def _partial(self) -> int:
        """Length of the longest tail of `pending` that starts some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:n]):
                    best = n
                    break
        return best
