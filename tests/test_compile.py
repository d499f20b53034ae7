"""Compiled forwards (issue 20): the same tokens as uncompiled ones, the weights a module holds
at each call, no tracer ever left in a module, and the first-run notice of the front ends."""

import contextlib
import copy
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import TINY, reference, tiny_drafter, tiny_target

import mlx_mtp
from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.loading import load_model
from mlx_mtp.decode.speculative import MAX_ROLLBACK


@contextlib.contextmanager
def uncompiled():
    mx.disable_compile()
    try:
        yield
    finally:
        mx.enable_compile()


def decode(variant, **kw):
    return [t for t, _ in generate_tokens(tiny_target(variant), reference(variant)["prompt"].tolist(),
                                          max_tokens=40, **kw)]


@pytest.mark.parametrize("k", [0, 3])
def test_compiled_decoding_equals_uncompiled(variant, k):
    """Greedy, with a random drafter (rejections happen), past the sliding window."""
    kw = dict(drafter=tiny_drafter(variant), draft_tokens=k) if k else {}
    compiled = decode(variant, **kw)
    with uncompiled():
        assert decode(variant, **kw) == compiled


def steps(target, prompt, n=3):
    """Logits of `n` one-token steps after `prompt` (fixed-shape steps: the compiled forward)."""
    cache = target.make_cache(1, max_rollback=MAX_ROLLBACK)
    target(mx.array([prompt]), cache)
    out = [target(mx.array([[5 + i]]), cache).logits for i in range(n)]
    return np.array(mx.concatenate(out, axis=1))


def test_weights_changed_after_compiling_are_the_ones_used():
    target = load_model(TINY / "dense" / "target")[0]
    prompt = reference("dense")["prompt"].tolist()
    before = steps(target, prompt)
    target.update({"model": {"norm": {"weight": target.model.norm.weight * 3}}})
    after = steps(target, prompt)
    with uncompiled():
        eager = steps(target, prompt)
    assert not np.allclose(after, before, atol=1e-3)
    assert np.allclose(after, eager, atol=1e-5)


def test_a_copied_model_compiles_for_itself():
    target = load_model(TINY / "dense" / "target")[0]
    prompt = reference("dense")["prompt"].tolist()
    mine = steps(target, prompt)
    twin = copy.deepcopy(target)
    twin.update({"model": {"norm": {"weight": twin.model.norm.weight * 3}}})
    assert not np.allclose(steps(twin, prompt), mine, atol=1e-3)
    assert np.array_equal(steps(target, prompt), mine)


def test_a_failed_trace_leaves_no_tracer_in_the_model():
    drafter, target = tiny_drafter("dense"), tiny_target("dense")
    out = target(mx.array([reference("dense")["prompt"].tolist()]))
    token = target.embed(mx.array([[3]]))[:, 0]
    with pytest.raises(ValueError):  # a hidden state of the wrong width: fails inside the trace
        drafter.draft_step(token, mx.zeros((1, 7)), out.shared_kv, mx.array([20]))
    good = drafter.draft_step(token, out.hidden[:, -1], out.shared_kv, mx.array([20]))
    mx.eval(good.logits, drafter.parameters())  # a tracer left in the module could not be evaluated


def run(code: str, tmp: Path) -> str:
    root = Path(mlx_mtp.__file__).resolve().parent.parent
    env = dict(os.environ, TMPDIR=str(tmp))
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120, check=True).stdout


COMPILE = ("import time, mlx.core as mx\nfrom mlx_mtp import jit\n"
           "jit.on_first_compile(lambda: print(jit.NOTICE, flush=True), every=0.02)\n"
           "f = mx.compile(lambda x: mx.tanh(x * {}) * 0.5 + 0.25)\n"
           "mx.eval(f(mx.ones((8,))))\ntime.sleep(0.2)\n")


def test_a_compile_is_announced_only_while_this_process_compiles(tmp_path):
    """The chat and the server say so while MLX's CPU backend builds kernels this machine never
    built (kept on disk under the temporary directory): not on the next run, and not when another
    process is what fills the folder."""
    if mx.default_device() != mx.cpu:
        pytest.skip("GPU kernels are not built by a system compiler")
    assert run(COMPILE.format(1.2345), tmp_path).strip() == "compiling kernels (kept on disk for later runs)"
    watcher = COMPILE.format(1.2345) + (  # the same kernel again: built on the first run
               "folder = jit.kernel_dir()\nbefore = jit.count(folder)\nprint('ready', flush=True)\n"
               "deadline = time.time() + 100\n"
               "while jit.count(folder) == before and time.time() < deadline:\n    time.sleep(0.02)\n"
               "time.sleep(0.3)\nprint('seen' if jit.count(folder) > before else 'timeout', flush=True)\n")
    root, env = Path(mlx_mtp.__file__).resolve().parent.parent, dict(os.environ, TMPDIR=str(tmp_path))
    watching = subprocess.Popen([sys.executable, "-c", watcher], cwd=root, env=env, stdout=subprocess.PIPE, text=True)
    assert watching.stdout.readline() == "ready\n"
    other = run(COMPILE.format(2.5), tmp_path)  # a kernel new to the folder, built by another process
    assert watching.communicate(timeout=120)[0] == "seen\n"
    assert other.strip() == "compiling kernels (kept on disk for later runs)"


def test_traces_are_bounded():
    """MLX keeps every trace while a compiled function lives (~2 KB per graph node): past its
    limit of argument signatures a `Bounded` function starts afresh, and stays right."""
    from mlx_mtp.runtime.jit import Bounded

    calls = []

    def f(x, scale):
        calls.append(x.shape)  # runs only while tracing
        return x * scale + 1

    fn = Bounded(f, limit=3)
    for n in range(1, 8):
        assert np.array_equal(np.array(fn(mx.ones((n,)), 2.0)), np.full(n, 3.0))
        assert len(fn.seen) <= 3
    fn(mx.ones((7,)), 2.0)
    assert len(calls) == 7  # the last signature was still traced
    fn(mx.ones((1,)), 2.0)
    assert len(calls) == 8  # an early one was dropped with the rest


def test_the_chats_notice_never_lands_inside_a_reply_line(capsys):
    """The compile notice comes from another thread: on the shared terminal it waits for the
    reply's line to end (`1, 1, 1compiling kernels` was what it printed)."""
    import threading

    from mlx_mtp.chat import Console

    console = Console()
    console.line("before")  # no line half written: at once
    console.write(sys.stdout, "1, 1, 1")
    noticed = threading.Thread(target=console.line, args=("compiling kernels",))
    noticed.start()
    noticed.join()
    assert capsys.readouterr() == ("1, 1, 1", "before\n")
    console.write(sys.stdout, ", 2\ndef f(")
    assert capsys.readouterr() == (", 2\ndef f(", "")
    console.write(sys.stderr, "x):\n")
    assert capsys.readouterr() == ("", "x):\ncompiling kernels\n")
