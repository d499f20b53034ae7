"""Train (or adapt) a Gemma 4 MTP drafter against a frozen target, in MLX.

    python -m apps.train_drafter --target TARGET_DIR --data DATA [DATA ...] --out DRAFTER_DIR \\
        [--init DRAFTER_DIR | --hidden 128 --layers 4 --heads 4 --intermediate 512] \\
        [--steps 300] [--k 3] [--seq 256] [--batch 8] [--lr 2e-3] [--seed 0]

DATA: `.npy` arrays of token ids, or text files / directories of text files (tokenized
with the target directory's tokenizer). `--init` starts from an existing drafter (e.g. the
released assistant of the Gemma 4 you fine-tuned) to adapt it; without it a fresh drafter
is built whose attention geometry mirrors the target's store layers.

Objective (distillation of the target's greedy choice, which is what greedy verification
accepts). For every position p of a text chunk at once:

* the frozen target runs once over the chunk: post-norm hidden states h, argmax labels
  y_q = argmax target(t_<=q), and the K/V of its store layers (`TargetOutput.shared_kv`);
* draft step 1 reads concat(target.embed(t_p), h_{p-1}) at query position p, attending the
  target K/V at positions < p (full layers) and [p - W - 1, p - 1] (sliding layers): the
  drafter's own `trunk`, for a whole row of queries at once;
* step j > 1 reads concat(target.embed(t_{p+j-1}), the previous step's post_projection
  output), teacher-forced with the real text, at the same position p and K/V;
* the loss is the cross-entropy of step j's logits against y_{p+j-1}, averaged over steps.

A drafter with the E2B/E4B centroid head (`use_ordered_embeddings`, adapted with --init) also
learns its centroid scores: a cross-entropy towards the label's cluster (token_ordering is kept).
Agreement is reported for the dense tied logits.

The drafter is saved as `config.json` (`gemma4_assistant`) plus `model.safetensors` (our
parameter names), which `mlx_mtp.loading.load_model` reads.

Speed on a Linux CPU: the mlx[cpu] wheel links a slow reference BLAS; preloading MKL
(`pip install mkl`, `LD_PRELOAD=$VIRTUAL_ENV/lib/libmkl_rt.so.3`) makes training ~10x faster.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from mlx_mtp.cache import FULL, SLIDING
from mlx_mtp.loading import load_model, load_tokenizer
from mlx_mtp.models import gemma4_assistant
from mlx_mtp.models.base import SharedKV

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".jsonl", ".c", ".h", ".js", ".ts", ".rs", ".go")


# ---- drafter construction ---------------------------------------------------------------


def drafter_config(target, hidden: int = 128, layers: int = 4, heads: int = 4,
                   intermediate: Optional[int] = None) -> dict:
    """A released-style `gemma4_assistant` config.json dict for a fresh drafter of `target`:
    layers [S, .., S, F], attention geometry mirroring the target's store layers, dense tied head."""
    tc = target.config
    s_src, f_src = tc.store_layer(SLIDING), tc.store_layer(FULL)
    layer_types = [SLIDING] * (layers - 1) + [FULL]
    text = {
        "model_type": "gemma4_text",
        "vocab_size": tc.vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate or 4 * hidden,
        "num_hidden_layers": layers,
        "layer_types": layer_types,
        "num_attention_heads": heads,
        "num_key_value_heads": tc.layer_kv_heads(s_src),
        "head_dim": tc.layer_head_dim(s_src),
        "global_head_dim": tc.layer_head_dim(f_src),
        "attention_k_eq_v": bool(tc.attention_k_eq_v),
        "num_global_key_value_heads": tc.layer_kv_heads(f_src) if tc.attention_k_eq_v else None,
        "sliding_window": tc.sliding_window,
        "rope_parameters": tc.rope_parameters,
        "max_position_embeddings": tc.max_position_embeddings,
        "rms_norm_eps": tc.rms_norm_eps,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "num_kv_shared_layers": layers,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
    }
    return {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": tc.hidden_size,
        "use_ordered_embeddings": False,
        "tie_word_embeddings": True,
        "text_config": text,
    }


def new_drafter(config: dict) -> gemma4_assistant.Model:
    """A randomly initialised drafter (seed with mx.random.seed first)."""
    model = gemma4_assistant.Model(gemma4_assistant.Config.from_dict(config))
    mx.eval(model.parameters())
    return model


def save_drafter(drafter: nn.Module, config: dict, out: Path, extra: Optional[dict] = None,
                 dtype: Optional[mx.Dtype] = None) -> None:
    """config.json + model.safetensors (our parameter names, which load_model reads back),
    floating-point weights cast to `dtype` if given."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(drafter.parameters()))
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if extra is not None:
        (out / "training.json").write_text(json.dumps(extra, indent=2) + "\n")


# ---- the batched training forward ---------------------------------------------------------


def unroll(drafter, embeds: mx.array, hidden: mx.array, shared_kv: dict[str, SharedKV], k: int,
           start: int = 1) -> list[mx.array]:
    """K teacher-forced draft steps for every query position p in [start, L - k].

    Args:
        embeds: (B, L, H_t) the target's scaled embeddings of the chunk.
        hidden: (B, L, H_t) the target's post-norm hidden states.
        shared_kv: the target's store-layer K/V over the chunk (positions 0..L-1).

    Returns:
        K logits arrays (B, T, V), T = L - k - start + 1; step j's row p predicts the
        target's greedy token after t_{p+j} (0-indexed j).
    """
    B, L = embeds.shape[:2]
    T = L - k - start + 1
    qpos = mx.broadcast_to(mx.arange(start, start + T, dtype=mx.int32)[None], (B, T))
    h = hidden[:, start - 1 : start - 1 + T]
    step = drafter.step(shared_kv, qpos)
    out = []
    for j in range(k):
        x = drafter.trunk(embeds[:, start + j : start + j + T], h, shared_kv, step)
        out.append(drafter.model.embed_tokens.as_linear(x))
        if "masked_embedding" in drafter:  # E2B/E4B centroid head: also score the clusters
            out[-1] = (out[-1], drafter.masked_embedding.centroids(x))
        h = drafter.post_projection(x)
    return out


def cluster_of(drafter) -> mx.array:
    """(V,) the centroid cluster of every token, for a drafter with the ordered (centroid) head."""
    me = drafter.masked_embedding
    ordering = mx.stop_gradient(me.token_ordering)
    per = ordering.size // me.num_centroids
    clusters = mx.arange(ordering.size, dtype=mx.int32) // per
    return mx.zeros_like(clusters).at[ordering].add(clusters)


def target_pass(target, tokens: mx.array):
    """Frozen target over (B, L): scaled embeddings, hidden, greedy labels, store K/V."""
    B, L = tokens.shape
    out = target(tokens, target.make_cache(B, max_rollback=L))  # sliding rings keep the whole chunk
    labels = mx.argmax(out.logits, axis=-1)
    embeds = target.embed(tokens)
    shared = {kind: SharedKV(mx.stop_gradient(kv.keys), mx.stop_gradient(kv.values), kv.positions)
              for kind, kv in out.shared_kv.items()}
    result = (mx.stop_gradient(embeds), mx.stop_gradient(out.hidden), labels, shared)
    mx.eval(result[:3], [(kv.keys, kv.values, kv.positions) for kv in shared.values()])
    return result


def losses(drafter, embeds, hidden, labels, shared_kv, k: int, start: int = 1):
    """(mean CE over steps, per-step CE list, per-step top-1 agreement list)."""
    logits = unroll(drafter, embeds, hidden, shared_kv, k, start)
    clusters = cluster_of(drafter) if "masked_embedding" in drafter else None
    T = (logits[0][0] if clusters is not None else logits[0]).shape[1]
    ces, agree = [], []
    for j, lg in enumerate(logits):
        y = labels[:, start + j : start + j + T]
        if clusters is not None:
            # The centroid head picks the top-k clusters, then the dense tied logits of their
            # tokens: train both (the token CE over the full vocabulary, the cluster CE).
            lg, scores = lg
            ce = nn.losses.cross_entropy(scores.astype(mx.float32), clusters[y], reduction="mean")
            ces.append(nn.losses.cross_entropy(lg.astype(mx.float32), y, reduction="mean") + ce)
        else:
            ces.append(nn.losses.cross_entropy(lg.astype(mx.float32), y, reduction="mean"))
        agree.append((mx.argmax(lg, axis=-1) == y).astype(mx.float32).mean())
    return sum(ces) / k, ces, agree


# ---- data ---------------------------------------------------------------------------------


def load_tokens(paths: Sequence[Path], tokenizer=None) -> np.ndarray:
    """One int32 token stream from .npy id arrays and/or text files and directories."""
    parts: list[np.ndarray] = []
    texts: list[Path] = []
    for path in map(Path, paths):
        if path.suffix == ".npy":
            parts.append(np.load(path).astype(np.int32).reshape(-1))
        elif path.is_dir():
            texts += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        elif path.is_file():
            texts.append(path)
        else:
            raise FileNotFoundError(f"--data {path}: no such file or directory")
    if texts:
        if tokenizer is None:
            raise ValueError("text data needs a tokenizer: the target directory has none; pass .npy token ids")
        bos = getattr(tokenizer, "bos_token_id", None)
        eos = getattr(tokenizer, "eos_token_id", None)
        for file in texts:
            try:
                text = file.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            ids = tokenizer.encode(text, add_special_tokens=False)
            ids = ([bos] if bos is not None else []) + list(ids) + ([eos] if eos is not None else [])
            parts.append(np.asarray(ids, dtype=np.int32))
    if not parts:
        raise ValueError("no training data found")
    return np.concatenate(parts)


def batches(stream: np.ndarray, batch: int, seq: int, rng: np.random.Generator) -> Iterable[mx.array]:
    if len(stream) <= seq:
        raise ValueError(f"data has {len(stream)} tokens; need more than --seq {seq}")
    while True:
        starts = rng.integers(0, len(stream) - seq, batch)
        yield mx.array(np.stack([stream[s : s + seq] for s in starts]))


# ---- training loop ------------------------------------------------------------------------


def train(target, drafter, stream: np.ndarray, *, steps: int = 300, k: int = 3, seq: int = 256,
          batch: int = 8, lr: float = 2e-3, warmup: Optional[int] = None, weight_decay: float = 0.01,
          seed: int = 0, log_every: int = 25, val_stream: Optional[np.ndarray] = None,
          minutes: Optional[float] = None, print_fn=print) -> dict:
    """Train `drafter` in place against the frozen `target`; returns a log dict. `minutes`
    caps the wall time (the LR schedule still assumes `steps`)."""
    drafter.check_target(target)
    target.freeze()
    drafter.train()
    drafter.unfreeze()
    # layer_scalar: a fixed buffer in transformers; token_ordering: integer cluster layout
    drafter.freeze(keys=["layer_scalar", "token_ordering"])
    rng = np.random.default_rng(seed)
    warmup = max(1, steps // 20) if warmup is None else warmup
    schedule = optim.join_schedules(
        [optim.linear_schedule(lr / warmup, lr, warmup),
         optim.cosine_decay(lr, max(1, steps - warmup), lr * 0.1)], [warmup])
    opt = optim.AdamW(learning_rate=schedule, betas=[0.9, 0.95], weight_decay=weight_decay)

    def loss_fn(model, embeds, hidden, labels, shared):
        loss, ces, agree = losses(model, embeds, hidden, labels, shared, k)
        return loss, (mx.stack(ces), mx.stack(agree))

    step_fn = nn.value_and_grad(drafter, loss_fn)
    data = batches(stream, batch, seq, rng)
    log: dict = {"steps": [], "k": k, "seq": seq, "batch": batch, "lr": lr, "seed": seed}
    started = time.perf_counter()
    ema_loss, ema_agree = None, None
    for step in range(1, steps + 1):
        if minutes is not None and time.perf_counter() - started > 60 * minutes:
            print_fn(f"stopping before step {step}: {minutes} minutes reached")
            log["stopped_early"] = step - 1
            break
        embeds, hidden, labels, shared = target_pass(target, next(data))
        (loss, (ces, agree)), grads = step_fn(drafter, embeds, hidden, labels, shared)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(drafter, grads)
        mx.eval(drafter.parameters(), opt.state, loss, agree)
        loss_v, agree_v = loss.item(), np.array(agree)
        ema_loss = loss_v if ema_loss is None else 0.9 * ema_loss + 0.1 * loss_v
        ema_agree = agree_v if ema_agree is None else 0.9 * ema_agree + 0.1 * agree_v
        if step % log_every == 0 or step == steps or step == 1:
            elapsed = time.perf_counter() - started
            rate = step * batch * seq / elapsed
            print_fn(f"step {step}/{steps} loss {loss_v:.3f} (ema {ema_loss:.3f}) agreement "
                     f"{'/'.join(f'{a:.2f}' for a in ema_agree)} (ema, per draft step) "
                     f"{rate:.0f} target-tok/s {elapsed:.0f}s")
            log["steps"].append({"step": step, "loss": round(loss_v, 4), "ema_loss": round(ema_loss, 4),
                                 "agreement": [round(float(a), 4) for a in agree_v],
                                 "ema_agreement": [round(float(a), 4) for a in ema_agree]})
    log["seconds"] = round(time.perf_counter() - started, 1)
    drafter.eval()
    if val_stream is not None:
        log["val"] = evaluate(target, drafter, val_stream, k=k, seq=seq, batch=batch)
        val = log["val"]
        print_fn(f"held-out: loss {val['loss']:.3f} agreement {'/'.join(f'{a:.2f}' for a in val['agreement'])}")
    return log


def evaluate(target, drafter, stream: np.ndarray, *, k: int = 3, seq: int = 256, batch: int = 8,
             n_batches: int = 4, seed: int = 1234) -> dict:
    """Teacher-forced loss and per-step agreement on a stream (e.g. held-out data)."""
    rng = np.random.default_rng(seed)
    data = batches(stream, batch, seq, rng)
    total, agree = 0.0, np.zeros(k)
    for _ in range(n_batches):
        embeds, hidden, labels, shared = target_pass(target, next(data))
        loss, _, ag = losses(drafter, embeds, hidden, labels, shared, k)
        total += loss.item()
        agree += np.array(mx.stack(ag))
    return {"loss": round(total / n_batches, 4), "agreement": [round(float(a), 4) for a in agree / n_batches]}


# ---- CLI ----------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m apps.train_drafter", description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="target model directory (frozen)")
    p.add_argument("--data", required=True, nargs="+", help=".npy token ids, text files or directories")
    p.add_argument("--val-data", nargs="+", help="held-out data: report teacher-forced agreement at the end")
    p.add_argument("--out", required=True, help="directory to write the drafter to")
    p.add_argument("--init", help="existing drafter directory to adapt (else a fresh drafter)")
    p.add_argument("--hidden", type=int, default=128, help="fresh drafter: hidden size")
    p.add_argument("--layers", type=int, default=4, help="fresh drafter: layers ([S]*(n-1) + [F])")
    p.add_argument("--heads", type=int, default=4, help="fresh drafter: query heads")
    p.add_argument("--intermediate", type=int, help="fresh drafter: MLP width (default 4 * hidden)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--k", type=int, default=3, help="draft steps unrolled per position")
    p.add_argument("--seq", type=int, default=256, help="tokens per chunk")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--minutes", type=float, help="wall-time cap (a capped run is not step-reproducible)")
    p.add_argument("--save-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype of the saved weights (training is always float32)")
    a = p.parse_args(argv)

    mx.random.seed(a.seed)
    target, _, tpath = load_model(a.target, dtype=mx.float32)
    if a.init:
        drafter, config, _ = load_model(a.init, dtype=mx.float32)
        if "quantization" in config:
            raise SystemExit(f"--init {a.init} is quantized; adapt an unquantized (bf16/fp32) drafter")
    else:
        config = drafter_config(target, a.hidden, a.layers, a.heads, a.intermediate)
        drafter = new_drafter(config)
    tokenizer = None
    needs_text = any(Path(d).suffix != ".npy" for d in a.data + (a.val_data or []))
    if needs_text:
        tokenizer = load_tokenizer(tpath)
    stream = load_tokens(a.data, tokenizer)
    val = load_tokens(a.val_data, tokenizer) if a.val_data else None
    n_params = sum(v.size for _, v in tree_flatten(drafter.parameters()))
    print(f"drafter: {n_params / 1e6:.2f} M params ({'adapting ' + a.init if a.init else 'fresh'}); "
          f"data {len(stream) / 1e6:.2f} M tokens; {a.steps} steps x {a.batch} x {a.seq}, K={a.k}", flush=True)
    log = train(target, drafter, stream, steps=a.steps, k=a.k, seq=a.seq, batch=a.batch, lr=a.lr,
                weight_decay=a.weight_decay, seed=a.seed, log_every=a.log_every, val_stream=val,
                minutes=a.minutes, print_fn=lambda s: print(s, flush=True))
    log.update({"target": str(a.target), "init": a.init, "params": n_params, "data_tokens": int(len(stream))})
    save_drafter(drafter, config, Path(a.out), extra=log, dtype=getattr(mx, a.save_dtype))
    print(f"saved {a.out} ({log['seconds']:.0f}s of training)")
    return log


if __name__ == "__main__":
    main()
