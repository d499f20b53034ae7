"""Quantization error where it means something: the trained demo target (random tiny models
are chaotic, see test_convert.py), converted at 8 and 4 bits."""

import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_mtp import demo
from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.loading import load_model, load_tokenizer


CODE = [
    "def read_config(path):\n    with open(path) as f:\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import os\n\ndef walk(top):\n    for root, dirs, files in os.walk(top):\n",
    "    try:\n        value = int(text)\n    except ValueError:\n",
]


def convert(tmp_path, *args):
    from convert.convert import main

    out = tmp_path / "_".join(a.strip("-") for a in args)
    main([str(demo.TARGET_DIR), str(out), "--dtype", "float32", "--quiet", *args])
    return load_model(out)[0]


@pytest.fixture(scope="module")
def reference():
    model = load_model(demo.TARGET_DIR, dtype=mx.float32)[0]
    tok = load_tokenizer(demo.TARGET_DIR)
    return model, [tok.encode(p) for p in CODE]


def agreement(model, ref_model, prompts, n=48):
    top1, greedy = [], []
    for ids in prompts:
        want = [t for t, _ in generate_tokens(ref_model, ids, max_tokens=n)]
        got = [t for t, _ in generate_tokens(model, ids, max_tokens=n)]
        greedy.append(next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), n) / n)
        seq = mx.array([ids + want])
        a, b = ref_model(seq).logits[0], model(seq).logits[0]
        top1.append(float((mx.argmax(a, -1) == mx.argmax(b, -1)).mean()))
        err = float(mx.abs(a - b).max())
    return float(np.mean(top1)), float(np.mean(greedy)), err


@pytest.mark.parametrize("bits, min_top1, min_greedy", [("8", 0.97, 0.6), ("4", 0.85, 0.2)])
def test_quantized_demo_target_agrees(tmp_path, reference, bits, min_top1, min_greedy):
    ref_model, prompts = reference
    model = convert(tmp_path, "-q", "--bits", bits, "--group-size", "64")
    top1, greedy, err = agreement(model, ref_model, prompts)
    print(f"demo-quant bits={bits} top1={top1:.3f} greedy-prefix={greedy:.3f} max|dlogit|={err:.3f}",
          file=sys.stderr)
    assert top1 >= min_top1 and greedy >= min_greedy
