"""Backend-aware quantized compute (mlx_mtp/models/quantized.py): the CPU branch (fp32 activations,
experts grouped by expert, weights dequantised once for many rows) and the GPU branch (MLX's own
kernels, gather_qmm) both run here by forcing the choice, and agree to the parity tolerance."""

import copy
import math
import sys
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import TINY, reference, tiny_target
from mlx_lm.models.switch_layers import SwitchGLU
from test_bench_regime import needs_mkl, run_python

from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.loading import load_model
from mlx_mtp.models import gemma4, quantized
from mlx_mtp.models.base import force_fused, using_streams
from mlx_mtp.models.quantized import (
    ROW_EXACT_TOKENS, QuantizedEmbedding, QuantizedLinear, dequantize_rows, dequantizing_from, switch_glu,
)
from mlx_mtp.models.quantize import quantize
from mlx_mtp.decode.speculative import K_MAX

TOL = 1e-4  # test_gemma4_parity's, fp32
# (GPU paths?, rows from which weights are dequantised): every branch there is.
BRANCHES = [(True, math.inf), (False, math.inf), (False, 1), (False, 3)]


def diff(a, b) -> float:
    a, b = (np.array(v.astype(mx.float32) if isinstance(v, mx.array) else v, dtype=np.float64) for v in (a, b))
    return float(np.abs(a - b).max())


def run(branch, fn):
    gpu, rows = branch
    with force_fused(gpu), dequantizing_from(rows):
        out = fn()
        mx.eval(out)
        return out


def quantized_tiny(variant: str):
    model = copy.deepcopy(tiny_target(variant))
    quantize(model, {}, bits=4, group_size=32)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def quantized_moe():
    return quantized_tiny("moe")


def test_quantize_and_load_give_backend_aware_layers(tmp_path, quantized_moe):
    from convert import convert

    kinds = {type(m) for _, m in quantized_moe.named_modules()}
    assert QuantizedLinear in kinds and QuantizedEmbedding in kinds
    assert nn.QuantizedLinear not in {type(m) for m in kinds} - {QuantizedLinear}
    out = convert(TINY / "moe" / "target", tmp_path / "q", quantize=True, bits=4, group_size=32, dtype="float32",
                  progress=False)
    loaded = load_model(out)[0]
    assert {type(m) for _, m in loaded.named_modules()} >= {QuantizedLinear, QuantizedEmbedding}
    prompt = mx.array(reference("moe")["prompt"][None])
    assert np.array_equal(np.array(loaded(prompt).logits), np.array(quantized_moe(prompt).logits))


@pytest.mark.parametrize("branch", BRANCHES[1:])
def test_cpu_branches_match_gpu_branch_on_a_quantized_moe(quantized_moe, branch):
    """Prefill of two rows (experts shared by several rows) and a decode step after it."""
    ids = mx.array(np.stack([reference("moe")["prompt"], reference("moe")["prompt"][::-1]]))

    def forward():
        cache = quantized_moe.make_cache(2)
        first = quantized_moe(ids, cache).logits
        return mx.concatenate([first, quantized_moe(ids[:, :1], cache).logits], axis=1)

    want = run(BRANCHES[0], forward)
    assert diff(run(branch, forward), want) <= TOL


@pytest.mark.parametrize("branch", BRANCHES)
def test_every_branch_matches_transformers(branch):
    """The unquantized tiny MoE (grouped experts on the CPU branch, gather_mm on the GPU one)."""
    model, ref = tiny_target("moe"), reference("moe")
    out = run(branch, lambda: model(mx.array(ref["prompt"][None])).logits)
    assert diff(out[0], ref["logits_exact"]) <= TOL


@pytest.mark.parametrize("quantized", [False, True])
def test_grouped_experts_equal_gather_path(quantized):
    """Rows grouped by expert give what SwitchGLU's gather path gives, with experts used by one
    row, by several, and not at all."""
    mx.random.seed(3)
    glu = SwitchGLU(64, 32, 6, gemma4.GeGLU())
    if quantized:
        nn.quantize(glu, group_size=32, bits=4)
    x = mx.random.normal((2, 10, 64))  # a prompt chunk: past ROW_EXACT_TOKENS, rows may share a weight
    idx = mx.array([[[0, 1], [0, 2], [1, 0], [4, 0], [0, 2]] * 2, [[2, 1], [4, 1], [1, 0], [0, 4], [4, 2]] * 2])
    want = run(BRANCHES[0], lambda: switch_glu(glu, x, idx))
    for branch in BRANCHES[1:]:
        got = run(branch, lambda: switch_glu(glu, x, idx))
        assert got.shape == (2, 10, 2, 64) and diff(got, want) <= 1e-5
    exact = run(BRANCHES[1], lambda: switch_glu(glu, x, idx))  # the same kernel, row by row
    assert np.array_equal(np.array(exact), np.array(want))


def test_cpu_branch_computes_in_fp32_and_returns_the_input_dtype():
    mx.random.seed(4)
    layer = nn.QuantizedLinear(128, 96, bias=True, group_size=64, bits=4)
    layer.__class__ = QuantizedLinear
    layer.update({k: v.astype(mx.bfloat16) for k, v in layer.parameters().items() if k in ("scales", "biases", "bias")})
    x = mx.random.normal((2, 9, 128)).astype(mx.bfloat16)
    got = run(BRANCHES[1], lambda: layer(x))
    w = mx.dequantize(layer.weight, layer.scales.astype(mx.float32), layer.biases.astype(mx.float32), 64, 4)
    exact = x.astype(mx.float32) @ w.T + layer.bias.astype(mx.float32)
    assert got.dtype == mx.bfloat16
    assert diff(got, exact) <= diff(exact.astype(mx.bfloat16), exact) + 1e-6  # only the output's rounding
    assert diff(run(BRANCHES[2], lambda: layer(x)), exact) <= diff(exact.astype(mx.bfloat16), exact) + 1e-6


def test_dequantised_head_is_chunked_and_exact(monkeypatch):
    """The tied head dequantised in blocks of output rows (the real one is 2.9 GB in fp32)."""
    mx.random.seed(5)
    emb = nn.QuantizedEmbedding(1000, 64, group_size=32, bits=4)
    emb.__class__ = QuantizedEmbedding
    x = mx.random.normal((1, 12, 64))
    whole = run(BRANCHES[2], lambda: emb.as_linear(x))
    monkeypatch.setattr(quantized, "CHUNK_BYTES", 64 * 4 * 300)  # blocks of 300 rows: 4 blocks
    chunked = run(BRANCHES[2], lambda: emb.as_linear(x))
    assert chunked.shape == (1, 12, 1000) and np.array_equal(np.array(chunked), np.array(whole))
    assert diff(chunked, run(BRANCHES[0], lambda: emb.as_linear(x))) <= 1e-5


def test_forcing_dequantisation_threshold():
    assert dequantize_rows() >= 2  # measured: one row never pays for a dequantisation
    with dequantizing_from(5):
        assert dequantize_rows() == 5
        with dequantizing_from(math.inf):
            assert dequantize_rows() == math.inf
        assert dequantize_rows() == 5


@pytest.mark.parametrize("branch", BRANCHES[1:3])
def test_greedy_mtp_equals_plain_on_the_quantized_moe(quantized_moe, branch):
    """Past the window (8), with the fixture's independently random drafter."""
    from conftest import tiny_drafter

    prompt = reference("moe")["prompt"].tolist()
    gpu, rows = branch
    with force_fused(gpu), dequantizing_from(rows):
        plain = [t for t, _ in generate_tokens(quantized_moe, prompt, max_tokens=24)]
        mtp = [t for t, _ in generate_tokens(quantized_moe, prompt, drafter=tiny_drafter("moe"), draft_tokens=3,
                                             max_tokens=24)]
    assert mtp == plain


@pytest.mark.parametrize("streams", [1, 2])
def test_dequantised_weights_are_not_held_together(streams, monkeypatch):
    """Forty experts each used by several rows: at most a round of experts (one per CPU stream)
    dequantised (fp32) at once, not all 120 projections (MLX alone would schedule the
    dequantisations first and hold most of them)."""
    mx.random.seed(6)
    glu = SwitchGLU(512, 256, 40, gemma4.GeGLU())
    nn.quantize(glu, group_size=64, bits=4)
    x = mx.random.normal((1, 120, 512))
    idx = mx.array(np.arange(240).reshape(1, 120, 2) % 40)  # every expert: 6 rows
    mx.eval(glu.parameters(), x, idx)
    one = 256 * 512 * 4  # bytes of one dequantised projection
    monkeypatch.setattr(quantized, "SPLIT_WEIGHTS", 0)  # experts this small stay on one stream otherwise
    with using_streams(streams):
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        run(BRANCHES[2], lambda: switch_glu(glu, x, idx))
    assert mx.get_peak_memory() - base < 10 * streams * one  # 120 projections were dequantised


def test_decode_and_verify_forwards_compute_each_row_alone(quantized_moe, monkeypatch):
    """Forwards of at most ROW_EXACT_TOKENS tokens per row (decode steps, verifies) never share a
    dequantised weight among rows, even where sharing pays from one row; a prompt chunk does."""
    assert K_MAX + 1 <= ROW_EXACT_TOKENS
    calls, dequantize = [], mx.dequantize

    def spy(*args, **kwargs):  # the dequantisations for a product (not the embedding's lookups)
        if sys._getframe(1).f_globals["__name__"] == quantized.__name__:
            calls.append(args[0].shape)
        return dequantize(*args, **kwargs)

    monkeypatch.setattr(mx, "dequantize", spy)
    prompt = reference("moe")["prompt"]
    ids = mx.array(np.stack([prompt, prompt[::-1]]))
    with force_fused(False), dequantizing_from(1):
        cache = quantized_moe.make_cache(2)
        mx.eval(quantized_moe(ids[:, :12], cache).logits)
        assert calls
        calls.clear()
        mx.eval(quantized_moe(ids[:, 12: 13 + K_MAX], cache).logits, quantized_moe(ids[:, -1:], cache).logits)
    assert not calls


VERIFY_EQUALS_STEPS = """
import copy, sys
sys.path.insert(0, "tests")
from apps.bench import regime
regime.setup(REGIME)
import mlx.core as mx, numpy as np
from mlx.utils import tree_map
from conftest import tiny_target
from mlx_mtp.models.quantized import dequantizing_from
from mlx_mtp.models.quantize import quantize

model = copy.deepcopy(tiny_target("moe"))
quantize(model, {}, bits=4, group_size=32)
model.update(tree_map(lambda a: a.astype(mx.bfloat16) if mx.issubdtype(a.dtype, mx.floating) else a,
                      model.parameters()))
rng = np.random.default_rng(0)
prompt, tokens = (mx.array(rng.integers(4, model.vocab_size, (4, n))) for n in (12, 4))
with dequantizing_from(1):
    verify, steps = model.make_cache(4), model.make_cache(4)
    model(prompt, verify), model(prompt, steps)
    together = model(tokens, verify).logits
    alone = mx.concatenate([model(tokens[:, t: t + 1], steps).logits for t in range(4)], axis=1)
    print(np.array_equal(np.array(together.astype(mx.float32)), np.array(alone.astype(mx.float32))))
"""


@pytest.mark.parametrize("name", ["stock", pytest.param("mkl", marks=needs_mkl)])
def test_a_verify_equals_the_decode_steps_it_stands_for_bit_for_bit(name, tmp_path):
    """bf16, 4 rows, every weight shareable: a 4-token verify's logits are those of 4 decode steps
    to the last bit. MKL rounds a row differently with the rows in a product, so this failed there
    while verifies shared dequantised weights (greedy MTP != plain at B=4 on 26B-A4B)."""
    proc = run_python(f"REGIME = {name!r}\n" + VERIFY_EQUALS_STEPS, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "True"


def test_a_forwards_tokens_per_row_are_its_own_threads():
    """Two generators on two threads run forwards at once: one's tokens per row must not decide
    how the other's layers compute."""
    from mlx_mtp.models import quantized

    rows = mx.zeros((4, 8))
    inside, seen = threading.Event(), []
    done = threading.Event()

    def prompt_chunk():
        with quantized.forward_tokens(64):
            inside.set()
            done.wait(5)

    other = threading.Thread(target=prompt_chunk)
    other.start()
    inside.wait(5)
    seen.append(quantized._tokens_per_row(rows))
    done.set()
    other.join()
    assert seen == [1]


@pytest.fixture(scope="module")
def quantized_dense():
    return quantized_tiny("dense")


@pytest.mark.parametrize("variant,rows", [("moe", math.inf), ("moe", 1), ("dense", math.inf)])
def test_spreading_over_cpu_streams_changes_no_bit(quantized_moe, quantized_dense, monkeypatch, variant, rows):
    """Weights split between streams and experts dealt out to them (every product large enough to
    spread here): the same kernels on the same inputs, so a prompt chunk and a decode step (the
    dense model's compiled) give the logits of one stream to the last bit, on this thread and (the
    MoE, uncompiled) on another, whose streams are its own. (A tiny model's compiled forward traced
    on a bare thread makes this process abort at exit, with or without streams; an Engine's does not.)"""
    model = quantized_moe if variant == "moe" else quantized_dense
    ids = mx.array(reference(variant)["prompt"])[None, :12]
    entered = []
    stream = mx.stream
    monkeypatch.setattr(quantized, "SPLIT_WEIGHTS", 0)
    monkeypatch.setattr(quantized.mx, "stream", lambda s: entered.append(str(s)) or stream(s))

    def logits(streams):
        with using_streams(streams), force_fused(False), dequantizing_from(rows):
            cache = model.make_cache(1)
            out = [model(ids, cache).logits, model(ids[:, -1:], cache).logits, model(ids[:, -1:], cache).logits]
            mx.eval(out)
            return [np.array(o) for o in out]

    one = logits(1)
    entered.clear()
    three = logits(3)
    assert len(set(entered)) == 3  # the work really went to three streams
    elsewhere = []
    if variant == "moe":
        thread = threading.Thread(target=lambda: elsewhere.extend(logits(3)))
        thread.start()
        thread.join()
    for got in (three, elsewhere) if variant == "moe" else (three,):
        assert len(got) == 3 and all(np.array_equal(a, b) for a, b in zip(one, got))


def test_work_too_small_to_spread_makes_no_stream(quantized_moe):
    """Every product of the tiny MoE is below SPLIT_WEIGHTS: a thread running it on the CPU path
    makes no stream of its own (streams live as long as the process)."""
    made = len(quantized._made)

    def forward():
        with using_streams(3), force_fused(False):
            mx.eval(quantized_moe(mx.array(reference("moe")["prompt"])[None, :12]).logits)

    thread = threading.Thread(target=forward)
    thread.start()
    thread.join()
    assert len(quantized._made) == made
