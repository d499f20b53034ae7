"""Every request option under every decoding mode (issue 49): logprobs, penalties, logit bias, a
grammar, stop strings and a seed, each greedy and sampled, with MTP on and off, alone and in a
batch. Each cell answers (a DoneEvent), does what its option promises, and greedy output with
MTP on is plain decoding's (mtp=False), token for token, alone or batched; a seeded sampled
request's output depends only on (seed, prompt, sampling, draft length), so alone and batched
it is the same (README "Reproducibility"). Drafted with the bundled demo pair at a fixed draft
length, so rounds really draft (and reject)."""

import math
import re
import threading

import pytest

import mlx_mtp
from mlx_mtp.demo import DRAFTER_DIR, TARGET_DIR

PROMPT = "import os\n"  # a raw prompt; greedy: "\n\n\n\nclass Test_Test(unittest.TestCase):\n    def test..."
MAX_TOKENS = 32
K = 3  # drafts per round: fixed, so every MTP round drafts
WAIT = 120  # seconds a request may go without an event
MODES = {"greedy": mlx_mtp.SamplingParams(temperature=0),
         "sampled": mlx_mtp.SamplingParams(temperature=0.8, top_p=0.95)}
TOP = 3  # log-probability alternatives
BANNED = (403, 3667)  # "class" and "_" of the demo tokenizer: both in the plain greedy reply
STOPS = ("Test", "import")
PATTERN = r"[a-z_]{1,12}\(x\): return x [+*] [0-9]\n"
SEED = 1234
OPTIONS = {
    "none": {},
    "logprobs": dict(logprobs=TOP),
    "penalties": dict(penalties=mlx_mtp.Penalties(presence=1.0, frequency=0.5, repetition=1.3)),
    "logit_bias": dict(penalties=mlx_mtp.Penalties(logit_bias={t: -100.0 for t in BANNED})),
    "grammar": dict(grammar=mlx_mtp.Grammar.regex(PATTERN)),
    "stop": dict(stop=list(STOPS)),
    "seed": dict(seed=SEED),
}


class Run:
    """One request's events: its token events, then its last event (a DoneEvent or an ErrorEvent)."""

    def __init__(self, handle):
        events = list(handle.events(WAIT))
        self.tokens_events, self.last = events[:-1], events[-1]

    @property
    def done(self):
        assert self.last.kind == "done", self.last.message
        return self.last


class Matrix:
    """The cells' runs, each made once, on demand: a cell alone, or a mode's whole batch (every
    option with MTP on and off, submitted together so they share one batch)."""

    def __init__(self, engine):
        self.engine, self.runs = engine, {}

    def request(self, option: str, mode: str, mtp: bool) -> mlx_mtp.Request:
        return mlx_mtp.Request(PROMPT, max_tokens=MAX_TOKENS, sampling=MODES[mode], mtp=mtp, draft_tokens=K,
                               **OPTIONS[option])

    def get(self, option: str, mode: str, mtp: bool, layout: str) -> Run:
        key = (option, mode, mtp, layout)
        if key not in self.runs:
            if layout == "single":
                self.runs[key] = Run(self.engine.submit(self.request(option, mode, mtp)))
            else:
                self._batch(mode)
        return self.runs[key]

    def _batch(self, mode: str) -> None:
        cells = [(option, mode, mtp, "batch") for option in OPTIONS for mtp in (True, False)]
        gate, running = threading.Event(), []
        worker = self.engine._worker
        worker.command(None, gate.wait)  # the worker waits while the batch is queued: it starts as one
        try:
            handles = [self.engine.submit(self.request(*cell[:3])) for cell in cells]
            worker.command(None, lambda: running.append(len(worker._running)))  # admitted with them
        finally:
            gate.set()
        for cell, handle in zip(cells, handles):
            self.runs[cell] = Run(handle)
        assert running == [len(cells)], f"the batch did not run as one: {running}"


@pytest.fixture(scope="module")
def matrix():
    loaded = mlx_mtp.load(TARGET_DIR, drafter=DRAFTER_DIR)
    with mlx_mtp.Engine(loaded, max_batch=2 * len(OPTIONS)) as engine:
        yield Matrix(engine)


def text_of(run: Run) -> str:
    return "".join(e.text for e in run.tokens_events)


def check_option(option: str, mode: str, run: Run, plain: Run) -> None:
    """What `option` promises of `run`; `plain` is the plain greedy reply without any option."""
    done, greedy = run.done, mode == "greedy"
    tokens = list(done.tokens)
    assert 0 < len(tokens) <= MAX_TOKENS and done.text == text_of(run)
    assert done.finish_reason in ("length", "stop")
    assert done.finish_reason == "stop" or len(tokens) == MAX_TOKENS
    assert all((e.logprob is not None) == (option == "logprobs") for e in run.tokens_events)
    if option == "logprobs":
        assert [e.token for e in run.tokens_events] == tokens
        for e in run.tokens_events:
            lp = e.logprob
            assert lp.token == e.token and math.isfinite(lp.logprob) and lp.logprob <= 0
            values = [alt.logprob for alt in lp.top]
            assert len(values) == TOP and values == sorted(values, reverse=True)
            assert lp.logprob <= values[0] + 1e-5
            if greedy:  # the chosen token is the most likely one
                assert lp.top[0].token == e.token and lp.logprob == pytest.approx(values[0], abs=1e-5)
    elif option == "penalties" and greedy:
        assert tokens != list(plain.done.tokens)  # the penalties matter
    elif option == "logit_bias":
        assert not set(tokens) & set(BANNED)
        if greedy:
            assert tokens != list(plain.done.tokens)
    elif option == "grammar":
        assert done.finish_reason == "stop" and re.fullmatch(PATTERN, done.text), done.text
    elif option == "stop":
        assert not any(s in done.text for s in STOPS), done.text
        if greedy:
            cut = plain.done.text.index("Test")
            expected = ("stop", "Test", plain.done.text[:cut])
            assert (done.finish_reason, done.stop_sequence, done.text) == expected
            assert tokens == list(plain.done.tokens[: len(tokens)])
        elif done.finish_reason == "stop":
            assert done.stop_sequence in STOPS
        else:
            assert done.finish_reason == "length" and done.stop_sequence is None
    elif option in ("none", "seed"):
        assert done.stop_sequence is None
        if greedy:  # greedy output depends on no seed
            assert tokens == list(plain.done.tokens)


@pytest.mark.parametrize("layout", ["single", "batch"])
@pytest.mark.parametrize("mtp", [True, False], ids=["mtp", "plain"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("option", OPTIONS)
def test_request_matrix(matrix, option, mode, mtp, layout):
    run = matrix.get(option, mode, mtp, layout)
    done = run.done  # an answer, not an error
    check_option(option, mode, run, matrix.get("none", "greedy", False, "single"))
    stats = done.stats
    if mtp and option != "grammar" and stats.emitted > 1:  # it drafted (the first token is the prompt's)
        assert stats.rounds > 0 and 0 < stats.drafted and stats.accepted <= stats.drafted
    if not mtp:
        assert stats.from_draft == stats.forced  # only a grammar's forced tokens are drafted
    if mode == "greedy":  # exact: plain decoding's reply, token for token
        reference = matrix.get(option, "greedy", False, "single")
        assert list(done.tokens) == list(reference.done.tokens)
        assert (done.finish_reason, done.text, done.stop_sequence) == (
            reference.done.finish_reason, reference.done.text, reference.done.stop_sequence)
        if option == "logprobs":
            ours = [e.logprob.logprob for e in run.tokens_events]
            theirs = [e.logprob.logprob for e in reference.tokens_events]
            assert ours == pytest.approx(theirs, abs=1e-4)
    elif option == "seed":  # the seed, prompt, sampling and draft length decide: alone or batched alike
        alone = matrix.get("seed", "sampled", mtp, "single")
        assert list(done.tokens) == list(alone.done.tokens)
        assert done.finish_reason == alone.done.finish_reason


def test_the_matrix_drafts_and_rejects(matrix):
    """The greedy MTP cells drafted and had drafts rejected: the exactness above was tested."""
    runs = [matrix.get(option, "greedy", True, layout) for option in OPTIONS
            for layout in ("single", "batch")]
    drafted = sum(r.done.stats.drafted for r in runs)
    accepted = sum(r.done.stats.accepted for r in runs)
    assert 0 < accepted < drafted
