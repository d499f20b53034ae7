"""Noticing MLX compile kernels for the first time on this machine.

On the CPU backend each fused kernel of a compiled graph is C++ built by the system compiler the
first time it is used (about half a second each), then kept on disk, under the temporary
directory, for every later run: a fresh machine's first reply can take many seconds. Front ends
say so instead of looking hung; the library only reports it, through a callback.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx

NOTICE = "compiling kernels, first run only"


def kernel_dir() -> Path:
    """Where MLX's CPU backend keeps the kernels it compiled (per MLX version)."""
    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "cpu"


def on_first_compile(say: Callable[[], None], every: float = 0.2) -> Optional[threading.Thread]:
    """Call `say()` once, from a daemon thread, as soon as MLX starts writing new kernels (none
    on a machine that has run this before, or on a GPU, whose kernels build in milliseconds).
    Returns the watching thread, or None where there is nothing to watch."""
    if mx.default_device() != mx.cpu:
        return None
    folder = kernel_dir()
    before = _stamp(folder)

    def watch():
        while _stamp(folder) == before:
            time.sleep(every)
        say()

    thread = threading.Thread(target=watch, name="mlx_mtp-jit-notice", daemon=True)
    thread.start()
    return thread


def _stamp(folder: Path) -> Optional[int]:
    """Changes whenever a file is added to `folder` (or the folder appears)."""
    try:
        return os.stat(folder).st_mtime_ns
    except OSError:
        return None
