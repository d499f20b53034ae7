"""mlx_mtp: Gemma 4 with MTP speculative decoding on Apple MLX."""

import sys as _sys

from .runtime.mlx_build import require as _require_mlx

_require_mlx()  # before anything imports MLX: an install MLX cannot load is explained in one line

from .runtime import moved as _moved  # the modules' paths from before the layer packages, with a DeprecationWarning

_moved.install(_sys.modules[__name__])

from .decode import generate as generate_module
from .decode.batch import BatchGenerator
from .decode.generate import ContextLengthError, Result, generate, stream_generate
from .decode.grammar import Grammar
from .decode.processors import Penalties
from .decode.sample import SamplingParams
from .decode.stats import Stats
from .decode.text import TextEvent
from .engine.conversation import Conversation
from .engine.engine import Engine
from .engine.requests import MemoryLimitError, QueueFull, Request, RequestHandle
from .loading import Loaded, load

Event = TextEvent  # the name `stream_generate`'s events had before they were `TextEvent`s
__getattr__ = _moved.old_attribute  # an old module as an attribute after `import mlx_mtp`, as before

__version__ = "0.1.0"
__all__ = ["BatchGenerator", "Conversation", "Engine", "QueueFull", "MemoryLimitError", "Request",
           "RequestHandle", "ContextLengthError", "load", "Loaded", "generate", "stream_generate",
           "TextEvent", "Event", "Result", "SamplingParams", "Stats", "Grammar", "Penalties"]
