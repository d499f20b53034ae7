"""Memory on the device: wired buffers, MLX's buffer cache, and the defaults the Engine starts from.

On a Mac the GPU shares the system's memory, and macOS may page out any buffer that is not
wired: a model of many GiB that gets paged decodes at disk speed. So, as mlx-lm does, the model's
buffers are wired (up to Metal's recommended working set) while it generates. MLX also keeps
freed buffers for reuse, without bound unless limited. Both are process-wide settings:
`generating()` sets them on a GPU for as long as generation runs and restores them after. An
NVIDIA GPU (MLX's CUDA backend) has memory of its own, which nothing pages: only the buffer cache
is bounded there. On the CPU both are left alone (wiring is a Metal notion).

The defaults follow `mx.device_info()`. Of the memory the device should use (the recommended
working set on a Mac's GPU, an NVIDIA GPU's own memory, the physical memory on the CPU), what the
weights leave is split: half for the KV cache of the running batch (the Engine's `memory_limit`),
a quarter for the prefix cache, an eighth for MLX's buffer cache, and the rest for activations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from typing import Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

log = logging.getLogger(__name__)

GiB = 2**30
BACKENDS = {"metal": "Metal", "cuda": "CUDA", "cpu": "CPU"}  # Device.backend -> its name in reports
TIGHT = 0.9  # a model above this share of the working set leaves too little for the rest


@dataclasses.dataclass(frozen=True)
class Device:
    """What MLX reports about the default device."""

    name: str
    gpu: bool
    memory: int  # bytes: unified memory on a Mac, an NVIDIA GPU's own, physical memory on the CPU
    working_set: Optional[int] = None  # Metal's recommended working set; None elsewhere

    @classmethod
    def current(cls) -> "Device":
        info = mx.device_info()
        gpu = mx.default_device() == mx.gpu
        memory = info.get("memory_size") or info.get("total_memory") or _physical_memory()
        working_set = info.get("max_recommended_working_set_size") if gpu else None
        about = f"{info.get('device_name', 'unknown')}, {info.get('architecture', '?')}"
        name = f"{'gpu' if gpu else 'cpu'} ({about})"
        return cls(name, gpu, int(memory), int(working_set) if working_set else None)

    @property
    def backend(self) -> str:
        """MLX's backend: "metal" (a GPU with a recommended working set), "cuda" or "cpu"."""
        if not self.gpu:
            return "cpu"
        return "metal" if self.working_set is not None else "cuda"

    @property
    def budget(self) -> int:
        """Bytes MLX should stay within on this device."""
        return self.working_set or self.memory

    @property
    def wires(self) -> bool:
        """Whether generation wires buffers here (Metal)."""
        return self.backend == "metal"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Settings and defaults for one model on one device (see the module's docstring)."""

    device: Device
    model_bytes: int
    kv_limit: int  # the Engine's default `memory_limit`
    prefix_cache: int  # the prefix cache's default budget
    wired_limit: Optional[int]  # set while generating; None: left alone
    cache_limit: Optional[int]  # MLX's buffer cache limit while generating; None: left alone

    @property
    def tight(self) -> bool:
        """The weights alone take (nearly) all the memory the device should use."""
        return self.model_bytes > TIGHT * self.device.budget

    def describe(self, prefix_cache: Optional[int] = None) -> str:
        """One line for start-up logs (`prefix_cache`: the budget in use, when not the plan's)."""
        d = self.device
        limits = "wired and buffer cache limits left alone (CPU)"
        if self.wired_limit is not None:
            limits = (f"wired limit {size(self.wired_limit)}, buffer cache limit {size(self.cache_limit)} "
                      "while generating")
        elif self.cache_limit is not None:
            limits = f"buffer cache limit {size(self.cache_limit)} while generating; nothing wired (CUDA)"
        working_set = f", working set {size(d.working_set)}" if d.working_set else ""
        budget = self.prefix_cache if prefix_cache is None else prefix_cache
        prefix = size(budget) if budget else "off"
        return (f"memory: {d.name}, {size(d.memory)}{working_set}; weights {size(self.model_bytes)}; "
                f"KV cache limit {size(self.kv_limit)}, prefix cache {prefix}; {limits}")


def plan(*models, device: Optional[Device] = None) -> MemoryPlan:
    """The memory plan for `models` (target, drafter; None is skipped) on `device` (default: now)."""
    device = device or Device.current()
    weights = sum(nbytes(m) for m in models if m is not None)
    # At least an eighth of the budget, so a model that fills the device runs (slowly) rather
    # than refusing every request.
    room = max(device.budget - weights, device.budget // 8)
    wired = device.working_set if device.wires else None
    return MemoryPlan(device, weights, room // 2, room // 4, wired_limit=wired,
                      cache_limit=room // 8 if device.gpu else None)


def nbytes(model) -> int:
    """Bytes of a module's arrays (0 for a drafter that is not a module, e.g. prompt lookup)."""
    if not isinstance(model, nn.Module):
        return 0
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


# ---- wired memory and the buffer cache while generating ---------------------------------------

_lock = threading.Lock()
_depth = 0  # open `generating` blocks, on any thread
_active: Optional[MemoryPlan] = None  # the plan they applied
_saved: tuple = ()  # (wired, cache) limits to restore
_warned = False


@contextlib.contextmanager
def generating(*models) -> Iterator[None]:
    """Wire the models' buffers (Metal) and bound MLX's buffer cache (any GPU) while the block
    generates; restore both after it, once every buffer it queued is done. Nested and concurrent
    blocks share one setting: the first applies it and the last restores it. On the CPU nothing
    is touched."""
    if not _enter(models):
        yield
        return
    try:
        yield
    finally:
        _leave()


def _enter(models) -> bool:
    global _depth, _active, _saved, _warned
    device = Device.current()
    if not device.gpu:
        return False
    with _lock:
        if _depth == 0:
            p = plan(*models, device=device)
            if p.tight and not _warned and device.wires:
                _warned = True
                log.warning("the weights (%s) take over %d%% of the recommended working set (%s): expect "
                            "them to be paged, and slow generation", size(p.model_bytes), 100 * TIGHT,
                            size(p.wired_limit))
            wired = _set_wired_limit(p.wired_limit) if p.wired_limit is not None else None
            _saved = (wired, mx.set_cache_limit(p.cache_limit))
            _active = p if _saved[0] is not None else dataclasses.replace(p, wired_limit=None)
        _depth += 1
        return True


def _leave() -> None:
    global _depth, _active
    with _lock:
        _depth -= 1
        if _depth:
            return
        mx.synchronize()  # the wired limit must not change under a running computation
        wired, cache = _saved
        if wired is not None:
            mx.set_wired_limit(wired)
        mx.set_cache_limit(cache)
        mx.clear_cache()
        _active = None


def _set_wired_limit(limit: int) -> Optional[int]:
    """The previous limit, or None when the system refuses (above `iogpu.wired_limit_mb`)."""
    try:
        return mx.set_wired_limit(limit)
    except (RuntimeError, ValueError) as e:
        log.warning("could not wire %s for the model, generating unwired: %s", size(limit), e)
        return None


def wired_limit() -> Optional[int]:
    """The wired limit `generating` set and holds now (None: none set)."""
    return _active.wired_limit if _active is not None else None


# ---- reporting --------------------------------------------------------------------------------


def usage() -> dict[str, int]:
    """MLX's memory now: in use, held by its buffer cache, and the peak since start (bytes)."""
    return {"active_memory_bytes": mx.get_active_memory(), "cache_memory_bytes": mx.get_cache_memory(),
            "peak_memory_bytes": mx.get_peak_memory()}


def usage_line() -> str:
    u = usage()
    wired = wired_limit()
    held = f"wired limit {size(wired)}" if wired is not None else "nothing wired"
    return (f"memory: active {size(u['active_memory_bytes'])}, buffer cache {size(u['cache_memory_bytes'])}, "
            f"peak {size(u['peak_memory_bytes'])}; {held}")


def size(n: int) -> str:
    """Bytes for people: GiB from 1 GiB up, MiB below."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
