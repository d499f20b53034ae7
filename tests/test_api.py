"""The public API: load(), generate(), stream_generate() events and statistics."""

import pytest
from conftest import TINY, reference

import mlx_mtp
from mlx_mtp.decode.oracle import OracleDrafter


@pytest.fixture(scope="module")
def loaded():
    return mlx_mtp.load(TINY / "dense" / "target", TINY / "dense" / "drafter")


def test_stream_events_flag_drafted_tokens_and_count_stats(loaded):
    prompt = reference("dense")["prompt"].tolist()
    plain = mlx_mtp.generate(loaded, prompt, max_tokens=30, mtp=False)
    oracle = loaded._replace(drafter=OracleDrafter(plain.tokens, len(prompt), 128, 0.7))
    events = list(mlx_mtp.stream_generate(oracle, prompt, max_tokens=30, draft_tokens=3))
    assert [e.token for e in events] == plain.tokens
    stats = events[-1].stats
    assert sum(e.from_draft for e in events) == stats.from_draft == stats.accepted > 0
    assert stats.emitted == 30 and events[-1].finish_reason == "length"
    assert all(e.finish_reason is None for e in events[:-1])
    assert stats.acceptance_length == pytest.approx(1 + stats.accepted / stats.rounds)
    assert len(stats.acceptance_rates) == 3 and stats.acceptance_rates[0] >= stats.acceptance_rates[2]


def test_eos_from_config_ends_with_stop(loaded):
    prompt = reference("dense")["prompt"].tolist()
    tokens = mlx_mtp.generate(loaded, prompt, max_tokens=20, mtp=False).tokens
    stopper = loaded._replace(eos_ids=frozenset({tokens[5]}))
    result = mlx_mtp.generate(stopper, prompt, max_tokens=20)
    assert result.finish_reason == "stop" and result.tokens == tokens[: tokens.index(tokens[5]) + 1]


def test_mismatched_drafter_is_rejected():
    with pytest.raises(ValueError, match="drafter does not match its target"):
        mlx_mtp.load(TINY / "dense" / "target", TINY / "e2b" / "drafter")


def test_prompt_longer_than_context_is_a_clear_error(loaded):
    with pytest.raises(mlx_mtp.generate_module.ContextLengthError, match="context of 512"):
        mlx_mtp.generate(loaded, [5] * 600, max_tokens=5)


def test_text_prompt_without_tokenizer_is_a_clear_error(loaded):
    with pytest.raises(ValueError, match="needs a tokenizer"):
        mlx_mtp.generate(loaded, "hello")


def test_target_passed_as_drafter_is_a_clear_error():
    with pytest.raises(ValueError, match="not an MTP drafter"):
        mlx_mtp.load(TINY / "dense" / "target", TINY / "dense" / "target")
