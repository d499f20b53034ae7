"""Command line: `python -m apps.bench {speed,oracle,experts,cost,stepcost,pipeline} [options]` (speed by default).

Every mode takes `--regime {stock,mkl,streaming}` (see regime.py); it is set up before mlx is
imported, so this module imports nothing that imports mlx until then.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from . import regime


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m apps.bench", description=__doc__)
    sub = ap.add_subparsers(dest="command")

    def common(p, out):
        p.add_argument("--out", type=Path, default=Path("bench_out") / out, help="results.{md,json}, plot.png")
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--regime", choices=regime.REGIMES, default="stock",
                       help="BLAS for fp32 matmuls: stock (as installed), mkl, streaming (EMULATES a "
                            "bandwidth-bound GPU: MKL + a weight-streaming sgemm for 1-8 rows)")

    s = sub.add_parser("speed", help="ours plain/MTP vs mlx-lm, B and K sweeps, prompt classes")
    common(s, "speed")
    s.add_argument("--model", help="target dir (default: mlx_mtp/demo/target if present, else the tiny dense pair)")
    s.add_argument("--drafter", help="drafter dir (with --model)")
    s.add_argument("--pair", help="tiny-dense | tiny-moe | tiny-e2b | demo")
    s.add_argument("--batch", default="1,2,4,8")
    s.add_argument("--k", default="1,2,3,4,5,6,auto", help="draft lengths (ints and/or auto)")
    s.add_argument("--tokens", type=int, default=64, help="new tokens per row")
    s.add_argument("--classes", help="prompt classes (code,prose,chat with a tokenizer; fixture,random,repeat without)")
    s.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx-lm baselines")
    s.add_argument("--mlxlm-draft", help="mlx-lm speculative draft model: DIR, 'self' (the target; default for "
                                         "tokenizer-less tiny pairs) or 'none'")

    o = sub.add_parser("oracle", help="controlled-acceptance drafter on the tiny pairs (old bench_mtp)")
    common(o, "oracle")
    o.add_argument("--variants", default="dense,moe,e2b")
    o.add_argument("--tokens", type=int, default=200)
    o.add_argument("--k", type=int, default=4, help="draft length of the oracle runs")
    o.set_defaults(repeats=5)

    e = sub.add_parser("experts", help="MoE expert union per verify forward; sorted-indices path")
    common(e, "experts")
    e.add_argument("--model", help="MoE target dir (default: the tiny MoE pair)")
    e.add_argument("--drafter")
    e.add_argument("--batch", default="1,2,4,8")
    e.add_argument("--k", default="1,2,4,6")
    e.add_argument("--tokens", type=int, default=32)
    e.add_argument("--shape", help="also time the sorted-indices path on one real-shape MoE layer "
                                   "(random weights), e.g. 26b-a4b")
    e.add_argument("--bits", type=int, default=4, help="with --shape: 0 = unquantized fp32")
    e.add_argument("--sizes", default="1,2,4,8,16,32,64", help="tokens per forward for the sorted-path timing")

    c = sub.add_parser("cost", help="released shapes, random weights: step costs and a PROJECTED speed-up")
    common(c, "cost")
    c.add_argument("--shape", default="e2b", help="comma list of e2b, e4b, 26b-a4b, 31b, or tiny (a toy config)")
    c.add_argument("--bits", type=int, default=4, help="4 or 8 (affine, group 64); 0 = unquantized fp32")
    c.add_argument("--layers", type=int, default=2, help="instances of each layer kind to time (chained)")
    c.add_argument("--sizes", default="1,2,4,8,16,32,64", help="tokens per target forward T = B*(K+1)")
    c.add_argument("--context", type=int, default=256, help="tokens already in the KV cache")
    c.add_argument("--batch", default="1,2,4,8")
    c.add_argument("--k", default="1,2,3,4,5,6")
    c.add_argument("--acceptance", help="per-position acceptance for the projection, e.g. 0.84,0.6,0.39,0.27, "
                                        "or a speed results.json (its pair's measured rates)")
    c.add_argument("--skip-head", action="store_true", help="do not time the 262144-row LM head")
    c.set_defaults(repeats=2)

    t = sub.add_parser("stepcost", help="target forward cost vs tokens per row, drafter step, MTP round cost in "
                                        "plain steps")
    common(t, "stepcost")
    t.add_argument("--pair", default="demo", help="demo | tiny | mid (~313M-param Gemma-4-shaped target with random "
                                                  "weights and a ~4%% drafter, built in-process)")
    t.add_argument("--batch", default="1,4,8")
    t.add_argument("--max-tokens", type=int, default=8, help="time target forwards of T = 1..N tokens per row")
    t.add_argument("--k", default="1,2,3,4,5,6", help="draft lengths for the round cost")
    t.add_argument("--context", type=int, default=128, help="tokens in the cache before the timed forwards")
    t.add_argument("--seed", type=int, default=0, help="weights of the mid pair")
    t.set_defaults(repeats=7)

    p = sub.add_parser("pipeline", help="1 process vs 2 local ranks (pipeline parallelism): tok/s, traffic per round")
    common(p, "pipeline")
    p.add_argument("--pair", default="tiny-dense", help="tiny-dense | tiny-moe (E2B-style pairs cannot be split)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--k", type=int, default=3, help="draft length of the MTP mode")
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["speed", *argv]
    args = parser().parse_args(argv)
    try:
        regime.setup(args.regime)
    except regime.RegimeError as e:
        print(f"regime {args.regime}: {e}", file=sys.stderr)
        return 2
    from .env import device_info, device_line

    info = device_info()
    print(device_line(info), flush=True)
    log = lambda msg: print(msg, flush=True)
    if args.command == "speed":
        from .speed import run_speed

        res = run_speed(args, log)
    elif args.command == "oracle":
        from .speed import run_oracle

        res = run_oracle(args, log)
    elif args.command == "pipeline":
        from .pipeline import run_pipeline_bench

        res = run_pipeline_bench(args, log)
    elif args.command == "experts":
        from .experts import run_experts

        res = run_experts(args, log)
    elif args.command == "cost":
        from .cost import run_cost

        res = run_cost(args, log)
    else:
        from .stepcost import run_stepcost

        res = run_stepcost(args, log)
    res["regime"] = info["regime"]
    res["command"] = shlex.join(["python", "-m", "apps.bench", *argv])
    from .report import write

    md = write([res], info, args.out)
    print(md)
    print(f"wrote {args.out}/results.md, results.json" + (", plot.png" if (args.out / "plot.png").exists() else ""))
    if res.get("mismatches"):
        print("OUTPUT MISMATCHES: " + "; ".join(res["mismatches"]), file=sys.stderr)
        return 1
    return 0
