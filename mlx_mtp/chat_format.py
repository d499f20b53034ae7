"""What a chat means to Gemma 4: prompts rendered with the model's own chat template, and the
model's output split, as it streams, into content, reasoning and tool calls.

Plain Python (no MLX, no HTTP), used by the chat, the `Engine` and every HTTP API, each of
which translates its own wire format to and from these shapes:

- messages as transformers' chat templates take them: `{"role", "content"}` with roles
  system / user / assistant / tool; an assistant message may carry `tool_calls`
  (`[{"id", "type": "function", "function": {"name", "arguments": {...}}}]`, arguments an
  object) and `reasoning_content`; a tool message carries `tool_call_id` and its result.
- tools as JSON schemas: `{"type": "function", "function": {"name", "description", "parameters"}}`.
- the output as `Delta`s: content text, reasoning text, or one whole `ToolCall`.

Gemma 4 writes reasoning as `<|channel>thought\\n...<channel|>` and a tool call as
`<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`, all control tokens, so the output
must be decoded with them kept. `OutputParser` never releases part of a call: a call comes out
whole once its close tag (or the next call, or the end of the output) arrives, or, if it does
not parse, as the text the model wrote.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence

TOOL_CALL, TOOL_CALL_END = "<|tool_call>", "<tool_call|>"
TOOL_RESPONSE, TOOL_RESPONSE_END = "<|tool_response>", "<tool_response|>"
CHANNEL, CHANNEL_END = "<|channel>", "<channel|>"
QUOTE = '<|"|>'  # Gemma 4's string delimiter inside tool calls and declarations
THOUGHT = "thought\n"  # the label of the reasoning channel
# Control tags that mean nothing where they stray into text: dropped.
STRAY = (CHANNEL_END, "<|tool>", "<tool|>", "<|think|>", "<|turn>", "<turn|>")
TOOL_STRAY = (TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END)
CALL_ENDS = (TOOL_CALL_END, TOOL_CALL, TOOL_RESPONSE, TOOL_RESPONSE_END)  # what ends a call's body
STOP_TOKENS = ("<turn|>", TOOL_RESPONSE)  # end a reply: the turn, or a turn that waits for tool results
MAX_DEPTH = 64  # nesting allowed in a tool call's arguments


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A tool call the model made: `index` counts the calls of one reply from 0."""

    name: str
    arguments: dict
    index: int = 0

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclasses.dataclass(frozen=True)
class Delta:
    """A piece of output: `kind` "content" or "reasoning" with `text`, or "tool_call" with `call`."""

    kind: str
    text: str = ""
    call: Optional[ToolCall] = None


@dataclasses.dataclass
class Reply:
    """A reply assembled from its deltas."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list = dataclasses.field(default_factory=list)

    def add(self, deltas: Iterable[Delta]) -> None:
        for d in deltas:
            if d.kind == "tool_call":
                self.tool_calls.append(d.call)
            elif d.kind == "reasoning":
                self.reasoning += d.text
            else:
                self.content += d.text

    def message(self) -> dict:
        """The reply as an assistant message, for the history of the next turn."""
        message: dict = {"role": "assistant", "content": self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": f"call_{c.index}", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls]
        return message


# ---- rendering -----------------------------------------------------------------------------------


class Prompt(NamedTuple):
    """A rendered prompt; `open` is the text after a reasoning channel the prompt leaves open
    (None when it leaves none open), which is where the model's output starts."""

    text: str
    tokens: list
    open: Optional[str] = None

    def parser(self, tools: bool = True) -> "OutputParser":
        """A parser for the model's output after this prompt."""
        return OutputParser(tools=tools, reasoning=self.open)


def render(tokenizer, messages: Sequence[Mapping], tools: Optional[Sequence[Mapping]] = None, *,
           enable_thinking: bool = False, add_generation_prompt: bool = True, continue_final_message: bool = False,
           template_kwargs: Optional[Mapping] = None) -> Prompt:
    """Render `messages` (and `tools`) with the tokenizer's chat template, as transformers'
    `apply_chat_template` does, and tokenize the text (the template writes `<bos>` itself).

    `continue_final_message`: the last (assistant) message is left open for the model to go on.

    Raises:
        ValueError: malformed messages or tools, or the template refused them.
    """
    text = render_text(tokenizer, messages, tools, enable_thinking=enable_thinking,
                       add_generation_prompt=add_generation_prompt and not continue_final_message,
                       continue_final_message=continue_final_message, template_kwargs=template_kwargs)
    tokens = list(tokenizer.encode(text, add_special_tokens=False))
    start = text.rfind(CHANNEL)  # a channel left open in the generation prompt (after the last turn tag)
    is_open = start > max(text.rfind(CHANNEL_END), text.rfind("<|turn>"))
    return Prompt(text, tokens, text[start + len(CHANNEL):] if is_open else None)


def render_text(tokenizer, messages: Sequence[Mapping], tools: Optional[Sequence[Mapping]] = None, *,
                enable_thinking: bool = False, add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: Optional[Mapping] = None) -> str:
    import jinja2  # transformers renders with it

    check_messages(messages)
    check_tools(tools)
    kwargs = {**(template_kwargs or {}), "enable_thinking": bool(enable_thinking)}  # mlx-lm would default it on
    try:
        return tokenizer.apply_chat_template(
            [dict(m) for m in messages], tools=list(tools) if tools else None, tokenize=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message, **kwargs)
    except RecursionError:
        raise ValueError("the messages or tools are nested too deeply for the chat template") from None
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
        # raise_exception() in the template, or a message shape it cannot handle
        raise ValueError(f"the chat template cannot render these messages: {e}") from None


def turn_ends(tokens: Sequence[int], end_ids: Iterable[int]) -> list[int]:
    """Where the turns of a rendered conversation end: after each token that ends one (the
    model's stop tokens: templates close every message with `<turn|>`, and a reply that calls
    tools stops at `<|tool_response>`). A later prompt that renders more of the conversation has
    the same tokens up to there, unless the template rewrites a turn once later ones follow
    (Gemma drops earlier reasoning): a prefix cache keeps states there. One pass over the tokens."""
    ends = frozenset(end_ids)
    return [i + 1 for i, t in enumerate(tokens) if t in ends]


def check_messages(messages: Any) -> None:
    """Raise ValueError unless `messages` is a non-empty list of messages as described above."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise ValueError(f"messages[{i}] needs a role among system, developer, user, assistant, tool")
        if not isinstance(m.get("content"), (str, list, tuple, type(None))):
            raise ValueError(f"messages[{i}].content must be a string, a list of parts, or null")
        for j, call in enumerate(m.get("tool_calls") or ()):
            function = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise ValueError(f"messages[{i}].tool_calls[{j}] needs a function with a name")
            if not isinstance(function.get("arguments", {}), Mapping):
                raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments must be an object")


def check_tools(tools: Any) -> None:
    """Raise ValueError unless `tools` is None or a list of function declarations."""
    if tools is None:
        return
    if not isinstance(tools, (list, tuple)):
        raise ValueError("tools must be a list")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if tool.get("type") != "function" or not isinstance(function, Mapping) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., ...}}}}')
        if not isinstance(function.get("parameters", {}), Mapping):
            raise ValueError(f"tools[{i}].function.parameters must be an object (a JSON schema)")


def stop_tokens(tokenizer) -> set[int]:
    """Ids of the tokens that end a Gemma 4 reply, where the vocabulary has them."""
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    return {vocab[t] for t in STOP_TOKENS if t in vocab}


# ---- output --------------------------------------------------------------------------------------


class OutputParser:
    """Splits the model's output text, fed piece by piece, into `Delta`s.

    Args:
        tools: parse tool calls (else the call syntax stays text, as when no tools were given).
        reasoning: the output starts inside a reasoning channel the prompt opened, after this
            text of the channel (see `Prompt.open`); None: it starts as content.

    Text that may be the start of a control tag is held back until the next piece decides.
    Stray tags (a close tag with no open one, a tool response the model should not write) are
    dropped. A call that does not parse comes back as the text the model wrote.
    """

    def __init__(self, tools: bool = True, reasoning: Optional[str] = None):
        self.tools = tools
        self.state = "content" if reasoning is None else "reasoning"
        self.label = THOUGHT[len(reasoning):] if reasoning is not None and THOUGHT.startswith(reasoning) else ""
        self.buf = ""
        self.calls = 0
        self._scan, self._quoted = 0, False  # how far a call's body was scanned, inside a string there
        tags = (CHANNEL, *STRAY) + ((TOOL_CALL, *TOOL_STRAY) if tools else ())
        self._tags = {"content": tags, "reasoning": tags}

    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        out: list[Delta] = []
        while self._step(out, final=False):
            pass
        return merge(out)

    def finish(self) -> list[Delta]:
        """What is still held back, once the output has ended."""
        out: list[Delta] = []
        while self._step(out, final=True):
            pass
        if self.state == "call":
            self._end_call(out, self.buf)
        elif self.buf:
            out.append(Delta(self.state, self.buf))
        self.buf, self.state = "", "content"
        return merge(out)

    def _step(self, out: list, final: bool) -> bool:
        """Consume what can be decided; False when the rest must wait."""
        if self.state == "call":
            return self._step_call(out)
        if self.state == "reasoning" and self.label:
            if self.buf.startswith(self.label):
                self.buf = self.buf[len(self.label):]
            elif self.label.startswith(self.buf) and not final:
                return False
            self.label = ""
        at, tag = _first(self.buf, self._tags[self.state])
        if tag is None:
            keep = 0 if final else _partial(self.buf, self._tags[self.state])
            if len(self.buf) > keep:
                out.append(Delta(self.state, self.buf[: len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
            return False
        if at:
            out.append(Delta(self.state, self.buf[:at]))
        self.buf = self.buf[at + len(tag):]
        if tag == CHANNEL:
            self.state, self.label = "reasoning", THOUGHT
        elif tag == CHANNEL_END and self.state == "reasoning":
            self.state = "content"
        elif tag == TOOL_CALL:
            self.state, self._scan, self._quoted = "call", 0, False
        return True

    def _step_call(self, out: list) -> bool:
        """Look for the end of the call's body: a close tag, the next call, or a tool response,
        outside its strings (a string may hold any text, braces and tags included)."""
        buf, i = self.buf, self._scan
        while i < len(buf):
            if buf[i] != "<":
                i += 1
                continue
            rest = buf[i:]
            if rest.startswith(QUOTE):
                self._quoted = not self._quoted
                i += len(QUOTE)
                continue
            tag = None if self._quoted else next((t for t in CALL_ENDS if rest.startswith(t)), None)
            if tag is not None:
                self._end_call(out, buf[:i], tag if tag == TOOL_CALL_END else "")
                self.buf = rest if tag == TOOL_CALL else rest[len(tag):]  # a next call starts afresh
                self.state = "content"
                return True
            if any(t.startswith(rest) for t in (QUOTE, *CALL_ENDS)):
                break  # a tag may be arriving: wait for the next piece
            i += 1
        self._scan = i
        return False

    def _end_call(self, out: list, body: str, close: str = "") -> None:
        parsed = parse_call(body)
        if parsed is None:  # not a call after all: what the model wrote is the answer
            out.append(Delta("content", TOOL_CALL + body + close))
            return
        name, arguments, rest = parsed
        out.append(Delta("tool_call", call=ToolCall(name, arguments, self.calls)))
        self.calls += 1
        if rest.strip():
            out.append(Delta("content", rest))


def parse(text: str, tools: bool = True, reasoning: Optional[str] = None) -> Reply:
    """A whole output at once (see `OutputParser`)."""
    parser, reply = OutputParser(tools, reasoning), Reply()
    reply.add(parser.feed(text))
    reply.add(parser.finish())
    return reply


def _first(text: str, tags: Sequence[str]) -> tuple[int, Optional[str]]:
    best, found = len(text), None
    for tag in tags:
        i = text.find(tag, 0, best + len(tag))
        if i != -1 and i < best:
            best, found = i, tag
    return best, found


def _partial(text: str, tags: Sequence[str]) -> int:
    """Length of the longest tail of `text` that a tag starts with."""
    start = text.rfind("<", max(0, len(text) - max(map(len, tags))))
    while start != -1:
        tail = text[start:]
        if any(t.startswith(tail) for t in tags):
            return len(tail)
        start = text.find("<", start + 1)
    return 0


def merge(deltas: Iterable[Delta]) -> list[Delta]:
    """Adjacent text deltas of one kind as one; empty ones dropped."""
    out: list[Delta] = []
    for d in deltas:
        if d.kind != "tool_call" and not d.text:
            continue
        if out and d.kind == out[-1].kind and d.kind != "tool_call":
            out[-1] = Delta(d.kind, out[-1].text + d.text)
        else:
            out.append(d)
    return out


# ---- the tool-call syntax ------------------------------------------------------------------------


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
