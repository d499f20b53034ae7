"""Prompt-lookup (n-gram) drafting: the lookup itself, and exactness as for MTP (greedy output
equals plain decoding past the window, also as a hybrid with the MTP drafter)."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import reference, tiny_drafter, tiny_target

from mlx_mtp.decode.drafters import HybridDrafter, MTPProposer, NgramDrafter, lookup
from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.decode.stats import Stats


def test_lookup_continues_the_latest_longest_match():
    #        0  1  2  3  4  5  6  7  8  9 10 11 12
    row0 = [5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6, -1, -1]  # "5 6" occurs at 0 and 5: the latest wins
    row1 = [1, 2, 3, 4, 9, 9, 2, 3, 1, 2, 3, -1, -1]  # "1 2 3" (n=3) at 0 beats "2 3" at 6
    row2 = [4, 4, 4, 4, 4, 4, 7, 3, 3, 8, -1, -1, -1]  # "3 8" never occurred before
    history = mx.array([row0, row1, row2], dtype=mx.int32)
    tokens, count = lookup(history, mx.array([11, 11, 10]), k=3, n_min=2, n_max=3)
    assert np.array(count).tolist() == [3, 3, 0]
    assert np.array(tokens).tolist()[:2] == [[9, 2, 5], [4, 9, 9]]
    tokens, count = lookup(history, mx.array([11, 11, 10]), k=5, n_min=2, n_max=3)
    assert np.array(count).tolist() == [4, 5, 0]  # never past the known tokens


@pytest.mark.parametrize("k", [3, "auto"])
def test_greedy_ngram_and_hybrid_equal_plain(variant, k):
    """The tiny MoE and E2B models' greedy text repeats itself now and then: lookups hit and
    miss (the dense one's hardly repeats: there they miss)."""
    target, prompt = tiny_target(variant), reference(variant)["prompt"].tolist()
    plain = [t for t, _ in generate_tokens(target, prompt, max_tokens=60)]
    ngram = NgramDrafter(n_max=3, n_min=1)
    for drafter in (ngram, HybridDrafter(MTPProposer(tiny_drafter(variant), target), ngram, min_ngram=1)):
        stats = Stats()
        out = [t for t, _ in generate_tokens(target, prompt, drafter=drafter, draft_tokens=k, max_tokens=60,
                                             stats=stats)]
        assert out == plain
        if k == 3:
            assert stats.accepted < stats.drafted and (stats.accepted > 0 or variant == "dense")
