"""The MLX MTP drafter reproduces transformers' Gemma4AssistantForCausalLM (first draft round)."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import BOTH_KERNELS, reference, tiny_drafter, tiny_target

from mlx_mtp.models.base import SharedKV

TOL = 1e-4
pytestmark = [pytest.mark.usefixtures("fused"), BOTH_KERNELS]  # every check on both kernel branches


def reference_kv(ref):
    """The reference's own store-layer K/V for the 20 prompt positions, as our cache exposes it."""
    pos = mx.arange(20, dtype=mx.int32)[None]
    return {
        kind: SharedKV(mx.array(ref[f"kv_{name}_k_exact"])[None], mx.array(ref[f"kv_{name}_v_exact"])[None], pos)
        for kind, name in (("sliding_attention", "sliding"), ("full_attention", "full"))
    }


def test_drafter_logits_and_hidden_match(variant):
    """Each step gets exactly the reference's inputs: token, hidden state (the target's for
    step 1, the previous step's output after), and the target's K/V."""
    target, drafter, ref = tiny_target(variant), tiny_drafter(variant), reference(variant)
    kv, position = reference_kv(ref), mx.array([20], dtype=mx.int32)
    tokens = [int(ref["greedy"][0]), *ref["draft_tokens"][:3].tolist()]
    hiddens = [ref["hidden_exact"][-1], *ref["draft_hidden_exact"][:3]]
    for step, (token, hidden) in enumerate(zip(tokens, hiddens)):
        out = drafter.draft_step(target.embed(mx.array([[token]]))[:, 0], mx.array(hidden)[None], kv, position)
        exact = ref["draft_logits_exact"][step]
        assert np.abs(np.array(out.hidden[0]) - ref["draft_hidden_exact"][step]).max() <= TOL
        if out.token_ids is None:
            assert np.abs(np.array(out.logits[0]) - exact).max() <= TOL
        else:  # centroid head: the selected tokens and their logits; every other token excluded
            ids = np.array(out.token_ids[0])
            assert sorted(ids.tolist()) == ref["draft_selected_ids"][step].tolist()
            assert np.abs(np.array(out.logits[0]) - exact[ids]).max() <= TOL
            assert np.isneginf(np.delete(np.array(out.full_logits(128)[0]), ids)).all()


def test_drafted_tokens_match_reference_candidate_generator(variant):
    """Free-running argmax drafts equal what transformers' candidate generator proposed."""
    target, drafter, ref = tiny_target(variant), tiny_drafter(variant), reference(variant)
    cache = target.make_cache(max_rollback=8)
    prefill = target(mx.array([ref["prompt"].tolist()]), cache)
    token, hidden, drafted = mx.array(ref["greedy"][:1]), prefill.hidden[:, -1], []
    for _ in range(4):
        out = drafter.draft_step(target.embed(token[None])[:, 0], hidden, prefill.shared_kv, mx.array([20]))
        token, hidden = out.argmax(), out.hidden
        drafted.append(int(token.item()))
    assert drafted == ref["draft_tokens"].tolist()


def test_centroid_head_works_with_quantized_embedding():
    """Another MLX port crashes here: indexing a QuantizedEmbedding's weight."""
    import copy

    import mlx.nn as nn

    drafter = copy.deepcopy(tiny_drafter("e2b"))
    nn.quantize(drafter, group_size=32, bits=8)
    assert isinstance(drafter.model.embed_tokens, nn.QuantizedEmbedding)
    target, ref = tiny_target("e2b"), reference("e2b")
    token = target.embed(mx.array([[int(ref["greedy"][0])]]))[:, 0]
    out = drafter.draft_step(token, mx.array(ref["hidden_exact"][-1:]), reference_kv(ref), mx.array([20]))
    outs_q = np.array(out.logits[0])
    ids = np.array(out.token_ids[0])
    assert np.abs(outs_q - ref["draft_logits_exact"][0][ids]).max() < 0.2  # 8-bit weights: approximate, but the same sparse head runs
