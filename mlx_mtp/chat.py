"""`python -m mlx_mtp.chat`: chat with a Gemma 4 model in the terminal, with MTP speculative decoding.

Every turn reuses the KV cache of the conversation so far. Without --model it runs the small demo
pair bundled in `mlx_mtp.demo`. With --prompt it answers once and exits (for scripts); without a
terminal it reads one message per line from stdin.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from pathlib import Path
from typing import Iterator, Optional

import mlx.core as mx

from . import pipeline
from .conversation import Conversation
from .generate import ContextLengthError
from .group import Group, launched
from .loading import Loaded, load
from .sample import SamplingParams
from .stats import Stats

HELP = """commands:
  /reset   start over (the system message stays)
  /stats   details of the last reply and the KV cache
  /help    this help
  /quit    leave (so does end of input, Ctrl-D)
Ctrl-C stops a reply; what was written stays in the conversation."""


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m mlx_mtp.chat", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="target model dir or hub id (default: the bundled demo pair)")
    ap.add_argument("--drafter", help="MTP drafter dir or hub id (default: none, plain decoding)")
    ap.add_argument("--draft-tokens", type=draft_tokens, default="auto", metavar="N|auto")
    ap.add_argument("--no-mtp", action="store_true", help="plain decoding, no drafter")
    ap.add_argument("--temp", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=512, help="per reply")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--system", help="system message")
    ap.add_argument("--prompt", help="answer this one message and exit")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="compute dtype (default: the checkpoint's; float32 for the demo pair)")
    return ap.parse_args(argv)


def draft_tokens(text: str):
    if text == "auto":
        return text
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a number of tokens or 'auto', got {text!r}")


def demo_pair() -> tuple[Path, Optional[Path]]:
    try:
        import mlx_mtp.demo as demo
    except ImportError:
        demo = None
    file = getattr(demo, "__file__", None)
    root = Path(file).parent if file else None
    if root is None or not (root / "target").is_dir():
        raise FileNotFoundError("no --model given and the bundled demo pair (mlx_mtp/demo) is not installed; "
                                "pass --model DIR (and --drafter DIR)")
    return root / "target", (root / "drafter") if (root / "drafter").is_dir() else None


def load_pair(args, group: Optional[Group] = None) -> tuple[Loaded, str]:
    """Load the model (this rank's part of it in a pipeline group); returns it and a banner line."""
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
    loaded = load(model, drafter, dtype=dtype) if group is None else pipeline.load(model, drafter, dtype, group)
    if group is None or group.leader:
        if loaded.tokenizer is None:
            raise ValueError(f"{model} has no tokenizer: chat needs one")
        if not getattr(loaded.tokenizer, "has_chat_template", True):
            raise ValueError(f"{model}'s tokenizer has no chat template")
    mode = f"MTP, draft tokens {args.draft_tokens}" if drafter is not None else "plain decoding"
    return loaded, f"{what}; {mode}"


def stat_line(s: Stats) -> str:
    line = f"[{s.emitted} tokens, {s.decode_tps:.1f} tok/s, first token {s.first_token_seconds * 1000:.0f} ms"
    if s.rounds:
        line += f", acceptance length {s.acceptance_length:.2f}, {100 * s.draft_share:.0f}% from drafts"
    return line + "]"


def details(conv: Conversation) -> str:
    memory = "KV cache: empty"
    if conv.cache is not None:
        memory = f"KV cache: {conv.cached} tokens, {conv.cache.nbytes / 2**20:.1f} MiB"
    if conv.last_stats is None:
        return f"no reply yet\n{memory}"
    s = conv.last_stats
    prompt = f"prompt: {s.prompt_tokens} tokens fed, {s.prompt_tps:.0f} tok/s"
    return f"last reply: {s.summary()}\n{prompt}\n{memory}"


def answer(conv: Conversation, text: str, options: dict) -> None:
    stream, stats = conv.reply(text, **options), None
    try:
        with ctrl_c() as stop:
            for event in stream:
                print(event.text, end="", flush=True)
                stats = event.stats
                if stop.is_set():
                    break
    except KeyboardInterrupt:  # a second Ctrl-C: the conversation keeps what was written
        pass
    finally:
        stream.close()
    print(flush=True)
    if stats is not None:
        print(stat_line(stats), file=sys.stderr, flush=True)


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


def repl(conv: Conversation, options: dict, interactive: bool) -> None:
    for line in lines(interactive):
        command = line.strip()
        if command in ("/quit", "/exit"):
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
            except ContextLengthError as e:
                print(f"error: {e}; /reset to start over", file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        group = launched()  # the ranks `mlx.launch` started together (pipeline parallelism), or None
        sampling = SamplingParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k)
        loaded, banner = load_pair(args, group)
        conv = Conversation(loaded, system=args.system) if group is None or group.leader else None
    except Exception as e:  # bad path, wrong pair, unreadable checkpoint: one line, no traceback
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    if group is None:
        return talk(conv, args, sampling, banner)
    print(loaded.target.pipeline.describe(), file=sys.stderr)
    return pipeline.run(loaded, group, lambda: talk(conv, args, sampling, banner)) or 0


def talk(conv: Conversation, args, sampling: SamplingParams, banner: str) -> int:
    """Answer --prompt, or run the REPL."""
    if args.seed is not None:
        mx.random.seed(args.seed)
    options = dict(max_tokens=args.max_tokens, sampling=sampling, draft_tokens=args.draft_tokens,
                   mtp=not args.no_mtp)
    print(banner, file=sys.stderr)
    if args.prompt is not None:
        try:
            answer(conv, args.prompt, options)
        except ContextLengthError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        print("type /help for commands", file=sys.stderr)
    try:
        repl(conv, options, interactive)
    except KeyboardInterrupt:
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
