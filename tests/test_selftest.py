"""`python -m mlx_mtp.selftest`: passes as a user runs it, and fails on a broken kernel or an
accept step that lets a rejected draft through."""

import subprocess
import sys

import mlx.core as mx
import pytest

from mlx_mtp.selftest import checks as selftest
from mlx_mtp.decode import speculative
from mlx_mtp.selftest.tiny import VARIANTS


PAIRS = ["demo", *VARIANTS, "moe-q4"]


def rows(text: str) -> dict[str, list[str]]:
    """The report's table: pair name -> its other columns."""
    names = set(PAIRS)
    cells = [line.split() for line in text.splitlines()]
    return {c[0]: c[1:] for c in cells if c and c[0] in names}


def test_selftest_passes_in_a_fresh_process():
    out = subprocess.run([sys.executable, "-m", "mlx_mtp.selftest"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("mlx_mtp ") and lines[1].startswith("device:")
    assert lines[3].startswith("wired:")
    assert lines[-1].startswith("PASS: 5 pairs")
    assert lines[2].endswith("products: MLX's; reference: the CPU stream, unfused")
    table = rows(out.stdout)
    assert sorted(table) == sorted(PAIRS)
    for name, columns in table.items():
        assert columns[1:4] == ["ok", "ok", "ok"], name  # logits, B=1, batch
        assert float(columns[6]) > 0 and float(columns[8]) > 0  # plain and MTP tok/s
    assert float(table["demo"][10]) > 1.5  # its trained drafter's acceptance length
    assert "terminate called" not in out.stderr


def test_selftest_passes_with_the_fused_branch_forced():
    passed, text = selftest.run(["e2b"], "fused")
    assert passed, text
    assert "mx.fast (fused) (forced)" in text
    for name, columns in rows(text).items():  # the device really took the other branch than the CPU
        assert 0 < float(columns[0]) <= selftest.TOLERANCE, name


def test_selftest_fails_when_a_fused_kernel_is_broken(monkeypatch, capsys):
    """As a Metal-only kernel break would look: the device's logits move away from the CPU's,
    while MTP and plain decoding still agree with each other."""
    rms_norm = mx.fast.rms_norm
    monkeypatch.setattr(mx.fast, "rms_norm", lambda x, w, eps: rms_norm(x, w, eps) * 1.01)
    assert selftest.main(["--pairs", "dense", "--kernels", "fused"]) == 1
    out = capsys.readouterr().out
    assert "dense: logits differ from the CPU's" in out and "greedy MTP differs" not in out
    assert out.splitlines()[-1].startswith("FAIL: 1 pairs")


def test_selftest_fails_when_a_rejected_draft_is_accepted(monkeypatch):
    real = speculative._greedy  # the compiled greedy acceptance

    def lenient(drafts, logits, limit=None):  # also takes the first rejected draft
        n, nxt = real(drafts, logits, limit)
        if drafts.shape[-1] == 0:
            return n, nxt
        n = mx.minimum(n + 1, drafts.shape[-1] if limit is None else limit)
        return n, mx.take_along_axis(mx.argmax(logits, axis=-1), n[:, None], axis=-1)[:, 0].astype(mx.int32)

    monkeypatch.setattr(speculative, "_greedy", lenient)
    passed, text = selftest.run(["e2b"])
    assert not passed
    assert "e2b: greedy MTP differs from plain decoding, or plain from itself (one row)" in text
    assert "e2b: greedy MTP differs from plain decoding in a ragged batch" in text


def test_on_cuda_the_report_names_the_kernels_that_ran(monkeypatch):
    from mlx_mtp.kernels import dispatch

    monkeypatch.setattr(dispatch, "cuda", lambda: True)
    dispatch.decisions.clear()
    assert selftest.ran() == []
    dispatch.decisions[("quantized matmul", dispatch.OURS)] += 3
    dispatch.decisions[("quantized matmul", "MLX's (600 rows)")] += 1
    assert selftest.ran() == ["ran:     quantized matmul: MLX's (600 rows) x1, mlx_mtp x3"]
    assert selftest.products("cuda").startswith("mlx_mtp's CUDA kernels for decode and verify steps")
    with dispatch.using("mlx"):
        assert selftest.products("cuda") == "MLX's (MLX_MTP_KERNELS=mlx)"
    dispatch.decisions.clear()


def test_unknown_pair_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit:
        selftest.main(["--pairs", "dense,huge"])
    assert exit.value.code == 2 and "unknown pair(s) huge" in capsys.readouterr().err
