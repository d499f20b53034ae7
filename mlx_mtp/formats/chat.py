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
not parse, as the text the model wrote less its control tokens (no text ever holds one).

`render(..., as_generated=True)` renders a history the way the model generated it (see
`render_generated`), where Gemma 4's template re-renders replies otherwise; with any other
template, each reply is spliced in as generated (`render_spliced`), where templates trim it.
"""

from __future__ import annotations

import dataclasses
import json
import re
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
    (None when it leaves none open), which is where the model's output starts; `thinking`: it
    was rendered with thinking on."""

    text: str
    tokens: list
    open: Optional[str] = None
    thinking: bool = False

    @property
    def reasoning(self) -> Optional[bool]:
        """Whether the reply may reason before it answers (the one place that decides it, for
        the output's parser and its grammar): True when the prompt left a reasoning channel
        open (the reply starts inside it), False when thinking is on (the reply may open one),
        None when neither."""
        return True if self.open is not None else (False if self.thinking else None)

    def parser(self, tools: bool = True) -> "OutputParser":
        """A parser for the model's output after this prompt."""
        return OutputParser(tools=tools, reasoning=self.open)


def render(tokenizer, messages: Sequence[Mapping], tools: Optional[Sequence[Mapping]] = None, *,
           enable_thinking: bool = False, add_generation_prompt: bool = True, continue_final_message: bool = False,
           template_kwargs: Optional[Mapping] = None, as_generated: bool = False,
           replies: Optional[Mapping[str, Sequence[int]]] = None) -> Prompt:
    """Render `messages` (and `tools`) with the tokenizer's chat template, as transformers'
    `apply_chat_template` does, and tokenize the text (the template writes `<bos>` itself).

    `continue_final_message`: the last (assistant) message is left open for the model to go on.
    `as_generated`: earlier replies render as the model generated them (`render_generated`, or
    `render_spliced` with the token ids in `replies`, reply text -> ids, where they are known).

    Raises:
        ValueError: malformed messages or tools, or the template refused them.
    """
    options = dict(enable_thinking=enable_thinking, continue_final_message=continue_final_message,
                   template_kwargs=template_kwargs)
    text = render_generated(tokenizer, messages, tools, **options) if as_generated and add_generation_prompt \
        else None
    if text is None and as_generated and add_generation_prompt:
        spliced = render_spliced(tokenizer, messages, tools, replies or {}, **options)
        if spliced is not None:
            return spliced
    if text is None:
        text = render_text(tokenizer, messages, tools, add_generation_prompt=add_generation_prompt
                           and not continue_final_message, **options)
    tokens = list(tokenizer.encode(text, add_special_tokens=False))
    return Prompt(text, tokens, _open_channel(text), enable_thinking)  # a channel the prompt left open


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


def has_tool_calls(tokenizer) -> bool:
    """Whether the tokenizer's chat template can say Gemma 4's tool calls."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and TOOL_CALL in template


def token_id(tokenizer, text: str) -> Optional[int]:
    """The id of the token spelled `text` (a control token), or None where the vocabulary has none."""
    return tokenizer.get_vocab().get(text) if tokenizer is not None else None


def stop_tokens(tokenizer) -> set[int]:
    """Ids of the tokens that end a Gemma 4 reply, where the vocabulary has them."""
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    return {vocab[t] for t in STOP_TOKENS if t in vocab}


# ---- histories as the model generated them -------------------------------------------------------
#
# Gemma 4's template re-renders an earlier reply unlike the tokens the model wrote: text after the
# tool responses instead of before the calls, no empty thought channel where the generation prompt
# had one, arguments in sorted order, a trimmed answer, and a model turn left open before the
# user's next text. The model then reads a turn it did not write, and the prefix cache parts
# ways inside every such turn. So the head (everything before the first reply) is the template's
# own, and what follows is written here: each reply as generated after the generation prompt the
# template gave it, the tool responses after it in the template's block syntax, and a closed
# model turn before the next user or system message.

TURN, TURN_END = "<|turn>", "<turn|>"


def render_generated(tokenizer, messages: Sequence[Mapping], tools: Optional[Sequence[Mapping]] = None, *,
                     enable_thinking: bool = False, continue_final_message: bool = False,
                     template_kwargs: Optional[Mapping] = None) -> Optional[str]:
    """The prompt text of `messages` with earlier replies as the model generated them (see
    above), ending with the generation prompt; None where the template's own rendering stands
    (not Gemma 4's template, no reply in the history, or a history that starts with one)."""
    first = next((i for i, m in enumerate(messages) if isinstance(m, Mapping)
                  and m.get("role") in ("assistant", "tool")), None)
    template = getattr(tokenizer, "chat_template", None)
    if not first or not isinstance(template, str) or TOOL_CALL not in template or TURN not in template \
            or any("tool_responses" in m for m in messages):
        return None
    check_messages(messages)
    options = dict(enable_thinking=enable_thinking, template_kwargs=template_kwargs)
    head = render_text(tokenizer, messages[:first], tools, add_generation_prompt=False, **options)
    openers = _openers(tokenizer, **options)
    return head + _turns(messages[first:], openers, continue_final_message)


# Any other template: it renders each reply with a mark in its place (digits between control
# characters: trimmed, cased and escaped unchanged), and the reply goes in as generated, its token
# ids where the caller kept them. Every stretch of template text between replies is tokenized on
# its own, the same stretches at every turn, so a conversation's tokens only ever grow at the end.
_MARK = "\x00\x01{}\x01\x00"
_MARKS = re.compile("\x00\x01(\\d+)\x01\x00")


def render_spliced(tokenizer, messages: Sequence[Mapping], tools: Optional[Sequence[Mapping]],
                   replies: Mapping[str, Sequence[int]], *, enable_thinking: bool = False,
                   continue_final_message: bool = False, template_kwargs: Optional[Mapping] = None) -> Optional[Prompt]:
    """`messages` rendered by the template with each text reply as generated: its ids from
    `replies` (reply text -> ids, without the stop token), else its text tokenized untrimmed.
    None where there is no such reply, or the template does not render each in its place."""
    check_messages(messages)
    spots = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and isinstance(m.get("content"), str)
             and not m.get("tool_calls")]
    if not spots:
        return None
    marked = [dict(m, content=_MARK.format(i)) if i in spots else m for i, m in enumerate(messages)]
    rendered = render_text(tokenizer, marked, tools, enable_thinking=enable_thinking,
                           add_generation_prompt=not continue_final_message,
                           continue_final_message=continue_final_message, template_kwargs=template_kwargs)
    parts = _MARKS.split(rendered)  # template text, reply index, template text, ...
    if [int(i) for i in parts[1::2]] != spots:
        return None
    texts, tokens = [], []
    for k, part in enumerate(parts):
        text = messages[int(part)]["content"] if k % 2 else part
        ids = replies.get(text) if k % 2 else None
        texts.append(text)
        tokens += list(ids) if ids is not None else list(tokenizer.encode(text, add_special_tokens=False))
    text = "".join(texts)
    return Prompt(text, tokens, _open_channel(text), enable_thinking)


def _openers(tokenizer, **options) -> tuple[str, str]:
    """The template's generation prompts: after a user's turn, and after tool responses."""
    user = [{"role": "user", "content": "x"}]
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"id": "0", "type": "function", "function": {"name": "f", "arguments": {}}}]}
    after_tool = [*user, call, {"role": "tool", "tool_call_id": "0", "content": "y"}]
    out = []
    for probe in (user, after_tool):
        base = render_text(tokenizer, probe, add_generation_prompt=False, **options)
        full = render_text(tokenizer, probe, add_generation_prompt=True, **options)
        if not full.startswith(base):
            raise ValueError("the chat template's generation prompt rewrites the conversation before it")
        out.append(full[len(base):])
    return out[0], out[1]


def _turns(messages: Sequence[Mapping], openers: tuple[str, str], continue_final: bool) -> str:
    after_user, after_tool = openers
    out, in_turn, names = [], False, {}  # in_turn: a model turn is open (it made calls)
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "assistant":
            opener = after_tool if in_turn else after_user
            calls = m.get("tool_calls") or []
            out.append(_reply(m, opener))
            if continue_final and i == len(messages) - 1:
                return "".join(out)  # left open for the model to go on
            names = {c.get("id"): c["function"]["name"] for c in calls}
            in_turn = bool(calls)
            out.append("" if calls else TURN_END + "\n")
        elif role == "tool":
            name = names.get(m.get("tool_call_id")) or m.get("name") or "unknown"
            out.append(_tool_response(name, m.get("content")))
            in_turn = True
        else:
            out.append((TURN_END + "\n" if in_turn else "") + f"{TURN}{role}\n{_user_text(m.get('content'))}"
                       f"{TURN_END}\n")
            in_turn = False
    return "".join(out) + (after_tool if in_turn else after_user)


def _reply(message: Mapping, opener: str) -> str:
    """A reply as generated after `opener` (the generation prompt it followed): reasoning, answer
    text, then its calls."""
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    empty = CHANNEL + THOUGHT + CHANNEL_END  # what a generation prompt with thinking off may close at once
    if _open_channel(opener) is not None:  # the generation prompt opened the reasoning channel
        head = reasoning + CHANNEL_END
    elif reasoning:  # (thought with thinking on, where this prompt has it off: its thought, not an empty one)
        head = CHANNEL + THOUGHT + reasoning + CHANNEL_END
        opener = opener.removesuffix(empty)
    else:
        head = ""
    calls = "".join(call_text(c["function"]["name"], c["function"].get("arguments") or {})
                    for c in message.get("tool_calls") or [])
    return opener + head + _text(message.get("content")) + calls


def call_text(name: str, arguments: Mapping) -> str:
    """A tool call in Gemma 4's syntax, its arguments in their given order (the model's)."""
    return f"{TOOL_CALL}call:{name}{_argument(dict(arguments))}{TOOL_CALL_END}"


def _argument(value: Any) -> str:
    """A value as the template's `format_argument` writes it (keys bare, in the given order)."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_argument(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_argument(v) for v in value) + "]"
    return "null" if value is None else str(value)


def _tool_response(name: str, content: Any) -> str:
    """The template's `format_tool_response_block`."""
    if isinstance(content, Mapping):
        body = ",".join(f"{k}:{_argument(content[k])}" for k in sorted(content))
    else:
        body = "value:" + _argument(_text(content))
    return f"{TOOL_RESPONSE}response:{name}{{{body}}}{TOOL_RESPONSE_END}"


def _user_text(content: Any) -> str:
    """A user or system message as Gemma 4's template writes it: text trimmed, and an image part as
    its placeholder, each part trimmed on its own where the content has an image."""
    if not isinstance(content, (list, tuple)) or not any(isinstance(p, Mapping) and p.get("type") == "image"
                                                         for p in content):
        return _text(content).strip()
    return "".join("<|image|>" if p.get("type") == "image" else (p.get("text") or "").strip()
                   for p in content if isinstance(p, Mapping))


def _text(content: Any) -> str:
    if isinstance(content, (list, tuple)):  # text parts
        return "".join(p.get("text") or "" for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return content or ""


def _open_channel(text: str) -> Optional[str]:
    """The text after a reasoning channel `text` leaves open (after its last turn tag), or None."""
    start = text.rfind(CHANNEL)
    is_open = start >= 0 and start > max(text.rfind(CHANNEL_END), text.rfind(TURN))
    return text[start + len(CHANNEL):] if is_open else None


# ---- output --------------------------------------------------------------------------------------


class OutputParser:
    """Splits the model's output text, fed piece by piece, into `Delta`s.

    Args:
        tools: parse tool calls (else the call syntax stays text, as when no tools were given).
        reasoning: the output starts inside a reasoning channel the prompt opened, after this
            text of the channel (see `Prompt.open`); None: it starts as content.

    Text that may be the start of a control tag is held back until the next piece decides.
    Stray tags (a close tag with no open one, a tool response the model should not write, a call
    where no tools were given) are dropped and `<|"|>` becomes `"`: no text holds a control token.
    A call that does not parse comes back as the text the model wrote, less its control tokens;
    one the output's end cuts short (`finish(cut=True)`) is dropped.
    """

    def __init__(self, tools: bool = True, reasoning: Optional[str] = None):
        self.tools = tools
        self.state = "content" if reasoning is None else "reasoning"
        self.label = THOUGHT[len(reasoning):] if reasoning is not None and THOUGHT.startswith(reasoning) else ""
        self.buf = ""
        self.calls = 0
        self._scan, self._quoted = 0, False  # how far a call's body was scanned, inside a string there
        tags = (CHANNEL, QUOTE, *STRAY, TOOL_CALL, *TOOL_STRAY)
        self._tags = {"content": tags, "reasoning": tags}

    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        out: list[Delta] = []
        while self._step(out, final=False):
            pass
        return merge(out)

    def finish(self, cut: bool = False) -> list[Delta]:
        """What is still held back, once the output has ended (`cut`: by its token budget, so
        a call still open is dropped unless its arguments are complete)."""
        out: list[Delta] = []
        while self._step(out, final=True):
            pass
        if self.state == "call":
            self._end_call(out, self.buf, drop=cut)
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
        elif tag == TOOL_CALL and self.tools:
            self.state, self._scan, self._quoted = "call", 0, False
        elif tag == QUOTE:
            out.append(Delta(self.state, '"'))
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
                self._end_call(out, buf[:i])
                self.buf = rest if tag == TOOL_CALL else rest[len(tag):]  # a next call starts afresh
                self.state = "content"
                return True
            if any(t.startswith(rest) for t in (QUOTE, *CALL_ENDS)):
                break  # a tag may be arriving: wait for the next piece
            i += 1
        self._scan = i
        return False

    def _end_call(self, out: list, body: str, drop: bool = False) -> None:
        parsed = parse_call(body)
        if parsed is None:  # not a call after all (or cut short): what the model wrote is the answer
            if not drop:
                out.append(Delta("content", plain(body)))
            return
        name, arguments, rest = parsed
        out.append(Delta("tool_call", call=ToolCall(name, arguments, self.calls)))
        self.calls += 1
        if rest.strip():
            out.append(Delta("content", plain(rest)))


def plain(text: str) -> str:
    """`text` without control tokens: tags dropped, Gemma's string quote as `"`."""
    text = text.replace(QUOTE, '"')
    for tag in (CHANNEL, *STRAY, TOOL_CALL, *TOOL_STRAY):
        text = text.replace(tag, "")
    return text


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
