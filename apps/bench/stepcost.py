"""`python -m apps.bench.stepcost`: measured per-forward costs of a pair (target forward over T
tokens, one drafter step), the numbers that bound the MTP speed-up on a given machine."""

import argparse
import mlx.core as mx

from apps.bench.env import time_fn
from mlx_mtp.demo import DRAFTER_DIR, TARGET_DIR
from mlx_mtp.loading import load_model


def timed(fn, repeats=30):
    return time_fn(fn, repeats, warmup=3) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(TARGET_DIR))
    ap.add_argument("--drafter", default=str(DRAFTER_DIR))
    ap.add_argument("--batch", default="1,8")
    args = ap.parse_args(argv)
    target = load_model(args.model, dtype=mx.float32)[0]
    drafter = load_model(args.drafter, dtype=mx.float32)[0]
    print("| B | target T=1 ms | target T=4 (K=3 verify) ms | drafter step ms | K=3 round / plain step |")
    print("|---|---|---|---|---|")
    for B in [int(b) for b in args.batch.split(",")]:
        cache = target.make_cache(B, max_rollback=8)
        out = target(mx.ones((B, 200), dtype=mx.int32), cache)
        mx.eval(out.hidden)

        def forward(T):
            o = target(mx.ones((B, T), dtype=mx.int32), cache)
            mx.eval(o.logits)
            cache.trim(T)

        def step():
            o = drafter.draft_step(target.embed(mx.ones((B, 1), dtype=mx.int32))[:, 0], out.hidden[:, -1],
                                   target.shared_kv(cache), mx.array([200] * B))
            mx.eval(o.logits, o.hidden)

        t1, t4, d = timed(lambda: forward(1)), timed(lambda: forward(4)), timed(step)
        print(f"| {B} | {t1:.1f} | {t4:.1f} | {d:.1f} | {(t4 + 3 * d) / t1:.2f}x |")


if __name__ == "__main__":
    main()
