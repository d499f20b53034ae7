"""Smoke test of `python -m apps.bench` on the tiny fixtures: smallest settings, < 30 s."""

import json

from apps.bench.cli import main


def test_speed_mode_on_tiny_dense(tmp_path):
    out = tmp_path / "speed"
    rc = main(["speed", "--pair", "tiny-dense", "--batch", "1,2", "--k", "2", "--tokens", "8", "--repeats", "1",
               "--classes", "fixture", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    env = data["environment"]
    for key in ("device", "mlx", "mlx_lm", "platform", "cpu", "mkl_preloaded"):
        assert key in env
    res = data["results"][0]
    assert res["mode"] == "speed" and res["quantization"].startswith("unquantized")
    assert res["mismatches"] == []
    modes = {(r["batch"], r["mode"]) for r in res["rows"]}
    assert {(1, "ours-plain"), (1, "ours-mtp-2"), (1, "mlx-lm-plain"), (1, "mlx-lm-spec-2"),
            (2, "ours-plain"), (2, "ours-mtp-2")} <= modes
    for r in res["rows"]:
        for key in ("decode_tps", "prompt_tps", "ttft_ms", "aggregate_tps", "speedup_vs_ours_plain", "peak_mb",
                    "acceptance_length", "acceptance_at", "same_output"):
            assert key in r
        if r["mode"].startswith("ours"):
            assert r["same_output"], r  # MTP (and batched) output equals plain greedy
        assert r["decode_tps"] > 0 and r["tokens"] == 8 * r["batch"]
    mtp = next(r for r in res["rows"] if r["mode"] == "ours-mtp-2" and r["batch"] == 1)
    assert mtp["acceptance_length"] >= 1.0 and len(mtp["acceptance_at"]) == 2
    assert "2@1" in res["summary"] and "2@2" in res["summary"]
    assert "| ours-mtp-2 |" in (out / "results.md").read_text()


def test_cost_mode_on_a_tiny_shape(tmp_path):
    out = tmp_path / "cost"
    rc = main(["cost", "--shape", "tiny", "--bits", "0", "--sizes", "1,2", "--batch", "1,2", "--k", "1",
               "--repeats", "1", "--layers", "1", "--out", str(out)])
    assert rc == 0
    shape = json.loads((out / "results.json").read_text())["results"][0]["shapes"][0]
    assert set(shape["forward_ms"]) == {"1", "2"}  # JSON keys
    assert shape["drafter_ms"] and shape["projection"]["speedup"]["1@1"] > 0
    assert "PROJECTION" in (out / "results.md").read_text()
