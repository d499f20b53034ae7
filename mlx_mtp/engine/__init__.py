"""Serving behind the `Engine`: the facade (engine.py), the one worker thread that calls MLX
(worker.py), what callers submit and read back (requests.py), how a request is prepared
(prepare.py), admitted (admission.py) and streamed (output.py), and the conversations it keeps."""

from .engine import (DoneEvent, Engine, ErrorEvent, MemoryLimitError, QueueFull, Request, RequestEvent,
                     RequestHandle, TokenEvent)
