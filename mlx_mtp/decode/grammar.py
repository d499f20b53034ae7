"""Structured output: what a reply must match, and each row's grammar state on the host.

`Grammar` is plain data (llguidance's serialized grammar): a JSON schema, a regex, a Lark or GBNF
grammar, a choice of strings, or Gemma 4 tool calls for the given tools. `Vocabulary` is
llguidance's view of a tokenizer, built once per tokenizer; `Matcher` is one row's parser state:
it proposes the tokens the grammar forces (the round drafts them: they cost no forward of their
own), fills the token mask of each verified position, and advances by the tokens emitted.

The mask of position j of a round is the grammar's state after the row's emitted tokens plus
the round's drafts d_1..d_j: the target's distribution there is masked, so acceptance against it
keeps the output exactly that of plain constrained decoding (see `processors`).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import weakref
from typing import Any, Iterable, Mapping, Optional, Sequence

import llguidance
import llguidance.numpy
import numpy as np

# JSON as `json.dumps` writes it: one space after ":" and ",", no other whitespace. Flexible
# whitespace lets a weak model loop on blanks, and fixed separators make keys and punctuation
# forced tokens, which a round drafts for free.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
REASONING_OPEN, REASONING_CLOSE = "<|channel>", "<channel|>"
TEXT = r"/(.|\n)*/"  # any text up to the next special token (lexemes never hold one)


@dataclasses.dataclass(frozen=True)
class Grammar:
    """What a reply must match: llguidance's serialized top-level grammar (`spec`).

    Build one with `json`, `regex`, `cfg`, `choice` or `tool_calls`; `after_reasoning` lets a
    reasoning channel come first.
    """

    spec: str

    @classmethod
    def json(cls, schema: Optional[Mapping] = None) -> "Grammar":
        """A JSON value matching `schema` (None: any JSON object)."""
        schema = {"type": "object"} if schema is None else schema
        if not isinstance(schema, Mapping):
            raise ValueError("a JSON schema must be an object")
        return cls(llguidance.LLMatcher.grammar_from_json_schema(dict(schema), defaults=JSON_OPTIONS))

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        _text(pattern, "regex")
        return cls(llguidance.LLMatcher.grammar_from_regex(pattern))

    @classmethod
    def cfg(cls, grammar: str) -> "Grammar":
        """A context-free grammar in llguidance's Lark syntax or in llama.cpp's GBNF."""
        return cls(_top(llguidance.grammar_from("grammar", _text(grammar, "grammar"))))

    @classmethod
    def choice(cls, options: Sequence[str]) -> "Grammar":
        if not isinstance(options, (list, tuple)) or not options or not all(isinstance(o, str) for o in options):
            raise ValueError("a choice is a non-empty list of strings")
        return cls(_top("start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)))

    @classmethod
    def tool_calls(cls, tools: Sequence[Mapping], name: Optional[str] = None, parallel: bool = True) -> "Grammar":
        """Gemma 4 tool calls (`<|tool_call>call:NAME{key:value,...}<tool_call|>`) to the given
        tools, arguments typed by their schemas and keys in the order the chat template writes
        them: one call of the tool `name`, else one call or more (one when not `parallel`)."""
        return cls(_top(ToolCallGrammar(tools).lark(name, parallel)))

    def after_reasoning(self, opened: bool) -> "Grammar":
        """This grammar after a reasoning channel: one the prompt left open (`opened`), which the
        reply closes first, or else one the reply may open and close before it."""
        head = f"{TEXT} {REASONING_CLOSE}" if opened else f"({REASONING_OPEN} {TEXT} {REASONING_CLOSE})?"
        grammars = json.loads(self.spec)["grammars"]
        body = {**grammars[0], "name": grammars[0].get("name") or "reply"}
        top = {"lark_grammar": f"start: {head} @{body['name']}"}
        return Grammar(json.dumps({"grammars": [top, body, *grammars[1:]]}))


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"a {what} must be a non-empty string")
    return value


def _top(lark: str) -> str:
    """A Lark grammar as a top-level grammar."""
    return json.dumps({"grammars": [{"lark_grammar": lark}]})


# ---- the tokenizer, as llguidance sees it --------------------------------------------------------


class Vocabulary:
    """llguidance's view of a tokenizer (about a second to build for Gemma's 262k tokens: build
    one per tokenizer and share it). `eos_ids` are the tokens that end a reply: a grammar that
    is complete allows them, and only them.

    Args:
        tokenizer: a Hugging Face tokenizer, or mlx-lm's wrapper of one.
        vocab_size: the model's vocabulary (masks cover it).
        eos_ids: the model's stop tokens.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Iterable[int]):
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        hf = tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer
        n = max(int(vocab_size), len(hf))
        self.eos = sorted(int(t) for t in eos_ids)
        try:
            import llguidance.hf

            self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=n, eos_token=self.eos)
        except ValueError:  # a decoder llguidance cannot read (a character-level tokenizer, say)
            self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Pieces(hf, n, self.eos)),
                                                    n_vocab=n, eos_token=self.eos)
        self.vocab_size = int(vocab_size)
        self.words = (n + 31) // 32  # int32 words of one mask
        added = hf.get_added_vocab()
        self.reasoning = REASONING_OPEN in added and REASONING_CLOSE in added  # Gemma 4's channel tokens
        self.others = np.full(self.words, -1, dtype=np.int32)  # every token but the stop tokens
        for t in self.eos:
            self.others.view(np.uint32)[t // 32] &= ~np.uint32(1 << (t % 32))

    def matcher(self, grammar: Grammar) -> "Matcher":
        """A fresh parser state for `grammar`.

        Raises:
            ValueError: the grammar does not compile for this tokenizer (bad schema, regex or
            syntax, a special token the tokenizer lacks).
        """
        error = llguidance.LLMatcher.validate_grammar(grammar.spec, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"the grammar does not compile: {error.strip()}")
        return Matcher(self, llguidance.LLMatcher(self.tokenizer, grammar.spec, log_level=0))


class _Pieces:
    """A tokenizer described token by token (its text, special tokens marked), for llguidance's
    TokenizerWrapper, where llguidance cannot read the tokenizer's own decoder."""

    def __init__(self, hf, n: int, eos: Sequence[int]):
        self.hf = hf
        self.eos_token_id, self.bos_token_id = eos[0], hf.bos_token_id
        added = {i for i in hf.get_added_vocab().values()}
        self.special_token_ids = sorted(set(hf.all_special_ids) | added | set(range(len(hf), n)))
        self.unk = hf.unk_token_id
        self.tokens = [self._bytes(i) for i in range(n)]

    def _bytes(self, i: int) -> bytes:
        if i >= len(self.hf):
            return f"<[{i}]>".encode()
        if i in self.special_token_ids:
            return self.hf.convert_ids_to_tokens(i).encode()
        return self.hf.decode([i]).encode()

    def __call__(self, text) -> list:
        ids = self.hf.encode(text.decode() if isinstance(text, bytes) else text, add_special_tokens=False)
        # Text the vocabulary cannot spell encodes as <unk>: keep only what it can.
        return ids[: ids.index(self.unk)] if self.unk in ids else ids


class Clock:
    """Host time spent in a row's grammar: wall time, and the thread's CPU time (the work itself,
    without the waits for a core that a CPU shared with the device's threads adds)."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def __enter__(self):
        self._started = (time.perf_counter(), time.thread_time())

    def __exit__(self, *exc):
        self.wall += time.perf_counter() - self._started[0]
        self.cpu += time.thread_time() - self._started[1]


class Matcher:
    """One row's grammar state on the host: the tokens emitted so far have been consumed.
    `clock` adds up the host time spent in it (the benchmarks read it)."""

    def __init__(self, vocab: Vocabulary, matcher: "llguidance.LLMatcher"):
        self.vocab, self.m = vocab, matcher
        self.mask = np.empty((1, vocab.words), dtype=np.int32)  # of the current state
        self.dead = False  # no token may follow: the reply ends here ("dead_end")
        self.clock = Clock()
        self._refresh()

    def forced(self, limit: int) -> list:
        """Up to `limit` tokens the grammar forces next (none once it may end)."""
        if limit <= 0 or self.dead or self.m.is_stopped():
            return []
        with self.clock:
            return self.m.compute_ff_tokens()[:limit]

    def masks(self, drafts: Sequence[int], out: np.ndarray) -> int:
        """Fill `out[j]` (int32 bitmask words) with the mask after `drafts[:j]`, j = 0..len(drafts),
        as far as the drafts are allowed (later positions are never reached: left as they are).
        Returns how many drafts may count: all of them, or fewer where a draft leads to a state
        that admits no token (a dead end must come at the start of a round)."""
        with self.clock:
            return self._masks(drafts, out)

    def _masks(self, drafts: Sequence[int], out: np.ndarray) -> int:
        out[0] = self.mask[0]
        taken, count = 0, len(drafts)
        for j, token in enumerate(drafts):
            if not _allowed(out[j], token):
                break
            self.m.consume_token(token)
            taken += 1
            llguidance.numpy.fill_next_token_bitmask(self.m, out, j + 1)
            if self._is_dead(out[j + 1]):
                count = j  # d_{j+1} must be emitted as a round's last token: the next round ends the row
                break
        self.m.rollback(taken)
        return count

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume emitted tokens; `dead` is set when nothing may follow them."""
        with self.clock:
            for token in tokens:
                if self.dead or self.m.is_stopped():
                    break  # a stop token after the grammar ended: the row ends with it
                if not self.m.consume_token(int(token)):
                    self.dead = True  # cannot happen for tokens drawn under the masks
            self._refresh()

    def _refresh(self) -> None:
        if not self.dead:
            llguidance.numpy.fill_next_token_bitmask(self.m, self.mask, 0)
            self.dead = self._is_dead(self.mask[0])

    def _is_dead(self, mask: np.ndarray) -> bool:
        """No token allowed, or only the stop tokens (llguidance's answer to an error) where
        the grammar cannot end."""
        if self.m.is_error():
            return True
        if np.bitwise_and(mask, self.vocab.others).any():  # a token other than a stop token: alive
            return False
        return not (mask.any() and (self.m.is_accepting() or self.m.is_stopped()))


def _allowed(mask: np.ndarray, token: int) -> bool:
    return 0 <= token < 32 * len(mask) and bool((int(mask[token // 32]) >> (token % 32)) & 1)


# ---- Gemma 4 tool calls --------------------------------------------------------------------------


class ToolCallGrammar:
    """Lark rules for Gemma 4 tool calls, from the tools' JSON schemas. Values are written as the
    chat template writes arguments: strings between `<|"|>` tokens, bare numbers, `true` /
    `false`, objects `{key:value,...}` with bare keys in sorted order, lists `[a,b]`."""

    GENERIC = (
        'gvalue: gstring | NUMBER | "true" | "false" | "null" | "None" | garray | gobject\n'
        'gstring: <|"|> TEXT <|"|>\n'
        'garray: "[" (gvalue ("," gvalue)*)? "]"\n'
        'gobject: "{" (KEY ":" gvalue ("," KEY ":" gvalue)*)? "}"\n'
        "KEY: /[A-Za-z_$][A-Za-z0-9_.$-]*/\n"
        "NUMBER: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/\n"
        "INT: /-?(0|[1-9][0-9]*)/\n"
        f"TEXT: {TEXT}\n"
    )

    def __init__(self, tools: Sequence[Mapping]):
        self.tools = [t["function"] for t in tools]
        self.rules: list[str] = []

    def lark(self, name: Optional[str], parallel: bool) -> str:
        calls = []
        for function in self.tools:
            if name is None or function["name"] == name:
                head = json.dumps(f"call:{function['name']}{{", ensure_ascii=False)
                args = self._members(function.get("parameters") or {})
                calls.append(self._rule(f'<|tool_call> {head} {args} "}}" <tool_call|>'))
        if not calls:
            raise ValueError(f"no tool named {name!r}" if name else "no tools to call")
        many = parallel and name is None
        return f"start: ({' | '.join(calls)}){'+' if many else ''}\n" + "\n".join(self.rules) + "\n" + self.GENERIC

    def _rule(self, body: str) -> str:
        self.rules.append(f"r{len(self.rules)}: {body}")
        return f"r{len(self.rules) - 1}"

    def _members(self, schema: Mapping) -> str:
        """`key:value` pairs of an object schema, comma-separated, keys sorted as the template
        sorts them (case-insensitively), the required ones present; empty rules where none are."""
        props = schema.get("properties")
        if not isinstance(props, Mapping) or not props:
            return '(KEY ":" gvalue ("," KEY ":" gvalue)*)?'
        required = set(schema.get("required") or ())
        keys = sorted(props, key=str.lower)
        first = rest = '""'  # from the end: the members from key i on, led by a comma or not
        for key in reversed(keys):
            pair = f'{json.dumps(key + ":", ensure_ascii=False)} {self._value(props[key])}'
            if key in required:
                first, rest = self._rule(f"{pair} {rest}"), self._rule(f'"," {pair} {rest}')
            else:
                first, rest = self._rule(f"{pair} {rest} | {first}"), self._rule(f'"," {pair} {rest} | {rest}')
        return first

    def _value(self, schema: Any) -> str:
        if not isinstance(schema, Mapping):
            return "gvalue"
        if "const" in schema or "enum" in schema:
            options = [schema["const"]] if "const" in schema else list(schema["enum"] or ())
            return self._rule(" | ".join(self._literal(o) for o in options)) if options else "gvalue"
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return self._rule(" | ".join(self._value(s) for s in schema[key]))
        kind = schema.get("type")
        if isinstance(kind, list):
            return self._rule(" | ".join(self._value({**schema, "type": k}) for k in kind)) if kind else "gvalue"
        if kind == "string":
            return "gstring"
        if kind in ("integer", "number"):
            return "INT" if kind == "integer" else "NUMBER"
        if kind == "boolean":
            return self._rule('"true" | "false"')
        if kind == "null":
            return self._rule('"null" | "None"')
        if kind == "array":
            item = self._value(schema.get("items"))
            return self._rule(f'"[" ({item} ("," {item})*)? "]"')
        if kind == "object":
            return self._rule(f'"{{" {self._members(schema)} "}}"')
        return "gvalue"

    @staticmethod
    def _literal(value: Any) -> str:
        if isinstance(value, str):
            return f'<|"|> {json.dumps(value, ensure_ascii=False)} <|"|>' if value else '<|"|> <|"|>'
        if isinstance(value, bool):
            return json.dumps("true" if value else "false")
        return json.dumps("None" if value is None else str(value))


# ---- one vocabulary per tokenizer -----------------------------------------------------------------

_VOCABULARIES: dict[int, Vocabulary] = {}  # id(tokenizer) -> its vocabulary, dropped with the tokenizer
_LOCK = threading.Lock()


def vocabulary(loaded) -> Vocabulary:
    """The `Vocabulary` of a `load()`ed model's tokenizer, built on first use and kept as long as
    the tokenizer lives.

    Raises:
        ValueError: the model has no tokenizer.
    """
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise ValueError("structured output needs a tokenizer: the model directory has none")
    with _LOCK:
        if id(tokenizer) not in _VOCABULARIES:
            _VOCABULARIES[id(tokenizer)] = Vocabulary(tokenizer, loaded.target.vocab_size, loaded.eos_ids)
            try:
                weakref.finalize(tokenizer, _VOCABULARIES.pop, id(tokenizer), None)
            except TypeError:  # not weakly referenceable: kept for the process's life
                pass
        return _VOCABULARIES[id(tokenizer)]
