"""What a request becomes before it runs, and how its tokens become events.

A one-shot request is prepared on the caller's thread (`Engine.submit`): its prompt rendered and
tokenized (an agent's prompt can take a while, and on the worker it would hold up every running
row), checked against the context, its grammar compiled, and the token that opens a tool call
banned where it declares tools it does not allow calls of. A conversation's turn is prepared by
the worker when it starts (it follows the turns queued before it). The replies the engine wrote
are kept (`history.Replies`) so that a history sent back as messages renders them as generated.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..formats import chat as chat_format, media
from ..decode.batch import BAN, check_fits
from ..formats.chat import Prompt
from ..decode.grammar import Grammar, vocabulary
from .history import Replies, Turn
from .output import Output
from .requests import Prepared, Request
from ..decode.text import encode, token_piece

REPLIES_KEPT = 1024  # recent replies whose ids a history sent as messages can render with


class Preparer:
    """Turns requests into what the batch runs (prompt ids, turn ends, grammar state) and into an
    `Output` that splits their tokens into events, for one loaded model."""

    def __init__(self, loaded):
        self.loaded = loaded  # its target and tokenizer: a drafter swap changes neither
        self.replies = Replies(loaded, REPLIES_KEPT)
        self._call_token = chat_format.token_id(loaded.tokenizer, chat_format.TOOL_CALL)
        self._pieces: dict[int, tuple[str, bytes]] = {}  # token -> its text and bytes (worker side)

    def one_shot(self, request: Request) -> tuple[Request, Prepared]:
        """A one-shot request with its calls banned where asked, and its prompt, checked against the
        context, with its grammar state."""
        sources, messages = media.message_media(request.messages)
        tokens, boundaries, chat = self.render(request if messages is None else dataclasses.replace(request,
                                                                                                   messages=messages))
        images = None
        if sources:  # images and audio: their placeholders expanded, their soft tokens placed
            tokens, images = media.place(self.loaded, tokens, sources)
            boundaries = chat_format.turn_ends(tokens, self.loaded.eos_ids)
        check_fits(len(tokens), self.loaded.target.config.max_position_embeddings,
                   request.max_tokens if request.fit_max_tokens else None)
        return self._ban_calls(request), Prepared(tokens, boundaries, chat, self._matcher(request.grammar, chat), images)

    def count(self, request: Request) -> int:
        """The length of a one-shot request's prompt as it would run (media as their soft tokens,
        counted from their sizes: nothing is encoded)."""
        sources, messages = media.message_media(request.messages)
        tokens = self.render(request if messages is None else dataclasses.replace(request, messages=messages))[0]
        return len(tokens) + media.count(self.loaded, sources)

    def turn(self, request: Request, turn: Turn) -> Prepared:
        """A conversation's turn as it starts, with its grammar (after the turns before it)."""
        return Prepared(turn.prompt.tokens, turn.boundaries, turn.prompt, self._matcher(request.grammar, turn.prompt))

    def render(self, request: Request) -> tuple[list[int], list[int], Optional[Prompt]]:
        """The request's prompt tokens, where its turns end (for the prefix cache), and the
        rendered chat (None for a raw prompt)."""
        if request.messages is None:
            prompt = encode(self.loaded, request.prompt)
            return prompt, chat_format.turn_ends(prompt, self.loaded.eos_ids), None
        if self.loaded.tokenizer is None:
            raise ValueError("`messages` need a tokenizer: the model directory has none")
        chat = chat_format.render(self.loaded.tokenizer, request.messages, request.tools,
                                  enable_thinking=request.enable_thinking,
                                  continue_final_message=request.continue_final_message,
                                  template_kwargs=request.chat_template_kwargs,
                                  as_generated=request.history == "generated", keep_thinking=request.keep_thinking,
                                  replies=self.replies, content_as_text=not request.parse_control_tokens)
        return chat.tokens, chat_format.turn_ends(chat.tokens, self.loaded.eos_ids), chat

    def output(self, request: Request, chat: Optional[Prompt]) -> Output:
        """How the request's tokens become events: a chat reply is parsed (tool calls only where
        it declares tools, or in a conversation, whose model may call what it was told of)."""
        tools = bool(request.tools) or request.conversation is not None
        parser = None if chat is None else chat.parser(tools=tools)
        return Output(self.loaded, parser, request.stop, request.parallel_tool_calls, self._piece)

    def _ban_calls(self, request: Request) -> Request:
        """`request` with the token that opens a tool call banned, where it declares tools it
        does not allow calls of (a logit bias: exact under speculative decoding)."""
        if not request.tools or request.allow_tool_calls or self._call_token is None:
            return request
        bias = (*request.penalties.logit_bias, (self._call_token, BAN))
        return dataclasses.replace(request, penalties=dataclasses.replace(request.penalties, logit_bias=bias))

    def _matcher(self, grammar: Optional[Grammar], chat: Optional[Prompt]):
        """The grammar's state for a reply to `chat`: after the reasoning where the reply may
        reason first (`Prompt.reasoning` decides). A large schema takes a while to compile."""
        if grammar is None:
            return None
        vocab = vocabulary(self.loaded)
        reasoning = chat.reasoning if chat is not None else None
        if reasoning is not None and vocab.reasoning:
            grammar = grammar.after_reasoning(reasoning)
        return vocab.matcher(grammar)

    def _piece(self, token: int) -> tuple[str, bytes]:
        if token not in self._pieces:
            tokenizer = self.loaded.tokenizer
            self._pieces[token] = token_piece(tokenizer, token) if tokenizer is not None else ("", b"")
        return self._pieces[token]
