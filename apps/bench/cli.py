"""Command line: `python -m apps.bench MODE [options]` (speed by default); the modes and their
figures are in apps/README.md. Modes that measured one issue's question and are history now (oracle,
cost, stepcost, experts, hosttime, mixed) were removed in issue 45: their code is at commit d1a4d89.

Every mode takes `--regime {stock,mkl}` (see regime.py); it is set up before mlx is
imported, so this module imports nothing that imports mlx until then.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
from pathlib import Path

from . import regime


class NeedsGPU(RuntimeError):
    """A mode this machine cannot run, said in one line (exit status 2)."""

# subcommand -> (module of apps.bench, function(args, log) -> result dict)
MODES = {
    "speed": ("speed", "run_speed"), "engine": ("engine", "run_engine"), "ttft": ("ttft", "run_ttft"),
    "lookup": ("lookup", "run_lookup"), "pipeline": ("pipeline", "run_pipeline_bench"),
    "agent": ("agent", "run_agent"),
    "structured": ("structured", "run_structured"),
    "realsize": ("realsize", "run_realsize"),
    "gpu": ("gpu", "run_gpu"),
    "kernels": ("kernels", "run_kernels"),
    "learn": ("learn", "run_learn"),
    "prefill": ("prefill", "run_prefill"),
    "primitives": ("primitives", "run_primitives"),
    "histories": ("histories", "run_histories"),
}


class _OneLineModes(argparse.HelpFormatter):
    """--help lists each mode on one line: argparse measures the modes' names without the 2 columns
    it indents them by, and would wrap the longest names' help."""

    def __init__(self, prog):
        super().__init__(prog)
        self._action_max_length = 2 + 2 + max(map(len, MODES))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m apps.bench", description=__doc__,
                                 formatter_class=_OneLineModes)
    sub = ap.add_subparsers(dest="command", title="modes (python -m apps.bench MODE --help)", metavar="MODE")

    def common(p, out):
        p.add_argument("--out", type=Path, default=Path("bench_out") / out, help="results.{md,json}, plot.png")
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--regime", choices=regime.REGIMES, default="stock",
                       help="BLAS for fp32 matmuls: stock (as installed) or mkl")

    s = sub.add_parser("speed", help="ours plain and MTP vs mlx-lm: B, K, prompt classes")
    common(s, "speed")
    s.add_argument("--model", help="target dir (default: mlx_mtp/demo/target if present, else the tiny dense pair)")
    s.add_argument("--drafter", help="drafter dir (with --model)")
    s.add_argument("--pair", help="tiny-dense | tiny-moe | tiny-e2b | demo")
    s.add_argument("--batch", default="1,2,4,8")
    s.add_argument("--k", default="1,2,3,4,5,6,auto", help="draft lengths (ints and/or auto)")
    s.add_argument("--tokens", type=int, default=64, help="new tokens per row")
    s.add_argument("--classes", help="prompt classes (code,prose,chat with a tokenizer; fixture,random,repeat without)")
    s.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx-lm baselines")
    s.add_argument("--dtype", default="stored", choices=("stored", "float32", "bfloat16"),
                   help="compute dtype of ours and mlx-lm alike (fp32 matmuls are what the regimes change)")
    s.add_argument("--prompts", type=int, default=1, help="at B=1, run this many prompts of each class in turn "
                                                          "(their tokens and times summed)")
    s.add_argument("--mlxlm-draft", help="mlx-lm speculative draft model: DIR, 'self' (the target; default for "
                                         "tokenizer-less tiny pairs) or 'none'")

    p = sub.add_parser("pipeline", help="one process vs two pipeline ranks: tok/s, traffic")
    common(p, "pipeline")
    p.add_argument("--pair", default="tiny-dense", help="tiny-dense | tiny-moe (E2B-style pairs cannot be split)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--k", type=int, default=3, help="draft length of the MTP mode")

    g = sub.add_parser("engine", help="the Engine under N concurrent requests, MTP on/off")
    common(g, "engine")
    g.add_argument("--pair", default="demo,tiny-moe", help="comma list of demo, tiny-dense, tiny-moe, tiny-e2b "
                                                           "(loaded as stored: the demo pair in bf16)")
    g.add_argument("--clients", default="1,2,4,8", help="concurrent requests N (the batched engine's max_batch "
                                                        "is the largest)")
    g.add_argument("--fifo-clients", type=int, default=8, help="N for the max_batch=1 baseline (0: none)")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    g.add_argument("--dtype", default="stored", choices=("stored", "float32", "bfloat16"),
                   help="compute dtype (stored: as the Engine loads it; float32 lets --regime serve the matmuls)")
    g.add_argument("--quick", action="store_true", help="N=1,8, 24 tokens, 1 repeat")

    f = sub.add_parser("ttft", help="time to first token, ours vs mlx-vlm")
    common(f, "ttft")
    f.add_argument("--models", default="demo,e2b", help="demo (as stored, bf16) and/or e2b (an E2B-shaped random "
                                                        "checkpoint: 35 layers, 20 KV-shared, width scaled down)")
    f.add_argument("--lengths", default="64,112,200,1000", help="prompt lengths in tokens")
    f.add_argument("--e2b-hidden", type=int, default=128, help="hidden size of the E2B-shaped model (E2B: 1536)")
    f.add_argument("--quick", action="store_true", help="demo only, lengths 64,200, 2 repeats")
    f.set_defaults(repeats=5)

    u = sub.add_parser("lookup", help="prompt lookup: n-gram, MTP and hybrid drafting")
    common(u, "lookup")
    u.add_argument("--files", type=int, default=6, help="held-out stdlib files (one prompt each)")
    u.add_argument("--lines", type=int, default=40, help="lines of each file in the prompt")
    u.add_argument("--tokens", type=int, default=160, help="new tokens per prompt")
    u.add_argument("--k", default="6,auto", help="draft lengths (ints and/or auto)")
    u.add_argument("--dtype", default="stored", choices=("stored", "float32", "bfloat16"))
    u.add_argument("--quick", action="store_true", help="2 files, 48 tokens, K=6")
    u.set_defaults(repeats=1)

    a = sub.add_parser("agent", help="agent sessions via the server, prefix cache on/off")
    common(a, "agent")
    a.add_argument("--pair", default="demo", help="demo | mid (the mid pair with the demo tokenizer and --context "
                                                  "positions: long contexts)")
    a.add_argument("--calls", type=int, default=25, help="calls per session (fewer when the context fills)")
    a.add_argument("--sessions", type=int, default=4, help="concurrent sessions sharing the system prompt")
    a.add_argument("--system-tokens", type=int, default=600, help="system prompt (tool declarations) tokens")
    a.add_argument("--max-tokens", type=int, default=12, help="tokens per reply")
    a.add_argument("--context", type=int, default=12288, help="--pair mid: its max positions")
    a.add_argument("--prompt-cache-gb", type=float, default=2.0, help="the prefix cache budget when on")
    a.add_argument("--scenarios", default="one,many,seeded", help="one session, --sessions concurrent ones, one "
                                                                  "seeded (comma list)")
    a.add_argument("--caches", default="on,off", help="servers to run: prefix cache on, off, disk (on, with "
                                                      "--prompt-cache-dir, then a new server on that directory)")
    a.set_defaults(repeats=1)

    j = sub.add_parser("structured", help="JSON-schema requests: validity, MTP on/off, grammar")
    common(j, "structured")
    j.add_argument("--pair", default="demo", help="demo | tiny-dense | tiny-moe")
    j.add_argument("--requests", type=int, default=200, help="requests whose replies are validated")
    j.add_argument("--batch", type=int, default=8, help="rows at a time in the validity run")
    j.add_argument("--speed-requests", type=int, default=20, help="requests of the B=1 speed runs")
    j.add_argument("--max-tokens", type=int, default=192)
    j.add_argument("--temperature", type=float, default=0.0)
    j.add_argument("--dtype", default="float32", choices=("stored", "float32"))
    j.set_defaults(repeats=3)

    r = sub.add_parser("realsize", help="a released shape at real size: memory, speed, MTP")
    common(r, "realsize")
    r.add_argument("--shape", default="26b-a4b", help="26b-a4b | 31b | e4b | e2b | tiny (the tiny MoE fixture shape)")
    r.add_argument("--bits", type=int, default=4, choices=(4, 8), help="affine, group 64 (MoE router and dense MLP "
                                                                       "at 8, as mlx-community's 26B-A4B)")
    r.add_argument("--cache-dir", default=str(Path("~/.cache/mlx_mtp/realsize")),
                   help="where the checkpoint pair is written once (<shape>-<bits>bit/{target,assistant})")
    r.add_argument("--prefill", default="40,1000", help="prompt lengths timed to the first token")
    r.add_argument("--batch", default="1,4,8", help="rows of plain decoding (and of the assistant-head timing)")
    r.add_argument("--mtp-batch", default="1,4", help="rows of MTP (oracle) vs plain")
    r.add_argument("--tokens", type=int, default=24, help="new tokens per row at B=1 (plain and MTP)")
    r.add_argument("--batch-tokens", type=int, default=8, help="new tokens per row at B>1")
    r.add_argument("--context", type=int, default=8, help="prompt tokens per row before decoding")
    r.add_argument("--k", type=int, default=3, help="draft length of the MTP runs")
    r.add_argument("--p", type=float, default=0.8, help="oracle: probability that a draft is right")
    r.add_argument("--long-context", type=int, default=32768, help="K/V memory at this many positions (0: skip)")
    r.add_argument("--cache-limit-gb", type=float, default=0.5, help="MLX buffer cache limit during the run")
    r.add_argument("--max-rss-gb", type=float, default=17.0, help="abort once this process's RSS passes it (0: never)")
    r.add_argument("--seed", type=int, default=0, help="prompts")
    r.add_argument("--streams", type=int, help="CPU streams that quantized work is spread over (default: one per core)")
    r.set_defaults(repeats=3)

    u = sub.add_parser("gpu", help="GPU suite: 31B, 26B-A4B, E4B vs roofline and peers")
    common(u, "gpu")
    u.add_argument("--smoke", action="store_true", help="the same code at the tiny fixture shapes (any device)")
    u.add_argument("--shapes", help="comma list (default 31b,26b-a4b,e4b; with --smoke tiny-dense,tiny-moe,tiny-e2b)")
    u.add_argument("--p", type=float, default=0.8, help="oracle: probability that a draft is right")
    u.add_argument("--seed", type=int, default=0, help="prompts")
    u.add_argument("--no-peers", action="store_true", help="skip mlx-lm and mlx-vlm")
    u.add_argument("--prefill", default=None, help="prompt lengths timed to the first token (comma list; "
                                                  "default 1024,8192, with --smoke 32,96; empty: none)")
    u.add_argument("--kernels", choices=("auto", "mlx"), default=None,
                   help="mlx: MLX's kernels everywhere (MLX_MTP_KERNELS=mlx); auto: mlx_mtp's on CUDA")
    u.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="run the stages in order of value and skip, saying so, those that would not fit")
    u.add_argument("--stages", help="comma list of stages (default: all): " + ", ".join(
                       ("31b", "26b-a4b", "31b-batch", "26b-a4b-batch", "prefill", "peers", "e4b", "demo")))
    u.add_argument("--kernel-cache", metavar="DIR",
                   help="keep MLX's compiled kernels in DIR (MLX_PTX_CACHE_DIR) and reuse them")
    u.add_argument("--no-demo", action="store_true", help="skip the demo pair")
    u.add_argument("--results-dir", default=str(Path(__file__).resolve().parents[1] / "results" / "gpu"),
                   help="where a GPU run's JSON goes (<card>-<date>.json)")

    n = sub.add_parser("kernels", help="mlx_mtp's CUDA kernels vs MLX's at released shapes")
    common(n, "kernels")
    n.add_argument("--shapes", default="31b,26b-a4b", help="comma list of 31b, 26b-a4b, e4b")
    n.add_argument("--quick", action="store_true", help="fewer row counts")
    n.add_argument("--smoke", action="store_true", help="tiny shapes (wherever the kernels run)")
    n.set_defaults(repeats=5)

    L = sub.add_parser("learn", help="the demo drafter adapted to new traffic: acceptance")
    common(L, "learn")
    L.add_argument("--traffic", choices=("c", "tool-calls"), default="c",
                   help="what is served: excerpts of this Python's C headers (C, new to the demo pair) or JSON "
                        "tool-call transcripts (default: c)")
    L.add_argument("--requests", type=int, default=800, help="requests served and kept (default: 800)")
    L.add_argument("--max-tokens", type=int, default=64, help="tokens per reply (default: 64)")
    L.add_argument("--temperature", type=float, default=0.8,
                   help="of the served replies, seeded per request (default: 0.8)")
    L.add_argument("--captures", help="a working directory to reuse: the tuned target, the captured requests "
                                      "(served into when short of --requests), the adapted drafter")
    L.add_argument("--tune-steps", type=int,
                   help="fine-tune the demo target on the traffic's kind of text first (tool-call transcripts, "
                        "or the C headers), so that it answers it in kind (0: the shipped target, which answers "
                        "every prompt with stdlib-style code; default: 40 with --traffic tool-calls, else 0)")
    L.add_argument("--serve-only", action="store_true",
                   help="tune and serve (into --captures), then stop: the adaptation can then run in another "
                        "regime (default: off)")
    L.add_argument("--steps", type=int, default=300, help="training steps at most (default: 300)")
    L.add_argument("--minutes", type=float, default=15.0,
                   help="the adaptation's whole time, measuring before and after included, as "
                        "`python -m mlx_mtp.learn --minutes` (default: 15)")
    L.add_argument("--seq", type=int, default=128, help="(default: 128)")
    L.add_argument("--batch", type=int, default=4, help="(default: 4)")
    L.add_argument("--lr", type=float, default=1e-3, help="(default: 1e-3)")
    L.add_argument("--seed", type=int, default=0, help="(default: 0)")
    L.add_argument("--wall-prompts", type=int, default=12, help="held-out prompts timed at B = 1")
    L.add_argument("--real-step", metavar="SHAPES", help="instead: one distillation step of these released "
                                                          "assistants (31b,26b-a4b) at real size, time and memory")
    L.add_argument("--real-batch", type=int, default=1)
    L.add_argument("--real-seq", type=int, default=512)

    f = sub.add_parser("prefill", help="requests arriving together: batched prefill, TTFT")
    common(f, "prefill")
    f.add_argument("--pair", default="demo", help="a pair with a tokenizer (demo)")
    f.add_argument("--arrivals", type=int, default=8, help="requests inserted at once")
    f.add_argument("--prompt-tokens", default="300-600",
                   help="new prompt tokens per request: lo-hi, lengths spread evenly (comma list: scenarios)")
    f.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    f.add_argument("--chunk", type=int, default=512, help="prefill_chunk: the grid prompts are cut on")
    f.add_argument("--budgets", default="1,512,2048",
                   help="prefill_tokens of each configuration (the first is the baseline; under --chunk: one "
                        "row at a time)")
    f.set_defaults(repeats=3)

    h = sub.add_parser("histories", help="prefilled / new prompt tokens per history mode, thinking off/on")
    common(h, "histories")
    h.set_defaults(repeats=1)

    c = sub.add_parser("primitives", help="graph nodes per layer and step per path, counted")
    common(c, "primitives")
    c.add_argument("--shapes", default="demo,31b,26b-a4b,e4b", help="demo and released shapes (comma list)")
    c.add_argument("--paths", default="cpu,metal,cuda", help="cpu | metal | cuda (comma list)")
    c.add_argument("--batch", default="1,4,8", help="rows (comma list)")
    c.add_argument("--k", type=int, default=3, help="draft length of the counted round")
    c.set_defaults(repeats=1)
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
    load_before = os.getloadavg()
    module, function = MODES[args.command]
    args.command_line = shlex.join(["python", "-m", "apps.bench", *argv])
    run = getattr(importlib.import_module(f"apps.bench.{module}"), function)
    try:
        res = run(args, log)
    except NeedsGPU as e:  # what this machine cannot measure: one line, no traceback
        print(e, file=sys.stderr)
        return 2
    res["loadavg"] = {"start": [round(x, 2) for x in load_before], "end": [round(x, 2) for x in os.getloadavg()]}
    res["regime"] = info["regime"]
    res["command"] = args.command_line
    from .report import write

    md = write([res], info, args.out)
    print(md)
    print(f"wrote {args.out}/results.md, results.json" + (", plot.png" if (args.out / "plot.png").exists() else ""))
    if res.get("mismatches"):
        print("OUTPUT MISMATCHES: " + "; ".join(res["mismatches"]), file=sys.stderr)
        return 1
    return 0
