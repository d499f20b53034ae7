"""Interoperability: mlx-community-style (mlx-lm converted, quantized) dirs and HF tokenizers."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from conftest import TINY, reference

import mlx_mtp
from mlx_mtp.loading import load_model


def released_form(path):
    """mlx-lm reads `global_head_dim`, not transformers-5.23's `per_layer_config`."""
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    text.pop("per_layer_config")
    text.update(global_head_dim=32, num_global_key_value_heads=1)
    config["vocab_size"] = 128  # mlx-lm's wrapper reads the top-level vocab size
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def mlx_lm_dir(tmp_path_factory):
    """The dense multimodal-wrapper checkpoint converted by mlx-lm to 8 bits, with the MoE-style
    recipe of a per-path override (as mlx-community's 26B conversion has)."""
    from mlx_lm import convert

    tmp = tmp_path_factory.mktemp("interop")
    src = tmp / "hf"
    shutil.copytree(TINY / "dense" / "wrapper", src)
    released_form(src)
    write_char_tokenizer(src)
    out = tmp / "mlx"

    def recipe(path, module, config=None):
        return {"group_size": 32, "bits": 4} if path.endswith("layers.0.mlp.down_proj") else True

    convert(str(src), str(out), quantize=True, q_group_size=32, q_bits=8, quant_predicate=recipe)
    return out


def test_mlx_lm_quantized_dir_loads_and_matches_mlx_lm(mlx_lm_dir):
    from mlx_lm.utils import load_model as mlx_lm_load

    config = json.loads((mlx_lm_dir / "config.json").read_text())
    assert config["quantization"]["bits"] == 8
    assert any(k.startswith("language_model.model.layers.0.mlp.down_proj") for k in config["quantization"])
    ours = load_model(mlx_lm_dir)[0]
    assert ours.model.layers[0].mlp.down_proj.bits == 4 and ours.model.layers[1].mlp.down_proj.bits == 8
    theirs = mlx_lm_load(mlx_lm_dir)[0]
    ids = mx.array(reference("dense")["prompt"][None])
    a, b = np.array(ours(ids).logits[0]), np.array(theirs(ids)[0])
    assert np.abs(a - b).max() < 1e-4  # same quantized weights, same math
    # (vs the fp32 reference the error is large: attention with scale 1.0 over normed q/k makes
    # a random tiny Gemma 4 near-chaotic; bf16 alone moves its logits by ~1.6)


def write_char_tokenizer(path):
    """A 128-token character-level HF tokenizer (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 32 + 124)]
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "bos_token": "<bos>",
         "pad_token": "<pad>", "unk_token": "<unk>"}))


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "dense"
    shutil.copytree(TINY / "dense" / "target", path)
    write_char_tokenizer(path)
    return path


def test_text_prompt_streams_through_mlx_lm_tokenizer_wrapper(with_tokenizer):
    loaded = mlx_mtp.load(with_tokenizer, TINY / "dense" / "drafter")
    assert loaded.tokenizer is not None
    events = list(mlx_mtp.stream_generate(loaded, "def f(x):\n    return", max_tokens=24, draft_tokens=2))
    tokens = [e.token for e in events if e.token not in loaded.eos_ids]
    streamed = "".join(e.text for e in events)
    assert streamed == loaded.tokenizer.decode(tokens) and len(streamed) > 0
    plain = mlx_mtp.generate(loaded, "def f(x):\n    return", max_tokens=24, mtp=False)
    assert [e.token for e in events] == plain.tokens and plain.text == streamed
