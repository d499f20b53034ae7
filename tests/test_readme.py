"""The README's Python examples run as written, in a fresh interpreter with nothing warmed up."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python_blocks() -> list[str]:
    """The blocks of the "Python API" section (Serve's need a server: tests/test_server.py runs them)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_readme_python_examples_run_in_a_fresh_process():
    blocks = python_blocks()
    assert len(blocks) >= 2 and "mlx_mtp.load" in blocks[0]
    out = subprocess.run([sys.executable, "-c", "\n".join(blocks)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tok/s" in out.stdout and "['length', 'length', 'length', 'length']" in out.stdout
    assert "terminate called" not in out.stderr
    assert re.search(r"(length|stop) \d+ prompt tokens, the image's among them", out.stdout)  # the image example
