"""Ollama's native API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version`, `GET /`): request bodies in, engine requests and Ollama's objects out.

Plain Python with no HTTP (MLX only to describe a loaded model, `card`). It maps Ollama's shapes
onto `chat_format`'s: messages with `images` (raw base64) and `thinking`, assistant `tool_calls`
whose `arguments` are an object, `role: "tool"` results named by `tool_name` (or
`tool_call_id`), `tools` (OpenAI's function schemas), `format` ("json" or a JSON schema, the
reply's grammar), `think`, and `options` (sampling, `num_predict`, `stop`, `seed`, the penalties,
`num_ctx`); and the reply back as NDJSON lines (`done: false` pieces, then a `done: true` line with
`done_reason` and Ollama's durations in nanoseconds, plus MTP's counts) or one object.

Which model a request names, and what its `keep_alive` does, is the server's pool's to decide
(`models.py`); this module says the answers: Ollama's 404 ("model \"x\" not found, try pulling it
first"; `name` and `name:latest` are one model), the listings (`tags`, `ps`, `show`) and an unload.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime
import hashlib
import json
import time
import uuid
from typing import Any, AsyncIterator, Optional

from ..formats import chat as chat_format
from ..formats.chat import Delta, Reply
from ..decode.grammar import Grammar
from ..decode.processors import Penalties
from ..engine.requests import ContextLengthError, Request
from ..decode.stats import Stats
from .common import (KEEPALIVE, APIError, Job, Outcome, ServedModel, checked, draft_tokens, flag, history, integer,
                     invalid, json_grammar, mapping, number, sampling, strings, structured, unsupported)
from .common import keep_alive as common_keep_alive
from .fields import (OLLAMA_CALL, OLLAMA_CHAT, OLLAMA_EXTENSIONS, OLLAMA_FUNCTION, OLLAMA_GENERATE, OLLAMA_MESSAGE,
                     OLLAMA_OPTIONS, first_extra)

VERSION = "0.12.6"  # what /api/version says: past Copilot Chat's floor (0.6.4) and Ollama's thinking and tools
FAMILY = "gemma4"
ROLES = ("system", "user", "assistant", "tool")
# Options that change nothing here (how a runner is laid out, or what is already the case), taken as they come;
# the sampling options Gemma's runner has no use for are refused unless left at their defaults.
DEFAULTS = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0, "penalize_newline": False}
FOREVER = "9999-12-31T23:59:59Z"  # ps's `expires_at` of a model that is never unloaded


def error_body(error: APIError) -> dict:
    return {"error": str(error)}


def not_found(name: Any) -> APIError:
    return APIError(404, f'model "{name}" not found, try pulling it first', param="model", code="model_not_found")


def same_model(name: Any, served: str) -> bool:
    """Whether `name` names the served model: Ollama's `name:tag`, the tag "latest" by default."""
    if not isinstance(name, str):
        return False
    tagged = lambda n: n if ":" in n.rsplit("/", 1)[-1] else n + ":latest"
    return tagged(name) == tagged(served)


def named(body: Any) -> str:
    """The model the request names (`model`, or Continue's older `name`)."""
    name = body.get("model") or body.get("name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise invalid("model", "model is required")
    return name


def check_model(body: dict, model: ServedModel) -> str:
    """The model the request names: the served one, else 404."""
    name = named(body)
    if not same_model(name, model.id):
        raise not_found(name)
    return name


def unloads(body: Any, generate: bool) -> bool:
    """Whether the request only unloads its model: nothing to generate, and keep_alive 0."""
    if not isinstance(body, dict) or common_keep_alive(body) != 0:
        return False
    return not (body.get("prompt") or body.get("images")) if generate else not body.get("messages")


def num_ctx(body: Any) -> Optional[int]:
    """The context the request asks for (`options.num_ctx`; the parser refuses one that is not an int)."""
    options = body.get("options") if isinstance(body, dict) else None
    n = options.get("num_ctx") if isinstance(options, dict) else None
    return n if type(n) is int and n >= 1 else None


# ---- requests ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OllamaJob(Job):
    """A parsed Ollama request (`common.Job`; `request` is None for a load or unload with nothing to
    generate) and what the model's server and the answer need."""

    generate: bool = False  # /api/generate: the reply's text is `response`, not `message`
    keep_alive: Optional[float] = None  # seconds (math.inf: forever, 0: unload after); None: the server's default
    num_ctx: Optional[int] = None  # the context the request asks for (at most the model's)
    started: int = 0  # time.perf_counter_ns() when it was parsed: `total_duration` counts from here
    load_ns: int = 0  # what loading the model took for this request (`load_duration`)


def parse_chat(body: Any, model: ServedModel) -> OllamaJob:
    """POST /api/chat. No `messages` (or an empty list) only loads the model, as with Ollama."""
    body = _object(body, OLLAMA_CHAT)
    name = check_model(body, model)
    raw = body.get("messages")
    if raw is not None and not isinstance(raw, list):
        raise invalid("messages", "messages must be a list")
    tools = body.get("tools") or None
    checked("tools", chat_format.check_tools, tools)
    if not raw:
        return _job(body, name, model, None)
    messages = _messages(raw)
    last = messages[-1]
    continued = last["role"] == "assistant" and not last.get("tool_calls") and bool(last.get("content"))
    return _job(body, name, model, dict(messages=messages, tools=list(tools) if tools else None,
                                        continue_final_message=continued, **history(body, model)))


def parse_generate(body: Any, model: ServedModel) -> OllamaJob:
    """POST /api/generate: `prompt` (with `system` and `images`) through the chat template, or as it
    is with `raw: true`. No prompt only loads the model."""
    body = _object(body, OLLAMA_GENERATE)
    name = check_model(body, model)
    prompt, system = body.get("prompt") or "", body.get("system") or ""
    for field in ("prompt", "system", "suffix", "template"):
        if not isinstance(body.get(field) or "", str):
            raise invalid(field, f"{field} must be a string")
    if body.get("suffix"):
        raise APIError(400, f'"{name}" does not support insert', param="suffix")
    if body.get("template"):
        raise unsupported("template", "template is not supported by this server: the model's own chat template "
                                      "applies (or none, with raw: true)")
    if body.get("context"):
        raise unsupported("context", "context (the deprecated token memory) is not supported: send the "
                                     "conversation to /api/chat instead")
    images = _images(body.get("images"), "images")
    if not prompt and not images:
        return _job(body, name, model, None, generate=True)
    if flag(body, "raw", False):
        if images or system:
            raise invalid("raw", "a raw prompt takes no images and no system: write them into the prompt")
        return _job(body, name, model, dict(prompt=prompt), generate=True)
    user = [*images, {"type": "text", "text": prompt}] if images else prompt
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return _job(body, name, model, dict(messages=messages), generate=True)


def _object(body: Any, fields: frozenset) -> dict:
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    checks = [("", body, fields | OLLAMA_EXTENSIONS), ("options", body.get("options"), OLLAMA_OPTIONS)]
    messages = body.get("messages") if isinstance(body.get("messages"), list) else []
    for i, message in enumerate(messages):
        checks.append((f"messages[{i}]", message, OLLAMA_MESSAGE))
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for j, call in enumerate(calls if isinstance(calls, list) else []):
            checks.append((f"messages[{i}].tool_calls[{j}]", call, OLLAMA_CALL))
            if isinstance(call, dict):
                checks.append((f"messages[{i}].tool_calls[{j}].function", call.get("function"), OLLAMA_FUNCTION))
    where = first_extra(checks)
    if where is not None:  # Go's words (a decoder that disallows unknown fields)
        raise invalid(where, f'json: unknown field "{where}"', code=None)
    return body


def _job(body: dict, name: str, model: ServedModel, prompt: Optional[dict], generate: bool = False) -> OllamaJob:
    options = mapping(body, "options")
    for option, default in DEFAULTS.items():
        if options.get(option, default) != default:
            raise unsupported(f"options.{option}", f"the option {option} is not supported by this server")
    context = integer(options, "num_ctx", low=1)
    context = min(context, model.context) if context is not None else None  # as Ollama: capped at the model's
    predict = integer(options, "num_predict", low=-2)  # -1: no limit, -2: fill the context
    limit = context or model.context
    max_tokens = min(predict, limit) if predict is not None and predict > 0 else limit
    keep_alive = common_keep_alive(body)
    stream = flag(body, "stream", True)  # Ollama streams unless told not to
    job = dict(stream=stream, model=name, id=f"ollama-{uuid.uuid4().hex[:24]}", generate=generate,
               keep_alive=keep_alive, num_ctx=context, started=time.perf_counter_ns())
    if prompt is None:
        return OllamaJob(None, **job)
    if flag(body, "logprobs", False) or body.get("top_logprobs"):
        raise unsupported("logprobs", "logprobs are not supported on Ollama's API here: use /v1/chat/completions")
    request = Request(
        **prompt, max_tokens=max_tokens, sampling=_sampling(options), seed=_seed(options),
        penalties=_penalties(options), stop=strings(options, "stop"),
        grammar=structured(body, _format(body.get("format")), None), enable_thinking=_think(body, model),
        draft_tokens=draft_tokens(body, model.draft_tokens), mtp=flag(body, "mtp", True),
    )
    return OllamaJob(request, **job)


def _sampling(options: dict):
    """temperature, top_p, top_k, min_p: as the other APIs read them (top_k 0 is off)."""
    temperature = options.get("temperature")
    if type(temperature) in (int, float) and temperature > 2:  # Ollama takes any; the sampler takes up to 2
        options = {**options, "temperature": 2.0}
    return sampling(options)


def _seed(options: dict) -> Optional[int]:
    seed = integer(options, "seed")
    return None if seed is None or seed < 0 else seed % 2**64  # Ollama: -1 is a random seed


def _penalties(options: dict) -> Penalties:
    """presence_penalty and frequency_penalty as OpenAI's (-2..2); repeat_penalty is the
    multiplicative one (> 0, 1 off), over the prompt and the reply (not only the last
    `repeat_last_n` tokens)."""
    repeat = number(options, "repeat_penalty", 1.0, low=0.0)
    if repeat <= 0:
        raise invalid("options.repeat_penalty", "repeat_penalty must be > 0")
    return Penalties(number(options, "presence_penalty", 0.0, low=-2.0, high=2.0),
                     number(options, "frequency_penalty", 0.0, low=-2.0, high=2.0), repeat)


def _format(fmt: Any) -> Optional[Grammar]:
    """`format`: "json" (any JSON value) or a JSON schema ("" and null: free text)."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return Grammar.json()
    if isinstance(fmt, dict):
        return json_grammar(fmt, "format")
    raise invalid("format", 'format must be "json" or a JSON schema')


def _think(body: dict, model: ServedModel) -> bool:
    """`think`: true / false, or an effort ("low", "medium", "high", "max"), which for Gemma 4 is on."""
    think = body.get("think")
    if think is None:
        return model.thinking
    if isinstance(think, bool):
        return think
    if think in ("low", "medium", "high", "max"):
        return True
    raise invalid("think", 'think must be true, false, "low", "medium", "high" or "max"')


def _messages(raw: list) -> list:
    out: list = []
    calls: list = []  # the calls of the last assistant message: (id, name), which tool results answer
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise invalid(where, f"{where}: role must be one of {', '.join(ROLES)}")
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise invalid(f"{where}.content", f"{where}.content must be a string")
        images = _images(message.get("images"), f"{where}.images")
        if images and role not in ("user", "system"):
            raise invalid(f"{where}.images", f"{where}: images go in user messages")
        m: dict = {"role": role, "content": [*images, {"type": "text", "text": content}] if images else content}
        if role == "assistant":
            thinking = message.get("thinking")
            if isinstance(thinking, str) and thinking:
                m["reasoning_content"] = thinking
            calls = _history_calls(message.get("tool_calls"), where, i)
            if calls:
                m["tool_calls"] = [{"id": c, "type": "function", "function": f} for c, f in calls]
        elif role == "tool":
            m.update(_tool_result(message, where, calls))
        out.append(m)
    return out


def _images(images: Any, where: str) -> list:
    """Ollama's `images` (raw base64, no data URL) as image parts of the files' bytes."""
    if images is None:
        return []
    if not isinstance(images, list) or not all(isinstance(image, str) for image in images):
        raise invalid(where, f"{where} must be a list of base64 strings")
    parts = []
    for j, image in enumerate(images):
        try:
            data = base64.b64decode(image.split(",", 1)[-1] if image.startswith("data:") else image, validate=True)
        except (binascii.Error, ValueError):
            raise invalid(f"{where}[{j}]", f"{where}[{j}]: illegal base64 data") from None
        parts.append({"type": "image", "image": data})
    return parts


def _history_calls(calls: Any, where: str, i: int) -> list:
    """An assistant message's `tool_calls` as (id, function) pairs: arguments an object (a JSON
    string too, as some clients send them back), ids made up where the client sent none."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise invalid(f"{where}.tool_calls", f"{where}.tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(at, f"{at} needs a function with a name")
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        if not isinstance(arguments, dict):
            raise invalid(f"{at}.function.arguments", f"{at}.function.arguments must be an object")
        call_id = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else f"call_{i}_{j}"
        out.append((call_id, {"name": function["name"], "arguments": arguments}))
    return out


def _tool_result(message: dict, where: str, calls: list) -> dict:
    """A tool message: the call it answers by `tool_call_id`, else its `tool_name` (Ollama's)."""
    call_id, name = message.get("tool_call_id"), message.get("tool_name")
    known = {c: f["name"] for c, f in calls}
    if isinstance(call_id, str) and call_id in known:
        return {"tool_call_id": call_id, "name": known[call_id]}
    if isinstance(name, str) and name:
        return {"name": name}
    if len(calls) == 1:
        return {"tool_call_id": calls[0][0], "name": calls[0][1]["name"]}
    raise invalid(where, f"{where}: a tool result needs the tool_name of the call it answers")


# ---- answers -------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _head(job: OllamaJob) -> dict:
    return {"model": job.model, "created_at": _now()}


def _shown(job: OllamaJob, part: Delta) -> bool:
    """Reasoning is shown where the request thinks (a model may open the channel on its own)."""
    return part.kind != "reasoning" or job.request.enable_thinking


def _piece(job: OllamaJob, content: str = "", thinking: str = "", calls: tuple = ()) -> dict:
    """A reply's text, reasoning and tool calls, as /api/chat's `message` or /api/generate's fields."""
    if job.generate:
        return {"response": content, **({"thinking": thinking} if thinking else {})}
    message: dict = {"role": "assistant", "content": content}
    if thinking:
        message["thinking"] = thinking
    if calls:
        message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}",
                                  "function": {"index": c.index, "name": c.name, "arguments": c.arguments}}
                                 for c in calls]
    return {"message": message}


def done_reason(outcome: Outcome) -> str:
    return "length" if outcome.finish_reason == "length" else "stop"


def _done(job: OllamaJob, outcome: Outcome) -> dict:
    """The last line's fields: why it ended, and the work in Ollama's nanoseconds (the prompt's
    tokens all counted, those the prefix cache restored too), with MTP's counts beside them."""
    stats = outcome.stats or Stats()
    ns = lambda seconds: int(seconds * 1e9)
    return {"done": True, "done_reason": done_reason(outcome),
            "total_duration": time.perf_counter_ns() - job.started, "load_duration": job.load_ns,
            "prompt_eval_count": outcome.prompt_tokens, "prompt_eval_duration": ns(stats.prompt_seconds),
            "eval_count": outcome.completion_tokens, "eval_duration": ns(stats.decode_seconds),
            "prompt_cached_count": outcome.cached_tokens, "draft_n": stats.drafted,
            "draft_n_accepted": stats.accepted}


def loaded(job: OllamaJob) -> dict:
    """The answer to a request with nothing to generate: the model is loaded (or, with keep_alive 0,
    let go)."""
    reason = "unload" if job.keep_alive == 0 else "load"
    return {**_head(job), **_piece(job), "done": True, "done_reason": reason}


def unloaded(name: str, generate: bool) -> dict:
    """The answer to an unload (nothing to generate, keep_alive 0)."""
    piece = {"response": ""} if generate else {"message": {"role": "assistant", "content": ""}}
    return {"model": name, "created_at": _now(), **piece, "done": True, "done_reason": "unload"}


def answer(job: OllamaJob, parts: list, outcome: Outcome) -> dict:
    reply = Reply()
    reply.add([part for part in parts if _shown(job, part)])
    return {**_head(job), **_piece(job, reply.content, reply.reasoning, tuple(reply.tool_calls)),
            **_done(job, outcome)}


async def stream(job: OllamaJob, parts: AsyncIterator[Delta], outcome: Outcome) -> AsyncIterator[str]:
    """NDJSON: a `done: false` line per piece (an empty one while nothing comes, a long prefill),
    then the `done: true` line; an error after the headers is a last `{"error": ...}` line."""
    try:
        async for part in parts:
            if part is KEEPALIVE or part.kind == "keepalive":
                yield _line({**_head(job), **_piece(job), "done": False})
            elif _shown(job, part):
                piece = _piece(job, calls=(part.call,)) if part.kind == "tool_call" else \
                    _piece(job, thinking=part.text) if part.kind == "reasoning" else _piece(job, part.text)
                yield _line({**_head(job), **piece, "done": False})
        yield _line({**_head(job), **_piece(job), **_done(job, outcome)})
    except APIError as e:
        yield _line(error_body(e))


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


def context_error(error: ContextLengthError, job: OllamaJob) -> APIError:
    if error.context is None:
        return invalid(None, str(error))
    return invalid(None, f"the input length ({error.prompt_tokens} tokens) exceeds the context length "
                         f"({error.context} tokens)", code="context_length_exceeded")


# ---- the models ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Card:
    """What Ollama's model listings say of one model."""

    name: str
    size: int  # bytes of its weights, the drafter's included
    parameters: int
    quantization: str  # "Q4", "Q8", "BF16", ...
    context: int
    vision: bool
    tools: bool
    template: str
    modified_at: str  # RFC 3339

    @property
    def digest(self) -> str:
        facts = [self.name, self.size, self.parameters, self.quantization, self.context]
        return hashlib.sha256(json.dumps(facts).encode()).hexdigest()

    @property
    def details(self) -> dict:
        """Zed reads every one of these as a string: none is ever left out."""
        return {"parent_model": "", "format": "mlx", "family": FAMILY, "families": [FAMILY],
                "parameter_size": _count(self.parameters), "quantization_level": self.quantization}

    @property
    def capabilities(self) -> list:
        return ["completion", *(["tools"] if self.tools else []), "thinking", *(["vision"] if self.vision else [])]


def card(loaded, model: ServedModel, started: int) -> Card:
    """The card of a `load()`ed model served as `model` since `started` (Unix seconds)."""
    from mlx import nn
    from mlx.utils import tree_flatten

    target = loaded.target if isinstance(loaded.target, nn.Module) else nn.Module()  # a wrapped one: not read
    bits = {module.bits for _, module in target.named_modules() if getattr(module, "bits", None)}
    size, parameters, dtypes = 0, 0, set()
    for name, array in tree_flatten(target.parameters()):
        size += array.nbytes
        if name.endswith((".scales", ".biases")):  # a quantized layer's: not parameters of their own
            continue
        packed = "uint32" in str(array.dtype) and bits
        parameters += array.size * 32 // min(bits) if packed else array.size
        dtypes.add(str(array.dtype).split(".")[-1])
    if isinstance(loaded.drafter, nn.Module):  # prompt lookup has no weights
        size += sum(a.nbytes for _, a in tree_flatten(loaded.drafter.parameters()))
    quantization = f"Q{min(bits)}" if bits else next((d.upper() for d in ("bfloat16", "float16", "float32")
                                                      if d in dtypes), "F32")
    quantization = {"BFLOAT16": "BF16", "FLOAT16": "F16", "FLOAT32": "F32"}.get(quantization, quantization)
    when = datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat().replace("+00:00", "Z")
    template = getattr(loaded.tokenizer, "chat_template", None)
    return Card(model.id, size, parameters, quantization, model.context, loaded.vision is not None,
                model.tool_calls, template if isinstance(template, str) else "", when)


def _count(n: int) -> str:
    """Ollama's parameter_size: "31.3B", "567.7M"."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _entry(c: Card) -> dict:
    return {"name": c.name, "model": c.name, "modified_at": c.modified_at, "size": c.size, "digest": c.digest,
            "details": c.details}


def tags(cards: list) -> dict:
    """GET /api/tags: the models there are."""
    return {"models": [_entry(c) for c in cards]}


def ps(listed: list) -> dict:
    """GET /api/ps: the models loaded (`models.Listed`): what each reserves (weights, KV and prompt
    cache; in unified memory all of it is the GPU's), its context and when it unloads."""
    return {"models": [{**_entry(item.card), "size": item.resident.bytes, "expires_at": _expires(item.resident),
                        "size_vram": item.resident.bytes, "context_length": item.resident.context}
                       for item in listed]}


def _expires(resident) -> str:
    if resident.expires_at is None:
        return FOREVER
    when = datetime.datetime.fromtimestamp(resident.expires_at, datetime.timezone.utc)
    return when.isoformat(timespec="microseconds").replace("+00:00", "Z")


def show(c: Card) -> dict:
    """POST /api/show {"model"} (or Continue's {"name"}): Copilot Chat reads `model_info`'s
    context length and `capabilities`, Continue `parameters` and `template`."""
    info = {"general.architecture": FAMILY, "general.basename": c.name, "general.parameter_count": c.parameters,
            f"{FAMILY}.context_length": c.context}
    return {"license": "", "modelfile": f"FROM {c.name}\n", "parameters": f"num_ctx {c.context}",
            "template": c.template, "details": c.details, "model_info": info, "capabilities": c.capabilities,
            "modified_at": c.modified_at}


def version() -> dict:
    return {"version": VERSION}


def no_store(what: str) -> APIError:
    """/api/pull and /api/delete where an app serves one Engine (`create_app(engine, ...)`), not a store."""
    return APIError(501, f"{what} is not available: this app serves one model and has no model store "
                         "(`mlx-mtp-server` has one)", code="not_implemented")
