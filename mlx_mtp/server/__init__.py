"""A local OpenAI-compatible server for Gemma 4 with MTP: `python -m mlx_mtp.server` (or
`mlx-mtp-server`). Starlette on uvicorn in front of one `Engine`; see the README's "Serve".

    from mlx_mtp.server import Settings, create_app, served_model
    app = create_app(engine, Settings(served_model(loaded, "my-model")))   # any ASGI server runs it
"""

from .app import Settings, create_app, served_model
from .cli import main

__all__ = ["Settings", "create_app", "served_model", "main"]
