"""What the command-line entry points share."""

from __future__ import annotations

import sys
from pathlib import Path


def prog_name(module: str) -> str:
    """The program name as the user invoked it, for usage lines: the console script's name
    (`mlx-mtp-chat`), or `python -m MODULE` when run as a module (argv[0] is then a .py file)."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return name if name and not name.endswith(".py") else f"python -m {module}"
