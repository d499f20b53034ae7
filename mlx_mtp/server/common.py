"""What the wire formats share: the error that becomes an HTTP error, the served model, a parsed
request (`Job`), checks of request fields (structured output among them), and how a request
ended. Plain Python, no MLX and no HTTP: the engine's types come from `requests`."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

from ..formats.chat import HISTORIES, Delta
from ..decode.grammar import Grammar
from ..engine.requests import Request
from ..decode.sample import SamplingParams
from ..decode.speculative import K_MAX
from ..decode.stats import Stats

KEEPALIVE = Delta("keepalive")  # a stream's piece that says "still working": a ping, an SSE comment


class APIError(Exception):
    """An error answered with an HTTP status, shaped by the API that was called."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers or {}
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        """OpenAI's error object."""
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: Optional[str], message: str, code: Optional[str] = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported")


@dataclasses.dataclass(frozen=True)
class Job:
    """One parsed request of either API: what the engine runs (the `Request`, with its stop
    strings and tool-call rule) and what shapes the answer (each API adds its own fields)."""

    request: Request
    stream: bool
    model: str
    id: str


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What the parsers need to know about the model behind the server."""

    id: str
    context: int  # max_position_embeddings: the default (and largest) max_tokens
    vocab_size: int
    draft_tokens: object = "auto"  # the server's default for requests that do not say
    thinking: bool = False  # the server's default for `enable_thinking`
    tool_calls: bool = True  # the chat template can say tool calls
    history: str = "generated"  # the server's default for a request's `history`
    keep_thinking: bool = False  # ... and for `keep_thinking`
    parse_control_tokens: bool = False  # control tokens spelled in messages are parsed (--parse-control-tokens)


def keep_alive(body: Any) -> Optional[float]:
    """A request's `keep_alive` (every API's; Ollama's meaning): seconds, a Go duration ("5m"),
    0 to unload after the request, negative (`math.inf`) to keep; None: the server's default."""
    from ..engine.pool import keep_alive_seconds

    value = body.get("keep_alive") if isinstance(body, dict) else None
    if value is None:
        return None
    try:
        return keep_alive_seconds(value)
    except ValueError:
        raise invalid("keep_alive", f'time: invalid duration "{value}"', code=None) from None


def check_model(name: Any, model: ServedModel) -> None:
    if name is not None and name != model.id:
        raise APIError(404, f"the model `{name}` does not exist; this server serves `{model.id}`",
                       param="model", code="model_not_found")


def forced_calls(tools: Optional[list], name: Optional[str], parallel: bool, model: ServedModel) -> Grammar:
    """The grammar of a reply that must call a tool (`name`, or any of `tools`)."""
    if not model.tool_calls:
        raise invalid("tool_choice", f"`{model.id}`'s chat template has no tool calls: a tool_choice cannot force one")
    if not tools:
        raise invalid("tool_choice", "a tool_choice that forces a call needs `tools`")
    try:
        return Grammar.tool_calls(tools, name, parallel)
    except ValueError as e:
        raise invalid("tool_choice", str(e)) from None


def structured(body: dict, grammar: Optional[Grammar], forced: Optional[Grammar]) -> Optional[Grammar]:
    """The reply's grammar: the API's own field (`grammar`), a forced tool call (`forced`), or
    the `structured_outputs` extension (one of `json`, `json_object`, `regex`, `grammar` (Lark or
    GBNF), `choice`, as vLLM names them); at most one of them."""
    extension = mapping(body, "structured_outputs")
    kinds = {"json": Grammar.json, "json_object": lambda on: Grammar.json() if on else None,
             "regex": Grammar.regex, "grammar": Grammar.cfg, "choice": Grammar.choice}
    unknown = sorted(set(extension) - set(kinds))
    if unknown or len(extension) > 1:
        raise invalid("structured_outputs", "`structured_outputs` takes one of " + ", ".join(kinds))
    found = [g for g in (grammar, forced) if g is not None]
    for kind, value in extension.items():
        try:
            found += [g for g in [kinds[kind](value)] if g is not None]
        except (ValueError, TypeError) as e:
            raise invalid(f"structured_outputs.{kind}", str(e)) from None
    if len(found) > 1:
        raise invalid(None, "a request takes one output constraint: a response format, a forced tool call or "
                            "`structured_outputs`")
    return found[0] if found else None


def json_grammar(schema: Any, param: str) -> Grammar:
    if not isinstance(schema, dict):
        raise invalid(param, f"`{param}` must be a JSON schema (an object)")
    try:
        return Grammar.json(schema)
    except ValueError as e:
        raise invalid(param, str(e)) from None


@dataclasses.dataclass
class Outcome:
    """How a request ended: filled in while its reply is read."""

    finish_reason: Optional[str] = None  # the engine's "stop" (a stop token or string) / "length" / "dead_end"
    stop_sequence: Optional[str] = None  # the stop string that ended it
    tool_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0  # the tokens streamed (the one completing a stop string included)
    stats: Optional[Stats] = None  # the engine's account, once the request is done
    logprobs: Optional[list] = None  # `engine.TokenLogprob` of each token read, when the request asked
    logprobs_sent: int = 0
    handle: Any = None  # the engine's handle, whose `stats` fill in as the request runs

    @property
    def cached_tokens(self) -> int:
        """Of the prompt tokens, those restored from the prefix cache (0 until its prefill began)."""
        stats = self.stats or (self.handle.stats if self.handle is not None else None)
        return stats.cached_tokens if stats is not None else 0

    @property
    def stored_tokens(self) -> int:
        """Of the prompt tokens prefilled, those left in the prefix cache for later requests."""
        stats = self.stats or (self.handle.stats if self.handle is not None else None)
        return stats.stored_tokens if stats is not None else 0

    @property
    def dead_end(self) -> bool:
        """The reply ended because its output constraint allows no further token."""
        return self.finish_reason == "dead_end"

    def new_logprobs(self) -> Optional[list]:
        """The log-probabilities read since the last call (None when the request asked for none)."""
        if self.logprobs is None:
            return None
        new, self.logprobs_sent = self.logprobs[self.logprobs_sent:], len(self.logprobs)
        return new


# ---- request fields ------------------------------------------------------------------------------


def sampling(body: dict, temperature_high: Optional[float] = None) -> SamplingParams:
    top_k = integer(body, "top_k", low=-1)
    try:
        return SamplingParams(
            temperature=number(body, "temperature", 1.0, low=0.0, high=temperature_high),
            top_p=number(body, "top_p", 1.0, low=0.0, high=1.0),
            top_k=max(top_k or 0, 0),  # -1 (vLLM's "off") and 0 both turn top-k off
            min_p=number(body, "min_p", 0.0, low=0.0, high=1.0),
        )
    except ValueError as e:  # e.g. top_p = 0
        raise invalid(None, str(e)) from None


def draft_tokens(body: dict, default):
    value = body.get("draft_tokens")
    if value is None:
        return default
    if value == "auto" or (type(value) is int and 0 <= value <= K_MAX):
        return value
    raise invalid("draft_tokens", f"`draft_tokens` must be \"auto\" or an integer in [0, {K_MAX}]")


def history(body: dict, model: ServedModel) -> dict:
    """A chat request's history options (`Request.history`, `keep_thinking`, `parse_control_tokens`):
    the extensions `history` ("generated" or "template") and `keep_thinking`, else the server's."""
    mode = body.get("history", model.history)
    if mode not in HISTORIES:
        raise invalid("history", f"`history` must be one of {', '.join(map(json.dumps, HISTORIES))}")
    keep = flag(body, "keep_thinking", model.keep_thinking and mode == "generated")
    if keep and mode != "generated":
        raise invalid("keep_thinking", '`keep_thinking` goes with `history: "generated"` (the template decides)')
    return dict(history=mode, keep_thinking=keep, parse_control_tokens=model.parse_control_tokens)


def strings(body: dict, name: str) -> tuple:
    """A string or a list of non-empty strings."""
    value = body.get(name)
    found = [value] if isinstance(value, str) else value if value is not None else []
    if not isinstance(found, list) or not all(isinstance(s, str) and s for s in found):
        raise invalid(name, f"`{name}` must be a non-empty string or a list of them")
    return tuple(found)


def flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"`{name}` must be true or false")
    return value


def integer(body: dict, name: str, low: Optional[int] = None, high: Optional[int] = None) -> Optional[int]:
    value = body.get(name)
    if value is not None and type(value) is not int:
        raise invalid(name, f"`{name}` must be an integer")
    if value is not None and low is not None and value < low:
        raise invalid(name, f"`{name}` must be >= {low}, got {value}")
    if value is not None and high is not None and value > high:
        raise invalid(name, f"`{name}` must be <= {high}, got {value}")
    return value


def number(body: dict, name: str, default: float, low: float, high: Optional[float] = None) -> float:
    value = body.get(name)
    if value is None:
        return default
    if type(value) not in (int, float) or value < low or (high is not None and value > high):
        limits = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise invalid(name, f"`{name}` must be a number {limits}, got {value!r}")
    return float(value)


def typed(body: dict, name: str, kind: type) -> None:
    """Refuse a field the server ignores unless it has its API's type (str, dict, bool)."""
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        names = {str: "a string", dict: "an object", bool: "true or false"}
        raise invalid(name, f"`{name}` must be {names[kind]}")


def mapping(body: dict, name: str) -> dict:
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise invalid(name, f"`{name}` must be an object")
    return value or {}


def checked(param: str, check, *args) -> None:
    """Run a `chat_format` check; its ValueError becomes a 400 naming `param`."""
    try:
        check(*args)
    except ValueError as e:
        raise invalid(param, str(e)) from None
