"""A conversation as the `Engine` keeps it: its messages, the tokens the model read and wrote,
and the turn being generated.

Each turn renders the whole conversation with the tokenizer's chat template, each earlier reply
as the model generated it (`chat_format.render(..., as_generated=True)`: templates trim replies
or rewrite them, and the reply's own token ids are kept to be spliced back in) less its reasoning
once the user's next message follows (unless `keep_thinking`), and feeds the
model only what no stored state covers: a conversation is a client of the engine's prefix cache
(`PrefixCache`) that pins the states its latest turn left (before and after the prompt's last
token, after each turn of the rendering, after the reply). Where a template still re-renders a
reply (one that edits it past recognition), the next prompt parts ways with the last one inside
the last reply, long after the sliding window has moved past it; it then resumes from the state
at the end of the prompt before, and only the re-rendered reply and the new message are fed:
exactly what a fresh prefill gives.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
from typing import Mapping, Optional, Sequence

from ..formats import chat as chat_format
from ..decode.batch import BatchGenerator, ContextLengthError
from ..formats.chat import Prompt

_KEYS = itertools.count()


class Replies:
    """Replies' token ids as generated (without the stop token), by their text as a client reads it
    (its content): what a history sent back as text renders as (`chat_format.render_spliced`).
    The most recent `limit`, from any thread."""

    def __init__(self, loaded, limit: Optional[int] = None):
        self.loaded, self.limit = loaded, limit
        self._ids: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, text: str) -> Optional[list[int]]:
        with self._lock:
            return self._ids.get(text)

    def record(self, reply: Sequence[int], message: Mapping) -> None:
        """Keep a reply's ids under its content as a client reads it (`message`, the reply as an
        assistant message), where the content is all the reply says: a reply that reasoned or called
        a tool stands for more than its text (and an empty one for nothing), so it is not kept."""
        ids, text = self.ids(reply), message.get("content") or ""
        if not text or message.get("reasoning_content") or message.get("tool_calls"):
            return
        with self._lock:
            self._ids[text] = ids
            self._ids.move_to_end(text)
            while self.limit is not None and len(self._ids) > self.limit:
                self._ids.popitem(last=False)

    def ids(self, reply: Sequence[int]) -> list[int]:
        """A reply's ids without its stop token."""
        return list(reply[:-1] if reply and reply[-1] in self.loaded.eos_ids else reply)

    def clear(self) -> None:
        with self._lock:
            self._ids.clear()


@dataclasses.dataclass
class Turn:
    """A turn being generated: the user's message, its rendered prompt, where the prompt's turns
    end, and its token budget."""

    message: dict
    prompt: Prompt
    boundaries: list
    max_tokens: int


class History:
    """Messages, the tokens the model has read and written, and the states their turns left.

    Args:
        loaded: a `load()`ed model with a tokenizer that has a chat template.
        system: optional system message.
        enable_thinking: the template's switch for reasoning before the answer.
        keep_thinking: earlier replies keep their reasoning in later prompts (by default it is
            left out once the next user message follows, as Gemma 4's model card asks).

    `messages` is a plain list of {"role", "content"} dicts, replies as assistant messages
    (`content`, `reasoning_content`, `tool_calls`): callers may edit it between turns (drop the
    last exchange, edit a message); the next turn reuses whatever stored state still matches.
    """

    def __init__(self, loaded, system: Optional[str] = None, enable_thinking: bool = False,
                 keep_thinking: bool = False):
        if loaded.tokenizer is None:
            raise ValueError("a conversation needs a tokenizer: the model directory has none")
        self.loaded = loaded
        self.system = system
        self.key = f"conversation-{next(_KEYS)}"  # what pins its states in a prefix cache
        self.enable_thinking, self.keep_thinking = enable_thinking, keep_thinking
        self.messages: list[dict] = []
        self.tokens: list[int] = []  # the conversation as the model saw it, replies included
        self.replies = Replies(loaded)  # its replies' ids as generated, to render them as generated
        self.busy = False  # a turn is being generated
        self.reset()

    def reset(self) -> None:
        """Forget every turn (the system message stays)."""
        self._check_idle()
        self.messages[:] = [{"role": "system", "content": self.system}] if self.system else []
        self.tokens, self._reply = [], 0  # _reply: the last reply's length, at the end of `tokens`
        self._prompt: Optional[Prompt] = None  # the last reply's prompt
        self.replies.clear()

    def render(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` followed by the model's generation prompt."""
        return self._render(messages).tokens

    def check(self, text: str) -> None:
        """Raise `ContextLengthError` now if the next turn, with message `text`, does not fit."""
        self._check_idle()
        self._fit(self._render([*self.messages, {"role": "user", "content": text}]))

    def prepare(self, text: str, max_tokens: int) -> Turn:
        """Render the next turn and mark the conversation busy with it until `end`.

        Raises:
            ContextLengthError: the conversation does not fit the model's context; nothing changes.
        """
        self._check_idle()
        message = {"role": "user", "content": text}
        prompt = self._render([*self.messages, message])
        self._fit(prompt)
        limit = self.loaded.target.config.max_position_embeddings
        boundaries = chat_format.turn_ends(prompt.tokens, self.loaded.eos_ids)
        self.busy = True
        return Turn(message, prompt, boundaries, min(max_tokens, limit - len(prompt.tokens)))

    def insert(self, gen: BatchGenerator, turn: Turn, **kwargs) -> int:
        """Insert the turn's row into `gen`; its states stay pinned for this conversation."""
        return gen.insert(turn.prompt.tokens, max_tokens=turn.max_tokens, stop_ids=self.loaded.eos_ids,
                          boundaries=turn.boundaries, owner=self.key, **kwargs)

    def end(self, turn: Turn, reply: list[int]) -> None:
        """Finish a turn: keep the reply as streamed (a turn that streamed nothing is dropped)."""
        self.busy = False
        self.tokens, self._reply, self._prompt = turn.prompt.tokens + reply, len(reply), turn.prompt
        if reply:
            self.messages += [turn.message, self._record(reply)]

    def keep(self, n: int) -> None:
        """Keep only the first `n` tokens of the last reply (a client that read no further); a
        reply cut to nothing is dropped with its message, as `end` drops one."""
        self._check_idle()
        if n < self._reply:
            cut = len(self.tokens) - self._reply + n
            reply, self.tokens, self._reply = self.tokens[cut - n: cut], self.tokens[:cut], n
            if reply:
                self.messages[-1] = self._record(reply)
            else:
                del self.messages[-2:]

    def _record(self, reply: list[int]) -> dict:
        """The last reply as an assistant message, its ids kept under its content."""
        message = chat_format.reply_message(self.loaded.tokenizer, self.replies.ids(reply), self._prompt)
        self.replies.record(reply, message)
        return message

    def _render(self, messages: list[dict]) -> Prompt:
        return chat_format.render(self.loaded.tokenizer, messages, enable_thinking=self.enable_thinking,
                                  as_generated=True, keep_thinking=self.keep_thinking, replies=self.replies)

    def _fit(self, prompt: Prompt) -> None:
        limit = self.loaded.target.config.max_position_embeddings
        if len(prompt.tokens) >= limit:
            n = len(prompt.tokens)
            raise ContextLengthError(f"the conversation ({n} tokens) does not fit the model's context of "
                                     f"{limit} tokens", n, limit)

    def _check_idle(self) -> None:
        if self.busy:
            raise RuntimeError("a reply is still streaming; exhaust or close it first")
