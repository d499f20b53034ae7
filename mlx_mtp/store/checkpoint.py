"""One model directory of the store (a target or a drafter), inspected without loading a weight:
its config, what its tensors need in bytes, its quantization, and the facts that size its KV cache."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from ..cache import FULL, SLIDING
from ..loading import WeightsError, check_quantization, weight_files
from ..models import DRAFTER_TYPES, model_module
from ..models.base import ConfigError
from .errors import Refused
from .headers import Header, read_header

# The media towers' tensors: read with a request's first image or audio, not at load (`loading.Tower`)
TOWER = re.compile(r"(?:^|\.)(?:vision_tower|audio_tower|embed_vision|embed_audio|vision_embedder|"
                   r"audio_embedder)\.")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVShape:
    """What one sequence's KV cache costs: for each layer that keeps K/V (KV-shared layers read
    another's), its kind, K/V heads and head dim; the sliding window; the trained context."""

    layer_types: tuple[str, ...]
    kv_heads: tuple[int, ...]
    head_dims: tuple[int, ...]
    sliding_window: int
    context: int  # max_position_embeddings
    itemsize: int  # bytes of one K or V element (the model's compute dtype)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "KVShape":
        cfg = model_module(config["model_type"]).Config.from_dict(config)
        dtype = config.get("dtype") or config.get("torch_dtype") or config.get("text_config", {}).get("dtype")
        return cls.of(cfg, ITEMSIZE.get(dtype, 2))

    @classmethod
    def of(cls, cfg, itemsize: int) -> "KVShape":
        """The shape of a model `Config` (a loaded target's `config`), its K/V `itemsize` bytes."""
        kept = range(cfg.first_shared_layer)
        return cls(tuple(cfg.layer_types[i] for i in kept), tuple(cfg.layer_kv_heads(i) for i in kept),
                   tuple(cfg.layer_head_dim(i) for i in kept), cfg.sliding_window,
                   cfg.max_position_embeddings, itemsize)

    def token_bytes(self) -> dict[str, int]:
        """K and V bytes of one position, summed over the layers of each kind (FULL, SLIDING)."""
        out = {FULL: 0, SLIDING: 0}
        for kind, heads, dim in zip(self.layer_types, self.kv_heads, self.head_dims):
            out[kind] += 2 * heads * dim * self.itemsize
        return out

    def bytes(self, tokens: int) -> int:
        """One sequence of `tokens` positions: sliding layers keep at most the window (the cache's
        own rounding and rollback slack not included)."""
        per = self.token_bytes()
        return per[FULL] * tokens + per[SLIDING] * min(tokens, self.sliding_window)


@dataclass(frozen=True)
class Checkpoint:
    """A target or drafter directory. `bytes`: its tensors (what loading it allocates, before any
    cast), of which `tower_bytes` are media towers read only with the first image or audio."""

    name: str  # its store name: the Hub id ("google/gemma-4-31B-it") or its path in the models dir
    path: Path
    where: str  # "models" (the models dir) or "hf-cache"
    config: dict
    files: tuple[Path, ...]
    bytes: int
    tower_bytes: int
    disk_bytes: int
    parameters: int  # approximate for quantized weights: packed elements times 32 / bits
    quantization: str  # "bf16", "4-bit", "4/8-bit", "mxfp4", ...
    digest: str  # "sha256:..." of the config and the headers: changes with the files
    modified: float
    kv: Optional[KVShape]  # targets only

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def is_drafter(self) -> bool:
        return self.model_type in DRAFTER_TYPES


def inspect(name: str, path: Path, where: str) -> Checkpoint:
    """Read `path`'s config and weight headers. Raises Refused naming what is wrong (a missing,
    truncated or foreign file; a model type or quantization this project does not load)."""
    config = _config(name, path)
    try:
        model_module(config["model_type"]).Config.from_dict(config)
        check_quantization(config, path)
        kv = None if config["model_type"] in DRAFTER_TYPES else KVShape.from_config(config)
        files = weight_files(path)
        headers = [read_header(f, name) for f in files]
        _check_index(name, path, headers)
    except (ConfigError, WeightsError) as e:
        raise Refused(name, path, _without(str(e), path)) from e
    except (ValueError, TypeError, KeyError) as e:  # a config or an index that is not what it says
        raise Refused(name, path, f"unreadable config or index ({type(e).__name__}: {_line(e)})") from e
    except OSError as e:
        file = Path(e.filename or "").name or "a file"
        raise Refused(name, path, f"cannot read {file}: {e.strerror}") from e
    tensors = {k: t for h in headers for k, t in h.tensors.items()}
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for h in headers:
        digest.update(f"{h.path.name}:{h.file_bytes}:".encode() + h.raw)
    return Checkpoint(
        name, path, where, config, tuple(files), sum(h.nbytes for h in headers),
        sum(t.nbytes for k, t in tensors.items() if TOWER.search(k)),
        sum(f.stat().st_size for f in path.iterdir() if f.is_file()), _parameters(tensors, config),
        quantization(config), f"sha256:{digest.hexdigest()}",
        max(f.stat().st_mtime for f in [path / "config.json", *files]), kv,
    )


def _without(text: str, path: Path) -> str:
    """The loader's message without the directory, which Refused already names."""
    return text.replace(f"{path}/", "").replace(f" in {path}", "").replace(f"{path}: ", "")


def _line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _config(name: str, path: Path) -> dict:
    file = path / "config.json"
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError as e:
        raise Refused(name, path, "no config.json: not a model directory") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise Refused(name, path, "config.json is not valid JSON") from e
    if not isinstance(config, dict) or "model_type" not in config:
        raise Refused(name, path, "config.json has no model_type")
    return config


def _check_index(name: str, path: Path, headers: list[Header]) -> None:
    """Every tensor the index places in a shard is in that shard (a shard swapped for another
    file has the right name and a valid header, but not these tensors)."""
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return
    held = {h.path.name: h.tensors for h in headers}
    for tensor, shard in json.loads(index.read_text())["weight_map"].items():
        if tensor not in held.get(shard, ()):
            raise Refused(name, path, f"{shard} does not hold {tensor}, which the index places there")


def quantization(config: dict[str, Any]) -> str:
    """A short label: the float dtype ("bf16"), the bits of an affine record ("4-bit", "4/8-bit"
    with overrides), or a microscaling mode ("mxfp4")."""
    record = config.get("quantization")
    if not record:
        dtype = config.get("dtype") or config.get("torch_dtype") or config.get("text_config", {}).get("dtype")
        return {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(dtype, str(dtype or "bf16"))
    if record.get("mode", "affine") != "affine":
        return record["mode"]
    bits = {record.get("bits", 4)}
    bits |= {v["bits"] for v in record.values() if isinstance(v, dict) and "bits" in v}
    return "/".join(str(b) for b in sorted(bits)) + "-bit"


def _parameters(tensors: dict, config: dict[str, Any]) -> int:
    record = config.get("quantization") or {}
    total = 0
    for key, t in tensors.items():
        stem = key.rsplit(".", 1)[0]
        if key.endswith((".scales", ".biases")) and f"{stem}.weight" in tensors:
            continue
        if t.dtype == "U32" and f"{stem}.scales" in tensors:  # packed quantized weight
            own = record.get(stem) if isinstance(record.get(stem), dict) else {}
            total += t.elements * 32 // own.get("bits", record.get("bits", 4))
        else:
            total += t.elements
    return total


class Inspector:
    """Checkpoints by directory, inspected again only when a file in it changed (size or mtime),
    so listing the store often reads no header twice. Safe to share between threads."""

    def __init__(self):
        self._seen: dict[Path, tuple] = {}
        self._lock = threading.Lock()

    def __call__(self, name: str, path: Path, where: str) -> Checkpoint:
        mark = _signature(path)
        with self._lock:
            seen = self._seen.get(path)
        if seen is not None and seen[0] == mark and seen[1].name == name:
            result: Union[Checkpoint, Refused] = seen[1]
        else:
            try:
                result = inspect(name, path, where)
            except Refused as e:
                result = e
            with self._lock:
                self._seen[path] = (mark, result)
        if isinstance(result, Refused):
            raise result
        return result


def _signature(path: Path) -> tuple:
    out = []
    for item in os.scandir(path):
        try:
            st = item.stat()  # through symlinks: the HF cache's snapshots link to blobs
        except FileNotFoundError:
            continue
        out.append((item.name, st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))
