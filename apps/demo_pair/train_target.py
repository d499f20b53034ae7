"""Train the demo target: a tiny transformers `Gemma4ForCausalLM` (`gemma4_text`) on the stdlib corpus.

A genuine Hugging Face checkpoint (save_pretrained, fp32), later converted to MLX. The
architecture is an E2B-like Gemma 4 in miniature, so the demo exercises the same code paths
as the real small models: sliding/full layers [S, S, F, S, S, F] with a 128-token window,
a wider global head (global_head_dim), proportional RoPE on full layers, per-layer
embeddings (PLE), the last two layers KV-shared (store layers 3 = sliding, 2 = full), q/k/v
norms, tied embeddings and a final logit softcap of 30.

torch trains far faster than MLX on a Linux CPU (2 threads). Deterministic for a fixed seed
on one machine (torch CPU kernels; results can differ in the last bits across CPUs).

`--init DIR` continues from a checkpoint instead of a random init: a Hugging Face one, or the
converted MLX target shipped in mlx_mtp/demo/target (same tensor names; bf16 is widened to fp32).
`--save-every N` writes the checkpoint every N steps, so a long run that is stopped keeps its work.
`--bf16` computes in bfloat16 (autocast; fp32 weights and optimizer): ~2x faster on a CPU with
AVX512-BF16 (a 2-core EPYC here), not step-for-step the recipe's fp32 run.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

from apps.hf_compat import patch_kv_sharing_modes

S, F = "sliding_attention", "full_attention"


def target_config(vocab: int):
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=6,
        layer_types=[S, S, F, S, S, F],
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        global_head_dim=128,
        sliding_window=128,
        max_position_embeddings=2048,
        final_logit_softcapping=30.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh",
        hidden_size_per_layer_input=32,
        vocab_size_per_layer_input=vocab,
        num_kv_shared_layers=2,
        use_double_wide_mlp=False,
        attention_k_eq_v=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )


def lr_at(step: int, steps: int, peak: float, warmup: int, elapsed: float = 0.0) -> float:
    """Linear warmup, then cosine to 10 % of `peak`; `elapsed` (0..1, the share of a wall-time
    cap used) moves the cosine on when it is further along than the steps are."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, max((step - warmup) / max(1, steps - warmup), elapsed))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def load_init(model, init: Path) -> None:
    """Start from `init`'s weights (HF or converted MLX safetensors: the names match). Only the
    KV-shared layers' unused k/v projections may be absent (a converted checkpoint drops them)."""
    from safetensors.torch import load_file

    state = {}
    for f in sorted(init.glob("*.safetensors")):
        state.update({k: v.float() for k, v in load_file(f).items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith(("k_proj.weight", "v_proj.weight", "k_norm.weight"))
               and k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"{init}: missing {missing[:4]}, unexpected {unexpected[:4]}")


def val_loss_of(model, val: np.ndarray, batch: int, seq: int) -> float:
    """Mean loss on 8 fixed batches of the held-out stream (the same batches every call)."""
    import torch

    gen = np.random.default_rng(12345)
    losses = []
    with torch.no_grad():
        for _ in range(8):
            starts = gen.integers(0, len(val) - seq - 1, batch)
            x = torch.from_numpy(np.stack([val[s : s + seq + 1] for s in starts]))
            logits = model(input_ids=x[:, :-1]).logits
            losses.append(torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).item())
    return float(np.mean(losses))


def train_target(work: Path, out: Path, steps: int = 450, batch: int = 8, seq: int = 256,
                 lr: float = 3e-3, seed: int = 0, threads: int = 2, log_every: int = 25,
                 minutes: float | None = None, init: Path | None = None, save_every: int = 0,
                 bf16: bool = False) -> dict:
    """`minutes` caps the wall time (and the LR's cosine follows the time used when that is
    further along): a run cut short by it is no longer reproducible step-for-step, so the
    recipe's default is no cap. `init`: continue from that checkpoint."""
    import torch
    from transformers import Gemma4ForCausalLM

    patch_kv_sharing_modes()
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    rng = np.random.default_rng(seed)
    train = np.load(work / "train.npy").astype(np.int64)
    val = np.load(work / "val.npy").astype(np.int64)
    import sentencepiece as spm

    vocab = spm.SentencePieceProcessor(model_file=str(work / "tokenizer.model")).get_piece_size()
    model = Gemma4ForCausalLM._from_config(target_config(vocab), attn_implementation="sdpa")
    if init is not None:
        load_init(model, init)
        model.tie_weights()
        model.eval()
        print(f"from {init}: val loss {val_loss_of(model, val, 8, 256):.3f} nats/token", flush=True)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    other = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    print(f"target: {n_params / 1e6:.2f} M params, {steps} steps x {batch} x {seq} tokens", flush=True)

    def batch_of(data, n, gen):
        starts = gen.integers(0, len(data) - seq - 1, n)
        x = torch.from_numpy(np.stack([data[s : s + seq + 1] for s in starts]))
        return x[:, :-1], x[:, 1:]

    t0, ema = time.time(), None
    log = []
    for step in range(steps):
        if minutes is not None and time.time() - t0 > 60 * minutes:
            print(f"stopping at step {step}: --minutes {minutes} reached", flush=True)
            break
        elapsed = 0.0 if minutes is None else (time.time() - t0) / (60 * minutes)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup, elapsed)
        x, y = batch_of(train, batch, rng)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            el = time.time() - t0
            tps = (step + 1) * batch * seq / el
            print(f"step {step + 1}/{steps} loss {loss.item():.3f} (ema {ema:.3f}) "
                  f"lr {g['lr']:.2e} {tps:.0f} tok/s {el:.0f}s", flush=True)
            log.append({"step": step + 1, "loss": round(loss.item(), 4), "ema": round(ema, 4)})
        if save_every and (step + 1) % save_every == 0:
            save(model, out)
    train_seconds = time.time() - t0

    model.eval()
    val_loss = val_loss_of(model, val, 8, 256)  # the original recipe's val batches: comparable across runs
    print(f"val loss {val_loss:.3f} nats/token; trained in {train_seconds:.0f}s", flush=True)
    save(model, out)
    info = {"params": n_params, "init": str(init) if init else None, "bf16": bf16, "steps": steps, "steps_done": step + 1, "batch": batch, "seq": seq, "lr": lr, "seed": seed,
            "train_seconds": round(train_seconds, 1), "final_train_loss_ema": round(ema, 4),
            "val_loss": round(val_loss, 4), "log": log}
    (out.parent / "target_train.json").write_text(json.dumps(info, indent=2))
    return info


def save(model, out: Path) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=2, pad_token_id=0, eos_token_id=[1]).save_pretrained(out)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("work", type=Path, help="data dir from apps.demo_pair.data")
    p.add_argument("out", type=Path, help="HF checkpoint dir to write")
    p.add_argument("--steps", type=int, default=450)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--minutes", type=float, help="wall-time cap (breaks step-for-step reproducibility)")
    p.add_argument("--init", type=Path, help="continue from this checkpoint (HF, or the converted MLX target)")
    p.add_argument("--save-every", type=int, default=0, help="write the checkpoint every N steps (default: 0, "
                                                             "only at the end)")
    p.add_argument("--bf16", action="store_true", help="compute in bfloat16 (autocast), ~2x faster on AVX512-BF16")
    a = p.parse_args()
    train_target(a.work, a.out, a.steps, a.batch, a.seq, a.lr, a.seed, a.threads, minutes=a.minutes,
                 init=a.init, save_every=a.save_every, bf16=a.bf16)
