"""The prefix cache's disk tier: a state written by one process and restored by another gives exactly
what a fresh prefill gives; states never load into another model; torn files, a full disk and two
processes on one directory leave serving exact and the directory sound."""

import errno
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from chat_helpers import DRAFTER, make_chat_model
from conftest import tiny_target
from test_prefix_cache import HOT, W, agent_session, ids, prefill
from test_prefix_cache import sessions as memory_sessions

import mlx_mtp
from mlx_mtp.cache import disk as prefix_disk
from mlx_mtp.cache.kv import FULL, SLIDING
from mlx_mtp.engine.engine import Engine
from mlx_mtp.cache.prefix import PrefixCache
from mlx_mtp.cache.disk import DiskTier, model_fingerprint
from mlx_mtp.decode.speculative import MAX_ROLLBACK

WAIT = 60
TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return mlx_mtp.load(make_chat_model(tmp_path_factory.mktemp("disk") / "model"), DRAFTER)


def tier(directory, target, budget=1 << 30):
    return DiskTier(directory, model_fingerprint(target), budget, W)


def fresh_cache(target):
    return target.make_cache(1, max_rollback=MAX_ROLLBACK)


def assert_restores_exactly(target, pc, prompt, expect=None, cuts=()) -> int:
    """`pc` resumes `prompt` (at `expect` tokens if given), and the state equals a fresh prefill's
    cut where the prefill that stored it was (`cuts`; how a prompt is cut changes K/V's last bits)."""
    resumed = fresh_cache(target)
    m = pc.resume(prompt, resumed)
    assert expect is None or m == expect
    fresh, whole = prefill(target, prompt, cuts=(*(c for c in cuts if c < m), m))
    _, rest = prefill(target, prompt, resumed)
    assert np.array_equal(np.array(rest.logits[:, -1]), np.array(whole.logits[:, -1]))
    for kind, start in ((FULL, 0), (SLIDING, len(prompt) - W - 1)):
        got, want = resumed.read(start, len(prompt), kind), fresh.read(start, len(prompt), kind)
        assert got.keys() == want.keys()
        assert all(np.array_equal(np.array(got[i][j]), np.array(want[i][j])) for i in got for j in (0, 1))
    return m


def store_chain(target, pc, tokens, stops):
    cache = None
    for stop in stops:
        cache, _ = prefill(target, tokens[:stop], cache)
        pc.store(tokens[:stop], cache)


def model_files(directory):
    return sorted(p for p in Path(directory).glob("*/*") if p.name.endswith(".safetensors"))


# ---- the tier on its own --------------------------------------------------------------------------


def test_a_new_process_restores_exactly_what_a_fresh_prefill_gives(tmp_path):
    target = tiny_target("dense")
    a = ids(90)
    store_chain(target, PrefixCache(target, 1 << 30, tier(tmp_path, target)), a, (30, 60, 61, 90))
    # a later process: nothing in memory, everything on disk
    pc = PrefixCache(target, 1 << 30, tier(tmp_path, target))
    assert pc.disk.states == 4 and pc.nbytes == 0
    assert_restores_exactly(target, pc, a[:25] + ids(20, seed=1), 25)  # parts ways inside the first state
    assert_restores_exactly(target, pc, a[:80] + ids(5, seed=2), 80)  # inside the last one's sliding tail
    assert_restores_exactly(target, pc, a, 89)
    assert pc.disk.stats.hits == 3 and pc.stats.hits == 25 + 80 + 89
    assert pc.lookup(a[:85] + [5]) == 85  # restored states are in memory now
    assert pc.disk.stats.writes == 0  # and were not written again


def test_states_share_what_they_have_in_common_on_disk(tmp_path):
    """Four sessions on one 40-token system prompt, each stored at 60 and 61: the prompt's K/V
    are written once, as in memory, and a state reuses the one before it."""
    target = tiny_target("dense")
    pc = PrefixCache(target, 1 << 30, tier(tmp_path, target))
    trunk = ids(40)
    store_chain(target, pc, trunk, (40,))
    for seed in range(4):
        store_chain(target, pc, trunk + ids(21, seed=10 + seed), (60, 61))
    segments = [p.stat().st_size for p in model_files(tmp_path) if p.name.startswith("b-")]
    on_disk = sum(p.stat().st_size for p in model_files(tmp_path))
    # the K/V memory holds (each position once: see test_prefix_cache), plus each file's header
    assert pc.nbytes <= sum(segments) <= pc.nbytes + 1024 * len(segments)
    assert pc.disk.stats.bytes == on_disk and pc.disk.stats.writes == 9 and len(segments) == 2 * 9


def test_the_disk_budget_evicts_the_least_recently_used_and_a_broken_state_is_a_miss(tmp_path):
    target = tiny_target("dense")
    disk = tier(tmp_path, target)
    pc = PrefixCache(target, 0, disk)
    prompts = [[s] + ids(39, seed=s) for s in range(6, 10)]  # nothing shared
    for p in prompts[:2]:
        store_chain(target, pc, p, (40,))
    one = disk.stats.bytes // 2
    disk.budget = int(2.5 * one)
    os.utime(model_files(tmp_path)[0], (1, 1))  # some file of the first two is the least recently used
    for p in prompts[2:]:
        store_chain(target, pc, p, (40,))
    assert disk.stats.evictions > 0 and disk.stats.bytes <= disk.budget
    assert disk.stats.bytes == sum(p.stat().st_size for p in model_files(tmp_path))
    assert pc.lookup(prompts[3] + [5]) == 40
    restored = [PrefixCache(target, 0, tier(tmp_path, target)).resume(p + [5], fresh_cache(target)) for p in prompts]
    assert restored[3] == 40 and 0 in restored[:2]  # what lost a file is a miss, not an error


# ---- safety ---------------------------------------------------------------------------------------------


def test_states_never_load_into_another_model(tmp_path):
    target = tiny_target("dense")
    other = tiny_target("moe")  # another model altogether
    a = ids(40)
    store_chain(target, PrefixCache(target, 0, tier(tmp_path, target)), a, (40,))
    name, w = max(_flat(target), key=lambda item: item[1].size)  # sampled, not hashed whole
    assert w.size > prefix_disk.SAMPLE
    changed = {name: w + 1e-3 * mx.random.normal(w.shape, key=mx.random.key(0)).astype(w.dtype)}
    copy = tiny_target.__wrapped__("dense")  # a separate copy of the same checkpoint ...
    assert model_fingerprint(copy) == model_fingerprint(target)
    copy.load_weights(list(changed.items()), strict=False)  # ... with other weights in one tensor
    bf16 = tiny_target.__wrapped__("dense")
    bf16.set_dtype(mx.bfloat16)
    for model in (copy, bf16, other):
        assert model_fingerprint(model) != model_fingerprint(target)
        disk = DiskTier(tmp_path, model_fingerprint(model), 1 << 30, model.make_cache(1).window)
        assert disk.states == 0 and disk.resume(np.asarray(a + [5]), fresh_cache(model)) == 0
    assert tier(tmp_path, target).states == 1


def _flat(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_torn_or_corrupt_file_is_skipped_with_one_warning_and_removed(tmp_path, caplog, damage):
    target = tiny_target("dense")
    a = ids(70)
    store_chain(target, PrefixCache(target, 0, tier(tmp_path, target)), a, (30, 70))
    segment = max((p for p in model_files(tmp_path) if p.name.startswith("b-")), key=lambda p: p.stat().st_mtime_ns)
    data = bytearray(segment.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[-5] ^= 0x40  # one bit of the K/V
    segment.write_bytes(bytes(data))
    pc = PrefixCache(target, 0, tier(tmp_path, target))
    with caplog.at_level(logging.WARNING, logger="mlx_mtp.cache.disk"):
        assert_restores_exactly(target, pc, a + [5], 30)  # the last state lost a segment: the one before
        assert_restores_exactly(target, pc, a + [5], 30)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "damaged" in warnings[0].getMessage() and segment.name in warnings[0].getMessage()
    assert not segment.exists() and pc.disk.states == 1 and pc.disk.stats.corrupt == 1


def test_a_full_disk_degrades_to_memory_only_with_one_warning(tmp_path, loaded, monkeypatch, caplog):
    calls = []

    def full(*args, **kwargs):
        calls.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prefix_disk.mx, "save_safetensors", full)
    with caplog.at_level(logging.WARNING, logger="mlx_mtp.cache.disk"):
        with Engine(loaded, max_batch=2, prompt_cache_dir=tmp_path) as engine:
            outputs, stats = agent_session(engine, 4)
            metrics = engine.metrics()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No space left" in warnings[0] and len(calls) == 1
    assert model_files(tmp_path) == [] and not list(tmp_path.glob("*/.*"))  # no temporary file left behind
    assert metrics["prefix_cache_disk_writes"] == 0 and all(s.cached_tokens > 0 for s in stats[1:])
    with Engine(loaded, max_batch=2, prompt_cache_bytes=0) as engine:
        assert agent_session(engine, 4)[0] == outputs


# ---- through the Engine ---------------------------------------------------------------------------------


def sessions(loaded, directory, budget, n_sessions=3, n_calls=5, **kw):
    """Concurrent agent sessions (see test_prefix_cache) on an Engine with the disk tier (none: the
    prefix cache off)."""
    if directory is None:
        return memory_sessions(loaded, 0, n_sessions, n_calls, **kw)
    return memory_sessions(loaded, budget, n_sessions, n_calls, dict(prompt_cache_dir=directory), **kw)


@pytest.mark.parametrize("seeded", [False, True])
def test_sessions_replayed_by_a_new_engine_are_exact_and_prefill_almost_nothing(loaded, tmp_path, seeded):
    """Three agents at once (greedy, or seeded hot sampling; MTP with a random drafter; far past the
    sliding window) on an Engine that keeps no state in memory: every restore comes from disk.
    A new Engine on the directory replays them: outputs equal the cache-off ones, and from its
    first call each prefills only its last token."""
    kw = dict(sampling=HOT, seed=5) if seeded else {}
    first, metrics = sessions(loaded, tmp_path, 0, **kw)
    again, replayed = sessions(loaded, tmp_path, 1 << 30, **kw)
    off, _ = sessions(loaded, None, 0, **kw)
    for i in off:
        assert first[i][0] == again[i][0] == off[i][0], f"session {i}"
        lengths = [s.prompt_tokens + s.cached_tokens for s in first[i][1]]
        assert lengths[-1] > 6 * W
        for call, s in enumerate(first[i][1][1:], 1):  # memory held nothing: the disk gave the prefix
            assert s.cached_tokens > 0 and s.prompt_tokens <= lengths[call] - lengths[call - 1] + 2
        assert all(s.prompt_tokens == 1 for s in again[i][1])
    assert metrics["prefix_cache_disk_hits"] >= 3 * 4 and metrics["prefix_cache_bytes"] == 0
    assert replayed["prefix_cache_disk_hits"] >= 3 and replayed["prefix_cache_disk_writes"] < metrics[
        "prefix_cache_disk_writes"]
    assert metrics["spec_draft_tokens"] > metrics["spec_accepted_tokens"] > 0  # drafts really rejected


CONCURRENT = textwrap.dedent("""
    import logging, sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    from conftest import tiny_target
    from test_prefix_disk import assert_restores_exactly, ids, store_chain, tier
    from mlx_mtp.cache.prefix import PrefixCache
    logging.basicConfig(level=logging.WARNING)
    target = tiny_target("dense")
    me, restored, evictions = int(sys.argv[1]), [], 0
    for round in range(6):
        pc = PrefixCache(target, 0, tier({directory!r}, target, budget=int(sys.argv[2])))
        trunk = ids(40)  # both processes store the same states, and each its own
        store_chain(target, pc, trunk + ids(30, seed=round), (40, 70))
        store_chain(target, pc, trunk + ids(30, seed=100 * me + round), (40, 55, 70))
        mine = trunk + ids(30, seed=100 * me + round) + [5]
        restored.append(assert_restores_exactly(target, pc, mine, cuts=(40, 55)))  # what the other left it
        evictions += pc.disk.stats.evictions
    print("ok", sum(m > 0 for m in restored), evictions)
""")


def test_two_processes_share_one_directory_without_damage(tmp_path):
    """Two processes store and restore states in one directory at once, under a budget that makes
    them evict each other's files: every restore is exact, no file is ever damaged."""
    script = CONCURRENT.format(tests=str(TESTS), directory=str(tmp_path / "cache"))
    budget = str(250_000)  # about three rounds of one process
    procs = [subprocess.Popen([sys.executable, "-c", script, str(me), budget], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for me in (1, 2)]
    results = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0 and out.startswith("ok"), err
        assert "damaged" not in err, err
    counts = np.array([[int(n) for n in out.split()[1:]] for out, _ in results])
    assert counts[:, 0].sum() > 0 and counts[:, 1].sum() > 0  # restores happened, and evictions
    assert [p.name for p in tmp_path.iterdir()] == ["cache"]  # nothing written outside the directory
    files = model_files(tmp_path / "cache")
    assert files and sum(f.stat().st_size for f in files) <= int(budget) + 20_000
    disk = tier(tmp_path / "cache", tiny_target("dense"))
    for f in files:  # every file left is whole
        disk.files.read(f.name[: -len(".safetensors")], touch=False)
    assert disk.stats.corrupt == 0


def test_a_restarted_server_serves_what_the_last_one_stored(tmp_path):
    """The README's flags: a server on a directory, stopped (SIGTERM) and started again, answers an
    agent's call from the states the first one stored; usage and /metrics say so."""
    import httpx
    import openai

    from apps.serve_load import free_port, start_server, stop_server, wait_healthy
    from mlx_mtp.server.metrics import parse

    messages = [{"role": "system", "content": "You write Python. " * 20}, {"role": "user", "content": "Sort a list."}]
    replies = []
    for run in range(2):
        port = free_port()
        proc = start_server([sys.executable, "-m", "mlx_mtp.server", "--prompt-cache-dir", str(tmp_path / "states"),
                             "--prompt-cache-disk-gb", "0.5", "--log-level", "warning"], port, str(tmp_path / "log"))
        try:
            wait_healthy(proc, port)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
            reply = client.chat.completions.create(model="mlx-mtp-demo", messages=messages, max_tokens=16,
                                                   temperature=0)
            metrics = parse(httpx.get(f"http://127.0.0.1:{port}/metrics").text)
        finally:
            stop_server(proc)
        assert proc.returncode == 0, (tmp_path / "log").read_text()
        replies.append((reply.choices[0].message.content, reply.usage, metrics))
    (first, usage0, metrics0), (again, usage1, metrics1) = replies
    assert first == again and usage0.prompt_tokens_details.cached_tokens == 0
    assert usage1.prompt_tokens_details.cached_tokens == usage1.prompt_tokens - 1 > 100
    assert metrics0["mlx_mtp:prefix_cache_disk_writes_total"] >= 2 and metrics0["mlx_mtp:prefix_cache_disk_bytes"] > 0
    assert metrics1["mlx_mtp:prefix_cache_disk_hits_total"] == 1
    assert metrics1["mlx_mtp:prefix_cache_disk_hit_tokens_total"] == usage1.prompt_tokens - 1
