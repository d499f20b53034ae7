"""Gemma 4's tool-call syntax, both ways: a call as the template writes it (`call_text`), and a
call's body as the model wrote it read back (`parse_call`).

`<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`: keys bare, strings between `<|"|>`
quotes (any text inside, braces and tags included), other values as JSON writes them.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional

TOOL_CALL, TOOL_CALL_END = "<|tool_call>", "<tool_call|>"
QUOTE = '<|"|>'  # Gemma 4's string delimiter inside tool calls and declarations
MAX_DEPTH = 64  # nesting allowed in a tool call's arguments


def call_text(name: str, arguments: Mapping) -> str:
    """A tool call in Gemma 4's syntax, its arguments in their given order (the model's)."""
    return f"{TOOL_CALL}call:{name}{format_argument(dict(arguments))}{TOOL_CALL_END}"


def format_argument(value: Any) -> str:
    """A value as the template's `format_argument` writes it (keys bare, in the given order)."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{format_argument(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_argument(v) for v in value) + "]"
    return "null" if value is None else str(value)


class _SyntaxError(ValueError):
    pass


def parse_call(body: str) -> Optional[tuple[str, dict, str]]:
    """`call:NAME{...}` (the `call:` may be missing) -> (name, arguments, text after the
    arguments), or None when it does not parse."""
    text = body.strip()
    text = text[len("call:"):] if text.startswith("call:") else text
    brace = text.find("{")
    name = text[:brace].strip() if brace > 0 else ""
    if not name or any(c.isspace() or c in '{}[]:,"<>' for c in name):
        return None
    try:
        arguments, end = _value(text, brace, 0)
    except (_SyntaxError, IndexError):
        return None
    return (name, arguments, text[end:]) if isinstance(arguments, dict) else None


def _value(s: str, i: int, depth: int) -> tuple[Any, int]:
    """The value starting at s[i] (after blanks) and the index just past it."""
    i = _skip(s, i)
    if depth > MAX_DEPTH:
        raise _SyntaxError("nested too deeply")
    if s.startswith(QUOTE, i):
        end = s.find(QUOTE, i + len(QUOTE))
        if end < 0:
            raise _SyntaxError("unterminated string")
        return s[i + len(QUOTE): end], end + len(QUOTE)
    if s[i] == '"':
        try:
            return json.JSONDecoder().raw_decode(s, i)
        except ValueError:
            raise _SyntaxError("bad JSON string") from None
    if s[i] == "{":
        return _items(s, i + 1, "}", depth, keyed=True)
    if s[i] == "[":
        return _items(s, i + 1, "]", depth, keyed=False)
    end = i
    while end < len(s) and s[end] not in ",}]":
        end += 1
    return _scalar(s[i:end].strip()), end


def _items(s: str, i: int, close: str, depth: int, keyed: bool) -> tuple[Any, int]:
    out: Any = {} if keyed else []
    i = _skip(s, i)
    if s[i] == close:
        return out, i + 1
    while True:
        if keyed:
            key, i = _key(s, i)
            out[key], i = _value(s, i, depth + 1)
        else:
            value, i = _value(s, i, depth + 1)
            out.append(value)
        i = _skip(s, i)
        if s[i] == close:
            return out, i + 1
        if s[i] != ",":
            raise _SyntaxError(f"expected , or {close}")
        i += 1


def _key(s: str, i: int) -> tuple[str, int]:
    """An object key (bare, or quoted either way) and the index just past its colon."""
    i = _skip(s, i)
    if s.startswith(QUOTE, i) or s[i] == '"':
        key, i = _value(s, i, 0)
        i = _skip(s, i)
    else:
        end = s.find(":", i)
        key, i = s[i:end].strip(), end
        if end < 0 or not key or any(c in key for c in "{}[],"):
            raise _SyntaxError("bad key")
    if s[i] != ":":
        raise _SyntaxError("expected :")
    return str(key), i + 1


def _scalar(word: str) -> Any:
    if not word:
        raise _SyntaxError("missing value")
    if word in ("true", "false"):
        return word == "true"
    if word in ("null", "None"):
        return None
    for kind in (int, float):
        try:
            return kind(word)
        except ValueError:
            pass
    return word  # a bare word: the model's unquoted text


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    if i >= len(s):
        raise _SyntaxError("unexpected end")
    return i
