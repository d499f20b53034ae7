"""Every tool's `--help`, run as a user runs it: each option says what it does and its default
(issue 49: the apps, the converter and apps/hf_compat.py printed bare option names, or nothing)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ["-m apps.serve_load", "-m apps.demo_pair.eval_raw", "-m apps.demo_pair.eval_acceptance",
         "-m convert", "apps/hf_compat.py"]
ENTRY = re.compile(r"  (-[\w-]+)(?:,? \S+)*(?:\s{2,}(.*))?$")  # `  -q, --quantize   help...`


def option_helps(usage: str) -> dict:
    """{an option's first name: its help text} of the `options:` section of argparse's --help."""
    section = usage.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]
    found, current = {}, None
    for line in section.splitlines():
        entry = ENTRY.match(line)
        if entry:
            current = entry[1]
            found[current] = entry[2] or ""
        elif current is not None:  # the help's next lines, indented under it
            found[current] += " " + line.strip()
    return {name: text.strip() for name, text in found.items()}


@pytest.mark.parametrize("tool", TOOLS)
def test_every_option_says_what_it_does_and_its_default(tool):
    out = subprocess.run([sys.executable, *tool.split(), "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: "), out.stderr[-2000:]
    helps = option_helps(out.stdout)
    assert len(helps) >= 2, out.stdout  # -h and the tool's own
    missing = [name for name, text in helps.items() if name != "-h" and "default" not in text]
    assert not missing, out.stdout


def test_an_option_without_a_description_is_found():
    usage = ("usage: x [-h] [--clients CLIENTS] [-q]\n\noptions:\n"
             "  -h, --help         show this help message and exit\n"
             "  --clients CLIENTS\n"
             "  -q, --quiet        no progress bar\n"
             "                     (default: off)\n")
    assert option_helps(usage) == {"-h": "show this help message and exit", "--clients": "",
                                   "-q": "no progress bar (default: off)"}
