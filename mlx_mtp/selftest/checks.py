"""`python -m mlx_mtp.selftest` / `mlx-mtp-selftest`: does MLX on this machine run mlx_mtp right?

On the default device it runs the bundled demo pair, three tiny random pairs (dense, MoE and
E2B-style) and a tiny bf16 4-bit MoE pair at sizes mlx_mtp's CUDA kernels take, and, for each, checks that
  - the target's logits and one drafter step equal those computed on the CPU stream with the
    compiled-ops kernels (on a Mac: the GPU's `mx.fast` kernels against the CPU);
  - greedy MTP (K=3) emits exactly the plain tokens, past the sliding window, for one row (with
    the real drafter, and with an oracle that is right 70% of the time) and for a ragged batch;
then times a plain decode step and a K=3 round. It prints one screen (device, memory, wired
limit, which kernels ran, pass/fail, tok/s) and exits with status 1 when a check fails. Paste it
into bug reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from .. import __version__
from ..runtime import jit, memory, mlx_build
from . import primitives
from ..decode.batch import BatchGenerator
from ..cli import prog_name
from ..decode.drafters import MTPProposer
from ..decode.generate import generate_tokens
from ..kernels import dispatch
from ..loading import Loaded
from ..models.base import force_fused, fused_kernels
from ..decode.oracle import OracleDrafter
from ..decode.stats import Stats
from .tiny import VARIANTS, quantized_pair, tiny_pair

K = 3
TOKENS = 40  # per row: past the sliding window (8 in the tiny pairs; the demo's prompt fills its 128)
TOLERANCE = 1e-3  # of the logits' scale: fp32 on two devices differs by ~1e-5, a broken kernel by far more
BF16_TOLERANCE = 0.1  # bf16 activations on the device against the CPU branch's fp32 products: ~0.04 seen
DEMO_PROMPT = '''import os
import sys


def walk(top, topdown=True, onerror=None, followlinks=False):
    """Directory tree generator.

    For each directory in the directory tree rooted at top (including top
    itself, but excluding '.' and '..'), yields a 3-tuple

        dirpath, dirnames, filenames

    dirpath is a string, the path to the directory.  dirnames is a list of
    the names of the subdirectories in dirpath.
'''
# --kernels: (RoPE/RMSNorm branch: None = the device's, True = mx.fast, False = compiled ops;
# products: mlx_mtp's GPU kernels where they apply, or MLX's everywhere)
KERNELS = {"auto": (None, "auto"), "fused": (True, "auto"), "unfused": (False, "auto"), "mlx": (None, "mlx")}


@dataclasses.dataclass
class Pair:
    name: str
    load: Callable[[], Loaded]
    prompt: Callable[[Loaded], list]
    tolerance: float = TOLERANCE


@dataclasses.dataclass
class Outcome:
    name: str
    tolerance: float = TOLERANCE  # of `logits`
    logits: float = float("nan")  # largest difference from the CPU, relative to the logits' scale
    single: Optional[bool] = None  # B=1: MTP tokens == plain tokens == plain again
    batch: Optional[bool] = None  # ragged batch: every row == its plain tokens
    plain: Optional[Stats] = None
    mtp: Optional[Stats] = None
    nodes: Optional[tuple] = None  # primitives of a plain step and of a K=3 round (`primitives.summary`)
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.logits <= self.tolerance and bool(self.single) and bool(self.batch)

    def problems(self) -> list[str]:
        if self.error is not None:
            return [f"{self.name}: {self.error}"]
        out = []
        if not self.logits <= self.tolerance:
            out.append(f"{self.name}: logits differ from the CPU's by {self.logits:.1e} "
                       f"(tolerance {self.tolerance:.0e})")
        if not self.single:
            out.append(f"{self.name}: greedy MTP differs from plain decoding, or plain from itself (one row)")
        if not self.batch:
            out.append(f"{self.name}: greedy MTP differs from plain decoding in a ragged batch")
        return out


def pairs() -> list[Pair]:
    def demo() -> Loaded:
        from ..demo import load_demo

        return load_demo()

    def random_prompt(loaded: Loaded) -> list:
        return np.random.default_rng(0).integers(3, loaded.target.vocab_size, 20).tolist()

    def seeded_prompt(loaded: Loaded) -> list:  # (the prompt quantized_pair's seed was checked with)
        return np.random.default_rng(3).integers(3, loaded.target.vocab_size, 12).tolist()

    tiny = [Pair(v, lambda v=v: tiny_pair(v), random_prompt) for v in VARIANTS]
    return [Pair("demo", demo, lambda loaded: list(loaded.tokenizer.encode(DEMO_PROMPT))), *tiny,
            Pair("moe-q4", quantized_pair, seeded_prompt, BF16_TOLERANCE)]


def check(pair: Pair) -> Outcome:
    """Every check of one pair; an exception becomes the outcome's error."""
    outcome = Outcome(pair.name, pair.tolerance)
    try:
        loaded = pair.load()
        prompt = pair.prompt(loaded)
        with memory.generating(loaded.target, loaded.drafter):
            outcome.logits = logits_difference(loaded, prompt)
            truth = plain(loaded, prompt, TOKENS)
            outcome.mtp = Stats()
            outcome.single = single_row(loaded, prompt, truth, outcome.mtp)
            outcome.batch = ragged_batch(loaded, prompt, truth)
            outcome.plain = Stats()  # timed now that every shape has run once
            outcome.single &= plain(loaded, prompt, TOKENS, outcome.plain) == truth
        outcome.nodes = primitives.summary(loaded.target, loaded.drafter, 1, K)
    except Exception as e:  # a failing kernel, a missing file: report it and go on to the next pair
        outcome.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return outcome


def logits_difference(loaded: Loaded, prompt: list) -> float:
    """The largest difference between the default device's outputs and the CPU stream's (with the
    compiled-ops kernels), relative to the outputs' scale: target logits, then one drafter step."""
    here = first_outputs(loaded, prompt)
    with mx.stream(mx.cpu), force_fused(False):
        cpu = first_outputs(loaded, prompt)
    return max(float(np.abs(a - b).max()) / (1.0 + float(np.abs(b).max())) for a, b in zip(here, cpu))


def first_outputs(loaded: Loaded, prompt: list) -> list[np.ndarray]:
    """The target's logits for the prompt and the drafter's logits and hidden state for its first
    draft (a sparse head's logits are put back on the full vocabulary, -30 elsewhere)."""
    target, drafter = loaded.target, loaded.drafter
    out = target(mx.array([prompt]))
    token = mx.argmax(out.logits[:, -1], axis=-1)
    step = drafter.draft_step(target.embed(token[:, None])[:, 0], out.hidden[:, -1], out.shared_kv,
                              mx.array([len(prompt)], dtype=mx.int32))
    draft = mx.maximum(step.full_logits(target.vocab_size), -30.0)
    mx.eval(out.logits, draft, step.hidden)
    return [np.array(a.astype(mx.float32)) for a in (out.logits[0], draft[0], step.hidden[0])]


def plain(loaded: Loaded, prompt: list, n: int, stats: Optional[Stats] = None) -> list:
    return [t for t, _ in generate_tokens(loaded.target, prompt, max_tokens=n, draft_tokens=0, stats=stats)]


def mtp(loaded: Loaded, prompt: list, n: int, drafter=None, stats: Optional[Stats] = None) -> list:
    drafter = drafter or loaded.drafter
    out = generate_tokens(loaded.target, prompt, drafter=drafter, draft_tokens=K, max_tokens=n, stats=stats)
    return [t for t, _ in out]


def single_row(loaded: Loaded, prompt: list, truth: list, stats: Stats) -> bool:
    """One row, with an oracle that accepts at varied positions (which also warms every shape up),
    then with the real drafter, whose run is timed into `stats`."""
    oracle = OracleDrafter(truth, len(prompt), loaded.target.vocab_size, 0.7,
                           inner=MTPProposer(loaded.drafter, loaded.target))
    n = len(truth)
    return mtp(loaded, prompt, n, oracle) == truth and mtp(loaded, prompt, n, stats=stats) == truth


def ragged_batch(loaded: Loaded, prompt: list, truth: list) -> bool:
    """Three rows of different lengths and budgets, drafting together; each must equal its own
    plain decoding."""
    n = len(truth)
    rows = [(prompt, n), (prompt[: len(prompt) * 2 // 3], n - 9), (prompt[3 : len(prompt) // 2 + 3], n // 2)]
    gen = BatchGenerator(loaded.target, loaded.drafter, draft_tokens=K)
    uids = {gen.insert(p, max_tokens=m): i for i, (p, m) in enumerate(rows)}
    out: dict[int, list] = {i: [] for i in uids.values()}
    while gen.busy:
        for event in gen.step():
            out[uids[event.uid]] += event.tokens
    expected = [truth] + [plain(loaded, p, m) for p, m in rows[1:]]
    return all(out[i] == expected[i] for i in range(len(rows)))


# ---- the report --------------------------------------------------------------------------------


def header(forced: Optional[bool]) -> list[str]:
    """The machine, the device, the kernels chosen and the memory, one line each."""
    d = memory.Device.current()
    mac = platform.mac_ver()[0]
    system = f"macOS {mac}" if mac else f"{platform.system()} {platform.release()}"
    kernels = "mx.fast (fused)" if fused_kernels() else "compiled MLX ops (unfused)"
    wired = {"metal": f"{memory.size(d.working_set or 0)} while generating",
             "cuda": "nothing (the GPU's own memory)", "cpu": "left alone (CPU)"}[d.backend]
    working_set = f", recommended working set {memory.size(d.working_set)}" if d.working_set else ""
    tf32 = os.environ.get("MLX_ENABLE_TF32") if d.gpu else None
    tf32 = f"; MLX_ENABLE_TF32={tf32}" if tf32 is not None else ""
    return [
        f"mlx_mtp {__version__}, mlx {mx.__version__}, Python {platform.python_version()}, {system} "
        f"({platform.machine()})",
        f"device:  {d.name}, MLX {memory.BACKENDS[d.backend]} backend, "
        f"memory {memory.size(d.memory)}{working_set}",
        f"kernels: RoPE/RMSNorm {kernels}{' (forced)' if forced is not None else ''}; products: "
        f"{products(d.backend)}; reference: the CPU stream, unfused{tf32}",
        f"wired:   {wired}",
        *both_builds(),
    ]


def products(backend: str) -> str:
    if backend != "cuda":
        return "MLX's"
    if dispatch.mode() == "mlx":
        return "MLX's (MLX_MTP_KERNELS=mlx)"
    return "mlx_mtp's CUDA kernels for decode and verify steps, MLX's for prompts"


def ran() -> list[str]:
    """Which kernel each product family took, on an NVIDIA GPU (a line, or none)."""
    summary = dispatch.summary()
    return [f"ran:     {summary}"] if summary else []


def both_builds() -> list[str]:
    """A warning line when MLX's CPU and CUDA builds are both installed: they write the same
    library, and the one written last is what runs."""
    line = mlx_build.both_installed_line()
    return [line] if line else []


COLUMNS = "{:<7}{:<15}{:<6}{:<7}{:>11}{:>11}{:>9}{:>8}{:>8}"
TITLES = COLUMNS.format("pair", "logits vs CPU", "B=1", "batch", "plain step", "K=3 round", "plain/s",
                        "MTP/s", "accept")


def row(o: Outcome) -> str:
    def mark(ok: Optional[bool]) -> str:
        return "-" if ok is None else ("ok" if ok else "FAIL")

    if o.error is not None:
        return f"{o.name:<7}error"
    timing = [""] * 5
    if o.plain is not None and o.mtp is not None:
        p, m = o.plain, o.mtp
        timing = [f"{1000 * p.decode_seconds / max(p.target_forwards, 1):.2f} ms",
                  f"{1000 * m.decode_seconds / max(m.target_forwards, 1):.2f} ms",
                  f"{p.decode_tps:.0f}", f"{m.decode_tps:.0f}", f"{m.acceptance_length:.2f}"]
    logits = f"{o.logits:.1e} {mark(o.logits <= o.tolerance)}"
    return COLUMNS.format(o.name, logits, mark(o.single), mark(o.batch), *timing).rstrip()


def graph(outcomes: list[Outcome]) -> list[str]:
    """Primitives per plain step and per K=3 round of each pair, on this device's path (a line)."""
    counted = [o for o in outcomes if o.nodes is not None and o.nodes[1]]
    if not counted:
        return []
    cells = ", ".join(f"{o.name} {o.nodes[0]} / {o.nodes[1]} ({o.nodes[1] / o.nodes[0]:.2f}x)" for o in counted)
    return [f"graph:   primitives of a plain step / a K={K} round, B=1, {primitives.device_path()} path: {cells}"]


def report(outcomes: list[Outcome], forced: Optional[bool], seconds: float) -> str:
    lines = header(forced) + [
        "",
        TITLES,
        *[row(o) for o in outcomes],
        "",
        *graph(outcomes),
        *ran(),
        memory.usage_line(),
    ]
    problems = [p for o in outcomes for p in o.problems()]
    verdict = "FAIL" if problems else "PASS"
    lines += problems + [f"{verdict}: {len(outcomes)} pairs in {seconds:.1f} s "
                         "(B=1 and batch: greedy MTP K=3 == plain; tok/s of decoding one row)"]
    return "\n".join(lines)


def run(names: Optional[list[str]] = None, kernels: str = "auto") -> tuple[bool, str]:
    """Check the named pairs (default: all); returns (passed, the report)."""
    chosen = [p for p in pairs() if names is None or p.name in names]
    forced, products_mode = KERNELS[kernels]
    start = time.perf_counter()
    dispatch.decisions.clear()
    stop = jit.watch_compiles(lambda n: print(f"compiling kernels (kept on disk for later runs): {n} so far",
                                              file=sys.stderr, flush=True))
    with force_fused(forced), dispatch.using(products_mode):
        outcomes = [check(p) for p in chosen]
        stop()
        text = report(outcomes, forced, time.perf_counter() - start)
    return all(o.ok for o in outcomes), text


def parse_args(argv=None) -> argparse.Namespace:
    names = [p.name for p in pairs()]
    ap = argparse.ArgumentParser(prog=prog_name("mlx_mtp.selftest"), description="Check that MLX on this "
                                 "machine runs mlx_mtp right (the default device against the CPU, greedy MTP "
                                 "against plain decoding) and time it; paste the output into bug reports.")
    ap.add_argument("--pairs", type=lambda s: s.split(","), default=None,
                    help=f"comma-separated subset of {','.join(names)} (default: all)")
    ap.add_argument("--warm", metavar="MODEL", help="instead of the checks: compile every kernel MODEL (a dir or hub "
                                                    "id; with --drafter) will use, for machine images and first runs")
    ap.add_argument("--drafter", help="with --warm: the MTP drafter dir or hub id")
    ap.add_argument("--batches", type=batch_sizes, default=range(1, 9), help="with --warm: rows, e.g. 1-8 (default)")
    ap.add_argument("--kernels", choices=list(KERNELS), default="auto",
                    help="RoPE/RMSNorm branch on the default device (default: auto, fused on a GPU); mlx: MLX's "
                         "kernels for every product (on NVIDIA GPUs mlx_mtp's own take decode and verify steps)")
    args = ap.parse_args(argv)
    unknown = set(args.pairs or ()) - set(names)
    if unknown:
        ap.error(f"unknown pair(s) {', '.join(sorted(unknown))}; choose from {', '.join(names)}")
    return args


def batch_sizes(text: str) -> range:
    low, _, high = text.partition("-")
    return range(int(low), int(high or low) + 1)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.warm:
        from ..loading import load
        from .warm import warm

        done = warm(load(args.warm, drafter=args.drafter), args.batches, log=print)
        print(f"warmed {args.warm}: {done['runs']} runs, {done['compiled']} kernels compiled, {done['seconds']:.0f} s")
        return 0
    # The check compares float32 outputs with the CPU's: MLX's GPU matmuls would otherwise round
    # float32 inputs to TF32 (10-bit mantissas). Read by MLX at its first GPU matmul.
    os.environ.setdefault("MLX_ENABLE_TF32", "0")
    passed, text = run(args.pairs, args.kernels)
    print(text)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
