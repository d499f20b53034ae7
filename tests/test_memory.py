"""Memory policy: defaults follow the device, wired and buffer cache limits are set around
generation on a GPU (a faked Mac here) and restored after, and left alone on the CPU; /metrics
reports MLX's memory."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import TINY, reference
from starlette.testclient import TestClient

import mlx_mtp
from mlx_mtp.runtime import memory
from mlx_mtp.engine.engine import Engine, Request
from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.server.app import Settings, create_app, served_model
from mlx_mtp.server.metrics import parse

GiB = 2**30
MAC = {"device_name": "Apple M3 Max", "architecture": "applegpu_g15s", "memory_size": 64 * GiB,
       "max_recommended_working_set_size": 48 * GiB, "max_buffer_length": 32 * GiB}
LINUX = {"device_name": "AMD EPYC", "architecture": "x86_64"}  # what MLX's CPU backend reports
H100 = {"device_name": "NVIDIA H100 80GB HBM3", "architecture": "sm_90", "total_memory": 80 * GiB,
        "free_memory": 79 * GiB, "compute_capability_major": 9, "compute_capability_minor": 0}  # CUDA's keys
OLD_WIRED, OLD_CACHE = 7, 9  # what the faked setters say the limits were


@pytest.fixture
def calls(monkeypatch):
    """Record (instead of making) the calls that change MLX's process-wide memory settings."""
    seen = []

    def spy(name, previous):
        def record(*args):
            seen.append((name, *args))
            return previous
        monkeypatch.setattr(mx, name, record)

    spy("set_wired_limit", OLD_WIRED)
    spy("set_cache_limit", OLD_CACHE)
    spy("clear_cache", None)
    spy("synchronize", None)
    return seen


@pytest.fixture
def device(monkeypatch):
    """fake(info, gpu): make MLX report `info` for a default device that is a GPU or the CPU."""

    def fake(info: dict, gpu: bool) -> None:
        monkeypatch.setattr(mx, "device_info", lambda *a: dict(info))
        monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu if gpu else mx.cpu, 0))

    return fake


@pytest.fixture(scope="module")
def loaded():
    return mlx_mtp.load(TINY / "dense" / "target", TINY / "dense" / "drafter")


def generate(loaded, n=12):
    prompt = reference("dense")["prompt"].tolist()
    return [t for t, _ in generate_tokens(loaded.target, prompt, drafter=loaded.drafter, draft_tokens=3,
                                          max_tokens=n)]


def generate_plain(loaded, n=12):
    prompt = reference("dense")["prompt"].tolist()
    return [t for t, _ in generate_tokens(loaded.target, prompt, draft_tokens=0, max_tokens=n)]


def test_defaults_follow_a_mac_device_info(device, calls, loaded):
    device(MAC, gpu=True)
    weights = memory.nbytes(loaded.target) + memory.nbytes(loaded.drafter)
    plan = memory.plan(loaded.target, loaded.drafter)
    room = 48 * GiB - weights
    assert plan.device == memory.Device("gpu (Apple M3 Max, applegpu_g15s)", True, 64 * GiB, 48 * GiB)
    assert (plan.model_bytes, plan.kv_limit, plan.prefix_cache) == (weights, room // 2, room // 4)
    assert (plan.wired_limit, plan.cache_limit) == (48 * GiB, room // 8)
    line = plan.describe()
    assert "working set 48.0 GiB" in line and "wired limit 48.0 GiB" in line and "warning" not in line
    with Engine(loaded) as engine:
        assert engine.memory == plan and engine.memory_limit == room // 2
        assert engine.prompt_cache_bytes == room // 4
    with Engine(loaded, memory_limit=12345) as engine:
        assert engine.memory_limit == 12345 == engine.prompt_cache_bytes  # it cannot be over the limit


def test_defaults_follow_the_cpu_memory(device, calls, loaded):
    device(LINUX, gpu=False)
    plan = memory.plan(loaded.target, loaded.drafter)
    assert plan.device.memory == memory._physical_memory() and plan.device.working_set is None
    assert plan.kv_limit == (plan.device.memory - plan.model_bytes) // 2
    assert plan.wired_limit is None and plan.cache_limit is None
    assert "left alone (CPU)" in plan.describe()


def test_defaults_follow_an_nvidia_gpu_and_only_the_buffer_cache_is_bounded(device, calls, loaded):
    """MLX's CUDA backend: the GPU's own memory is the budget; nothing is wired (no working set, no
    wired limit there), the buffer cache is bounded while generating and restored after."""
    device(H100, gpu=True)
    plan = memory.plan(loaded.target, loaded.drafter)
    room = 80 * GiB - plan.model_bytes
    assert plan.device.backend == "cuda" and plan.device.budget == 80 * GiB
    assert (plan.kv_limit, plan.wired_limit, plan.cache_limit) == (room // 2, None, room // 8)
    assert "nothing wired (CUDA)" in plan.describe() and "NVIDIA H100" in plan.describe()
    assert generate(loaded) == generate_plain(loaded)
    assert calls[:4] == [("set_cache_limit", plan.cache_limit), ("synchronize",),
                         ("set_cache_limit", OLD_CACHE), ("clear_cache",)]
    assert [c[0] for c in calls[4:]] == [c[0] for c in calls[:4]]  # the plain run: its own plan, same calls
    assert memory.wired_limit() is None


def test_a_model_that_fills_the_device_still_gets_room_and_a_warning(device, calls, caplog, monkeypatch):
    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = mx.zeros((15 * 2**14, 2**14))  # 15 GiB of float32, lazy: never allocated

    device({**MAC, "memory_size": 16 * GiB, "max_recommended_working_set_size": 11 * GiB}, gpu=True)
    plan = memory.plan(Big())
    assert plan.model_bytes == 15 * GiB and plan.tight
    assert plan.kv_limit == 11 * GiB // 8 // 2  # at least an eighth of the working set is left
    monkeypatch.setattr(memory, "_warned", False)  # once per process
    with memory.generating(Big()):
        pass
    assert "take over 90% of the recommended working set (11.0 GiB)" in caplog.text


def test_limits_are_set_and_restored_around_generation_on_a_gpu(device, calls, loaded):
    device(MAC, gpu=True)
    plan = memory.plan(loaded.target, loaded.drafter)
    wired_while_generating = []
    prompt = reference("dense")["prompt"].tolist()
    for _ in generate_tokens(loaded.target, prompt, drafter=loaded.drafter, draft_tokens=3, max_tokens=12):
        wired_while_generating.append(memory.wired_limit())
    assert set(wired_while_generating) == {48 * GiB} and memory.wired_limit() is None
    assert calls == [("set_wired_limit", 48 * GiB), ("set_cache_limit", plan.cache_limit), ("synchronize",),
                     ("set_wired_limit", OLD_WIRED), ("set_cache_limit", OLD_CACHE), ("clear_cache",)]


def test_an_engine_keeps_the_model_wired_while_it_runs(device, calls, loaded):
    """Set once when the worker starts, whatever else generates meanwhile; restored at close."""
    device(MAC, gpu=True)
    with Engine(loaded) as engine:
        done = engine.submit(Request(prompt=reference("dense")["prompt"].tolist(), max_tokens=8)).result(60)
        assert len(done.tokens) == 8
        assert generate(loaded) == generate_plain(loaded)  # nested: changes nothing
        assert [c[0] for c in calls] == ["set_wired_limit", "set_cache_limit"]
    assert [c[0] for c in calls][2:] == ["synchronize", "set_wired_limit", "set_cache_limit", "clear_cache"]
    assert calls[3] == ("set_wired_limit", OLD_WIRED)


def test_limits_are_left_alone_on_the_cpu(device, calls, loaded):
    device(LINUX, gpu=False)
    assert generate(loaded) == generate_plain(loaded)
    with Engine(loaded) as engine:
        engine.submit(Request(prompt=[5, 6, 7], max_tokens=4)).result(60)
    assert calls == [] and memory.wired_limit() is None


def test_metrics_report_mlx_memory(loaded):
    def page(client) -> tuple:
        values = parse(client.get("/metrics").text)
        return tuple(values[f"mlx_mtp:memory_{k}_bytes"] for k in ("active", "cache", "peak"))

    with Engine(loaded) as engine:
        client = TestClient(create_app(engine, Settings(served_model(loaded, "tiny"))))
        before = page(client)  # live figures, before any request too
        engine.submit(Request(prompt=[5, 6, 7], max_tokens=4)).result(60)
        active, cache, peak = page(client)
    assert before[0] >= memory.nbytes(loaded.target) and before[2] >= before[0]
    assert active >= memory.nbytes(loaded.target) and peak >= active and cache >= 0
