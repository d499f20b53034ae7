"""Tokens to text: stop strings cut out of streamed text, and token ids the tokenizer cannot spell,
which must not stop the Engine."""

import json

import pytest

import mlx_mtp
from mlx_mtp.batch import RowEvent
from mlx_mtp.demo import load_demo
from mlx_mtp.engine import Engine, Request
from mlx_mtp.loading import Loaded, build_model, load_tokenizer
from mlx_mtp.stats import Stats
from mlx_mtp.text import Detokenizer, StopMatcher
from mlx_mtp.tiny import CONFIGS, randomize

WAIT = 60


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
