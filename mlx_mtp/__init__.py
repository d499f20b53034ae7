"""mlx_mtp: Gemma 4 with MTP speculative decoding on Apple MLX."""

from .generate import Event, Result, generate, stream_generate
from .loading import Loaded, load
from .sample import SamplingParams
from .stats import Stats

__version__ = "0.1.0"
__all__ = ["load", "Loaded", "generate", "stream_generate", "Event", "Result", "SamplingParams", "Stats"]
