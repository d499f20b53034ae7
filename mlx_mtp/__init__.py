"""mlx_mtp: Gemma 4 with MTP speculative decoding on Apple MLX."""

from .runtime.mlx_build import require as _require_mlx

_require_mlx()  # before anything imports MLX: an install MLX cannot load is explained in one line

from .decode import generate as generate_module
from .decode.batch import BatchGenerator
from .engine.conversation import Conversation
from .engine.engine import Engine
from .decode.generate import ContextLengthError, Result, generate, stream_generate
from .decode.grammar import Grammar
from .loading import Loaded, load
from .decode.processors import Penalties
from .engine.requests import MemoryLimitError, QueueFull, Request, RequestHandle
from .decode.sample import SamplingParams
from .decode.stats import Stats
from .decode.text import TextEvent

Event = TextEvent  # the name `stream_generate`'s events had before they were `TextEvent`s

__version__ = "0.1.0"
__all__ = ["BatchGenerator", "Conversation", "Engine", "QueueFull", "MemoryLimitError", "Request",
           "RequestHandle", "ContextLengthError", "load", "Loaded", "generate", "stream_generate",
           "TextEvent", "Event", "Result", "SamplingParams", "Stats", "Grammar", "Penalties"]
