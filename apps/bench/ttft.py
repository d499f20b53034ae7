"""TTFT mode (issue 13 item 4): time to first token, ours vs mlx-vlm, on the same checkpoint files
and the same prompts.

Models: `demo` (mlx_mtp/demo/target as stored, bf16) and `e2b`, a checkpoint with E2B's layer
structure (35 layers, the last 20 KV-shared, 4 sliding : 1 full, double-wide MLP on the shared
layers, per-layer inputs, proportional RoPE on full layers) with its width scaled down
(`--e2b-hidden`, vocab 4096 so the demo tokenizer's ids fit) and seed-deterministic random fp32
weights, written once as a gemma4_text checkpoint (config.json + model.safetensors) under the
user cache dir, which both loaders read. Prompts: held-out stdlib source (the demo pair's split)
tokenized with the demo tokenizer, cut to each length.

Ours: `generate_tokens(target, prompt, max_tokens=1)` (the BatchGenerator path, prompt chunks of
512), from the call to the first token as an int. mlx-vlm: `mlx_vlm.generate.generate_step`
(greedy, its default prefill step of 2048), from the call to its first token as an int. Both
skip the KV-shared layers on the prompt positions whose output is unused. Plain decoding (no
drafter) on both sides. Implementations alternate within each repeat; ratios are medians of
within-repeat ratios. Agreement: the first tokens are compared on every run, and the last
position's logits of one full forward on each side.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import mlx.core as mx
from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.loading import load
from mlx_mtp.models.layout import checkpoint_weights

from .env import median
from .pairs import ROOT, build, n_params
from .report import fmt, section, table

DEMO_TARGET = ROOT / "mlx_mtp" / "demo" / "target"
E2B_CONFIG = ROOT / "tests" / "fixtures" / "real_configs" / "google--gemma-4-E2B-it" / "config.json"


def e2b_config(hidden: int) -> dict:
    """E2B's text config with the layer structure kept and the width scaled by hidden / 1536."""
    real = json.loads(E2B_CONFIG.read_text())["text_config"]
    scale = hidden / real["hidden_size"]
    config = {k: v for k, v in real.items() if k not in ("dtype", "transformers_version")}
    config.update(
        hidden_size=hidden, intermediate_size=int(real["intermediate_size"] * scale),
        num_attention_heads=4, head_dim=max(32, int(real["head_dim"] * scale)),
        global_head_dim=max(64, int(real["global_head_dim"] * scale)),
        hidden_size_per_layer_input=max(16, int(real["hidden_size_per_layer_input"] * scale)),
        vocab_size=4096, vocab_size_per_layer_input=4096, max_position_embeddings=4096,
        architectures=["Gemma4ForCausalLM"], dtype="float32",
    )
    return config


def e2b_checkpoint(hidden: int, seed: int = 0, log=print) -> Path:
    """Write (once) an E2B-shaped random checkpoint both loaders read; returns its directory."""
    config = e2b_config(hidden)
    key = hashlib.sha256(json.dumps([config, seed], sort_keys=True).encode()).hexdigest()[:10]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlx_mtp"
    path = cache / f"bench-e2b-{hidden}-{key}"
    if (path / "model.safetensors").exists():
        return path
    log(f"writing the E2B-shaped checkpoint to {path}")
    model = build(config, seed)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), checkpoint_weights(model))
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    os.replace(tmp, path)
    return path


def code_prompts(tokenizer, lengths: list) -> dict:
    """Held-out stdlib source, tokenized, cut to each length (one prompt per length)."""
    from apps.demo_pair.data import stdlib_files

    text = "\n".join(stdlib_files(held_out=True).values())
    ids = tokenizer.encode(text[: 16 * max(lengths)])
    if len(ids) < max(lengths):
        raise SystemExit(f"held-out text gives only {len(ids)} tokens")
    return {L: ids[:L] for L in lengths}


def ours_first(target, prompt) -> tuple[float, int]:
    start = time.perf_counter()
    token = next(generate_tokens(target, prompt, max_tokens=1))[0]
    return time.perf_counter() - start, int(token)


def vlm_first(model, prompt) -> tuple[float, int]:
    from mlx_vlm.generate import generate_step

    start = time.perf_counter()
    for token, _ in generate_step(mx.array([prompt]), model, None, None, max_tokens=1, temperature=0.0):
        token = int(token.item()) if isinstance(token, mx.array) else int(token)
        break
    return time.perf_counter() - start, token


def bench_model(name: str, path: Path, prompts: dict, repeats: int, log) -> dict:
    from mlx_vlm.utils import load_model as vlm_load

    ours = load(path).target  # as stored
    vlm = vlm_load(path)
    cfg = ours.config
    description = (f"{path.name}: {n_params(ours) / 1e6:.1f}M params, "
                   f"{ours.model.embed_tokens.weight.dtype}".replace("mlx.core.", "")
                   + f", {cfg.num_hidden_layers} layers, {cfg.num_hidden_layers - cfg.first_shared_layer} KV-shared")
    agreement = {}
    for L, p in prompts.items():
        a = ours(mx.array([p])).logits[0, -1].astype(mx.float32)
        b = vlm.language_model(mx.array([p])).logits[0, -1].astype(mx.float32)
        agreement[L] = dict(max_abs_diff=float(mx.abs(a - b).max()), scale=float(mx.abs(a).max()),
                            same_argmax=int(mx.argmax(a)) == int(mx.argmax(b)))
    times = {(impl, L): [] for L in prompts for impl in ("ours", "mlx-vlm")}
    firsts = {key: set() for key in times}
    fns = {"ours": lambda p: ours_first(ours, p), "mlx-vlm": lambda p: vlm_first(vlm, p)}
    for r in range(repeats + 1):  # the first pass is the warm-up
        for L, p in prompts.items():
            for impl, fn in (fns.items() if r % 2 == 0 else reversed(fns.items())):
                seconds, token = fn(p)
                firsts[(impl, L)].add(token)
                if r:
                    times[(impl, L)].append(seconds)
        log(f"  {name}: pass {r + 1}/{repeats + 1}")
    rows = []
    for L in prompts:
        o, v = times[("ours", L)], times[("mlx-vlm", L)]
        same = firsts[("ours", L)] == firsts[("mlx-vlm", L)] and len(firsts[("ours", L)]) == 1
        rows.append(dict(length=L, ours_ms=1e3 * median(o), vlm_ms=1e3 * median(v),
                         ours_over_vlm=median([a / b for a, b in zip(o, v)]), same_first_token=same,
                         **{f"logits_{k}": x for k, x in agreement[L].items()}))
    return dict(model=name, path=str(path), description=description, rows=rows)


def run_ttft(args, log=print) -> dict:
    import mlx_vlm

    if args.quick:
        args.models, args.lengths, args.repeats = "demo", "64,200", 2
    lengths = [int(x) for x in args.lengths.split(",")]
    tokenizer = load(DEMO_TARGET).tokenizer
    prompts = code_prompts(tokenizer, lengths)
    models = []
    for name in args.models.split(","):
        path = DEMO_TARGET if name == "demo" else e2b_checkpoint(args.e2b_hidden, log=log)
        models.append(bench_model(name, path, prompts, args.repeats, log))
    mismatches = [f"{m['model']} L={r['length']}: first token differs from mlx-vlm's"
                  for m in models for r in m["rows"] if not r["same_first_token"]]
    return dict(mode="ttft", repeats=args.repeats, lengths=lengths, mlx_vlm=mlx_vlm.__version__, models=models,
                mismatches=mismatches)


def ttft_md(res: dict) -> str:
    intro = ("Measured. Same checkpoint files, same prompts (held-out stdlib code, demo tokenizer), greedy, plain "
             "decoding. Ours: `generate_tokens(..., max_tokens=1)` (BatchGenerator, 512-token prompt chunks); "
             "mlx-vlm: `generate_step` (prefill step 2048); both from the call to the first token as an int, both "
             f"skipping the KV-shared layers on unused prompt positions. Median of {res['repeats']} alternating "
             "repeats after a warm-up; ours / mlx-vlm is the median of within-repeat ratios (< 1: ours is faster). "
             "Logits: last position of one full forward on each side.")
    return section(f"Time to first token vs mlx-vlm {res['mlx_vlm']}, regime {res['regime']['name']}", intro,
                   *[(f"{m['model']}: {m['description']}", model_table(m["rows"])) for m in res["models"]])


def model_table(rows: list) -> str:
    cells = [[r["length"], fmt(r["ours_ms"], ".1f"), fmt(r["vlm_ms"], ".1f"), fmt(r["ours_over_vlm"]) + "x",
              "met" if r["ours_over_vlm"] <= 1.0 else "MISSED", "yes" if r["same_first_token"] else "**no**",
              f"{r['logits_max_abs_diff']:.2g} of {r['logits_scale']:.3g}"] for r in rows]
    return table(["prompt tokens", "ours ms", "mlx-vlm ms", "ours / mlx-vlm", "target <= 1.0x", "same first token",
                  "max |logit diff|"], cells)
