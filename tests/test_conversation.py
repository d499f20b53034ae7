"""Conversation: multi-turn chat reusing one KV cache gives exactly what fresh prefills give."""

import time

import pytest
from chat_helpers import DRAFTER, REWRITING_TEMPLATE, make_chat_model

import mlx_mtp
from mlx_mtp.engine.conversation import Conversation

HOT = mlx_mtp.SamplingParams(temperature=3.0)
TURNS = ["hello there", "tell me a story about a cat", "why?", "go on"]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return mlx_mtp.load(make_chat_model(tmp_path_factory.mktemp("chat") / "model"), DRAFTER)


def fresh(conv, messages, max_tokens):
    """The reference: the whole rendered conversation (earlier replies as generated, control
    tokens the tiny model wrote included) prefilled into a new cache, plain decoding."""
    return mlx_mtp.generate(conv.loaded, conv.render(messages), max_tokens=max_tokens, mtp=False).tokens


def turn(conv, text, max_tokens=30, **kwargs):
    """(reply tokens, reference tokens, tokens fed to the model) of one turn."""
    expected = fresh(conv, [*conv.messages, {"role": "user", "content": text}], max_tokens)
    events = list(conv.reply(text, max_tokens=max_tokens, draft_tokens=3, **kwargs))
    assert cached(conv) == len(conv.tokens) - 1  # the invariant generate_tokens relies on
    return [e.token for e in events], expected, conv.last_stats.prompt_tokens


def cached(conv):
    """How much of the conversation a next turn resumes from (the state after all of it but the
    reply's last token is kept)."""
    return conv.cached_tokens()


def test_turns_reuse_the_cache_and_match_fresh_prefills(loaded):
    conv = Conversation(loaded, system="be brief")
    for i, text in enumerate(TURNS):
        before = len(conv.tokens)
        got, expected, fed = turn(conv, text)
        assert got == expected
        rendered = conv.render(conv.messages)  # the conversation so far, next prompt included
        assert conv.tokens == rendered[: len(conv.tokens)] or conv.tokens[-1] in loaded.eos_ids
        if i:  # only the new turn's tokens (and the last cached one) are fed
            assert fed == len(conv.tokens) - len(got) - before + 1
            assert fed <= len(text) + 18  # <turn|>\n<|turn>user\n...<turn|>\n<|turn>model\n
    assert len(conv.tokens) > 4 * 8  # well past the sliding window
    assert [m["role"] for m in conv.messages] == ["system"] + ["user", "assistant"] * len(TURNS)


def test_rerendered_history_rolls_back_or_prefills_again(loaded):
    """A template whose rendering of a reply differs from the generated tokens (simulated by
    editing the reply text) rolls the cache back to the common prefix, or prefills anew when
    that lies beyond what the sliding window retains."""
    conv = Conversation(loaded)
    turn(conv, TURNS[0])
    turn(conv, TURNS[1], max_tokens=40)
    conv.messages[-1]["content"] = conv.messages[-1]["content"][:-2] + "!!"  # near the end: trim
    got, expected, fed = turn(conv, TURNS[2])
    assert got == expected and fed < 25
    conv.messages[1]["content"] = "?" + conv.messages[1]["content"][1:]  # far back: re-prefill
    prompt_len = len(conv.render([*conv.messages, {"role": "user", "content": TURNS[3]}]))
    got, expected, fed = turn(conv, TURNS[3])
    assert got == expected and fed == prompt_len


def test_reset_and_a_prompt_too_long(loaded):
    conv = Conversation(loaded, system="hi")
    first, expected, _ = turn(conv, TURNS[0])
    turn(conv, TURNS[1])
    state = (list(conv.messages), list(conv.tokens))
    with pytest.raises(mlx_mtp.ContextLengthError):
        conv.reply("x" * 600)
    assert (conv.messages, conv.tokens) == state  # nothing lost: the cache is still reused
    got, expected, fed = turn(conv, TURNS[2])
    assert got == expected and fed < 25
    conv.reset()
    assert conv.messages == [{"role": "system", "content": "hi"}] and conv.tokens == []
    again, _, fed = turn(conv, TURNS[0])
    assert again == first and fed == len(conv.tokens) - len(again)
    events = list(conv.reply("y" * 400, max_tokens=100))  # a reply that fills the context stops there
    assert events[-1].finish_reason in ("length", "stop") and len(conv.tokens) <= 512


@pytest.mark.parametrize("slow", [False, True])
def test_a_reply_closed_early_is_kept_as_read(loaded, slow):
    """The engine streams ahead of its reader (a slow one: to the end of the reply); what the
    conversation keeps is what was read, and the next turn is exact."""
    conv = Conversation(loaded)
    turn(conv, TURNS[0])
    # Hot sampling gets drafts accepted: the round that gave the 3rd token went further.
    stream = conv.reply(TURNS[1], max_tokens=30, draft_tokens=4, sampling=HOT, seed=0)
    events = [next(stream)]
    while not events[-1].from_draft:  # stop on a draft: its round ran ahead of what was handed out
        events.append(next(stream))
    partial = [e.token for e in events]
    with pytest.raises(RuntimeError):
        conv.reply("while streaming")
    if slow:
        time.sleep(1)
    stream.close()
    assert conv.tokens[-len(partial):] == partial and len(conv.last_done.tokens) >= len(partial)
    assert conv.messages[-1] == {"role": "assistant", "content": loaded.tokenizer.decode(partial)}
    assert cached(conv) >= len(conv.tokens) - len(partial) - 1  # at least the prompt's state is kept
    got, expected, fed = turn(conv, TURNS[2])
    assert got == expected and fed <= len(TURNS[2]) + 18 + len(partial) + 1  # + the partial reply, re-read


def test_a_template_that_rewrites_replies_costs_one_reply_not_the_conversation(tmp_path):
    """A template that rewrites replies past recognition (so none can be spliced back in as
    generated) re-renders a stored reply differently from what was generated, from a point long after
    the sliding window (8) and the rollback slack moved past it. Each turn must still feed only the new
    message plus at most the re-rendered last reply, and give what a fresh prefill gives."""
    loaded = mlx_mtp.load(make_chat_model(tmp_path / "m", REWRITING_TEMPLATE), DRAFTER)
    conv = Conversation(loaded)
    rewritten, previous_reply = 0, []
    for i in range(10):
        text = f"q{i} "
        prompt = conv.render([*conv.messages, {"role": "user", "content": text}])
        kw = dict(max_tokens=24, sampling=HOT, seed=i, mtp=False)
        expected = mlx_mtp.generate(loaded, prompt, **kw).tokens
        events = list(conv.reply(text, **kw))
        assert [e.token for e in events] == expected
        fed, message_cost = conv.last_stats.prompt_tokens, len(text) + 18  # + <turn|>\n<|turn>user\n..
        assert fed <= message_cost + len(previous_reply) + 1, (i, fed)
        rewritten += fed > message_cost + 1
        previous_reply = expected
    assert rewritten >= 5  # the snapshot path really ran
    assert len(conv.tokens) > 300  # far past window + slack


def ten_turns():
    return [f"Please write a Python function number {i} that reads a text file and returns the ten most "
            f"common words in it." for i in range(10)]


def test_a_ten_turn_chat_on_the_demo_pair_feeds_only_its_new_tokens():
    """The demo template trims replies, so rendering one again would part ways with the tokens the
    model wrote at their first token (every turn prefilling the last reply again): each reply goes
    back in as generated, every prompt extends the conversation so far, and what is fed over ten
    turns is the new tokens (each reply's stop token, written but never fed, aside)."""
    from mlx_mtp.demo import load_demo

    conv = Conversation(load_demo())
    fed = new = 0
    for i, text in enumerate(ten_turns()):
        seen = list(conv.tokens)
        prompt = conv.render([*conv.messages, {"role": "user", "content": text}])
        assert prompt[: len(seen)] == seen, i  # the reply as generated, not re-rendered
        list(conv.reply(text, max_tokens=24))
        if i:
            fed, new = fed + conv.last_stats.prompt_tokens, new + len(prompt) - len(seen)
    assert fed / new <= 1.05, (fed, new)
