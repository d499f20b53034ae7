"""Smoke tests of `python -m apps.bench`: smallest settings, a few seconds per mode."""

import json

import pytest

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


def _results(out):
    data = json.loads((out / "results.json").read_text())
    res = data["results"][0]
    assert res["loadavg"]["start"] and res["command"].startswith("python -m apps.bench")
    md = (out / "results.md").read_text()
    assert res["command"] in md and "Regime: " in md and "Load average" in md
    return res, md


def test_speed_mode_prompts_and_dtype(tmp_path):
    out = tmp_path / "speed"
    rc = main(["speed", "--pair", "tiny-dense", "--batch", "1", "--k", "2", "--tokens", "6", "--repeats", "1",
               "--classes", "fixture", "--prompts", "2", "--dtype", "float32", "--mlxlm-draft", "none",
               "--out", str(out)])
    assert rc == 0
    res, _ = _results(out)
    assert res["prompts"] == 2 and res["mismatches"] == []
    assert {r["mode"] for r in res["rows"]} == {"ours-plain", "ours-mtp-2", "mlx-lm-plain"}
    for r in res["rows"]:  # two prompts of 6 tokens each, every output equal to plain greedy
        assert r["tokens"] == 12 and len(r["prompt_tokens"]) == 2 and r["same_output"], r


def test_engine_mode_on_tiny_dense(tmp_path):
    out = tmp_path / "engine"
    rc = main(["engine", "--pair", "tiny-dense", "--clients", "1,2", "--fifo-clients", "2", "--max-tokens", "6",
               "--repeats", "1", "--out", str(out)])
    assert rc == 0
    res, md = _results(out)
    pair = res["pairs"][0]
    assert pair["mismatches"] == []  # every request equals its plain greedy output
    keys = {r["key"] for r in pair["rows"]}
    assert {"mb2-n1-mtp", "mb2-n2-mtp", "mb1-n2-mtp", "gen-n1-mtp", "mb2-n2-plain", "mb1-n2-plain"} <= keys
    for r in pair["rows"]:
        for key in ("aggregate_tps", "per_request_tps", "decode_tps", "ttft_p50_ms", "ttft_p95_ms"):
            assert r[key] > 0, (key, r)
    assert pair["ratios"]["batch_vs_fifo_mtp"] > 0 and pair["ratios"]["mtp_vs_plain_n2"] > 0
    assert "max_batch=1" in md


def test_lookup_mode_on_the_demo_pair(tmp_path):
    out = tmp_path / "lookup"
    rc = main(["lookup", "--files", "1", "--lines", "12", "--tokens", "10", "--k", "4", "--out", str(out)])
    assert rc == 0
    res, _ = _results(out)
    assert res["mismatches"] == []  # n-gram, MTP and hybrid outputs equal plain greedy
    assert {r["mode"] for r in res["rows"]} == {"plain", "ngram-4", "mtp-4", "hybrid-4"}
    assert all(r["tokens_per_forward"] >= 1.0 for r in res["rows"])
    assert "renamed to" in res["example"]


def test_prefill_mode_on_the_demo_pair(tmp_path):
    out = tmp_path / "prefill"
    rc = main(["prefill", "--arrivals", "3", "--prompt-tokens", "20-40", "--max-tokens", "4", "--budgets", "1,512",
               "--repeats", "1", "--out", str(out)])
    assert rc == 0
    res, md = _results(out)
    assert res["mismatches"] == []  # one at a time and batched both give plain greedy
    rows = res["scenarios"][0]["rows"]
    assert [r["label"] for r in rows] == ["one at a time", "batched, 512 tokens a step"]
    assert rows[0]["rows_per_forward"] == 1 and rows[1]["rows_per_forward"] == 3
    assert rows[0]["forwards"] == 6 and rows[1]["forwards"] == 2  # a chunk and a last token per row, or per step
    assert "TTFT p95 ms" in md and res["scenarios"][0]["lengths"] == [20, 30, 40]


def test_ttft_mode_against_mlx_vlm(tmp_path, monkeypatch):
    pytest.importorskip("mlx_vlm")  # optional, bench only (pip install mlx-vlm)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "ttft"
    rc = main(["ttft", "--models", "e2b", "--e2b-hidden", "64", "--lengths", "16,40", "--repeats", "1",
               "--out", str(out)])
    assert rc == 0
    res, _ = _results(out)
    rows = res["models"][0]["rows"]
    assert [r["length"] for r in rows] == [16, 40]
    for r in rows:
        assert r["same_first_token"] and r["ours_ms"] > 0 and r["vlm_ms"] > 0
        assert r["logits_max_abs_diff"] < 1e-2 * max(r["logits_scale"], 1.0)


def test_realsize_mode_on_the_tiny_shape(tmp_path):
    """The checkpoint pair is written once through the converter's shapes-only plan, then reused."""
    out, cache = tmp_path / "realsize", tmp_path / "cache"
    argv = ["realsize", "--shape", "tiny", "--cache-dir", str(cache), "--prefill", "8", "--batch", "1,2",
            "--mtp-batch", "2", "--tokens", "6", "--batch-tokens", "5", "--long-context", "40", "--repeats", "1",
            "--out", str(out)]
    assert main(argv) == 0
    res, md = _results(out)
    assert set(res["checkpoint"]["written"]) == {"target", "assistant"}
    assert (cache / "tiny-4bit" / "target" / "model.safetensors.index.json").exists()
    assert res["mtp"]["2"]["equals_plain"] and res["mismatches"] == []
    assert res["plain"]["2"]["union_mean"] >= res["plain"]["1"]["union_mean"] == 2  # top-2 of 4 experts
    assert res["long_context"]["full_layers"] == 2 and res["long_context"]["full_bytes_per_token"] > 0
    assert "| greedy MTP == plain, B=2, 5 tokens | yes |" in md
    assert main(argv + ["--streams", "3"]) == 0  # reused, not rewritten
    again = json.loads((out / "results.json").read_text())["results"][0]
    assert again["checkpoint"]["written"] == {} and again["streams"] == 3 and again["mismatches"] == []
    assert "quantized work on 3 CPU stream(s)" in (out / "results.md").read_text()
