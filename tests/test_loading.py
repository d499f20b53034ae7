"""Loading: config forms, and clear errors for bad input."""

import json
import logging
import shutil

import mlx.core as mx
import numpy as np
import pytest
from conftest import TINY, reference

import mlx_mtp
from mlx_mtp import loading
from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.loading import ModelKindError, WeightsError, cast_floats, load_model
from mlx_mtp.models.base import ConfigError
from mlx_mtp.models.gemma4 import Config


def copy_model(tmp_path, variant="moe", kind="target"):
    dst = tmp_path / f"{variant}-{kind}"
    shutil.copytree(TINY / variant / kind, dst)
    return dst


def test_missing_shard_names_the_file(tmp_path):
    path = copy_model(tmp_path)
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(WeightsError, match=shard.name):
        load_model(path)


def test_corrupt_safetensors_names_the_file(tmp_path):
    path = copy_model(tmp_path, "dense")
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(WeightsError, match="model.safetensors"):
        load_model(path)


def test_unknown_model_type(tmp_path):
    path = copy_model(tmp_path, "dense")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        load_model(path)


def test_shape_mismatch_names_the_tensor(tmp_path):
    path = copy_model(tmp_path, "dense")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match=r"mlp\.(gate_up|down)_proj"):
        load_model(path)


def test_wrong_path():
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_model("./no/such/model")


def test_released_and_transformers_config_forms_agree(tmp_path):
    path = copy_model(tmp_path, "moe")
    config = json.loads((path / "config.json").read_text())
    assert "per_layer_config" in config
    released = {k: v for k, v in config.items() if k != "per_layer_config"}
    released.update(global_head_dim=32, num_global_key_value_heads=1)
    a, b = Config.from_dict(config), Config.from_dict(released)
    assert (a.global_head_dim, a.num_global_key_value_heads) == (b.global_head_dim, b.num_global_key_value_heads)
    (path / "config.json").write_text(json.dumps(released))
    model = load_model(path)[0]
    logits = model(mx.array(reference("moe")["prompt"][None])).logits
    assert np.abs(np.array(logits[0]) - reference("moe")["logits_exact"]).max() <= 1e-4


def test_unknown_config_keys_are_logged_not_fatal(caplog):
    config = json.loads((TINY / "dense" / "target" / "config.json").read_text())
    config["brand_new_field"] = 3
    with caplog.at_level(logging.INFO, logger="mlx_mtp"):
        Config.from_dict(config)
    assert "brand_new_field" in caplog.text


def test_a_drafter_passed_as_the_target_is_named():
    drafter = TINY / "dense" / "drafter"
    with pytest.raises(ModelKindError, match=r"drafter \(gemma4_assistant\), not a target model; pass it"):
        mlx_mtp.load(drafter)
    with pytest.raises(ModelKindError, match="not an MTP drafter"):
        mlx_mtp.load(TINY / "dense" / "target", drafter=TINY / "dense" / "target")


def low_precision_moe(dtype):
    """The tiny MoE in `dtype`, and the same (rounded) weights computing in float32."""
    model = load_model(TINY / "moe" / "target", dtype=dtype)[0]
    ref = load_model(TINY / "moe" / "target", dtype=dtype)[0]
    cast_floats(ref, mx.float32)
    return model, ref


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_low_precision_moe_generates_on_this_backend(dtype):
    model, ref = low_precision_moe(dtype)
    ids = reference("moe")["prompt"].tolist()
    assert len([t for t, _ in generate_tokens(model, ids, max_tokens=8)]) == 8
    logits = model(mx.array([ids])).logits[0]
    assert logits.dtype == dtype
    ours, theirs = np.array(logits.astype(mx.float32)), np.array(ref(mx.array([ids])).logits[0])
    # The tiny fixture is chaotic (dense bf16 logits differ by 0.16 on average from float32 compute).
    assert np.abs(ours - theirs).mean() < 0.3 and (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.8


def test_experts_compute_in_float32_where_gather_mm_cannot(monkeypatch):
    monkeypatch.setattr(loading, "gather_mm_supports", lambda dtype: dtype == mx.float32)
    model, ref = low_precision_moe(mx.bfloat16)
    layer = model.model.layers[0]
    assert layer.experts.switch_glu.down_proj.weight.dtype == mx.float32
    assert layer.mlp.gate_up_proj.weight.dtype == mx.bfloat16 and layer.router.proj.weight.dtype == mx.bfloat16
    ids = mx.array(reference("moe")["prompt"][None])
    ours, theirs = np.array(model(ids).logits[0].astype(mx.float32)), np.array(ref(ids).logits[0])
    assert np.abs(ours - theirs).mean() < 0.3
