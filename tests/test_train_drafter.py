"""apps.train_drafter on the tiny dense fixture target: the batched training forward equals
the drafter's inference steps, training learns, and the saved drafter loads and drafts better."""

from functools import lru_cache

import mlx.core as mx
import numpy as np
import pytest

from conftest import TINY, tiny_target
from apps import train_drafter
from mlx_mtp.learn import distill as td
from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.loading import load_model
from mlx_mtp.decode.stats import Stats

K = 3


def fresh_drafter(target, seed=0, layers=4):
    mx.random.seed(seed)
    config = td.drafter_config(target, hidden=64, layers=layers, heads=4)
    return td.new_drafter(config), config


@lru_cache(maxsize=None)
def greedy_text():
    """The tiny target's own greedy continuations of random prompts: (train stream, eval prompts)."""
    target = tiny_target("dense")
    rng = np.random.default_rng(0)
    stream, prompts = [], []
    for i in range(11):
        prompt = rng.integers(3, 128, 12).tolist()
        if i >= 8:
            prompts.append(prompt)
        else:
            stream.append(prompt + [t for t, _ in generate_tokens(target, prompt, max_tokens=40)])
    return np.concatenate([np.asarray(s, dtype=np.int32) for s in stream]), prompts


def acceptance(target, drafter, prompts):
    stats = Stats()
    for prompt in prompts:
        plain = [t for t, _ in generate_tokens(target, prompt, max_tokens=24)]
        mtp = [t for t, _ in generate_tokens(target, prompt, drafter=drafter, draft_tokens=K,
                                              max_tokens=24, stats=stats)]
        assert mtp == plain
    return stats.acceptance_length


@pytest.mark.parametrize("variant", ["dense", "e2b"])
def test_unroll_equals_draft_steps(variant):
    """Training row p, step j == the inference draft_step at position p (masks past the window)."""
    target = load_model(TINY / variant / "target")[0]
    drafter, _ = fresh_drafter(target)
    L = 24  # > sliding window 8 + 1: the sliding mask matters
    tokens = mx.array(np.random.default_rng(1).integers(3, 128, (2, L)), dtype=mx.int32)
    embeds, hidden, _, shared = td.target_pass(target, tokens)
    rows = td.unroll(drafter, embeds, hidden, shared, K)
    for b in range(2):
        for p in (1, 9, 10, 21):
            out = target(tokens[b : b + 1, :p])
            h, pos = out.hidden[:, -1], mx.array([p], dtype=mx.int32)
            for j in range(K):
                step = drafter.draft_step(target.embed(tokens[b : b + 1, p + j : p + j + 1])[:, 0], h,
                                          out.shared_kv, pos)
                np.testing.assert_allclose(np.array(step.logits[0]), np.array(rows[j][b, p - 1]), atol=3e-4)
                h = step.hidden


def test_train_save_load_and_acceptance(tmp_path):
    target = tiny_target("dense")
    stream, prompts = greedy_text()
    drafter, config = fresh_drafter(target, layers=2)  # [S, F]: half the cost of 4 layers
    before = acceptance(target, drafter, prompts)
    lines = []
    log = td.train(target, drafter, stream, steps=25, k=K, seq=32, batch=8, lr=3e-2, warmup=3,
                   log_every=10, print_fn=lines.append)
    first, last = log["steps"][0], log["steps"][-1]
    # The tiny random target's greedy text is close to noise: a few dozen steps give a small
    # but clear gain (agreement ~0 -> ~0.1 per step); the real demo pair reaches ~0.8.
    assert last["ema_loss"] < first["loss"] - 0.5
    assert np.mean(last["ema_agreement"]) > np.mean(first["agreement"]) + 0.04
    assert any("agreement" in line for line in lines)

    td.save_drafter(drafter, config, tmp_path / "drafter", extra=log)
    loaded, cfg, _ = load_model(tmp_path / "drafter")
    assert cfg["model_type"] == "gemma4_assistant"
    loaded.check_target(target)
    tokens = mx.array(stream[None, :20])
    embeds, hidden, _, shared = td.target_pass(target, tokens)
    for a, b in zip(td.unroll(drafter, embeds, hidden, shared, K), td.unroll(loaded, embeds, hidden, shared, K)):
        np.testing.assert_array_equal(np.array(a), np.array(b))

    after = acceptance(target, loaded, prompts)
    assert after >= before + 0.04, (before, after)


def test_cli_adapts_an_existing_drafter(tmp_path):
    """`python -m apps.train_drafter --init DIR`: adapt the fixture drafter on .npy token ids."""
    stream, _ = greedy_text()
    np.save(tmp_path / "ids.npy", stream.astype(np.uint16))
    log = train_drafter.main(["--target", str(TINY / "dense" / "target"), "--init", str(TINY / "dense" / "drafter"),
                   "--data", str(tmp_path / "ids.npy"), "--val-data", str(tmp_path / "ids.npy"),
                   "--out", str(tmp_path / "adapted"), "--steps", "5", "--seq", "32", "--batch", "4",
                   "--log-every", "5"])
    assert log["init"] and "val" in log
    drafter, _, _ = load_model(tmp_path / "adapted")
    drafter.check_target(tiny_target("dense"))
    assert (tmp_path / "adapted" / "training.json").exists()


def test_cli_saves_every_n_steps_so_a_stopped_run_keeps_its_work(tmp_path, monkeypatch):
    """--save-every 2 over 5 steps: the drafter is saved at steps 2 and 4, then once more at the end."""
    stream, _ = greedy_text()
    np.save(tmp_path / "ids.npy", stream.astype(np.uint16))
    saved, save = [], train_drafter.save_drafter

    def keep(drafter, config, out, extra=None, dtype=None):
        saved.append(extra.get("checkpoint_at", "end"))
        save(drafter, config, out, extra, dtype)
        assert load_model(out)[0] is not None  # each save is a whole drafter

    monkeypatch.setattr(train_drafter, "save_drafter", keep)
    train_drafter.main(["--target", str(TINY / "dense" / "target"), "--init", str(TINY / "dense" / "drafter"),
                        "--data", str(tmp_path / "ids.npy"), "--out", str(tmp_path / "adapted"), "--steps", "5",
                        "--seq", "32", "--batch", "4", "--save-every", "2"])
    assert saved == [2, 4, "end"]


def test_centroid_head_drafter_trains(tmp_path):
    """An E2B-style drafter (ordered embeddings / centroid head) adapts too: its centroid scores
    get a cluster loss, token_ordering survives the save, and loss goes down."""
    target = load_model(TINY / "e2b" / "target")[0]
    drafter, config, _ = load_model(TINY / "e2b" / "drafter")
    ordering = np.array(drafter.masked_embedding.token_ordering)
    clusters = np.array(td.cluster_of(drafter))
    per = ordering.size // drafter.masked_embedding.num_centroids
    assert (clusters[ordering] == np.arange(ordering.size) // per).all()
    stream = np.random.default_rng(0).integers(3, 128, 2000).astype(np.int32)
    log = td.train(target, drafter, stream, steps=12, k=2, seq=24, batch=4, lr=1e-2, warmup=2, log_every=11,
                   print_fn=lambda s: None)
    assert log["steps"][-1]["ema_loss"] < log["steps"][0]["loss"]
    td.save_drafter(drafter, config, tmp_path / "d")
    loaded = load_model(tmp_path / "d")[0]
    np.testing.assert_array_equal(np.array(loaded.masked_embedding.token_ordering), ordering)
    loaded.check_target(target)
