"""Speed mode: ours plain / ours MTP (K sweep, auto) / mlx-lm generate / mlx-lm speculative.

Same weights, same prompts, greedy, every mode generates exactly `tokens` tokens (stop
tokens ignored). Every mode is run once as warm-up, then `repeats` times interleaved (all
modes in turn, so machine noise hits every mode alike); speed-ups are medians of ratios
measured within one repeat. Our outputs are checked against plain greedy (B = 1) and any
mismatch is flagged.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from mlx_mtp.runtime import jit
from mlx_mtp.decode.batch import BatchGenerator
from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.loading import load
from mlx_mtp.decode.speculative import K_MAX
from mlx_mtp.decode.stats import Stats
from mlx_mtp.selftest.warm import every_length

from .env import median, peak_mb, reset_peak
from .prompts import prompt_sets

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "fixtures" / "tiny"
DEMO = ROOT / "mlx_mtp" / "demo"


def default_pair() -> tuple[Path, Path, str]:
    if (DEMO / "target" / "config.json").exists() and (DEMO / "drafter" / "config.json").exists():
        return DEMO / "target", DEMO / "drafter", "demo"
    return TINY / "dense" / "target", TINY / "dense" / "drafter", "tiny-dense"


def pair_dirs(name: str) -> tuple[Path, Path]:
    if name == "demo":
        return DEMO / "target", DEMO / "drafter"
    if name.startswith("tiny-"):
        return TINY / name[5:] / "target", TINY / name[5:] / "drafter"
    raise SystemExit(f"unknown pair {name!r} (tiny-dense, tiny-moe, tiny-e2b, demo)")


def default_mlxlm_draft(model_dir: Path) -> str:
    """mlx-lm's speculative mode needs a separate target-type model of the same vocabulary:
    for a tiny fixture target another tiny fixture target; otherwise none is known."""
    model_dir = model_dir.resolve()
    if model_dir.parent.parent == TINY.resolve():
        return "tiny-moe" if model_dir.parent.name != "moe" else "tiny-dense"
    return "none"


def quantization_label(model_dir: Path, model) -> str:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    q = config.get("quantization")
    if q:
        return f"{q.get('mode', 'affine')} {q.get('bits')}-bit g{q.get('group_size')}"
    return f"unquantized {model.model.embed_tokens.weight.dtype}".replace("mlx.core.", "")


# ---- one measured run ---------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    tokens: list  # per row
    seconds: float  # wall, prefill included
    ttft: float
    prompt_tps: float
    decode_tps: float  # aggregate over rows
    peak_mb: float
    drafted_at: list = dataclasses.field(default_factory=list)
    accepted_at: list = dataclasses.field(default_factory=list)
    rounds: int = 0
    accepted: int = 0
    forwards: int = 0  # target forwards after the prefill


def from_stats(tokens, seconds, stats: Stats, ttft: float) -> Run:
    return Run(tokens, seconds, ttft, stats.prompt_tps,
               (stats.emitted - len(tokens)) / stats.decode_seconds if stats.decode_seconds else 0.0,
               peak_mb(), list(stats.drafted_at), list(stats.accepted_at), stats.rounds, stats.accepted,
               stats.target_forwards)


def many(fn: Callable[[list], Run], prompts: list) -> Run:
    """`fn` on each prompt in turn, as one run: tokens per prompt, times and counts summed
    (decode tok/s = all decoded tokens / all decode time), TTFT the mean."""
    runs = [fn(p) for p in prompts]
    if len(runs) == 1:
        return runs[0]
    prompt_s = sum(len(p) / r.prompt_tps for p, r in zip(prompts, runs) if r.prompt_tps)
    decoded = [sum(len(t) for t in r.tokens) - len(r.tokens) for r in runs]
    decode_s = sum(d / r.decode_tps for d, r in zip(decoded, runs) if r.decode_tps)
    width = max([len(r.drafted_at) for r in runs] + [0])
    pad = lambda xs: list(xs) + [0] * (width - len(xs))  # noqa: E731
    return Run([t for r in runs for t in r.tokens], sum(r.seconds for r in runs),
               sum(r.ttft for r in runs) / len(runs), sum(len(p) for p in prompts) / prompt_s if prompt_s else 0.0,
               sum(decoded) / decode_s if decode_s else 0.0, max(r.peak_mb for r in runs),
               list(np.sum([pad(r.drafted_at) for r in runs], axis=0)) if width else [],
               list(np.sum([pad(r.accepted_at) for r in runs], axis=0)) if width else [],
               sum(r.rounds for r in runs), sum(r.accepted for r in runs), sum(r.forwards for r in runs))


def ours_single(loaded, prompt, n, k) -> Run:
    """Our B = 1 path (generate_tokens); k None = plain decoding."""
    stats = Stats()
    reset_peak()
    start = time.perf_counter()
    drafter = loaded.drafter if k is not None else None
    tokens = [t for t, _ in generate_tokens(loaded.target, prompt, drafter=drafter,
                                            draft_tokens=k if k is not None else 0, max_tokens=n, stats=stats)]
    return from_stats([tokens], time.perf_counter() - start, stats, stats.first_token_seconds)


def ours_batch(loaded, prompts, n, k) -> Run:
    """BatchGenerator with B rows; aggregate tok/s = total tokens / wall."""
    reset_peak()
    start = time.perf_counter()
    gen = BatchGenerator(loaded.target, loaded.drafter if k is not None else None,
                         draft_tokens=k if k is not None else 0)
    uids = [gen.insert(p, max_tokens=n) for p in prompts]
    out = {u: [] for u in uids}
    ttft = None
    while gen.busy:
        for event in gen.step():
            out[event.uid] += event.tokens
            if ttft is None and event.tokens:
                ttft = time.perf_counter() - start
    return from_stats([out[u] for u in uids], time.perf_counter() - start, gen.stats, ttft)


def mlxlm_plain(model, prompt, n) -> Run:
    from mlx_lm.generate import generate_step

    reset_peak()
    start = time.perf_counter()
    tokens, first = [], None
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        tokens.append(int(tok))
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    ttft = first - start
    return Run([tokens], end - start, ttft, len(prompt) / ttft, (n - 1) / max(end - first, 1e-9), peak_mb(),
               forwards=n - 1)


def mlxlm_spec(model, draft, prompt, n, k) -> Run:
    from mlx_lm.generate import speculative_generate_step

    reset_peak()
    start = time.perf_counter()
    tokens, flags, first = [], [], None
    for tok, _, from_draft in speculative_generate_step(mx.array(prompt), model, draft, num_draft_tokens=k,
                                                        max_tokens=n):
        tokens.append(int(tok))
        flags.append(bool(from_draft))
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    ttft = first - start
    # mlx-lm reports only a from_draft flag: each verify forward emits its accepted drafts and
    # one target token, so forwards ~ target tokens after the first.
    own = max(sum(not f for f in flags[1:]), 1)
    return Run([tokens], end - start, ttft, len(prompt) / ttft, (n - 1) / max(end - first, 1e-9), peak_mb(),
               rounds=own, accepted=sum(flags), forwards=own)


# ---- mlx-lm on the same weights ------------------------------------------------------------


def mlxlm_config(config: dict) -> dict:
    """`config` in mlx-lm's form (global_head_dim, not transformers-5.23's per_layer_config; a
    top-level vocab_size for the multimodal wrapper)."""
    config = copy.deepcopy(config)
    text = config.get("text_config", config)
    for over in (text.pop("per_layer_config", None) or {}).values():
        if "head_dim" in over:
            text["global_head_dim"] = over["head_dim"]
        if "num_key_value_heads" in over:
            text["num_global_key_value_heads"] = over["num_key_value_heads"]
    if "text_config" in config and "vocab_size" not in config:
        config["vocab_size"] = text["vocab_size"]
    return config


def mlxlm_form(src: Path, dst: Path) -> Path:
    """A copy of `src` in mlx-lm's config form (`mlxlm_config`); weights linked."""
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(mlxlm_config(json.loads((src / "config.json").read_text()))))
    for f in src.iterdir():
        if f.name != "config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    return dst


def load_mlxlm(model_dir: Path, tmp: Path):
    from mlx_lm.utils import load_model

    return load_model(mlxlm_form(Path(model_dir), tmp / Path(model_dir).name))[0]


# ---- the benchmark -----------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    prompt_class: str
    batch: int
    mode: str  # ours-plain, ours-mtp-K, ours-mtp-auto, mlx-lm-plain, mlx-lm-spec-K
    fn: Callable[[], Run]
    k: object = None
    reference: str = "ours-plain"  # whose greedy output this mode must equal
    note: str = ""
    runs: list = dataclasses.field(default_factory=list)
    tokens: Optional[list] = None  # from the warm-up
    traces: int = 0  # new compiled traces in its timed runs (0 after a complete warm-up)


def warm_lengths(loaded, sets: dict, batches: list, singles: int, n: int, log) -> None:
    """Every shape `auto` may meet built on each case's prompts before anything is timed (issue 42: auto
    measured 0.09x plain on a GPU, compiling mid-run): each fixed draft length, then plain steps and
    drafted rounds in turn (`warm.every_length`)."""
    for prompts in sets.values():
        for B in batches:
            for group in ([[p] for p in prompts[:singles]] if B == 1 else [prompts[:B]]):
                every_length(group, loaded, n)
    log(f"warmed draft lengths 0..{K_MAX} and their orders at B = {', '.join(map(str, batches))}")


def parse_ks(text: str) -> list:
    return [k if k == "auto" else int(k) for k in text.split(",") if k]


def run_speed(args, log=print) -> dict:
    if args.pair:
        model_dir, drafter_dir = pair_dirs(args.pair)
        pair = args.pair
    elif args.model:
        model_dir, drafter_dir, pair = Path(args.model), Path(args.drafter), Path(args.model).name
    else:
        model_dir, drafter_dir, pair = default_pair()
    dtype = None if args.dtype == "stored" else getattr(mx, args.dtype)
    loaded = load(model_dir, drafter_dir, dtype=dtype)
    batches, ks, n = [int(b) for b in args.batch.split(",")], parse_ks(args.k), args.tokens
    classes = args.classes.split(",") if args.classes else None
    singles = max(args.prompts, 1)  # prompts per B = 1 run
    sets = prompt_sets(loaded, model_dir, max(batches + [singles]), classes)
    tmp = Path(tempfile.mkdtemp(prefix="bench-mlxlm-"))
    notes = []
    mlxlm, draft, draft_label = None, None, None
    if not args.no_mlx_lm:
        try:
            mlxlm = load_mlxlm(model_dir, tmp)
            if dtype is not None:
                mlxlm.set_dtype(dtype)
                mx.eval(mlxlm.parameters())
        except Exception as e:  # an unsupported format: say so, keep going
            notes.append(f"mlx-lm could not load {model_dir}: {e}")
        want = args.mlxlm_draft or default_mlxlm_draft(Path(model_dir))
        if mlxlm is not None and want.startswith("tiny-"):
            other = TINY / want[5:] / "target"
            draft = load_mlxlm(other, tmp / "draft")
            draft_label = (f"the {want} fixture target as draft model (same 128-token vocabulary, unrelated random "
                           "weights: low acceptance; shows the mode runs and whether it stays exact)")
        elif mlxlm is not None and want == "self":
            draft, draft_label = mlxlm, "target as its own draft model (shows the mode runs; cannot speed up)"
        elif mlxlm is not None and want != "none":
            draft, draft_label = load_mlxlm(Path(want), tmp), f"draft model {want}"
        elif mlxlm is not None:
            notes.append("mlx-lm's speculative mode needs a separate, smaller target-type model with the same "
                         "vocabulary; none is available for this pair, so it does not apply (pass --mlxlm-draft DIR)")
        if draft is not None:
            notes.append(f"mlx-lm speculative: {draft_label}. mlx-lm cannot rewind Gemma 4's rotating sliding-window "
                         "cache, so its output silently diverges once the window wraps; the 'same as' column checks it "
                         "against mlx-lm's own greedy output")
    if mlxlm is not None:  # same weights, same math?
        ids = mx.array([sets[next(iter(sets))][0]])
        ours_logits = loaded.target(ids).logits
        diff = float(mx.abs(ours_logits - mlxlm(ids)).max())
        notes.append(f"mlx-lm vs ours on the same weights: max |logit diff| {diff:.2e} over the first prompt")

    cases: list[Case] = []
    for cls, prompts in sets.items():
        for B in batches:
            rows = prompts[:B]
            if B == 1:
                ps = prompts[:singles]
                add = lambda mode, fn, **kw: cases.append(Case(cls, 1, mode, fn, **kw))  # noqa: E731
                add("ours-plain", lambda: many(lambda p: ours_single(loaded, p, n, None), ps))
                for k in ks:
                    add(f"ours-mtp-{k}", lambda k=k: many(lambda p: ours_single(loaded, p, n, k), ps), k=k)
                if mlxlm is not None:
                    add("mlx-lm-plain", lambda: many(lambda p: mlxlm_plain(mlxlm, p, n), ps),
                        note="mlx-lm generate_step")
                    for k in ks if draft is not None else []:
                        if k != "auto":
                            add(f"mlx-lm-spec-{k}", lambda k=k: many(lambda p: mlxlm_spec(mlxlm, draft, p, n, k), ps),
                                k=k, reference="mlx-lm-plain", note=draft_label)
            else:
                cases.append(Case(cls, B, "ours-plain", lambda r=rows: ours_batch(loaded, r, n, None)))
                for k in ks:
                    cases.append(Case(cls, B, f"ours-mtp-{k}", lambda r=rows, k=k: ours_batch(loaded, r, n, k), k=k))

    # truth: our plain greedy output of every prompt at B = 1
    truth = {cls: [ours_single(loaded, p, n, None).tokens[0] for p in ps[: max(batches + [singles])]]
             for cls, ps in sets.items()}
    log(f"{len(cases)} cases x (1 warm-up + {args.repeats} repeats), {n} tokens each")
    started = time.perf_counter()
    for c in cases:  # warm-up of every path (compiles, allocations), and the outputs
        c.tokens = c.fn().tokens
    if "auto" in ks:  # every draft length `auto` may pick, at every B, built before anything is timed
        warm_lengths(loaded, sets, batches, singles, n, log)
    for r in range(args.repeats):
        for c in cases:
            with jit.counting() as traced:
                c.runs.append(c.fn())
            c.traces += traced.count
        log(f"repeat {r + 1}/{args.repeats} done ({time.perf_counter() - started:.0f} s)")

    index = {(c.prompt_class, c.batch, c.mode): c for c in cases}
    rows, mismatches = [], []
    for c in cases:
        rows_n = len(c.tokens)  # B rows, or the B = 1 prompts run in turn
        if c.reference == "ours-plain":
            expected = truth[c.prompt_class][:rows_n]
        else:
            expected = index[(c.prompt_class, c.batch, c.reference)].tokens
        same = c.tokens == expected and all(run.tokens == expected for run in c.runs)
        first_diff = None
        if not same:
            a, b = c.tokens[0], expected[0]
            first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            if c.mode.startswith("ours"):
                mismatches.append(f"{c.prompt_class} B={c.batch} {c.mode}: output differs from plain greedy")
        base = index[(c.prompt_class, c.batch, "ours-plain")]
        ratios = [run.decode_tps / b.decode_tps for run, b in zip(c.runs, base.runs) if b.decode_tps]
        drafted = np.sum([np.pad(r.drafted_at, (0, 8 - len(r.drafted_at))) for r in c.runs], axis=0)
        accepted = np.sum([np.pad(r.accepted_at, (0, 8 - len(r.accepted_at))) for r in c.runs], axis=0)
        rounds, acc = sum(r.rounds for r in c.runs), sum(r.accepted for r in c.runs)
        total = sum(len(t) for t in c.runs[0].tokens)
        rows.append(dict(
            prompt_class=c.prompt_class, batch=c.batch, mode=c.mode, k=c.k, note=c.note,
            prompt_tokens=[len(p) for p in sets[c.prompt_class][:rows_n]],
            tokens=total, seconds=median([r.seconds for r in c.runs]),
            aggregate_tps=median([total / r.seconds for r in c.runs]),
            decode_tps=median([r.decode_tps for r in c.runs]),
            prompt_tps=median([r.prompt_tps for r in c.runs]),
            ttft_ms=1000 * median([r.ttft for r in c.runs]),
            speedup_vs_ours_plain=median(ratios),
            acceptance_length=(1 + acc / rounds) if rounds and c.k is not None else None,
            acceptance_at=[round(a / d, 3) for a, d in zip(accepted, drafted) if d],
            tokens_per_forward=total / max(median([r.forwards for r in c.runs]) + rows_n, 1)
            if c.mode.startswith("ours") else None,
            peak_mb=median([r.peak_mb for r in c.runs]),
            same_as=c.reference, same_output=same, first_divergence=first_diff, traces_timed=c.traces,
        ))
    shutil.rmtree(tmp, ignore_errors=True)
    traced = {f"{c.prompt_class} B={c.batch} {c.mode}": c.traces for c in cases if c.traces}
    notes.append("new compiled traces during the timed runs: " + (
        ", ".join(f"{name}: {count}" for name, count in traced.items()) if traced else "none"))
    return dict(
        mode="speed", pair=pair, model=str(model_dir), drafter=str(drafter_dir),
        quantization=quantization_label(model_dir, loaded.target),
        tokenizer=loaded.tokenizer is not None, tokens=n, repeats=args.repeats, batches=batches, prompts=singles,
        draft_lengths=ks, prompt_classes=list(sets), notes=notes, mismatches=mismatches,
        rows=rows, summary=summarize(rows, batches, ks),
    )


def summarize(rows, batches, ks) -> dict:
    """Speed-up of ours-mtp-K over ours-plain at the same B: geometric mean over prompt classes."""
    out = {}
    for k in ks:
        for B in batches:
            vals = [r["speedup_vs_ours_plain"] for r in rows
                    if r["mode"] == f"ours-mtp-{k}" and r["batch"] == B and r["speedup_vs_ours_plain"]]
            if vals:
                out[f"{k}@{B}"] = math.exp(sum(math.log(v) for v in vals) / len(vals))
    return out
