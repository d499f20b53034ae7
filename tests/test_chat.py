"""`python -m mlx_mtp.chat` driven through pipes, as a script or CI would."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from chat_helpers import DRAFTER, TINY, make_chat_model, make_vision_chat_model

import mlx_mtp
from mlx_mtp import chat
from mlx_mtp.engine.conversation import Conversation

ROOT = Path(mlx_mtp.__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("cli") / "model")


def run_chat(*args, stdin=""):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONIOENCODING": "utf-8"}
    return subprocess.run(
        [sys.executable, "-m", "mlx_mtp.chat", *map(str, args)], input=stdin, capture_output=True,
        text=True, encoding="utf-8", env=env, timeout=120,
    )


@pytest.fixture(scope="module")
def loaded(model_dir):
    return mlx_mtp.load(model_dir)


def expected_replies(loaded, messages, max_tokens):
    conv = Conversation(loaded, system="be kind")
    return ["".join(e.text for e in conv.reply(m, max_tokens=max_tokens)) for m in messages]


def stat_lines(stderr: str) -> list:
    """The replies' stat lines ("[N tokens: ..."), not the other notes in brackets (a stop, auto's choice)."""
    return [line for line in stderr.splitlines() if re.match(r"\[\d+ tokens", line)]


def test_one_prompt_prints_the_reply_and_a_stat_line(model_dir, loaded):
    out = run_chat("--model", model_dir, "--drafter", DRAFTER, "--system", "be kind", "--prompt", "hello",
                   "--max-tokens", 20, "--draft-tokens", 2)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected_replies(loaded, ["hello"], 20)[0] + "\n"
    stat = out.stderr.strip().splitlines()[-1]
    assert "tok/s" in stat and "first token" in stat and "acceptance length" in stat


def test_a_scripted_session_over_stdin(model_dir, loaded):
    script = "hello\n/stats\n/help\nmore please\n/reset\nhello\n"
    out = run_chat("--model", model_dir, "--drafter", DRAFTER, "--system", "be kind", "--max-tokens", 16,
                   stdin=script)
    assert out.returncode == 0, out.stderr
    first, second = expected_replies(loaded, ["hello", "more please"], 16)
    assert "> " not in out.stdout  # no prompts without a terminal
    assert out.stdout.startswith(first + "\n" + "last reply:")
    assert "KV cache:" in out.stdout and "/reset" in out.stdout  # /stats, /help
    assert "\nmemory: active " in out.stdout and "peak " in out.stdout  # /stats: MLX's memory
    assert sum(line.startswith("memory: ") for line in out.stderr.splitlines()) == 1  # the defaults, at start
    assert f"\n{second}\n(new conversation)\n{first}\n" in out.stdout  # /reset starts over
    assert len(stat_lines(out.stderr)) == 3


def test_bad_model_or_drafter_exits_2_with_one_line(model_dir, capsys, monkeypatch):
    out = run_chat("--model", model_dir / "missing", "--prompt", "x")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error:") and "missing" in out.stderr
    assert chat.main(["--model", str(model_dir), "--drafter", str(TINY.parent / "e2b" / "drafter"),
                      "--prompt", "x"]) == 2
    assert capsys.readouterr().err.startswith("error: drafter does not match")
    monkeypatch.setitem(sys.modules, "mlx_mtp.demo", None)  # the demo pair not installed
    assert chat.main(["--prompt", "x"]) == 2
    assert "--model" in capsys.readouterr().err


def test_ctrl_c_during_a_reply_keeps_the_turn_and_the_cache():
    """The demo pair writes long replies (run on where they loop): interrupt one after a few characters."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONIOENCODING": "utf-8"}
    command = [sys.executable, "-m", "mlx_mtp.chat", "--max-tokens", "400", "--no-stop-at-repeat"]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out = []
    reader = threading.Thread(target=lambda: out.extend(iter(lambda: proc.stdout.read(1), "")), daemon=True)
    reader.start()
    proc.stdin.write("Write a class for a binary tree.\n")
    proc.stdin.flush()
    deadline = time.monotonic() + 120
    while len(out) < 20 and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    proc.stdin.write("/stats\nhello\n/stats\n")
    proc.stdin.close()
    proc.wait(timeout=180)
    reader.join(10)
    text, stderr = "".join(out), proc.stderr.read()
    assert proc.returncode == 0, stderr
    first, second = [line for line in text.splitlines() if line.startswith("KV cache:")]
    assert first != "KV cache: empty" and int(first.split()[2]) > 20  # prompt + the partial reply
    fed = [int(line.split()[1]) for line in text.splitlines() if line.startswith("prompt:")]
    assert fed[-1] < int(second.split()[2]) // 2  # turn 2 fed its message, not the conversation
    replies = stat_lines(stderr)
    assert len(replies) == 2 and int(replies[0][1:].split()[0]) < 400  # the first reply was cut short


def test_a_request_that_fails_says_why_in_one_line_and_the_chat_goes_on(tmp_path, monkeypatch, capsys):
    """An image that was there at `/image` and gone when its message is sent: the turn fails with
    one `error:` line on stderr, and the conversation goes on (the next message is answered, with
    the same reply as a fresh chat's)."""
    from PIL import Image

    model = make_vision_chat_model(tmp_path / "vision")
    picture = tmp_path / "a.png"
    Image.new("RGB", (40, 30), "red").save(picture)
    typed = iter([f"/image {picture}", "what is it?", "hello"])

    def type_line(prompt=""):
        line = next(typed, None)
        if line is None:
            raise EOFError
        if line == "what is it?":
            picture.unlink()  # moved away after /image took it
        return line

    monkeypatch.setattr("builtins.input", type_line)
    monkeypatch.setattr(sys, "stdin", open(os.devnull))
    assert chat.main(["--model", str(model), "--max-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: no image file at {picture}"], err
    assert "Traceback" not in err and len(stat_lines(err)) == 1  # "hello" was answered
    reply = "".join(e.text for e in Conversation(mlx_mtp.load(model)).reply("hello", max_tokens=5))
    assert out.endswith(reply + "\n")
