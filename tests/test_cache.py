"""The shared KV cache: exact rollback after the sliding window wraps, or a clear error."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import reference, tiny_target

from mlx_mtp.cache import FULL, SLIDING, CacheError, KVCache

W = 8


def fill(cache, n, start=0, layer_dims=((2, 4), (2, 8))):
    """Write n tokens one forward at a time; K values encode the position (to check slots)."""
    for pos in range(start, start + n):
        cache.begin(1)
        for layer, (h, d) in enumerate(layer_dims):
            k = mx.full((1, h, 1, d), float(pos))
            cache.update(layer, k, -k)


def visible_positions(cache, kind):
    kv = cache.shared_kv(0 if kind == SLIDING else 1)
    pos = np.array(kv.positions[0])
    keys = np.array(kv.keys[0, 0, :, 0])
    assert (keys[pos >= 0] == pos[pos >= 0]).all()  # every slot holds its own position's K
    return sorted(pos[pos >= 0].tolist())


def make(max_rollback=4, step=16):
    return KVCache([SLIDING, FULL], W, max_rollback=max_rollback, step=step)


def test_trim_after_wrap_is_exact():
    cache = make()
    fill(cache, 100)
    cache.trim(4)
    assert cache.offset.tolist() == [96]
    assert visible_positions(cache, FULL) == list(range(96))
    assert visible_positions(cache, SLIDING)[-(W + 1):] == list(range(96 - W - 1, 96))
    fill(cache, 10, start=96)  # rewriting the rolled-back positions
    assert visible_positions(cache, FULL) == list(range(106))
    mask = np.array(cache.mask(SLIDING, mx.array([[105]]))[0, 0, 0])
    assert sorted(np.array(cache.tracks[SLIDING].pos[0, : cache.tracks[SLIDING].length])[mask]) == list(
        range(98, 106)
    )


def test_trim_beyond_slack_raises_and_changes_nothing():
    cache = make(max_rollback=4)
    fill(cache, 100)
    before = (cache.offset.copy(), cache.tracks[SLIDING].length)
    with pytest.raises(CacheError, match="sliding-window"):
        cache.trim(40)
    assert (cache.offset == before[0]).all() and cache.tracks[SLIDING].length == before[1]
    with pytest.raises(CacheError):
        cache.trim(200)


def test_trim_before_wrap_can_undo_everything():
    cache = make(max_rollback=1)
    fill(cache, 6)
    cache.trim(6)
    assert cache.offset.tolist() == [0] and visible_positions(cache, SLIDING) == []


def test_sliding_memory_stays_bounded():
    cache = make(max_rollback=4, step=16)
    bound = W + 1 + 4 + 16 + 1  # window + drafter's extra key + slack + one growth step + the new token
    for _ in range(50):
        fill(cache, 7, start=int(cache.offset[0]))
        cache.trim(3)
        assert cache.capacity(SLIDING) <= bound
    assert cache.capacity(FULL) >= int(cache.offset[0])


def test_ragged_rollback_masks_each_row_separately():
    cache = KVCache([SLIDING, FULL], W, batch_size=2, max_rollback=4, step=16)
    fill(cache, 30, layer_dims=((1, 4), (1, 4)))
    cache.rollback([1, 3])
    assert cache.offset.tolist() == [29, 27]
    qpos, _ = cache.begin(1)
    assert np.array(qpos).tolist() == [[29], [27]]
    full = np.array(cache.mask(FULL, qpos))[:, 0, 0]
    pos = np.array(cache.tracks[FULL].pos[:, : cache.tracks[FULL].length])
    assert sorted(pos[0][full[0]]) == list(range(30))
    assert sorted(pos[1][full[1]]) == list(range(28))


def test_model_rollback_after_wrap_equals_never_having_seen_the_tokens():
    """Feed extra tokens, roll back, continue: logits equal the straight run."""
    model = tiny_target("dense")
    ids = mx.array(reference("dense")["prompt"][None])
    straight = model.make_cache(max_rollback=5)
    model(ids[:, :15], straight)
    expect = model(ids[:, 15:], straight).logits
    rolled = model.make_cache(max_rollback=5)
    model(ids[:, :15], rolled)
    model(mx.array([[3, 4, 5, 6, 7]]), rolled)  # 15 + 5 > window: wrapped
    rolled.trim(5)
    assert np.abs(np.array(model(ids[:, 15:], rolled).logits - expect)).max() < 1e-5
