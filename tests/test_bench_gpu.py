"""`python -m apps.bench gpu --smoke`: the GPU suite's code at the tiny fixture shapes, as a user
runs it (a fresh process), on this machine's CPU; and the pieces its figures rest on."""

import importlib.util
import re
import time
import json
import math
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from apps.bench import gpu, inmemory

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "tiny"


def test_the_gpu_suite_runs_at_tiny_shapes_in_a_fresh_process(tmp_path):
    out = subprocess.run([sys.executable, "-m", "apps.bench", "gpu", "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())["results"][0]
    assert res["smoke"] and res["mismatches"] == [] and "saved" not in res  # no GPU JSON from a smoke run
    assert res["bandwidth"]["bytes_per_s"] > 0 and res["card"] and res["backend"] == "CPU"
    assert sorted(res["shapes"]) == ["tiny-dense", "tiny-e2b", "tiny-moe"]
    for name, shape in res["shapes"].items():
        assert [int(n) for n in shape["prefill"]] == list(gpu.SMOKE.prefill)
        assert shape["first_token_after_load_s"] > 0
        batches = gpu.MOE_BATCHES if shape["moe"] else gpu.BATCHES
        assert sorted(int(B) for B in shape["decode"]) == sorted(batches)
        for B, d in shape["decode"].items():
            assert d["tok_s"] > 0 and d["bytes_per_step"] > 0, (name, B)
            assert d["roofline"] is None if res["backend"] == "CPU" else 0 < d["roofline"], (name, B)
        assert sorted(shape["mtp"]) == sorted(f"K={k},B={B}" for k, B in gpu.ORACLE_RUNS)
        for key, run in shape["mtp"].items():
            assert run["equals_plain"] and run["round_in_plain_steps"] > 0 and run["speedup"] > 0, (name, key)
        assert shape["peers"]["ours_mtp"]["1"] > 0 and shape["peers"]["ours_mtp"]["4"] > 0
    moe = res["shapes"]["tiny-moe"]["decode"]
    assert moe["1"]["union_mean"] == 2.0  # top-2 routing: one row reads exactly two experts per layer
    assert 2.0 <= moe["4"]["union_mean"] <= moe["16"]["union_mean"] <= 4.0  # 4 experts in all
    dense = res["shapes"]["tiny-dense"]["peers"]
    assert dense["mlx_lm_plain"]["1"] > 0 and dense["mlx_lm_plain"]["4"] > 0, dense
    assert dense["equals_ours_plain"]["mlx-lm B=1"] in (True, False)
    if importlib.util.find_spec("mlx_vlm"):
        assert dense["mlx_vlm_mtp"]["1"] > 0 and dense["mtp_over_mlx_vlm"]["4"] > 0, dense
    else:
        assert dense["mlx_vlm_skipped"] == "mlx-vlm is not installed (pip install mlx-vlm to compare)"
    if res["backend"] == "CPU":  # mlx-lm's MoE: float32 only on the CPU, skipped in one line
        assert "GatherMM" in res["shapes"]["tiny-moe"]["peers"]["mlx_lm_skipped"]
    assert all(r["equals_plain"] for r in res["demo"].values())
    md = (tmp_path / "results.md").read_text()
    assert "| figure | tiny-dense | tiny-moe | tiny-e2b |" in md and "MTP oracle K=auto,B=8 / plain" in md
    assert sorted(res["stages"]) == sorted(["tiny-dense", "tiny-moe", "tiny-dense-batch", "tiny-moe-batch", "prefill",
                                            "peers", "tiny-e2b", "demo"])  # named for what they are
    assert "31b" not in out.stdout and "26b-a4b" not in out.stdout and "e4b" not in out.stdout.replace("e2b", "")
    if res["backend"] == "CPU":
        assert "roofline" not in md.split("| figure |")[1] and "compiling GPU kernels" not in out.stdout
        assert out.stdout.count("skipped, the roofline fraction") == 1


def test_random_weights_are_drawn_in_their_stored_form_at_the_planned_spread():
    """Each quantized tensor is drawn as codes, scales and biases (no float copy is made), giving
    weights of standard deviation 1 / sqrt(fan-in) centred on zero, as the converter lays them out."""
    config = json.loads((TINY / "dense" / "target" / "config.json").read_text())
    out_config, weights = inmemory.random_checkpoint(config, 4, seed=0)
    assert out_config["quantization"]["bits"] == 4 and out_config["quantization"]["group_size"] == 64
    up = "model.layers.0.mlp.up_proj"
    w = mx.dequantize(weights[f"{up}.weight"], weights[f"{up}.scales"], weights[f"{up}.biases"],
                      group_size=64, bits=4).astype(mx.float32)
    fan_in = w.shape[-1]
    assert abs(float(w.std()) * math.sqrt(fan_in) - 1) < 0.1
    assert abs(float(w.mean())) < 0.1 / math.sqrt(fan_in)
    again = inmemory.random_checkpoint(config, 4, seed=0)[1]
    assert all(mx.array_equal(weights[k], again[k]) for k in weights)  # seed-deterministic


def test_a_decode_step_reads_only_the_experts_its_rows_route_to():
    config = json.loads((TINY / "moe" / "target" / "config.json").read_text())
    target = inmemory.build(config, 4, seed=0)[0]
    layers, experts = target.config.num_hidden_layers, target.config.num_experts
    every = gpu.step_bytes(target, 1, 0, [experts] * layers)
    two = gpu.step_bytes(target, 1, 0, [2] * layers)
    expert_tensors = [a.nbytes for name, a in tree_flatten(target.parameters()) if ".experts." in name]
    read = sum(expert_tensors) * (experts - 2) / experts
    assert abs((every - two) - read) <= len(expert_tensors)  # rounding per tensor
    assert gpu.step_bytes(target, 2, 10, [2] * layers) > two  # two rows' K/V over 10 positions


def suite_args(tmp_path, **over):
    import types

    base = dict(smoke=True, shapes=None, stages=None, budget=None, kernel_cache=None, no_peers=True, no_demo=True,
                prefill="32", p=0.8, seed=0, kernels=None, results_dir=str(tmp_path / "results"), command_line="x")
    return types.SimpleNamespace(**{**base, **over})


def test_stages_run_in_order_of_value_and_those_past_the_budget_are_skipped_saying_so(tmp_path, monkeypatch):
    """What a short window on a fresh GPU machine gets: the chosen stages in order, each figure printed
    as it is measured, the JSON written again after every stage, a stage that would not fit skipped
    in one line."""
    import dataclasses

    said, saves = [], []
    estimates = {"31b": 0, "26b-a4b-batch": 20000}  # seconds (x 0.05 in a smoke run); the others keep theirs
    monkeypatch.setattr(gpu, "STAGES", tuple(dataclasses.replace(s, estimate_s=estimates.get(s.name, s.estimate_s))
                                             for s in gpu.STAGES))
    monkeypatch.setattr(gpu, "saving", lambda args, device: True)
    real_save = gpu.save
    monkeypatch.setattr(gpu, "save", lambda res, args: saves.append(sorted(res["stages"])) or real_save(res, args))
    res = gpu.run_gpu(suite_args(tmp_path, stages="31b,prefill,26b-a4b-batch", budget=600), said.append)
    # the STAGES order, not the option's; named for the stand-ins a smoke run builds
    assert list(res["stages"]) == ["tiny-dense", "tiny-moe-batch", "prefill"]
    assert res["stages"]["tiny-moe-batch"]["skipped"].startswith("needs ~1000 s")
    assert "stage tiny-moe-batch: skipped (needs ~1000 s of the budget" in "\n".join(said)
    assert saves[0] == ["tiny-dense"] and saves[-1] == ["prefill", "tiny-dense", "tiny-moe-batch"]
    saved = json.loads(Path(res["saved"]).read_text())
    assert saved["shapes"]["tiny-dense"]["mtp"]["K=3,B=1"]["equals_plain"] and "tiny-moe" not in saved["shapes"]
    assert [int(n) for n in saved["shapes"]["tiny-dense"]["prefill"]] == [32]
    assert any(line.startswith("  plain B=1: ") for line in said)  # printed as soon as it exists
    with pytest.raises(SystemExit, match="unknown stage"):
        gpu.chosen_stages(suite_args(tmp_path, stages="31b,fast"))


@pytest.fixture
def cuda(monkeypatch):
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu, 0))
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)


def test_the_kernel_cache_option_keeps_mlxs_kernels_in_a_folder_and_counts_them(tmp_path, cuda, monkeypatch):
    from mlx_mtp.runtime import jit

    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    folder = tmp_path / "ptx"
    folder.mkdir()
    (folder / "qmm_sm80.ptx").write_text("x")
    cache = jit.KernelCache.open(str(folder))
    assert jit.kernel_dir() == folder.resolve() and cache.report()["found"] == 1
    told = []
    stop = jit.watch_compiles(told.append, every=0.05)
    for name in ("a.ptx", "b.ptx", "a.cu"):
        (folder / name).write_text("x")
    deadline = time.time() + 5
    while not told and time.time() < deadline:
        time.sleep(0.05)
    stop()
    assert told and told[-1] == 2 and cache.report() == dict(folder=str(folder.resolve()), found=1, compiled=2)


def test_warming_runs_prefill_decode_and_every_verify_at_each_batch_size(capsys):
    from mlx_mtp.selftest import checks as selftest

    argv = ["--warm", str(TINY / "moe" / "target"), "--drafter", str(TINY / "moe" / "drafter"), "--batches", "1-2"]
    assert selftest.main(argv) == 0
    out = capsys.readouterr().out
    assert "B=2: plain steps and verifies of K = 1..6 run, and in turn" in out
    assert re.search(r"warmed .*: 17 runs, \d+ kernels compiled, \d+ s", out)  # 1 + 2 x (K = 0..6, a cycle)


@pytest.mark.skipif(mx.cuda.is_available(), reason="on a GPU the kernels run as they are")
def test_the_kernels_bench_without_a_gpu_emulates_its_smoke_run_and_refuses_the_rest_in_one_line(tmp_path, capsys):
    from apps.bench import kernels
    from apps.bench.cli import main

    assert main(["kernels", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == ("kernels: needs an NVIDIA GPU (MLX's CUDA backend); `--smoke` runs tiny shapes "
                                       "through the CPU emulator of a source checkout\n")
    if kernels.emulator() is None:
        pytest.skip("no g++ for the emulator")
    assert main(["kernels", "--smoke", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())["results"][0]
    assert res["device"].endswith("CUDA kernels EMULATED") and res["mismatches"] == []
    rows = res["dense"] + res["experts"] + res["attention"]
    assert len(rows) == 10 and all(r["invariant"] and r["error"] < 1e-2 for r in rows)
    assert "| 1 | " in (tmp_path / "results.md").read_text()
