"""A drafter that learns from use (issue 37): served requests kept (`capture`), the drafter adapted on
them (`learn`) and put in service (`Engine.swap_drafter`, `POST /v1/drafter`, `learn_every`), on the
tiny dense fixture pair. The adapted drafter never changes an output: greedy MTP == plain past the
sliding window, and sampling keeps the target's distribution."""

import hashlib
import logging
import subprocess
import sys
import threading
import time
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from chat_helpers import DRAFTER, make_chat_model
from conftest import TINY, tiny_target
from starlette.testclient import TestClient
from test_speculative_sampling import check_sampling_is_exact

import mlx_mtp
from mlx_mtp.learn import capture, distill, learner as learn
from mlx_mtp.engine.engine import Engine, Request
from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.loading import load_model
from mlx_mtp.server.app import Settings, create_app, served_model

WAIT = 60
STEPS = 30
DEMO_DRAFTER = Path(mlx_mtp.__file__).parent / "demo" / "drafter"


@lru_cache(maxsize=None)
def greedy(seed: int, n: int) -> tuple:
    """The tiny target's greedy replies (40 tokens) to `n` random prompts, decoded as one batch: (prompt,
    reply) pairs."""
    target = tiny_target("dense")
    prompts = np.random.default_rng(seed).integers(3, 128, (n, 10))
    cache = target.make_cache(n)
    logits = target(mx.array(prompts), cache).logits[:, -1]
    replies = []
    for _ in range(40):
        token = mx.argmax(logits, axis=-1)
        replies.append(token)
        logits = target(token[:, None], cache).logits[:, -1]
    replies = np.array(mx.stack(replies, axis=1))
    return tuple((p.tolist(), r.tolist()) for p, r in zip(prompts, replies))


def kept(folder: Path, pairs) -> list:
    c = capture.Capture(folder)
    for prompt, reply in pairs:
        c.add(prompt, reply, 3, 9, 4)
    c.close()
    return list(capture.read(folder))


def general() -> list:
    return [(np.array(p + r), len(p)) for p, r in greedy(1, 6)]


def digest(folder: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file())).hexdigest()


def run_adapt(records, out, **kw):
    lines = []
    report = learn.adapt(tiny_target("dense"), TINY / "dense" / "drafter", records, general(), out,
                         **{"steps": STEPS, "seq": 32, "batch": 8, "lr": 3e-2, "checkpoint_every": 10,
                            "progress": lines.append, **kw})
    return report, lines


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """(report, lines, out, records) of one adaptation of the fixture drafter on 80 greedy replies (8 held out:
    enough for its gain to clear the paired noise margin)."""
    root = tmp_path_factory.mktemp("learn")
    records = kept(root / "captured", greedy(0, 80))
    source = digest(TINY / "dense" / "drafter")
    report, lines = run_adapt(records, root / "adapted")
    assert digest(TINY / "dense" / "drafter") == source  # never touches the drafter it started from
    return report, lines, root / "adapted", records


# ---- capture ---------------------------------------------------------------------------------------


def test_capture_round_trip_keeps_ids_and_counts_only(tmp_path):
    records = kept(tmp_path, [([5, 6, 7], [8, 9]), ([1] * 300, list(range(200)))])
    assert [(r.prompt.tolist(), r.reply.tolist()) for r in records] == [([5, 6, 7], [8, 9]),
                                                                         ([1] * 300, list(range(200)))]
    assert [(r.rounds, r.drafted, r.accepted) for r in records] == [(3, 9, 4)] * 2
    assert records[0].tokens.tolist() == [5, 6, 7, 8, 9]
    (segment,) = tmp_path.glob("c-*.bin")
    assert segment.stat().st_size == sum(capture.HEADER.size + 4 * len(r.tokens) + 4 for r in records)


@pytest.mark.parametrize("damage", ["torn", "flipped"])
def test_a_torn_or_corrupt_record_is_skipped_with_one_warning(tmp_path, caplog, damage):
    kept(tmp_path / "a", [([1, 2], [3])] * 3)
    whole = kept(tmp_path / "b", [([4, 5], [6])] * 2)
    (bad,) = (tmp_path / "a").glob("c-*.bin")
    data = bytearray(bad.read_bytes())
    one = len(data) // 3
    if damage == "torn":  # a crash mid-write: the last record half there
        data = data[: 2 * one + one // 2]
    else:
        data[one + capture.HEADER.size] ^= 0xFF  # the second record's ids
    bad.write_bytes(bytes(data))
    for seg in (tmp_path / "b").glob("c-*.bin"):
        seg.rename(tmp_path / "a" / seg.name)
    with caplog.at_level(logging.WARNING, logger="mlx_mtp.learn.capture"):
        records = list(capture.read(tmp_path / "a"))
    assert len(records) == (2 if damage == "torn" else 1) + len(whole)
    assert len([r for r in caplog.records if "torn or corrupt" in r.message]) == 1


def test_the_budget_drops_the_oldest_segments(tmp_path, monkeypatch):
    monkeypatch.setattr(capture, "SEGMENT_BYTES", 600)
    c = capture.Capture(tmp_path, budget=2000)
    for i in range(40):
        c.add([i] * 20, [i] * 20)
    c.close()
    sizes = [p.stat().st_size for p in tmp_path.glob("c-*.bin")]
    assert sum(sizes) <= 2000 and len(sizes) >= 2
    firsts = [int(r.prompt[0]) for r in capture.read(tmp_path)]
    assert firsts == list(range(40 - len(firsts), 40))  # the newest, in order


def test_the_newest_records_within_a_token_budget_are_read(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(capture, "SEGMENT_BYTES", 500)  # several segments
    c = capture.Capture(tmp_path)
    for i in range(30):
        c.add([i] * 10, [i] * (5 + i % 4))
    c.close()
    (last,) = sorted(tmp_path.glob("c-*.bin"))[-1:]
    last.write_bytes(last.read_bytes() + b"MTPc torn")  # a crash mid-write: one warning, as `read` gives
    everything = list(capture.read(tmp_path, warn=False))
    for budget in (0, 14, 100, 10_000):
        with caplog.at_level(logging.WARNING, logger="mlx_mtp.learn.capture"):
            caplog.clear()
            got = capture.newest(tmp_path, budget)
        want, total = [], 0
        for r in sorted(everything, key=lambda r: r.time, reverse=True):
            total += len(r.tokens)
            if total > budget:
                break
            want.append(int(r.prompt[0]))
        assert [int(r.prompt[0]) for r in got] == want and sum(len(r.tokens) for r in got) <= budget
        assert len([r for r in caplog.records if "torn or corrupt" in r.message]) == 1
    assert len(capture.newest(tmp_path, 10_000)) == 30


def test_several_processes_append_to_one_directory(tmp_path):
    code = ("import sys; from mlx_mtp.learn.capture import Capture; c = Capture(sys.argv[1]); "
            "[c.add([int(sys.argv[2])] * 50, list(range(i))) for i in range(200)]; c.close()")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(w)]) for w in (1, 2, 3)]
    assert [p.wait(WAIT) for p in procs] == [0, 0, 0]
    records = list(capture.read(tmp_path))
    assert sorted((int(r.prompt[0]), len(r.reply)) for r in records) == sorted(
        (w, i) for w in (1, 2, 3) for i in range(200))


# ---- the Engine keeps served requests --------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return mlx_mtp.load(make_chat_model(tmp_path_factory.mktemp("learn-engine") / "model"), DRAFTER)


def test_the_engine_keeps_what_it_served_unless_a_request_opts_out(loaded, tmp_path):
    with Engine(loaded, learn_dir=tmp_path) as engine:
        handles = [engine.submit(Request(p, max_tokens=12, draft_tokens=2, learn=p != "private"))
                   for p in ("abc", "private", "hello")]
        outs = [h.result(WAIT) for h in handles]
    records = list(capture.read(tmp_path))
    assert len(records) == 2
    for record, prompt, out in zip(records, ("abc", "hello"), (outs[0], outs[2])):
        assert record.prompt.tolist() == loaded.tokenizer.encode(prompt)
        assert record.reply.tolist() == list(out.tokens)
        assert (record.rounds, record.drafted, record.accepted) == (out.stats.rounds, out.stats.drafted,
                                                                    out.stats.accepted)


def test_without_learn_dir_nothing_is_kept(loaded, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with Engine(loaded) as engine:
        engine.submit(Request("abc", max_tokens=4)).result(WAIT)
        assert engine.learner is None
    assert not list(tmp_path.rglob("*"))


# ---- adapting ---------------------------------------------------------------------------------------


def test_adapting_raises_held_out_acceptance_and_writes_a_whole_drafter(adapted):
    report, lines, out, records = adapted
    assert report["written"] and report["better"] and report["steps"] == STEPS
    assert report["after"]["held_out"] > report["before"]["held_out"]
    assert report["held_out_requests"] == 8 and report["train_requests"] == 72
    assert distill.check_saved(out) and not out.with_name(out.name + ".partial").exists()
    assert lines[-1].startswith(f"wrote {out}: accepted drafts per round (K=3): held-out")
    assert load_model(out)[0].check_target(tiny_target("dense")) is None


def test_held_out_is_the_newest_tenth(adapted):
    records = adapted[3]
    train, held = learn.split(records)
    assert len(held) == 8 and max(r.time for r in train) <= min(r.time for r in held)


def test_the_verdict_needs_held_out_up_by_more_than_the_noise_and_general_within_two_percent():
    before = {"held_out": [(10.0, 10), (10.0, 10), (10.0, 10)], "general": [(10.0, 10)]}
    steady = {"held_out": [(13.0, 10), (12.0, 10), (14.0, 10)], "general": [(9.85, 10)]}
    v = learn.verdict(before, steady)
    assert v["better"] and v["before"]["held_out"] == 1.0 and v["after"]["held_out"] == 1.3
    assert v["margin"] == pytest.approx(2 * np.sqrt(1.5 * (0.01 + 0.01) * 100) / 30)  # paired over 3 requests
    noisy = {**steady, "held_out": [(19.0, 10), (6.0, 10), (14.0, 10)]}  # the same mean, spread wide
    assert not learn.verdict(before, noisy)["better"]
    two = {"held_out": before["held_out"], "general": [(10.0, 10), (10.0, 10)]}
    assert not learn.verdict(two, {**steady, "general": [(9.7, 10), (9.7, 10)]})["better"]  # -3%, no noise
    assert learn.verdict(two, {**steady, "general": [(9.0, 10), (10.4, 10)]})["better"]  # -3%, within noise
    assert learn.paired_margin([(1.0, 5)], [(3.0, 5)]) == float("inf")  # one request: no bound


def test_an_adaptation_that_is_not_better_writes_nothing(adapted, tmp_path):
    report, lines = run_adapt(adapted[3], tmp_path / "same", steps=0)
    assert not report["written"] and not (tmp_path / "same").exists()
    assert lines[-1].startswith("not written: the adapted drafter is not better")


def test_a_stopped_adaptation_resumes_to_the_same_drafter(adapted, tmp_path):
    report, _, out, records = adapted

    def stop_at_11(line):  # the progress line after the checkpoint at step 10 (one every other step)
        if "step 12/" in line:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_adapt(records, tmp_path / "resumed", progress=stop_at_11)
    assert (tmp_path / "resumed.partial" / "state.json").exists() and not (tmp_path / "resumed").exists()
    resumed, lines = run_adapt(records, tmp_path / "resumed")
    assert lines[0].startswith("resuming at step 10 of 30")
    assert resumed["before"] == report["before"] and resumed["after"] == report["after"]
    mine, theirs = mx.load(str(tmp_path / "resumed" / "model.safetensors")), mx.load(str(out / "model.safetensors"))
    assert all(mx.array_equal(mine[k], theirs[k]).item() for k in theirs)


def test_a_crash_mid_save_leaves_the_old_drafter_whole(adapted, tmp_path, monkeypatch):
    out = tmp_path / "d"
    drafter = load_model(adapted[2], dtype=mx.float32)[0]
    config = load_model(adapted[2])[1]
    distill.save_drafter(drafter, config, out)

    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(mx, "save_safetensors", crash)
    with pytest.raises(OSError):
        distill.save_drafter(drafter, config, out)
    assert distill.check_saved(out)
    blob = out / "model.safetensors"
    data = bytearray(blob.read_bytes())
    data[-5] ^= 0x40  # a bit flipped in the last weight
    blob.write_bytes(bytes(data))
    assert not distill.check_saved(out)


# ---- an adapted drafter changes no output ------------------------------------------------------------


def test_greedy_mtp_with_the_adapted_drafter_is_plain_past_the_window(adapted):
    target, drafter = tiny_target("dense"), load_model(adapted[2])[0]
    for prompt, _ in greedy(2, 3):  # 60 tokens: the window (8) wraps many times
        plain = [t for t, _ in generate_tokens(target, prompt, max_tokens=60)]
        for k in (1, 3):
            assert [t for t, _ in generate_tokens(target, prompt, drafter=drafter, draft_tokens=k,
                                                  max_tokens=60)] == plain


def test_sampling_with_the_adapted_drafter_keeps_the_targets_distribution(adapted):
    check_sampling_is_exact(load_model(adapted[2])[0], 2000)  # 1000 rows per law: a lean check


# ---- putting it in service ------------------------------------------------------------------------


def test_engine_swaps_the_drafter_and_outputs_stay_the_same(loaded, adapted):
    with Engine(loaded) as engine:
        before = [list(engine.submit(Request(p, max_tokens=30, draft_tokens=3)).result(WAIT).tokens)
                  for p in ("abc", "hello")]
        running = engine.submit(Request("xyz", max_tokens=40, draft_tokens=3))
        assert engine.swap_drafter(adapted[2]).result(WAIT)
        assert running.result(WAIT).tokens  # finished on the old drafter, before the swap
        assert engine.loaded.drafter is not loaded.drafter
        after = [list(engine.submit(Request(p, max_tokens=30, draft_tokens=3)).result(WAIT).tokens)
                 for p in ("abc", "hello")]
    assert after == before


def test_post_drafter_swaps_from_loopback_only(loaded, adapted):
    with Engine(loaded) as engine:
        app = create_app(engine, Settings(served_model(loaded, "tiny")))
        assert TestClient(app).post("/v1/drafter", json={"drafter": str(adapted[2])}).status_code == 403
        local = TestClient(app, client=("127.0.0.1", 50000))
        r = local.post("/v1/drafter", json={"drafter": str(adapted[2])})
        assert r.status_code == 200 and r.json() == {"drafter": str(adapted[2]), "in_service": True}
        for body, words in (({"drafter": "/no/such/dir"}, "/no/such/dir"), ({}, "the body must be"),
                            ({"drafter": str(TINY / "dense" / "target")}, "not an MTP drafter"),
                            ({"drafter": str(TINY / "e2b" / "drafter")}, "!=")):
            r = local.post("/v1/drafter", json=body)
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.json()
        r = local.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200


def test_learn_every_adapts_in_idle_time_and_requests_come_first(loaded, tmp_path):
    prompts = [bytes(np.random.default_rng(i).integers(97, 123, 8)).decode() for i in range(24)]
    with Engine(loaded, learn_dir=tmp_path, learn_every=len(prompts), drafter_dir=DRAFTER,
                prefill_chunk=64) as engine:
        engine.learner.steps = 4  # a short adaptation (200 by default)
        for p in prompts:
            engine.submit(Request(p, max_tokens=20, draft_tokens=2)).result(WAIT)
        deadline = time.monotonic() + WAIT
        while engine.learner.pieces is None and not engine.learner.reports:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # a request that comes while it adapts is served before the adaptation ends
        assert list(engine.submit(Request("abc", max_tokens=20)).result(WAIT).tokens)
        assert not engine.learner.reports
        while not engine.learner.reports:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        report = engine.learner.reports[0]
        assert report["steps"] == engine.learner.steps and report["train_requests"] == 22
        saved = list((tmp_path / "drafters").glob("*"))
        assert len(saved) == (1 if report["better"] else 0)
        if report["better"]:
            assert engine.loaded.drafter is not loaded.drafter
        out = engine.submit(Request("hello", max_tokens=30, draft_tokens=3)).result(WAIT)
    assert list(out.tokens) == list(mlx_mtp.generate(loaded, "hello", max_tokens=30, draft_tokens=0).tokens)


# ---- the command line ------------------------------------------------------------------------------


def test_cli_says_what_is_wrong_in_one_line(tmp_path, capsys):
    drafter, target = str(TINY / "dense" / "drafter"), str(TINY / "dense" / "target")
    kept(tmp_path / "few", greedy(0, 40)[:5])
    kept(tmp_path / "enough", greedy(0, 40))
    for folder, out, words in (
            (tmp_path / "few", tmp_path / "new", "holds 5 captured requests; adapting needs at least 20"),
            (tmp_path / "enough", drafter, "--out is the drafter adapted from")):
        assert learn.main([str(folder), "--target", target, "--drafter", drafter, "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and words in err, err
    # in a fresh process, as a user meets it
    r = subprocess.run([sys.executable, "-m", "mlx_mtp.learn", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=WAIT)
    assert r.returncode == 1 and r.stderr == f"error: {tmp_path / 'nothing'}: no such directory of captured requests\n"


# ---- the README's commands, as a user runs them ------------------------------------------------------


def readme_commands() -> list[str]:
    import re

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## A drafter that learns from use", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```sh\n(.*?)```", section, re.S)
    return [line.split("  #")[0].strip() for line in block.strip().splitlines()]


def test_readme_commands_keep_adapt_and_swap(tmp_path):
    import concurrent.futures
    import inspect
    import os

    import httpx
    from apps.serve_load import free_port, start_server, stop_server, wait_healthy

    serve, adapt, swap = readme_commands()
    assert serve.startswith("mlx-mtp-server --learn-dir") and adapt.startswith("python -m mlx_mtp.learn")
    env = {**os.environ, "HOME": str(tmp_path)}
    port = free_port()
    argv = subprocess.run(["bash", "-c", f"printf '%s\\n' {serve}"], env=env, capture_output=True, text=True).stdout
    argv = argv.split()
    argv[0] = str(Path(sys.executable).parent / argv[0])
    proc = start_server(argv, port, str(tmp_path / "server.log"), env=env)
    try:
        wait_healthy(proc, port)
        def post(i: int) -> int:
            body = {"prompt": f"def f{i}(x):\n", "max_tokens": 12, "temperature": 0.8, "seed": i}
            headers = {"X-MLX-MTP-Learn": "off"} if i == 0 else {}
            return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers,
                              timeout=WAIT).status_code

        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # 20 kept: the fewest an adaptation takes
            assert list(pool.map(post, range(21))) == [200] * 21
        general = tmp_path / "general.py"  # a short general sample: two chunks
        general.write_text(Path(inspect.__file__).read_text()[:1200])
        quick = f" --steps 2 --batch 2 --seq 64 --general {general}"  # the command as written, less work
        r = subprocess.run(["bash", "-c", adapt.replace("python", sys.executable, 1) + quick], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines()[0] == (f"20 captured requests; adapting {DEMO_DRAFTER} for at most 2 steps "
                                            "within 15 minutes")
        written = (tmp_path / "adapted-drafter").is_dir()
        assert r.stdout.splitlines()[-1].startswith("wrote" if written else "not written")
        r = subprocess.run(["bash", "-c", swap.replace(":8000", f":{port}")], env=env, capture_output=True, text=True,
                           timeout=WAIT)
        answer = r.stdout
        if written:
            assert '"in_service":true' in answer.replace(" ", ""), answer
        else:
            assert "adapted-drafter" in answer and "invalid_request_error" in answer, answer
    finally:
        stop_server(proc)
    assert proc.returncode == 0


# ---- a run bounded in time, its progress, its help ---------------------------------------------------


def test_the_target_features_kept_are_the_ones_computed_afresh(adapted):
    """Measuring in padded batches and training from kept features change nothing: the same runs as one
    sequence at a time, the same features as a fresh target pass."""
    target, drafter = tiny_target("dense"), load_model(TINY / "dense" / "drafter", dtype=mx.float32)[0]
    records = adapted[3]
    sequences = [learn.window(r, 32 + 6 * i) for i, r in enumerate(records[:5])]  # unequal lengths: padding
    m = learn.Measure(target, sequences, batch=3)
    got = [t for i in range(len(m.batches)) for t in m.run(drafter, i)]
    assert got == [(float(r.sum()), len(r)) for r in (distill.accepted_runs(target, drafter, ids, first, learn.K)
                                                       for ids, first in sequences)]
    assert m.run(drafter, 0) == got[:3] and len(m.features) == 2  # measured again from the kept features
    windows = learn.request_windows(records[:40], 24)
    pool = learn.Pool(target, windows, batch=4, seed=0, cache_bytes=3 * 100_000)  # room for a few rows only
    assert sorted(pool.indices(0) + pool.indices(1) + [i for s in range(2, 10) for i in pool.indices(s)])[:40] == \
        sorted(range(40))  # an epoch sees every window once
    for step in (0, 1, 0):
        fresh = distill.target_pass(target, mx.array(np.stack([windows[i] for i in pool.indices(step)])))
        kept_ = pool.features(step)
        for a, b in zip(kept_[:3], fresh[:3]):
            assert mx.array_equal(a, b).item()
        for kind, kv in fresh[3].items():
            assert all(mx.array_equal(x, y).item() for x, y in zip(kept_[3][kind], kv))
    assert 0 < pool.cached_bytes <= 3 * 100_000


def test_features_computed_ahead_on_a_thread_train_the_same_drafter(adapted, tmp_path, monkeypatch):
    """The next step's target features on a worker thread, while the drafter trains on this step's:
    the same drafter, bitwise, as computing each batch when its step comes."""
    pass_, threads = distill.target_pass, set()

    def noted(target, tokens):
        threads.add(threading.current_thread() is threading.main_thread())
        return pass_(target, tokens)

    monkeypatch.setattr(distill, "target_pass", noted)
    records = adapted[3]
    serial, _ = run_adapt(records, tmp_path / "serial", ahead=False)
    assert threads == {True}
    ahead, _ = run_adapt(records, tmp_path / "ahead", ahead=True)
    assert threads == {True, False}  # the steps' features did come from the worker
    assert serial["written"] and ahead["written"] and ahead["after"] == serial["after"]
    a, b = (mx.load(str(tmp_path / d / "model.safetensors")) for d in ("serial", "ahead"))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)


def test_minutes_bound_the_whole_run_and_progress_says_how_long(monkeypatch, tmp_path):
    """A target slowed to 0.5 s a forward and an 8 s budget (2 s to measure before): not all three held-out
    batches measured, training cut to what fits, the run within its time; a line before any work, then
    an estimate."""
    pass_ = distill.target_pass
    times, lines = [], []

    def slow(target, tokens):
        times.append(time.perf_counter())
        time.sleep(0.5)
        return pass_(target, tokens)

    monkeypatch.setattr(distill, "target_pass", slow)
    records = kept(tmp_path / "c", greedy(3, 200))
    started = time.perf_counter()
    report, _ = run_adapt(records, tmp_path / "o", minutes=8 / 60, steps=300, progress=lambda s: lines.append(
        (time.perf_counter(), s)))
    took = time.perf_counter() - started
    assert report["held_out_requests"] in (8, 16) and 1 <= report["steps"] < 300  # of 20: a bounded sample
    assert took < 8 * 1.3 + 2, took
    assert lines[0][0] < times[0] and lines[0][1].startswith("measuring the drafter on 6 general sequences and up "
                                                             "to 20 held-out requests")
    for at, line in lines[1:-2]:  # the last two: where the time went, the verdict
        left = float(line.split("~")[1].split(" s left")[0])
        assert at - started + left <= 8 + 1, line  # never past the bound
    assert any(f"step {report['steps']}/" in line for _, line in lines)
    assert lines[-2][1].startswith(f"{report['seconds']:.0f} s: measuring before ")


def test_help_gives_every_default():
    for action in learn.parser()._actions:
        if action.option_strings and action.dest not in ("help", "out"):
            assert "default" in action.help, action.dest


def test_the_benchs_c_traffic_is_excerpts_of_c_cut_at_line_ends():
    from apps.bench.learn import c_header_prompts

    prompts = c_header_prompts(20, seed=3)
    assert prompts == c_header_prompts(20, seed=3) and prompts != c_header_prompts(20, seed=4)
    assert all(p.endswith("\n") and 0 < len(p) <= 1000 for p in prompts)
    assert sum(("#" in p) or (";" in p) for p in prompts) >= 15  # C: preprocessor lines, statements


def test_training_is_on_the_replies_the_prompts_end_their_context():
    """A window's loss starts at its reply (at most half-way): labels before it change nothing, and the
    drafter still reads the target's K/V of the prompt's end."""
    prompt, reply = list(range(3, 43)), list(range(50, 62))  # 40 + 12 tokens
    records = [capture.Record(np.array(prompt, np.int32), np.array(reply[: 12 - i], np.int32), 0, 0, 0, float(i))
               for i in range(3)]
    assert learn.reply_starts(records, 16) == [4, 5, 6] and learn.reply_starts(records, 8) == [1, 1, 1]
    assert learn.reply_starts(records, 32) == [16, 16, 16]  # a reply shorter than half the window: half-way
    windows = learn.request_windows(records, 32)
    target, drafter = tiny_target("dense"), load_model(TINY / "dense" / "drafter", dtype=mx.float32)[0]
    pool = learn.Pool(target, windows, batch=2, seed=0, firsts=learn.reply_starts(records, 32))
    assert pool.start(0) == min(learn.reply_starts(records, 32)[i] for i in pool.indices(0))
    embeds, hidden, labels, shared = pool.features(0)
    loss = distill.losses(drafter, embeds, hidden, labels, shared, learn.K, start=16)[0]
    changed = mx.concatenate([(labels[:, :16] + 1) % 128, labels[:, 16:]], axis=1)
    assert distill.losses(drafter, embeds, hidden, changed, shared, learn.K, start=16)[0].item() == loss.item()
    assert distill.losses(drafter, embeds, hidden, changed, shared, learn.K, start=15)[0].item() != loss.item()
    train = learn.split(records * 8)[0]
    for replies, firsts in ((True, learn.reply_starts(train, 16)), (False, [1] * len(train))):
        a = learn.Adaptation(target, TINY / "dense" / "drafter", records * 8, general(), seq=16, replies=replies)
        assert a.pool.firsts == firsts and sorted(set(firsts)) == ([4, 5, 6] if replies else [1])
    assert learn.parse_args(["d", "--out", "o"]).train_on == "replies"
    assert learn.parse_args(["d", "--out", "o", "--train-on", "all"]).train_on == "all"


def test_the_benchs_variants_parse_and_say_what_is_missing():
    from apps.bench.learn import main, parse_variant

    assert parse_variant("steps=60,lr=1e-3,warmup=5,train_on=all") == dict(steps=60, lr=1e-3, warmup=5,
                                                                             train_on="all")
    with pytest.raises(ValueError, match="steps= and lr= are required"):
        parse_variant("lr=1e-3")
    with pytest.raises(SystemExit):
        main(["--variant", "steps=1,lr=1"])  # no --captures
    with pytest.raises(SystemExit):
        main(["--captures", "d"])  # neither variants nor --ahead-steps
    with pytest.raises(SystemExit):
        main(["--captures", "d", "--variant", "steps=1,lr=1", "--ahead-steps", "2"])  # both
