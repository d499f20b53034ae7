"""Every command line the READMEs show (in their code blocks) still parses: each is run through its
entry point's own argparse, in this process, and stopped once its arguments are parsed, so a
documented flag the CLI no longer takes, or a value it refuses, fails here (issue 43)."""

import argparse
import contextlib
import io
import re
import runpy
import shlex
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]  # mlx-mtp-x -> "module:main"
OURS = ("mlx_mtp", "apps", "convert")  # `python -m pytest` and the like are not ours to check


def commands(readme: str) -> list[str]:
    """The `python -m ...` and `mlx-mtp-*` command lines of a README's shell code blocks, and its
    inline ones with arguments (`python -m apps.bench realsize --shape e2b`), synopses made concrete:
    `[...]` optional parts kept, `a|b` alternatives their first, `...` and comments dropped."""
    text = (ROOT / readme).read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.S).replace("\n", " ")
    out = [concrete(span.replace("\\|", "|")) for span in re.findall(r"`((?:python -m |mlx-mtp-)[^`]*)`", prose)]
    out = [line for line in out if len(line.split()) > (3 if line.startswith("python") else 1) and ours(line)]
    for block in blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0]
            found = re.search(r"(?:^|\s)(python -m [\w.]+|mlx-mtp-[\w-]+)(\s.*|$)", line)
            if found is None or not ours(found[1]):
                continue
            rest = re.split(r"\)|&&|;", found[2])[0] if "$(" in line else found[2].split("&&")[0]
            out.append(concrete(found[1] + rest))
    return out


def ours(line: str) -> bool:
    words = line.split()
    return words[0] in SCRIPTS or (words[0] == "python" and words[2].startswith(OURS))


def blocks(text: str) -> list[str]:
    """The code blocks of a Markdown text, but Python's."""
    found, current, lang = [], None, None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current, lang = [], line[3:].strip()
            else:
                found += [] if lang == "python" else ["\n".join(current)]
                current = None
        elif current is not None:
            current.append(line)
    return found


def concrete(line: str) -> str:
    line = re.sub(r"(?<=\S)\[[^\]]*\]", "", line)  # 300-600[,30-60]: 300-600
    line = re.sub(r"\[([^\]]*?) \| [^\]]*\]", r"\1", line)  # [a | b]: a
    line = line.replace("[", " ").replace("]", " ").replace("...", " ")
    return " ".join(w.split("|")[0] if "|" in w and not w.startswith(("'", '"')) else w for w in line.split())


class Parsed(BaseException):
    """Raised once an entry point's arguments are parsed: nothing after that runs."""


def parse(line: str) -> None:
    """Run the command's entry point until argparse has parsed its arguments (SystemExit(2) where
    argparse refuses them)."""
    words = shlex.split(line)
    if words[0] == "python":
        module, argv = words[2], words[3:]
    else:
        module, argv = SCRIPTS[words[0]].split(":")[0], words[1:]
    real = argparse.ArgumentParser.parse_args

    def stop(self, args=None, namespace=None):
        real(self, args, namespace)
        raise Parsed

    old_argv, sys.argv = sys.argv, [module, *argv]
    argparse.ArgumentParser.parse_args = stop
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                if words[0] == "python":
                    with warnings.catch_warnings():  # a module an earlier command imported runs again as __main__
                        warnings.simplefilter("ignore", RuntimeWarning)
                        runpy.run_module(module, run_name="__main__", alter_sys=False)
                else:
                    __import__(module, fromlist=["main"]).main()
            except Parsed:
                return
            except SystemExit as e:
                if e.code == 0 and "--help" in argv:
                    return
                raise AssertionError(f"{line!r}: exit {e.code}: {err.getvalue().strip()[-300:]}") from None
            except Exception as e:  # before its arguments were parsed
                raise AssertionError(f"{line!r}: {type(e).__name__}: {e}") from None
        raise AssertionError(f"{line!r} ran without parsing arguments with argparse")
    finally:
        argparse.ArgumentParser.parse_args, sys.argv = real, old_argv


@pytest.mark.parametrize("readme", ["README.md", "apps/README.md"])
def test_every_readme_command_parses(readme):
    lines = commands(readme)
    assert len(lines) >= (30 if readme == "README.md" else 50), len(lines)  # the extraction still finds them
    failed = []
    for line in lines:
        try:
            parse(line)
        except AssertionError as e:
            failed.append(str(e))
    assert not failed, "\n".join(failed)


def test_a_stale_command_fails():
    """The check can fail: a flag the CLI does not take, a value it refuses."""
    with pytest.raises(AssertionError, match="unrecognized arguments: --frobnicate"):
        parse("mlx-mtp-server --frobnicate 3")
    with pytest.raises(AssertionError, match="invalid choice: 'streaming'"):
        parse("python -m apps.bench speed --regime streaming")
    assert concrete("python -m x [--pair a|b | --model DIR] [--k 1,2[,...]] ...") == "python -m x --pair a --k 1,2"


def parser_of(line: str) -> argparse.ArgumentParser:
    """The parser a command line's entry point builds."""
    found = []
    real = argparse.ArgumentParser.parse_args

    def keep(self, args=None, namespace=None):
        found.append(self)
        return real(self, args, namespace)

    argparse.ArgumentParser.parse_args = keep
    try:
        parse(line)
    finally:
        argparse.ArgumentParser.parse_args = real
    return found[0]


@pytest.mark.parametrize("line", ["mlx-mtp-server", "mlx-mtp-chat"])
def test_every_option_says_what_it_does_and_its_default(line):
    options = [a for a in parser_of(line)._actions if a.option_strings and a.help != argparse.SUPPRESS
               and not isinstance(a, argparse._HelpAction)]
    assert len(options) > 10
    missing = [a.option_strings[-1] for a in options if not a.help or "default" not in a.help]
    assert not missing, missing


def test_the_server_names_its_draft_policy_prompt_cache_and_capture_as_it_starts():
    from mlx_mtp.server.cli import parse_args, start_lines

    plain = start_lines("m", parse_args([]), 2048, True, 2**30)
    assert plain == ["serving 'm' at http://127.0.0.1:8000/v1 (MTP on, draft tokens auto (chosen by measured cost "
                     "and acceptance); context 2048 tokens)", "prompt cache: 1.0 GiB in memory"]
    args = parse_args(["--draft-tokens", "3", "--prompt-cache-dir", "/c", "--learn-dir", "/l", "--learn-gb", "2",
                       "--learn-every", "50", "--port", "9"])
    lines = start_lines("m", args, 2048, True, 0)
    assert lines[0] == "serving 'm' at http://127.0.0.1:9/v1 (MTP on, draft tokens 3; context 2048 tokens)"
    assert lines[1] == "prompt cache: off in memory, 16 GiB on disk in /c"
    assert lines[2].startswith("keeping each finished request's token ids in /l (within 2 GiB, oldest out first")
    assert lines[2].endswith("the drafter adapts every 50 new requests while idle")
    assert "MTP off" in start_lines("m", parse_args([]), 2048, False, 0)[0]
