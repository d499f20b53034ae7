"""Time to first token with one image (issue 44), and the vision encoder alone at real shapes.

    python -m apps.vision_ttft [--shapes demo,demo-280,26b-a4b,e4b] [--repeats 3] [--dtype float32]
                               [--peer mlx-vlm|transformers]

`demo`: the tiny vision checkpoint (tests/fixtures/vision/bidir, random weights, its MTP drafter): from
`Engine.submit` of a one-image chat request to its first token, the image new each time (prefix cache
off): processing, encoding, prefill and the first token; at its budget of 70 (its position table
holds 32 patches a side), and the same request without the image for comparison.
`demo-280`: the same with one 960x672 image at budget 280 (280 soft tokens, 2,520 patches), on a copy
of the demo in a temporary directory whose position table has the released configs' 10240 entries
(`demo_checkpoint`: the fixture's rows first, the rest random). `--peer mlx-vlm` times mlx-vlm there
too, on that copy, the same prompt and images, where `mlx_vlm` imports (a separate venv: not ours);
`--peer transformers` runs transformers' fp32 forward there (first tokens to check ours and the peer's by).
`26b-a4b`, `e4b`: the released vision towers' shapes (the 26B-A4B/31B one: 27 layers at width 1152,
16 heads of 72, MLP 4304, standardized; E2B/E4B: 16 at 768, 12 of 64, MLP 3072, clipped linears),
random weights, one 960x672 image = 280 soft tokens (2,520 patches): processing and the encoder
(`Vision.__call__`, evaluated); the language model's prefill of the ~290 positions comes on top.
Prints one line per shape: the median over `--repeats` and each run (after `--warmup` untimed ones).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_mtp.formats.vision import encoder

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "tests" / "fixtures" / "vision" / "bidir"
DRAFTER = ROOT / "tests" / "fixtures" / "tiny" / "dense" / "drafter"
BIG = (960, 672)  # 280 soft tokens at budget 280 with any patch size (60 x 42 patches)
SHAPES = {  # the released vision_config values (shared/fixtures/real-configs), text width of the wrapper
    "26b-a4b": (dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                     num_key_value_heads=16, head_dim=72, standardize=True, use_clipped_linears=False), 2816),
    "e4b": (dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                 num_key_value_heads=12, head_dim=64, standardize=False, use_clipped_linears=True), 2560),
}


def picture(w: int, h: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def demo_checkpoint(dest: Path, budget: int = 280, table: int = 10240) -> Path:
    """The demo checkpoint with a position table of `table` entries a side (the released configs' 10240;
    the fixture's 32 reach budget 70 only) and `budget` in its processor_config.json, under `dest`:
    the fixture's weights, its 32 rows first, the new rows random at the same scale (numpy seed 0)."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    for f in DEMO.iterdir():
        if f.name not in ("config.json", "processor_config.json", "model.safetensors", "reference.npz"):
            shutil.copy(f, dest / f.name)
    tokenizer = json.loads((DEMO / "tokenizer_config.json").read_text())  # the released ones name these
    tokenizer.update(image_token="<|image|>", boi_token="<|image>", eoi_token="<image|>")
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer, indent=1))
    config = json.loads((DEMO / "config.json").read_text())
    vision, text = config["vision_config"], config["text_config"]
    vision["position_embedding_size"] = table
    for over in text.pop("per_layer_config", {}).values():  # the released configs' keys, which mlx-vlm reads
        text["global_head_dim"] = over["head_dim"]
        text["num_global_key_value_heads"] = over["num_key_value_heads"]
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    processor = dict(max_soft_tokens=budget, patch_size=vision["patch_size"],
                     pooling_kernel_size=vision["pooling_kernel_size"])
    (dest / "processor_config.json").write_text(json.dumps({"image_processor": processor}))
    weights = load_file(str(DEMO / "model.safetensors"))
    key = "model.vision_tower.patch_embedder.position_embedding_table"
    old = weights[key]
    extra = np.random.default_rng(0).normal(0, old.std(), (2, table - old.shape[1], old.shape[2]))
    weights[key] = np.concatenate([old, extra.astype(old.dtype)], axis=1)
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def demo_ttft(repeats: int, path: Path = DEMO, size: tuple = (40, 30)) -> str:
    from mlx_mtp import Engine, Request, load

    loaded = load(path, DRAFTER, load_vision=True)
    times, tokens, first = {"image": [], "text": []}, {}, []
    with Engine(loaded, prompt_cache_bytes=0) as engine:
        for i in range(repeats + 1):  # the first round warms up (compiles)
            for kind in times:
                message = chat_message(picture(*size, seed=i), kind == "image")
                start = time.perf_counter()
                handle = engine.submit(Request(messages=[message], max_tokens=1))
                token = next(iter(handle))
                if i:
                    times[kind].append(time.perf_counter() - start)
                    first += [token.token] if kind == "image" else []
                handle.result()
                tokens[kind] = handle.prompt_tokens
    table = encoder(loaded).vision_config.position_embedding_size
    name = DEMO.relative_to(ROOT) if path == DEMO else f"{DEMO.relative_to(ROOT)}, position table {table}"
    return (f"demo ({name}, budget {encoder(loaded).budget}): TTFT with one {size[0]}x{size[1]} image "
            f"({tokens['image'] - tokens['text']} image tokens, {tokens['image']} in all) "
            f"{_ms(times['image'])}; "
            f"the same request without it ({tokens['text']} prompt tokens) {_ms(times['text'])}; "
            f"first tokens with the image {first}")


def peer_ttft(repeats: int, path: Path, size: tuple) -> str:
    """mlx-vlm's time to first token on the same checkpoint, prompt and images as `demo_ttft` (greedy,
    `stream_generate` from the PIL image to its first token), and the largest difference between its
    soft tokens and ours for the first image (both fp32, the same weights)."""
    try:
        import mlx_vlm
        from mlx_vlm import load as vlm_load, stream_generate
    except ImportError as e:
        return f"mlx-vlm: not run ({e}; it goes in a separate venv: see apps/README.md)"
    from mlx_mtp import load

    model, processor = vlm_load(str(path))
    prompt = processor.tokenizer.apply_chat_template([chat_message(None)], tokenize=False,
                                                     add_generation_prompt=True)
    times, first = [], []
    for i in range(repeats + 1):  # the first run warms up
        image = picture(*size, seed=i)
        start = time.perf_counter()
        result = next(stream_generate(model, processor, prompt, image=[image], max_tokens=1, temperature=0.0))
        if i:
            times.append(time.perf_counter() - start)
            first.append(result.token)
    image = picture(*size, seed=1)
    theirs = model.encode_image(mx.array(np.asarray(processor.image_processor([image])[0]["pixel_values"])))
    vision = encoder(load(path, load_vision=True))
    patches = vision.process(image)
    ours = vision.load()(mx.array(patches.pixels), mx.array(patches.positions))
    gap = float(mx.abs(theirs.reshape(ours.shape) - ours).max())
    return (f"mlx-vlm {mlx_vlm.__version__} (same checkpoint): TTFT with one {size[0]}x{size[1]} image "
            f"({result.prompt_tokens} prompt tokens) {_ms(times)}; first tokens {first}; "
            f"its soft tokens vs ours: max |diff| {gap:.1e}")


def transformers_ttft(repeats: int, path: Path, size: tuple) -> str:
    """transformers' fp32 forward on the same copy and images, from our prompt ids and patches (the
    processor's, bit for bit) to the argmax of its last logits: whose first tokens ours must equal."""
    try:
        import torch
        import transformers
        from transformers import Gemma4ForConditionalGeneration
    except ImportError as e:
        return f"transformers: not run ({e}; torch is no dependency: the reference venv of tests/reference)"
    from mlx_mtp import load
    from mlx_mtp.formats.chat import render
    from mlx_mtp.models.gemma4_vision import expand_placeholders

    loaded = load(path)
    vision = encoder(loaded)
    model = Gemma4ForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    times, first = [], []
    for i in range(repeats + 1):  # the first run warms up
        image = picture(*size, seed=i)
        patches = vision.process(image)
        tokens = render(loaded.tokenizer, [chat_message(image)]).tokens
        ids = expand_placeholders(tokens, [patches.tokens], vision.boi, vision.image_token, vision.eoi)
        ids = torch.tensor([ids])
        start = time.perf_counter()
        with torch.no_grad():
            logits = model(ids, pixel_values=torch.from_numpy(patches.pixels)[None],
                           image_position_ids=torch.from_numpy(patches.positions.astype(np.int64))[None],
                           mm_token_type_ids=(ids == vision.image_token).long()).logits
        if i:
            times.append(time.perf_counter() - start)
            first.append(int(logits[0, -1].argmax()))
    return (f"transformers {transformers.__version__} (same checkpoint, fp32, forward only, "
            "from our ids and patches): "
            f"{ids.shape[1]} prompt tokens {_ms(times)}; first tokens {first}")


def chat_message(image, with_image: bool = True) -> dict:
    """The user turn the demo times: the image (when asked) and one question."""
    parts = [{"type": "text", "text": "What is in this picture?"}]
    return {"role": "user", "content": ([{"type": "image", "image": image}] if with_image else []) + parts}


def encoder_time(name: str, repeats: int, dtype: mx.Dtype, warmup: int = 1) -> str:
    from mlx_mtp.formats.images import process
    from mlx_mtp.loading import cast_floats
    from mlx_mtp.models.gemma4_vision import Vision, VisionConfig

    params, text_hidden = SHAPES[name]
    model = Vision(VisionConfig(**params), text_hidden)
    mx.random.seed(0)
    model.update(_random(model.parameters()))
    cast_floats(model, dtype)
    mx.eval(model.parameters())
    image = picture(960, 672, seed=1)
    times, prep = [], []
    for i in range(repeats + warmup):
        start = time.perf_counter()
        patches = process(image, 280)
        mid = time.perf_counter()
        mx.eval(model(patches.pixels, patches.positions))
        if i >= warmup:
            prep.append(mid - start)
            times.append(time.perf_counter() - mid)
    return (f"{name} encoder ({params['num_hidden_layers']} x {params['hidden_size']}, {dtype}), one image of "
            f"{patches.tokens} soft tokens ({len(patches.pixels)} patches): processing {_ms(prep)}, encoder {_ms(times)}")


def _random(tree):
    """Well-scaled random values in place of every parameter (norm weights near 1, matrices 1/sqrt(fan-in))."""
    from mlx.utils import tree_map

    def one(a):
        if a.ndim < 2:
            return 1 + 0.1 * mx.random.normal(a.shape)
        return mx.random.normal(a.shape) / np.sqrt(a.shape[-1])

    return tree_map(one, tree)


def _ms(values) -> str:
    return f"{statistics.median(values) * 1e3:.0f} ms (runs: {', '.join(f'{v * 1e3:.0f}' for v in values)})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="demo,26b-a4b,e4b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--warmup", type=int, default=1, help="untimed encoder runs first (default 1)")
    ap.add_argument("--peer", choices=["mlx-vlm", "transformers"],
                    help="demo-280 also run on this peer, where it imports (its own venv)")
    args = ap.parse_args(argv)
    print(f"MLX {mx.__version__}, device {mx.default_device()}")
    for name in args.shapes.split(","):
        if name == "demo":
            line = demo_ttft(args.repeats)
        elif name == "demo-280":
            with tempfile.TemporaryDirectory() as tmp:
                path = demo_checkpoint(Path(tmp))
                line = demo_ttft(args.repeats, path, BIG)
                if args.peer == "mlx-vlm":
                    line += "\n" + peer_ttft(args.repeats, path, BIG)
                elif args.peer == "transformers":
                    line += "\n" + transformers_ttft(args.repeats, path, BIG)
        else:
            line = encoder_time(name, args.repeats, getattr(mx, args.dtype), args.warmup)
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
