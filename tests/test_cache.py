"""The shared KV cache: exact rollback after the sliding window wraps, on the host or the
device, or a clear error; rows joining and leaving; states read out and resumed."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import reference, tiny_target

from mlx_mtp.cache.kv import FULL, SLIDING, CacheError, KVCache

W = 8


def fill(cache, n, chunk=1, layer_dims=((2, 4), (2, 8))):
    """Write n tokens, `chunk` per forward; K values encode the position (to check slots)."""
    for _ in range(0, n, chunk):
        step = cache.begin(chunk)
        for layer, (h, d) in enumerate(layer_dims):
            k = mx.broadcast_to(step.positions[:, None, :, None].astype(mx.float32), (cache.batch_size, h, chunk, d))
            step.store(layer, k, -k)


def held(cache, kind, row=0):
    """Positions a layer type holds for `row` (checking each slot holds its own position's K)."""
    kv = cache.shared_kv(0 if kind == SLIDING else 1)
    pos = np.array(kv.positions[row])
    keys = np.array(kv.keys[row, 0, :, 0])
    assert (keys[pos >= 0] == pos[pos >= 0]).all()
    return sorted(pos[pos >= 0].tolist())


def make(max_rollback=4, batch_size=1):
    return KVCache([SLIDING, FULL], W, batch_size=batch_size, max_rollback=max_rollback, step=16)


def test_trim_after_wrap_is_exact():
    cache = make()
    fill(cache, 100)
    cache.trim(4)
    assert cache.offsets().tolist() == [96]
    assert held(cache, FULL) == list(range(96))
    assert held(cache, SLIDING) == list(range(100 - (W + 1 + 4), 96))  # the ring: window + 1 + max_rollback
    fill(cache, 10)  # rewriting the rolled-back positions
    assert held(cache, FULL) == list(range(106))
    step = cache.begin(1)
    pos = np.array(cache.tracks[SLIDING].pos[0])
    assert sorted(pos[np.array(step.masks[SLIDING][0, 0, 0])].tolist()) == list(range(99, 107))


def test_trim_beyond_slack_raises_and_changes_nothing():
    cache = make(max_rollback=4)
    fill(cache, 100)
    before = (cache.offsets().tolist(), np.array(cache.tracks[SLIDING].pos).tolist())
    with pytest.raises(CacheError, match="sliding-window"):
        cache.trim(40)
    with pytest.raises(CacheError):
        cache.trim(200)
    assert (cache.offsets().tolist(), np.array(cache.tracks[SLIDING].pos).tolist()) == before


def test_trim_before_wrap_can_undo_everything():
    cache = make(max_rollback=1)
    fill(cache, 6)
    cache.trim(6)
    assert cache.offsets().tolist() == [0] and held(cache, SLIDING) == []


def test_device_rollback_and_chunks_longer_than_the_ring():
    """rollback_to runs on the device (lengths never read back); a 30-token chunk (longer than
    the 13-slot ring) still leaves the last 13 positions; memory of sliding layers is fixed."""
    cache = make(max_rollback=4, batch_size=2)
    fill(cache, 30, chunk=30)
    assert held(cache, SLIDING) == list(range(17, 30)) and held(cache, FULL) == list(range(30))
    for _ in range(40):
        fill(cache, 5, chunk=5)
        cache.rollback_to(cache.offset - mx.array([4, 1]))  # ragged rows
    assert cache.offsets().tolist() == [70, 190]
    assert held(cache, FULL, 0) == list(range(70)) and held(cache, FULL, 1) == list(range(190))
    assert held(cache, SLIDING, 1)[-(W + 1):] == list(range(190 - W - 1, 190))
    assert cache.tracks[SLIDING].capacity == W + 1 + 4


def test_rows_join_and_leave():
    a, b = make(), make()
    fill(a, 20)
    fill(b, 5)
    a.extend(b)
    assert a.offsets().tolist() == [20, 5] and held(a, FULL, 1) == list(range(5))
    fill(a, 3)
    one = a.take(1)
    assert one.offsets().tolist() == [8] and held(one, FULL) == list(range(8))
    a.select([0])
    assert a.offsets().tolist() == [23] and held(a, SLIDING) == list(range(10, 23))


def test_a_state_read_out_is_resumed_exactly_and_reads_past_the_ring_raise():
    cache = make(max_rollback=2)
    fill(cache, 40)
    full, sliding = cache.read(0, 40, FULL), cache.read(40 - W - 1, 40, SLIDING)
    assert set(full) == {1} and set(sliding) == {0} and full[1][0].shape[2] == 40
    fill(cache, 60)  # the ring moves on; what was read out stays
    with pytest.raises(CacheError, match="not all held"):
        cache.read(40 - W - 1, 40, SLIDING)
    resumed = make(max_rollback=2)
    resumed.resume(40, full, sliding)
    assert resumed.offsets().tolist() == [40]
    assert held(resumed, FULL) == list(range(40)) and held(resumed, SLIDING) == list(range(40 - W - 1, 40))
    with pytest.raises(CacheError, match="sliding-window"):
        resumed.trim(1)  # the ring holds nothing older than the window: nothing to roll back to
    fill(resumed, 20)
    assert held(resumed, FULL) == list(range(60)) and held(resumed, SLIDING) == list(range(60 - W - 1 - 2, 60))
    with pytest.raises(CacheError, match="empty"):
        resumed.resume(5, full, sliding)


def test_model_rollback_after_wrap_equals_never_having_seen_the_tokens():
    """Feed extra tokens, roll back, continue: logits equal the straight run."""
    model = tiny_target("dense")
    ids = mx.array(reference("dense")["prompt"][None])
    straight = model.make_cache(max_rollback=5)
    model(ids[:, :15], straight)
    expect = model(ids[:, 15:], straight).logits
    for device in (False, True):
        rolled = model.make_cache(max_rollback=5)
        model(ids[:, :15], rolled)
        model(mx.array([[3, 4, 5, 6, 7]]), rolled)  # 15 + 5 > window: wrapped
        if device:
            rolled.rollback_to(mx.array([15]))
        else:
            rolled.trim(5)
        assert np.abs(np.array(model(ids[:, 15:], rolled).logits - expect)).max() < 1e-5


def test_rings_grow_with_the_context_until_they_wrap():
    """A ring is as long as the full buffers (slot = position, nothing moves) until it reaches
    window + 1 + max_rollback; then it wraps as before. Every slot holds its own position
    throughout, rows of different lengths included, and rollback stays exact on both sides."""
    window, rollback = 40, 4
    cache = KVCache([SLIDING, FULL], window, batch_size=2, max_rollback=rollback, step=16)
    size = window + 1 + rollback
    assert cache.ring_size == size and cache.nbytes == 0
    rings = []
    for i in range(30):
        fill(cache, 3, chunk=3)
        ring, full = cache.tracks[SLIDING].capacity, cache.tracks[FULL].capacity
        rings.append(ring)
        assert ring == min(full, size)
        assert held(cache, SLIDING, 1)[-(window + 1):] == list(range(max(0, 3 * i + 3 - window - 1), 3 * i + 3))
        if i % 4 == 3:
            cache.rollback_to(cache.offset - mx.array([3, 1]))  # ragged rows
            fill(cache, 1)
    assert rings == sorted(rings) and len(set(rings)) >= 3 and rings[-1] == size  # grew in steps, then stopped
    cache.rollback_to(cache.offset - rollback)
    length = cache.offsets()[1]
    assert held(cache, SLIDING, 1)[-(window + 1):] == list(range(length - window - 1, length))
    assert held(cache, FULL, 0) == list(range(cache.offsets()[0]))


def test_short_rows_hold_a_short_ring_and_join_longer_ones():
    """Rows joining a batch, leaving it and resumed from a read state keep slot = position while
    their rings are short."""
    window = 40
    short, long = (KVCache([SLIDING, FULL], window, max_rollback=4, step=16) for _ in range(2))
    fill(short, 5)
    fill(long, 60, chunk=20)
    assert short.tracks[SLIDING].capacity == 16 < long.tracks[SLIDING].capacity == window + 5
    long.extend(short)
    assert held(long, SLIDING, 1) == list(range(5)) and held(long, SLIDING, 0) == list(range(60 - 45, 60))
    long.select([1])
    assert long.tracks[SLIDING].capacity == 16 and held(long, SLIDING) == list(range(5))
    state = {kind: long.read(0, 5, kind) for kind in (FULL, SLIDING)}
    resumed = KVCache([SLIDING, FULL], window, max_rollback=4, step=16)
    resumed.resume(5, state[FULL], state[SLIDING])
    fill(resumed, 3)
    assert held(resumed, SLIDING) == list(range(8)) and held(resumed, FULL) == list(range(8))


def test_growing_rings_give_the_same_tokens(monkeypatch):
    """A model whose rings grow in many small steps (4 slots) past its window decodes
    the same tokens as with whole rings, plain and with MTP (independently random drafter)."""
    from conftest import tiny_drafter

    from mlx_mtp.cache import kv as cache_module
    from mlx_mtp.decode.generate import generate_tokens
    from mlx_mtp.models import gemma4

    target, prompt = tiny_target("dense"), reference("dense")["prompt"].tolist()[:5]
    whole = [t for t, _ in generate_tokens(target, prompt, max_tokens=30)]
    monkeypatch.setattr(gemma4, "KVCache", lambda *a, **k: cache_module.KVCache(*a, step=4, **k))
    assert target.make_cache(1, 6).tracks[FULL].capacity == 0
    grown = [t for t, _ in generate_tokens(target, prompt, max_tokens=30)]
    mtp = [t for t, _ in generate_tokens(target, prompt, drafter=tiny_drafter("dense"), draft_tokens=3,
                                         max_tokens=30)]
    assert grown == whole and mtp == whole
