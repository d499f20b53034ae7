"""Generate the tiny Gemma 4 reference fixtures used by the mlx_mtp parity tests.

Ground truth is the Hugging Face transformers implementation (pinned: transformers==5.23.0,
torch==2.13.0, CPU, float32). Usage:

    python tests/reference/make_fixtures.py [--out tests/fixtures/tiny]

The script is deterministic (fixed torch seed, single CPU thread): running it twice gives
bitwise-identical reference.npz arrays.

What it builds (all fp32, vocab 128, hidden 64, 4 q-heads, 2 kv-heads, head_dim 16,
global_head_dim 32, sliding_window 8, softcap 30, tied embeddings, 6 layers [S,S,F,S,S,F]):

* ``dense`` target: 31B-like. ``attention_k_eq_v=True``, one global kv head, no PLE, no KV sharing.
* ``moe`` target: 26B-A4B-like. Same attention as ``dense`` plus a 4-expert top-2 MoE block
  running in parallel with the dense MLP (intermediate 96, expert intermediate 32). Saved sharded.
* ``e2b`` target: E2B-like. Per-layer embeddings (P=16, V_ple=128), last 3 layers KV-shared
  (store layers are 1 (sliding) and 2 (full)), double-wide MLP in the shared layers.
* one drafter (``Gemma4AssistantForCausalLM``) per target: hidden 32, 4 layers [S,S,S,F], all
  KV-shared, attention geometry mirroring the target. ``dense``/``moe`` get a tied dense LM head;
  ``e2b`` gets the ordered (centroid) head with 8 centroids, top-2 (so 32 candidate ids a step).
* ``dense/wrapper``: a *real* tiny ``Gemma4ForConditionalGeneration`` (tiny vision tower with
  clipped linears, no audio tower) whose language model weights are exactly the ``dense`` target's.
  Its text config additionally sets ``use_bidirectional_attention="vision"`` like the released
  31B; for text-only input that does not change the output (checked below).

Config adjustments relative to the brief: none were needed; transformers accepts every config as
specified (only with the kv_sharing_modes patch from apps.hf_compat, which the assistant needs to be
constructible at all). The MoE ``intermediate_size=96`` is the dense ("shared expert") MLP width.
The drafters' text configs set ``final_logit_softcapping=None`` (as the official assistant
configs do; the assistant forward never softcaps anyway). All configs use pad/eos/bos = 0/1/2.
Note that transformers does not create (and so does not save) k_proj/v_proj/k_norm for the
KV-shared e2b layers 3-5, whereas official E2B checkpoints contain them.

Random initialisation is replaced by a perturbation (see ``perturb_``) so that no path is
near-identity: linear/expert weights ~ N(0, 1/fan_in) (std 1/sqrt(fan_in)), main embeddings
~ N(0, 1/H) (so embed*sqrt(H) ~ N(0, 1)), per-layer embeddings ~ N(0, 1/P), RMSNorm weights
1 + 0.3 N(0,1) (the final norm too: FINAL_NORM_GAIN = 1, pre-softcap logit std about 1; a larger
gain makes fp32 noise, in transformers as in MLX, approach the 1e-4 parity bar), layer_scalar ~ U(0.5, 1.5), router.scale and
router.per_expert_scale ~ U(0.5, 1.5). The drafter's token_ordering is a random permutation.

Outputs per variant, under ``<out>/<variant>/``: ``target/`` and ``drafter/`` (save_pretrained,
fp32 safetensors; ``moe/target`` sharded with an index), ``reference.npz`` and ``meta.json``.
See tests/reference/README.md.

reference.npz (float32 unless noted; T = 20 prompt tokens, p = 20 = bonus position):
  prompt int32 [T]              ids in [3, 128). Drawn again (deterministically) until the 48-token
                                greedy continuation has no id < 3 (no eos/pad/bos, so stopping at
                                eos is moot) and at least 16 distinct tokens.
  logits_full [T, V]            one forward over the prompt (softcapped model output)
  hidden_full [T, H]            hidden_states[-1] = post-final-norm = lm_head input;
                                softcap(lm_head(hidden_full)) == logits_full is asserted
  logits_step [T, V]            prompt fed one token at a time through the HF DynamicCache
  kv_{sliding,full}_{k,v}       shared_kv_states of the store layers (K after k_norm+RoPE, V after
                                v_norm), batch dropped: [n_kv, T, head_dim]
  greedy, greedy_assisted int32 [48]  generate(do_sample=False), new tokens only; asserted equal
  draft_inputs_h [H]            hidden_full[-1], the h fed with the bonus token b = greedy[0]
  draft_logits [4, V]           drafter logits per step (for the ordered head: the scattered full
                                vocab row, non-selected entries = min(selected) - 1)
  draft_hidden [4, H]           post_projection output per step (next step's h)
  draft_tokens int32 [4]        argmax per step
  drafter_logits_raw_hidden [4, 32]  drafter's final-norm output (lm_head / centroid input)
  draft_selected_ids int32 [4, 32]   e2b only: ids picked by the centroid head, sorted ascending
Each drafting step, as SinglePositionMultiTokenCandidateGenerator does it: inputs_embeds =
concat(target.get_input_embeddings()(tok) [scaled by sqrt(H); asserted], h), position_ids=[[p]],
shared_kv_states = prefill K/V sliced to the first p+1 (= all 20) positions, attention_mask =
ones(1, p+1) (what generate passes), use_cache=False.

How the drafter reference is cross-checked against transformers' own MTP loop: during
``target.generate(..., assistant_model=drafter)`` we wrap
``SinglePositionMultiTokenCandidateGenerator.get_candidates`` (a monkeypatch on the class for the
duration of that call) and record the first round that returns candidates (the round right after
prefill). Its candidate tokens must equal ``draft_tokens`` and its drafter logits must equal
``draft_logits`` bitwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys

import numpy as np
import torch

import transformers
from transformers import (
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    Gemma4VisionConfig,
)
from transformers.generation import candidate_generator as _cg

from apps.hf_compat import patch_kv_sharing_modes

SEED = 1234
VARIANT_SEED_OFFSET = {"dense": 0, "moe": 1, "e2b": 2}
TRANSFORMERS_VERSION = "5.23.0"
TORCH_VERSION = "2.13.0"

# transformers 5.23.0's Gemma4TextConfig.kv_sharing_modes has two bugs that break every
# Gemma4Assistant and unshared targets; apps.hf_compat explains and fixes both.
patch_kv_sharing_modes()

# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------
S, F = "sliding_attention", "full_attention"
LAYER_TYPES = [S, S, F, S, S, F]
VOCAB = 128
HIDDEN = 64
PROMPT_LEN = 20
NEW_TOKENS = 48
NUM_DRAFT = 4
MIN_DISTINCT = 16
EMBED_GAIN = 1.0  # std of embed*sqrt(H) (the residual stream's input scale)
FINAL_NORM_GAIN = 1.0  # the final RMSNorm scale is FINAL_NORM_GAIN * (1 + 0.3 N(0,1)); with the tied
# head this sets the pre-softcap logit std (about 1). Putting that gain into the embedding instead
# makes the input embedding dominate the residual stream and greedy decoding repeats one token.

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=6,
    layer_types=list(LAYER_TYPES),
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    sliding_window=8,
    max_position_embeddings=512,
    final_logit_softcapping=30.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_activation="gelu_pytorch_tanh",
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
NO_PLE = dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
K_EQ_V = dict(attention_k_eq_v=True, num_global_key_value_heads=1)


def target_config(variant: str) -> Gemma4TextConfig:
    if variant == "dense":
        return Gemma4TextConfig(**COMMON, **NO_PLE, **K_EQ_V, num_kv_shared_layers=0, intermediate_size=128)
    if variant == "moe":
        return Gemma4TextConfig(
            **COMMON, **NO_PLE, **K_EQ_V, num_kv_shared_layers=0, intermediate_size=96,
            enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        )
    if variant == "e2b":
        return Gemma4TextConfig(
            **COMMON, hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
            num_kv_shared_layers=3, use_double_wide_mlp=True, attention_k_eq_v=False,
            intermediate_size=128,
        )
    raise ValueError(variant)


def drafter_config(variant: str) -> Gemma4AssistantConfig:
    text = dict(
        COMMON,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        layer_types=[S, S, S, F],
        final_logit_softcapping=None,  # the assistant forward never softcaps (official configs: null)
        num_kv_shared_layers=4,
        **NO_PLE,
    )
    if variant in ("dense", "moe"):
        text.update(K_EQ_V)
    ordered = variant == "e2b"
    extra = dict(num_centroids=8, centroid_intermediate_top_k=2) if ordered else {}
    return Gemma4AssistantConfig(
        text_config=Gemma4TextConfig(**text),
        backbone_hidden_size=HIDDEN,
        use_ordered_embeddings=ordered,
        **extra,
    )


# ---------------------------------------------------------------------------------------------
# Weight perturbation
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def perturb_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Overwrite every parameter (and layer_scalar) with well-scaled random values, in
    named_parameters() order, drawing from ``gen``."""

    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    def uniform(shape, lo, hi):
        return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float32)

    for name, p in model.named_parameters():
        if name.endswith("embed_tokens_per_layer.weight"):  # [V_ple, L*P], scaled by sqrt(P) on lookup
            per_layer = model.config.get_text_config().hidden_size_per_layer_input
            p.copy_(randn(p.shape) / math.sqrt(per_layer))
        elif name.endswith("embed_tokens.weight"):  # [V, H], scaled by sqrt(H) on lookup; tied LM head
            p.copy_(randn(p.shape) * EMBED_GAIN / math.sqrt(p.shape[1]))
        elif name.endswith("router.scale") or name.endswith("router.per_expert_scale"):
            p.copy_(uniform(p.shape, 0.5, 1.5))
        elif name in ("model.norm.weight", "model.language_model.norm.weight"):  # final norm -> tied head
            p.copy_(FINAL_NORM_GAIN * (1.0 + 0.3 * randn(p.shape)))
        elif p.ndim == 1:  # RMSNorm scales (text norms, q/k norms, PLE norms)
            p.copy_(1.0 + 0.3 * randn(p.shape))
        elif p.ndim in (2, 3):  # Linear [out, in]; experts gate_up [E, 2I, H], down [E, H, I]
            p.copy_(randn(p.shape) / math.sqrt(p.shape[-1]))
        elif p.ndim == 4:  # vision patch conv etc., if any
            p.copy_(randn(p.shape) / math.sqrt(p[0].numel()))
        else:
            raise RuntimeError(f"unhandled parameter {name} {tuple(p.shape)}")
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(uniform(b.shape, 0.5, 1.5))


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


def f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy().astype(np.float32, copy=True)


def i32(t) -> np.ndarray:
    return np.asarray(t.detach().cpu().numpy() if torch.is_tensor(t) else t, dtype=np.int32).copy()


@contextlib.contextmanager
def record_candidates(store: list):
    """Wrap the real MTP candidate generator and record each non-empty round's output."""
    orig = _cg.SinglePositionMultiTokenCandidateGenerator.get_candidates

    def wrapped(self, input_ids, *args, **kwargs):
        cand, logits = orig(self, input_ids, *args, **kwargs)
        if logits is not None and cand.shape[1] > input_ids.shape[1]:
            store.append((input_ids.shape[1], cand[0, input_ids.shape[1]:].clone(), logits[0].clone()))
        return cand, logits

    _cg.SinglePositionMultiTokenCandidateGenerator.get_candidates = wrapped
    try:
        yield
    finally:
        _cg.SinglePositionMultiTokenCandidateGenerator.get_candidates = orig


def safetensor_keys(directory: str) -> dict:
    """{filename: {key: [dtype, shape]}} for every safetensors file in ``directory``."""
    from safetensors import safe_open

    out = {}
    for fn in sorted(os.listdir(directory)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(directory, fn), "pt") as f:
                out[fn] = {k: [str(f.get_slice(k).get_dtype()), list(f.get_slice(k).get_shape())] for k in f.keys()}
    return out


def greedy_ids(model, prompt: torch.Tensor, **kw) -> torch.Tensor:
    out = model.generate(
        prompt, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=0,
        pad_token_id=0, eos_token_id=1, **kw,
    )
    return out[0, prompt.shape[1]:]


# ---------------------------------------------------------------------------------------------
# Per-variant work
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def build_variant(variant: str, out_dir: str, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)

    target = Gemma4ForCausalLM(target_config(variant)).eval()
    perturb_(target, gen)
    drafter = Gemma4AssistantForCausalLM(drafter_config(variant)).eval()
    perturb_(drafter, gen)
    if drafter.config.use_ordered_embeddings:
        # _init_weights zero-fills token_ordering (every centroid would map to token 0).
        drafter.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB, generator=gen))
    drafter.generation_config.num_assistant_tokens = NUM_DRAFT
    drafter.generation_config.num_assistant_tokens_schedule = "constant"

    tcfg = target.config
    cap = tcfg.final_logit_softcapping
    modes = tcfg.kv_sharing_modes
    store = {t: max(i for i, m in enumerate(modes) if m == "store" and tcfg.layer_types[i] == t) for t in (S, F)}

    # The prompt: tokens in [3, 128). Re-draw (deterministically) until the 48-token greedy
    # continuation contains no eos/pad/bos token (so "stop at eos" and "always generate 48" agree)
    # and is varied (at least MIN_DISTINCT distinct tokens, so it is not stuck on one token).
    for attempt in range(100):
        prompt = torch.randint(3, VOCAB, (1, PROMPT_LEN), generator=gen)
        greedy = greedy_ids(target, prompt)
        if (greedy.shape[0] == NEW_TOKENS and not bool((greedy < 3).any())
                and len(set(greedy.tolist())) >= MIN_DISTINCT):
            break
    else:
        raise RuntimeError("could not find a prompt whose greedy continuation avoids special tokens")

    # --- one full forward (prefill, as generate does it) ------------------------------------
    out = target(prompt, use_cache=True, output_hidden_states=True, return_shared_kv_states=True)
    logits_full = out.logits[0]
    hidden_full = out.hidden_states[-1][0]
    assert torch.equal(hidden_full, target.model(prompt).last_hidden_state[0])
    raw_logits = target.lm_head(hidden_full)
    recon = softcap(raw_logits, cap)
    recon_err = (recon - logits_full).abs().max().item()
    assert recon_err < 1e-5, recon_err
    kv = out.shared_kv_states
    assert set(kv) == {S, F}, kv.keys()

    # --- one token at a time with the HF cache ----------------------------------------------
    cache = None
    step_logits = []
    for i in range(PROMPT_LEN):
        o = target(prompt[:, i : i + 1], past_key_values=cache, use_cache=True)
        cache = o.past_key_values
        step_logits.append(o.logits[0, -1])
    logits_step = torch.stack(step_logits)
    step_err = (logits_step - logits_full).abs().max().item()
    assert step_err < 1e-3, step_err  # fp32 accumulation-order noise only

    # --- assisted greedy (+ record the real candidate generator's first round) --------------
    rounds: list = []
    with record_candidates(rounds):
        greedy_assisted = greedy_ids(target, prompt, assistant_model=drafter)
    assert torch.equal(greedy_assisted, greedy), (greedy, greedy_assisted)
    assert rounds, "candidate generator produced no candidates"

    # --- manual first drafting round, exactly as SinglePositionMultiTokenCandidateGenerator -----
    emb = target.get_input_embeddings()
    tok = greedy[:1].view(1, 1)  # the bonus token b, sitting at position p
    p = PROMPT_LEN
    # check: the target's input embedding is the *scaled* one (embed * sqrt(H))
    assert torch.equal(emb(tok), target.model.embed_tokens.weight[tok] * torch.tensor(math.sqrt(HIDDEN)))
    h = hidden_full[-1].view(1, 1, HIDDEN)
    kv_sliced = {t: (k[:, :, :p], v[:, :, :p]) for t, (k, v) in kv.items()}
    attn_mask = torch.ones(1, p + 1, dtype=torch.long)  # what generate passes (prompt + bonus)
    position_ids = torch.tensor([[p]])

    normed = []
    hook = drafter.model.norm.register_forward_hook(lambda m, i, o: normed.append(o.detach().clone()))
    d_logits, d_hidden, d_tokens, d_selected = [], [], [], []
    for _ in range(NUM_DRAFT):
        x = torch.cat([emb(tok), h], dim=-1)
        o = drafter(inputs_embeds=x, attention_mask=attn_mask, position_ids=position_ids,
                    shared_kv_states=kv_sliced, use_cache=False)
        tok = o.logits.argmax(dim=-1)
        h = o.last_hidden_state
        d_logits.append(o.logits[0, 0])
        d_hidden.append(o.last_hidden_state[0, 0])
        d_tokens.append(int(tok))
        hn = normed[-1]
        if drafter.config.use_ordered_embeddings:
            me = drafter.masked_embedding
            top = torch.topk(me.centroids(hn), k=me.centroid_intermediate_top_k, dim=-1).indices
            sel = me.token_ordering.view(me.num_centroids, me.vocab_size_per_centroid)[top].reshape(-1)
            sel = torch.sort(sel).values
            # every non-selected vocab entry holds the fill value min(selected) - 1
            fill = o.logits[0, 0].min()
            nonsel = torch.ones(VOCAB, dtype=torch.bool)
            nonsel[sel] = False
            assert bool((o.logits[0, 0][nonsel] == fill).all()) and bool((o.logits[0, 0][sel] > fill).all())
            d_selected.append(sel)
        else:
            assert torch.equal(drafter.lm_head(hn)[0, 0], o.logits[0, 0])
        assert torch.equal(drafter.post_projection(hn)[0, 0], o.last_hidden_state[0, 0])
    hook.remove()
    draft_logits = torch.stack(d_logits)
    draft_raw = torch.cat([t[0] for t in normed])  # [4, 32]

    pos0, cand_tokens, cand_logits = rounds[0]
    assert pos0 == PROMPT_LEN + 1, pos0
    assert cand_tokens.tolist() == d_tokens, (cand_tokens.tolist(), d_tokens)
    assert torch.equal(cand_logits, draft_logits), (cand_logits - draft_logits).abs().max()

    # --- save models --------------------------------------------------------------------------
    vdir = os.path.join(out_dir, variant)
    if os.path.isdir(vdir):
        shutil.rmtree(vdir)
    tdir, ddir = os.path.join(vdir, "target"), os.path.join(vdir, "drafter")
    shard = dict(max_shard_size="400KB") if variant == "moe" else {}
    target.save_pretrained(tdir, **shard)
    drafter.save_pretrained(ddir)
    if variant == "moe":
        assert os.path.exists(os.path.join(tdir, "model.safetensors.index.json"))
        assert len([f for f in os.listdir(tdir) if f.endswith(".safetensors")]) >= 2

    # reload from disk and check the saved files reproduce the references
    t2 = Gemma4ForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    d2 = Gemma4AssistantForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
    o2 = t2(prompt, use_cache=True, output_hidden_states=True, return_shared_kv_states=True)
    assert torch.equal(o2.logits[0], logits_full)
    x0 = torch.cat([t2.get_input_embeddings()(greedy[:1].view(1, 1)), hidden_full[-1].view(1, 1, HIDDEN)], -1)
    od = d2(inputs_embeds=x0, attention_mask=attn_mask, position_ids=position_ids,
            shared_kv_states={t: (k[:, :, :p], v[:, :, :p]) for t, (k, v) in o2.shared_kv_states.items()})
    assert torch.equal(od.logits[0, 0], draft_logits[0])
    assert d2.generation_config.num_assistant_tokens == NUM_DRAFT

    # --- wrapper (dense only) -------------------------------------------------------------------
    wrapper_info = None
    if variant == "dense":
        wrapper_info = build_wrapper(target, prompt, logits_full, os.path.join(vdir, "wrapper"), gen)

    # --- reference arrays -----------------------------------------------------------------------
    ref = {
        "prompt": i32(prompt[0]),
        "logits_full": f32(logits_full),
        "hidden_full": f32(hidden_full),
        "logits_step": f32(logits_step),
        "kv_sliding_k": f32(kv[S][0][0]),
        "kv_sliding_v": f32(kv[S][1][0]),
        "kv_full_k": f32(kv[F][0][0]),
        "kv_full_v": f32(kv[F][1][0]),
        "greedy": i32(greedy),
        "greedy_assisted": i32(greedy_assisted),
        "draft_inputs_h": f32(hidden_full[-1]),
        "draft_logits": f32(draft_logits),
        "draft_hidden": f32(torch.stack(d_hidden)),
        "draft_tokens": i32(d_tokens),
        "drafter_logits_raw_hidden": f32(draft_raw),
    }
    if d_selected:
        ref["draft_selected_ids"] = i32(torch.stack(d_selected))
    ref.update(exact_references(target, drafter, prompt, greedy, d_tokens))
    np.savez(os.path.join(vdir, "reference.npz"), **ref)

    logit_std = raw_logits.std().item()
    distinct = len(set(greedy.tolist()))
    meta = {
        "variant": variant,
        "seed": seed,
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "dtype": "float32",
        "attn_implementation": target.config._attn_implementation,
        "prompt_len": PROMPT_LEN,
        "prompt_attempts": attempt + 1,
        "new_tokens": NEW_TOKENS,
        "num_assistant_tokens": NUM_DRAFT,
        "bonus_position": p,
        "pre_softcap_logit_std": logit_std,
        "pre_softcap_logit_absmax": raw_logits.abs().max().item(),
        "greedy_distinct_tokens": distinct,
        "logits_step_max_abs_diff_vs_full": step_err,
        "softcap_lm_head_hidden_max_abs_diff_vs_logits": recon_err,
        "kv_sharing_modes": modes,
        "store_layers": store,
        "drafter_use_ordered_embeddings": bool(drafter.config.use_ordered_embeddings),
        "drafter_kv_sliding_window_note": "drafter attends to the last W+1 entries of the sliding KV and all full KV entries",
        "candidate_generator_cross_check": "first round of SinglePositionMultiTokenCandidateGenerator.get_candidates during "
        "generate(assistant_model=drafter) equals draft_tokens / draft_logits bitwise",
        "arrays": {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in ref.items()},
        "files": {
            "target": safetensor_keys(tdir),
            "drafter": safetensor_keys(ddir),
        },
    }
    if wrapper_info is not None:
        meta["wrapper"] = wrapper_info
        meta["files"]["wrapper"] = safetensor_keys(os.path.join(vdir, "wrapper"))
    with open(os.path.join(vdir, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=1, sort_keys=True)
        fh.write("\n")
    print(
        f"[{variant}] pre-softcap logit std={logit_std:.3f} absmax={meta['pre_softcap_logit_absmax']:.2f} "
        f"greedy distinct={distinct}/{NEW_TOKENS} prompt attempts={attempt + 1} step-vs-full={step_err:.2e} "
        f"draft_tokens={d_tokens} greedy[:8]={greedy[:8].tolist()}"
    )
    return meta


@torch.no_grad()
def exact_references(target, drafter, prompt, greedy, d_tokens) -> dict:
    """The same forwards in float64 on copies of the (fp32-representable) weights.

    fp32 accumulation noise in transformers itself is ~1e-4 on these logits, as large as the
    parity bar, so the MLX port is checked against the exact (float64) outputs instead.
    """
    import copy

    t64, d64 = copy.deepcopy(target).double(), copy.deepcopy(drafter).double()
    if t64.config.enable_moe_block:
        t64.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    out = t64(prompt, use_cache=True, output_hidden_states=True, return_shared_kv_states=True)
    hidden = out.hidden_states[-1]
    p = prompt.shape[1]
    kv = {t: (k[:, :, :p], v[:, :, :p]) for t, (k, v) in out.shared_kv_states.items()}
    tok, h = greedy[:1].view(1, 1), hidden[:, -1:]
    logits, hiddens = [], []
    for d in d_tokens:  # teacher-force the fp32 draft tokens so both runs see the same inputs
        x = torch.cat([t64.get_input_embeddings()(tok), h], dim=-1)
        o = d64(inputs_embeds=x, attention_mask=torch.ones(1, p + 1, dtype=torch.long),
                position_ids=torch.tensor([[p]]), shared_kv_states=kv, use_cache=False)
        logits.append(o.logits[0, 0])
        hiddens.append(o.last_hidden_state[0, 0])
        tok, h = torch.tensor([[d]]), o.last_hidden_state
    return {
        "logits_exact": f32(out.logits[0]),
        "hidden_exact": f32(hidden[0]),
        "draft_logits_exact": f32(torch.stack(logits)),
        "draft_hidden_exact": f32(torch.stack(hiddens)),
        **{f"kv_{name}_{kv_name}_exact": f32(out.shared_kv_states[kind][j][0])
           for kind, name in ((S, "sliding"), (F, "full")) for j, kv_name in ((0, "k"), (1, "v"))},
    }


@torch.no_grad()
def build_wrapper(target, prompt, logits_full, wdir, gen) -> dict:
    """A real tiny Gemma4ForConditionalGeneration whose language model is the dense target."""
    text = target.config.to_dict()
    for k in ("architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path", "model_type"):
        text.pop(k, None)
    text["use_bidirectional_attention"] = "vision"  # like the released 31B; text-only output unchanged
    vision = Gemma4VisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=2,
        position_embedding_size=16, use_clipped_linears=True,
    )
    cfg = Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    wrapper = Gemma4ForConditionalGeneration(cfg).eval()
    perturb_(wrapper, gen)  # vision tower + embed_vision get random values; text is overwritten below
    for name, b in wrapper.named_buffers():  # give the clipping buffers finite, realistic values
        if name.endswith(("input_min", "output_min")):
            b.fill_(-8.0)
        elif name.endswith(("input_max", "output_max")):
            b.fill_(8.0)
    missing, unexpected = wrapper.model.language_model.load_state_dict(target.model.state_dict(), strict=True)
    assert not missing and not unexpected
    assert wrapper.lm_head.weight.data_ptr() == wrapper.model.language_model.embed_tokens.weight.data_ptr()
    wl = wrapper(prompt).logits[0]
    assert torch.equal(wl, logits_full), (wl - logits_full).abs().max()
    wrapper.save_pretrained(wdir)
    w2 = Gemma4ForConditionalGeneration.from_pretrained(wdir, dtype=torch.float32).eval()
    assert torch.equal(w2(prompt).logits[0], logits_full)
    return {
        "kind": "real Gemma4ForConditionalGeneration (tiny vision tower, clipped linears, no audio)",
        "text_weights_equal_dense_target": True,
        "text_only_logits_equal_dense_target": True,
        "text_config_extra": {"use_bidirectional_attention": "vision"},
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("tests", "fixtures", "tiny"))
    ap.add_argument("--variants", default="dense,moe,e2b")
    args = ap.parse_args(argv)

    if transformers.__version__ != TRANSFORMERS_VERSION or not torch.__version__.startswith(TORCH_VERSION):
        print(
            f"warning: fixtures are pinned to transformers=={TRANSFORMERS_VERSION}, torch=={TORCH_VERSION}; "
            f"running with {transformers.__version__}, {torch.__version__}",
            file=sys.stderr,
        )
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    os.makedirs(args.out, exist_ok=True)
    for variant in args.variants.split(","):
        build_variant(variant, args.out, SEED + VARIANT_SEED_OFFSET[variant])


if __name__ == "__main__":
    main()
