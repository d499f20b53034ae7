"""The shipped demo pair (mlx_mtp/demo/): loads offline, speculative greedy output equals plain
greedy output past the sliding window, and its tokenizer and chat template work."""

from functools import lru_cache


import mlx_mtp
from mlx_mtp import demo
from mlx_mtp.decode.generate import generate_tokens


# Code in the style of the corpus, not taken from it (so the test does not depend on the
# Python version's stdlib).
SNIPPET = '''import os
import sys


class Config:
    """Settings read from the environment."""

    def __init__(self, prefix="APP_"):
        self.prefix = prefix
        self.values = {}

    def load(self, environ=None):
        if environ is None:
            environ = os.environ
        for key, value in environ.items():
            if key.startswith(self.prefix):
                self.values[key[len(self.prefix):].lower()] = value
        return self.values

    def get(self, name, default=None):
'''


@lru_cache(maxsize=None)
def loaded():
    return demo.load_demo()


def test_files_small_and_complete():
    total = sum(f.stat().st_size for f in demo.DEMO_DIR.rglob("*") if f.is_file() and f.suffix != ".py")
    assert total < 25e6, f"demo pair is {total / 1e6:.1f} MB"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                 "generation_config.json"):
        assert (demo.TARGET_DIR / name).exists(), name
    assert (demo.DRAFTER_DIR / "config.json").exists()


def test_greedy_mtp_equals_plain_past_the_window():
    pair = loaded()
    window = pair.target.config.sliding_window
    prompt = pair.tokenizer.encode(SNIPPET, add_special_tokens=False)
    assert len(prompt) + 48 > window + 8, "must generate past the sliding window"
    for ids in (prompt, prompt[:96]):
        n = window + 16 - len(ids) if len(ids) < window else 48
        plain = [t for t, _ in generate_tokens(pair.target, ids, max_tokens=n)]
        for k in (3, "auto"):
            mtp = [t for t, _ in generate_tokens(pair.target, ids, drafter=pair.drafter, draft_tokens=k,
                                                  max_tokens=n)]
            assert mtp == plain, k
        assert len(ids) + len(plain) > window


def test_drafter_is_useful():
    pair = loaded()
    stats = mlx_mtp.Stats()
    ids = pair.tokenizer.encode(SNIPPET, add_special_tokens=False)
    list(generate_tokens(pair.target, ids, drafter=pair.drafter, draft_tokens=3, max_tokens=40, stats=stats))
    assert stats.acceptance_length > 1.5, stats.summary()


def test_tokenizer_and_chat_template():
    tok = loaded().tokenizer
    text = "def f(x):\n    return {'a': x}  # é\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "Write a Python function `add`."}],
                                   add_generation_prompt=True, tokenize=False)
    assert chat == "<bos><|turn>user\nWrite a Python function `add`.<turn|>\n<|turn>model\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    turn_close = tok.convert_tokens_to_ids("<turn|>")
    assert ids[0] == 2 and tok.convert_tokens_to_ids("<|turn>") in ids
    assert {1, turn_close} <= set(loaded().eos_ids)


def test_generate_text_api():
    result = mlx_mtp.generate(loaded(), SNIPPET, max_tokens=24)
    assert result.tokens and result.finish_reason in ("stop", "length")
    assert isinstance(result.text, str)


def test_the_library_only_corpus_leaves_out_test_code_alone():
    from apps.demo_pair.data import is_test

    tests = ["test/test_os.py", "unittest/test/test_case.py", "idlelib/idle_test/test_calltip.py",
             "lib2to3/tests/data/fixers/myfixes/fix_parrot.py", "ctypes/test/__init__.py", "test_something.py"]
    library = ["os.py", "unittest/case.py", "idlelib/calltip.py", "json/tests.py", "latest/x.py", "contest.py",
               "email/_header_value_parser.py"]
    assert all(map(is_test, tests)) and not any(map(is_test, library))
