"""Earlier thinking and the history modes, end to end on the scripted Gemma 4 model
(tests/scripted.py, the released 31B template): a reply's reasoning leaves later prompts once the
model's turn is over and a new user message came, unless kept; the prefix cache then prefills from
where the history changed and no further back; `history="template"` is the template's own rendering."""

import pytest
from scripted import ask, load_scripted, make_scripted_model

import mlx_mtp
from mlx_mtp.formats import chat as chat_format

QUESTIONS = [f"Please think it over, then tell me what {i} times {i + 2} makes." for i in range(3)]
SCRIPT = [(ask(q, thinking), f"<|channel>thought\n{i} times {i + 2} is {i * (i + 2)}.<channel|>It makes "
                             f"{i * (i + 2)}.<turn|>") for i, q in enumerate(QUESTIONS) for thinking in (False, True)]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_scripted(make_scripted_model(tmp_path_factory.mktemp("histories") / "model"), SCRIPT)


def common(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def chat(engine, **options):
    """Three user turns re-sent whole as messages: each call's (prompt ids, reply ids, prefilled, done)."""
    messages, out = [{"role": "system", "content": "You answer arithmetic."}], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        handle = engine.submit(mlx_mtp.Request(messages=list(messages), enable_thinking=True, max_tokens=60,
                                               draft_tokens=3, **options))
        done = handle.result()
        out.append((handle.prompt_keys, list(done.tokens), done.stats.prompt_tokens, done))
        messages.append({"role": "assistant", "content": done.text, "reasoning_content": done.reasoning})
    return out


@pytest.mark.parametrize("keep", [False, True], ids=["dropped", "kept"])
def test_earlier_thinking_and_the_prefix_cache(loaded, keep):
    with mlx_mtp.Engine(loaded) as engine:
        calls = chat(engine, keep_thinking=keep)
    text = loaded.tokenizer.decode(calls[-1][0])
    assert [c[3].text for c in calls] == [f"It makes {i * (i + 2)}." for i in range(3)]  # as scripted
    assert all(c[3].reasoning for c in calls)
    assert ("0 times 2 is 0." in text) == keep and ("1 times 3 is 3." in text) == keep
    for (prompt, _, fed, _), (before, reply, _, _) in zip(calls[1:], calls):
        shared = common(prompt, before + reply)
        if not keep:  # parted right after the reply's generation prompt: where the reasoning began
            assert shared == len(before)
        # prefilled from where the history changed and no further back (but the reply's stop token, never fed)
        assert fed == len(prompt) - min(shared, len(before) + len(reply) - 1)


def test_a_conversation_drops_earlier_thinking_too(loaded):
    conv = mlx_mtp.Conversation(loaded, system="You answer arithmetic.", enable_thinking=True)
    fed = []
    for question in QUESTIONS:
        before = list(conv.tokens)
        events = list(conv.reply(question, max_tokens=60, draft_tokens=3))
        prompt = conv.tokens[: len(conv.tokens) - len(events)]
        fed.append((conv.last_stats.prompt_tokens, len(prompt) - common(prompt, before)))
    assert conv.messages[2] == {"role": "assistant", "content": "It makes 0.", "reasoning_content": "0 times 2 is 0."}
    assert "0 times 2 is 0." not in loaded.tokenizer.decode(conv.render(conv.messages))
    assert all(f == n for f, n in fed[1:]), fed
    conv.close()
    kept = mlx_mtp.Conversation(loaded, system="You answer arithmetic.", enable_thinking=True, keep_thinking=True)
    for question in QUESTIONS[:2]:
        list(kept.reply(question, max_tokens=60))
    assert "0 times 2 is 0." in loaded.tokenizer.decode(kept.render(kept.messages))
    kept.close()


def test_template_mode_is_the_templates_own_rendering(loaded):
    messages = [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": "It makes 0."},
                {"role": "user", "content": QUESTIONS[1]}]
    with mlx_mtp.Engine(loaded) as engine:
        handle = engine.submit(mlx_mtp.Request(messages=messages, history="template", max_tokens=4))
        handle.result()
    expected = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    assert handle.prompt_keys == list(expected)
    generated = chat_format.render(loaded.tokenizer, messages, as_generated=True).tokens
    assert generated != handle.prompt_keys  # the empty thought channel the reply was generated after stays there


@pytest.mark.parametrize("bad, match", [
    (dict(history="verbatim"), "history must be one of"),
    (dict(history="template", keep_thinking=True), "keep_thinking goes with"),
])
def test_history_options_are_checked(bad, match):
    with pytest.raises(ValueError, match=match):
        mlx_mtp.Request(messages=[{"role": "user", "content": "x"}], **bad).check()


def test_only_a_reply_whose_text_is_all_it_says_is_spliced_back_by_its_text(loaded):
    """A stateless history sends replies back as text; their ids as generated stand in for them only
    where the text is the whole reply: not a tool call's empty text, nor a reply that reasoned."""
    from mlx_mtp.engine.history import Replies

    replies = Replies(loaded, 8)
    replies.record([7, 8, 9], {"role": "assistant", "content": "Hi there."})
    replies.record([1, 2, 3], {"role": "assistant", "content": "",
                               "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]})
    replies.record([4, 5], {"role": "assistant", "content": "42", "reasoning_content": "6 x 7"})
    assert replies.get("Hi there.") == [7, 8, 9] and replies.get("") is None and replies.get("42") is None
