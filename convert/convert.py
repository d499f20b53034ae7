"""Convert a Gemma 4 target or MTP drafter checkpoint (HF dir or hub id) to an MLX directory.

Loading is `mlx_mtp.loading.load_model(lazy=True)`, so the model file's `sanitize` is the only
place that knows checkpoint names. Weights are then cast / quantized lazily and written one
output shard at a time: peak memory is about one shard, not the model.
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from mlx_lm.utils import save_config

from mlx_mtp.models import quantize as q
from mlx_mtp.cli import prog_name
from mlx_mtp.loading import WeightsError, build_model, cast_floats, load_model, read_config, resolve
from mlx_mtp.models import DRAFTER_TYPES, model_module
from mlx_mtp.models.gemma4 import Config as TextConfig

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
EXTRA_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "chat_template.jinja", "chat_template.json", "generation_config.json",
)
DEFAULT_SHARD_GB = 5.0  # mlx-lm's MAX_FILE_SIZE_GB
WRAPPERS = ("gemma4", "gemma4_unified")  # multimodal checkpoints: the text model under `language_model.`
TEXT_TYPES = ("gemma4_text", "gemma4_unified_text")  # a text config at the top level
SPELLED_OUT = ("sliding_window", "max_position_embeddings", "hidden_size_per_layer_input", "enable_moe_block",
               "use_bidirectional_attention")


def plan(
    source: Union[str, Path],
    *,
    dtype: str = "bfloat16",
    quantize: bool = False,
    bits: Optional[int] = None,
    group_size: Optional[int] = None,
    mode: str = "affine",
    preset: Optional[str] = None,
    quantize_drafter: bool = False,
    quantize_vision: bool = False,
    shapes_only: bool = False,
    progress: bool = True,
) -> tuple[Path, dict[str, Any], dict[str, mx.array]]:
    """Load `source` lazily and cast / quantize it, evaluating nothing.

    With `shapes_only` the model is built from config.json alone (no weight files are read),
    which is enough to see the output's tensors, sizes and quantization record.

    Returns:
        (resolved source, output config, tensors under the names they are saved with).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    src = resolve(source)
    model_type = read_config(src).get("model_type")
    module = model_module(model_type)  # unknown types fail here, before anything is written
    if model_type in DRAFTER_TYPES:
        if quantize and not quantize_drafter:
            _say("drafter kept unquantized (pass --quantize-drafter to quantize it)", progress)
        quantize = quantize_drafter
    elif not quantize and (bits or group_size or preset or mode != "affine"):
        raise ValueError("--bits/--group-size/--mode/--preset need --quantize (-q)")
    if quantize:
        q.base_params(bits, group_size, mode)  # bad settings fail before any work

    kept: dict = {}
    if shapes_only:
        config = read_config(src)
        model = build_model(config)
        cast_floats(model, DTYPES[dtype])
    else:
        with module.keeping_parts() as kept:
            model, config, _ = load_model(src, dtype=DTYPES[dtype], lazy=True)
    config = output_config(config, model, dtype)
    if quantize:
        config = q.quantize(model, config, bits=bits, group_size=group_size, mode=mode, preset=preset)
    prefix = "language_model." if model_type in WRAPPERS else ""
    layers = model.model.layers
    if "quantization" in config:
        config["quantization"] = _record_names(config["quantization"], module, prefix, layers)
    config.pop("quantization_config", None)  # save_config writes it back from `quantization`

    # Written in the checkpoint's layout (q/k/v_proj, gate/up_proj: what HF and mlx-lm load), not
    # the projections the model joins at load.
    weights = {prefix + k: v for k, v in module.unjoin(dict(tree_flatten(model.parameters())), layers, kept).items()}
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))  # the caller owns the arrays now
    towers = quantize and quantize_vision, bits, group_size, shapes_only
    if model_type == "gemma4_unified" and ("vision_config" in config or "audio_config" in config):
        weights.update(embedder_weights(src, config, DTYPES[dtype], *towers))
    elif model_type not in DRAFTER_TYPES:
        if config.get("vision_config"):
            weights.update(vision_weights(src, config, DTYPES[dtype], *towers))
        if config.get("audio_config"):
            weights.update(audio_weights(src, config, DTYPES[dtype], shapes_only))
    return src, config, weights


def vision_weights(src: Path, config: dict[str, Any], dtype: mx.Dtype, quantize: bool, bits: Optional[int],
                   group_size: Optional[int], shapes_only: bool) -> dict[str, mx.array]:
    """The vision tower and its embedder under mlx-community's names (`vision_tower.*`,
    `embed_vision.*`), in `dtype`; with `quantize`, the embedder and the tower's Linear layers whose
    width the group size divides (the released tower's MLP width, 4304, is divided by neither 32 nor
    64), at the LM's bits and group size."""
    from mlx_mtp.loading import load_weights, weight_files
    from mlx_mtp.models.gemma4_vision import Vision, vision_from_weights

    if shapes_only:
        vision = Vision.from_config(config)
    else:
        vision = vision_from_weights(config, load_weights(weight_files(src)), evaluate=False)
    return _cast_and_quantize(vision, config, dtype, quantize, bits, group_size)


def audio_weights(src: Path, config: dict[str, Any], dtype: mx.Dtype, shapes_only: bool) -> dict[str, mx.array]:
    """The E2B/E4B audio tower and its embedder under mlx-community's names (`audio_tower.*`,
    `embed_audio.*`, convolutions channel-last), in `dtype` (bf16 by default), never quantized:
    the conformer is 0.3B parameters whose convolutions and clipped linears quantize poorly."""
    from mlx_mtp.loading import load_weights, weight_files
    from mlx_mtp.models.gemma4_audio import Audio, audio_from_weights

    if shapes_only:
        audio = Audio.from_config(config)
    else:
        audio = audio_from_weights(config, load_weights(weight_files(src)), dtype=None, evaluate=False)
    return _cast_and_quantize(audio, config, dtype, False, None, None)


def embedder_weights(src: Path, config: dict[str, Any], dtype: mx.Dtype, quantize: bool, bits: Optional[int],
                     group_size: Optional[int], shapes_only: bool) -> dict[str, mx.array]:
    """The 12B's (`gemma4_unified`) image and audio embedders under its checkpoint's names without `model.`
    (`vision_embedder.*`, `embed_vision.*`, `embed_audio.*`), in `dtype`; with `quantize`, their Linear
    layers whose width the group size divides, as `vision_weights` does."""
    from mlx_mtp.loading import load_weights, weight_files
    from mlx_mtp.models.gemma4_unified import Embedders, embedders_from_weights

    if shapes_only:
        embedders = Embedders.from_config(config)
    else:
        embedders = embedders_from_weights(config, load_weights(weight_files(src)), evaluate=False)
    return _cast_and_quantize(embedders, config, dtype, quantize, bits, group_size)


def _cast_and_quantize(module: nn.Module, config: dict[str, Any], dtype: mx.Dtype, quantize: bool,
                       bits: Optional[int], group_size: Optional[int]) -> dict[str, mx.array]:
    cast_floats(module, dtype)
    if quantize:
        record = config.get("quantization") or {}
        group = group_size or record.get("group_size", 64)
        nn.quantize(module, group_size=group, bits=bits or record.get("bits", 4),
                    class_predicate=lambda p, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % group == 0)
    return dict(tree_flatten(module.parameters()))


def convert(
    source: Union[str, Path],
    output: Union[str, Path],
    *,
    max_shard_gb: float = DEFAULT_SHARD_GB,
    force: bool = False,
    progress: bool = True,
    **options,
) -> Path:
    """Convert `source` into the MLX directory `output`.

    Args:
        source: local HF directory or hub id of a `gemma4` / `gemma4_text` / `gemma4_unified` (12B) target
            or a `gemma4_assistant` / `gemma4_unified_assistant` drafter.
        output: directory to create; it is written to a temporary sibling and renamed
            into place only when complete.
        max_shard_gb: largest output shard (also about the peak memory).
        force: replace an existing `output`.
        options: `plan`'s: `dtype` of everything left unquantized; `quantize` with `bits`,
            `group_size`, `mode`, `preset`; a drafter is quantized only with `quantize_drafter`.

    Returns:
        The output path.
    """
    output = Path(output).expanduser().absolute()
    src = resolve(source)
    check_apart(src, output)
    if output.exists() and not force:
        raise FileExistsError(f"{output} exists; pass --force to replace it")
    if max_shard_gb <= 0:
        raise ValueError("max_shard_gb must be positive")
    src, config, weights = plan(src, progress=progress, **options)

    tmp = output.parent / f".{output.name}.partial-{os.getpid()}"
    output.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(output)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_weights(tmp, weights, int(max_shard_gb * (1 << 30)), progress)
        save_config(config, tmp / "config.json", keep_vision_config=True)
        for name in EXTRA_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        _move_into_place(tmp, output, force)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, RuntimeError) and "safetensors" in str(e):
            raise WeightsError(f"cannot read {src}: {e}") from e
        raise
    return output


def check_apart(src: Path, output: Path) -> None:
    """Refuse an output that is, contains, or is inside the source (symlinks resolved):
    replacing it would destroy the input."""
    src, out = src.resolve(), output.resolve()
    if out == src:
        raise ValueError(f"output {output} is the source directory; choose another output")
    if out in src.parents:
        raise ValueError(f"output {output} contains the source {src}; replacing it would delete the source")
    if src in out.parents:
        raise ValueError(f"output {output} is inside the source {src}; choose a directory outside it")


def remove_stale_partials(output: Path) -> None:
    """Delete the temporary dirs of conversions into `output` whose process is gone (interrupted
    runs); a live process's dir is left alone."""
    prefix = f".{output.name}.partial-"
    for tmp in output.parent.glob(glob.escape(prefix) + "*"):
        pid = tmp.name[len(prefix):]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
            print(f"[convert] removed {tmp}, left by an interrupted conversion (process {pid} is gone)",
                  file=sys.stderr)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0 only checks that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        pass
    return True


def summary(config: dict[str, Any], weights: dict[str, mx.array]) -> str:
    """What a conversion would write: tensor count, bytes, and the quantization record."""
    total = sum(v.nbytes for v in weights.values())
    lines = [f"{len(weights)} tensors, {total / 1e9:.2f} GB, dtype {config.get('dtype')}"]
    record = config.get("quantization")
    if record:
        overrides = {k: v for k, v in record.items() if isinstance(v, (dict, bool))}
        base = {k: v for k, v in record.items() if k not in overrides}
        lines.append(f"quantization {base}, {len(overrides)} per-layer overrides")
        lines += [f"  {k}: {v}" for k, v in list(overrides.items())[:8]]
        if len(overrides) > 8:
            lines.append(f"  ... {len(overrides) - 8} more")
    return "\n".join(lines)


def output_config(config: dict[str, Any], model, dtype: str) -> dict[str, Any]:
    """The input config in the released form mlx-lm reads (`global_head_dim`, no `per_layer_config`)."""
    config = copy.deepcopy(config)
    text_cfg = model.config.text if config["model_type"] in DRAFTER_TYPES else model.config
    text = config.get("text_config", config) if config["model_type"] not in TEXT_TYPES else config
    _released_text_config(text, text_cfg)
    if config["model_type"] in WRAPPERS:
        config["vocab_size"] = text["vocab_size"]  # mlx-lm's wrapper otherwise assumes 262144
    config["dtype"] = dtype
    config.pop("torch_dtype", None)
    return config


def _released_text_config(text: dict[str, Any], cfg: TextConfig) -> None:
    text.pop("per_layer_config", None)
    for key in SPELLED_OUT:  # what our config class assumed where the file is silent (mlx-lm's defaults differ)
        text[key] = getattr(cfg, key)
    text["global_head_dim"] = cfg.global_head_dim or cfg.head_dim
    if cfg.num_global_key_value_heads is not None:
        text["num_global_key_value_heads"] = cfg.num_global_key_value_heads
    text["layer_types"] = list(cfg.layer_types)


def _record_names(record: dict[str, Any], module, prefix: str, layers) -> dict[str, Any]:
    """Per-path entries of a quantization record under the names the weights are saved with (a joined
    projection's entry for each of its parts)."""
    rename = getattr(module, "rename", None) or (lambda k: k)
    out = {}
    for key, value in record.items():
        if not isinstance(value, (dict, bool)):
            out[key] = value
            continue
        name = rename(key + ".weight")
        if name is None:
            continue
        for part, _ in module.parts(name[: -len(".weight")], layers):
            out[prefix + part] = value
    return out


def plan_shards(weights: dict[str, mx.array], max_bytes: int) -> list[dict[str, mx.array]]:
    """Split into shards of at most `max_bytes` (a bigger tensor gets a shard of its own)."""
    shards, size = [], 0
    for key, value in weights.items():
        if not shards or size + value.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = value
        size += value.nbytes
    return shards


def write_weights(path: Path, weights: dict[str, mx.array], max_bytes: int, progress: bool = True) -> None:
    """Evaluate and write one shard at a time, dropping each before the next."""
    shards = plan_shards(weights, max_bytes)
    weights.clear()
    total = sum(v.nbytes for s in shards for v in s.values())
    bar = Progress(total, progress)
    count = len(shards)
    names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    names = names if count > 1 else ["model.safetensors"]
    weight_map = {}
    for i in range(count):
        shard, shards[i] = shards[i], None
        for key, value in shard.items():
            mx.eval(value)  # one tensor at a time: its source is freed before the next is read
            bar.update(value.nbytes)
        mx.save_safetensors(str(path / names[i]), shard, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, names[i]))
        del shard
    bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))


def _move_into_place(tmp: Path, output: Path, force: bool) -> None:
    if output.exists():
        if not force:
            raise FileExistsError(f"{output} exists; pass --force to replace it")
        old = output.parent / f".{output.name}.old-{os.getpid()}"
        os.replace(output, old)
        os.replace(tmp, output)
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
    else:
        os.replace(tmp, output)


class Progress:
    """A one-line stderr progress bar: bytes done, rate, ETA."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled = total, 0, enabled
        self.start = self.last = time.monotonic()

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self.last > 0.5 or self.done >= self.total):
            self.last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate else 0.0
        pct = 100.0 * self.done / max(self.total, 1)
        sys.stderr.write(
            f"\r[convert] {pct:5.1f}%  {_gb(self.done)}/{_gb(self.total)} GB  "
            f"{rate * 60 / 1e9:.2f} GB/min  ETA {eta:4.0f}s "
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f}"


def _say(msg: str, enabled: bool) -> None:
    if enabled:
        print(f"[convert] {msg}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog_name("convert"),
        description="Convert a Gemma 4 target (gemma4, gemma4_text, gemma4_unified) or drafter (gemma4_assistant, "
                    "gemma4_unified_assistant) to MLX.",
    )
    p.add_argument("source", help="local Hugging Face directory or hub id")
    p.add_argument("output", help="MLX directory to create")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16",
                   help="dtype of the weights left unquantized (default: bfloat16)")
    p.add_argument("-q", "--quantize", action="store_true",
                   help="quantize Linear/Embedding weights (default: off; --preset turns it on)")
    p.add_argument("--bits", type=int, choices=q.BITS,
                   help="bits per weight, affine mode (default: 4; --preset mixed_4_8 sets them itself)")
    p.add_argument("--group-size", type=int, choices=q.GROUP_SIZES, help="affine group size (default: 64)")
    p.add_argument("--mode", default="affine", choices=("affine", *q.FIXED_MODES),
                   help="quantization mode: affine, or a microscaling format with its own bits and group "
                        "size (default: affine)")
    p.add_argument("--preset", choices=q.PRESETS,
                   help="mixed recipe: mixed_4_8 is 4 bits, the first and last layers 8 (default: none)")
    p.add_argument("--quantize-drafter", action="store_true",
                   help="quantize an MTP drafter too (default: off, kept in --dtype)")
    p.add_argument("--quantize-vision", action="store_true",
                   help="quantize the vision embedder and tower (the 12B: its image and audio embedders) too "
                        "(default: off, kept in --dtype)")
    p.add_argument("--max-shard-size", type=float, default=DEFAULT_SHARD_GB, metavar="GB",
                   help="largest output shard, in GB: about the peak memory of a run "
                        f"(default: {DEFAULT_SHARD_GB:g})")
    p.add_argument("--force", action="store_true", help="replace an existing output directory (default: off)")
    p.add_argument("--dry-run", action="store_true",
                   help="print what would be written, reading config.json only (default: off)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (default: off)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    quantize = args.quantize or args.preset is not None
    options = dict(
        dtype=args.dtype, quantize=quantize, bits=args.bits, group_size=args.group_size, mode=args.mode,
        preset=args.preset, quantize_drafter=args.quantize_drafter, quantize_vision=args.quantize_vision,
        progress=not args.quiet,
    )
    try:
        if args.dry_run:
            _, config, weights = plan(args.source, shapes_only=True, **options)
            print(summary(config, weights))
            return 0
        out = convert(
            args.source, args.output, max_shard_gb=args.max_shard_size, force=args.force, **options
        )
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"{prog_name('convert')}: error: {e}", file=sys.stderr)
        return 1
    _say(f"wrote {out}", not args.quiet)
    return 0
