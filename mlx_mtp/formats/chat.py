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

from .markup import END, START, Markup, markup as markup_of
from .toolcall import QUOTE, TOOL_CALL, TOOL_CALL_END, call_text, format_argument, parse_call

TOOL_RESPONSE, TOOL_RESPONSE_END = "<|tool_response>", "<tool_response|>"
CHANNEL, CHANNEL_END = "<|channel>", "<channel|>"
THOUGHT = "thought\n"  # the label of the reasoning channel
# Control tags that mean nothing where they stray into text: dropped.
STRAY = (CHANNEL_END, "<|tool>", "<tool|>", "<|think|>", "<|turn>", "<turn|>")
TOOL_STRAY = (TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END)
CALL_ENDS = (TOOL_CALL_END, TOOL_CALL, TOOL_RESPONSE, TOOL_RESPONSE_END)  # what ends a call's body
STOP_TOKENS = ("<turn|>", TOOL_RESPONSE)  # end a reply: the turn, or a turn that waits for tool results
# Gemma 4's markup: control tokens wherever a vocabulary has them (`markup.Markup`); the output's
# parser reads the first ones (`PARSED`), every other control token is no text in a reply.
MEDIA = ("<|image>", "<|image|>", "<image|>", "<|audio>", "<|audio|>", "<audio|>", "<|video|>")
PARSED = (CHANNEL, CHANNEL_END, QUOTE, TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END,
          "<|tool>", "<tool|>", "<|think|>", "<|turn>", "<turn|>")
PROTOCOL = PARSED + MEDIA
HISTORIES = ("generated", "template")  # how earlier replies render: see `render`


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
           template_kwargs: Optional[Mapping] = None, as_generated: bool = False, keep_thinking: bool = False,
           replies: Optional[Mapping[str, Sequence[int]]] = None, content_as_text: bool = True) -> Prompt:
    """Render `messages` (and `tools`) with the tokenizer's chat template, as transformers'
    `apply_chat_template` does, and tokenize the text (the template writes `<bos>` itself).

    `continue_final_message`: the last (assistant) message is left open for the model to go on.
    `as_generated`: earlier replies render as the model generated them (`render_generated`, or
    `render_spliced` with the token ids in `replies`, reply text -> ids, where they are known),
    a reply's reasoning left out once its model turn is over and a user or system message came, as
    Gemma 4's model card asks (within a tool-call loop it stays), unless `keep_thinking`. Otherwise
    the prompt is the template's own rendering, token for token.
    `content_as_text`: every string of the request (content, tool calls and results, tools,
    template variables) is tokenized as text, so only the template's markup makes control tokens
    (`markup`); False parses control strings in them too, as `apply_chat_template` does.

    Raises:
        ValueError: malformed messages or tools, or the template refused them.
    """
    mk = tokenizer_markup(tokenizer) if content_as_text else None
    if mk is not None:
        check_messages(messages)  # (as the caller wrote them: the errors name their fields)
        messages, tools = mk.mark(list(messages)), mk.mark(tools)
        template_kwargs = mk.mark(dict(template_kwargs)) if template_kwargs else template_kwargs
    options = dict(enable_thinking=enable_thinking, continue_final_message=continue_final_message,
                   template_kwargs=template_kwargs)
    text = None
    if as_generated and add_generation_prompt:
        text = render_generated(tokenizer, messages, tools, keep_thinking=keep_thinking, **options)
        if text is None:
            spliced = render_spliced(tokenizer, messages, tools, replies or {}, markup=mk, **options)
            if spliced is not None:
                return spliced
    if text is None:
        text = render_text(tokenizer, messages, tools, add_generation_prompt=add_generation_prompt
                           and not continue_final_message, **options)
    return _prompt(tokenizer, mk, text, enable_thinking)


def tokenizer_markup(tokenizer) -> Markup:
    """The tokenizer's template markup apart from request text (Gemma 4's tags among its controls)."""
    return markup_of(tokenizer, PROTOCOL, PARSED)


def hidden_ids(tokenizer) -> frozenset:
    """Control tokens that are no text in a reply: all but the tags the output's parser reads."""
    return tokenizer_markup(tokenizer).hidden


def reply_message(tokenizer, ids: Sequence[int], prompt: "Prompt", tools: bool = True) -> dict:
    """The assistant message a reply's ids (without the stop token) stand for: its content,
    reasoning and tool calls as the output's parser reads them (`Reply.message`)."""
    hidden = hidden_ids(tokenizer)
    return parse(tokenizer.decode([t for t in ids if t not in hidden]), tools, prompt.open).message()


def _prompt(tokenizer, mk: Optional[Markup], text: str, thinking: bool, tokens: Optional[list] = None) -> Prompt:
    """A rendered text (its request strings marked where `mk` is given) as a `Prompt`."""
    if mk is None:
        tokens = list(tokenizer.encode(text, add_special_tokens=False)) if tokens is None else tokens
        return Prompt(text, tokens, _open_channel(text), thinking)
    tokens = mk.tokens(text) if tokens is None else tokens
    return Prompt(mk.unmark(text), tokens, _open_channel(mk.markup_only(text)), thinking)  # the template's channel


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
        message = str(e).replace(START, "").replace(END, "")  # (request strings come back marked)
        raise ValueError(f"the chat template cannot render these messages: {message}") from None


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
                     template_kwargs: Optional[Mapping] = None, keep_thinking: bool = False) -> Optional[str]:
    """The prompt text of `messages` with earlier replies as the model generated them (see
    above), ending with the generation prompt; None where the template's own rendering stands
    (not Gemma 4's template, no reply in the history, or a history that starts with one). A
    reply's reasoning is left out once its model turn is over (`_turns_ended`), unless `keep_thinking`."""
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
    return head + _turns(messages[first:], openers, continue_final_message, keep_thinking)


# Any other template: it renders each reply with a mark in its place (digits between control
# characters: trimmed, cased and escaped unchanged), and the reply goes in as generated, its token
# ids where the caller kept them. Every stretch of template text between replies is tokenized on
# its own, the same stretches at every turn, so a conversation's tokens only ever grow at the end.
_MARK = "\x00\x01{}\x01\x00"
_MARKS = re.compile("\x00\x01(\\d+)\x01\x00")


def render_spliced(tokenizer, messages: Sequence[Mapping], tools: Optional[Sequence[Mapping]],
                   replies: Mapping[str, Sequence[int]], *, enable_thinking: bool = False,
                   continue_final_message: bool = False, template_kwargs: Optional[Mapping] = None,
                   markup: Optional[Markup] = None) -> Optional[Prompt]:
    """`messages` rendered by the template with each text reply as generated: its ids from
    `replies` (reply text -> ids, without the stop token), else its text tokenized untrimmed
    (as text, where `markup` marked the request's strings). None where there is no such reply,
    or the template does not render each in its place."""
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
    mk = markup
    texts, tokens = [], []
    for k, part in enumerate(parts):
        if k % 2:  # a reply: its ids as generated, else its text
            text = messages[int(part)]["content"]
            ids = replies.get(mk.unmark(text) if mk else text)
            if ids is None:
                ids = mk.tokens(text) if mk else tokenizer.encode(text, add_special_tokens=False)
        else:
            text, ids = part, mk.tokens(part) if mk else tokenizer.encode(part, add_special_tokens=False)
        texts.append(text)
        tokens += list(ids)
    return _prompt(tokenizer, mk, "".join(texts), enable_thinking, tokens)


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


def _turns(messages: Sequence[Mapping], openers: tuple[str, str], continue_final: bool,
           keep_thinking: bool = False) -> str:
    after_user, after_tool = openers
    out, in_turn, names = [], False, {}  # in_turn: a model turn is open (it made calls)
    ended = _turns_ended(messages)
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "assistant":
            opener = after_tool if in_turn else after_user
            calls = m.get("tool_calls") or []
            out.append(_reply(m, opener, thought=keep_thinking or not ended[i]))
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


def _turns_ended(messages: Sequence[Mapping]) -> list[bool]:
    """For each message, whether it is a reply of a model turn that is over: the turn ended with
    a reply that calls no tool, and a user or system message came after it. Its reasoning goes;
    within a tool-call loop (reminders beside tool results included) it stays."""
    ended, over, user_after = [False] * len(messages), False, False
    for i in reversed(range(len(messages))):
        role = messages[i]["role"]
        if role == "assistant":
            if not messages[i].get("tool_calls"):  # the reply that ends its turn
                over = user_after
            ended[i] = over
        elif role != "tool":
            user_after = True
    return ended


def _reply(message: Mapping, opener: str, thought: bool = True) -> str:
    """A reply as generated after `opener` (the generation prompt it followed): reasoning, answer
    text, then its calls. Without its `thought`, a reply that reasoned renders as the template
    renders it: no reasoning channel at all."""
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    empty = CHANNEL + THOUGHT + CHANNEL_END  # what a generation prompt with thinking off may close at once
    if reasoning and not thought:
        head, at = "", opener.find(CHANNEL)
        opener = opener if at < 0 else opener[:at]
    elif _open_channel(opener) is not None:  # the generation prompt opened the reasoning channel
        head = reasoning + CHANNEL_END
    elif reasoning:  # (thought with thinking on, where this prompt has it off: its thought, not an empty one)
        head = CHANNEL + THOUGHT + reasoning + CHANNEL_END
        opener = opener.removesuffix(empty)
    else:
        head = ""
    calls = "".join(call_text(c["function"]["name"], c["function"].get("arguments") or {})
                    for c in message.get("tool_calls") or [])
    return opener + head + _text(message.get("content")) + calls


def _tool_response(name: str, content: Any) -> str:
    """The template's `format_tool_response_block`."""
    if isinstance(content, Mapping):
        body = ",".join(f"{k}:{format_argument(content[k])}" for k in sorted(content))
    else:
        body = "value:" + format_argument(_text(content))
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
