"""`python -m convert`: tiny checkpoints round-trip through the converter and load again."""

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import TINY, reference, tiny_drafter, tiny_target

from convert import convert, main
from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.loading import WeightsError, load_model
from mlx_mtp.models.base import ConfigError

REPO = Path(__file__).resolve().parents[1]
SOURCES = {
    "dense": TINY / "dense" / "target",
    "moe": TINY / "moe" / "target",
    "e2b": TINY / "e2b" / "target",
    "wrapper": TINY / "dense" / "wrapper",
}
# bits -> bounds on (max |logit diff|, top-1 agreement). The tiny fixtures are chaotic (0.3%
# multiplicative weight noise moves logits by ~1.5), so these are loose; exactness against the
# same quantization done in memory is the sharp check.
BOUNDS = {8: (3.0, 0.7), 4: (8.0, 0.1)}


def ref_variant(name):
    return "dense" if name == "wrapper" else name


def prompt(name):
    return mx.array(reference(ref_variant(name))["prompt"][None])


def logits(model, name):
    return np.array(model(prompt(name)).logits[0].astype(mx.float32))


def greedy(model, name, n=32):
    ids = reference(ref_variant(name))["prompt"].tolist()
    return [t for t, _ in generate_tokens(model, ids, max_tokens=n)]


def quantized_in_memory(name, **kw):
    import copy

    from mlx_mtp.models.quantize import quantize

    model = copy.deepcopy(tiny_target(ref_variant(name)))
    quantize(model, {}, **kw)
    return model


def run(src, out, **kw):
    return load_model(convert(src, out, progress=False, **kw))


def no_leftovers(parent: Path):
    return not [p for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


@pytest.mark.parametrize("name", list(SOURCES))
def test_float32_conversion_is_exact(tmp_path, name):
    model, config, _ = run(SOURCES[name], tmp_path / "out", dtype="float32")
    ref = tiny_target(ref_variant(name))
    assert np.array_equal(logits(model, name), logits(ref, name))
    assert "quantization" not in config and "per_layer_config" not in json.dumps(config)
    assert config["dtype"] == "float32"


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_bfloat16_conversion_equals_bfloat16_load(tmp_path, name):
    from mlx.utils import tree_flatten

    model, _, _ = run(SOURCES[name], tmp_path / "out")
    ref, _, _ = load_model(SOURCES[name], dtype=mx.bfloat16)
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16
    ours, theirs = dict(tree_flatten(model.parameters())), dict(tree_flatten(ref.parameters()))
    assert ours.keys() == theirs.keys() and all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)
    assert np.array_equal(logits(model, name), logits(ref, name))  # MoE too, on any backend


def test_wrapper_uses_mlx_lm_names(tmp_path):
    out = convert(SOURCES["wrapper"], tmp_path / "out", quantize=True, group_size=32, progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    text = [k for k in index["weight_map"] if not k.startswith(("vision_tower.", "embed_vision."))]
    assert all(k.startswith("language_model.model.") for k in text) and len(text) < len(index["weight_map"])
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma4" and "vision_config" in config  # the tower is kept (tests/test_vision_convert.py)
    assert config["vocab_size"] == config["text_config"]["vocab_size"] == 128


@pytest.mark.parametrize("name", list(SOURCES))
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_target_error_is_bounded(tmp_path, name, bits):
    kw = dict(dtype="float32", quantize=True, bits=bits, group_size=32)
    model, config, _ = run(SOURCES[name], tmp_path / "out", **kw)
    assert config["quantization"]["bits"] == bits
    ref = tiny_target(ref_variant(name))
    ql, rl = logits(model, name), logits(ref, name)
    diff = float(np.abs(ql - rl).max())
    top1 = float((ql.argmax(-1) == rl.argmax(-1)).mean())
    g = float(np.mean(np.array(greedy(model, name)) == np.array(greedy(ref, name))))
    print(f"\n[convert-metrics] {name} {bits}-bit: max|dlogit|={diff:.4f} top1={top1:.3f} greedy32={g:.3f}")
    assert np.array_equal(ql, logits(quantized_in_memory(name, bits=bits, group_size=32), name))
    max_diff, min_top1 = BOUNDS[bits]
    assert diff < max_diff and top1 >= min_top1


def test_moe_router_stays_at_8_bits(tmp_path):
    _, config, _ = run(SOURCES["moe"], tmp_path / "out", quantize=True, bits=4, group_size=32)
    record = config["quantization"]
    routers = {k: v for k, v in record.items() if k.endswith("router.proj")}
    assert len(routers) == 6 and all(v["bits"] == 8 for v in routers.values())
    assert config["quantization_config"] == record  # the HF-tree copy mlx-lm also writes


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4", "mxfp8"])
def test_microscaling_modes(tmp_path, mode):
    from mlx_mtp.models.quantize import FIXED_MODES, available_modes

    if mode not in available_modes():
        pytest.skip(f"{mode} not in this MLX")
    model, config, _ = run(SOURCES["dense"], tmp_path / "out", dtype="float32", quantize=True, mode=mode)
    group_size, bits = FIXED_MODES[mode]
    assert {k: config["quantization"][k] for k in ("group_size", "bits", "mode")} == {
        "group_size": group_size, "bits": bits, "mode": mode,
    }
    diff = float(np.abs(logits(model, "dense") - logits(tiny_target("dense"), "dense")).max())
    print(f"\n[convert-metrics] dense {mode}: max|dlogit|={diff:.4f}")
    assert diff < 8.0
    assert np.array_equal(logits(model, "dense"), logits(quantized_in_memory("dense", mode=mode), "dense"))
    with pytest.raises(ValueError, match="fixes group_size"):
        convert(SOURCES["dense"], tmp_path / "x", quantize=True, mode=mode, group_size=128, progress=False)


@pytest.mark.parametrize("group_size", [64, 128])
def test_group_sizes(tmp_path, group_size):
    kw = dict(dtype="float32", quantize=True, bits=8, group_size=group_size)
    model, config, _ = run(SOURCES["dense"], tmp_path / "out", **kw)
    assert config["quantization"]["group_size"] == group_size
    ql = logits(model, "dense")
    assert float(np.abs(ql - logits(tiny_target("dense"), "dense")).max()) < BOUNDS[8][0]
    assert np.array_equal(ql, logits(quantized_in_memory("dense", bits=8, group_size=group_size), "dense"))


def test_preset_mixed_4_8(tmp_path):
    _, config, _ = run(SOURCES["dense"], tmp_path / "out", preset="mixed_4_8", quantize=True, group_size=32)
    record = config["quantization"]
    assert record["bits"] == 4
    eights = {k for k, v in record.items() if isinstance(v, dict) and v["bits"] == 8}
    assert eights and all(k.startswith(("model.layers.0.", "model.layers.5.")) for k in eights)
    assert "model.layers.5.mlp.down_proj" in eights


@pytest.mark.parametrize("variant", ["dense", "e2b"])  # e2b: centroid head
def test_drafter_conversion(tmp_path, variant):
    src = TINY / variant / "drafter"
    ref, target, r = tiny_drafter(variant), tiny_target(variant), reference(variant)
    token = target.embed(mx.array([[int(r["greedy"][0])]]))[:, 0]
    hidden = mx.array(r["hidden_exact"][-1:])
    kv = target(prompt(variant)).shared_kv
    position = mx.array([20], dtype=mx.int32)
    want = ref.draft_step(token, hidden, kv, position)

    # -q alone leaves a drafter unquantized; --quantize-drafter quantizes it
    plain, config, _ = run(src, tmp_path / "fp32", dtype="float32", quantize=True)
    assert "quantization" not in config
    got = plain.draft_step(token, hidden, kv, position)
    assert np.array_equal(np.array(got.logits), np.array(want.logits))

    kw = dict(dtype="float32", quantize_drafter=True, bits=8, group_size=32)
    quant, config, _ = run(src, tmp_path / "q8", **kw)
    assert config["quantization"]["bits"] == 8 and "scales" in quant.model.embed_tokens
    got = quant.draft_step(token, hidden, kv, position)
    if variant == "e2b":
        order = quant.masked_embedding.token_ordering
        assert order.dtype == mx.int32 and mx.array_equal(order, ref.masked_embedding.token_ordering).item()
        assert "scales" in quant.masked_embedding.centroids
        assert np.array_equal(np.array(got.token_ids), np.array(want.token_ids))
    diff = float(np.abs(np.array(got.logits) - np.array(want.logits)).max())
    print(f"\n[convert-metrics] {variant} drafter 8-bit gs32: max|dlogit| first draft step={diff:.4f}")
    assert diff < 0.2 and int(got.argmax().item()) == int(want.argmax().item())


@pytest.mark.parametrize("name", ["dense", "moe", "e2b", "wrapper"])
def test_mlx_lm_loads_conversion(tmp_path, name):
    from mlx_lm.utils import load_model as mlx_lm_load_model

    for kw in ({"dtype": "float32"}, {"dtype": "float32", "quantize": True, "bits": 4, "group_size": 32}):
        out = tmp_path / str(len(kw))
        ours = run(SOURCES[name], out, **kw)[0]
        theirs, _ = mlx_lm_load_model(out)
        diff = np.abs(np.array(theirs(prompt(name))[0]) - logits(ours, name)).max()
        assert diff < 1e-4, (kw, diff)


def test_tokenizer_files_copied(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(SOURCES["dense"], src)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (src / f).write_text("{}")
    (src / "tokenizer.model").write_bytes(b"\0sp")
    (src / "notes.txt").write_text("not copied")
    out = convert(src, tmp_path / "out", progress=False)
    names = {p.name for p in out.iterdir()}
    assert {"tokenizer.json", "tokenizer.model", "chat_template.jinja", "generation_config.json"} <= names
    assert "notes.txt" not in names


# ---- bad input: a clear error and nothing left behind --------------------------------------


def _expect_failure(tmp_path, src, exc, match):
    out = tmp_path / "out"
    with pytest.raises(exc, match=match):
        convert(src, out, progress=False)
    assert not out.exists() and no_leftovers(tmp_path)


def test_missing_shard(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(SOURCES["moe"], src)
    (src / "model-00003-of-00004.safetensors").unlink()
    _expect_failure(tmp_path, src, WeightsError, "missing shard")


def test_truncated_safetensors(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(SOURCES["dense"], src)
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    _expect_failure(tmp_path, src, WeightsError, "model.safetensors")


def test_unknown_model_type(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(SOURCES["dense"], src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    _expect_failure(tmp_path, src, ConfigError, "unsupported model_type 'llama'")


def test_existing_output_needs_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(FileExistsError, match="--force"):
        convert(SOURCES["dense"], out, progress=False)
    assert (out / "keep").exists()
    assert main([str(SOURCES["dense"]), str(out), "--quiet"]) == 1
    convert(SOURCES["dense"], out, force=True, progress=False)
    assert not (out / "keep").exists() and (out / "config.json").exists() and no_leftovers(tmp_path)


def snapshot(path: Path) -> dict:
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_output_overlapping_the_source_is_refused(tmp_path, capsys):
    src = tmp_path / "p" / "src"
    shutil.copytree(SOURCES["dense"], src)
    (tmp_path / "link").symlink_to(src)
    before = snapshot(tmp_path / "p")
    for out, why in [(src, "is the source"), (tmp_path / "p", "contains the source"),
                     (src / "out", "is inside the source"), (tmp_path / "link", "is the source")]:
        with pytest.raises(ValueError, match=why):
            convert(src, out, force=True, quantize=True, progress=False)
        assert main([str(src), str(out), "-q", "--force", "--quiet"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and why in err
        assert snapshot(tmp_path / "p") == before


def test_stale_partial_dirs_are_removed(tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    stale, live = tmp_path / f".out.partial-{dead.pid}", tmp_path / f".out.partial-{os.getppid()}"
    other = tmp_path / f".other.partial-{dead.pid}"  # another output's: not ours to judge
    for d in (stale, live, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    convert(SOURCES["dense"], tmp_path / "out", progress=False)
    assert not stale.exists() and live.exists() and other.exists()
    assert f"removed {stale}" in capsys.readouterr().err


def test_interrupted_run_leaves_nothing(tmp_path, monkeypatch):
    cc = importlib.import_module("convert.convert")  # the package's `convert` is the function

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cc, "_move_into_place", boom)
    with pytest.raises(KeyboardInterrupt):
        convert(SOURCES["dense"], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path)


def test_cli(tmp_path):
    out = tmp_path / "out"
    assert main([str(SOURCES["e2b"]), str(out), "-q", "--bits", "8", "--group-size", "32", "--quiet"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 8
    assert main([str(SOURCES["dense"]), str(tmp_path / "o2"), "--bits", "8", "--quiet"]) == 1  # needs -q


def test_the_readmes_conversions_are_ones_the_converter_takes(tmp_path, capsys):
    """Each command of the README's "Converting checkpoints" (`python -m convert`, `mlx-mtp-convert`)
    passes the converter's own rules, not only argparse's: run as a --dry-run on the tiny checkpoints
    (the tiny drafter for an -assistant source)."""
    section = (REPO / "README.md").read_text().split("## Converting checkpoints", 1)[1].split("\n## ", 1)[0]
    commands = [line.split("#", 1)[0].split() for line in section.splitlines()
                if line.startswith(("python -m convert ", "mlx-mtp-convert "))]
    assert len(commands) >= 4 and any(words[0] == "mlx-mtp-convert" for words in commands)
    for words in commands:
        source, _, *options = words[3:] if words[0] == "python" else words[1:]
        src = TINY / "dense" / ("drafter" if "assistant" in source else "target")
        rc = main([str(src), str(tmp_path / "out"), *options, "--dry-run", "--quiet"])
        assert rc == 0, (words, capsys.readouterr().err)
    assert main([str(SOURCES["dense"]), str(tmp_path / "out"), "-q", "--bits", "8", "--preset", "mixed_4_8",
                 "--dry-run", "--quiet"]) == 1  # what the README showed: the preset sets the bits itself
    assert "mixed_4_8 sets the bits itself" in capsys.readouterr().err


def test_usage_names_how_the_converter_was_run(monkeypatch):
    from convert.convert import build_parser

    usage = subprocess.run([sys.executable, "-m", "convert", "--help"], capture_output=True, text=True,
                           cwd=REPO, check=True).stdout
    assert usage.startswith("usage: python -m convert ")
    monkeypatch.setattr(sys, "argv", ["/venv/bin/mlx-mtp-convert"])
    assert build_parser().format_usage().startswith("usage: mlx-mtp-convert ")


# ---- bounded memory ------------------------------------------------------------------------

MEASURE = (
    "import resource, subprocess, sys, time; t = time.time(); "
    "rc = subprocess.call(sys.argv[1:]); "
    "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, time.time() - t)"
)


def _measure(cmd):
    """(peak RSS bytes, seconds) of `cmd` in a fresh process tree."""
    cmd = [sys.executable, "-c", MEASURE, *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True)
    rc, kb, secs = out.stdout.split()[-3:]
    assert rc == "0", out.stderr
    return int(kb) * 1024, float(secs)


def synthetic_checkpoint(path: Path) -> list[int]:
    """A gemma4_text checkpoint of ~0.95 GB fp32 in 5 shards; returns the shard sizes."""
    from mlx.utils import tree_flatten

    from mlx_mtp.models import gemma4

    config = {
        "model_type": "gemma4_text", "vocab_size": 16384, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "global_head_dim": 256, "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "sliding_window": 512,
        "final_logit_softcapping": 30.0, "tie_word_embeddings": True,
    }
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    model = gemma4.Model(gemma4.Config.from_dict(config))  # its tensors in the checkpoint's layout
    shapes = {k: v.shape for k, v in gemma4.unjoin(dict(tree_flatten(model.parameters())), model.model.layers).items()}
    groups = {}
    for key in shapes:
        layer = key.split(".")[2] if key.startswith("model.layers.") else "rest"
        groups.setdefault(layer, []).append(key)
    weight_map, sizes = {}, []
    for i, (_, keys) in enumerate(sorted(groups.items())):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {k: mx.random.uniform(-0.03, 0.03, shapes[k]) for k in keys}
        mx.save_safetensors(str(path / name), shard)
        sizes.append((path / name).stat().st_size)
        weight_map.update(dict.fromkeys(keys, name))
        del shard
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return sizes


@pytest.mark.slow
def test_peak_memory_is_about_one_shard(tmp_path):
    sizes = synthetic_checkpoint(tmp_path / "src")
    baseline, _ = _measure([sys.executable, "-c", "import mlx.core, mlx_mtp.loading, convert"])
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "convert", str(tmp_path / "src"), str(out), "--quiet"]
    cmd += ["--max-shard-size", "0.2"]
    peak, secs = _measure(cmd)
    total = sum(sizes)
    print(
        f"\n[convert-metrics] {total / 1e9:.2f} GB fp32 -> bf16, "
        f"shards {[round(s / 1e6) for s in sizes]} MB: peak RSS {peak / 1e6:.0f} MB "
        f"(baseline {baseline / 1e6:.0f} MB, largest shard {max(sizes) / 1e6:.0f} MB), "
        f"{secs:.1f}s, {total / 1e9 / secs * 60:.2f} GB/min"
    )
    assert peak < 1.5 * max(sizes) + baseline
    model, _, _ = load_model(out, lazy=True)
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == mx.bfloat16


def test_hub_id_goes_through_resolve(tmp_path, monkeypatch):
    import huggingface_hub

    asked = []

    def fake_snapshot_download(repo_id, allow_patterns=None):
        asked.append((repo_id, allow_patterns))
        return str(SOURCES["e2b"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    model, _, _ = run("google/gemma-4-tiny-test", tmp_path / "out", dtype="float32")
    assert asked and asked[0][0] == "google/gemma-4-tiny-test" and "*.jinja" in asked[0][1]
    assert np.array_equal(logits(model, "e2b"), logits(tiny_target("e2b"), "e2b"))


def test_reconverting_an_mlx_conversion_is_lossless(tmp_path):
    kw = dict(quantize=True, group_size=32, preset="mixed_4_8", progress=False)
    first = convert(SOURCES["wrapper"], tmp_path / "a", **kw)
    again = convert(first, tmp_path / "b", progress=False)
    assert json.loads((first / "config.json").read_text()) == json.loads((again / "config.json").read_text())
    a, b = load_model(first)[0], load_model(again)[0]
    assert np.array_equal(logits(a, "wrapper"), logits(b, "wrapper"))
    with pytest.raises(ValueError, match="already quantized"):
        convert(first, tmp_path / "c", quantize=True, progress=False)
    assert not (tmp_path / "c").exists() and no_leftovers(tmp_path)


# ---- real released configs, shapes only (no weights) -----------------------------------------

REAL = Path(__file__).parent / "fixtures" / "real_configs"


@pytest.mark.parametrize(
    "google, community",
    [("gemma-4-26B-A4B-it", "gemma-4-26b-a4b-it-4bit"), ("gemma-4-E2B-it", "gemma-4-e2b-it-4bit")],
)
def test_default_4bit_recipe_matches_mlx_community(google, community):
    from convert.convert import plan

    def normal(record):
        return {k: {"mode": "affine", **v} if isinstance(v, dict) else v for k, v in record.items()}

    _, config, weights = plan(REAL / f"google--{google}", quantize=True, shapes_only=True, progress=False)
    theirs = json.loads((REAL / f"mlx-community--{community}" / "config.json").read_text())["quantization"]
    assert normal(config["quantization"]) == normal(theirs)
    vision = ("vision_tower.", "embed_vision.", "audio_tower.", "embed_audio.")  # kept in --dtype (E2B/E4B: audio too)
    assert all(k.startswith("language_model.model.") for k in weights if not k.startswith(vision))
    assert not any(k.endswith(".scales") for k in weights if k.startswith(vision))


# ---- the 12B (`gemma4_unified`) and its drafter, on tests/fixtures/unified --------------------------

UNIFIED = Path(__file__).parent / "fixtures" / "unified"


def unified_logits(model):
    ids = mx.array(np.load(UNIFIED / "reference.npz")["prompt"][None])
    return np.array(model(ids).logits[0].astype(mx.float32))


def unified_embedders(path: Path):
    from mlx_mtp.loading import load_weights, read_config, weight_files
    from mlx_mtp.models.gemma4_unified import embedders_from_weights

    return embedders_from_weights(read_config(path), load_weights(weight_files(path)))


def embedded(embedders):
    """Soft tokens of the fixture's first image and first audio clip."""
    r = np.load(UNIFIED / "reference.npz")
    real = (r["image_positions"][1] >= 0).all(-1)
    image = embedders.image(r["image_codes"][1][real].astype(np.float32) / 255, r["image_positions"][1][real])
    return np.array(image), np.array(embedders.audio(r["audio_frames"][1]))


def test_unified_float32_conversion_is_exact(tmp_path):
    out = convert(UNIFIED / "target", tmp_path / "out", dtype="float32", progress=False)
    model, config, _ = load_model(out)
    assert np.array_equal(unified_logits(model), unified_logits(load_model(UNIFIED / "target")[0]))
    assert config["model_type"] == "gemma4_unified" and {"vision_config", "audio_config"} <= set(config)
    text = config["text_config"]  # spelled out: mlx-lm's gemma4 defaults are not the unified ones
    assert (text["max_position_embeddings"], text["hidden_size_per_layer_input"]) == (262144, 0)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert {k.split(".")[0] for k in index} == {"language_model", "vision_embedder", "embed_vision", "embed_audio"}
    ours, theirs = embedded(unified_embedders(out)), embedded(unified_embedders(UNIFIED / "target"))
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs))
    assert load_model(convert(out, tmp_path / "again", dtype="float32", progress=False))[1] == config


def test_unified_quantized_conversion(tmp_path):
    import copy

    from mlx_mtp.models.quantize import quantize

    kw = dict(dtype="float32", quantize=True, bits=4, group_size=32, quantize_vision=True)
    out = convert(UNIFIED / "target", tmp_path / "q4", progress=False, **kw)
    model, config, _ = load_model(out)
    ref = load_model(UNIFIED / "target")[0]
    in_memory = copy.deepcopy(ref)
    quantize(in_memory, {}, bits=4, group_size=32)
    assert np.array_equal(unified_logits(model), unified_logits(in_memory))
    assert float(np.abs(unified_logits(model) - unified_logits(ref)).max()) < BOUNDS[4][0]
    embedders = unified_embedders(out)
    assert "scales" in embedders.vision_embedder.patch_dense and "scales" in embedders.embed_audio.embedding_projection
    assert "scales" not in embedders.embed_vision.embedding_projection  # 8 wide: no group of 32 fits
    image, audio = embedded(embedders)
    want_image, want_audio = embedded(unified_embedders(UNIFIED / "target"))
    assert np.abs(image - want_image).max() < 0.5 and np.abs(audio - want_audio).max() < 0.5


def test_unified_drafter_conversion(tmp_path):
    from mlx_mtp.loading import load

    pair = load(UNIFIED / "target", drafter=UNIFIED / "drafter")
    plain, config, _ = run(UNIFIED / "drafter", tmp_path / "fp32", dtype="float32", quantize=True)
    assert config["model_type"] == "gemma4_unified_assistant" and "quantization" not in config
    kv = pair.target(mx.array(np.load(UNIFIED / "reference.npz")["prompt"][None])).shared_kv
    token, hidden = pair.target.embed(mx.array([5])), mx.ones((1, 32))
    position = mx.array([20], dtype=mx.int32)
    want = pair.drafter.draft_step(token, hidden, kv, position).logits
    assert np.array_equal(np.array(plain.draft_step(token, hidden, kv, position).logits), np.array(want))
    quant, config, _ = run(UNIFIED / "drafter", tmp_path / "q8", dtype="float32", quantize_drafter=True, bits=8,
                           group_size=32)
    assert config["quantization"]["bits"] == 8 and "scales" in quant.pre_projection  # (16 wide: no group of 32)
    quant.check_target(pair.target)


def test_mlx_lm_loads_unified_conversion(tmp_path):
    from mlx_lm.utils import load_model as mlx_lm_load_model

    ids = mx.array(np.load(UNIFIED / "reference.npz")["prompt"][None])
    for kw in ({"dtype": "float32"}, {"dtype": "float32", "quantize": True, "bits": 4, "group_size": 32}):
        out = tmp_path / str(len(kw))
        ours = run(UNIFIED / "target", out, **kw)[0]
        theirs, _ = mlx_lm_load_model(out)
        assert np.abs(np.array(theirs(ids)[0]) - unified_logits(ours)).max() < 1e-4, kw


def test_unified_12b_dry_run_writes_mlx_community_names():
    from convert.convert import plan

    _, config, weights = plan(REAL / "google--gemma-4-12B-it", quantize=True, shapes_only=True, progress=False)
    media = ("vision_embedder.", "embed_vision.", "embed_audio.")
    assert all(k.startswith("language_model.model.") for k in weights if not k.startswith(media))
    assert sum(k.startswith(media) for k in weights) == 11 and not any(k.endswith(".scales") for k in weights
                                                                        if k.startswith(media))
    assert config["quantization"]["bits"] == 4 and config["vocab_size"] == 262144
