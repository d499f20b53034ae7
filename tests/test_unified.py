"""The 12B (`gemma4_unified`) and its drafter reproduce transformers 5.23 (tests/fixtures/unified, made by
tests/reference/make_unified_fixtures.py): logits, MTP past the sliding window, `suppress_tokens`, and the
encoder-free image and audio embedders."""

import copy
import hashlib
import json
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import BOTH_KERNELS

from mlx_mtp.decode.batch import BatchGenerator
from mlx_mtp.decode.drafters import MTPProposer
from mlx_mtp.decode.generate import generate_tokens, stream_generate
from mlx_mtp.decode.oracle import OracleDrafter
from mlx_mtp.decode.processors import Penalties
from mlx_mtp.decode.sample import SamplingParams
from mlx_mtp.decode.stats import Stats
from mlx_mtp.engine.engine import Engine, Request
from mlx_mtp.formats.images import target_size
from mlx_mtp.loading import load, load_model, load_weights, weight_files
from mlx_mtp.models import gemma4_unified
from mlx_mtp.models.gemma4_unified import embedders_from_weights, image_patches

UNIFIED = Path(__file__).parent / "fixtures" / "unified"
TOL = 1e-4  # fp32 against float64 forwards of the same weights
N_TOKENS = 48  # prompt 20 + 48: far past the sliding window of 8


@lru_cache(maxsize=None)
def ref() -> dict:
    return dict(np.load(UNIFIED / "reference.npz"))


@lru_cache(maxsize=None)
def loaded():
    return load(UNIFIED / "target", drafter=UNIFIED / "drafter")


def target():
    return loaded().target


def prompt() -> list:
    return ref()["prompt"].tolist()


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


def rel_diff(a, b) -> float:
    """Largest difference relative to the reference's largest magnitude (the issue's bar)."""
    return max_diff(a, b) / float(np.abs(np.asarray(b, dtype=np.float64)).max())


def greedy(drafter=None, k="auto", model=None, stats=None, **kw) -> list:
    out = generate_tokens(model or target(), prompt(), drafter=drafter, draft_tokens=k, max_tokens=N_TOKENS,
                          stats=stats, **kw)
    return [t for t, _ in out]


@pytest.fixture
def unsuppressed():
    """The fixture's target with its generation config's `suppress_tokens` forgotten."""
    model = copy.copy(target())
    model.config = copy.copy(model.config)
    model.config.suppress_tokens = ()
    return model


# ---- loading: the unified defaults --------------------------------------------------------------


def test_loads_with_the_unified_defaults():
    model, config, _ = load_model(UNIFIED / "target")
    text = config["text_config"]
    assert "max_position_embeddings" not in text and "hidden_size_per_layer_input" not in text
    cfg = model.config
    assert type(cfg) is gemma4_unified.Config and config["model_type"] == "gemma4_unified"
    assert (cfg.max_position_embeddings, cfg.use_bidirectional_attention) == (262144, "vision")
    assert cfg.hidden_size_per_layer_input == 0 and "embed_tokens_per_layer" not in model.model
    assert (cfg.store_layer("sliding_attention"), cfg.store_layer("full_attention")) == (4, 5)
    assert (cfg.layer_kv_heads(0), cfg.layer_kv_heads(5), cfg.layer_head_dim(5)) == (2, 1, 16)
    assert cfg.suppress_tokens == tuple(ref()["suppress_tokens"].tolist())  # from generation_config.json
    drafter = loaded().drafter
    assert type(drafter.config.text) is gemma4_unified.Config and drafter.config.text.sliding_window == 8


def test_text_only_checkpoint_loads(tmp_path):
    """A `gemma4_unified_text` checkpoint (transformers' Gemma4UnifiedForCausalLM layout, `model.layers.*`)
    is the same decoder: the fixture's text weights under those names give the same logits."""
    config = json.loads((UNIFIED / "target" / "config.json").read_text())["text_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = load_weights(weight_files(UNIFIED / "target"))
    text = {k.replace("model.language_model.", "model."): v for k, v in weights.items() if "language_model" in k}
    mx.save_safetensors(str(tmp_path / "model.safetensors"), text)
    model, config, _ = load_model(tmp_path)
    assert config["model_type"] == "gemma4_unified_text"
    ids = mx.array(ref()["prompt"][None])
    assert np.array_equal(np.array(model(ids).logits), np.array(target()(ids).logits))


# ---- parity with transformers ---------------------------------------------------------------------


@BOTH_KERNELS  # the mx.fast norms and RoPE (a GPU's) as well as the CPU's
def test_prefill_matches_transformers(fused):
    out = target()(mx.array(ref()["prompt"][None]))
    print(f"\n[unified-parity] prefill logits rel {rel_diff(out.logits[0], ref()['logits_exact']):.2e} "
          f"hidden rel {rel_diff(out.hidden[0], ref()['hidden_exact']):.2e}")
    assert rel_diff(out.logits[0], ref()["logits_exact"]) <= TOL
    assert rel_diff(out.hidden[0], ref()["hidden_exact"]) <= TOL


@BOTH_KERNELS
@pytest.mark.parametrize("chunk", [1, 7])
def test_incremental_matches_transformers_past_the_window(chunk, fused):
    model, ids = target(), mx.array(ref()["prompt"][None])
    cache = model.make_cache()
    logits = mx.concatenate([model(ids[:, i: i + chunk], cache).logits for i in range(0, 20, chunk)], axis=1)
    assert rel_diff(logits[0], ref()["logits_exact"]) <= TOL
    assert rel_diff(logits[0], ref()["logits_step"]) <= TOL  # transformers' own incremental decode


def test_store_layers_kv_match_transformers():
    kv = target()(mx.array(ref()["prompt"][None])).shared_kv
    for kind, name, kept in (("sliding_attention", "sliding", 9), ("full_attention", "full", 20)):
        pos = np.array(kv[kind].positions[0])
        slots = np.nonzero(pos >= 0)[0]
        assert sorted(pos[slots].tolist()) == list(range(20 - kept, 20))  # window 8 + 1
        for part, array in (("k", kv[kind].keys), ("v", kv[kind].values)):
            want = ref()[f"kv_{name}_{part}_exact"][:, pos[slots]]
            assert rel_diff(np.array(array[0])[:, slots], want) <= TOL


@BOTH_KERNELS
def test_first_draft_round_matches_transformers(fused):
    """The drafter's first round after prefill, teacher-forced on transformers' drafts."""
    model, drafter, r = target(), loaded().drafter, ref()
    kv = model(mx.array(r["prompt"][None])).shared_kv
    token, hidden = mx.array([int(r["greedy"][0])]), mx.array(r["hidden_exact"][-1:])
    position = mx.array([20], dtype=mx.int32)
    for i, want in enumerate(r["draft_tokens"].tolist()):
        out = drafter.draft_step(model.embed(token), hidden, kv, position)
        assert rel_diff(out.logits[0], r["draft_logits_exact"][i]) <= TOL
        assert rel_diff(out.hidden[0], r["draft_hidden_exact"][i]) <= TOL
        assert int(out.argmax()[0]) == want
        token, hidden = mx.array([want]), out.hidden


def test_greedy_matches_transformers():
    assert greedy() == ref()["greedy"].tolist()


@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_greedy_mtp_equals_plain_and_transformers_assisted(k):
    """The drafter's weights are random and independent of the target's: drafts are often rejected,
    and each rejection rolls the sliding window back."""
    stats = Stats()
    assert greedy(loaded().drafter, k, stats=stats) == ref()["greedy_assisted"].tolist() == ref()["greedy"].tolist()
    assert stats.rounds > 0 and stats.accepted < stats.drafted


def test_greedy_mtp_equals_plain_with_partial_acceptance():
    """Drafts right with probability 0.7 (`OracleDrafter`): blocks accepted in part, then rolled back,
    past the window; its wrong drafts are unprocessed, so some are suppressed tokens the verify rejects."""
    truth, stats = ref()["greedy"].tolist(), Stats()
    drafter = OracleDrafter(truth, 20, 128, 0.7)
    assert greedy(drafter, 4, stats=stats) == truth
    assert 0 < stats.accepted < stats.drafted
    assert sum(1 for a, d in zip(stats.accepted_at, stats.drafted_at) if 0 < a < d) >= 2


# ---- suppress_tokens ------------------------------------------------------------------------------


def suppressed() -> set:
    return set(ref()["suppress_tokens"].tolist())


def test_suppress_tokens_change_the_output(unsuppressed):
    """Without its generation config's suppression the target emits those tokens (transformers agrees)."""
    free = greedy(model=unsuppressed)
    assert free == ref()["greedy_unsuppressed"].tolist() and set(free) & suppressed()
    assert greedy(loaded().drafter, 3, model=unsuppressed) == free


def test_suppressed_tokens_are_never_drafted_or_emitted(monkeypatch, unsuppressed):
    """A drafter that prefers the suppressed tokens (their tied-head rows scaled up) drafts them only
    where they are not suppressed; with them suppressed, neither the drafts nor the output hold them."""
    drafter = copy.deepcopy(loaded().drafter)
    rows = mx.array(sorted(suppressed()))
    drafter.model.embed_tokens.weight[rows] = drafter.model.embed_tokens.weight[rows] * 40
    drafted = []
    propose = MTPProposer.propose

    def spy(self, *args, **kwargs):
        drafts = propose(self, *args, **kwargs)
        drafted.extend(np.array(drafts.tokens).reshape(-1).tolist())
        return drafts

    monkeypatch.setattr(MTPProposer, "propose", spy)
    assert set(greedy(drafter, 3, model=unsuppressed)) & suppressed() and set(drafted) & suppressed()
    drafted.clear()
    assert greedy(drafter, 3) == ref()["greedy"].tolist()
    assert drafted and not set(drafted) & suppressed()


def test_sampled_rows_never_emit_suppressed_tokens(unsuppressed):
    hot = SamplingParams(temperature=1.5)
    runs = [greedy(loaded().drafter, 3, model=model, sampling=hot, seed=seed)
            for model in (unsuppressed, target()) for seed in range(3)]
    assert any(set(run) & suppressed() for run in runs[:3])  # they would be sampled
    assert not any(set(run) & suppressed() for run in runs[3:])


def test_every_front_end_suppresses():
    """`stream_generate` (a `load()`ed pair), the `Engine`, and a `BatchGenerator` used directly, several
    rows with their own logit bias: the one place rows are made (`BatchGenerator.insert`) bans the tokens
    for all of them."""
    text = [e.token for e in stream_generate(loaded(), prompt(), max_tokens=N_TOKENS) if e.token is not None]
    assert text == ref()["greedy"].tolist()
    with Engine(loaded()) as engine:
        assert list(engine.submit(Request(prompt(), max_tokens=N_TOKENS)).result(60).tokens) == text
    gen = BatchGenerator(target(), loaded().drafter, draft_tokens=2)
    favoured = sorted(suppressed())[0]
    uids = [gen.insert(prompt(), max_tokens=24), gen.insert(prompt()[3:], max_tokens=24),
            gen.insert(prompt(), max_tokens=24, penalties=Penalties(logit_bias={favoured: 50.0}))]
    tokens = {uid: [] for uid in uids}
    while gen.busy:
        for event in gen.step():
            tokens[event.uid] += event.tokens
    assert tokens[uids[0]] == ref()["greedy"][:24].tolist()
    assert all(tokens[uid] and not set(tokens[uid]) & suppressed() for uid in uids)


# ---- the encoder-free embedders ---------------------------------------------------------------------


@lru_cache(maxsize=None)
def embedders():
    config = json.loads((UNIFIED / "target" / "config.json").read_text())
    return embedders_from_weights(config, load_weights(weight_files(UNIFIED / "target")))


@BOTH_KERNELS
def test_image_embedder_matches_transformers(fused):
    """Each image alone over its real rows (padding rows, (-1, -1), dropped), a flat patch among them."""
    r = ref()
    got = []
    for codes, positions in zip(r["image_codes"], r["image_positions"]):
        real = (positions >= 0).all(-1)
        got.append(embedders().image(codes[real].astype(np.float32) * gemma4_unified.RESCALE, positions[real]))
    got = mx.concatenate(got)
    print(f"\n[unified-parity] image embedder rel {rel_diff(got, r['image_features_exact']):.2e}")
    assert rel_diff(got, r["image_features_exact"]) <= TOL


@BOTH_KERNELS
def test_audio_embedder_matches_transformers(fused):
    r = ref()
    for frames, mask, want in zip(r["audio_frames"], r["audio_mask"], r["audio_features_exact"]):
        got = embedders().audio(frames[mask])
        assert rel_diff(got, want[mask]) <= TOL
    silent = embedders().audio(np.zeros((1, 640), np.float32))
    assert not np.array(silent).any()  # digital silence embeds to zero


def test_image_patches_are_transformers_merged_patches():
    """48-pixel raster patches = transformers' 16-pixel patches merged 3x3 (`patches_merge`), bit for bit,
    the processor's rescale included."""
    p = dict(np.load(UNIFIED / "processor.npz"))
    pixels, positions = image_patches(p["merge_codes"])
    assert pixels.dtype == np.float32 and pixels.shape == (6, 6912)
    assert hashlib.sha256(pixels.tobytes()).hexdigest() == str(p["merge_pixels_sha256"])
    assert np.array_equal(positions, p["merge_positions"])


def test_soft_token_counts_are_transformers():
    """The 12B's resize target (hence its soft-token count, one per 48-pixel block) is gemma4's
    `formats.images.target_size`: equal to transformers' unified processor for every size and budget."""
    sizes = np.load(UNIFIED / "processor.npz")["sizes"]
    for h, w, budget, th, tw in sizes.tolist():
        assert target_size(h, w, budget) == (th, tw), (h, w, budget)

