"""`python -m mlx_mtp`: generate from a prompt of token ids or text.

With no --model it runs the tiny transformers-made test pair in tests/fixtures/tiny
(random weights: the point is the mechanics and the statistics, not the text).
"""

import argparse
from pathlib import Path

from .generate import generate_tokens
from .loading import load_model
from .sample import SamplingParams
from .stats import Stats

TINY = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tiny" / "dense"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="target model dir or hub id")
    ap.add_argument("--drafter", type=Path, help="MTP drafter dir or hub id")
    ap.add_argument("--prompt-ids", default="5,17,42,9,33,71,8,64,12,99", help="comma-separated token ids")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--draft-tokens", default="auto")
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--seed", type=int)
    args = ap.parse_args(argv)
    if args.model is None:
        print(f"no --model: running the tiny random test pair from {TINY}")
        args.model, args.drafter = TINY / "target", TINY / "drafter"
    target = load_model(args.model)[0]
    drafter = load_model(args.drafter)[0] if args.drafter else None
    k = args.draft_tokens if args.draft_tokens == "auto" else int(args.draft_tokens)
    stats = Stats()
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    tokens = generate_tokens(
        target, prompt, drafter=drafter, sampling=SamplingParams(temperature=args.temp),
        draft_tokens=k, max_tokens=args.max_tokens, seed=args.seed, stats=stats,
    )
    print(" ".join(f"{t}{'*' if d else ''}" for t, d in tokens))
    print(f"(* = accepted draft) {stats.summary()}")


if __name__ == "__main__":
    main()
