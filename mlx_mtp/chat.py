"""`python -m mlx_mtp.chat`: chat with a Gemma 4 model in the terminal, with MTP speculative decoding.

Every turn reuses the KV cache of the conversation so far. Without --model it runs the small demo
pair bundled in `mlx_mtp.demo`. With --prompt it answers once and exits (for scripts); without a
terminal it reads one message per line from stdin. With --raw each message is completed as plain
text (no chat template, no history), which suits code models. With --think the model reasons
before it answers; the reasoning goes to stderr (dimmed on a terminal), the answer to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import signal
import sys
import threading
from typing import Iterator, Optional, Union

import mlx.core as mx

from . import jit, memory, pipeline
from .chat_format import Delta, OutputParser
from .cli import demo_pair, draft_tokens, error_line, positive_int, prog_name, readable
from .conversation import Conversation
from .generate import ContextLengthError, stream_generate
from .group import Group, launched
from .loading import Loaded, load
from .sample import SamplingParams
from .stats import Stats
from .text import TextEvent


HELP = """commands:
  /reset   start over (the system message stays)
  /stats   details of the last reply and the KV cache
  /help    this help
  /quit    leave (so do quit, exit, end of input, Ctrl-D)
Ctrl-C stops a reply; what was written stays in the conversation. At the prompt it clears the line."""


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog_name("mlx_mtp.chat"), description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="target model dir or hub id (default: the bundled demo pair)")
    ap.add_argument("--drafter", help="MTP drafter dir or hub id, or 'ngram' for prompt lookup (no model "
                                      "needed); default: none, plain decoding")
    ap.add_argument("--ngram", action="store_true",
                    help="with an MTP drafter: use a prompt-lookup proposal instead where it is long")
    ap.add_argument("--draft-tokens", type=draft_tokens, default="auto", metavar="N|auto")
    ap.add_argument("--no-mtp", action="store_true", help="plain decoding, no drafter")
    ap.add_argument("--temp", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--max-tokens", type=positive_int, default=512, help="per reply")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--system", help="system message")
    ap.add_argument("--think", action=argparse.BooleanOptionalAction, default=False,
                    help="let the model reason before it answers (the chat template's enable_thinking) and show "
                         "the reasoning, on stderr; --no-think (the default) turns it off and hides any")
    ap.add_argument("--prompt", help="answer this one message and exit")
    ap.add_argument("--raw", action="store_true", help="complete each message as plain text (no template)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="compute dtype (default: the checkpoint's; float32 for the demo pair)")
    args = ap.parse_args(argv)
    if args.raw and (args.system is not None or args.think):
        ap.error("--system and --think need the chat template, which --raw does not use")
    args.prompt, args.system = readable(args.prompt), readable(args.system)
    return args


def open_session(args, group: Optional[Group] = None) -> tuple[Loaded, Union[Conversation, "Completion", None], str]:
    """Load the model (this rank's part of it in a pipeline group); returns it, the conversation
    (a `Completion` with --raw; None on a rank that only follows rank 0) and a banner line."""
    model, drafter, dtype = args.model, args.drafter, args.dtype
    what = f"model {model}"
    if model is None:
        dtype = dtype or "float32"  # bf16-stored; fp32 is exact and fastest on CPU
        model, demo_drafter = demo_pair()
        drafter = drafter or demo_drafter
        what = f"no --model: running the bundled demo pair in {model.parent}, a small model to try things out"
    if args.no_mtp:
        drafter = None
    dtype = getattr(mx, dtype) if dtype else None
    if group is None:
        loaded = load(model, drafter, dtype=dtype, ngram=args.ngram)
    else:
        loaded = pipeline.load(model, drafter, dtype, group)
    banner = f"{what}; {decoding(args, drafter)}"
    if group is not None and not group.leader:
        return loaded, None, banner
    if loaded.tokenizer is None:
        raise ValueError(f"{model} has no tokenizer: chat needs one")
    if args.raw:
        return loaded, Completion(loaded), f"{banner}; raw completion, no chat template"
    if not getattr(loaded.tokenizer, "has_chat_template", True):
        raise ValueError(f"{model}'s tokenizer has no chat template; --raw completes plain text")
    return loaded, Conversation(loaded, system=args.system, enable_thinking=args.think), banner


def decoding(args, drafter) -> str:
    if drafter is None:
        return "plain decoding"
    if args.draft_tokens == 0:
        return "MTP off (--draft-tokens 0), plain decoding"
    if str(drafter) == "ngram":
        return f"prompt-lookup (n-gram) drafting, draft tokens {args.draft_tokens}"
    return f"MTP{' + prompt lookup' if args.ngram else ''}, draft tokens {args.draft_tokens}"


class Completion:
    """--raw: each message is completed as plain text, with no chat template and no history.
    It offers what the REPL uses of a `Conversation`."""

    prefix_cache = None  # each completion starts from an empty cache

    def __init__(self, loaded):
        self.loaded = loaded
        self.tokens: list[int] = []  # the last completion's prompt and output
        self.last_stats: Optional[Stats] = None

    def reset(self) -> None:
        self.tokens, self.last_stats = [], None

    def reply(self, text: str, max_tokens: int, **options) -> Iterator[TextEvent]:
        prompt = self.loaded.tokenizer.encode(text)
        room = self.loaded.target.config.max_position_embeddings - len(prompt)
        self.tokens = list(prompt)
        events = stream_generate(self.loaded, prompt, max_tokens=max(1, min(max_tokens, room)), **options)
        try:
            for event in events:
                self.tokens.append(event.token)
                self.last_stats = event.stats
                yield event
        finally:
            events.close()


def stat_line(s: Stats) -> str:
    line = f"[{s.emitted} tokens, {s.decode_tps:.1f} tok/s, first token {s.first_token_seconds * 1000:.0f} ms"
    if s.rounds:  # "auto" may also have decoded stretches plainly: say how much
        from_rounds = s.emitted - 1 - s.plain_steps  # the first token comes from the prefill
        line += f", {from_rounds} from {s.rounds} MTP rounds (acceptance length {s.acceptance_length:.2f})"
        if s.plain_steps:
            line += f", {s.plain_steps} from plain steps"
    return line + "]"


def say_if_cut(session) -> None:
    """Say so when the last reply stopped because the conversation filled the model's context."""
    limit = session.loaded.target.config.max_position_embeddings
    if len(session.tokens) >= limit:
        hint = "" if isinstance(session, Completion) else "; /reset to start over"
        print(f"[reply cut at the model's context of {limit} tokens{hint}]", file=sys.stderr, flush=True)


def details(conv: Conversation) -> str:
    kv = "KV cache: empty"
    kept = conv.prefix_cache
    if kept is not None and kept.checkpoints:
        kv = (f"KV cache: {kept.lookup(conv.tokens)} tokens of the conversation kept, "
              f"{kept.nbytes / 2**20:.1f} MiB ({kept.checkpoints} states)")
    held = f"{kv}\n{memory.usage_line()}"
    if conv.last_stats is None:
        return f"no reply yet\n{held}"
    s = conv.last_stats
    prompt = (f"prompt: {s.prompt_tokens} tokens fed ({s.prompt_tps:.0f} tok/s), "
              f"{s.cached_tokens} reused from the cache")
    return f"last reply: {s.summary()}\n{prompt}\n{held}"


def answer(conv: Conversation, text: str, options: dict) -> None:
    stream, stats = conv.reply(text, **options), None
    printer = Printer(conv)
    try:
        with ctrl_c() as stop:
            for event in stream:
                printer.print(event.text)
                stats = event.stats
                if stop.is_set():
                    break
    except KeyboardInterrupt:  # a second Ctrl-C: the conversation keeps what was written
        pass
    finally:
        stream.close()
        printer.finish()
    print(flush=True)
    if stats is not None:
        print(stat_line(stats), file=sys.stderr, flush=True)


class Printer:
    """Prints a reply as it streams: the answer on stdout, the reasoning (when the conversation
    thinks) on stderr, dimmed on a terminal, and tool calls as `[tool call] NAME {arguments}`.
    A --raw completion is printed as it is."""

    DIM, PLAIN = "\x1b[2m", "\x1b[0m"

    def __init__(self, conv):
        self.parser = OutputParser() if isinstance(conv, Conversation) else None
        self.thinking = getattr(conv, "enable_thinking", False)
        self.reasoning = False  # in the middle of printing reasoning
        self.tty = sys.stderr.isatty()

    def print(self, text: str) -> None:
        self._show(self.parser.feed(text) if self.parser else [Delta("content", text)])

    def finish(self) -> None:
        if self.parser is not None:
            self._show(self.parser.finish())
        self._end_reasoning()

    def _show(self, parts: list) -> None:
        for part in parts:
            if part.kind == "reasoning":
                if self.thinking:
                    self._reason(part.text)
                continue
            self._end_reasoning()
            if part.kind == "tool_call":
                print(f"\n[tool call] {part.call.name} {part.call.arguments_json}", flush=True)
            else:
                print(part.text, end="", flush=True)

    def _reason(self, text: str) -> None:
        if not self.reasoning:
            text = (self.DIM if self.tty else "thinking: ") + text
            self.reasoning = True
        sys.stderr.write(text)
        sys.stderr.flush()

    def _end_reasoning(self) -> None:
        if self.reasoning:
            sys.stderr.write((self.PLAIN if self.tty else "") + "\n")
            sys.stderr.flush()
            self.reasoning = False


@contextlib.contextmanager
def ctrl_c():
    """Ctrl-C stops the reply at the next token, where the conversation and its cache are in a
    consistent state; a second Ctrl-C interrupts at once."""
    stop = threading.Event()

    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def lines(interactive: bool) -> Iterator[str]:
    while True:
        try:
            yield input("> " if interactive else "")
        except EOFError:
            if interactive:
                print()
            return
        except KeyboardInterrupt:
            if not interactive:
                raise
            print()  # Ctrl-C at the prompt clears the line; Ctrl-D leaves


def repl(conv: Conversation, options: dict, interactive: bool) -> None:
    for line in lines(interactive):
        command = line.strip()
        if command in ("/quit", "/exit", "quit", "exit"):
            return
        if command == "/help":
            print(HELP)
        elif command == "/reset":
            conv.reset()
            print("(new conversation)")
        elif command == "/stats":
            print(details(conv))
        elif command.startswith("/"):
            print(f"unknown command {command}; /help lists them")
        elif command:
            try:
                answer(conv, line, options)
                say_if_cut(conv)
            except ContextLengthError as e:
                print(f"error: {e}; /reset to start over", file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        group = launched()  # the ranks `mlx.launch` started together (pipeline parallelism), or None
        sampling = SamplingParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k)
        loaded, conv, banner = open_session(args, group)
    except Exception as e:  # bad path, wrong pair, unreadable checkpoint: one line, no traceback
        print(error_line(e), file=sys.stderr)
        return 2
    # The model stays wired for the session: a chat exists to generate, like a server.
    with memory.generating(loaded.target, loaded.drafter):
        if group is None:
            return talk(conv, args, sampling, banner)
        print(loaded.target.pipeline.describe(), file=sys.stderr)
        return pipeline.run(loaded, group, lambda: talk(conv, args, sampling, banner)) or 0


def talk(conv: Conversation, args, sampling: SamplingParams, banner: str) -> int:
    """Answer --prompt, or run the REPL."""
    options = dict(max_tokens=args.max_tokens, sampling=sampling, draft_tokens=args.draft_tokens,
                   mtp=not args.no_mtp, seed=args.seed)
    print(banner, file=sys.stderr)
    print(memory.plan(conv.loaded.target, conv.loaded.drafter).describe(), file=sys.stderr)
    jit.on_first_compile(lambda: print(jit.NOTICE, file=sys.stderr, flush=True))
    if args.prompt is not None:
        try:
            answer(conv, args.prompt, options)
            say_if_cut(conv)
        except ContextLengthError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    if isinstance(sys.stdin, io.TextIOWrapper):  # undecodable bytes become U+FFFD, not a crash
        sys.stdin.reconfigure(errors="replace")
    interactive = sys.stdin.isatty()
    if interactive:
        # Started with SIGINT ignored (e.g. from a script's background job), Python installs no
        # handler and Ctrl-C at the prompt would do nothing: on a terminal it clears the line.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print("type /help for commands", file=sys.stderr)
    try:
        repl(conv, options, interactive)
    except KeyboardInterrupt:
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
