"""The MLX target reproduces transformers 5.23 (fixtures from tests/reference/make_fixtures.py)."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import BOTH_KERNELS, TINY, reference, tiny_target

from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.loading import load_model

TOL = 1e-4  # fp32; references are float64 forwards of the same weights
pytestmark = [pytest.mark.usefixtures("fused"), BOTH_KERNELS]  # every check on both kernel branches


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


def prompt(variant):
    return mx.array(reference(variant)["prompt"][None])


def test_full_prefill_matches_reference(variant):
    model, ref = tiny_target(variant), reference(variant)
    out = model(prompt(variant))
    assert max_diff(out.logits[0], ref["logits_exact"]) <= TOL
    assert max_diff(out.hidden[0], ref["hidden_exact"]) <= TOL


@pytest.mark.parametrize("chunk", [1, 3, 7, 16])
def test_chunked_and_incremental_match_reference(variant, chunk):
    """chunk=1 is token-by-token decoding; the 20-token prompt is longer than the window 8."""
    model, ref = tiny_target(variant), reference(variant)
    ids, cache = prompt(variant), model.make_cache()
    logits = [model(ids[:, i : i + chunk], cache).logits for i in range(0, ids.shape[1], chunk)]
    assert max_diff(mx.concatenate(logits, axis=1)[0], ref["logits_exact"]) <= TOL


def test_shared_kv_is_store_layers_kv(variant):
    model, ref = tiny_target(variant), reference(variant)
    kv = model(prompt(variant)).shared_kv
    for kind, name, retained in (("sliding_attention", "sliding", 9), ("full_attention", "full", 20)):
        pos = np.array(kv[kind].positions[0])
        slots = np.nonzero(pos >= 0)[0]
        assert sorted(pos[slots].tolist()) == list(range(20 - retained, 20))  # window 8 + 1, no rollback
        keys, values = np.array(kv[kind].keys[0]), np.array(kv[kind].values[0])
        assert max_diff(keys[:, slots], ref[f"kv_{name}_k"][:, pos[slots]]) <= TOL
        assert max_diff(values[:, slots], ref[f"kv_{name}_v"][:, pos[slots]]) <= TOL


def test_greedy_decode_matches_transformers_past_the_window(variant):
    model, ref = tiny_target(variant), reference(variant)
    tokens = [t for t, _ in generate_tokens(model, ref["prompt"].tolist(), max_tokens=48)]
    assert tokens == ref["greedy"].tolist()


def test_multimodal_wrapper_loads_text_model():
    model, config, _ = load_model(TINY / "dense" / "wrapper")
    assert config["model_type"] == "gemma4"
    out = model(prompt("dense"))
    assert max_diff(out.logits[0], reference("dense")["logits_exact"]) <= TOL


def test_sharded_checkpoint_with_index_loads():
    files = sorted(p.name for p in (TINY / "moe" / "target").glob("*.safetensors"))
    assert len(files) >= 2 and (TINY / "moe" / "target" / "model.safetensors.index.json").exists()
    assert tiny_target("moe").config.enable_moe_block


def test_prompt_processing_runs_kv_shared_layers_only_where_used(monkeypatch):
    """E2B/E4B: KV-shared layers store nothing, so in prompt processing they run only on the
    last position (whose output is used); logits and the cache are those of the full forward."""
    from mlx_mtp.models import gemma4

    model, ref = tiny_target("e2b"), reference("e2b")
    ids = prompt("e2b")
    seen = {}
    original = gemma4.DecoderLayer.__call__

    def spy(self, x, *args, **kwargs):
        seen.setdefault(id(self), []).append(x.shape[0])  # tokens: the rows of x (one prompt)
        return original(self, x, *args, **kwargs)

    full_cache, chunk_cache = model.make_cache(), model.make_cache()
    full = model(ids, full_cache)
    monkeypatch.setattr(gemma4.DecoderLayer, "__call__", spy)
    model(ids[:, :12], chunk_cache, keep=0)
    last = model(ids[:, 12:], chunk_cache, keep=1)
    first_shared = model.config.first_shared_layer
    assert first_shared < len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        assert seen[id(layer)] == ([12, 8] if i < first_shared else [1])  # chunk 1 skips them entirely
    assert max_diff(last.logits[0, -1], ref["logits_exact"][-1]) <= TOL
    assert max_diff(last.logits[0, -1], full.logits[0, -1]) <= TOL
    for kind in ("sliding_attention", "full_attention"):
        a, b = full.shared_kv[kind], last.shared_kv[kind]
        assert np.array_equal(np.array(a.positions), np.array(b.positions))
        assert max_diff(a.keys, b.keys) <= TOL and max_diff(a.values, b.values) <= TOL
