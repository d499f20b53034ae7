"""Acceptance of the demo drafter on held-out stdlib code (files no training stage saw).

    python -m apps.demo_pair.eval_acceptance [--target DIR --drafter DIR] [--prompts 30] [--k 3]

Prompts: `--prompts` windows of 64-128 tokens cut from the held-out files (md5(path) % 50 == 0,
see apps/demo_pair/data.py), at seeded random offsets. For each prompt, greedy decoding of
`--max-tokens` tokens three ways: plain, MTP with a fixed draft length K, MTP with the default
"auto" policy; the MTP outputs must equal the plain output token for token.

Reported: mean acceptance length (1 + accepted / rounds, vLLM's convention: tokens per MTP
verify forward), per-position acceptance P(draft i accepted | drafted), tokens per target forward.

Loop check: the greedy continuation of a weak target can be a trivial repetition, which any
drafter predicts. For each continuation we compute the fraction of distinct 4-grams (1.0: no
4-gram repeats; a 4-token cycle gives ~0.05) and flag it as a loop when that fraction is < 0.5
or it has fewer than 8 distinct tokens; acceptance is reported over all prompts and over the
non-loop ones separately.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from apps.demo_pair.data import stdlib_files  # noqa: E402
from mlx_mtp.decode.generate import generate_tokens  # noqa: E402
from mlx_mtp.loading import load  # noqa: E402
from mlx_mtp.decode.stats import Stats  # noqa: E402

LOOP_DISTINCT_4GRAMS = 0.5
LOOP_MIN_DISTINCT_TOKENS = 8


def distinct_4grams(tokens) -> float:
    grams = [tuple(tokens[i : i + 4]) for i in range(len(tokens) - 3)]
    return len(set(grams)) / len(grams) if grams else 1.0


def is_loop(tokens) -> bool:
    return distinct_4grams(tokens) < LOOP_DISTINCT_4GRAMS or len(set(tokens)) < LOOP_MIN_DISTINCT_TOKENS


def held_out_prompts(tokenizer, n: int, lo: int = 64, hi: int = 128, seed: int = 0) -> list[dict]:
    """n token windows of lo..hi tokens from the held-out stdlib files, starting at a line start."""
    rng = np.random.default_rng(seed)
    files = stdlib_files(held_out=True)
    names = sorted(files)
    encoded = {}
    prompts = []
    while len(prompts) < n:
        name = names[rng.integers(len(names))]
        if name not in encoded:
            encoded[name] = tokenizer.encode(files[name], add_special_tokens=False)
        ids = encoded[name]
        length = int(rng.integers(lo, hi + 1))
        if len(ids) <= length + 64:
            continue
        newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
        start = int(rng.integers(0, len(ids) - length - 64))
        while start > 0 and ids[start - 1] != newline:  # begin at a line start
            start -= 1
        prompts.append({"file": name, "start": start, "ids": ids[start : start + length]})
    return prompts


def merge(total: Stats, s: Stats) -> None:
    total.rounds += s.rounds
    total.plain_steps += s.plain_steps
    total.drafted += s.drafted
    total.accepted += s.accepted
    total.emitted += s.emitted - 1  # decode tokens only: the first one comes from the prefill forward
    total.from_draft += s.from_draft
    total.decode_seconds += s.decode_seconds
    grow = len(s.drafted_at) - len(total.drafted_at)
    if grow > 0:
        total.drafted_at += [0] * grow
        total.accepted_at += [0] * grow
    for i, (d, a) in enumerate(zip(s.drafted_at, s.accepted_at)):
        total.drafted_at[i] += d
        total.accepted_at[i] += a


def summarize(s: Stats) -> dict:
    return {
        "acceptance_length": round(s.acceptance_length, 3),
        "per_position_acceptance": [round(r, 3) for r in s.acceptance_rates],
        "tokens_per_target_forward": round(s.emitted / max(1, s.target_forwards), 3),
        "rounds": s.rounds, "plain_steps": s.plain_steps, "decode_tokens": s.emitted,
        "decode_seconds": round(s.decode_seconds, 2),
    }


def evaluate(target_dir, drafter_dir, n_prompts=30, max_tokens=64, k=3, seed=0, dtype=mx.float32,
             print_fn=print) -> dict:
    loaded = load(target_dir, drafter_dir, dtype=dtype)
    prompts = held_out_prompts(loaded.tokenizer, n_prompts, seed=seed)
    stop = tuple(loaded.eos_ids)
    groups = {name: {"all": Stats(), "non_loop": Stats()} for name in (f"k{k}", "auto")}
    plain_time = {"all": 0.0, "non_loop": 0.0}
    rows = []
    for i, prompt in enumerate(prompts):
        ids = prompt["ids"]
        t0 = time.perf_counter()
        plain = [t for t, _ in generate_tokens(loaded.target, ids, max_tokens=max_tokens, stop_ids=stop)]
        t_plain = time.perf_counter() - t0
        # the continuation after the prompt, excluding the first (prefill) token only for the loop check
        loop = is_loop(plain)
        row = {"file": prompt["file"], "prompt_tokens": len(ids), "generated": len(plain),
               "distinct_4grams": round(distinct_4grams(plain), 3), "loop": loop}
        for name, draft in ((f"k{k}", k), ("auto", "auto")):
            stats = Stats()
            mtp = [t for t, _ in generate_tokens(loaded.target, ids, drafter=loaded.drafter, draft_tokens=draft,
                                                  max_tokens=max_tokens, stop_ids=stop, stats=stats)]
            if mtp != plain:
                raise AssertionError(f"prompt {i}: MTP ({name}) output differs from plain greedy")
            merge(groups[name]["all"], stats)
            if not loop:
                merge(groups[name]["non_loop"], stats)
            row[name] = {"acceptance_length": round(stats.acceptance_length, 3), "rounds": stats.rounds,
                         "plain_steps": stats.plain_steps, "seconds": round(stats.decode_seconds, 2)}
        plain_time["all"] += t_plain
        if not loop:
            plain_time["non_loop"] += t_plain
        rows.append(row)
        print_fn(f"[{i + 1}/{len(prompts)}] {prompt['file']}: {len(ids)} prompt tokens, "
                 f"4-gram distinct {row['distinct_4grams']:.2f}{' LOOP' if loop else ''}, "
                 f"acceptance length K={k}: {row[f'k{k}']['acceptance_length']:.2f}")
    result = {
        "target": str(target_dir), "drafter": str(drafter_dir), "prompts": len(prompts),
        "non_loop_prompts": sum(not r["loop"] for r in rows), "max_tokens": max_tokens, "k": k, "seed": seed,
        "loop_rule": f"distinct 4-gram fraction < {LOOP_DISTINCT_4GRAMS} or < {LOOP_MIN_DISTINCT_TOKENS} distinct tokens",
        "mean_distinct_4grams": round(float(np.mean([r["distinct_4grams"] for r in rows])), 3),
        "plain_seconds": {key: round(v, 2) for key, v in plain_time.items()},
        "results": {name: {sub: summarize(s) for sub, s in g.items()} for name, g in groups.items()},
        "per_prompt": rows,
    }
    return result


def main(argv=None):
    from mlx_mtp.demo import DRAFTER_DIR, TARGET_DIR

    p = argparse.ArgumentParser(prog="python -m apps.demo_pair.eval_acceptance",
                                description=__doc__.split("\n")[0])
    p.add_argument("--target", default=str(TARGET_DIR), help="target model dir (default: the demo pair's)")
    p.add_argument("--drafter", default=str(DRAFTER_DIR), help="its drafter dir (default: the demo pair's)")
    p.add_argument("--prompts", type=int, default=30,
                   help="prompts cut from the held-out stdlib files, 64-128 tokens each (default: 30)")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt (default: 64)")
    p.add_argument("--k", type=int, default=3, help="the fixed draft length compared with auto (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts' offsets (default: 0)")
    p.add_argument("--json", type=Path, help="write the full result here (default: printed only)")
    a = p.parse_args(argv)
    res = evaluate(a.target, a.drafter, a.prompts, a.max_tokens, a.k, a.seed)
    for name, g in res["results"].items():
        for sub, s in g.items():
            print(f"{name:>5} {sub:>8}: acceptance length {s['acceptance_length']:.2f}, per position "
                  f"{' '.join(f'{r:.2f}' for r in s['per_position_acceptance'])}, "
                  f"{s['tokens_per_target_forward']:.2f} tokens/target forward "
                  f"({s['rounds']} MTP rounds, {s['plain_steps']} plain steps)")
    print(f"non-loop prompts: {res['non_loop_prompts']}/{res['prompts']}; mean distinct 4-gram fraction "
          f"{res['mean_distinct_4grams']:.2f}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")
    return res


if __name__ == "__main__":
    main()
