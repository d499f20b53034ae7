"""A ragged forward (`Model.ragged`): the prompts of several sequences side by side in one forward.
Each row's K/V, logits and hidden state are bit for bit those of its own forwards on the same chunk
grid (float32 and 4-bit, the BLAS branch of a quantized product too, and under a BLAS whose
rounding follows the number of rows)."""

import copy
import json
import math
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import VARIANTS, reference, tiny_target

from mlx_mtp.models.base import force_fused
from mlx_mtp.models.quantized import dequantizing_from
from mlx_mtp.quantize import quantize
from mlx_mtp.speculative import MAX_ROLLBACK

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 12  # over ROW_EXACT_TOKENS: a chunk's quantized products may share a dequantised weight
LENGTHS = (1, 2, 6, 9, 13, 30)  # one token, within a chunk, across chunks, past the sliding window of 8


def text(variant: str) -> list:
    ref = reference(variant)
    return (ref["prompt"].tolist() + ref["greedy"].tolist()) * 3


def prompts(variant: str, lengths=LENGTHS) -> list:
    t = text(variant)
    return [t[s : s + n] for s, n in zip(range(0, 6 * len(lengths), 6), lengths)]


@lru_cache(maxsize=None)
def model(variant: str, bits):
    if bits is None:
        return tiny_target(variant)
    q = copy.deepcopy(tiny_target(variant))
    quantize(q, {}, bits=bits, group_size=32)
    mx.eval(q.parameters())
    return q


def pieces(n: int) -> list:
    """A prompt of n tokens cut as the driver cuts it: on the grid, then its last token alone."""
    edges = [*range(0, n - 1, CHUNK), n - 1, n] if n > 1 else [0, 1]
    return list(zip(edges, edges[1:]))


def alone(target, prompt: list):
    cache, out = target.make_cache(1, max_rollback=MAX_ROLLBACK), None
    for a, b in pieces(len(prompt)):
        out = target(mx.array([prompt[a:b]]), cache, keep=1 if b == len(prompt) else 0)
    return out.logits[0, -1], out.hidden[0, -1], cache


def together(target, ps: list) -> list:
    """Every row's next piece in one ragged forward, until every prompt is in."""
    caches = [target.make_cache(1, max_rollback=MAX_ROLLBACK) for _ in ps]
    todo, outs = [pieces(len(p)) for p in ps], {}
    while any(todo):
        rows = [i for i in range(len(ps)) if todo[i]]
        edges = [todo[i].pop(0) for i in rows]
        wanted = [b == len(ps[i]) for i, (_, b) in zip(rows, edges)]
        chunks = [mx.array([ps[i][a:b]]) for i, (a, b) in zip(rows, edges)]
        out = target.ragged(chunks, [caches[i] for i in rows], wanted)
        for j, i in enumerate(i for i, w in zip(rows, wanted) if w):
            outs[i] = (out.logits[j, -1], out.hidden[j, -1])
    return [(*outs[i], caches[i]) for i in range(len(ps))]


def differences(target, ps: list) -> list:
    """The rows whose K/V, logits or hidden state side by side differ from alone (bitwise)."""
    def arrays(logits, hidden, cache):
        every = [logits, hidden, *cache.keys, *cache.values]
        return [np.array(a.astype(mx.float32)) for a in every if a is not None]

    out = []
    for p, side in zip(ps, together(target, ps)):
        mine, theirs = arrays(*alone(target, p)), arrays(*side)
        if len(mine) != len(theirs) or not all(np.array_equal(a, b) for a, b in zip(mine, theirs)):
            out.append(len(p))
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bits,share", [(None, math.inf), (4, math.inf), (4, 3)],
                         ids=["fp32", "q4-kernel", "q4-blas-from-3-rows"])
def test_a_ragged_forward_gives_each_row_exactly_its_own_forwards(variant, bits, share):
    with dequantizing_from(share):
        assert differences(model(variant, bits), prompts(variant)) == []


def test_a_ragged_forward_with_the_fused_kernels_is_exact_too():
    with force_fused(True):
        assert differences(model("e2b", 4), prompts("e2b")) == []


MKL_CHILD = """
import json, sys
sys.path[:0] = [{root!r}, {tests!r}]
from apps.bench import regime
regime.setup("mkl")
import mlx.core as mx, numpy as np
from mlx_mtp.models.quantized import dequantizing_from
import test_prefill as t
x, w = mx.random.normal((40, 64), key=mx.random.key(1)), mx.random.normal((96, 64), key=mx.random.key(2))
rounds_by_rows = not np.array_equal(np.array(x[:3] @ w.T), np.array((x @ w.T)[:3]))
out = {{"rounds_by_rows": bool(rounds_by_rows)}}
for variant, bits in (("dense", None), ("moe", None), ("e2b", None), ("dense", 4), ("moe", 4)):
    with dequantizing_from(3):
        out[f"{{variant}}-{{bits}}"] = t.differences(t.model(variant, bits), t.prompts(variant))
print(json.dumps(out))
"""


def test_rows_stay_exact_under_a_blas_that_rounds_by_the_number_of_rows():
    """MKL rounds a row of a product differently with the rows beside it: a ragged forward takes
    each sequence's rows apart wherever that matters, so it stays exact there too."""
    from apps.bench import regime

    try:
        regime.find_mkl()
    except Exception as e:
        pytest.skip(f"no MKL here ({e}); `pip install -e '.[bench]'` brings it")
    code = MKL_CHILD.format(root=str(ROOT), tests=str(ROOT / "tests"))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out.pop("rounds_by_rows")  # the hazard is real here: a row's product depends on the others
    assert out == {k: [] for k in out}
