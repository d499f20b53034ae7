"""Safetensors headers, read without loading a tensor: what each tensor costs in bytes, and whether
the file is whole.

A safetensors file is an 8-byte little-endian header length, a JSON header
(`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`), then the tensor
bytes, packed with no gap: its length is exactly 8 + header + the last tensor's end.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .errors import Refused

MAX_HEADER = 100 << 20  # the format's own limit; a longer "header" means another kind of file
BITS = {  # bits per element of each safetensors dtype
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "E8M0": 8,
    "U16": 16, "I16": 16, "F16": 16, "BF16": 16, "U32": 32, "I32": 32, "F32": 32,
    "U64": 64, "I64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


@dataclass(frozen=True)
class Tensor:
    dtype: str
    shape: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return (self.elements * BITS[self.dtype] + 7) // 8


@dataclass(frozen=True)
class Header:
    """One safetensors file's tensors (name -> Tensor) and its raw header (for digests)."""

    path: Path
    tensors: dict[str, Tensor]
    raw: bytes
    file_bytes: int

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def read_header(path: Path, name: str) -> Header:
    """The header of `path`, checked against the file's length. Raises Refused (for the store
    entry `name`) naming the file: not a safetensors file, or truncated."""
    size = path.stat().st_size  # (OSError: the caller says which file it could not read)
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if size < 8 or length > MAX_HEADER:
            raise Refused(name, path, f"{path.name} is not a safetensors file")
        raw = f.read(length)
    if len(raw) < length:
        raise Refused(name, path, f"{path.name} is truncated ({size} bytes, its header needs {8 + length})")
    tensors = _tensors(raw, path, name)
    whole = 8 + length + max((t[1] for t in tensors.values()), default=0)
    if size != whole:
        state = "truncated" if size < whole else "longer than its tensors"
        raise Refused(name, path, f"{path.name} is {state} ({size} bytes, its header says {whole})")
    return Header(path, {k: v[0] for k, v in tensors.items()}, raw, size)


def _tensors(raw: bytes, path: Path, name: str) -> dict[str, tuple[Tensor, int]]:
    """name -> (Tensor, end offset); Refused where the header is not safetensors' JSON."""
    try:
        header = json.loads(raw)
        out = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            tensor = Tensor(info["dtype"], tuple(int(n) for n in info["shape"]))
            begin, end = (int(n) for n in info["data_offsets"])
            if end - begin != tensor.nbytes or begin < 0:
                raise ValueError(f"tensor {key} holds {end - begin} bytes, its shape needs {tensor.nbytes}")
            out[key] = (tensor, end)
        return out
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        why = str(e).splitlines()[0] if isinstance(e, ValueError) and "tensor" in str(e) else "bad header"
        raise Refused(name, path, f"{path.name} is not a safetensors file ({why})") from e
