"""Template markup apart from request text: a chat's control tokens come only from the template.

A chat template writes its markup (`<|turn>`, `<|tool_call>`, `<|image|>`...) around strings that
come from a request: message content of every role, tool results, earlier replies, tool-call names
and arguments, tool declarations, documents. Tokenized as one string, a control token spelled in
any of those strings becomes the real token, and a web page, a mail or a tool's output can forge a
system turn or a tool result. So, as transformers' `apply_chat_template(..., sanitize_control_tokens=True)`
does (5.23), every control token in a request string is wrapped in private-use markers before the
template renders (`mark`), and the rendered text is tokenized with each marked token as plain text
and the rest as usual (`tokens`): the template's own markup stays markup. The template still sees
the strings as they are (Gemma's strips a reasoning channel a reply's text carries), and a string
with no control token in it tokenizes exactly as before. Unlike transformers, dict keys (argument
and property names) are marked too: they are request text as well.

The control tokens of a tokenizer, as transformers counts them: its added tokens flagged special,
and the added tokens its chat template's literal text holds (but whitespace, such as Gemma's "\\n").
"""

from __future__ import annotations

import re
import threading
import weakref
from typing import Any, Iterable, Mapping

# Private-use markers around a control token of a request string (transformers' own choice of code
# points, so that a rendered text reads the same to both).
START, END = "\U000f0000", "\U000f0001"


class Markup:
    """How one tokenizer's chat text becomes ids with control tokens only where the template wrote them.

    Args:
        tokenizer: mlx-lm's `TokenizerWrapper` (or a transformers tokenizer).
        protocol: more control strings (an output format's tags), where the vocabulary has them.
        parsed: the control strings an output's parser reads; every other control token is no text
            in a reply (`hidden`).
    """

    def __init__(self, tokenizer, protocol: Iterable[str] = (), parsed: Iterable[str] = ()):
        self.tokenizer = tokenizer
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        literal = _literal_text(getattr(tokenizer, "chat_template", None))
        protocol = set(protocol)
        added = getattr(hf, "added_tokens_decoder", {}) or {}
        self.controls: dict[str, int] = {
            t.content: i for i, t in added.items() if t.content and not t.content.isspace()
            and (getattr(t, "special", False) or t.content in literal or t.content in protocol)}
        self.control_ids = frozenset(self.controls.values())
        parsed = set(parsed)
        self.hidden = frozenset(i for t, i in self.controls.items() if t not in parsed)
        tokens = "|".join(map(re.escape, sorted(self.controls, key=len, reverse=True))) or "(?!)"
        self._control = re.compile(tokens)
        self._marked = re.compile(f"{START}({tokens}){END}|[{START}{END}]")
        self._plain = _plain_encoder(hf)
        self._newline = self._encode("\n")

    def mark(self, value: Any) -> Any:
        """`value` with each control token in its strings (keys too; lists, tuples and dicts
        walked) wrapped in markers, and markers already there dropped; anything else as it is."""
        if isinstance(value, str):
            value = value.replace(START, "").replace(END, "") if START in value or END in value else value
            return self._control.sub(lambda m: START + m.group(0) + END, value)
        if isinstance(value, Mapping):
            return {self.mark(k): self.mark(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mark(v) for v in value]
        return value

    def unmark(self, text: str) -> str:
        """`text` as a person reads it: the markers dropped."""
        return text.replace(START, "").replace(END, "") if START in text or END in text else text

    def markup_only(self, text: str) -> str:
        """`text` with the marked tokens dropped: what the template wrote, to look for its tags in."""
        return self._marked.sub("", text) if START in text or END in text else text

    def tokens(self, text: str) -> list[int]:
        """Ids of a rendered text whose request strings were marked: each marked token as plain
        text, the stretches around them as usual. A lone marker (a template that cut a string
        inside one) is dropped, yet still parts the text around it, which can join into no token."""
        pieces = self._marked.split(text)  # text, marked token or None, text, ...
        ids = self._encode(pieces[0])
        for k, piece in enumerate(pieces[1:], start=1):
            if piece:
                ids += self._after_newline(piece, plain=k % 2 == 1)
        return ids

    def text_ids(self, text: str) -> list[int]:
        """Ids of `text` as text: never a control token, whatever it spells."""
        return self.tokens(self.mark(text))

    def _after_newline(self, piece: str, plain: bool) -> list[int]:
        # A piece from inside the text, tokenized as it is there: after a newline, which is then
        # dropped (a SentencePiece tokenizer puts a space before a string's start).
        ids = self._plain_ids("\n" + piece) if plain else self._encode("\n" + piece)
        if ids[: len(self._newline)] == self._newline:
            return ids[len(self._newline):]
        return self._plain_ids(piece) if plain else self._encode(piece)

    def _plain_ids(self, text: str) -> list[int]:
        ids = self._plain(text)
        if self.control_ids.intersection(ids):  # the vocabulary merges plain text into a control
            return [i for part in (text[:1], text[1:]) if part for i in self._plain(part)]
        return ids

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []


def _plain_encoder(hf):
    """text -> ids with no added token matched, special or not: the backend's normalizer,
    pre-tokenizer and model (a fast tokenizer's), else transformers' `split_special_tokens`."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return lambda text: list(hf.encode(text, add_special_tokens=False, split_special_tokens=True))

    def plain(text: str) -> list[int]:
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        splits = [s for s, _ in backend.pre_tokenizer.pre_tokenize_str(text)] if backend.pre_tokenizer else [text]
        return [t.id for s in splits for t in backend.model.tokenize(s)]

    return plain


def _literal_text(template) -> str:
    """The literal strings of a chat template (its text and string constants), apart."""
    if not isinstance(template, str) or not template:
        return ""
    import jinja2
    from jinja2 import nodes

    try:
        ast = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return template
    strings = {n.data for n in ast.find_all(nodes.TemplateData)}
    strings |= {n.value for n in ast.find_all(nodes.Const) if isinstance(n.value, str)}
    return "\0".join(strings)


_MARKUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def markup(tokenizer, protocol: Iterable[str] = (), parsed: Iterable[str] = ()) -> Markup:
    """The tokenizer's `Markup` (with `protocol`'s tags among its controls), made once."""
    with _LOCK:
        found = _MARKUPS.get(tokenizer)
        if found is None:
            found = _MARKUPS[tokenizer] = Markup(tokenizer, protocol, parsed)
        return found
