"""What a request means, applied by the Engine below any API: stop strings (inside a speculative
round and across rounds, with the real demo drafter drafting), their check, and token ids the
tokenizer cannot spell."""

import json

import pytest

import mlx_mtp
from mlx_mtp.decode.batch import RowEvent
from mlx_mtp.demo import load_demo
from mlx_mtp.engine.engine import Engine, Request
from mlx_mtp.loading import Loaded, build_model, load_tokenizer
from mlx_mtp.decode.stats import Stats
from mlx_mtp.decode.text import Detokenizer, StopMatcher
from mlx_mtp.selftest.tiny import CONFIGS, randomize

WAIT = 60
K = 3  # a fixed draft length: greedy rounds are then the same on every run


@pytest.fixture(scope="module")
def demo():
    return load_demo()


@pytest.mark.parametrize("stops, pieces, sent", [
    (["END"], ["ab", "cE", "N", "Dxyz"], ["ab", "c", "", ""]),  # split over three pieces
    (["aab"], ["a", "a", "a", "b", "c"], ["", "", "a", ""]),  # a false start is released
    (["xy", "b"], ["a", "bxy"], ["a", ""]),  # the earliest stop string wins
    (["zz"], ["abc", "z"], ["abc", ""]),  # held back until the stream ends: flush sends it
])
def test_stop_matcher(stops, pieces, sent):
    m, out = StopMatcher(stops), []
    for piece in pieces:
        out.append(m.feed(piece))
        if m.hit:
            break
    assert out == sent
    if stops == ["zz"]:
        assert not m.hit and m.flush() == "z"


def stop_at(texts: list, first: int) -> tuple:
    """(stop string, where it starts in the text) made of the end of token `first`'s text and the
    start of the next one's, where that is its first occurrence; None if there is none such."""
    text = "".join(texts)
    left, right = texts[first][-2:], texts[first + 1][:2]
    at = len("".join(texts[: first + 1])) - len(left)
    return (left + right, at) if left and right and text.find(left + right) == at else None


@pytest.mark.parametrize("where", ["inside a round", "across rounds"])
def test_a_stop_string_ends_the_reply_and_its_generation(demo, where):
    request = dict(prompt="def fib(n):", max_tokens=80, draft_tokens=K)
    with Engine(demo) as engine:
        events = list(engine.submit(Request(**request)).events(WAIT))
        tokens, done = events[:-1], events[-1]
        assert done.finish_reason == "length" and done.stats.accepted > 0  # the drafter really drafts
        texts, drafted = [e.text for e in tokens], [e.from_draft for e in tokens]
        # A round is its accepted drafts, then the target's token. Inside: tokens i and i + 1 are
        # accepted drafts, so the round goes on past the stop string; across: token i ends a round.
        fits = {"inside a round": lambda i: drafted[i] and drafted[i + 1],
                "across rounds": lambda i: not drafted[i]}
        found = [(i, s) for i in range(4, len(tokens) - 1) if fits[where](i) and (s := stop_at(texts, i))]
        assert found, f"no usable place in {texts}"
        i, (stop, at) = found[0]
        before = engine.metrics()["generation_tokens_total"]
        stopped = list(engine.submit(Request(**request, stop=[stop, "never appears"])).events(WAIT))
        generated = engine.metrics()["generation_tokens_total"] - before
    end = stopped[-1]
    assert "".join(e.text for e in stopped[:-1]) == done.text[:at] == end.text  # nothing past the stop string
    assert (end.finish_reason, end.stop_sequence) == ("stop", stop) and stopped[-2].finish_reason == "stop"
    assert list(end.tokens) == [e.token for e in tokens[: i + 2]]  # up to the token that completed it
    # generation stopped there: at most the round it ended in and the one queued after it ran
    assert end.stats.emitted <= i + 2 + 2 * (K + 1) and generated == end.stats.emitted < 80


def test_stop_strings_are_checked(demo):
    with Engine(demo) as engine:
        for stop in ("abc", [""], [3]):
            with pytest.raises(ValueError, match="stop must be a list of non-empty strings"):
                engine.submit(Request("x", stop=stop))
        # a stop string in a conversation: the reply, and the conversation, end at it
        chat = mlx_mtp.Conversation(demo, engine=engine)
        full = "".join(e.text for e in chat.reply("Write a function.", max_tokens=24))
        chat.reset()
        stop = full[10:13]
        text = "".join(e.text for e in chat.reply("Write a function.", max_tokens=24, stop=[stop]))
        assert text == full[: full.index(stop)] and chat.last_done.stop_sequence == stop
        assert chat.messages[-1]["content"].startswith(text) and len(chat.last_done.tokens) < 24


@pytest.fixture(scope="module")
def wide(demo):
    """A random target whose vocabulary (4,200) is larger than its tokenizer's (the demo's 4,097,
    whose SentencePiece detokenizer indexes a table of that length)."""
    config = {**json.loads(CONFIGS.read_text())["dense"]["target"], "vocab_size": 4200}
    target = build_model(config)
    randomize(target, 0)
    tokenizer = load_tokenizer(mlx_mtp.demo.TARGET_DIR)
    assert len(tokenizer) < 4150
    return Loaded(target, tokenizer, None, demo.eos_ids)


def test_an_id_the_tokenizer_cannot_spell_does_not_stop_the_engine(wide):
    past = dict(penalties=mlx_mtp.Penalties(logit_bias=((4150, 100.0),)), logprobs=1)  # greedy picks id 4150
    with Engine(wide) as engine:
        done = engine.submit(Request("def f(x):", max_tokens=5, **past)).result(WAIT)
        assert done.tokens == (4150,) * 5 and done.text == ""
        events = list(engine.submit(Request("def f(x):", max_tokens=3, **past)).events(WAIT))
        assert [(e.logprob.text, e.logprob.bytes) for e in events[:-1]] == [("", b"")] * 3
        assert engine.running and len(engine.submit(Request("def f(x):", max_tokens=4)).result(WAIT).tokens) == 4
    word = wide.tokenizer.encode("hello")[0]

    def texts(tokens):  # through the detokenizer every front end uses
        event = RowEvent(0, tokens, [False] * len(tokens), "length", Stats())
        return [e.text for e in Detokenizer(wide).events(event)]

    assert texts([4150, word]) == ["", *texts([word])] and texts([word])[0]
