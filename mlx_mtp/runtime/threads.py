"""Running MLX on threads other than the main one.

MLX (0.32) keeps per-thread C++ state for every thread that evaluated arrays. When such a thread
ends, that state is torn down by the OS thread *after* Python's `Thread.join()` has returned;
if the process exits in that window it aborts ("terminate called without an active exception").
`mark_mlx_thread()` records the current thread, and an exit hook waits (bounded) until every
recorded thread has really gone; a worker still running then (an `Engine` nobody closed, such as
a `Conversation`'s own) is first stopped by the `stop` it gave.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Callable, Optional

_threads: dict[int, threading.Thread] = {}
_stops: dict[int, Callable[[], None]] = {}
_lock = threading.Lock()


def mark_mlx_thread(stop: Optional[Callable[[], None]] = None) -> None:
    """Note that the calling (non-main) thread evaluates MLX arrays; `stop()` (from any thread)
    makes it end and waits for it: called at exit if it still runs (until `unmark_stop`)."""
    if threading.current_thread() is threading.main_thread():
        return
    with _lock:
        if not _threads:
            atexit.register(_wait_for_threads)
        _threads[threading.get_native_id()] = threading.current_thread()
        if stop is not None:
            _stops[threading.get_native_id()] = stop


def unmark_stop() -> None:
    """The calling thread is ending by itself: forget its `stop` (and what that holds on to)."""
    with _lock:
        _stops.pop(threading.get_native_id(), None)


def _alive(native_id: int) -> bool:
    return os.path.exists(f"/proc/self/task/{native_id}")


def _wait_for_threads(timeout: float = 2.0) -> None:
    for native_id, stop in list(_stops.items()):
        if _threads[native_id].is_alive():
            try:
                stop()
            except Exception:  # exiting anyway: a worker that will not stop is not waited for below
                pass
    if not sys.platform.startswith("linux"):
        time.sleep(0.05)  # no /proc to ask: give ending threads a moment
        return
    # Threads still running Python code (a daemon worker never stopped) are not waited for.
    ending = [n for n, t in _threads.items() if not t.is_alive()]
    deadline = time.monotonic() + timeout
    while any(_alive(n) for n in ending) and time.monotonic() < deadline:
        time.sleep(0.001)
