"""Benchmark regimes (apps/bench/regime.py). mkl and streaming need a
fresh process (the BLAS is loaded before mlx.core), so they run in subprocesses and are skipped
where MKL, a C compiler or AVX-512 is missing."""

import glob
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from apps.bench import regime
from apps.bench.cli import main

ROOT = Path(__file__).resolve().parents[1]
MKL = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so.*")))


def has_avx512() -> bool:
    try:
        return " avx512f " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


needs_mkl = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64" or not MKL,
    reason="the mkl/streaming regimes need Linux x86-64 and `pip install mkl` (libmkl_rt in the venv)")
needs_streaming = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")) or not has_avx512(),
    reason="the streaming regime compiles an AVX-512 kernel: needs a C compiler and an AVX-512F CPU")


def run_python(code: str, tmp_path, env=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), **(env or {})}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_stock_regime_stepcost_runs_and_is_labelled(tmp_path):
    out = tmp_path / "stepcost"
    rc = main(["stepcost", "--pair", "tiny", "--regime", "stock", "--batch", "1,2", "--max-tokens", "2",
               "--k", "1", "--repeats", "1", "--context", "8", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    res = data["results"][0]
    assert data["environment"]["regime"]["name"] == res["regime"]["name"] == "stock"
    provider = res["regime"]["sgemm_provider"]
    if platform.system() == "Linux":  # the wheel's own BLAS, read from libmlx.so's GOT
        assert provider and "blas" in Path(provider).name and "mkl" not in provider
    assert set(res["round_in_plain_steps"]) == {"1@1", "1@2"}
    assert all(v > 0 for v in res["round_in_plain_steps"].values())
    md = (out / "results.md").read_text()
    assert "regime stock" in md and "python -m apps.bench stepcost --pair tiny" in md


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


STREAMING_PROBE = """
import json, sys
import numpy as np
from apps.bench import regime
info = regime.setup('streaming')
import mlx.core as mx
data = np.load(sys.argv[1])
out, counts = {}, {}
for name in ('r1', 'r3', 'r8', 'r16'):
    x, w, c = (mx.array(data[f'{name}_{k}']) for k in 'xwc')
    regime.streaming_counts(reset=True)
    y, z = x @ w.T, mx.addmm(c, x, w.T, alpha=0.5, beta=2.0)
    mx.eval(y, z)
    out[name + '_y'], out[name + '_z'] = np.array(y), np.array(z)
    counts[name] = regime.streaming_counts(reset=True)
np.savez('streamed.npz', **out)
print(json.dumps({'info': info, 'counts': counts}))
"""


@needs_mkl
@needs_streaming
def test_streaming_regime_serves_small_rows_and_matches_stock(tmp_path):
    rng = np.random.default_rng(0)
    shapes = {"r1": (1, 100, 37), "r3": (3, 1000, 65), "r8": (8, 100, 37), "r16": (16, 100, 37)}  # (M, K, N)
    data = {}
    for name, (M, K, N) in shapes.items():  # K = 100, 1000: not multiples of 16
        data[f"{name}_x"] = rng.standard_normal((M, K)).astype(np.float32)
        data[f"{name}_w"] = rng.standard_normal((N, K)).astype(np.float32)
        data[f"{name}_c"] = rng.standard_normal((M, N)).astype(np.float32)
    np.savez(tmp_path / "probe.npz", **data)
    proc = subprocess.run([sys.executable, "-c", STREAMING_PROBE, str(tmp_path / "probe.npz")], cwd=tmp_path,
                          env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"),
                               "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    lib = report["info"]["streaming_lib"]
    assert lib.startswith(str(tmp_path / "cache")) and report["info"]["sgemm_provider"] == lib  # built, bound
    assert "EMULATION" in report["info"]["label"]
    for name in ("r1", "r3", "r8"):
        assert report["counts"][name] == [2, 0], name  # both products served by the streaming kernel
    assert report["counts"]["r16"] == [0, 2]  # > 8 rows: forwarded to MKL
    streamed = np.load(tmp_path / "streamed.npz")
    for name in shapes:
        x, w, c = (mx.array(data[f"{name}_{k}"]) for k in "xwc")
        stock = {"y": np.array(x @ w.T), "z": np.array(mx.addmm(c, x, w.T, alpha=0.5, beta=2.0))}
        for k, ref in stock.items():
            rel = np.abs(streamed[f"{name}_{k}"] - ref).max() / np.abs(ref).max()
            assert rel < 1e-5, (name, k, rel)

