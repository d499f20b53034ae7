"""The prefix cache's disk tier: the states the prefix cache keeps, in a directory, so that they
outlive the process and the memory budget (`Engine(prompt_cache_dir=...)`, `--prompt-cache-dir`).

Every state the prefix cache keeps is written here as it is kept (write-through: an eviction from
memory costs no write, and a server that is killed loses nothing); a request whose deepest match is
deeper here than in memory loads it instead of prefilling. A state of m tokens is what it is in
memory: the full-attention K/V of positions 0..m-1 and the sliding K/V of its ring's tail
`anchor`..m-1, so it restores exactly at any p from `first` (anchor + W + 1; 1 for anchor 0) to m.

Files. A state is a small file (where it restores, its last tokens, its segments); K/V live
in segment files, each one attention type's K/V of positions lo..hi-1, named by a hash of the
model, the type, lo and every token before hi (all they depend on). A state reuses the segments of
the deepest stored state its tokens extend (its ancestor) and writes only the positions after it,
so the states of a conversation, or of sessions sharing a system prompt, hold a position about
once, as memory does. Each model has a subdirectory named by its fingerprint
(`model_fingerprint`); a state never loads into another model.

Safety (`CheckedFiles`). A file is written under a unique temporary name and renamed into place (a reader, or
another process, sees a whole file or none) and never changes afterwards: two processes writing one
segment write the same bytes. Each file carries a CRC-32 of its arrays and metadata: a torn or
corrupt file is removed with a warning, and the request prefills instead. A file that vanished
(another process evicted it) is a miss. A write that fails (a full disk) stops the writing, with
one warning; what is stored still loads. The byte budget evicts the least recently used files (by
modification time: using a file touches it) of the whole directory. Nothing outside it is touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import secrets
import time
import zlib
from pathlib import Path
from typing import Iterator, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .kv import FULL, SLIDING, KVCache
from ..models.base import fused_kernels

log = logging.getLogger(__name__)

DEFAULT_BUDGET = 16 * 2**30
SAMPLE = 1024  # elements of each weight tensor that the fingerprint hashes
SUFFIX = ".safetensors"
FILE = re.compile(r"[sb]-[0-9a-f]{40}\.safetensors")  # s-: a state, b-: a segment (a block of K/V)
MODEL_DIR = re.compile(r"[0-9a-f]{24}")
TEMP_AGE = 3600.0  # seconds after which a temporary file is an interrupted write's, not one under way
LOW_WATER = 0.9  # eviction frees down to this share of the budget, so that it runs seldom


def model_fingerprint(target, **context) -> str:
    """What a state's K/V depend on, hashed: each weight tensor's name, shape, dtype and the bytes
    of SAMPLE of its elements at fixed pseudo-random places (any change to more than a few
    elements of a tensor, another checkpoint, dtype or quantization changes it; quantized
    scales and biases are tensors too), the model's config, MLX's version, the device, the
    kernels, and `context` (e.g. the prefill chunk, which decides how prompts are cut)."""
    config = target.config
    about = dict(context, config=dataclasses.asdict(config) if dataclasses.is_dataclass(config) else repr(config),
                 mlx=mx.__version__, device=str(mx.default_device()), fused=fused_kernels())
    h = hashlib.sha256(json.dumps(about, sort_keys=True, default=str).encode())
    for name, a in sorted(tree_flatten(target.parameters()), key=lambda item: item[0]):
        h.update(f"{name}:{a.shape}:{a.dtype};".encode())
        h.update(_raw(_sample(name, a)))
    return h.hexdigest()


def open_disk_tier(directory, target, budget: Optional[int] = None, **context) -> Optional[DiskTier]:
    """The disk tier for `target` in `directory`, or None (with a warning) where it cannot be used."""
    try:
        window = target.make_cache(1).window
        return DiskTier(directory, model_fingerprint(target, **context), budget or DEFAULT_BUDGET, window)
    except OSError as e:
        log.warning("prefix cache: cannot use %s (%s); states stay in memory only", directory, e)
        return None


@dataclasses.dataclass
class DiskStats:
    hits: int = 0  # requests that resumed from a state loaded from disk
    hit_tokens: int = 0  # the tokens those restored
    misses: int = 0  # requests for which the disk held nothing deeper than memory
    writes: int = 0  # states written
    evictions: int = 0  # files removed to stay within the budget
    corrupt: int = 0  # files removed as torn or corrupt
    bytes: int = 0  # the directory's size: as of the last scan, plus this process's writes


@dataclasses.dataclass
class _Entry:
    """A stored state, as the index knows it."""

    name: str
    length: int
    anchor: int
    first: int  # the least position it restores at
    head: str  # the hash of its tokens before `first`
    tail: np.ndarray  # its tokens from `first` on


class _Vanished(Exception):
    """A file is gone (another process evicted it) or cannot be read."""


class _Corrupt(Exception):
    """A file failed its checks (it was removed)."""


class CheckedFiles:
    """The disk tier's files in one model's subdirectory (see the module's docstring): each written
    whole, read back checked (its CRC-32 and model), touched when used, and the least recently used
    of the whole directory, every model's, evicted to keep it within a byte budget. It counts bytes,
    evictions and damaged files in the tier's `stats`.

    Args:
        root: the directory; the model's subdirectory is made if missing.
        fingerprint: the model's `model_fingerprint`, which every file carries.
        stats: the tier's `DiskStats`.
    """

    def __init__(self, root: Path, fingerprint: str, stats: DiskStats):
        self.root, self.dir = root, root / fingerprint[:24]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fingerprint, self.stats = fingerprint, stats

    def write(self, name: str, arrays: dict, meta: dict) -> None:
        """Write a file whole or not at all: to a temporary name of this writer's own, then renamed."""
        meta = dict(meta, model=self.fingerprint)
        meta["crc32"] = _crc(arrays, meta)
        temp = self.dir / f".{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
        try:
            with open(temp, "xb") as f:
                mx.save_safetensors(f, arrays, metadata=meta)
                size = f.tell()
            os.replace(temp, self.path(name))
        except BaseException:
            with contextlib.suppress(OSError):
                temp.unlink()
            raise
        self.stats.bytes += size

    def path(self, name: str) -> Path:
        return self.dir / (name + SUFFIX)

    def read(self, name: str, touch: bool = True) -> tuple[dict, dict]:
        """A file's arrays and metadata, checked (and touched: it was used).

        Raises:
            _Vanished: it is gone or unreadable. _Corrupt: it failed a check (and was removed).
        """
        try:
            with open(self.path(name), "rb") as f:  # (a path would make a missing file a RuntimeError)
                arrays, meta = mx.load(f, format="safetensors", return_metadata=True)
            crc = meta.pop("crc32", None)
            if meta.get("model") != self.fingerprint:
                raise ValueError("another model's")
            if crc != _crc(arrays, meta):
                raise ValueError("checksum mismatch")
        except OSError as e:
            raise _Vanished(name) from e
        except Exception as e:  # what MLX raises for a torn file, bad JSON, a checksum mismatch
            raise self.corrupt(name, f"{type(e).__name__}: {e}") from None
        if touch:
            self.touch(name)
        return arrays, meta

    def corrupt(self, name: str, why: str) -> _Corrupt:
        log.warning("prefix cache: %s is damaged (%s); removed", self.path(name), why)
        self.stats.corrupt += 1
        self.remove(name)
        return _Corrupt(name)

    def touch(self, name: str) -> bool:
        """Mark a file as just used; False if it is not there."""
        try:
            os.utime(self.path(name))
            return True
        except FileNotFoundError:
            return False
        except OSError:  # a read-only directory: its files still load
            return self.path(name).exists()

    def remove(self, name: str) -> None:
        with contextlib.suppress(OSError):
            size = self.path(name).stat().st_size
            self.path(name).unlink()
            self.stats.bytes -= size

    def listing(self) -> list[tuple[int, int, Path]]:
        """(mtime, size, path) of every state and segment file of every model in the directory."""
        out = []
        for sub in os.scandir(self.root):
            if not (MODEL_DIR.fullmatch(sub.name) and sub.is_dir()):
                continue
            for f in os.scandir(sub.path):
                if FILE.fullmatch(f.name):
                    with contextlib.suppress(FileNotFoundError):  # evicted meanwhile by another process
                        st = f.stat()
                        out.append((st.st_mtime_ns, st.st_size, Path(f.path)))
        return out

    def fit(self, budget: int) -> list[str]:
        """Once this process's count says the directory is over `budget`: remove its least recently
        used files, of any model, until it is within LOW_WATER of it. Returns the names removed
        from this model's subdirectory."""
        if self.stats.bytes <= budget:
            return []
        files = sorted(self.listing())
        total, removed = sum(size for _, size, _ in files), []
        for _, size, path in files:
            if total <= LOW_WATER * budget:
                break
            with contextlib.suppress(FileNotFoundError):  # another process got there first
                path.unlink()
                self.stats.evictions += 1
            total -= size
            if path.parent == self.dir:
                removed.append(path.name[: -len(SUFFIX)])
        self.stats.bytes = total
        return removed

    def sweep_temporaries(self) -> None:
        """Remove what writes that were interrupted (a killed process) left, once surely not under way."""
        now = time.time()
        for f in os.scandir(self.dir):
            if f.name.startswith(".") and f.name.endswith(".tmp"):
                with contextlib.suppress(FileNotFoundError):
                    if now - f.stat().st_mtime > TEMP_AGE:
                        os.unlink(f.path)


class DiskTier:
    """The states of one model in `directory` (see the module's docstring); used by one thread,
    while other processes may use the directory too.

    Args:
        directory: where states live (made if missing); each model in a subdirectory.
        fingerprint: the model's `model_fingerprint`.
        budget: bytes the whole directory may hold.
        window: the model's sliding window W.
    """

    def __init__(self, directory, fingerprint: str, budget: int, window: int):
        if budget <= 0:
            raise ValueError(f"a disk budget must be > 0 bytes, got {budget}")
        self.fingerprint, self.budget, self.window = fingerprint, int(budget), window
        self.stats = DiskStats()
        self.files = CheckedFiles(Path(directory), fingerprint, self.stats)
        self.writable = True
        self._entries: dict[str, _Entry] = {}
        self._by_first: dict[int, dict[str, list[_Entry]]] = {}  # first -> head -> entries
        self._listed: Optional[int] = None  # the directory's mtime when it was last listed
        self.files.sweep_temporaries()
        self.stats.bytes = sum(size for _, size, _ in self.files.listing())
        self._fit()
        self._refresh()

    @property
    def states(self) -> int:
        return len(self._entries)

    # ---- restoring ---------------------------------------------------------------------------

    def lookup(self, ids: np.ndarray, beyond: int = 0) -> Optional[tuple[_Entry, int]]:
        """The stored state that restores the most of `ids` (leaving one token to feed), if more
        than `beyond` tokens, and how many it restores."""
        self._refresh()
        best = None
        for entry, p in self._matches(ids, len(ids) - 1):
            if p > (best[1] if best else beyond):
                best = (entry, p)
        return best

    def resume(self, ids: np.ndarray, cache: KVCache, beyond: int = 0) -> int:
        """Fill the empty one-row `cache` from the stored state restoring the most of `ids`, if
        more than `beyond` tokens. Returns how many it holds (0: a miss, the cache stays empty)."""
        while (found := self.lookup(ids, beyond)) is not None:
            if self._restore(*found, cache):
                self.stats.hits += 1
                self.stats.hit_tokens += found[1]
                return found[1]
        self.stats.misses += 1
        return 0

    def _restore(self, entry: _Entry, p: int, cache: KVCache) -> bool:
        try:  # (its first p tokens are ids': a hash of those before `first` and the rest one by one agree)
            segments = json.loads(self.files.read(entry.name)[1]["segments"])
            full = self._gather(entry.name, segments, FULL, 0, p)
            sliding = self._gather(entry.name, segments, SLIDING, max(p - self.window - 1, 0), p)
        except (_Vanished, _Corrupt):  # a state whose segment is gone is of no use either
            self._remove(entry.name)
            return False
        cache.resume(p, full, sliding)
        return True

    def _gather(self, state: str, segments: list, kind: str, lo: int, hi: int) -> dict:
        """(K, V) of positions lo..hi-1 of every layer of `kind`, from the segments holding them."""
        parts, at = [], lo
        for s_kind, s_lo, s_hi, name in segments:
            if s_kind != kind or s_hi <= at or s_lo >= hi:
                continue
            if s_lo > at:
                raise self.files.corrupt(state, f"no segment holds position {at}")
            parts.append((self.files.read(name)[0], at - s_lo, min(hi, s_hi) - s_lo))
            at = min(hi, s_hi)
        if at < hi:
            raise self.files.corrupt(state, f"no segment holds position {at}")
        layers = sorted({int(n[1:]) for arrays, _, _ in parts for n in arrays})
        return {layer: tuple(mx.concatenate([a[f"{c}{layer}"][:, :, i:j] for a, i, j in parts], axis=2)
                             for c in "kv") for layer in layers}

    def _matches(self, ids: np.ndarray, limit: int) -> Iterator[tuple[_Entry, int]]:
        """Each stored state sharing ids' first `first` tokens, with how many of ids[:limit] it
        restores (its tokens and ids agree up to there)."""
        firsts = [f for f in self._by_first if f <= limit]
        heads = _prefix_hashes(self.fingerprint, ids, firsts)
        for f in firsts:
            for entry in self._by_first[f].get(heads[f], ()):
                yield entry, f + _common(entry.tail, ids[f:limit])

    # ---- storing -----------------------------------------------------------------------------

    def save(self, ids: np.ndarray, cache: KVCache, anchor: int) -> None:
        """Store the state of the one-row `cache`, which holds `ids`, its ring holding the sliding
        K/V from `anchor` on (unless it is stored already)."""
        m = len(ids)
        first = anchor + self.window + 1 if anchor else 1
        if not self.writable or first > m:
            return
        self._refresh()
        hashes = _prefix_hashes(self.fingerprint, ids, [first, m])
        name = "s-" + hashes[m]
        if self.files.touch(name):
            return
        entry = _Entry(name, m, anchor, first, hashes[first], ids[first:].copy())
        try:
            segments = self._segments(ids, cache, anchor, hashes[m])
            meta = dict(length=m, anchor=anchor, first=first, head=entry.head, tail=entry.tail.tolist(),
                        segments=segments)
            self.files.write(name, {}, {k: json.dumps(v) for k, v in meta.items()})
        except OSError as e:
            self.writable = False
            log.warning("prefix cache: writing to %s failed (%s); new states stay in memory only", self.files.dir, e)
            return
        self._index(entry)
        self.stats.writes += 1
        self._fit()

    def _segments(self, ids: np.ndarray, cache: KVCache, anchor: int, end_hash: str) -> list:
        """The state's segments: its ancestor's, then new ones for the positions after it."""
        m = len(ids)
        start, full, sliding = self._ancestor(ids, anchor)
        if sliding is None:  # its sliding K/V start after this state's: write them all
            sliding, s_lo = [], anchor
        else:
            s_lo = max(start, anchor)
        full_new = self._segment(cache, FULL, start, m, end_hash)
        sliding_new = self._segment(cache, SLIDING, s_lo, m, end_hash)
        return [*full, *filter(None, [full_new]), *sliding, *filter(None, [sliding_new])]

    def _ancestor(self, ids: np.ndarray, anchor: int) -> tuple[int, list, Optional[list]]:
        """(its length, its full-attention segments, its sliding ones from `anchor` on, None if
        they do not reach back that far) of the deepest stored state that `ids` extend and whose
        segments are all still here; (0, [], None) if none."""
        found = [e for e, p in self._matches(ids, len(ids)) if p == e.length < len(ids)]
        for entry in sorted(found, key=lambda e: -e.length):
            try:
                segments = json.loads(self.files.read(entry.name)[1]["segments"])
            except (_Vanished, _Corrupt):
                self._remove(entry.name)
                continue
            if all(self.files.touch(s[3]) for s in segments):
                full = [s for s in segments if s[0] == FULL]
                sliding = [s for s in segments if s[0] == SLIDING and s[2] > anchor]
                return entry.length, full, sliding if entry.anchor <= anchor else None
        return 0, [], None

    def _segment(self, cache: KVCache, kind: str, lo: int, hi: int, end_hash: str) -> Optional[list]:
        """[kind, lo, hi, name] of the segment holding `cache`'s K/V of `kind` at lo..hi-1, written
        unless it is here already; None for no positions or no layers of the kind."""
        if lo >= hi or kind not in cache.layer_types:
            return None
        name = "b-" + hashlib.sha256(f"{end_hash}:{kind}:{lo}".encode()).hexdigest()[:40]
        if not self.files.touch(name):
            kv = cache.read(lo, hi, kind)
            arrays = {f"{c}{layer}": pair[j] for layer, pair in kv.items() for j, c in enumerate("kv")}
            self.files.write(name, arrays, {"kind": kind, "lo": str(lo), "hi": str(hi)})
        return [kind, lo, hi, name]

    # ---- the index -------------------------------------------------------------------------------

    def _refresh(self) -> None:
        """Index the states stored since the last look (by other processes, or before this one)."""
        folder = self.files.dir
        folder.mkdir(parents=True, exist_ok=True)  # (in case someone removed it)
        listed = os.stat(folder).st_mtime_ns
        if listed == self._listed:
            return
        self._listed = listed
        names = {n[: -len(SUFFIX)] for n in os.listdir(folder) if n.startswith("s-") and FILE.fullmatch(n)}
        for name in set(self._entries) - names:
            self._forget(name)
        for name in sorted(names - set(self._entries)):
            try:
                meta = self.files.read(name, touch=False)[1]
                self._index(_Entry(name, int(meta["length"]), int(meta["anchor"]), int(meta["first"]),
                                   json.loads(meta["head"]), np.asarray(json.loads(meta["tail"]), dtype=np.int32)))
            except (_Vanished, _Corrupt):
                continue
            except (KeyError, ValueError, TypeError) as e:  # checked, yet not what this version writes
                self.files.corrupt(name, f"unexpected metadata: {e!r}")

    def _index(self, entry: _Entry) -> None:
        self._forget(entry.name)
        self._entries[entry.name] = entry
        self._by_first.setdefault(entry.first, {}).setdefault(entry.head, []).append(entry)

    def _forget(self, name: str) -> None:
        entry = self._entries.pop(name, None)
        if entry is None:
            return
        heads = self._by_first[entry.first]
        heads[entry.head].remove(entry)
        if not heads[entry.head]:
            del heads[entry.head]
        if not heads:
            del self._by_first[entry.first]

    def _fit(self) -> None:
        """Keep the directory within the budget (`CheckedFiles.fit`); the states evicted leave the index."""
        for name in self.files.fit(self.budget):
            self._forget(name)

    def _remove(self, name: str) -> None:
        """Remove a file, and the state from the index if it is one."""
        self._forget(name)
        self.files.remove(name)


def _prefix_hashes(fingerprint: str, ids: np.ndarray, at) -> dict[int, str]:
    """For each p in `at`: a hash of (the model, ids[:p]), all in one pass over ids."""
    h = hashlib.sha256(fingerprint.encode())
    out, pos = {}, 0
    for p in sorted(set(at)):
        h.update(np.asarray(ids[pos:p], dtype="<i4").tobytes())
        out[p], pos = h.copy().hexdigest()[:40], p
    return out


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _sample(name: str, a: mx.array) -> mx.array:
    flat = a.reshape(-1)
    if flat.size <= SAMPLE:
        return flat
    index = np.random.default_rng(zlib.crc32(name.encode())).integers(0, flat.size, SAMPLE)
    return flat[mx.array(np.sort(index).astype(np.uint32))]


def _raw(a: mx.array) -> memoryview:
    """The bytes of `a`, without a copy where it is contiguous already."""
    a = mx.contiguous(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
    mx.eval(a)
    return memoryview(a).cast("B") if a.size else memoryview(b"")


def _crc(arrays: dict, meta: dict) -> str:
    """A CRC-32 of a file's arrays (names, dtypes, shapes, bytes) and metadata."""
    crc = zlib.crc32(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(arrays):
        a = arrays[name]
        crc = zlib.crc32(_raw(a), zlib.crc32(f"{name}:{a.dtype}:{a.shape}".encode(), crc))
    return f"{crc:08x}"
