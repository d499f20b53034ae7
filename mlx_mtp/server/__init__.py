"""A local OpenAI-, Anthropic- and Ollama-compatible server for Gemma 4 with MTP: `python -m
mlx_mtp.server` (or `mlx-mtp-server`). Starlette on uvicorn in front of a pool of Engines, one per
loaded model of the store (README: "Serve", "Many models, one server"); an app may put it in
front of one `Engine` of its own:

    from mlx_mtp.server import Settings, create_app, served_model
    app = create_app(engine, Settings(served_model(loaded, "my-model")))   # any ASGI server runs it
"""

from .app import Settings, create_app, served_model
from .cli import main

__all__ = ["Settings", "create_app", "served_model", "main"]
