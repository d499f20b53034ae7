"""Train (or adapt) a Gemma 4 MTP drafter against a frozen target, in MLX: a command over
`mlx_mtp.learn.distill` (which `python -m mlx_mtp.learn` adapts served drafters with).

    python -m apps.train_drafter --target TARGET_DIR --data DATA [DATA ...] --out DRAFTER_DIR \\
        [--init DRAFTER_DIR | --hidden 128 --layers 4 --heads 4 --intermediate 512] \\
        [--steps 300] [--k 3] [--seq 256] [--batch 8] [--lr 2e-3] [--seed 0]

DATA: `.npy` arrays of token ids, or text files / directories of text files (tokenized
with the target directory's tokenizer). `--init` starts from an existing drafter (e.g. the
released assistant of the Gemma 4 you fine-tuned) to adapt it; without it a fresh drafter
is built whose attention geometry mirrors the target's store layers. The objective is in
`mlx_mtp/learn/distill.py`.

Speed on a Linux CPU: the mlx[cpu] wheel links a slow reference BLAS; preloading MKL
(`pip install mkl`, `LD_PRELOAD=$VIRTUAL_ENV/lib/libmkl_rt.so.3`) makes training ~10x faster.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_mtp.learn.distill import drafter_config, load_tokens, new_drafter, save_drafter, train
from mlx_mtp.loading import load_model, load_tokenizer


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
    p.add_argument("--save-every", type=int, help="also save the drafter to --out every N steps, so that a "
                                                  "stopped run keeps its work (default: only at the end)")
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
    save = lambda d: save_drafter(drafter, config, Path(a.out), extra={"checkpoint_at": d.done, "init": a.init},
                                  dtype=getattr(mx, a.save_dtype))
    log = train(target, drafter, stream, steps=a.steps, k=a.k, seq=a.seq, batch=a.batch, lr=a.lr,
                weight_decay=a.weight_decay, seed=a.seed, log_every=a.log_every, val_stream=val,
                minutes=a.minutes, print_fn=lambda s: print(s, flush=True),
                checkpoint=save if a.save_every else None, checkpoint_every=a.save_every or 50)
    log.update({"target": str(a.target), "init": a.init, "params": n_params, "data_tokens": int(len(stream))})
    save_drafter(drafter, config, Path(a.out), extra=log, dtype=getattr(mx, a.save_dtype))
    print(f"saved {a.out} ({log['seconds']:.0f}s of training)")
    return log


if __name__ == "__main__":
    main()
