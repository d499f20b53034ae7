"""Generate the tiny Gemma 4 12B (`gemma4_unified`) reference fixtures used by tests/test_unified.py.

Ground truth is transformers==5.23.0 / torch==2.13.0 (CPU, float32, one thread). Usage:

    /work/refvenv/bin/python tests/reference/make_unified_fixtures.py [--out tests/fixtures/unified]

Deterministic: two runs give identical arrays. Modelled on make_fixtures.py (read its docstring for
the conventions shared here: `perturb_`, the float64 `*_exact` references, the first MTP round).

What it builds (fp32, vocab 128, pad/eos/bos 0/1/2):

* ``target/``: a real tiny ``Gemma4UnifiedForConditionalGeneration`` (the 12B's class), 12B-shaped:
  hidden 32, 6 layers [S,S,S,S,S,F] (the 12B's 5:1 block), 4 q-heads, 2 KV heads of 8 on sliding
  layers, ``attention_k_eq_v`` with 1 global KV head of 16 on the full layer, sliding window 8,
  softcap 30. No PLE / MoE keys at all (transformers writes none for these classes), and
  ``max_position_embeddings`` and ``use_bidirectional_attention`` at the class defaults, which
  `drop_default_keys` removes from config.json: the loader must supply the unified defaults. Its encoder-free embedders: image patches stay 48x48x3 = 6912
  wide, ``mm_embed_dim`` 8, a 16-entry position table; audio frames stay 640 samples.
  ``generation_config.json`` suppresses two tokens, as the 12B's does ([258883, 258882] there):
  here the two most frequent tokens of the unsuppressed greedy continuation, so suppression
  changes the output (``greedy_unsuppressed`` records the difference).
* ``drafter/``: a ``Gemma4UnifiedAssistantForCausalLM`` with random weights independent of the
  target (hidden 16, 4 layers [S,S,S,F], every layer KV-shared), so drafts are often rejected.

transformers 5.23's ``Gemma4UnifiedTextConfig.kv_sharing_modes`` repeats both bugs that
apps/hf_compat.py patches on ``Gemma4TextConfig`` (research gemma4-audio-unified.md §0.6): the
assistant cannot be built, and the target (nothing shared) publishes no store layers. It is a
separate class, so `patch_unified_kv_sharing_modes` applies the same rule to it.

reference.npz (T = 20 prompt tokens, bonus position p = 20):
  prompt int32 [T]; logits_full [T, V], hidden_full [T, H] (post-final-norm), logits_step [T, V]
  (token by token through the HF cache); kv_{sliding,full}_{k,v} [n_kv, T, d] (the store layers);
  greedy, greedy_assisted int32 [48] (generate(), the generation config's suppress_tokens applied;
  asserted equal); greedy_unsuppressed int32 [48]; suppress_tokens int32 [2];
  draft_logits [4, V], draft_hidden [4, H], draft_tokens int32 [4] (the first MTP round, as the
  real SinglePositionMultiTokenCandidateGenerator computes it: asserted bitwise);
  *_exact: the same forwards in float64 on the same weights.
  Embedders: image_codes uint8 [2, 6, 6912] (pixel codes, rescaled x * fp32(1/255) as the
  processor does), image_positions int32 [2, 6, 2] ((x, y), -1 on padding rows; image 1 has a
  flat patch, where LayerNorm's eps dominates, and reaches the table's last rows), image_features
  [9, H] (get_image_features: real rows only) and image_features_exact; audio_frames float32
  [2, 5, 640] (a zero frame among them), audio_mask bool [2, 5], audio_features [2, 5, H] and
  audio_features_exact.
processor.npz (the image arithmetic, exact; transformers' processor module imports torchvision and
Pillow, which the reference venv lacks, so `processor_functions` runs its functions from its source):
  sizes int32 [N, 5]: (height, width, budget, target height, target width) from
  ``get_aspect_ratio_preserving_size``; merge_codes uint8 [96, 144, 3] an image at a target size,
  merge_pixels_sha256 (of the float32 bytes of the [6, 6912] patches) and merge_positions int32 [6, 2]
  from ``convert_image_to_patches`` + ``patches_merge`` after the processor's rescale.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import shutil
import sys

import numpy as np
import torch

import transformers
from transformers import (
    Gemma4UnifiedAssistantConfig,
    Gemma4UnifiedAssistantForCausalLM,
    Gemma4UnifiedAudioConfig,
    Gemma4UnifiedConfig,
    Gemma4UnifiedForConditionalGeneration,
    Gemma4UnifiedTextConfig,
    Gemma4UnifiedVisionConfig,
)

sys.path.insert(0, os.path.dirname(__file__))
from make_fixtures import f32, i32, perturb_, record_candidates, safetensor_keys, softcap  # noqa: E402

SEED = 4321
TRANSFORMERS_VERSION = "5.23.0"
S, F = "sliding_attention", "full_attention"
VOCAB, HIDDEN, PROMPT_LEN, NEW_TOKENS, NUM_DRAFT = 128, 32, 20, 48, 4
RESCALE = 0.00392156862745098  # the processor's rescale_factor (1/255)
BUDGETS = (70, 140, 280, 560, 1120)


def patch_unified_kv_sharing_modes() -> None:
    """`Gemma4UnifiedTextConfig.kv_sharing_modes` as it should be: every layer "reuse" when all are
    shared (an assistant), the last layer of each type "store" when none is (a 12B target)."""
    original = Gemma4UnifiedTextConfig.kv_sharing_modes

    def modes(self):
        n, shared = self.num_hidden_layers, self.num_kv_shared_layers or 0
        if n and shared >= n:
            return ["reuse"] * n
        if shared == 0:
            last = {kind: i for i, kind in enumerate(self.layer_types)}
            return ["store" if last[kind] == i else None for i, kind in enumerate(self.layer_types)]
        return original.fget(self)

    Gemma4UnifiedTextConfig.kv_sharing_modes = property(modes)


patch_unified_kv_sharing_modes()


def processor_functions(*names: str) -> dict:
    """Functions of transformers' `image_processing_gemma4_unified.py`, run as written there. The module
    itself needs torchvision and Pillow at import (the reference venv has neither); these need torch."""
    import ast
    import transformers.models.gemma4_unified as package

    path = os.path.join(os.path.dirname(package.__file__), "image_processing_gemma4_unified.py")
    tree = ast.parse(open(path).read())
    wanted = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    scope = {"math": math, "torch": torch}
    exec(compile(ast.Module(wanted, type_ignores=[]), path, "exec"), scope)
    return {name: scope[name] for name in names}

TEXT = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=6,
    layer_types=[S] * 5 + [F], num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
    final_logit_softcapping=30.0, pad_token_id=0, eos_token_id=1, bos_token_id=2,
)


def target_config() -> Gemma4UnifiedConfig:
    vision = Gemma4UnifiedVisionConfig(mm_embed_dim=8, mm_posemb_size=16, output_proj_dims=8)
    return Gemma4UnifiedConfig(text_config=Gemma4UnifiedTextConfig(**TEXT), vision_config=vision,
                               audio_config=Gemma4UnifiedAudioConfig())


def drafter_config() -> Gemma4UnifiedAssistantConfig:
    text = dict(TEXT, hidden_size=16, intermediate_size=32, num_hidden_layers=4, layer_types=[S, S, S, F],
                final_logit_softcapping=None, num_kv_shared_layers=4)
    return Gemma4UnifiedAssistantConfig(text_config=Gemma4UnifiedTextConfig(**text), backbone_hidden_size=HIDDEN)


@torch.no_grad()
def perturb_embedders_(model, gen: torch.Generator) -> None:
    """The embedders' LayerNorm biases, patch bias and position table: well-scaled values, not
    the 1 + 0.3 N(0, 1) `perturb_` gives every vector."""
    for name, p in model.named_parameters():
        if "embed_vision" in name and name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith("pos_embedding"):
            p.copy_(torch.randn(p.shape, generator=gen))


def greedy_ids(model, prompt, **kw) -> torch.Tensor:
    out = model.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=0,
                         pad_token_id=0, eos_token_id=1, **kw)
    return out[0, prompt.shape[1]:]


@torch.no_grad()
def text_references(target, drafter, gen) -> dict:
    """Prompt, forwards, store-layer K/V, greedy (plain, suppressed, assisted) and the first MTP round."""
    for _ in range(200):  # a prompt whose greedy continuations, with and without suppression, avoid
        prompt = torch.randint(3, VOCAB, (1, PROMPT_LEN), generator=gen)  # ids < 3 and are varied
        free = greedy_ids(target, prompt)
        counts = np.bincount(free.numpy(), minlength=VOCAB)
        suppress = sorted(int(t) for t in np.argsort(-counts, kind="stable")[:2])  # its two most frequent
        greedy = greedy_ids(target, prompt, suppress_tokens=suppress)
        if all(not bool((g < 3).any()) and len(set(g.tolist())) >= 16 for g in (free, greedy)):
            break
    else:
        raise RuntimeError("no prompt with usable greedy continuations")
    target.generation_config.suppress_tokens = suppress  # saved: generate() applies it from here on
    assert torch.equal(greedy_ids(target, prompt), greedy) and not set(greedy.tolist()) & set(suppress)

    out = target(prompt, use_cache=True, output_hidden_states=True, return_shared_kv_states=True)
    logits, hidden, kv = out.logits[0], out.hidden_states[-1][0], out.shared_kv_states
    assert set(kv) == {S, F}
    assert (softcap(target.lm_head(hidden), 30.0) - logits).abs().max() < 1e-5
    cache, steps = None, []
    for i in range(PROMPT_LEN):
        o = target(prompt[:, i: i + 1], past_key_values=cache, use_cache=True)
        cache = o.past_key_values
        steps.append(o.logits[0, -1])
    logits_step = torch.stack(steps)
    assert (logits_step - logits).abs().max() < 1e-3

    rounds: list = []
    with record_candidates(rounds):
        assisted = greedy_ids(target, prompt, assistant_model=drafter)
    assert torch.equal(assisted, greedy) and rounds

    emb, p = target.get_input_embeddings(), PROMPT_LEN
    kv_p = {t: (k[:, :, :p], v[:, :, :p]) for t, (k, v) in kv.items()}
    tok, h = greedy[:1].view(1, 1), hidden[-1].view(1, 1, HIDDEN)
    d_logits, d_hidden, d_tokens = [], [], []
    for _ in range(NUM_DRAFT):
        o = drafter(inputs_embeds=torch.cat([emb(tok), h], -1), attention_mask=torch.ones(1, p + 1, dtype=torch.long),
                    position_ids=torch.tensor([[p]]), shared_kv_states=kv_p, use_cache=False)
        tok, h = o.logits.argmax(-1), o.last_hidden_state
        d_logits.append(o.logits[0, 0])
        d_hidden.append(h[0, 0])
        d_tokens.append(int(tok))
    pos0, cand_tokens, cand_logits = rounds[0]
    assert pos0 == p + 1 and cand_tokens.tolist() == d_tokens and torch.equal(cand_logits, torch.stack(d_logits))

    ref = {
        "prompt": i32(prompt[0]), "logits_full": f32(logits), "hidden_full": f32(hidden),
        "logits_step": f32(logits_step), "greedy": i32(greedy), "greedy_assisted": i32(assisted),
        "greedy_unsuppressed": i32(free), "suppress_tokens": i32(suppress),
        "draft_logits": f32(torch.stack(d_logits)), "draft_hidden": f32(torch.stack(d_hidden)),
        "draft_tokens": i32(d_tokens),
        **{f"kv_{n}_{x}": f32(kv[kind][j][0]) for kind, n in ((S, "sliding"), (F, "full"))
           for j, x in ((0, "k"), (1, "v"))},
    }
    ref.update(exact_text(target, drafter, prompt, greedy, d_tokens))
    return ref


@torch.no_grad()
def exact_text(target, drafter, prompt, greedy, d_tokens) -> dict:
    """The prefill and the teacher-forced first draft round in float64 (fp32 noise in transformers
    itself is ~1e-5, too close to the 1e-4 bar to compare against)."""
    t64, d64 = copy.deepcopy(target).double(), copy.deepcopy(drafter).double()
    out = t64(prompt, use_cache=True, output_hidden_states=True, return_shared_kv_states=True)
    hidden, p = out.hidden_states[-1], prompt.shape[1]
    kv = {t: (k[:, :, :p], v[:, :, :p]) for t, (k, v) in out.shared_kv_states.items()}
    tok, h, logits, hiddens = greedy[:1].view(1, 1), hidden[:, -1:], [], []
    for d in d_tokens:
        o = d64(inputs_embeds=torch.cat([t64.get_input_embeddings()(tok), h], -1),
                attention_mask=torch.ones(1, p + 1, dtype=torch.long), position_ids=torch.tensor([[p]]),
                shared_kv_states=kv, use_cache=False)
        logits.append(o.logits[0, 0])
        hiddens.append(o.last_hidden_state[0, 0])
        tok, h = torch.tensor([[d]]), o.last_hidden_state
    return {
        "logits_exact": f32(out.logits[0]), "hidden_exact": f32(hidden[0]),
        "draft_logits_exact": f32(torch.stack(logits)), "draft_hidden_exact": f32(torch.stack(hiddens)),
        **{f"kv_{n}_{x}_exact": f32(out.shared_kv_states[kind][j][0]) for kind, n in ((S, "sliding"), (F, "full"))
           for j, x in ((0, "k"), (1, "v"))},
    }


@torch.no_grad()
def embedder_references(target, gen) -> dict:
    """Two images of 12 patch rows (7 and 12 real, (x, y) inside the 16-entry table; image 1's
    first patch flat) and two clips of 5 audio frames (3 and 5 real; frame 1 of clip 0 all zeros)."""
    codes = torch.randint(0, 256, (2, 6, 6912), generator=gen, dtype=torch.uint8)
    codes[0, 3:] = 0
    codes[1, 0] = 117  # a flat patch: zero variance, LayerNorm's eps sets the scale
    positions = torch.full((2, 6, 2), -1, dtype=torch.long)
    positions[0, :3] = torch.tensor([[0, 0], [1, 0], [0, 1]])
    positions[1] = torch.tensor([[x + 13, y + 12] for y in range(2) for x in range(3)])  # the table's far end
    pixels = codes * RESCALE  # the processor's rescale (TorchvisionBackend.rescale)
    assert pixels.dtype == torch.float32
    frames = 0.3 * torch.randn((2, 5, 640), generator=gen)
    frames[0, 1] = 0.0
    frames[0, 3:] = 0.0
    mask = torch.tensor([[True] * 3 + [False] * 2, [True] * 5])

    def run(model, dtype):
        m = model.model
        image = torch.cat(m.get_image_features(pixels.to(dtype), positions).pooler_output)
        audio = m.get_audio_features(frames.to(dtype), mask).pooler_output
        return image, audio

    image, audio = run(target, torch.float32)
    image64, audio64 = run(copy.deepcopy(target).double(), torch.float64)
    assert image.shape == (9, HIDDEN) and audio.shape == (2, 5, HIDDEN)
    assert bool((audio[0, 1] == 0).all())  # digital silence embeds to zero
    return {
        "image_codes": codes.numpy(), "image_positions": i32(positions), "image_features": f32(image),
        "image_features_exact": f32(image64), "audio_frames": f32(frames), "audio_mask": mask.numpy(),
        "audio_features": f32(audio), "audio_features_exact": f32(audio64),
    }


def processor_references(gen) -> dict:
    """Target sizes over many image sizes and every budget, and one image patchified the processor's
    way (16-px patches merged 3x3 by `patches_merge`)."""
    fns = processor_functions("get_aspect_ratio_preserving_size", "convert_image_to_patches", "patches_merge")
    rng = np.random.default_rng(SEED)
    sides = sorted({1, 2, 47, 48, 49, 95, 96, 97, 300, 767, 768, 1024, 4000, *rng.integers(1, 5000, 20).tolist()})
    sizes = []
    for h in sides:
        for w in sides:
            for budget in BUDGETS:
                try:
                    th, tw = fns["get_aspect_ratio_preserving_size"](h, w, 16, budget * 9, 3)
                except ValueError:
                    th = tw = -1  # transformers refuses it
                sizes.append((h, w, budget, th, tw))
    codes = torch.randint(0, 256, (96, 144, 3), generator=gen, dtype=torch.uint8)
    image = codes.permute(2, 0, 1) * RESCALE  # (C, H, W), as the processor holds it
    teacher = fns["convert_image_to_patches"](image, 16)
    grid = torch.meshgrid(torch.arange(144 // 16), torch.arange(96 // 16), indexing="xy")
    positions = torch.stack(grid, -1).reshape(-1, 2)
    merged, merged_positions = fns["patches_merge"](teacher[None], positions[None], teacher.shape[0] // 9)
    digest = hashlib.sha256(f32(merged[0]).tobytes()).hexdigest()
    return {"sizes": np.asarray(sizes, dtype=np.int32), "merge_codes": codes.numpy(),
            "merge_pixels_sha256": np.array(digest), "merge_positions": i32(merged_positions[0])}


def drop_default_keys(path: str) -> None:
    """Leave the unified text defaults (max positions 262144, bidirectional "vision") out of a
    written config.json, as a hand-made or future file may: a loader must supply them. transformers
    writes no PLE or MoE keys for these classes (it has none); the released 12B files do."""
    config = json.load(open(path))
    text = config["text_config"]
    assert text.pop("max_position_embeddings") == 262144 and text.pop("use_bidirectional_attention") == "vision"
    assert not {"hidden_size_per_layer_input", "vocab_size_per_layer_input", "enable_moe_block"} & set(text)
    with open(path, "w") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
        fh.write("\n")


@torch.no_grad()
def build(out: str) -> None:
    gen = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    target = Gemma4UnifiedForConditionalGeneration(target_config()).eval()
    perturb_(target, gen)
    perturb_embedders_(target, gen)
    drafter = Gemma4UnifiedAssistantForCausalLM(drafter_config()).eval()
    perturb_(drafter, gen)
    drafter.generation_config.num_assistant_tokens = NUM_DRAFT
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    modes = target.config.text_config.kv_sharing_modes
    assert modes == [None] * 4 + ["store"] * 2, modes

    ref = text_references(target, drafter, gen)
    ref.update(embedder_references(target, gen))
    processor = processor_references(gen)

    if os.path.isdir(out):
        shutil.rmtree(out)
    tdir, ddir = os.path.join(out, "target"), os.path.join(out, "drafter")
    target.save_pretrained(tdir)
    drafter.save_pretrained(ddir)
    for directory in (tdir, ddir):
        drop_default_keys(os.path.join(directory, "config.json"))
    t2 = Gemma4UnifiedForConditionalGeneration.from_pretrained(tdir, dtype=torch.float32).eval()
    assert torch.equal(t2(torch.tensor(ref["prompt"][None].astype(np.int64))).logits[0],
                       torch.tensor(ref["logits_full"]))
    d2 = Gemma4UnifiedAssistantForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
    assert {**d2.config.text_config.to_dict(), "dtype": None} == {**drafter.config.text_config.to_dict(), "dtype": None}
    np.savez_compressed(os.path.join(out, "reference.npz"), **ref)
    np.savez_compressed(os.path.join(out, "processor.npz"), **processor)
    meta = {
        "seed": SEED, "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "kv_sharing_modes": modes, "suppress_tokens": ref["suppress_tokens"].tolist(),
        "greedy_distinct_tokens": len(set(ref["greedy"].tolist())),
        "arrays": {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in ref.items()},
        "files": {"target": safetensor_keys(tdir), "drafter": safetensor_keys(ddir)},
    }
    with open(os.path.join(out, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=1, sort_keys=True)
        fh.write("\n")
    print(f"suppress={ref['suppress_tokens'].tolist()} greedy[:8]={ref['greedy'][:8].tolist()} "
          f"unsuppressed[:8]={ref['greedy_unsuppressed'][:8].tolist()} drafts={ref['draft_tokens'].tolist()}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("tests", "fixtures", "unified"))
    args = ap.parse_args(argv)
    if transformers.__version__ != TRANSFORMERS_VERSION:
        print(f"warning: fixtures are pinned to transformers=={TRANSFORMERS_VERSION}", file=sys.stderr)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    build(args.out)


if __name__ == "__main__":
    main()
