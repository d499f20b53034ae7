"""mlx_mtp: Gemma 4 with MTP speculative decoding on Apple MLX."""

from .mlx_build import require as _require_mlx

_require_mlx()  # before anything imports MLX: an install MLX cannot load is explained in one line

from . import generate as generate_module
from .batch import BatchGenerator
from .conversation import Conversation
from .engine import Engine
from .generate import ContextLengthError, Result, generate, stream_generate
from .grammar import Grammar
from .loading import Loaded, load
from .processors import Penalties
from .requests import MemoryLimitError, QueueFull, Request, RequestHandle
from .sample import SamplingParams
from .stats import Stats
from .text import TextEvent

Event = TextEvent  # the name `stream_generate`'s events had before they were `TextEvent`s

__version__ = "0.1.0"
__all__ = ["BatchGenerator", "Conversation", "Engine", "QueueFull", "MemoryLimitError", "Request",
           "RequestHandle", "ContextLengthError", "load", "Loaded", "generate", "stream_generate",
           "TextEvent", "Event", "Result", "SamplingParams", "Stats", "Grammar", "Penalties"]
