"""Pipeline parallelism: two local ranks (ring backend over loopback) give exactly the output of
one process, hold about half of the weights each, and stop with a clear error when a peer dies."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from chat_helpers import DRAFTER, REWRITING_TEMPLATE, make_chat_model
from conftest import TINY, tiny_drafter, tiny_target
from pipeline_jobs import run_jobs

import mlx_mtp
from mlx_mtp.distributed.group import EXIT_PEER_LOST, loopback_hostfile
from mlx_mtp.distributed.pipeline import PlacementError, nbytes, place, split_layers

HERE = Path(__file__).parent
ROOT = HERE.parent


def start_ranks(tmp_path: Path, *args, **env) -> list:
    """Two ranks of `pipeline_ranks.py`, started as `mlx.launch` would (MLX_RANK, MLX_HOSTFILE)."""
    hosts = loopback_hostfile(tmp_path / "hosts.json")
    base = {**os.environ, "PYTHONPATH": str(ROOT), "MLX_HOSTFILE": str(hosts), **env}
    command = [sys.executable, str(HERE / "pipeline_ranks.py"), *map(str, args)]
    return [subprocess.Popen(command, env={**base, "MLX_RANK": str(r)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for r in range(2)]


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    """The tiny dense target with a chat tokenizer whose template rewrites history, so a
    conversation resumes from a state before its last reply each turn."""
    return make_chat_model(tmp_path_factory.mktemp("pp") / "dense", REWRITING_TEMPLATE)


@pytest.fixture(scope="module")
def group_run(tmp_path_factory, dense_dir):
    out = tmp_path_factory.mktemp("ranks")
    ranks = start_ranks(out, out, dense_dir, "check")
    logs = [p.communicate(timeout=240) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], logs
    return out


def test_two_ranks_give_the_output_of_one_process(group_run, dense_dir):
    got = json.loads((group_run / "jobs.json").read_text())
    for variant, target in (("dense", dense_dir), ("moe", TINY / "moe" / "target")):
        want = json.loads(json.dumps(run_jobs(mlx_mtp.load(target, TINY / variant / "drafter"), variant)))
        assert set(got[variant]) == set(want)
        for job in want:
            assert got[variant][job] == want[job], (variant, job)
    assert len(got["dense"]["plain"]) == 30 and got["dense"]["mtp3"] == got["dense"]["plain"]
    assert got["dense"]["seeded"] != got["dense"]["plain"]  # it really sampled
    assert len(got["dense"]["batch"]["1"]) < 24  # cancelled part way


def test_each_rank_holds_about_half_of_the_weights(group_run):
    ranks = [json.loads((group_run / f"rank{r}.json").read_text()) for r in range(2)]
    for variant in ("dense", "moe"):
        total = nbytes(tiny_target(variant)) + nbytes(tiny_drafter(variant))
        (a0, b0), (a1, b1) = ranks[0][variant]["span"], ranks[1][variant]["span"]
        assert a0 == 0 and b0 == a1 and b1 == 6  # contiguous, every layer once
        for rank in ranks:
            assert 0.35 * total < rank[variant]["weight_bytes"] < 0.65 * total, (variant, rank, total)
    for rank in ranks:  # the other rank's tensors were never read from the checkpoint
        assert rank["dense"]["active"] < 1.1 * rank["dense"]["weight_bytes"]


def test_the_chat_runs_under_mlx_launch(dense_dir, tmp_path):
    """Two ranks write what one process writes, token for token, also with the CPU busy (a
    process burning a core while the ranks run: once, in a full test run on a loaded machine, the
    two outputs differed). Every choice of a round is rank 0's or the last rank's, told to the
    other (`lockstep`); nothing a rank decides depends on its timing: the draft length is fixed
    here, and `auto`'s (timing-driven) choice is sent by rank 0 and followed. What can differ is a
    rank that failed, which mlx.launch does not report in its exit status: checked in its output."""
    lines = "Hello there\nand one more thing\n/quit\n"  # mlx.launch keeps stdin open: /quit ends
    args = ["-m", "mlx_mtp.chat", "--model", dense_dir, "--drafter", DRAFTER, "--max-tokens", "20",
            "--draft-tokens", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launcher = [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()",
                "--backend", "ring", "-n", "2", "--hosts", "127.0.0.1", "--starting-port", str(_free_ports(2))]
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        two = subprocess.run(launcher + [sys.executable, *map(str, args)], input=lines, capture_output=True,
                             text=True, env=env, timeout=240, cwd=tmp_path)
    finally:
        burner.kill()
        burner.wait()
    one = subprocess.run([sys.executable, *map(str, args)], input=lines, capture_output=True, text=True,
                         env=env, timeout=120)
    said = f"\none process: {one.stdout!r}\n{one.stderr}\ntwo ranks: {two.stdout!r}\n{two.stderr}"
    # mlx.launch exits 0 whatever its ranks do: a rank that failed shows only as its warning (and, before
    # this check, as a stdout that differed)
    assert two.returncode == 0 and one.returncode == 0 and "exited with code" not in two.stderr, said
    assert "was killed" not in two.stderr and "error:" not in two.stderr, said
    assert two.stdout == one.stdout and two.stdout.strip(), said
    assert _stat_lines(two.stderr) == _stat_lines(one.stderr), said  # the same rounds, not only the same text
    assert one.stderr.count(" tokens: 1 from the prompt") == 2  # two replies (their text may hold newlines)
    assert "rank 1 of 2: layers 4-5" in two.stderr


def _stat_lines(stderr: str) -> list:
    """Each reply's count line without its timings: tokens, MTP rounds, acceptance."""
    return [line.split(";")[0] for line in stderr.splitlines() if " tokens: " in line]


def _free_ports(n: int) -> int:
    """The first of `n` consecutive ports free now (mlx.launch's ring takes --starting-port and the
    ones after it; MLX binds them with SO_REUSEPORT, so a port another group holds would be shared
    with it, not refused)."""
    while True:
        first = _free_port()
        try:
            with contextlib.ExitStack() as held:
                for port in range(first, first + n):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(proc, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in proc.stdout.readline():
            return
    raise AssertionError(f"no {text!r} within {timeout} s")


@pytest.mark.parametrize("how", ["stopped follower", "killed leader"])
def test_a_lost_rank_stops_the_other_with_a_clear_error(dense_dir, tmp_path, how):
    """SIGSTOP: the peer's sockets stay open and the backend would wait for ever; the watchdog
    notices the silence. SIGKILL: the connection closes."""
    ranks = start_ranks(tmp_path, tmp_path, dense_dir, "stall", MLX_MTP_PEER_TIMEOUT="3")
    try:
        _wait_for(ranks[0], "generating")
        time.sleep(0.5)
        lost, survivor = (ranks[1], ranks[0]) if how == "stopped follower" else (ranks[0], ranks[1])
        os.kill(lost.pid, signal.SIGSTOP if how == "stopped follower" else signal.SIGKILL)
        start = time.monotonic()
        _, err = survivor.communicate(timeout=30)
        waited = time.monotonic() - start
    finally:
        for p in ranks:
            p.kill()
            p.communicate()
    assert survivor.returncode == EXIT_PEER_LOST, err
    assert f"rank {ranks.index(survivor)} of 2" in err and "stopping" in err
    if how == "stopped follower":
        assert "no word from rank 1" in err and 2 < waited < 15
    else:
        assert waited < 10


def test_placement_balances_bytes_and_keeps_the_drafters_layers_last():
    def heaviest(sizes, spans, first=0, last=0):
        loads = [sum(sizes[a:b]) for a, b in spans]
        return max(loads[0] + first, *loads[1:-1], loads[-1] + last)

    assert split_layers([10] * 6, 2) == [(0, 3), (3, 6)]
    assert split_layers([10] * 6, 2, first=25) == [(0, 2), (2, 6)]  # the embedding weighs on rank 0
    assert split_layers([40, 10, 10, 10, 10, 40], 2) == [(0, 3), (3, 6)]
    assert heaviest([10] * 6, split_layers([10] * 6, 3, last=25), last=25) == 35
    assert split_layers([10] * 6, 2, last_from=2) == [(0, 2), (2, 6)]  # layers 2.. go with the drafter
    target, drafter = tiny_target("dense"), tiny_drafter("dense")
    spans = place(target, drafter, 2)
    assert spans[-1][0] <= 4  # the store layers (4: last sliding, 5: last full) sit with the drafter


def test_groups_that_do_not_fit_are_refused():
    target, drafter = tiny_target("dense"), tiny_drafter("dense")
    with pytest.raises(PlacementError, match="7 ranks for a model of 6 layers"):
        place(target, None, 7)
    with pytest.raises(PlacementError, match="drafter reads layers 4 and up"):
        place(target, drafter, 6)
    assert len(place(target, None, 6)) == 6  # without a drafter every rank gets a layer
    with pytest.raises(PlacementError, match="E2B/E4B"):
        place(tiny_target("e2b"), None, 2)


def test_the_pipeline_benchmark_counts_what_crosses_ranks(tmp_path):
    from apps.bench.cli import main

    assert main(["pipeline", "--tokens", "12", "--repeats", "1", "--k", "2", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())["results"][0]
    plain, mtp = res["rows"]
    H, K = 64, 2  # tiny dense: fp32 activations of width 64
    # plain: the hidden state to rank 1, the decision (accepted count, next token) back
    assert plain["messages_per_round"] == 2 and plain["bytes_per_round"] == H * 4 + 3 * 4
    # MTP: the drafts to rank 0 as well; the verify carries K + 1 positions
    assert mtp["messages_per_round"] == 3 and mtp["bytes_per_round"] == (K + 1) * H * 4 + K * 4 + (K + 3) * 4
    assert plain["one_process_tps"] > 0 and plain["two_ranks_tps"] > 0
    assert "LOCAL LOOPBACK ONLY" in (tmp_path / "results.md").read_text()


def test_ranks_started_by_different_processes_are_refused(dense_dir, tmp_path):
    """What two groups on the same loopback ports look like to a rank (MLX's ring binds them with
    SO_REUSEPORT and joins the groups into each other's rings): peers started by another process.
    Each rank refuses, in one line, instead of running a stranger's steps."""
    hosts = loopback_hostfile(tmp_path / "hosts.json")
    base = {**os.environ, "PYTHONPATH": str(ROOT), "MLX_HOSTFILE": str(hosts)}
    command = [sys.executable, str(HERE / "pipeline_ranks.py"), str(tmp_path), dense_dir, "check"]
    wrapped = [sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))", *command]
    ranks = [subprocess.Popen(command, env={**base, "MLX_RANK": "0"}, stderr=subprocess.PIPE, text=True),
             subprocess.Popen(wrapped, env={**base, "MLX_RANK": "1"}, stderr=subprocess.PIPE, text=True)]
    errors = [r.communicate(timeout=120)[1] for r in ranks]
    assert all(r.returncode != 0 for r in ranks)
    assert all("the ranks of this ring were started by different processes" in e for e in errors), errors
