"""The Anthropic Messages wire format (`POST /v1/messages`, `/v1/messages/count_tokens`):
request bodies in, engine requests and message objects or stream events out.

Plain Python with no MLX and no HTTP. It maps Anthropic's shapes onto `chat_format`'s: `system`
(a string or text blocks), `role: "system"` entries of `messages` (Claude Code sends them; they
stay where they are in the conversation), content blocks `text` / `tool_use` / `tool_result` /
`thinking`, `tools` with `input_schema`, `tool_choice` (`any` and `tool` force a call, `none` bans
one), `thinking`, `output_config.format` (a JSON schema the reply must match); and the reply back
into `thinking`, `text` and `tool_use` blocks. Fields it has no use for (`metadata`,
`cache_control`, server tools, ...) are checked for type and ignored, as Claude Code sends many.
Claude Code's `x-anthropic-billing-header` system line changes with its version, its prompt and
every request: it is dropped, so that the prompt's prefix stays the same across requests and
sessions (as with `CLAUDE_CODE_ATTRIBUTION_HEADER=0`).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, AsyncIterator, Optional

from ..formats import chat as chat_format
from ..formats.chat import Delta
from ..decode.grammar import Grammar
from ..engine.requests import ContextLengthError, Request
from .common import (APIError, Job, Outcome, ServedModel, check_model, checked, draft_tokens, flag,
                     forced_calls, history, integer, invalid, json_grammar, mapping, sampling, strings, structured,
                     typed, unsupported)
from .fields import (ANTHROPIC_BLOCK, ANTHROPIC_COUNT, ANTHROPIC_EXTENSIONS, ANTHROPIC_MESSAGE, ANTHROPIC_MESSAGES,
                     ANTHROPIC_METADATA, ANTHROPIC_OUTPUT_CONFIG, ANTHROPIC_THINKING, ANTHROPIC_TOOL,
                     ANTHROPIC_TOOL_CHOICE, first_extra)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 529: "overloaded_error"}
BILLING = re.compile(r"^x-anthropic-billing-header:[^\n]*\n?", re.MULTILINE | re.IGNORECASE)
BLOCK_TYPES = {"reasoning": "thinking", "content": "text", "tool_call": "tool_use"}
IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # the image blocks Anthropic takes


def error_body(error: APIError) -> dict:
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": str(error)}}


# ---- requests ------------------------------------------------------------------------------------


def parse_messages(body: Any, model: ServedModel, count: bool = False) -> Job:
    """POST /v1/messages (`count`: /v1/messages/count_tokens, which needs no `max_tokens`)."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    _known(body, ANTHROPIC_COUNT if count else ANTHROPIC_MESSAGES)
    check_model(body.get("model"), model)
    max_tokens = integer(body, "max_tokens", low=1)
    if max_tokens is None and not count:
        raise invalid("max_tokens", "`max_tokens` is required")
    _check_ignored(body)
    messages = _messages(body)
    tools, parallel, forced = _tools(body, model)
    last = messages[-1]
    request = Request(
        messages=messages, tools=tools, allow_tool_calls=mapping(body, "tool_choice").get("type") != "none",
        enable_thinking=_thinking(body),
        continue_final_message=last["role"] == "assistant" and not last.get("tool_calls") and bool(last["content"]),
        max_tokens=max_tokens or model.context, fit_max_tokens=not count, sampling=sampling(body, temperature_high=1.0),
        draft_tokens=draft_tokens(body, model.draft_tokens), mtp=flag(body, "mtp", True),
        grammar=structured(body, _output_format(body), forced), stop=strings(body, "stop_sequences"),
        parallel_tool_calls=parallel, **history(body, model),
    )
    return Job(request, flag(body, "stream", False), model.id, f"msg_{uuid.uuid4().hex[:24]}")


def _known(body: dict, fields: frozenset) -> None:
    """Every field a known one (`fields` and this server's extensions), at the top of the request
    and inside its messages, blocks and tools: Anthropic's words for the first that is not."""
    checks = [("", body, fields | ANTHROPIC_EXTENSIONS), ("metadata", body.get("metadata"), ANTHROPIC_METADATA),
              ("tool_choice", body.get("tool_choice"), ANTHROPIC_TOOL_CHOICE),
              ("thinking", body.get("thinking"), ANTHROPIC_THINKING),
              ("output_config", body.get("output_config"), ANTHROPIC_OUTPUT_CONFIG)]
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    checks += [(f"tools.{i}.custom", tool, ANTHROPIC_TOOL) for i, tool in enumerate(tools)
               if isinstance(tool, dict) and tool.get("type") in (None, "custom")]  # server tools: dropped
    system = body.get("system") if isinstance(body.get("system"), list) else []
    checks += _block_checks("system", system)
    messages = body.get("messages") if isinstance(body.get("messages"), list) else []
    for i, message in enumerate(messages):
        checks.append((f"messages.{i}", message, ANTHROPIC_MESSAGE))
        content = message.get("content") if isinstance(message, dict) else None
        checks += _block_checks(f"messages.{i}.content", content if isinstance(content, list) else [])
    where = first_extra(checks)
    if where is not None:
        raise invalid(where, f"{where}: Extra inputs are not permitted", code=None)


def _block_checks(where: str, blocks: list) -> list:
    """(path, block, allowed) of the content blocks whose fields we know, a path as Anthropic's
    (pydantic's) errors name it: `messages.0.content.1.tool_use`; tool results' own blocks too."""
    out = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ANTHROPIC_BLOCK:
            out.append((f"{where}.{j}.{kind}", block, ANTHROPIC_BLOCK[kind]))
            if kind == "tool_result" and isinstance(block.get("content"), list):
                out += _block_checks(f"{where}.{j}.{kind}.content", block["content"])
    return out


def _check_ignored(body: dict) -> None:
    """The fields Anthropic takes that mean nothing here must still have their types."""
    metadata = mapping(body, "metadata")
    if not isinstance(metadata.get("user_id", ""), (str, type(None))):
        raise invalid("metadata.user_id", "`metadata.user_id` must be a string")
    typed(body, "service_tier", str)


def _messages(body: dict) -> list:
    """`system` and `messages` as chat messages: tool results become tool messages (named by
    the calls they answer), thinking becomes `reasoning_content`, and `role: "system"` entries
    stay system messages where they are."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages", "`messages` must be a non-empty list")
    system = _text(body["system"], "system", billing=True) if body.get("system") else ""
    names: dict = {}  # tool_use id -> the tool's name
    asked: set = set()  # the tool_use ids of the last assistant message, which the next one's results answer
    out: list = [{"role": "system", "content": system}] if system else []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system"):
            raise invalid(where, f"{where} needs a `role`: user or assistant")
        if role == "system":
            if text := _text(message.get("content"), f"{where}.content", billing=True):
                out.append({"role": "system", "content": text})
            continue
        blocks = _blocks(message.get("content"), f"{where}.content")
        if role == "assistant":
            out.extend(_assistant(blocks, where, names))
            asked = {b.get("id") for b in blocks if b.get("type") == "tool_use"}
        else:
            out.extend(_user(blocks, i, names, asked))
            asked = set()
    if not any(m["role"] != "system" for m in out):
        raise invalid("messages", "`messages` must hold a user or assistant message")
    return out


def _blocks(content: Any, where: str) -> list:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise invalid(where, f"{where} must be a string or a list of content blocks")
    return content


def _user(blocks: list, i: int, names: dict, asked: set) -> list:
    """Tool results first (as tool messages), each answering a call of the message before, as
    Anthropic requires (in its words), then the user's text."""
    where = f"messages[{i}]"
    results, text = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "tool_result":
            content = _text(block.get("content") or "", f"{where}.content[{j}].content")
            if block.get("is_error"):
                content = f"Error: {content}"
            call_id = block.get("tool_use_id")
            if call_id not in asked:
                raise invalid(f"{where}.content[{j}].tool_use_id",
                              f"messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` blocks: "
                              f"{call_id}. Each `tool_result` block must have a corresponding `tool_use` block in "
                              "the previous message.")
            name = names.get(call_id)
            results.append({"role": "tool", "tool_call_id": call_id, "content": content,
                            **({"name": name} if name else {})})
        elif kind == "image":
            text.append(_image(block, i, j))
        else:
            text.append(_block_text(block, f"{where}.content[{j}]"))
    if any(isinstance(t, dict) for t in text):  # images: the content as parts (`mlx_mtp.formats.vision`)
        parts = [t if isinstance(t, dict) else {"type": "text", "text": t} for t in text]
        return results + [{"role": "user", "content": parts}]
    return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])


def _image(block: dict, i: int, j: int) -> dict:
    """An `image` block as an image part: base64 data of a type Anthropic takes (or a URL, where
    the server fetches them)."""
    where, source = f"messages[{i}].content[{j}]", block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str):
        media = source.get("media_type") or "image/png"
        if media not in IMAGE_TYPES:  # Anthropic's (pydantic's) words
            at = f"messages.{i}.content.{j}.image.source.base64.media_type"
            raise invalid(at, f"{at}: Input should be {', '.join(map(repr, IMAGE_TYPES[:-1]))} or "
                              f"{IMAGE_TYPES[-1]!r}", code=None)
        return {"type": "image", "image": f"data:{media};base64,{source['data']}"}
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image", "url": source["url"]}
    raise invalid(f"{where}.source", f"{where}.source must be {{\"type\": \"base64\", \"media_type\": ..., "
                  "\"data\": ...}} or {{\"type\": \"url\", \"url\": ...}}")


def _assistant(blocks: list, where: str, names: dict) -> list:
    text, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        kind, at = block.get("type"), f"{where}.content[{j}]"
        if kind == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise invalid(at, f"{at} needs a `name` and an object `input`")
            names[block.get("id")] = block["name"]
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block["name"], "arguments": block.get("input") or {}}})
        elif kind == "thinking":
            thinking.append(str(block.get("thinking") or ""))
        elif kind != "redacted_thinking":  # encrypted reasoning of another model: nothing to show ours
            text.append(_block_text(block, at))
    message: dict = {"role": "assistant", "content": "".join(text)}
    if "".join(thinking):
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return [message]


def _block_text(block: dict, where: str) -> str:
    kind = block.get("type")
    if kind == "text" and isinstance(block.get("text"), str):
        return block["text"]
    if kind in ("image", "document", "search_result"):
        raise unsupported(where, f"{where}: {kind} blocks are not supported by this server (text only)")
    if kind in ("audio", "input_audio", "video", "video_url"):  # Anthropic's API has neither: say so
        raise invalid(where, f"{where}: Anthropic's Messages API takes no audio or video; send them through the "
                             "OpenAI API (`input_audio` and `video_url` parts of /v1/chat/completions)")
    raise invalid(where, f"{where}: expected a text block, got type {kind!r}")


def _text(content: Any, where: str, billing: bool = False) -> str:
    """A string, or the text of a list of text blocks (`billing`: normalise Claude Code's header)."""
    blocks = _blocks(content, where)
    texts = [_block_text(b, f"{where}[{j}]") for j, b in enumerate(blocks)]
    if billing:
        texts = [BILLING.sub("", t) for t in texts]
    return "\n\n".join(t for t in texts if t) if billing else "".join(texts)


def _tools(body: dict, model: ServedModel) -> tuple[Optional[list], bool, Optional[Grammar]]:
    """(the tools as JSON schemas, parallel calls allowed, the grammar of a forced call: `any`
    tool, or the `tool` named). Server tools (web search and the like, which have no
    `input_schema`) are not ours to run: dropped. Under `none` the tools stay declared."""
    choice = mapping(body, "tool_choice")
    kind = choice.get("type", "auto")
    if kind not in ("auto", "none", "any", "tool"):
        raise invalid("tool_choice", '`tool_choice.type` must be "auto", "any", "tool" or "none"')
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise invalid("tools", "`tools` must be a list")
    schemas = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or "input_schema" not in tool:
            continue
        function = {"name": tool.get("name"), "description": tool.get("description") or "",
                    "parameters": tool["input_schema"]}
        schemas.append({"type": "function", "function": function})
    checked("tools", chat_format.check_tools, schemas)
    parallel = not flag(choice, "disable_parallel_tool_use", False)
    schemas = schemas or None
    if kind not in ("any", "tool"):
        return schemas, parallel, None
    name = choice.get("name") if kind == "tool" else None
    if kind == "tool" and not isinstance(name, str):
        raise invalid("tool_choice", '`tool_choice` of type "tool" needs the tool\'s `name`')
    return schemas, parallel, forced_calls(schemas, name, parallel, model)


def _output_format(body: dict) -> Optional[Grammar]:
    """`output_config.format`: `{"type": "json_schema", "schema": {...}}`, the reply's JSON."""
    fmt = mapping(mapping(body, "output_config"), "format")
    if not fmt:
        return None
    if fmt.get("type") != "json_schema":
        raise invalid("output_config.format", '`output_config.format.type` must be "json_schema"')
    return json_grammar(fmt.get("schema"), "output_config.format.schema")


def _thinking(body: dict) -> bool:
    """Whether the request asks for thinking: as with Anthropic, not unless it says so (the server's
    --enable-thinking is OpenAI requests' default, not this API's)."""
    thinking = mapping(body, "thinking")
    kind = thinking.get("type")
    if kind is None:
        return False
    if kind not in ("enabled", "disabled", "adaptive"):
        raise invalid("thinking", '`thinking.type` must be "enabled", "adaptive" or "disabled"')
    if kind == "enabled":
        integer(thinking, "budget_tokens", low=1024)
    return kind != "disabled"  # a budget_tokens is not enforced: Gemma 4 thinks until it is done


# ---- answers -------------------------------------------------------------------------------------


def stop_reason(outcome: Outcome) -> str:
    if outcome.stop_sequence is not None:
        return "stop_sequence"
    if outcome.finish_reason == "length":
        return "max_tokens"
    return "tool_use" if outcome.tool_calls and not outcome.dead_end else "end_turn"


def _stop(outcome: Outcome) -> dict:
    """`stop_reason` and `stop_sequence`, and this server's `stop_detail` where there is more to
    say ("dead_end": the output constraint allowed no further token)."""
    detail = {"stop_detail": "dead_end"} if outcome.dead_end else {}
    return {"stop_reason": stop_reason(outcome), "stop_sequence": outcome.stop_sequence, **detail}


def context_error(error: ContextLengthError, job: Job) -> APIError:
    """Anthropic's own words, which Claude Code acts on: it compacts the conversation at "prompt
    is too long", and retries with a smaller `max_tokens` at "... exceed context limit"."""
    n, context = error.prompt_tokens, error.context
    if context is None:
        message = str(error)
    elif error.max_tokens is not None:
        message = (f"input length and `max_tokens` exceed context limit: {n} + {error.max_tokens} > {context}, "
                   "decrease input length or `max_tokens` and try again")
    else:  # the reply needs room for a token at least
        message = f"prompt is too long: {n} tokens > {context - 1} maximum"
    return APIError(400, message, param="messages", code="context_length_exceeded")


def answer(job: Job, parts: list, outcome: Outcome) -> dict:
    parts = [part for part in parts if _shown(job, part)]
    content = [_block(part, whole=True) for part in chat_format.merge(parts)] or [{"type": "text", "text": ""}]
    return {**_message(job), "content": content, **_stop(outcome), "usage": _usage(outcome)}


def _shown(job: Job, part: Delta) -> bool:
    """No thinking block unless the request asked for thinking: a model may open a reasoning
    channel on its own (the output's parser reads one wherever it comes), and that stays hidden."""
    return part.kind != "reasoning" or job.request.enable_thinking


def _message(job: Job) -> dict:
    return {"id": job.id, "type": "message", "role": "assistant", "model": job.model}


def _usage(outcome: Outcome) -> dict:
    """Anthropic's usage, which splits the prompt in three: `cache_read_input_tokens` were read
    from the prefix cache, `cache_creation_input_tokens` were prefilled and left there for later
    requests, `input_tokens` were prefilled and not kept."""
    cached, stored = outcome.cached_tokens, outcome.stored_tokens
    return {"input_tokens": outcome.prompt_tokens - cached - stored, "cache_creation_input_tokens": stored,
            "cache_read_input_tokens": cached, "output_tokens": outcome.completion_tokens}


def _block(part: Delta, whole: bool) -> dict:
    """A content block: complete (`whole`), or empty as a stream's `content_block_start` has it."""
    if part.kind == "tool_call":
        call = part.call
        return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name,
                "input": call.arguments if whole else {}}
    if part.kind == "reasoning":
        return {"type": "thinking", "thinking": part.text if whole else "", "signature": ""}
    return {"type": "text", "text": part.text if whole else ""}


def _delta(part: Delta) -> dict:
    if part.kind == "tool_call":
        return {"type": "input_json_delta", "partial_json": part.call.arguments_json}
    if part.kind == "reasoning":
        return {"type": "thinking_delta", "thinking": part.text}
    return {"type": "text_delta", "text": part.text}


async def stream(job: Job, parts: AsyncIterator[Delta], outcome: Outcome) -> AsyncIterator[str]:
    """Server-sent events in Anthropic's sequence: message_start, ping, per block
    content_block_start / _delta... / _stop, message_delta (stop_reason, usage), message_stop;
    a ping whenever nothing else came for a while (a long prefill)."""
    start = {**_message(job), "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": _usage(outcome)}
    yield _event("message_start", message=start)
    yield _event("ping")
    index, open_kind = -1, None
    try:
        async for part in parts:
            if part.kind == "keepalive":
                yield _event("ping")
                continue
            if not _shown(job, part):
                continue
            if part.kind != open_kind or part.kind == "tool_call":
                if open_kind is not None:
                    yield _close(index, open_kind)
                index, open_kind = index + 1, part.kind
                yield _event("content_block_start", index=index, content_block=_block(part, whole=False))
            yield _event("content_block_delta", index=index, delta=_delta(part))
        if open_kind is not None:
            yield _close(index, open_kind)
        yield _event("message_delta", delta=_stop(outcome), usage=_usage(outcome))
        yield _event("message_stop")
    except APIError as e:  # the headers are out: the error travels in the stream
        yield f"event: error\ndata: {json.dumps(error_body(e))}\n\n"


def _close(index: int, kind: str) -> str:
    if kind == "reasoning":  # no signature: nothing to verify on a local model
        return (_event("content_block_delta", index=index, delta={"type": "signature_delta", "signature": ""})
                + _event("content_block_stop", index=index))
    return _event("content_block_stop", index=index)


def _event(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, separators=(',', ':'))}\n\n"
