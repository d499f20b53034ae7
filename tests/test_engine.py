"""Engine: one worker thread serves requests from any thread, with cancellation and errors."""

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from chat_helpers import DRAFTER, make_chat_model

import mlx_mtp
from mlx_mtp.engine.conversation import Conversation
from mlx_mtp.engine import engine as engine_module
from mlx_mtp.engine.engine import Engine, MemoryLimitError, QueueFull, Request

WAIT = 60  # seconds any single event may take before a test fails instead of hanging
SCRIPTS = [["hi", "and then?"], ["what is 2+2", "sure?"], ["tell me a joke", "another"]]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return mlx_mtp.load(make_chat_model(tmp_path_factory.mktemp("engine") / "model"), DRAFTER)


@pytest.fixture
def engine(loaded):
    with Engine(loaded) as engine:
        yield engine
    assert not engine.running


def tokens_of(handle):
    return list(handle.result(WAIT).tokens)


def test_threads_on_different_conversations_get_single_threaded_outputs(loaded, engine):
    expected = []
    for i, script in enumerate(SCRIPTS):
        conv = Conversation(loaded, system=f"bot {i}")
        expected.append([[e.token for e in conv.reply(t, max_tokens=12, draft_tokens=2)] for t in script])
    one_shot = mlx_mtp.generate(loaded, "abc", max_tokens=12).tokens
    got, errors = [None] * len(SCRIPTS), []

    def client(i):
        try:
            conv = engine.conversations.new(system=f"bot {i}")
            got[i] = [tokens_of(engine.submit(Request(t, conversation=conv, max_tokens=12, draft_tokens=2)))
                      for t in SCRIPTS[i]]
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(SCRIPTS))]
    for t in threads:
        t.start()
    shot = engine.submit(Request("abc", max_tokens=12))
    for t in threads:
        t.join(WAIT)
    assert not errors and got == expected
    assert tokens_of(shot) == one_shot


def test_cancel_mid_stream_keeps_the_partial_reply(loaded, engine):
    conv = engine.conversations.new()
    handle = engine.submit(Request("tell me everything", conversation=conv, max_tokens=200))
    queued = engine.submit(Request("queued behind", conversation=conv, max_tokens=200))
    queued.cancel()
    events = []
    for event in handle.events(WAIT):
        events.append(event)
        if len(events) == 3:
            handle.cancel()
    done = events[-1]
    assert done.kind == "done" and done.finish_reason == "cancelled"
    streamed = [e.token for e in events if e.kind == "token"]
    assert len(streamed) >= 3 and list(done.tokens) == streamed
    assert queued.result(WAIT).finish_reason == "cancelled"
    # The partial reply is part of the conversation, as streamed; the next turn continues it.
    messages = engine.conversations.messages(conv)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[-1]["content"] == loaded.tokenizer.decode(streamed)
    reference = Conversation(loaded)
    reference.messages[:] = messages
    expected = [e.token for e in reference.reply("go on", max_tokens=10)]
    assert tokens_of(engine.submit(Request("go on", conversation=conv, max_tokens=10))) == expected


def test_errors_are_delivered_and_the_engine_goes_on(engine):
    with pytest.raises(mlx_mtp.ContextLengthError) as e:  # refused before it is queued
        engine.submit(Request(list(range(4, 100)) * 6, max_tokens=5))  # 576 > 512 tokens
    assert (e.value.prompt_tokens, e.value.context, e.value.max_tokens) == (576, 512, None)
    with pytest.raises(mlx_mtp.ContextLengthError) as e:  # Anthropic's rule: the whole budget must fit
        engine.submit(Request(list(range(4, 100)) * 5, max_tokens=33, fit_max_tokens=True))
    assert (e.value.prompt_tokens, e.value.max_tokens) == (480, 33)
    assert len(engine.submit(Request(list(range(4, 100)) * 5, max_tokens=33)).result(WAIT).tokens) <= 32  # to the end
    conv = engine.conversations.new()
    with pytest.raises(mlx_mtp.ContextLengthError):
        engine.submit(Request("x" * 600, conversation=conv)).result(WAIT)
    with pytest.raises(ValueError):  # raised inside generation: the cache allows 7 tokens of rollback
        engine.submit(Request("hi", conversation=conv, draft_tokens=10)).result(WAIT)
    assert engine.conversations.messages(conv) == []
    chat = Request(messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    in_conversation = engine.submit(Request("hi", conversation=conv, max_tokens=5))
    assert tokens_of(in_conversation) == tokens_of(engine.submit(chat))
    with pytest.raises(ValueError):
        engine.submit(Request())
    engine.conversations.close(conv)
    with pytest.raises(KeyError):
        engine.submit(Request("hi", conversation=conv))


def test_close_cancels_running_requests_and_joins(loaded):
    engine = Engine(loaded)
    handle = engine.submit(Request("long", max_tokens=400))
    first = next(handle.events(WAIT))
    assert first.kind == "token"
    engine.close(timeout=WAIT)
    assert not engine.running and handle.result(WAIT).finish_reason in ("cancelled", "stop")
    with pytest.raises(RuntimeError):
        engine.submit(Request("late"))


def test_eight_clients_with_cancels_and_bad_requests_all_end_exactly(loaded):
    """8 threads x 3 requests through 4 rows: some wait (first in, first out), some are
    cancelled mid-stream, some are bad; every stream ends and every output equals its solo run."""
    prompts = [[4 + i, 40 + 3 * i, 9, 17 + i, 30] * (1 + i % 3) for i in range(8)]
    solo = [mlx_mtp.generate(loaded, p, max_tokens=16).tokens for p in prompts]
    errors, results = [], {}

    def client(i, engine):
        try:
            for j in range(3):
                if j == 1 and i % 3 == 0:  # a token id outside the vocabulary
                    events = list(engine.submit(Request([1, 2, 999], max_tokens=4)).events(WAIT))
                    assert events[-1].kind == "error" and "vocabulary" in events[-1].message
                elif j == 2 and i % 2:  # cancelled after two tokens
                    handle = engine.submit(Request(prompts[i], max_tokens=200))
                    got = []
                    for event in handle.events(WAIT):
                        if event.kind == "token":
                            got.append(event.token)
                            if len(got) == 2:
                                handle.cancel()
                    assert list(event.tokens) == got
                    full = mlx_mtp.generate(loaded, prompts[i], max_tokens=200).tokens
                    assert got == full[: len(got)]
                    assert event.finish_reason == "cancelled" or got == full  # or it stopped first
                else:
                    results[(i, j)] = tokens_of(engine.submit(Request(prompts[i], max_tokens=16, draft_tokens=2)))
        except Exception as e:  # surfaced below
            errors.append((i, e))

    with Engine(loaded, max_batch=4) as engine:
        threads = [threading.Thread(target=client, args=(i, engine)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(4 * WAIT)
        metrics = engine.metrics()
    assert not errors, errors
    assert all(tokens == solo[i] for (i, _), tokens in results.items()) and len(results) >= 14
    assert metrics["requests_running"] == 0 and metrics["requests_total"] == 24
    assert metrics["spec_draft_tokens"] > metrics["spec_accepted_tokens"] > 0


def test_conversations_keep_their_cache_through_the_batch(loaded):
    """Two conversations and a one-shot request share the batch; each turn feeds only its new
    message (its cache came back from the batch), and replies equal a lone Conversation's."""
    with Engine(loaded) as engine:
        convs = [engine.conversations.new(system=f"bot {i}") for i in range(2)]
        references = [Conversation(loaded, system=f"bot {i}") for i in range(2)]
        for text in ("hello there", "tell me more", "and then?"):
            busy = engine.submit(Request("x" * 40, max_tokens=30))
            handles = [engine.submit(Request(text, conversation=c, max_tokens=25, draft_tokens=2)) for c in convs]
            for handle, ref in zip(handles, references):
                done = handle.result(WAIT)
                assert list(done.tokens) == [e.token for e in ref.reply(text, max_tokens=25, draft_tokens=2)]
                if text != "hello there":  # <turn|>\n<|turn>user\n + message + <turn|>\n<|turn>model\n
                    assert done.stats.prompt_tokens <= len(text) + 19
            busy.result(WAIT)


def test_queue_and_memory_limits(loaded):
    with Engine(loaded, max_batch=1, max_queue=1) as engine:
        running = engine.submit(Request("long", max_tokens=400))
        next(running.events(WAIT))  # it runs: the next request waits
        waiting = engine.submit(Request("second", max_tokens=2))
        with pytest.raises(QueueFull):
            engine.submit(Request("third", max_tokens=2))
        running.cancel()
        assert waiting.result(WAIT).finish_reason == "length"
    with Engine(loaded, memory_limit=100_000) as engine:
        with pytest.raises(MemoryLimitError, match="memory limit"):
            engine.submit(Request("x", max_tokens=400)).result(WAIT)
        assert len(tokens_of(engine.submit(Request("x", max_tokens=4)))) == 4


def run_fresh(code: str) -> subprocess.CompletedProcess:
    """`code` in a new interpreter: nothing loaded, warmed up or evaluated beforehand."""
    root = Path(mlx_mtp.__file__).resolve().parent.parent
    return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=180)


def docstring_example(module) -> str:
    lines = module.__doc__.split("\n\n")[1]
    return textwrap.dedent(lines)


def test_the_docstring_example_runs_in_a_fresh_process():
    code = ("import mlx_mtp\nfrom mlx_mtp.engine import Engine, Request\n"
            "from mlx_mtp.demo import TARGET_DIR as model, DRAFTER_DIR as drafter\n"
            + docstring_example(engine_module))
    out = run_fresh(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() and "terminate called" not in out.stderr


def test_generate_on_a_plain_thread_in_a_fresh_process():
    code = textwrap.dedent("""
        import threading, mlx_mtp
        from mlx_mtp.demo import load_demo
        loaded = load_demo()
        out = []
        worker = threading.Thread(target=lambda: out.append(mlx_mtp.generate(loaded, "def f(x):", max_tokens=12)))
        worker.start(); worker.join()
        print(len(out[0].tokens))
    """)
    out = run_fresh(code)
    assert out.returncode == 0 and out.stdout.strip() == "12", out.stderr[-2000:]


def test_the_prefill_budget_reaches_the_driver_and_changes_no_output(loaded):
    """`prefill_tokens` (`--prefill-tokens`): one prompt per prefill forward, or several; the same
    replies, greedy, with MTP."""
    prompts = [[5 + i, 9, 13 + i, 7] * (3 + 4 * i) for i in range(4)]  # 12-60 tokens, arriving together
    replies = []
    for budget in (1, None, 4096):
        with Engine(loaded, prefill_tokens=budget) as engine:
            handles = [engine.submit(Request(prompt=p, max_tokens=10)) for p in prompts]
            replies.append([tokens_of(h) for h in handles])
            assert engine._worker.gen.prefill.budget == (budget or 512)
    assert replies[0] == replies[1] == replies[2]
