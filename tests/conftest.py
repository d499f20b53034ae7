"""Shared fixtures: the tiny transformers-made checkpoints in tests/fixtures/tiny."""

from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from mlx_mtp.loading import load_model

TINY = Path(__file__).parent / "fixtures" / "tiny"
VARIANTS = ("dense", "moe", "e2b")


@lru_cache(maxsize=None)
def tiny_target(variant: str):
    return load_model(TINY / variant / "target")[0]


@lru_cache(maxsize=None)
def tiny_drafter(variant: str):
    return load_model(TINY / variant / "drafter")[0]


@lru_cache(maxsize=None)
def reference(variant: str) -> dict:
    return dict(np.load(TINY / variant / "reference.npz"))


@pytest.fixture(params=VARIANTS)
def variant(request):
    return request.param


@pytest.fixture
def fused(request):
    """Parametrize indirectly: True forces the `mx.fast` RoPE/RMSNorm branch (a GPU's), False the
    compiled-ops one (the CPU's), None leaves the choice to the device; so a Metal-only break
    shows on a CPU-only CI."""
    from mlx_mtp.models.base import force_fused

    with force_fused(getattr(request, "param", None)):
        yield


BOTH_KERNELS = pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"], indirect=True)


def fused_too(values, fused):
    """Parameters (value, fused): `values` on the device's kernels, plus the `fused` ones again with
    the `mx.fast` branch forced."""
    return ([pytest.param(v, None, id=str(v)) for v in values]
            + [pytest.param(v, True, id=f"{v}-fused") for v in fused])


@pytest.fixture(scope="session")
def scripted_server(tmp_path_factory):
    """The scripted Gemma 4 model (tests/scripted.py) served over HTTP, for both APIs' tests."""
    from scripted import serve_scripted

    with serve_scripted(tmp_path_factory.mktemp("scripted-server")) as url:
        yield url


def _isolated_stores() -> None:
    """Servers and CLIs started by the tests see an empty model store and Hugging Face cache (not the
    machine's), and pull from no Hub unless a test names one (its fake Hub's HF_ENDPOINT)."""
    import os
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="mlx_mtp-tests-"))
    os.environ["MLX_MTP_MODELS"] = str(root / "models")
    os.environ["HF_HUB_CACHE"] = str(root / "hf")
    os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")  # discard: a pull nobody faked fails at once


_isolated_stores()


# The files that take longest, collected first. With `--dist loadfile` a file is one unit of work, handed
# to the workers in collection order, so a long file collected last runs alone at the end of the run.
SLOW_FIRST = ("test_learn.py", "test_bench_gpu.py", "test_pipeline.py", "test_speculative_sampling.py",
              "test_kernels_emulated.py", "test_server_agent.py", "test_server_models.py", "test_selftest.py",
              "test_quantized_demo.py", "test_video_requests.py", "test_server_prefill.py", "test_request_matrix.py",
              "test_kernels_fused.py", "test_train_drafter.py", "test_chat_cli.py", "test_server.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests keep their order
