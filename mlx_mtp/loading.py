"""Load targets and drafters from HF dirs, hub ids, or MLX (quantized) conversions."""

from __future__ import annotations

import json
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchLinear

from .formats.chat import stop_tokens
from .decode.drafters import HybridDrafter, MTPProposer, NgramDrafter
from .models import DRAFTER_TYPES, MEDIA, model_module, tower_builder
from .models.base import ConfigError
from .models.quantized import adopt


class WeightsError(ValueError):
    """Checkpoint files that are missing, corrupt, or do not fit the model."""


class ModelKindError(ValueError):
    """A drafter given where a target is expected, or the other way round."""


def resolve(path_or_repo: Union[str, Path]) -> Path:
    """A local directory, or a hub id resolved through huggingface_hub's cache."""
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    text = str(path_or_repo)
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise FileNotFoundError(f"model path {text!r} is not a directory")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]
    try:
        return Path(snapshot_download(text, allow_patterns=patterns))
    except Exception as e:  # offline, unknown repo, auth: say which
        raise FileNotFoundError(f"could not fetch {text!r} from the Hugging Face hub: {e}") from e


def read_config(path: Path) -> dict[str, Any]:
    file = path / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"{file} not found: not a model directory")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON: {e}") from e


def weight_files(path: Path) -> list[Path]:
    """Safetensors files of a checkpoint; every shard named by an index must exist."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise WeightsError(f"{index} names missing shard(s): {', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no .safetensors files in {path}")
    return files


def load_weights(files: list[Path]) -> dict[str, mx.array]:
    """Lazily load every tensor; a truncated or corrupt file raises WeightsError naming it."""
    weights: dict[str, mx.array] = {}
    for file in files:
        try:
            weights.update(mx.load(str(file)))
        except Exception as e:
            raise WeightsError(f"cannot read {file}: {e}") from e
    return weights


def build_model(config: dict[str, Any]) -> nn.Module:
    """Instantiate (without loading weights) the model `config` describes."""
    model_type = config.get("model_type")
    if model_type is None:
        raise ConfigError("config.json has no model_type")
    module = model_module(model_type)
    model = module.Model(module.Config.from_dict(config))
    if "quantization" in config:
        apply_quantization(model, config["quantization"], module)
    return model


def apply_quantization(model: nn.Module, record: dict[str, Any], module=None, present=None) -> None:
    """Swap in quantized layers as a `quantization` record describes.

    The record holds defaults (`group_size`, `bits`, `mode`) and per-path overrides (a dict,
    or `false` for a layer left unquantized). Paths may use HF / mlx-lm names, and name the parts of
    a projection the model keeps joined (q/k/v, gate/up: `gemma4.join`).
    """
    rename = getattr(module, "rename", None) or (lambda k: k)
    joined = getattr(module, "joined_name", None) or (lambda k: k)  # projections the model keeps joined
    overrides = {}
    for key, value in record.items():
        if isinstance(value, (dict, bool)):
            name = rename(key + ".weight")
            if name is None:
                continue
            path = joined(name[: -len(".weight")])
            if overrides.setdefault(path, value) != value:
                raise ConfigError(f"quantization record: the parts of {path} are quantized differently")

    def predicate(path: str, layer: nn.Module):
        if path in overrides:
            return overrides[path]
        if present is not None and f"{path}.scales" not in present:
            return False
        return hasattr(layer, "to_quantized")

    nn.quantize(
        model,
        group_size=record.get("group_size", 64),
        bits=record.get("bits", 4),
        mode=record.get("mode", "affine"),
        class_predicate=predicate,
    )
    adopt(model)


def check_quantization(config: dict[str, Any], path: Path) -> None:
    """Only MLX's own `quantization` record is understood; say so for other formats."""
    method = (config.get("quantization_config") or {}).get("quant_method")
    if "quantization" not in config and method:
        raise ConfigError(f"{path}: {method!r} quantized checkpoints are not supported; convert from bf16 weights")


def load_model(
    path_or_repo: Union[str, Path], dtype: Optional[mx.Dtype] = None, lazy: bool = False
) -> tuple[nn.Module, dict[str, Any], Path]:
    """Load a model from a directory or hub id.

    Returns:
        (model, config dict, resolved path). Unless `lazy` (the converter's mode, which keeps
        weights as stored), expert weights may be widened to float32: see `widen_experts`.
    """
    path = resolve(path_or_repo)
    config = read_config(path)
    if config.get("model_type") is None:
        raise ConfigError(f"{path / 'config.json'} has no model_type")
    check_quantization(config, path)
    model_module(config["model_type"])  # an unknown type fails before any weight is read
    model = model_from_weights(config, load_weights(weight_files(path)), dtype, lazy, where=str(path))
    suppress = generation_config(path).get("suppress_tokens")
    if suppress is not None and hasattr(model.config, "suppress_tokens"):
        model.config.suppress_tokens = tuple(int(t) for t in suppress)
    return model, config, path


def model_from_weights(config: dict[str, Any], weights: dict[str, mx.array], dtype: Optional[mx.Dtype] = None,
                       lazy: bool = False, where: str = "weights") -> nn.Module:
    """A model from its config and its tensors under checkpoint (or converter) names, as
    `load_model` builds it from files; the model holds the arrays given, without copies."""
    module = model_module(config["model_type"])
    model = module.Model(module.Config.from_dict(config))
    if dtype is not None:  # matrices cast before `sanitize` joins projections: not both widths at once
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and v.ndim > 1 else v
                   for k, v in weights.items()}
    weights = model.sanitize(weights)
    if "quantization" in config:
        apply_quantization(model, config["quantization"], module, present=weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise WeightsError(f"{where}: weights do not match the config: {e}") from e
    if dtype is not None:
        cast_floats(model, dtype)
    if not lazy:
        widen_experts(model)
        mx.eval(model.parameters(), _private_arrays(model))
    model.eval()
    return model


def _private_arrays(model: nn.Module) -> list[mx.array]:
    """Arrays a module keeps outside its parameters (e.g. `_name` tables). They must be
    evaluated at load time too: MLX cannot evaluate, on another thread, an array whose
    graph was built on the loading thread's stream."""
    return [v for _, m in model.named_modules() for v in vars(m).values() if isinstance(v, mx.array)]


def cast_floats(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast floating-point parameters (not quantized integer weights) to `dtype`."""
    from mlx.utils import tree_map

    model.update(
        tree_map(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a, model.parameters())
    )


def gather_mm_supports(dtype: mx.Dtype) -> bool:
    """Whether `mx.gather_mm` runs in `dtype` on the default device (MLX's CPU backend
    supports only float32). Probed once per dtype and device with tiny arrays."""
    return _gather_mm_works(dtype, mx.default_device())


@lru_cache(maxsize=None)
def _gather_mm_works(dtype: mx.Dtype, device: mx.Device) -> bool:
    try:
        a, b = mx.zeros((1, 1, 2), dtype), mx.zeros((2, 2, 2), dtype)
        mx.eval(mx.gather_mm(a, b, rhs_indices=mx.array([1])))
        return True
    except RuntimeError:
        return False


def widen_experts(model: nn.Module) -> None:
    """Keep unquantized MoE expert weights in float32 when the backend cannot gather-matmul
    their dtype; `Experts` then computes in float32 and returns its input's dtype."""
    for _, module in model.named_modules():
        if isinstance(module, SwitchLinear) and not gather_mm_supports(module.weight.dtype):
            module.update({k: v.astype(mx.float32) for k, v in module.parameters().items()})


class Tower:
    """A checkpoint's vision or audio tower (found through the models' registry), read from its
    weights the first time it is used (`get`), once, whichever thread asks first: text-only use
    never pays for it. What turns requests' media into its inputs is the formats' (`formats.vision`,
    `formats.audio`); they keep what they make of a tower on it (`extras`)."""

    def __init__(self, kind: str, path: Path, config: dict[str, Any], build, dtype: Optional[mx.Dtype] = None):
        self.kind, self.path, self.config, self.dtype = kind, Path(path), config, dtype
        self.extras: dict[str, Any] = {}
        self._build, self._model = build, None
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def get(self) -> nn.Module:
        """The tower, read now if it was not yet."""
        with self._lock:
            if self._model is None:
                model = self._build(self.config, load_weights(weight_files(self.path)))
                if self.dtype is not None:
                    cast_floats(model, self.dtype)
                    mx.eval(model.parameters())
                self._model = model
            return self._model


def towers(path: Path, config: dict[str, Any], dtype: Optional[mx.Dtype] = None) -> dict[str, Tower]:
    """The checkpoint's media towers by kind ("vision", "audio"), not read yet."""
    found, built = {}, {}
    for kind in MEDIA:
        build = tower_builder(config, kind)
        if build is not None:  # (the 12B's embedders are one module for both kinds: one tower)
            found[kind] = built[build] = built.get(build) or Tower(kind, path, config, build, dtype)
    return found


class Loaded(NamedTuple):
    """A target, its tokenizer (None if the directory has none), an optional drafter,
    the token ids that end a reply (Gemma 4's turn end and tool response included), and the
    checkpoint's vision and audio towers (`Tower`, None without one; read with the first image
    or audio)."""

    target: nn.Module
    tokenizer: Any
    drafter: Optional[nn.Module]
    eos_ids: frozenset
    vision: Optional[Tower] = None
    audio: Optional[Tower] = None


def load(
    model: Union[str, Path], drafter: Union[str, Path, None] = None, dtype: Optional[mx.Dtype] = None,
    ngram: bool = False, load_vision: bool = False, load_audio: bool = False,
) -> Loaded:
    """Load a Gemma 4 target and what drafts for it.

    Args:
        model: the target's directory or hub id.
        drafter: its MTP drafter (directory or hub id), "ngram" for prompt lookup (no model
            needed), or None for plain decoding.
        dtype: compute dtype of floating-point weights (default: the checkpoint's).
        ngram: with an MTP drafter, use the n-gram proposal where it is long (hybrid).
        load_vision: read a vision tower now rather than with the first image (which then waits
            for it); text-only use never reads it.
        load_audio: the same for an audio tower (E2B/E4B; the 12B's audio embedder).

    Raises:
        ModelKindError: `model` is a drafter, or `drafter` is not one.
        ValueError: the drafter cannot read this target's K/V (wrong pair).
    """
    target, config, path = load_model(model, dtype=dtype)
    if config.get("model_type") in DRAFTER_TYPES:
        raise ModelKindError(f"{model} is an MTP drafter ({config['model_type']}), not a target model; "
                             "pass it as the drafter")
    draft = None
    if str(drafter) == "ngram":
        draft = NgramDrafter()
    elif drafter is not None:
        draft = load_drafter(drafter, target, dtype)
        if ngram:
            draft = HybridDrafter(MTPProposer(draft, target), NgramDrafter())
    tokenizer = load_tokenizer(path)
    found = towers(path, config, dtype)
    for kind, now in (("vision", load_vision), ("audio", load_audio)):
        if now and kind in found:
            found[kind].get()
    return Loaded(target, tokenizer, draft, eos_ids(path, config) | stop_tokens(tokenizer), found.get("vision"),
                  found.get("audio"))


def load_drafter(drafter: Union[str, Path], target, dtype: Optional[mx.Dtype] = None) -> nn.Module:
    """The MTP drafter at `drafter` (a directory or hub id), checked against `target` (ModelKindError,
    ValueError as `load` says)."""
    draft, draft_config, _ = load_model(drafter, dtype=dtype)
    if draft_config.get("model_type") not in DRAFTER_TYPES:
        raise ModelKindError(f"{drafter} is a {draft_config.get('model_type')!r} model, not an MTP "
                             f"drafter ({', '.join(sorted(DRAFTER_TYPES))})")
    draft.check_target(target)
    return draft


def load_tokenizer(path: Path):
    """mlx-lm's TokenizerWrapper when the directory has tokenizer files, else None."""
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from mlx_lm.tokenizer_utils import load as load_tok

    return load_tok(path)


def generation_config(path: Path) -> dict[str, Any]:
    """A checkpoint's generation_config.json ({} without one)."""
    file = path / "generation_config.json"
    return json.loads(file.read_text()) if file.exists() else {}


def eos_ids(path: Path, config: dict[str, Any]) -> frozenset:
    """Stop tokens from config.json (top level and text_config) and generation_config.json."""
    found: set[int] = set()
    sources = [config, config.get("text_config", {}), generation_config(path)]
    for source in sources:
        value = source.get("eos_token_id")
        if value is not None:
            found.update(value if isinstance(value, list) else [value])
    return frozenset(found)
