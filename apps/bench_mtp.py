"""`python -m apps.bench_mtp`: MTP vs plain decoding on the tiny fixture pairs (a benchmark, not a test).

Modes, same target and prompt, greedy, warm-up excluded, medians over repeats, all ratios
measured within one run:
  plain          no drafter
  random-auto    the fixture's independently random drafter, draft length "auto"
                 (must back off: the 'never slower' check, target >= 0.9x plain)
  oracle-P       a drafter that pays the real drafter's cost but proposes the target's
                 true continuation with probability P (controlled acceptance), fixed K
Prints tokens per target forward and wall-clock ratio vs plain. Tiny models are
dispatch-bound: the ratios show the loop's overheads and gains, not real-model speed.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_mtp.generate import generate_tokens
from mlx_mtp.loading import load_model
from mlx_mtp.oracle import OracleDrafter
from mlx_mtp.stats import Stats

TINY = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tiny"


def run(target, prompt, n, drafter=None, k="auto"):
    stats = Stats()
    start = time.perf_counter()
    tokens = [t for t, _ in generate_tokens(target, prompt, drafter=drafter, draft_tokens=k,
                                            max_tokens=n, stats=stats)]
    return tokens, time.perf_counter() - start, stats


def bench_variant(variant, n, repeats, k):
    target, drafter = load_model(TINY / variant / "target")[0], load_model(TINY / variant / "drafter")[0]
    prompt = np.load(TINY / variant / "reference.npz")["prompt"].tolist()
    truth, _, _ = run(target, prompt, n)  # also the warm-up
    modes = {"plain": lambda: run(target, prompt, n),
             "random-auto": lambda: run(target, prompt, n, drafter, "auto")}
    for p in (0.6, 0.8, 0.95):
        modes[f"oracle-{p}"] = lambda p=p: run(
            target, prompt, n, OracleDrafter(truth, len(prompt), target.vocab_size, p, inner=drafter), k)
    for fn in modes.values():
        fn()  # warm-up of every path
    times = {name: [] for name in modes}
    last = {}
    for _ in range(repeats):  # interleaved, so machine noise hits every mode alike
        for name, fn in modes.items():
            tokens, seconds, stats = fn()
            assert tokens == truth, f"{variant} {name}: output differs from plain greedy"
            times[name].append(seconds)
            last[name] = stats
    plain = statistics.median(times["plain"])
    rows = []
    for name in modes:
        s = last[name]
        rows.append(dict(variant=variant, mode=name, seconds=statistics.median(times[name]),
                         speed_vs_plain=plain / statistics.median(times[name]),
                         tokens_per_forward=n / max(s.target_forwards + 1, 1),
                         acceptance_length=s.acceptance_length, mtp_rounds=s.rounds,
                         plain_steps=s.plain_steps))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="dense,moe,e2b")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--k", type=int, default=4, help="draft length of the oracle runs")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = [r for v in args.variants.split(",") for r in bench_variant(v, args.tokens, args.repeats, args.k)]
    print(f"mlx {mx.__version__}, device {mx.default_device()}, {args.tokens} tokens, "
          f"median of {args.repeats}")
    print("| variant | mode | speed vs plain | tokens / target forward | acceptance length | rounds | plain steps |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['mode']} | {r['speed_vs_plain']:.2f}x | {r['tokens_per_forward']:.2f} | "
              f"{r['acceptance_length']:.2f} | {r['mtp_rounds']} | {r['plain_steps']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
