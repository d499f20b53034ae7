"""Serving behind the `Engine`: the facade (engine.py), the one worker thread that calls MLX
(worker.py), what callers submit and read back (requests.py), how a request is prepared
(prepare.py), admitted (admission.py) and streamed (output.py), the conversations it keeps, and a
pool of engines, one per loaded model of a store (pool.py)."""

from .engine import (DoneEvent, Engine, ErrorEvent, MemoryLimitError, QueueFull, Request, RequestEvent,
                     RequestHandle, TokenEvent)
