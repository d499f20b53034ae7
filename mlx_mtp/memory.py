"""Memory on the device: wired buffers, MLX's buffer cache, and the defaults the Engine starts from.

On a Mac the GPU shares the system's memory, and macOS may page out any buffer that is not
wired: a model of many GiB that gets paged decodes at disk speed. So, as mlx-lm does, the model's
buffers are wired (up to Metal's recommended working set) while it generates. MLX also keeps
freed buffers for reuse, without bound unless limited. Both are process-wide settings:
`generating()` sets them on a GPU for as long as generation runs and restores them after; on
the CPU it leaves them alone (wiring is a Metal notion).

The defaults follow `mx.device_info()`. Of the memory the device should use (the recommended
working set on a GPU, the physical memory on the CPU), what the weights leave is split: half for
the KV cache of the running batch (the Engine's `memory_limit`), a quarter for the prefix cache,
an eighth for MLX's buffer cache, and the rest for activations.
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
TIGHT = 0.9  # a model above this share of the working set leaves too little for the rest


@dataclasses.dataclass(frozen=True)
class Device:
    """What MLX reports about the default device."""

    name: str
    gpu: bool
    memory: int  # bytes: unified memory on a Mac, physical memory on the CPU
    working_set: Optional[int] = None  # Metal's recommended working set; None on the CPU

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
    def budget(self) -> int:
        """Bytes MLX should stay within on this device."""
        return self.working_set or self.memory


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

    def describe(self) -> str:
        """One line for start-up logs."""
        d = self.device
        limits = "wired and buffer cache limits left alone (CPU)"
        if self.wired_limit is not None:
            limits = (f"wired limit {gib(self.wired_limit)}, buffer cache limit {gib(self.cache_limit)} "
                      "while generating")
        working_set = f", working set {gib(d.working_set)}" if d.working_set else ""
        line = (f"memory: {d.name}, {gib(d.memory)}{working_set}; weights {gib(self.model_bytes)}; "
                f"KV cache limit {gib(self.kv_limit)}, prefix cache {gib(self.prefix_cache)}; {limits}")
        if self.tight:
            line += f"; warning: the weights take over {TIGHT:.0%} of {gib(d.budget)}, expect paging"
        return line


def plan(*models, device: Optional[Device] = None) -> MemoryPlan:
    """The memory plan for `models` (target, drafter; None is skipped) on `device` (default: now)."""
    device = device or Device.current()
    weights = sum(nbytes(m) for m in models if m is not None)
    # At least an eighth of the budget, so a model that fills the device runs (slowly) rather
    # than refusing every request.
    room = max(device.budget - weights, device.budget // 8)
    gpu = device.gpu and device.working_set is not None
    return MemoryPlan(device, weights, kv_limit=room // 2, prefix_cache=room // 4,
                      wired_limit=device.working_set if gpu else None, cache_limit=room // 8 if gpu else None)


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


@contextlib.contextmanager
def generating(*models) -> Iterator[None]:
    """Wire the models' buffers and bound MLX's buffer cache while the block generates; restore
    both after it, once every buffer it queued is done. Nested and concurrent blocks share one
    setting: the first applies it and the last restores it. On the CPU nothing is touched."""
    if not _enter(models):
        yield
        return
    try:
        yield
    finally:
        _leave()


def _enter(models) -> bool:
    global _depth, _active, _saved
    with _lock:
        if _depth == 0:
            p = plan(*models)
            if p.wired_limit is None:
                return False
            if p.tight:
                log.warning("%s", p.describe())
            _saved = (_set_wired_limit(p.wired_limit), mx.set_cache_limit(p.cache_limit))
            _active = p
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
        log.warning("could not wire %s for the model, generating unwired: %s", gib(limit), e)
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
    held = f"wired limit {gib(wired)}" if wired is not None else "nothing wired"
    return (f"memory: active {mib(u['active_memory_bytes'])}, buffer cache {mib(u['cache_memory_bytes'])}, "
            f"peak {mib(u['peak_memory_bytes'])}; {held}")


def gib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / GiB:.1f} GiB"


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
