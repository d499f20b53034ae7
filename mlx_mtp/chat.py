"""`python -m mlx_mtp.chat`: chat with a Gemma 4 model in the terminal, with MTP speculative decoding.

The chat is a client of an `Engine` (the server's code path: its prefix cache, memory admission and
request semantics): every turn reuses the KV cache of the conversation so far. Without --model it
runs the small demo pair bundled in `mlx_mtp.demo`. With --prompt it answers once and exits (for
scripts); without a terminal it reads one message per line from stdin. With --raw each message is
completed as plain text (no chat template, no history), which suits code models: text that ends
inside an indented block (a `def f():` line) is completed to the block's end, where the code comes
back to column 0. A reply or completion that repeats itself (the same lines a third time in a row)
stops there, and a request that fails (a missing image) says why and the conversation goes on. With
--think the model reasons before it answers; the reasoning goes to stderr (dimmed on a terminal), the
answer to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import signal
import string
import sys
import threading
from typing import Iterator, Optional, Union

import mlx.core as mx

from . import store
from .runtime import jit, memory
from .distributed import pipeline
from .cli import demo_pair, draft_tokens, error_line, positive_int, prog_name, readable
from .engine.conversation import Conversation
from .engine.engine import Engine
from .distributed.group import Group, launched
from .loading import Loaded, load
from .engine.requests import ContextLengthError, Request, TokenEvent
from .decode.sample import SamplingParams
from .decode.speculative import policy_for
from .decode.stats import Stats


HELP = """commands:
  /reset   start over (the system message stays)
  /stats   details of the last reply and the KV cache
  /image PATH  show the model an image with your next message (a model with a vision tower)
  /audio PATH  let the model hear a recording with your next message (E2B, E4B, the 12B)
  /video PATH  show the model a video with your next message (32 frames; needs PyAV: mlx-mtp[video])
  /help    this help
  /quit    leave (so do quit, exit, end of input, Ctrl-D)
Ctrl-C stops a reply; what was written stays in the conversation. At the prompt it clears the line."""


REPLY_TOKENS = 512  # a reply's default budget, where the model's context holds TURNS of them
RAW_TOKENS = 256  # a --raw completion's: a function or two (a block's end stops it sooner)
TURNS = 16  # context // TURNS a reply: 10 turns (and their messages) fit, the demo's 2,048 too
# A line that starts at column 0 ends an indented block (Python's function or class body).
COLUMN_0 = tuple("\n" + c for c in string.printable if not c.isspace())
REPEATS = 3  # a reply that ends with one block of lines this many times in a row is looping
PIECE = 8  # or with one piece of a line this long (or longer)


EPILOG = """The demo pair, a small model trained on Python's standard library, continues code; it is no
assistant. Try:
  python -m mlx_mtp.chat --raw --prompt 'def walk(top, topdown=True, onerror=None, followlinks=False):'"""


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog_name("mlx_mtp.chat"), description=__doc__.splitlines()[0],
                                 epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="target model dir, hub id, or a name in the model store (`gemma4:e2b`: its "
                                    "drafter too; mlx-mtp models lists them) (default: the bundled demo pair, a "
                                    "small model trained on Python source)")
    ap.add_argument("--drafter", help="MTP drafter dir or hub id, or 'ngram' for prompt lookup (no model needed); "
                                      "default: the demo pair's own drafter without --model, none (plain "
                                      "decoding) with --model")
    ap.add_argument("--ngram", action="store_true",
                    help="with an MTP drafter: use a prompt-lookup proposal instead where it is long (default: off)")
    ap.add_argument("--draft-tokens", type=draft_tokens, default="auto", metavar="N|auto",
                    help="tokens drafted per round, 0-6, or auto: chosen by measured cost and acceptance "
                         "(default: auto)")
    ap.add_argument("--no-mtp", action="store_true", help="plain decoding, no drafter (default: MTP on)")
    ap.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="(default: 1.0, off)")
    ap.add_argument("--top-k", type=int, default=0, help="(default: 0, off)")
    ap.add_argument("--max-tokens", type=positive_int, help=f"per reply (default: {RAW_TOKENS} with --raw; else {REPLY_TOKENS}, or "
                    f"less where the model's context would not hold 10 turns: 1/{TURNS} of it, 128 for the demo pair)")
    ap.add_argument("--seed", type=int, help="for sampling (default: a fresh one per run)")
    ap.add_argument("--system", help="system message (default: none)")
    ap.add_argument("--think", action=argparse.BooleanOptionalAction, default=False,
                    help="let the model reason before it answers (the chat template's enable_thinking) and show "
                         "the reasoning, on stderr; --no-think (the default) turns it off and hides any")
    ap.add_argument("--keep-thinking", action="store_true",
                    help="with --think, later turns keep each earlier reply's reasoning in the prompt (default: off: "
                         "left out once you answer, as Gemma 4's model card asks)")
    ap.add_argument("--prompt", help="answer this one message and exit (default: a conversation, one message "
                                     "per line)")
    ap.add_argument("--image", action="append", default=[], metavar="PATH",
                    help="an image to show the model with the first message (repeatable; /image PATH in the chat; "
                         "default: none)")
    ap.add_argument("--audio", action="append", default=[], metavar="PATH",
                    help="a recording (WAV, FLAC, OGG, MP3) for the model to hear with the first message (repeatable; "
                         "/audio PATH in the chat; E2B, E4B and the 12B; default: none)")
    ap.add_argument("--video", action="append", default=[], metavar="PATH",
                    help="a video for the model to see with the first message (repeatable; /video PATH in the chat; "
                         "32 frames sampled; needs PyAV: pip install 'mlx-mtp[video]'; default: none)")
    ap.add_argument("--raw", action="store_true", help="complete each message as plain text (no template): "
                                                       "what the demo pair, a code model, does best (default: off)")
    ap.add_argument("--stop-at-dedent", action=argparse.BooleanOptionalAction, default=True,
                    help="with --raw, text that ends inside an indented block (a `def f():` line) is completed "
                         "to the block's end, where a line starts at column 0 (default: on; --no-stop-at-dedent "
                         "runs to --max-tokens)")
    ap.add_argument("--stop-at-repeat", action=argparse.BooleanOptionalAction, default=True,
                    help=f"a reply (chat or --raw) that ends with the same block of lines {REPEATS} times in "
                         f"a row (or the same piece of {PIECE}+ characters within a line) is looping: it stops there, "
                         "and says so on stderr (default: on; --no-stop-at-repeat runs on)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="compute dtype (default: the checkpoint's; float32 for the demo pair)")
    args = ap.parse_args(argv)
    if args.raw and (args.system is not None or args.think or args.keep_thinking):
        ap.error("--system, --think and --keep-thinking need the chat template, which --raw does not use")
    args.prompt, args.system = readable(args.prompt), readable(args.system)
    return args


def open_session(args, group: Optional[Group] = None) -> tuple[Loaded, str]:
    """Load the model (this rank's part of it in a pipeline group) and check that it can chat;
    returns it and a banner line."""
    model, drafter, dtype = args.model, args.drafter, args.dtype
    what = f"model {model}"
    if model is None:
        dtype = dtype or "float32"  # bf16-stored; fp32 is exact and fastest on CPU
        model, demo_drafter = demo_pair()
        drafter = drafter or demo_drafter
        what = f"no --model: running the bundled demo pair in {model.parent}, a small model to try things out"
    else:
        model, drafter = store.named(model, drafter)  # a store name (gemma4:e2b) is its pair's directories
    if args.no_mtp:
        drafter = None
    dtype = getattr(mx, dtype) if dtype else None
    if group is None:
        loaded = load(model, drafter, dtype=dtype, ngram=args.ngram)
    else:
        loaded = pipeline.load(model, drafter, dtype, group)
    banner = f"{what}; {decoding(args, drafter)}"
    if group is not None and not group.leader:
        return loaded, banner
    if loaded.tokenizer is None:
        raise ValueError(f"{model} has no tokenizer: chat needs one")
    if args.raw:
        return loaded, f"{banner}; raw completion, no chat template"
    if not getattr(loaded.tokenizer, "has_chat_template", True):
        raise ValueError(f"{model}'s tokenizer has no chat template; --raw completes plain text")
    return loaded, banner


def decoding(args, drafter) -> str:
    if drafter is None:
        return "plain decoding"
    if args.draft_tokens == 0:
        return "MTP off (--draft-tokens 0), plain decoding"
    if str(drafter) == "ngram":
        return f"prompt-lookup (n-gram) drafting, draft tokens {args.draft_tokens}"
    return f"MTP{' + prompt lookup' if args.ngram else ''}, draft tokens {args.draft_tokens}"


class Completion:
    """--raw: each message is completed as plain text, with no chat template and no history (a
    one-shot request to the engine). It offers what the REPL uses of a `Conversation`."""

    enable_thinking = False

    def __init__(self, engine: Engine, stop_at_dedent: bool = True):
        self.engine, self.loaded = engine, engine.loaded
        self.stop_at_dedent = stop_at_dedent
        self.tokens: list[int] = []  # the last completion's prompt and output
        self.last_stats: Optional[Stats] = None

    def reset(self) -> None:
        self.tokens, self.last_stats = [], None

    def cached_tokens(self) -> int:
        return self.engine.cached(self.tokens)

    def reply(self, text: str, max_tokens: int, **options) -> Iterator[TokenEvent]:
        prompt = self.loaded.tokenizer.encode(text)
        room = self.loaded.target.config.max_position_embeddings - len(prompt)
        stop = block_end(text) if self.stop_at_dedent else ()
        handle = self.engine.submit(Request(prompt, max_tokens=max(1, min(max_tokens, room)), stop=stop, **options))
        self.tokens, self.last_stats = list(prompt), handle.stats
        return self._stream(handle)

    def _stream(self, handle) -> Iterator[TokenEvent]:
        events = handle.tokens()
        try:
            for event in events:
                self.tokens.append(event.token)
                yield event
        finally:  # closed early (a loop, Ctrl-C) too: the request is cancelled, its last round's stats read
            events.close()
            done = handle.done or next((e for e in handle.events() if e.kind == "done"), None)
            self.last_stats = done.stats if done is not None else handle.stats


class LoopStop:
    """A reply's events until its text ends in a loop (`repeating`): then the stream is closed,
    which cancels the request (a conversation keeps what was written), and `note` says so."""

    def __init__(self, events: Iterator[TokenEvent]):
        self.events, self.note = events, None

    def __iter__(self) -> Iterator[TokenEvent]:
        text = ""
        for event in self.events:
            yield event
            text += event.reasoning + event.text
            if loop := repeating(text):
                self.note = f"[stopped: {loop} {REPEATS} times in a row, a loop; --no-stop-at-repeat runs on]"
                self.close()
                return

    def close(self) -> None:
        self.events.close()


Session = Union[Conversation, Completion]


def block_end(text: str) -> tuple[str, ...]:
    """Stop strings that end a completion of `text` where its indented block ends (a line at
    column 0), when `text` ends inside one: its last line opens a block or is indented. They are
    matched on the reply's text, so greedy output is the same with MTP as without."""
    last = text.rstrip("\n").rsplit("\n", 1)[-1]
    opens = last.split("#", 1)[0].rstrip().endswith(":")
    return COLUMN_0 if opens or last[:1] in (" ", "\t") else ()


def repeating(text: str, times: int = REPEATS) -> str:
    """What `text` ends with `times` times in a row ('' if nothing): a block of whole lines (the
    shortest; blank lines alone are no block: code has runs of them), or within its last line a
    piece of PIECE or more characters, a letter or digit among them (not a `====` rule)."""
    *done, line = text.split("\n")
    for n in range(1, len(done) // times + 1):
        block = done[-n:]
        if any(b.strip() for b in block) and all(
                done[len(done) - (i + 1) * n: len(done) - i * n] == block for i in range(1, times)):
            return "the same line" if n == 1 else f"the same {n} lines"
    for n in range(PIECE, len(line) // times + 1):
        piece = line[-n:]
        if line.endswith(piece * times) and any(c.isalnum() for c in piece):
            return repr(piece)
    return ""


def default_max_tokens(loaded: Loaded, raw: bool) -> int:
    """A reply's budget when --max-tokens is not given: RAW_TOKENS for a --raw completion; in a
    chat REPLY_TOKENS, or 1/TURNS of the model's context where that is less, so that 10 turns fit."""
    if raw:
        return RAW_TOKENS
    return max(16, min(REPLY_TOKENS, loaded.target.config.max_position_embeddings // TURNS))


def stat_line(s: Stats) -> str:
    """Where every token of the reply came from, every time (they add up to the total): the first
    from the prompt's forward, the rest from MTP rounds and plain steps; then the speeds."""
    origins = []
    if s.emitted:
        after_first = s.emitted - 1
        from_rounds = min(max(after_first - s.plain_steps, 0), after_first) if s.rounds else 0
        origins.append("1 from the prompt")
        if s.rounds:
            plural = "s" if s.rounds != 1 else ""
            origins.append(f"{from_rounds} from {s.rounds} MTP round{plural} "
                           f"(acceptance length {s.acceptance_length:.2f})")
        origins.append(f"{after_first - from_rounds} from plain steps")
    return (f"[{s.emitted} tokens{': ' + ', '.join(origins) if origins else ''}; {s.decode_tps:.1f} tok/s, "
            f"first token {s.first_token_seconds * 1000:.0f} ms]")


def say_if_cut(session: Session, max_tokens: Optional[int] = None) -> None:
    """Say so when the last reply stopped because the conversation filled the model's context,
    and in a chat, before that, when two more replies of `max_tokens` might not fit."""
    limit = session.loaded.target.config.max_position_embeddings
    if len(session.tokens) >= limit:
        hint = "" if isinstance(session, Completion) else "; /reset to start over"
        print(f"[reply cut at the model's context of {limit} tokens{hint}]", file=sys.stderr, flush=True)
    elif max_tokens and isinstance(session, Conversation) and (room := limit - len(session.tokens)) < 2 * max_tokens:
        more = "the next reply may be cut short" if room < max_tokens else f"room for one more reply of {max_tokens}"
        print(f"[{room} of the model's {limit} context tokens left, {more}: /reset starts over, a smaller "
              "--max-tokens makes replies shorter]", file=sys.stderr, flush=True)


def details(session: Session) -> str:
    kept = session.cached_tokens() if session.tokens else 0
    cache = session.engine.metrics()
    kv = "KV cache: empty"
    if cache.get("prefix_cache_states"):  # counted once the engine has run a request
        kv = (f"KV cache: {kept} tokens of the conversation kept, "
              f"{cache['prefix_cache_bytes'] / 2**20:.1f} MiB ({cache['prefix_cache_states']} states)")
    held = f"{kv}\n{memory.usage_line()}"
    if session.last_stats is None:
        return f"no reply yet\n{held}"
    s = session.last_stats
    prompt = (f"prompt: {s.prompt_tokens} tokens fed ({s.prompt_tps:.0f} tok/s), "
              f"{s.cached_tokens} reused from the cache")
    return f"last reply: {s.summary()}\n{prompt}\n{held}"


def answer(session: Session, text: str, options: dict, stop_at_repeat: bool = True) -> None:
    """Stream the reply to `text` on stdout, then what ended it early and its stat line on stderr."""
    request = dict(options)
    options.pop("media", None)  # shown with this message only, whether or not it gets a reply
    stream = session.reply(text, **request)
    stream = LoopStop(stream) if stop_at_repeat else stream
    printer, replied = Printer(session.enable_thinking), False
    try:
        with ctrl_c() as stop:
            for event in stream:
                printer.show(event.parts)
                replied = True
                if stop.is_set():
                    break
    except KeyboardInterrupt:  # a second Ctrl-C: the conversation keeps what was written
        pass
    finally:
        stream.close()
        printer.finish()
        CONSOLE.write(sys.stdout, "\n")  # an error mid-reply too: its line goes on a line of its own
    if getattr(stream, "note", None):
        print(stream.note, file=sys.stderr, flush=True)
    if replied and session.last_stats is not None:
        print(stat_line(session.last_stats), file=sys.stderr, flush=True)
        if options.get("draft_tokens") == "auto" and (why := why_plain(session.loaded.drafter, session.last_stats)):
            print(why, file=sys.stderr, flush=True)


def why_plain(drafter, s: Stats) -> Optional[str]:
    """Where `auto` kept mostly to plain steps although the reply tried MTP rounds: what it measured
    on this machine (drafting that does not pay here is not used; a fixed --draft-tokens still drafts)."""
    measured = policy_for(drafter, "auto").speeds(1) if drafter is not None and s.rounds else None
    if measured is None or 2 * s.plain_steps < s.emitted - 1:
        return None
    plain, k, drafting = measured
    if drafting >= plain:
        return None
    drafts = f"{k} draft{'s' if k != 1 else ''}"
    return (f"[auto kept to plain steps: on this machine they measured {plain:.0f} tok/s, rounds of {drafts} an "
            f"expected {drafting:.0f}; --draft-tokens {k} drafts anyway]")


class Console:
    """stdout and stderr as the one terminal they usually share: a line from another thread (the
    compile notice) goes out on a line of its own, at once where no line is half written, else as
    soon as the reply's line ends; never inside it."""

    def __init__(self):
        self._lock, self._mid_line, self._pending = threading.Lock(), False, []

    def write(self, stream, text: str) -> None:
        with self._lock:
            stream.write(text)
            stream.flush()
            if text:
                self._mid_line = not text.endswith("\n")
            self._flush()

    def line(self, text: str) -> None:
        """`text` on stderr, on a line of its own; from any thread."""
        with self._lock:
            self._pending.append(text)
            self._flush()

    def _flush(self) -> None:
        if self._pending and not self._mid_line:
            sys.stderr.write("".join(line + "\n" for line in self._pending))
            sys.stderr.flush()
            self._pending.clear()


CONSOLE = Console()


class Printer:
    """Prints a reply as it streams, from the parts the engine parsed it into: the answer on
    stdout, the reasoning (with --think) on stderr, dimmed on a terminal, and tool calls as
    `[tool call] NAME {arguments}`. A --raw completion is all answer."""

    DIM, PLAIN = "\x1b[2m", "\x1b[0m"

    def __init__(self, thinking: bool):
        self.thinking = thinking  # show reasoning (without --think, hide any)
        self.reasoning = False  # in the middle of printing reasoning
        self.tty = sys.stderr.isatty()

    def show(self, parts) -> None:
        for part in parts:
            if part.kind == "reasoning":
                if self.thinking:
                    self._reason(part.text)
                continue
            self._end_reasoning()
            if part.kind == "tool_call":
                CONSOLE.write(sys.stdout, f"\n[tool call] {part.call.name} {part.call.arguments_json}\n")
            else:
                CONSOLE.write(sys.stdout, part.text)

    def finish(self) -> None:
        self._end_reasoning()

    def _reason(self, text: str) -> None:
        if not self.reasoning:
            text = (self.DIM if self.tty else "thinking: ") + text
            self.reasoning = True
        CONSOLE.write(sys.stderr, text)

    def _end_reasoning(self) -> None:
        if self.reasoning:
            CONSOLE.write(sys.stderr, (self.PLAIN if self.tty else "") + "\n")
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


def attach(session, options: dict, path: str, kind: str = "image"):
    """Show the image (or play the audio) at `path` with the next message: the session becomes an
    `ImageChat` (the conversation so far carried over) and `options` carry the media part until that
    message is sent."""
    from .chat_images import ImageChat, check_media

    try:
        if isinstance(session, Completion):
            raise ValueError(f"--raw completes text: {kind}s go with chat messages")
        part = check_media(session.engine.loaded, path, kind)
        if not isinstance(session, ImageChat):
            session = ImageChat(session.engine, list(session.messages), session.enable_thinking,  # system first
                                session.keep_thinking)
        options.setdefault("media", []).append(part)
        print(f"({kind} {path} goes with your next message)", file=sys.stderr)
    except ValueError as e:  # ImageError, AudioError: unreadable, a model without the tower
        print(f"error: {e}", file=sys.stderr)
    return session


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


def repl(session: Session, options: dict, interactive: bool, stop_at_repeat: bool = True) -> None:
    for line in lines(interactive):
        command = line.strip()
        if command in ("/quit", "/exit", "quit", "exit"):
            return
        if command == "/help":
            print(HELP)
        elif command == "/reset":
            session.reset()
            print("(new conversation)")
        elif command == "/stats":
            print(details(session))
        elif command.startswith(("/image", "/audio", "/video")):
            kind = command[1:6]
            session = attach(session, options, command[len(kind) + 1:].strip(), kind)
        elif command.startswith("/"):
            print(f"unknown command {command}; /help lists them")
        elif command:
            try:
                answer(session, line, options, stop_at_repeat)
                say_if_cut(session, options["max_tokens"])
            except ContextLengthError as e:
                print(f"error: {e}; /reset to start over", file=sys.stderr)
            except Exception as e:  # a request that failed (an unreadable image, ...): the chat goes on
                print(error_line(e), file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        group = launched()  # the ranks `mlx.launch` started together (pipeline parallelism), or None
        sampling = SamplingParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k)
        loaded, banner = open_session(args, group)
    except Exception as e:  # bad path, wrong pair, unreadable checkpoint: one line, no traceback
        print(error_line(e), file=sys.stderr)
        return 2
    # The model stays wired for the session: a chat exists to generate, like a server.
    with memory.generating(loaded.target, loaded.drafter):
        if group is None:
            return talk(loaded, args, sampling, banner)
        print(loaded.target.pipeline.describe(), file=sys.stderr)
        return pipeline.run(loaded, group, lambda: talk(loaded, args, sampling, banner)) or 0


def talk(loaded: Loaded, args, sampling: SamplingParams, banner: str) -> int:
    """Start the engine the chat is a client of; answer --prompt, or run the REPL."""
    max_tokens = args.max_tokens or default_max_tokens(loaded, args.raw)
    options = dict(max_tokens=max_tokens, sampling=sampling, draft_tokens=args.draft_tokens,
                   mtp=not args.no_mtp, seed=args.seed)
    print(banner, file=sys.stderr)
    with Engine(loaded, max_batch=1, draft_tokens=args.draft_tokens) as engine:
        print(engine.memory.describe(engine.prompt_cache_bytes), file=sys.stderr)
        jit.on_first_compile(lambda: CONSOLE.line(jit.NOTICE))
        if args.raw:
            session: Session = Completion(engine, args.stop_at_dedent)
        else:
            session = Conversation(loaded, system=args.system, enable_thinking=args.think, engine=engine,
                                   keep_thinking=args.keep_thinking)
        media = [*((p, "image") for p in args.image), *((p, "audio") for p in args.audio),
                 *((p, "video") for p in args.video)]
        for path, kind in media:
            session = attach(session, options, path, kind)
        if len(options.get("media", ())) != len(media):
            return 2
        if args.prompt is not None:
            return answer_once(session, args.prompt, options, args.stop_at_repeat)
        return converse(session, options, args.stop_at_repeat)


def answer_once(session: Session, text: str, options: dict, stop_at_repeat: bool = True) -> int:
    """--prompt: answer one message; 1 when the request fails (it does not fit the context, ...)."""
    try:
        answer(session, text, options, stop_at_repeat)
        say_if_cut(session)
    except Exception as e:
        print(error_line(e), file=sys.stderr)
        return 1
    return 0


def converse(session: Session, options: dict, stop_at_repeat: bool = True) -> int:
    """The REPL, on a terminal or over stdin lines."""
    if isinstance(sys.stdin, io.TextIOWrapper):  # undecodable bytes become U+FFFD, not a crash
        sys.stdin.reconfigure(errors="replace")
    interactive = sys.stdin.isatty()
    if interactive:
        # Started with SIGINT ignored (e.g. from a script's background job), Python installs no
        # handler and Ctrl-C at the prompt would do nothing: on a terminal it clears the line.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print("type /help for commands", file=sys.stderr)
    try:
        repl(session, options, interactive, stop_at_repeat)
    except KeyboardInterrupt:
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
