"""How `python -m mlx_mtp.chat --raw` completes held-out function headers on the demo pair.

    python -m apps.demo_pair.eval_raw [--headers 20] [--seed 0] [--repetition 1.0 1.2] [--draft-tokens auto 3]

Prompts: `--headers` top-level `def` headers (undecorated, the signature alone) drawn with `--seed` from
the held-out stdlib files (apps/demo_pair/data.py), each completed as the chat's --raw mode does
(greedy, `--max-tokens`, the stop at a line back at column 0 and the repeat stop). Reported per decoding
option (repetition penalty x draft length): how many completions end their function (a line at
column 0, or EOS), loop (the repeat stop) or run to the budget, and the share of tokens from MTP rounds.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from apps.demo_pair.data import stdlib_files  # noqa: E402
from mlx_mtp import chat  # noqa: E402
from mlx_mtp.cli import draft_tokens  # noqa: E402
from mlx_mtp.engine.engine import Engine  # noqa: E402
from mlx_mtp.loading import load  # noqa: E402
from mlx_mtp.decode.processors import Penalties  # noqa: E402


def headers(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(file, header) of n undecorated top-level functions of the held-out files, header lines up to the colon."""
    files, found = stdlib_files(held_out=True), []
    for name in sorted(files):
        try:
            tree = ast.parse(files[name])
        except SyntaxError:
            continue
        lines = files[name].splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.decorator_list:
                head = "\n".join(lines[node.lineno - 1: node.body[0].lineno - 1]).rstrip()
                if head.endswith(":") and len(head) < 200:
                    found.append((name, head))
    picked = np.random.default_rng(seed).choice(len(found), size=min(n, len(found)), replace=False)
    return [found[i] for i in sorted(picked)]


def evaluate(engine: Engine, prompts, max_tokens: int, **options) -> dict:
    counts = {"ends": 0, "loops": 0, "length": 0, "tokens": 0, "mtp_tokens": 0, "rounds": 0, "accepted": 0}
    texts = []
    for name, head in prompts:
        session = chat.Completion(engine)
        stream = chat.LoopStop(session.reply(head, max_tokens=max_tokens, **options))
        text = "".join(e.text for e in stream)
        s = session.last_stats
        kind = "loops" if stream.note else "length" if s.emitted >= max_tokens else "ends"
        counts[kind] += 1
        counts["tokens"] += s.emitted - 1  # after the prompt's token, as the stat line counts them
        counts["mtp_tokens"] += max(s.emitted - 1 - s.plain_steps, 0) if s.rounds else 0
        counts["rounds"], counts["accepted"] = counts["rounds"] + s.rounds, counts["accepted"] + s.accepted
        texts.append({"file": name, "header": head, "kind": kind, "text": text})
    counts["mtp_share"] = round(counts["mtp_tokens"] / max(1, counts["tokens"]), 3)
    counts["acceptance_length"] = round(1 + counts["accepted"] / max(1, counts["rounds"]), 2)
    return {**counts, "texts": texts}


def main(argv=None) -> dict:
    from mlx_mtp.demo import DRAFTER_DIR, TARGET_DIR

    p = argparse.ArgumentParser(prog="python -m apps.demo_pair.eval_raw", description=__doc__.split("\n")[0])
    p.add_argument("--target", default=str(TARGET_DIR), help="target model dir (default: the demo pair's)")
    p.add_argument("--drafter", default=str(DRAFTER_DIR), help="its drafter dir (default: the demo pair's)")
    p.add_argument("--headers", type=int, default=20,
                   help="held-out function headers to complete (default: 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the headers drawn (default: 0)")
    p.add_argument("--max-tokens", type=int, default=chat.RAW_TOKENS,
                   help=f"per completion, as the chat's --raw (default: {chat.RAW_TOKENS})")
    p.add_argument("--repetition", type=float, nargs="+", default=[1.0],
                   help="repetition penalties to compare (default: 1.0, none)")
    p.add_argument("--draft-tokens", type=draft_tokens, nargs="+", default=["auto"], metavar="N|auto",
                   help="draft lengths to compare, 0-6 or auto (default: auto)")
    p.add_argument("--json", type=Path, help="write the completions and counts here (default: printed only)")
    a = p.parse_args(argv)
    prompts = headers(a.headers, a.seed)
    results = {}
    with Engine(load(a.target, a.drafter, dtype=mx.float32), max_batch=1) as engine:
        for r in a.repetition:
            for k in a.draft_tokens:
                res = evaluate(engine, prompts, a.max_tokens, draft_tokens=k, penalties=Penalties(repetition=r))
                results[f"repetition {r}, draft tokens {k}"] = res
                print(f"repetition {r}, draft tokens {k}: of {len(prompts)}, {res['ends']} end their function, "
                      f"{res['loops']} loop, {res['length']} run to {a.max_tokens} tokens; {res['tokens']} tokens, "
                      f"{res['mtp_share']:.0%} from MTP rounds (acceptance length {res['acceptance_length']:.2f})",
                      flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
