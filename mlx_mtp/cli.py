"""What the command-line entry points share: usage names, argument types, the bundled demo pair
as the default model, and one-line errors."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Union

from .decode.speculative import K_MAX


def prog_name(module: str) -> str:
    """The program name as the user invoked it, for usage lines: the console script's name
    (`mlx-mtp-chat`), or `python -m MODULE` when run as a module (argv[0] is then a .py file)."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return name if name and not name.endswith(".py") else f"python -m {module}"


def draft_tokens(text: str) -> Union[int, str]:
    """--draft-tokens: "auto" or 0..K_MAX (the one draft-length limit, `speculative.K_MAX`)."""
    if text == "auto":
        return text
    if _integer(text) in range(K_MAX + 1):
        return int(text)
    raise argparse.ArgumentTypeError(f"must be 0-{K_MAX} (the longest draft) or auto, not {text!r}")


def positive_int(text: str) -> int:
    if (_integer(text) or 0) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"must be a positive number of tokens, not {text!r}")


def _integer(text: str) -> Optional[int]:
    try:
        return int(text)
    except ValueError:
        return None


def readable(text: Optional[str]) -> Optional[str]:
    """Command-line text with undecodable bytes (which Python keeps as surrogate escapes, and
    tokenizers reject) replaced by U+FFFD."""
    return None if text is None else os.fsencode(text).decode(sys.getfilesystemencoding(), "replace")


def demo_pair() -> tuple[Path, Optional[Path]]:
    """The bundled demo pair's (target, drafter) directories, the model of a run without --model."""
    try:
        import mlx_mtp.demo as demo  # through sys.modules: an install may leave the package out
    except ImportError:
        demo = None
    pair = demo.pair() if demo is not None else None
    if pair is None:
        raise FileNotFoundError("no --model given and the bundled demo pair (mlx_mtp/demo) is not installed; "
                                "pass --model DIR (and --drafter DIR)")
    return pair


def error_line(error: BaseException) -> str:
    """An error as one line for the terminal (bad path, wrong pair, unreadable checkpoint): no traceback."""
    return f"error: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
