"""MLX's backends: which build a Linux install gets (setup.py), and what changes on an NVIDIA GPU
(MLX's CUDA backend, faked here: this machine has none): the card in reports, the NVRTC kernel
cache watched on a first run, pipeline parallelism refused in one line."""

import importlib.util
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_mtp.runtime import jit, mlx_build
from mlx_mtp.distributed import pipeline
from mlx_mtp.selftest import checks as selftest

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
H100 = {"device_name": "NVIDIA H100 80GB HBM3", "architecture": "sm_90", "total_memory": 80 * GiB,
        "free_memory": 79 * GiB}


@pytest.fixture
def cuda(monkeypatch):
    """Make MLX look like its CUDA backend on an H100."""
    monkeypatch.setattr(mx, "device_info", lambda *a: dict(H100))
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu, 0))
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)


def setup_module_file():
    spec = importlib.util.spec_from_file_location("mlx_mtp_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not as __main__: setup() is not called
    return module


def test_linux_installs_one_mlx_build_chosen_on_the_machine(tmp_path):
    """pip would install `mlx[cpu]` over an extra's `mlx[cuda13]` (both write libmlx.so), so the base
    requirement itself is the CUDA build where an NVIDIA driver is loaded, or as MLX_MTP_BACKEND says."""
    setup = setup_module_file()
    driver = tmp_path / "version"
    linux = lambda deps: [d for d in deps if "linux" in d]  # noqa: E731
    assert linux(setup.dependencies({}, driver)) == ["mlx[cpu]>=0.32; sys_platform == 'linux'"]
    driver.write_text("NVRM version: 580.95")
    assert linux(setup.dependencies({}, driver)) == ["mlx[cuda13]>=0.32; sys_platform == 'linux'"]
    assert setup.linux_backend({"MLX_MTP_BACKEND": "cpu"}, driver) == "cpu"
    assert setup.linux_backend({"MLX_MTP_BACKEND": "CUDA"}, tmp_path / "none") == "cuda"
    with pytest.raises(SystemExit, match="MLX_MTP_BACKEND must be one of cpu, cuda"):
        setup.linux_backend({"MLX_MTP_BACKEND": "metal"}, driver)
    assert "mlx>=0.32; sys_platform == 'darwin'" in setup.dependencies({}, driver)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "mlx[cuda" not in pyproject and "mlx[cpu" not in pyproject  # no extra adds a second build
    assert 'dynamic = ["dependencies"]' in pyproject


def test_the_selftest_names_the_card_and_the_backend(cuda):
    lines = selftest.header(None)
    assert "NVIDIA H100 80GB HBM3" in lines[1] and "MLX CUDA backend" in lines[1] and "80.0 GiB" in lines[1]
    assert lines[3] == "wired:   nothing (the GPU's own memory)"


def test_the_selftest_warns_when_both_mlx_builds_are_installed(monkeypatch):
    import importlib.metadata as metadata

    monkeypatch.setattr(mlx_build, "version", lambda name: "0.32.4")
    assert selftest.both_builds() == ["warning: MLX's CPU and CUDA builds are both installed (one overwrote the "
                                      "other); keep one: pip uninstall -y mlx-cpu mlx-cuda-13 && pip install "
                                      "'mlx[cpu]==0.32.4'"]

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(mlx_build, "version", missing)
    assert selftest.both_builds() == []


def test_a_first_run_on_cuda_watches_the_nvrtc_kernel_cache(cuda, monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    assert jit.kernel_dir() == tmp_path / "ptx"
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    assert jit.kernel_dir().parts[-2:] == (mx.__version__, "ptx")
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)  # a GPU that is not CUDA: Metal
    assert jit.kernel_dir() is None and jit.on_first_compile(lambda: None) is None


def test_pipeline_parallelism_is_refused_on_cuda_in_one_line(cuda):
    """MLX's CUDA backend has no Send/Recv: refused before anything is read."""
    with pytest.raises(pipeline.PlacementError, match="^pipeline parallelism needs mx.distributed send/recv, "
                       "which MLX's CUDA backend does not have: run one process per GPU instead$"):
        pipeline.load("/no/such/model", None, None, group=None)


def test_benchmarks_name_the_card_without_metal_calls(cuda, monkeypatch):
    from apps.bench import env

    class NoMetal:
        def __getattr__(self, name):
            raise AssertionError(f"mx.metal.{name} on the CUDA backend")

    monkeypatch.setattr(mx, "metal", NoMetal())
    info = env.device_info()
    assert info["gpu"] == "NVIDIA H100 80GB HBM3" and info["backend"] == "cuda"
    assert "GPU NVIDIA H100 80GB HBM3), MLX CUDA backend" in env.device_line(info)
    env.reset_peak()
    assert env.peak_mb() >= 0
