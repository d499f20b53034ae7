"""Compiled MLX functions: bounded in memory, and noticed when their kernels are first built.

MLX keeps a trace of a compiled function for every set of argument shapes and constants it meets,
about 2 KB per graph node, for as long as the function lives: `Bounded` drops them all past a
number of signatures. On the CPU backend each fused kernel of a compiled graph is C++ built by the
system compiler the first time it is used (about half a second each), on the CUDA backend by NVRTC,
then kept on disk, under the temporary directory, for every later run: a fresh machine's first
reply can take many seconds; so can a later run's, where it meets new shapes.
Front ends say so instead of looking hung, and only while this process is building kernels (on
the CPU backend: while the system compiler runs as its child, not when another process fills the
shared folder); the library only reports it, through a callback.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx

NOTICE = "compiling kernels (kept on disk for later runs)"


class Traces:
    """How many new traces compiled functions (`Bounded`) made: each is a graph built and optimised
    again, and on the CPU and CUDA backends, for a new kernel, a compile. A run that was warmed up
    for its shapes makes none (`counting`)."""

    def __init__(self):
        self.count = 0
        self.signatures: list = []  # (function name, signature) of each, for saying which

    def __repr__(self) -> str:
        return f"Traces({self.count})"


_counters: list = []  # the open `counting` blocks
_lock = threading.Lock()


@contextmanager
def counting() -> Iterator[Traces]:
    """Count the new traces compiled functions make within the block (every thread's)."""
    traces = Traces()
    with _lock:
        _counters.append(traces)
    try:
        yield traces
    finally:
        with _lock:
            _counters.remove(traces)


def _traced(name: str, key) -> None:
    with _lock:
        for traces in _counters:
            traces.count += 1
            traces.signatures.append((name, key))


class Bounded:
    """`mx.compile(fn)`, traced again (all earlier traces freed) once it has met `limit` argument
    signatures: shapes and dtypes of its arrays, values of its constants (the first `skip`
    arguments left out: a module's weights, which keep their shapes). For functions whose shapes
    keep changing over a long run (a KV cache's size, a batch's rows, sampling parameters)."""

    def __init__(self, fn: Callable, limit: int = 48, skip: int = 0):
        self.fn, self.limit, self.skip = fn, limit, skip
        self.compiled, self.seen = mx.compile(fn), set()

    def __call__(self, *args):
        key = signature(args[self.skip :])
        if key not in self.seen:
            if _counters:
                _traced(getattr(self.fn, "__qualname__", "?"), key)
            if len(self.seen) >= self.limit:
                self.compiled, self.seen = None, set()  # the old traces go with the old function
                self.compiled = mx.compile(self.fn)
            self.seen.add(key)
        return self.compiled(*args)


def small(fn: Callable) -> Bounded:
    """`Bounded` for a function of a few ops (masks, bookkeeping), whose traces cost little to keep:
    room for every batch size, draft length and buffer size a long run meets."""
    return Bounded(fn, limit=512)


def signature(tree: Any) -> Any:
    """A hashable summary of a compile argument tree: what MLX keys its traces on."""
    if isinstance(tree, mx.array):
        return tree.shape, tree.dtype
    if isinstance(tree, (tuple, list)):
        return tuple(signature(t) for t in tree)
    if isinstance(tree, dict):
        return tuple((k, signature(v)) for k, v in tree.items())
    return tree


def kernel_dir() -> Optional[Path]:
    """Where MLX keeps the kernels it compiled (per MLX version): C++ built by the system compiler
    on the CPU backend, PTX built by NVRTC on the CUDA backend. None on Metal, whose kernels
    build in milliseconds."""
    built = Path(tempfile.gettempdir()) / "mlx" / mx.__version__
    if mx.default_device() == mx.cpu:
        return built / "cpu"
    if mx.cuda.is_available():
        return Path(os.environ.get("MLX_PTX_CACHE_DIR") or built / "ptx")
    return None


def on_first_compile(say: Callable[[], None], every: float = 0.1) -> Optional[threading.Thread]:
    """Call `say()` once, from a daemon thread, as soon as this process starts building a kernel
    (never where every kernel it uses was built before, or on Metal). Returns the watching
    thread, or None where there is nothing to watch."""
    folder = kernel_dir()
    if folder is None:
        return None
    started = Compiles(folder)

    def watch():
        while not started.now():
            time.sleep(every)
        say()

    thread = threading.Thread(target=watch, name="mlx_mtp-jit-notice", daemon=True)
    thread.start()
    return thread


def count(folder: Optional[Path]) -> int:
    """Kernels MLX keeps in `folder` (one file of machine code each, beside their sources)."""
    try:
        return sum(1 for f in os.scandir(folder) if f.name.endswith((".ptx", ".so", ".cubin")))
    except (OSError, TypeError):
        return 0


def watch_compiles(say: Callable[[int], None], every: float = 10.0, poll: float = 0.1) -> Callable[[], None]:
    """Call `say(n)` from a daemon thread, at most every `every` seconds, while this process is
    building kernels (n: the kernels the folder gained this run so far); returns the function
    that stops it."""
    folder, stop = kernel_dir(), threading.Event()
    if folder is None:  # Metal: kernels build in milliseconds
        return stop.set
    start, compiles = count(folder), Compiles(folder)

    def watch():
        busy, last = False, time.monotonic()
        while not stop.wait(poll):
            busy = busy or compiles.now()
            if busy and time.monotonic() - last >= every:
                say(max(count(folder) - start, 1))
                busy, last = False, time.monotonic()

    threading.Thread(target=watch, name="mlx_mtp-jit-count", daemon=True).start()
    return stop.set


class KernelCache:
    """MLX's compiled-kernel cache for a run: kept in `folder` when given (MLX_PTX_CACHE_DIR, read by
    MLX at its first compile, so set before anything runs), and what the run found there and added."""

    def __init__(self, folder: Optional[Path]):
        self.folder = folder
        self.found = count(folder)

    @classmethod
    def open(cls, folder: Optional[str]) -> "KernelCache":
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            os.environ["MLX_PTX_CACHE_DIR"] = str(Path(folder).resolve())
        return cls(kernel_dir())

    def report(self) -> dict:
        return dict(folder=None if self.folder is None else str(self.folder), found=self.found,
                    compiled=count(self.folder) - self.found)


class Compiles:
    """Whether this process is building kernels into `folder` now. On the CPU backend MLX runs the
    system compiler as a child process whose command names the folder: looked for among this
    process's children (Linux's /proc; elsewhere, and for NVRTC, which compiles in-process, the
    folder gaining files stands in, though another process may be what fills it)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.stamp = _stamp(folder)
        self.children = Path("/proc/self/task").is_dir() and mx.default_device() == mx.cpu

    def now(self) -> bool:
        if self.children:
            return any(str(self.folder) in _command(pid) for pid in _children())
        stamp = _stamp(self.folder)
        changed, self.stamp = stamp != self.stamp, stamp
        return changed


def _children() -> list[str]:
    """The process ids of this process's children (every thread's), on Linux."""
    found: list[str] = []
    for task in Path("/proc/self/task").iterdir():
        try:
            found += (task / "children").read_text().split()
        except OSError:
            pass
    return found


def _command(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _stamp(folder: Path) -> Optional[int]:
    """Changes whenever a file is added to `folder` (or the folder appears)."""
    try:
        return os.stat(folder).st_mtime_ns
    except OSError:
        return None
