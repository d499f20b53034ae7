"""The chat's edges, driven as a user would: undecodable input, argument limits, --raw, quit and
Ctrl-C at the prompt, replies cut by the context limit, the stat line, usage names."""

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.nn as nn
import pytest
from chat_helpers import DRAFTER, make_chat_model

import mlx_mtp
from mlx_mtp import chat
from mlx_mtp.engine.conversation import Conversation
from mlx_mtp.decode.stats import Stats

ROOT = Path(mlx_mtp.__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONIOENCODING": "utf-8"}


def run_chat(*args, stdin=b"", env=None):
    """(rc, stdout, stderr) of `python -m mlx_mtp.chat ARGS`; args may be bytes (raw argv)."""
    args = [a if isinstance(a, bytes) else str(a) for a in args]
    out = subprocess.run([sys.executable, "-m", "mlx_mtp.chat", *args], input=stdin, capture_output=True,
                         env={**ENV, **(env or {})}, timeout=120)
    return out.returncode, out.stdout.decode("utf-8"), out.stderr.decode("utf-8")


def edit_config(path: Path, **changes) -> None:
    file = path / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A chat model, the same without a chat template, and one with a 48-token context."""
    root = tmp_path_factory.mktemp("chat-cli")
    chat_dir, plain, short = (make_chat_model(root / name) for name in ("chat", "plain", "short"))
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    edit_config(short, max_position_embeddings=48)
    return chat_dir, plain, short


@pytest.fixture(scope="module")
def loaded(models):
    return mlx_mtp.load(models[0])


def replies(loaded, messages, max_tokens):
    conv = Conversation(loaded)
    return ["".join(e.text for e in conv.reply(m, max_tokens=max_tokens)) for m in messages]


def stat_counts(line: str) -> tuple[int, int, int]:
    """(tokens, from MTP rounds, from plain steps) of a stat line."""
    total = int(re.search(r"\[(\d+) tokens", line)[1])
    rounds, plain = re.search(r"(\d+) from \d+ MTP rounds?", line), re.search(r"(\d+) from plain steps", line)
    return total, int(rounds[1]) if rounds else 0, int(plain[1]) if plain else 0


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])
def test_undecodable_stdin_is_replaced_and_the_session_goes_on(models, loaded, errors):
    rc, out, err = run_chat("--model", models[0], "--max-tokens", 12, stdin=b"def f():\xff\xfe\nhello\n",
                            env={"PYTHONIOENCODING": f"utf-8:{errors}"})
    assert rc == 0 and "Traceback" not in err, err
    first, second = replies(loaded, ["def f():\ufffd\ufffd", "hello"], 12)
    assert out == f"{first}\n{second}\n"


def test_undecodable_prompt_argument_is_replaced(models, loaded):
    args = ["--model", models[0], "--drafter", DRAFTER, "--max-tokens", 12]
    rc, out, err = run_chat(*args, "--prompt", b"a\xff")
    assert rc == 0 and "Traceback" not in err, err
    assert out == replies(loaded, ["a\ufffd"], 12)[0] + "\n"
    assert "reply cut" not in err  # ended by --max-tokens, not the context
    total, from_rounds, from_plain = stat_counts([line for line in err.splitlines() if " tokens: " in line][-1])
    assert total == 1 + from_rounds + from_plain  # the first token comes from the prefill


def test_quit_alone_ends_and_draft_tokens_0_is_mtp_off(models, loaded):
    args = ["--model", models[0], "--drafter", DRAFTER, "--draft-tokens", 0, "--max-tokens", 8]
    rc, out, err = run_chat(*args, stdin=b"hello\n  quit \nhello\n")
    assert rc == 0, err
    assert "MTP off" in err.splitlines()[0]
    assert out == replies(loaded, ["hello"], 8)[0] + "\n"  # nothing after quit
    assert sum("tok/s" in line for line in err.splitlines()) == 1


def test_raw_completes_plain_text_without_a_chat_template(models, capsys):
    plain = models[1]
    expected = "".join(e.text for e in mlx_mtp.stream_generate(mlx_mtp.load(plain), "def f(", max_tokens=12))
    rc, out, err = run_chat("--model", plain, "--raw", "--max-tokens", 12, "--prompt", "def f(")
    assert rc == 0 and out == expected + "\n", err
    rc, out, err = run_chat("--model", plain, "--raw", "--max-tokens", 12, stdin=b"def f(\nexit\nx = 1\n")
    assert rc == 0 and out == expected + "\n", err  # exit, too, ends the session
    assert chat.main(["--model", str(plain), "--prompt", "x"]) == 2
    assert "no chat template; --raw" in capsys.readouterr().err


def test_a_reply_cut_by_the_context_limit_says_so(models):
    rc, out, err = run_chat("--model", models[2], "--max-tokens", 200, "--prompt", "hello")
    assert rc == 0, err
    assert "[reply cut at the model's context of 48 tokens; /reset to start over]" in err


BAD_NUMBERS = [("--max-tokens", "0"), ("--max-tokens", "-5"),
               ("--draft-tokens", "100"), ("--draft-tokens", "7"), ("--draft-tokens", "-1")]


@pytest.mark.parametrize("flag, value", BAD_NUMBERS)
def test_bad_numbers_are_refused_at_parsing(flag, value, capsys):
    with pytest.raises(SystemExit) as exit:
        chat.parse_args([flag, value])
    assert exit.value.code == 2
    assert f"argument {flag}: must be" in capsys.readouterr().err
    assert chat.parse_args(["--draft-tokens", "6", "--max-tokens", "1"]).draft_tokens == 6


def test_a_drafter_given_as_the_model_is_named(capsys):
    assert chat.main(["--model", str(DRAFTER), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.endswith("is an MTP drafter (gemma4_assistant), not a target model; pass it as the drafter\n")


def test_auto_says_why_it_kept_to_plain_steps_with_what_it_measured():
    """After a reply that tried MTP rounds but came mostly from plain steps, `auto`'s measures on this machine
    (plain steps faster than the best draft length's expected rate); nothing where drafting won or was not
    measured, and the draft length named is the one it would pick."""
    from mlx_mtp.decode.speculative import DraftPolicy, policy_for

    drafter = nn.Linear(1, 1)  # any object a policy can be kept for
    policy, tried = policy_for(drafter, "auto"), Stats(emitted=100, rounds=6, plain_steps=90, drafted=6, accepted=3)
    assert chat.why_plain(drafter, tried) is None  # nothing measured yet
    for _ in range(3):
        policy.observe(1, 0, [0], 0.010)  # plain: 100 tok/s
        policy.observe(1, 1, [0], 0.019)  # one draft, rarely accepted
        policy.observe(1, 2, [0], 0.028)
    line = chat.why_plain(drafter, tried)
    plain, k, drafting = policy.speeds(1)
    assert round(plain) == 100 and drafting < plain and k == max(range(1, policy.k_max + 1),
                                                                 key=lambda j: policy.rate(1, j))
    assert line == (f"[auto kept to plain steps: on this machine they measured 100 tok/s, rounds of {k} draft"
                    f"{'s' if k != 1 else ''} an expected {drafting:.0f}; --draft-tokens {k} drafts anyway]")
    assert chat.why_plain(drafter, Stats(emitted=100, rounds=40, plain_steps=10, drafted=80, accepted=60)) is None
    assert chat.why_plain(drafter, Stats(emitted=100, plain_steps=99)) is None  # no round tried: nothing to say
    assert chat.why_plain(None, tried) is None
    fast = DraftPolicy("auto")
    for _ in range(3):
        fast.observe(1, 0, [0], 0.010)
        fast.observe(1, 1, [1], 0.011)
    assert fast.speeds(1)[2] > fast.speeds(1)[0]  # drafting that pays is not reported as slower


def test_stat_line_names_every_tokens_origin_every_time():
    mixed = Stats(emitted=120, rounds=20, plain_steps=31, drafted=60, accepted=68, from_draft=68)
    line = chat.stat_line(mixed)
    assert line.startswith("[120 tokens: 1 from the prompt, 88 from 20 MTP rounds (acceptance length 4.40), "
                           "31 from plain steps; ")
    assert "%" not in line and 1 + 88 + 31 == 120
    assert chat.stat_line(Stats(emitted=10, plain_steps=9)).startswith("[10 tokens: 1 from the prompt, 9 from plain steps; ")
    one = chat.stat_line(Stats(emitted=4, rounds=1, drafted=3, accepted=2))
    assert one.startswith("[4 tokens: 1 from the prompt, 3 from 1 MTP round (acceptance length 3.00), 0 from plain steps; ")
    assert chat.stat_line(Stats()).startswith("[0 tokens; ")


@pytest.mark.parametrize("argv0, usage", [("/venv/bin/mlx-mtp-chat", "usage: mlx-mtp-chat "),
                                          ("/src/mlx_mtp/chat.py", "usage: python -m mlx_mtp.chat ")])
def test_usage_names_how_the_chat_was_run(argv0, usage, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [argv0])
    with pytest.raises(SystemExit):
        chat.parse_args(["--help"])
    assert capsys.readouterr().out.startswith(usage)


def read_until(fd: int, marker: bytes, timeout: float = 60) -> bytes:
    seen = b""
    while marker not in seen:
        if not select.select([fd], [], [], timeout)[0]:
            raise TimeoutError(f"waited for {marker!r}; got {seen!r}")
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # Linux: the child closed the terminal
            chunk = b""
        if not chunk:
            raise EOFError(f"ended before {marker!r}; got {seen!r}")
        seen += chunk
    return seen


def test_ctrl_c_at_the_prompt_clears_the_line_and_ctrl_d_leaves(models):
    """Also when the chat starts with SIGINT ignored (as a background job of a script starts it)."""
    pty = pytest.importorskip("pty")
    pid, fd = pty.fork()
    if pid == 0:  # the child: the chat on a terminal
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited through exec
            os.execve(sys.executable, [sys.executable, "-m", "mlx_mtp.chat", "--model", str(models[0])], ENV)
        finally:
            os._exit(127)
    status = None
    try:
        read_until(fd, b"> ")
        os.write(fd, b"half a line")
        read_until(fd, b"half a line")  # echoed by readline
        time.sleep(0.3)  # a SIGINT landing before readline waits for input again is only seen at the next key
        for attempt in range(5):  # so, on a loaded machine, press Ctrl-C again
            os.write(fd, b"\x03")
            try:
                read_until(fd, b"> ", timeout=3)  # still running, a fresh prompt
                break
            except TimeoutError:
                assert attempt < 4, "no prompt after Ctrl-C"
        os.write(fd, b"\x04")
        status = os.waitpid(pid, 0)[1]
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        os.close(fd)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_ten_turns_of_the_demo_chat_feed_only_their_new_tokens():
    """`python -m mlx_mtp.chat` as the README starts it, ten messages and `/stats` after each: the
    tokens fed over the turns are the new ones (the previous reply's stop token aside), read off what
    the chat prints (the prompt's tokens fed and reused, the reply's tokens)."""
    from test_conversation import ten_turns

    stdin = "".join(f"{text}\n/stats\n" for text in ten_turns()).encode()
    # Replies run to their budget: one the loop stop cuts is kept as far as it was read, and the state
    # at that cut is rebuilt from wherever the row's ring reached by then, which depends on timing.
    rc, out, err = run_chat("--max-tokens", 24, "--no-stop-at-repeat", stdin=stdin)
    assert rc == 0, err
    prompts = [(int(f), int(r)) for f, r in re.findall(r"prompt: (\d+) tokens fed \(.*?\), (\d+) reused", out)]
    replies = [int(n) for n in re.findall(r"^\[(\d+) tokens", err + out, re.M)]
    assert len(prompts) == len(replies) == 10, (out, err)
    fed = new = 0
    for i in range(1, 10):
        seen = sum(prompts[i - 1]) + replies[i - 1]  # the previous prompt and its reply
        fed, new = fed + prompts[i][0], new + sum(prompts[i]) - seen
    assert fed / new <= 1.05, (fed, new, prompts)


def test_the_readmes_first_command_continues_code_and_names_every_tokens_origin():
    """The README's Set up block, its chat line run as written (the demo pair, a code prefix, --raw)."""
    block = (ROOT / "README.md").read_text().split("## Set up", 1)[1].split("```", 2)[1]
    line = next(x for x in block.splitlines() if x.startswith("python -m mlx_mtp.chat"))
    out = subprocess.run(line + " --max-tokens 16", shell=True, capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r"\[16 tokens: 1 from the prompt, (\d+ from \d+ MTP rounds? \(acceptance length [\d.]+\), )?"
                     r"\d+ from plain steps; ", out.stdout + out.stderr)


def test_help_says_the_defaults_and_what_the_demo_runs_with():
    rc, out, _ = run_chat("--help")
    text = " ".join(out.split())
    assert rc == 0
    for said in ("(default: 0, greedy)", "per reply (default: 256 with --raw; else 512, or less where the model's "
                 "context would not hold 10 turns: 1/16 of it, 128 for the demo pair)", "where a line starts at column 0 (default: on;",
                 "the same block of lines 3 times in a row (or the same piece of 8+ characters within a line) is looping",
                 "default: the demo pair's own drafter without "
                 "--model, none (plain decoding) with --model", "(default: auto)", "--raw --prompt 'def walk(top, topdown=True"):
        assert said in text, said


def test_the_default_reply_budget_lets_ten_turns_fit_and_the_chat_warns_before_the_context_is_full(models):
    """512 tokens a reply filled the demo's 2,048-token context at turn 4: a reply's default is
    1/16 of a context that would not hold ten such turns, and while two more replies might not
    fit, each reply says how much room is left and how to get more."""
    sized = lambda context: SimpleNamespace(target=SimpleNamespace(config=SimpleNamespace(
        max_position_embeddings=context)))
    assert chat.default_max_tokens(sized(2048), raw=False) == 128  # the demo pair
    assert chat.default_max_tokens(sized(131072), raw=False) == 512
    assert chat.default_max_tokens(sized(2048), raw=True) == 256
    small = models[0].parent / "ctx640"
    if not small.exists():
        shutil.copytree(models[0], small)
        edit_config(small, max_position_embeddings=640)  # 40 tokens a reply by default
    rc, out, err = run_chat("--model", small, stdin="".join(f"hello {i}\n" for i in range(24)).encode())
    assert rc == 0, err
    lines = [line for line in err.splitlines() if line.startswith(("[", "error"))]
    trouble = next(i for i, line in enumerate(lines) if line.startswith(("error", "[reply cut")))
    replies = [line for line in lines[:trouble] if "tok/s" in line]
    assert len(replies) >= 10 and all(stat_counts(line)[0] <= 40 for line in replies), err  # 10 turns fit
    left = [re.match(r"\[(\d+) of the model's 640 context tokens left", line) for line in lines[:trouble]]
    assert any(left) and all(int(m[1]) < 80 for m in left if m), err  # said before the context filled
    assert "/reset starts over, a smaller --max-tokens makes replies shorter" in err


@pytest.mark.parametrize("text, ends", [("def walk(top, topdown=True):", True), ("class A:  # a class", True),
                                        ("x = 1\n    y = f(x)\n", True), ("import os", False),
                                        ("print('a:')", False), ("", False)])
def test_a_raw_completion_stops_at_column_0_only_inside_a_block(text, ends):
    stops = chat.block_end(text)
    assert bool(stops) == ends
    assert not ends or {"\nd", "\n@", "\n#", "\n)"} <= set(stops) and not any(s[1:].isspace() for s in stops)


def test_a_raw_completion_ends_with_its_function_the_same_with_mtp_as_without():
    """--raw completes a function to its end on the demo pair: the completion run to its budget,
    cut before its first line at column 0; greedy MTP (K=3, auto) writes the same text."""
    from mlx_mtp.demo import load_demo
    from mlx_mtp.engine.engine import Engine

    prompt, budget = 'def exists(path):\n    """Test whether a path exists."""\n', 128
    with Engine(load_demo(), max_batch=1) as engine:
        def complete(stop_at_dedent, **options):
            session = chat.Completion(engine, stop_at_dedent)
            return "".join(e.text for e in session.reply(prompt, max_tokens=budget, **options)), session.last_stats

        whole, _ = complete(False, mtp=False)
        end = re.search(r"\n\S", whole)
        assert end and whole[: end.start()].strip(), whole  # the demo target ends this function
        for options in (dict(mtp=False), dict(draft_tokens=3), dict(draft_tokens="auto")):
            text, stats = complete(True, **options)
            assert text == whole[: end.start()], options
            assert stats.emitted < budget, options  # generation stopped there too
            if options.get("draft_tokens") == 3:
                assert stats.rounds and stats.accepted, stats.summary()  # the drafter really drafted


@pytest.mark.parametrize("text, loop", [("a\nb\na\nb\na\nb\n", "the same 2 lines"), ("    x = 1\n" * 3, "the same line"),
                                        ("    x = 1\n" * 2, ""), ("a\nb\na\nb\na\nb", ""), ("\n" * 6, ""),
                                        ("x\n\n    y\n\n    y\n\n    y\n", "the same 2 lines"),
                                        ('    """All the test' + "_version" * 3, "'_version'"),
                                        ("    x = f(" + "0" * 24, "'00000000'"), ("    x = f(" + "0" * 23, ""),
                                        ("    " + "=" * 70, ""), ("_type" * 6, "'_type_type'")])
def test_a_completion_that_ends_with_the_same_lines_or_piece_3_times_in_a_row_loops(text, loop):
    assert chat.repeating(text) == loop  # complete lines; or a piece of 8+ characters, a letter or digit in it


def test_a_raw_completion_that_repeats_itself_stops_at_the_third_copy_the_same_with_mtp_as_without():
    """The demo target repeats a line it was given three times: the completion stops once it has
    written that line three times, says so, and greedy MTP (K=3, auto) stops at the same text;
    without the stop it runs to its budget."""
    from mlx_mtp.demo import load_demo
    from mlx_mtp.engine.engine import Engine

    prompt, line, budget = "def f():\n" + "    x = 1\n" * 3, "    x = 1\n", 48
    with Engine(load_demo(), max_batch=1) as engine:
        def complete(stop_at_repeat, **options):
            session = chat.Completion(engine, stop_at_dedent=False)
            stream = session.reply(prompt, max_tokens=budget, **options)
            stream = chat.LoopStop(stream) if stop_at_repeat else stream
            return "".join(e.text for e in stream), session, getattr(stream, "note", None)

        whole, session, note = complete(False, mtp=False)
        assert whole.startswith(line * 4) and session.last_stats.emitted == budget and note is None, whole
        for options in (dict(mtp=False), dict(draft_tokens=3), dict(draft_tokens="auto")):
            text, session, note = complete(True, **options)
            assert text == line * 3, (options, text)
            assert session.last_stats.emitted < budget and "the same line 3 times in a row" in note, options


def test_the_chat_says_on_stderr_that_a_raw_completion_stopped_in_a_loop():
    rc, out, err = run_chat("--raw", "--max-tokens", 48, "--prompt", "def f():\n" + "    x = 1\n" * 3)
    assert rc == 0 and [line for line in out.splitlines() if line.strip()] == ["    x = 1"] * 3, (out, err)
    stopped = [line for line in err.splitlines() if line.startswith("[stopped")]
    assert stopped == ["[stopped: the same line 3 times in a row, a loop; --no-stop-at-repeat runs on]"], err


def test_a_chat_reply_that_loops_stops_there_too_and_the_chat_goes_on():
    """The demo pair chats `def _check_check_check...` whatever it is asked: without --raw too, the
    reply stops at the third copy and says so, the conversation keeps what was written and the next
    turn runs; --no-stop-at-repeat runs to --max-tokens."""
    rc, out, err = run_chat("--max-tokens", 64, stdin=b"hello\nhello again\n")
    assert rc == 0, err
    stopped = [line for line in err.splitlines() if line.startswith("[stopped")]
    assert len(stopped) == 2, err
    assert all(line.endswith("a loop; --no-stop-at-repeat runs on]") for line in stopped), err
    assert all(stat_counts(line)[0] < 64 for line in err.splitlines() if " tokens: " in line), err
    rc, whole, err = run_chat("--max-tokens", 64, "--no-stop-at-repeat", "--prompt", "hello")
    (stat,) = [line for line in err.splitlines() if " tokens: " in line]
    assert rc == 0 and "[stopped" not in err and stat_counts(stat)[0] == 64, err
    first = out.lstrip("\n").split("\n")[0]  # the first reply, up to where it stopped
    assert chat.repeating(first) and whole.lstrip("\n").startswith(first) and len(whole) > len(first) + 10, out


def test_the_loop_stop_keeps_a_conversation_consistent():
    """A chat reply stopped in a loop (`LoopStop`) stays in the conversation as far as it was read,
    greedy MTP stops at the same text as plain decoding, and the next turn resumes from the cache."""
    from mlx_mtp.demo import load_demo
    from mlx_mtp.engine.engine import Engine

    with Engine(load_demo(), max_batch=1) as engine:
        texts = []
        for options in (dict(mtp=False), dict(draft_tokens=3)):
            conv = Conversation(engine.loaded, engine=engine)
            stream = chat.LoopStop(conv.reply("hello", max_tokens=64, **options))
            texts.append("".join(e.text for e in stream))
            assert stream.note and chat.repeating(texts[-1]) and conv.last_stats.emitted < 64, texts[-1]
            assert conv.messages[-1] == {"role": "assistant", "content": texts[-1]}
            list(conv.reply("again", max_tokens=4))
            assert conv.last_stats.cached_tokens > 10  # the first turn came from the prefix cache
        assert texts[0] == texts[1]
