"""The OpenAI wire format: request bodies in, engine requests and response objects out.

Plain Python with no MLX and no HTTP, so every rule here reads (and tests) on its own. What a
chat means (templates, tool calls, reasoning) is `chat_format`'s; this module maps OpenAI's
shapes onto it: `tools` / `tool_choice` / `parallel_tool_calls`, histories with assistant
`tool_calls` (JSON-string arguments) and `role: "tool"` results, `chat_template_kwargs`, and
answers with `reasoning_content` and `tool_calls` (llama.cpp's and vLLM's field names). Output
constraints (`response_format`, a forced `tool_choice`, vLLM's `structured_outputs`), penalties,
`logit_bias` and `logprobs` become the engine request's grammar, penalties and logprobs.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator, Optional

from ..formats import chat as chat_format
from ..formats.chat import Delta, Reply, ToolCall
from ..formats.images import is_image_type, media_type
from ..decode.grammar import Grammar
from ..decode.processors import MAX_LOGPROBS, Penalties
from ..engine.requests import ContextLengthError, Request, TokenLogprob
from ..decode.stats import Stats
from .common import (APIError, Job, Outcome, ServedModel, check_model, checked, draft_tokens, flag,
                     forced_calls, history, integer, invalid, json_grammar, mapping, number, sampling, strings,
                     structured, typed, unsupported)
from .fields import (HISTORY_EXTENSIONS, OPENAI_CALL, OPENAI_CHAT, OPENAI_COMPLETION, OPENAI_EXTENSIONS,
                     OPENAI_FUNCTION, OPENAI_MESSAGE, OPENAI_PART, OPENAI_TOOL, OPENAI_TOOL_FUNCTION, extra,
                     first_extra)

__all__ = ["APIError", "OpenAIJob", "ServedModel", "check_model", "invalid", "parse_chat", "parse_completion",
           "response", "stream"]
MEDIA_PARTS = ("image_url", "input_audio", "video_url")  # content parts beside text in user and system messages
AUDIO_FORMATS = ("wav", "mp3")  # OpenAI's input_audio formats

# OpenAI's newer "developer" role is the system message of older models.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# Fields whose meaning we cannot honour: refused unless left at their default, never silently ignored.
UNSUPPORTED = ("n", "best_of", "echo", "suffix", "functions", "function_call", "audio", "prediction",
               "web_search_options")
# Which fields are known (any other is refused, as OpenAI refuses it): `fields`.


@dataclasses.dataclass(frozen=True)
class OpenAIJob(Job):
    """A parsed OpenAI request (`common.Job`) and what shapes its answer."""

    object: str = "chat.completion"  # or "text_completion"
    include_usage: bool = False
    created: int = 0

    @property
    def chat(self) -> bool:
        return self.object == "chat.completion"


# ---- requests ----------------------------------------------------------------------------------


def parse_chat(body: Any, model: ServedModel) -> OpenAIJob:
    """POST /v1/chat/completions: `messages` (and `tools`) are rendered with the model's chat
    template by the engine."""
    body = _object(body)
    _known(body, OPENAI_CHAT | OPENAI_EXTENSIONS | HISTORY_EXTENSIONS | {"chat_template_kwargs"})
    options = mapping(body, "chat_template_kwargs")
    thinking = options.pop("enable_thinking", model.thinking)
    if not isinstance(thinking, bool):
        raise invalid("chat_template_kwargs", "`chat_template_kwargs.enable_thinking` must be true or false")
    tools, forced = _tools(body, model)
    return _job(body, "chat.completion", model, forced, messages=_messages(body.get("messages")), tools=tools,
                allow_tool_calls=body.get("tool_choice") != "none", enable_thinking=thinking,
                chat_template_kwargs=options or None, **history(body, model))


def parse_completion(body: Any, model: ServedModel) -> OpenAIJob:
    """POST /v1/completions: `prompt` is text or token ids, continued as they are."""
    body = _object(body)
    _known(body, OPENAI_COMPLETION | OPENAI_EXTENSIONS)
    return _job(body, "text_completion", model, prompt=_prompt(body.get("prompt"), model.vocab_size))


def _job(body: dict, kind: str, model: ServedModel, forced: Optional[Grammar] = None,
         **prompt) -> OpenAIJob:
    check_model(body.get("model"), model)
    for name in UNSUPPORTED:
        if not _is_default(name, body.get(name)):
            raise unsupported(name, f"`{name}` is not supported by this server"
                              + (" (one choice per request)" if name in ("n", "best_of") else ""))
    max_tokens = _max_tokens(body, model)
    stream = flag(body, "stream", False)
    options = mapping(body, "stream_options")
    for name, of in (("user", str), ("metadata", dict), ("store", bool), ("service_tier", str),
                     ("reasoning_effort", str), ("verbosity", str), ("prompt_cache_key", str),
                     ("prompt_cache_retention", str), ("safety_identifier", str), ("modalities", list)):
        typed(body, name, of)  # fields with no use here, checked as OpenAI checks them
    if body.get("modalities") not in (None, ["text"]):
        raise unsupported("modalities", "this server answers with text only (`modalities: [\"text\"]`)")
    request = Request(
        **prompt, max_tokens=max_tokens or model.context, sampling=sampling(body, 2.0),
        draft_tokens=draft_tokens(body, model.draft_tokens), mtp=flag(body, "mtp", True), seed=_seed(body),
        penalties=_penalties(body, model.vocab_size), grammar=structured(body, _response_format(body), forced),
        logprobs=_logprobs(body, kind), stop=strings(body, "stop"),
        parallel_tool_calls=flag(body, "parallel_tool_calls", True),
    )
    prefix = "chatcmpl-" if kind == "chat.completion" else "cmpl-"
    include_usage = stream and flag(options, "include_usage", False)
    job_id = prefix + uuid.uuid4().hex[:24]
    return OpenAIJob(request, stream, model.id, job_id, kind, include_usage, int(time.time()))


def _max_tokens(body: dict, model: ServedModel) -> Optional[int]:
    """`max_completion_tokens` (or the older `max_tokens`; None: up to the context), refused in OpenAI's
    words past the model's context, which no reply can outgrow. One within it that only passes the
    context with the prompt is cut there (finish_reason "length")."""
    found = None
    for name in ("max_tokens", "max_completion_tokens"):
        value = integer(body, name, low=1)
        if value is not None and value > model.context:
            raise invalid(name, f"{name} is too large: {value}. This model supports at most {model.context} "
                                f"completion tokens, whereas you provided {value}.")
        found = value if value is not None else found
    return found


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    return body


def _known(body: dict, fields: frozenset) -> None:
    """Every field a known one (`fields`): OpenAI's words for those that are not, at the top of
    the request and inside its messages, content parts, tool calls and tools."""
    unknown = extra(body, fields)
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        raise APIError(400, f"Unrecognized request argument{plural} supplied: {', '.join(unknown)}")
    messages, tools = body.get("messages"), body.get("tools")
    checks = [(f"tools.[{i}]", tool, OPENAI_TOOL) for i, tool in enumerate(_list(tools))]
    checks += [(f"tools.[{i}].function", tool.get("function"), OPENAI_TOOL_FUNCTION)
               for i, tool in enumerate(_list(tools)) if isinstance(tool, dict)]
    for i, message in enumerate(_list(messages)):
        if not isinstance(message, dict) or message.get("role") not in OPENAI_MESSAGE:
            continue  # refused for its role by `_messages`
        checks.append((f"messages.[{i}]", message, OPENAI_MESSAGE[message["role"]]))
        checks += [(f"messages.[{i}].content.[{j}]", part, OPENAI_PART[part.get("type")])
                   for j, part in enumerate(_list(message.get("content")))
                   if isinstance(part, dict) and part.get("type") in OPENAI_PART]  # other types: `_content`'s
        for j, call in enumerate(_list(message.get("tool_calls"))):
            checks.append((f"messages.[{i}].tool_calls.[{j}]", call, OPENAI_CALL))
            if isinstance(call, dict):
                checks.append((f"messages.[{i}].tool_calls.[{j}].function", call.get("function"), OPENAI_FUNCTION))
    where = first_extra(checks)
    if where is not None:  # OpenAI's words for a field its schema does not have
        at, _, name = where.rpartition(".")
        raise APIError(400, f"Additional properties are not allowed ('{name}' was unexpected) - '{at}'",
                       param=at, code=None)


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _is_default(name: str, value: Any) -> bool:
    if name in ("n", "best_of"):
        return value in (None, 1)
    return not value


def _tools(body: dict, model: ServedModel) -> tuple[Optional[list], Optional[Grammar]]:
    """The tools declared (under `tool_choice: "none"` too, as OpenAI keeps them; the model just
    cannot call them), and the grammar of a call `tool_choice` forces ("required", or a named
    function)."""
    choice = body.get("tool_choice")
    named = isinstance(choice, dict)
    if choice not in (None, "auto", "none", "required") and not named:
        raise invalid("tool_choice", '`tool_choice` must be "auto", "none", "required" or a function')
    tools = body.get("tools")
    checked("tools", chat_format.check_tools, tools)
    tools = list(tools) if tools else None
    if choice != "required" and not named:
        return tools, None
    name = None
    if named:
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise invalid("tool_choice", '`tool_choice` names a function as {"type": "function", "function": '
                                         '{"name": ...}}')
    return tools, forced_calls(tools, name, flag(body, "parallel_tool_calls", True), model)


def _response_format(body: dict) -> Optional[Grammar]:
    """`response_format`: "text", "json_object" (any JSON object) or "json_schema"."""
    fmt = mapping(body, "response_format")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json()
    if kind == "json_schema":
        return json_grammar(mapping(fmt, "json_schema").get("schema"), "response_format.json_schema.schema")
    raise invalid("response_format", '`response_format.type` must be "text", "json_object" or "json_schema"')


def _penalties(body: dict, vocab_size: int) -> Penalties:
    """presence_penalty and frequency_penalty (-2..2), repetition_penalty (vLLM's: > 0) and
    logit_bias ({token id: -100..100})."""
    bias = mapping(body, "logit_bias")
    pairs = []
    for token, value in bias.items():
        if not (isinstance(token, str) and token.isdigit() and int(token) < vocab_size) \
                or type(value) not in (int, float) or not -100 <= value <= 100:
            raise invalid("logit_bias", f"`logit_bias` maps token ids (0..{vocab_size - 1}) to numbers in [-100, 100]")
        pairs.append((int(token), float(value)))
    repetition = number(body, "repetition_penalty", 1.0, low=0.0)
    if repetition <= 0:
        raise invalid("repetition_penalty", "`repetition_penalty` must be > 0")
    return Penalties(number(body, "presence_penalty", 0.0, low=-2.0, high=2.0),
                     number(body, "frequency_penalty", 0.0, low=-2.0, high=2.0), repetition, tuple(pairs))


def _logprobs(body: dict, kind: str) -> Optional[int]:
    """How many alternatives each token's log-probability comes with (None: no log-probabilities):
    chat's `logprobs` (true / false) with `top_logprobs`, completions' `logprobs` (a count)."""
    if kind != "chat.completion":
        return integer(body, "logprobs", low=0, high=MAX_LOGPROBS)
    top = integer(body, "top_logprobs", low=0, high=MAX_LOGPROBS)
    if not flag(body, "logprobs", False):
        if top is not None:
            raise invalid("top_logprobs", "`top_logprobs` needs `logprobs: true`")
        return None
    return top or 0


def _messages(messages: Any) -> list:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "`messages` must be a non-empty list")
    names: dict = {}  # tool call id -> function name, for the results that answer them
    asked: set = set()  # the call ids of the last assistant message, which tool results answer
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise invalid(f"messages[{i}]", f"messages[{i}] needs a `role` among {', '.join(ROLES)}")
        role = ROLES[message["role"]]
        content = message.get("content")
        images = role in ("user", "system")
        m = {"role": role, "content": _media_content(content, i) if images and _has_media(content)
             else _content(content, i, optional=role == "assistant", images=images)}
        if role == "assistant":
            m.update(_history_calls(message, i, names))
            asked = {call["id"] for call in m.get("tool_calls", ())}
        elif role == "tool":
            m.update(_tool_result(message, i, names, asked))
        out.append(m)
    return out


def _content(content: Any, i: int, optional: bool = False, images: bool = False) -> Optional[str]:
    """A message's text: a string, or a list of text parts (`images`: a user or system message, whose
    image_url and input_audio parts `_media_content` takes; files are not supported)."""
    if isinstance(content, str) or (content is None and optional):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    parts = "text, image_url, input_audio and video_url parts" if images else "text parts"
    raise invalid(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of {parts}")


def _has_media(content: Any) -> bool:
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in MEDIA_PARTS for p in content)


def _media_content(content: list, i: int) -> list:
    """A user message's text, `image_url` (a data URL, or http(s) where the server fetches them) and
    `input_audio` parts, as chat templates take them (`mlx_mtp.formats.media`)."""
    parts = []
    for j, p in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if not isinstance(p, dict) or p.get("type") not in ("text", *MEDIA_PARTS):
            raise invalid(where, f"{where} must be a text, an image_url, an input_audio or a video_url part")
        if p["type"] == "text":
            if not isinstance(p.get("text"), str):
                raise invalid(where, f"{where}.text must be a string")
            parts.append({"type": "text", "text": p["text"]})
            continue
        if p["type"] == "input_audio":
            parts.append(_input_audio(p, where))
            continue
        if p["type"] == "video_url":
            parts.append(_video_url(p, where))
            continue
        url = p.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or not url:
            raise invalid(where, f'{where} must be {{"type": "image_url", "image_url": {{"url": ...}}}}')
        if url.startswith("data:") and not is_image_type(media_type(url)):  # OpenAI's words
            raise APIError(400, "Invalid MIME type. Only image types are supported.",
                           code="invalid_image_format")
        detail = p["image_url"].get("detail") if isinstance(p.get("image_url"), dict) else None
        parts.append({"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}})
    return parts


def _input_audio(part: dict, where: str) -> dict:
    """OpenAI's `{"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav" | "mp3"}}`
    as an audio part of the clip's bytes."""
    clip = part.get("input_audio")
    if not isinstance(clip, dict) or not isinstance(clip.get("data"), str):
        raise invalid(where, f'{where} must be {{"type": "input_audio", "input_audio": {{"data": <base64>, '
                             f'"format": "wav" or "mp3"}}}}')
    if clip.get("format") not in AUDIO_FORMATS:
        raise invalid(f"{where}.input_audio.format", f"Invalid value: {clip.get('format')!r}. Supported values "
                                                    f"are: 'wav' and 'mp3'.")
    try:
        data = base64.b64decode(clip["data"], validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"{where}.input_audio.data", f"{where}.input_audio.data is not valid base64") from None
    return {"type": "audio", "audio": data}


def _video_url(part: dict, where: str) -> dict:
    """vLLM's `{"type": "video_url", "video_url": {"url": "data:video/...;base64,..."}}` (OpenAI's API has
    no video part): a data URL only, never fetched."""
    url = part.get("video_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url.startswith("data:video/"):
        raise invalid(where, f'{where} must be {{"type": "video_url", "video_url": {{"url": '
                             f'"data:video/<type>;base64,..."}}}}')
    return {"type": "video_url", "video_url": {"url": url}}


def _history_calls(message: dict, i: int, names: dict) -> dict:
    """An assistant message's `tool_calls` (arguments parsed from JSON) and reasoning."""
    out: dict = {}
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        out["reasoning_content"] = reasoning
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise invalid(f"messages[{i}].tool_calls", f"messages[{i}].tool_calls must be a list")
    if calls:
        out["tool_calls"] = [_history_call(call, f"messages[{i}].tool_calls[{j}]", names)
                             for j, call in enumerate(calls)]
    return out


def _history_call(call: Any, where: str, names: dict) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid(where, f"{where} needs a `function` with a `name`")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    if not isinstance(arguments, dict):
        raise invalid(f"{where}.function.arguments", f"{where}.function.arguments must be a JSON object")
    names[call.get("id")] = function["name"]
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _tool_result(message: dict, i: int, names: dict, asked: set) -> dict:
    """A tool message answers a call of the last assistant message, by its id (OpenAI's words)."""
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str):
        raise invalid(f"messages.[{i}].tool_call_id", f"Missing required parameter: 'messages.[{i}].tool_call_id'.",
                      code="missing_required_parameter")
    if call_id not in asked:
        raise invalid(f"messages.[{i}].tool_call_id", f"Invalid parameter: 'tool_call_id' of '{call_id}' not found "
                      "in 'tool_calls' of previous message.", code=None)
    name = names.get(call_id) or message.get("name")
    return {"tool_call_id": call_id, **({"name": name} if isinstance(name, str) else {})}


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


def _seed(body: dict) -> Optional[int]:
    seed = integer(body, "seed")
    return None if seed is None else seed % 2**64  # any integer, like OpenAI; MLX keys take uint64


# ---- answers -----------------------------------------------------------------------------------


def usage(outcome: Outcome) -> dict:
    """OpenAI's usage: the whole prompt, of which `cached_tokens` came from the prefix cache."""
    p, c = outcome.prompt_tokens, outcome.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens}}


def timings(stats: Optional[Stats]) -> Optional[dict]:
    """llama.cpp's `timings`: the engine's work on this request, speculative counts included.
    `prompt_n` counts the prompt tokens prefilled, `cache_n` those restored from the prefix cache;
    `predicted_per_second` counts the tokens after the first (which comes out of the prefill)."""
    if stats is None:
        return None
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


def finish_reason(outcome: Outcome, chat: bool = True) -> Optional[str]:
    """"tool_calls" when the model stopped after calling tools; "stop" (with a `finish_detail`)
    where the output constraint allowed no further token."""
    if outcome.dead_end:
        return "stop"
    if chat and outcome.tool_calls and outcome.finish_reason == "stop" and outcome.stop_sequence is None:
        return "tool_calls"
    return outcome.finish_reason


def finish_detail(outcome: Outcome) -> dict:
    """This server's `finish_detail` beside a standard `finish_reason`, where there is more to say."""
    return {"finish_detail": "dead_end"} if outcome.dead_end else {}


def context_error(error: ContextLengthError, job: OpenAIJob) -> APIError:
    """OpenAI's words for a prompt that does not fit (its `context_length_exceeded`)."""
    what = "messages" if job.chat else "prompt"
    message = str(error) if error.context is None else (
        f"This model's maximum context length is {error.context} tokens. However, your {what} resulted in "
        f"{error.prompt_tokens} tokens. Please reduce the length of the {what}.")
    return APIError(400, message, param=what, code="context_length_exceeded")


def response(job: OpenAIJob, parts: list, outcome: Outcome) -> dict:
    reply = Reply()
    reply.add(parts)
    if job.chat:
        message: dict = {"role": "assistant", "content": reply.content or (None if reply.tool_calls else "")}
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = [_tool_call(c) for c in reply.tool_calls]
        choice = {"index": 0, "message": message, "logprobs": logprobs(job, outcome),
                  "finish_reason": finish_reason(outcome), **finish_detail(outcome)}
    else:
        choice = {"index": 0, "text": reply.content, "logprobs": logprobs(job, outcome),
                  "finish_reason": finish_reason(outcome, chat=False), **finish_detail(outcome)}
    return {**_head(job, job.object), "choices": [choice], "usage": usage(outcome), "timings": timings(outcome.stats)}


def _tool_call(call: ToolCall, index: bool = False) -> dict:
    out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
           "function": {"name": call.name, "arguments": call.arguments_json}}
    return {"index": call.index, **out} if index else out


def logprobs(job: OpenAIJob, outcome: Outcome) -> Optional[dict]:
    """The log-probabilities of the tokens read since the last call, in the endpoint's shape:
    chat's `{"content": [...]}`, completions' parallel lists; None when there are none."""
    start = outcome.logprobs_sent
    entries = outcome.new_logprobs()
    if not entries:
        return None
    if job.chat:
        return {"content": [{**_logprob(e), "top_logprobs": [_logprob(t) for t in e.top]} for e in entries]}
    offset = sum(len(e.text) for e in outcome.logprobs[:start])
    offsets = [offset + sum(len(e.text) for e in entries[:i]) for i in range(len(entries))]
    return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.text: t.logprob for t in e.top} for e in entries], "text_offset": offsets}


def _logprob(entry: TokenLogprob) -> dict:
    return {"token": entry.text, "logprob": entry.logprob, "bytes": list(entry.bytes)}


def chunk(job: OpenAIJob, part: Optional[Delta] = None, finish_reason: Optional[str] = None, first: bool = False,
          logprobs: Optional[dict] = None, detail: Optional[dict] = None, **extra) -> dict:
    """One streamed piece; a chat stream's first chunk carries the role."""
    if not job.chat:
        choice = {"index": 0, "text": part.text if part else "", "logprobs": logprobs, "finish_reason": finish_reason,
                  **(detail or {})}
        return {**_head(job, "text_completion"), "choices": [choice], **extra}
    if first:
        delta: dict = {"role": "assistant", "content": ""}
    elif part is None:
        delta = {}
    elif part.kind == "tool_call":
        delta = {"tool_calls": [_tool_call(part.call, index=True)]}
    else:
        delta = {"reasoning_content" if part.kind == "reasoning" else "content": part.text}
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, **(detail or {})}
    return {**_head(job, "chat.completion.chunk"), "choices": [choice], **extra}


def usage_chunk(job: OpenAIJob, outcome: Outcome) -> dict:
    """The extra last chunk that `stream_options.include_usage` asks for."""
    return {**_head(job, "chat.completion.chunk" if job.chat else "text_completion"), "choices": [],
            "usage": usage(outcome)}


async def stream(job: OpenAIJob, parts: AsyncIterator[Delta], outcome: Outcome) -> AsyncIterator[str]:
    """Server-sent events as OpenAI streams them, ending with `data: [DONE]`; an SSE comment
    keeps the connection alive while nothing comes (a long prefill)."""
    if job.chat:
        yield _frame(chunk(job, first=True))
    try:
        async for part in parts:  # a part carries the log-probabilities of the tokens read up to it
            if part.kind == "keepalive":
                yield ": keep-alive\n\n"
                continue
            yield _frame(chunk(job, part, logprobs=logprobs(job, outcome)))
        final = finish_reason(outcome, chat=job.chat)
        yield _frame(chunk(job, finish_reason=final, logprobs=logprobs(job, outcome), detail=finish_detail(outcome),
                           timings=timings(outcome.stats)))
        if job.include_usage:
            yield _frame(usage_chunk(job, outcome))
    except APIError as e:  # the headers are out: the error travels in the stream
        yield _frame(e.body())
    yield "data: [DONE]\n\n"


def _head(job: OpenAIJob, kind: str) -> dict:
    return {"id": job.id, "object": kind, "created": job.created, "model": job.model}


def _frame(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
