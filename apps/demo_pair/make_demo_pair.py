"""Reproduce the bundled demo pair (mlx_mtp/demo/) from scratch, offline, with a fixed seed.

    python -m apps.demo_pair.make_demo_pair [--out mlx_mtp/demo] [--work build/demo_pair] [--seed 0]

Stages (each skipped with --resume when its output exists):
  1. data      the CPython stdlib sources of the running interpreter -> SentencePiece BPE
               tokenizer (4096) -> train/held-out token streams     (apps/demo_pair/data.py)
  2. target    a tiny Gemma 4 (`Gemma4ForCausalLM`, E2B-like) trained with transformers/torch,
               saved as a Hugging Face checkpoint                     (apps/demo_pair/train_target.py)
  3. convert   HF -> MLX with `python -m convert --dtype bfloat16`, plus the tokenizer files
  4. drafter   `python -m apps.train_drafter` against the frozen, converted target
  5. eval      acceptance on held-out files                           (apps/demo_pair/eval_acceptance.py)

MLX stages run in subprocesses with MKL preloaded when `pip install mkl` put libmkl_rt in the
environment (~10x faster training on a Linux CPU); without it they run, only slower.
--target-minutes / --drafter-minutes cap wall time (a capped run is no longer step-reproducible).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from apps.demo_pair.data import EOS, TURN_CLOSE, make_data  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def mkl_env() -> dict:
    env = dict(os.environ)
    lib = Path(sys.prefix) / "lib" / "libmkl_rt.so.3"
    if sys.platform.startswith("linux") and lib.exists() and "libmkl_rt" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = f"{lib}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else str(lib)
        # one MKL thread: deterministic reductions, and MKL's threads fighting other jobs on a
        # busy 2-core machine made small MLX steps 4x slower (override by setting it yourself)
        env.setdefault("MKL_NUM_THREADS", "1")
    env["PYTHONPATH"] = f"{ROOT}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
    return env


def run(cmd: list[str], env: dict) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)


def own_convert(hf_dir: Path, out: Path, dtype: str) -> None:
    """Fallback when `python -m convert` is unavailable: our loader's sanitized weights and the
    released-form config (global_head_dim instead of transformers-5.23's per_layer_config)."""
    import dataclasses

    import mlx.core as mx
    from mlx_mtp.loading import load_model
    from mlx_mtp.models.layout import checkpoint_weights

    model, config, _ = load_model(hf_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in checkpoint_weights(model).items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    cfg = {k: v for k, v in dataclasses.asdict(model.config).items() if v is not None}
    cfg.update({"model_type": config["model_type"], "architectures": config.get("architectures")})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def finish_target_dir(target: Path, work: Path) -> None:
    """Tokenizer files + stop tokens (<eos> and <turn|>) next to the converted weights."""
    tok_dir = work / "hf_tokenizer"
    for name in TOKENIZER_FILES:
        shutil.copyfile(tok_dir / name, target / name)
    turn_close = json.loads((tok_dir / "tokenizer.json").read_text())
    turn_id = next(t["id"] for t in turn_close["added_tokens"] if t["content"] == TURN_CLOSE)
    eos = [EOS, turn_id]
    cfg = json.loads((target / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (target / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": 2, "pad_token_id": 0, "eos_token_id": eos, "do_sample": False}
    (target / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "mlx_mtp" / "demo")
    p.add_argument("--work", type=Path, default=ROOT / "build" / "demo_pair")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--target-steps", type=int, default=450)
    p.add_argument("--target-threads", type=int, default=1,
                   help="torch threads (1 is faster than 2 on a busy 2-core machine)")
    p.add_argument("--target-minutes", type=float)
    p.add_argument("--drafter-steps", type=int, default=250)
    p.add_argument("--drafter-minutes", type=float)
    p.add_argument("--drafter-seq", type=int, default=256)
    p.add_argument("--drafter-batch", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="stored weights")
    p.add_argument("--eval-prompts", type=int, default=30)
    p.add_argument("--resume", action="store_true", help="skip stages whose outputs exist")
    p.add_argument("--skip-eval", action="store_true")
    a = p.parse_args(argv)
    work, out = a.work.resolve(), a.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = mkl_env()
    times: dict[str, float] = {}
    manifest: dict = {"python": platform.python_version(), "seed": a.seed,
                      "mkl_preloaded": "libmkl_rt" in env.get("LD_PRELOAD", "")}

    t0 = time.time()
    if not (a.resume and (work / "data.json").exists()):
        make_data(work, a.vocab, a.seed)
    manifest["data"] = json.loads((work / "data.json").read_text())
    times["data"] = max(time.time() - t0, manifest["data"]["seconds"])  # recorded when resumed

    t0 = time.time()
    hf = work / "hf_target"
    if not (a.resume and (hf / "config.json").exists()):
        cmd = [sys.executable, "-m", "apps.demo_pair.train_target", str(work), str(hf), "--steps",
               str(a.target_steps), "--seed", str(a.seed), "--threads", str(a.target_threads)]
        if a.target_minutes:
            cmd += ["--minutes", str(a.target_minutes)]
        run(cmd, {**os.environ, "PYTHONPATH": env["PYTHONPATH"]})  # torch: no MKL preload needed
    manifest["target_training"] = {k: v for k, v in json.loads((work / "target_train.json").read_text()).items()
                                   if k != "log"}
    times["target"] = max(time.time() - t0, manifest["target_training"]["train_seconds"])

    t0 = time.time()
    target = out / "target"
    if not (a.resume and (target / "model.safetensors").exists()):
        if target.exists():
            shutil.rmtree(target)
        try:
            run([sys.executable, "-m", "convert", str(hf), str(target), "--dtype", a.dtype, "--force", "--quiet"],
                env)
        except subprocess.CalledProcessError as e:
            print(f"python -m convert failed ({e}); saving with mlx_mtp's loader instead", flush=True)
            own_convert(hf, target, a.dtype)
        finish_target_dir(target, work)
    times["convert"] = time.time() - t0

    t0 = time.time()
    drafter = out / "drafter"
    if not (a.resume and (drafter / "model.safetensors").exists()):
        cmd = [sys.executable, "-m", "apps.train_drafter", "--target", str(target),
               "--data", str(work / "train.npy"), "--val-data", str(work / "val.npy"), "--out", str(drafter),
               "--hidden", "128", "--layers", "4", "--heads", "4", "--k", "3",
               "--steps", str(a.drafter_steps), "--seq", str(a.drafter_seq), "--batch", str(a.drafter_batch),
               "--lr", "2e-3", "--seed", str(a.seed), "--save-dtype", a.dtype]
        if a.drafter_minutes:
            cmd += ["--minutes", str(a.drafter_minutes)]
        run(cmd, env)
    training = json.loads((drafter / "training.json").read_text())
    manifest["drafter_training"] = {"steps": training["steps"][-1], "seconds": training["seconds"],
                                    "val": training.get("val"), "params": training.get("params")}
    times["drafter"] = time.time() - t0

    if not a.skip_eval:
        t0 = time.time()
        run([sys.executable, "-m", "apps.demo_pair.eval_acceptance", "--target", str(target), "--drafter",
             str(drafter), "--prompts", str(a.eval_prompts), "--seed", str(a.seed), "--json",
             str(work / "eval.json")], env)
        ev = json.loads((work / "eval.json").read_text())
        manifest["eval"] = {k: v for k, v in ev.items() if k != "per_prompt"}
        times["eval"] = time.time() - t0

    manifest["seconds"] = {k: round(v, 1) for k, v in times.items()}
    manifest["size_mb"] = {"target": round(dir_mb(target), 2), "drafter": round(dir_mb(drafter), 2)}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps({"seconds": manifest["seconds"], "size_mb": manifest["size_mb"]}, indent=2))
    return manifest


if __name__ == "__main__":
    main()
