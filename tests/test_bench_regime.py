"""Benchmark regimes (apps/bench/regime.py). mkl needs a fresh process (the BLAS is loaded
before mlx.core), so it runs in subprocesses and is skipped where MKL is missing."""

import glob
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from apps.bench import regime
from apps.bench.cli import main

ROOT = Path(__file__).resolve().parents[1]
MKL = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so.*")))


needs_mkl = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64" or not MKL,
    reason="the mkl regime needs Linux x86-64 and `pip install mkl` (libmkl_rt in the venv)")


def run_python(code: str, tmp_path, env=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), **(env or {})}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_stock_regime_runs_and_is_labelled(tmp_path):
    out = tmp_path / "speed"
    rc = main(["speed", "--pair", "tiny-dense", "--regime", "stock", "--batch", "1", "--k", "1",
               "--tokens", "4", "--repeats", "1", "--classes", "fixture", "--no-mlx-lm", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    res = data["results"][0]
    assert data["environment"]["regime"]["name"] == res["regime"]["name"] == "stock"
    provider = res["regime"]["sgemm_provider"]
    if platform.system() == "Linux":  # the wheel's own BLAS, read from libmlx.so's GOT
        assert provider and "blas" in Path(provider).name and "mkl" not in provider
    assert {r["mode"] for r in res["rows"]} == {"ours-plain", "ours-mtp-1"}
    assert all(r["decode_tps"] > 0 for r in res["rows"])
    md = (out / "results.md").read_text()
    assert "regime stock" in md and "python -m apps.bench speed --pair tiny-dense" in md


def test_a_second_regime_in_one_process_is_refused():
    regime.setup("stock")
    with pytest.raises(regime.RegimeError, match="fresh"):
        regime.setup("mkl")


@needs_mkl
def test_mkl_regime_binds_mlx_sgemm_to_mkl(tmp_path):
    proc = run_python("import json; from apps.bench import regime; print(json.dumps(regime.setup('mkl')))", tmp_path)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.splitlines()[-1])
    assert os.path.realpath(info["sgemm_provider"]) == os.path.realpath(MKL[-1])
    assert info["mkl_threads"] == int(regime.MKL_THREADS)
    # The check can fail: stock under an MKL LD_PRELOAD is refused.
    proc = run_python("from apps.bench import regime; regime.setup('stock')", tmp_path, {"LD_PRELOAD": MKL[-1]})
    assert proc.returncode != 0 and "served by" in proc.stderr
