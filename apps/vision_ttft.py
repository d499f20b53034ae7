"""Time to first token with one image (issue 44), and the vision encoder alone at real shapes.

    python -m apps.vision_ttft [--shapes demo,26b-a4b,e4b] [--repeats 3] [--dtype float32]

`demo`: the tiny vision checkpoint (tests/fixtures/vision/bidir, random weights, its MTP drafter): from
`Engine.submit` of a one-image chat request to its first token, the image new each time (prefix cache
off): processing, encoding, prefill and the first token; at its budget of 70 (its position table
holds 32 patches a side), and the same request without the image for comparison.
`26b-a4b`, `e4b`: the released vision towers' shapes (the 26B-A4B/31B one: 27 layers at width 1152,
16 heads of 72, MLP 4304, standardized; E2B/E4B: 16 at 768, 12 of 64, MLP 3072, clipped linears),
random weights, one 960x672 image = 280 soft tokens (2,520 patches): processing and the encoder
(`Vision.__call__`, evaluated); the language model's prefill of the ~290 positions comes on top.
Prints one line per shape: the median over `--repeats` and each run (after `--warmup` untimed ones).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "tests" / "fixtures" / "vision" / "bidir"
DRAFTER = ROOT / "tests" / "fixtures" / "tiny" / "dense" / "drafter"
SHAPES = {  # the released vision_config values (shared/fixtures/real-configs), text width of the wrapper
    "26b-a4b": (dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                     num_key_value_heads=16, head_dim=72, standardize=True, use_clipped_linears=False), 2816),
    "e4b": (dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                 num_key_value_heads=12, head_dim=64, standardize=False, use_clipped_linears=True), 2560),
}


def picture(w: int, h: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def demo_ttft(repeats: int) -> str:
    from mlx_mtp import Engine, Request, load

    loaded = load(DEMO, DRAFTER, load_vision=True)
    times = {"image": [], "text": []}
    with Engine(loaded, prompt_cache_bytes=0) as engine:
        for i in range(repeats + 1):  # the first round warms up (compiles)
            for kind in times:
                parts = [{"type": "text", "text": "What is in this picture?"}]
                if kind == "image":
                    parts.insert(0, {"type": "image", "image": picture(40, 30, seed=i)})
                start = time.perf_counter()
                handle = engine.submit(Request(messages=[{"role": "user", "content": parts}], max_tokens=1))
                next(iter(handle))
                if i:
                    times[kind].append(time.perf_counter() - start)
                handle.result()
            tokens = handle.prompt_tokens
    return (f"demo (tests/fixtures/vision/bidir, budget 70): TTFT with one image {_ms(times['image'])}; "
            f"the same request without it ({tokens} prompt tokens) {_ms(times['text'])}")


def encoder_time(name: str, repeats: int, dtype: mx.Dtype, warmup: int = 1) -> str:
    from mlx_mtp.images import process
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
    args = ap.parse_args(argv)
    print(f"MLX {mx.__version__}, device {mx.default_device()}")
    for name in args.shapes.split(","):
        line = demo_ttft(args.repeats) if name == "demo" else encoder_time(name, args.repeats, getattr(mx, args.dtype),
                                                                             args.warmup)
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
