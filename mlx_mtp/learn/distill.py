"""Distilling an MTP drafter from a frozen target: what `mlx_mtp.learn` adapts the drafter with, and
`apps/train_drafter.py` trains one from scratch with.

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

Teacher forcing is also how acceptance is counted (`accepted_per_round`): the leading run of right
drafts from a position. A draft is only ever followed where it was right, so on the target's own greedy
text that run is exactly what a greedy round there accepts; on other text (sampled replies) it is the
run along that text.

A drafter with the E2B/E4B centroid head (`use_ordered_embeddings`) also learns its centroid scores:
a cross-entropy towards the label's cluster (token_ordering is kept).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from ..cache.kv import FULL, SLIDING
from ..models import gemma4_assistant, layout
from ..models.base import SharedKV

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
    """config.json + model.safetensors (the checkpoint's layout: q_proj, gate_proj and up_proj apart, as
    HF and mlx-lm name them, which load_model joins again; a CRC-32 of the weights in its metadata:
    `check_saved`), floating-point weights cast to `dtype` if given. Written beside `out` and renamed
    into place: a crash leaves the old directory or the new, whole."""
    out = Path(out)
    weights = layout.checkpoint_weights(drafter)
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    temp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    mx.save_safetensors(str(temp / "model.safetensors"), weights, metadata={"format": "mlx", "crc32": _crc(weights)})
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    (temp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if extra is not None:
        (temp / "training.json").write_text(json.dumps(extra, indent=2) + "\n")
    old = out.with_name(f".{out.name}.{os.getpid()}.old")
    if out.exists():
        out.rename(old)
    temp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def check_saved(folder: Path) -> bool:
    """Whether a drafter `save_drafter` wrote is whole: its weights match their CRC-32."""
    try:
        weights, meta = mx.load(str(Path(folder) / "model.safetensors"), return_metadata=True)
    except (OSError, ValueError, RuntimeError):
        return False
    return meta.get("crc32") == _crc(weights)


def _crc(weights: dict) -> str:
    crc = 0
    for name in sorted(weights):
        a = weights[name]
        view = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
        crc = zlib.crc32(np.array(view).tobytes(), zlib.crc32(f"{name}:{a.dtype}:{a.shape}".encode(), crc))
    return f"{crc:08x}"


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
    """(mean CE over steps, per-step CE list, per-step top-1 agreement list), over the queries from
    position `start` on."""
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
            raise FileNotFoundError(f"{path}: no such file or directory")
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


class Distiller:
    """A drafter's distillation against a frozen target on a token stream, one optimizer step at a
    time (`step`), its state kept whole for a resume (`state` / `restore`): AdamW, linear warm-up then
    cosine decay over `steps`, gradients clipped to norm 1."""

    def __init__(self, target, drafter, stream: np.ndarray, *, steps: int = 300, k: int = 3, seq: int = 256,
                 batch: int = 8, lr: float = 2e-3, warmup: Optional[int] = None, weight_decay: float = 0.01,
                 seed: int = 0, train_embedding: bool = True):
        if target is not None:  # None: features come from elsewhere (`learn`)
            drafter.check_target(target)
            target.freeze()
        drafter.train()
        drafter.unfreeze()
        # layer_scalar: a fixed buffer in transformers; token_ordering: integer cluster layout
        drafter.freeze(keys=["layer_scalar", "token_ordering"])
        if not train_embedding:  # the tied vocabulary table: most of a real assistant's weights
            drafter.model.embed_tokens.freeze()
        self.target, self.drafter, self.k, self.steps, self.done = target, drafter, k, steps, 0
        self.rng = np.random.default_rng(seed)
        self.data = batches(stream, batch, seq, self.rng) if stream is not None else None
        self.lr, self.warmup = lr, warmup
        self.opt = optim.AdamW(learning_rate=self._rate, betas=[0.9, 0.95], weight_decay=weight_decay)

        def loss_fn(model, embeds, hidden, labels, shared, start):
            loss, ces, agree = losses(model, embeds, hidden, labels, shared, k, start)
            return loss, (mx.stack(ces), mx.stack(agree))

        self._step = nn.value_and_grad(drafter, loss_fn)

    def _rate(self, step: mx.array) -> mx.array:
        """Linear warm-up, then cosine decay to a tenth over `steps`, read at each update: a run bounded
        in time may set `steps` to what fits once a step's time is known."""
        lr, warmup = self.lr, max(1, self.steps // 20) if self.warmup is None else self.warmup
        return optim.join_schedules([optim.linear_schedule(lr / warmup, lr, warmup),
                                     optim.cosine_decay(lr, max(1, self.steps - warmup), lr * 0.1)], [warmup])(step)

    def step(self) -> tuple[float, np.ndarray]:
        """One optimizer step on the next batch: (loss, agreement per draft step)."""
        return self.learn(target_pass(self.target, next(self.data)))

    def learn(self, features: tuple, start: int = 1) -> tuple[float, np.ndarray]:
        """One optimizer step on a batch's target features (`target_pass`), the loss over the positions
        from `start` on (the drafter still reads the target's K/V of every position before)."""
        (loss, (_, agree)), grads = self._step(self.drafter, *features, start)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        self.opt.update(self.drafter, grads)
        mx.eval(self.drafter.parameters(), self.opt.state, loss, agree)
        self.done += 1
        return loss.item(), np.array(agree)

    def state(self) -> tuple[dict, dict]:
        """(arrays: the drafter's weights and the optimizer's state; the step and the data's random state)."""
        arrays = {f"drafter.{k}": v for k, v in tree_flatten(self.drafter.parameters())}
        arrays |= {f"opt.{k}": v for k, v in tree_flatten(self.opt.state)}
        return arrays, {"done": self.done, "steps": self.steps, "rng": self.rng.bit_generator.state}

    def restore(self, arrays: dict, info: dict) -> None:
        from mlx.utils import tree_unflatten

        self.drafter.update(tree_unflatten([(k[8:], v) for k, v in arrays.items() if k.startswith("drafter.")]))
        self.opt.state = tree_unflatten([(k[4:], v) for k, v in arrays.items() if k.startswith("opt.")])
        self.done, self.rng.bit_generator.state = info["done"], info["rng"]
        self.steps = info.get("steps", self.steps)


def train(target, drafter, stream: np.ndarray, *, steps: int = 300, k: int = 3, seq: int = 256,
          batch: int = 8, lr: float = 2e-3, warmup: Optional[int] = None, weight_decay: float = 0.01,
          seed: int = 0, log_every: int = 25, val_stream: Optional[np.ndarray] = None,
          minutes: Optional[float] = None, print_fn=print,
          checkpoint: Optional[Callable[["Distiller"], None]] = None, checkpoint_every: int = 50,
          resume: Optional[tuple] = None) -> dict:
    """Train `drafter` in place against the frozen `target`; returns a log dict. `minutes` caps the
    wall time (the schedule still assumes `steps`). `checkpoint(distiller)` is called every
    `checkpoint_every` steps; `resume`: a `Distiller.state()` to go on from."""
    d = Distiller(target, drafter, stream, steps=steps, k=k, seq=seq, batch=batch, lr=lr, warmup=warmup,
                  weight_decay=weight_decay, seed=seed)
    if resume is not None:
        d.restore(*resume)
    log: dict = {"steps": [], "k": k, "seq": seq, "batch": batch, "lr": lr, "seed": seed, "resumed_at": d.done}
    started = time.perf_counter()
    ema_loss, ema_agree = None, None
    while d.done < steps:
        if minutes is not None and time.perf_counter() - started > 60 * minutes:
            print_fn(f"stopping before step {d.done + 1}: {minutes} minutes reached")
            log["stopped_early"] = d.done
            break
        loss_v, agree_v = d.step()
        ema_loss = loss_v if ema_loss is None else 0.9 * ema_loss + 0.1 * loss_v
        ema_agree = agree_v if ema_agree is None else 0.9 * ema_agree + 0.1 * agree_v
        step = d.done
        if checkpoint is not None and step % checkpoint_every == 0 and step < steps:
            checkpoint(d)
        if step % log_every == 0 or step == steps or step == log["resumed_at"] + 1:
            elapsed = time.perf_counter() - started
            rate = (step - log["resumed_at"]) * batch * seq / elapsed
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




def accepted_per_round(target, drafter, sequences: Sequence[tuple], k: int = 3) -> float:
    """Mean drafts a greedy round of `k` accepts, over every position p >= first of each (ids, first)
    in `sequences` with k labels after it (see `accepted_runs`)."""
    total = count = 0
    for ids, first in sequences:
        runs = accepted_runs(target, drafter, ids, first, k)
        total, count = total + float(runs.sum()), count + len(runs)
    return total / count if count else 0.0


def accepted_runs(target, drafter, ids, first: int, k: int = 3) -> np.ndarray:
    """For each position p >= first of `ids` with k labels after it, the drafts a greedy round of k
    drafting from p accepts: the leading run of teacher-forced drafts equal to the target's greedy
    tokens (a draft is only ever followed where it was right, so this is exact)."""
    ids = np.asarray(ids, np.int32)
    if len(ids) - k <= max(first, 1):
        return np.zeros(0)
    return runs_on(drafter, rows_pass(target, [ids]), [first], [len(ids)], k)[0]


def rows_pass(target, rows: Sequence[np.ndarray]) -> tuple:
    """`target_pass` over several id rows at once, right-padded to the longest: attention is causal, so
    a row's padding changes none of its own positions' features."""
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    return target_pass(target, mx.array(tokens))


def runs_on(drafter, features: tuple, firsts: Sequence[int], lengths: Sequence[int], k: int = 3) -> list[np.ndarray]:
    """`accepted_runs` of each row of a `rows_pass` (row i: positions firsts[i] .. lengths[i] - k), the
    drafter run only from the earliest position measured: the target's features can be kept and reused."""
    embeds, hidden, labels, shared = features
    start = max(1, min(firsts))
    right = []
    for j, lg in enumerate(unroll(drafter, embeds, hidden, shared, k, start)):
        lg = lg[0] if isinstance(lg, tuple) else lg
        right.append(mx.argmax(lg, axis=-1) == labels[:, start + j : start + j + lg.shape[1]])
    runs = np.cumprod(np.array(mx.stack(right)), axis=0).sum(axis=0)  # (rows, T): column t drafts from start + t
    return [runs[i, max(f, 1) - start : max(n - k - start + 1, max(f, 1) - start)].astype(np.float64)
            for i, (f, n) in enumerate(zip(firsts, lengths))]
