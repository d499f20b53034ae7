"""The pool of engines (issue 51): one Engine per loaded pair, admission before a load, eviction,
keep_alive, context growth. Tiny pairs from the fixtures, laid out in a store as pulls lay them out,
with budgets counted from their real byte sizes."""

import math
import shutil
import threading
import time
from pathlib import Path

import pytest
from chat_helpers import TINY, write_gemma4_tokenizer

import mlx_mtp
from mlx_mtp.engine import pool as pool_module
from mlx_mtp.engine.engine import Engine, Request
from mlx_mtp.engine.pool import Pool, PoolFull, keep_alive_seconds, kv_bytes
from mlx_mtp.runtime import memory
from mlx_mtp.store import NotFound, Store

WAIT = 60
NAMES = ["testorg/tiny", "testorg/other", "testorg/third"]
CONTEXT = 64
OPTIONS = {"max_batch": 2}
PROMPT = [2, 40, 41, 42, 43, 44, 45, 46]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Three pairs (the dense fixture's target, with a tokenizer, and its drafter) in a models dir."""
    root = tmp_path_factory.mktemp("pool") / "models"
    tokenizer = tmp_path_factory.mktemp("tokenizer")
    write_gemma4_tokenizer(tokenizer)
    for name in NAMES:
        shutil.copytree(TINY / "target", root / name)
        for f in tokenizer.iterdir():
            shutil.copy(f, root / name)
        shutil.copytree(TINY / "drafter", root / f"{name}-assistant")
    return root


@pytest.fixture
def store(models):
    return Store(models, hf_cache=None)


@pytest.fixture
def loads(monkeypatch):
    """The names the pool loads, in order."""
    calls, real = [], pool_module.load

    def counted(path, drafter=None):
        calls.append(f"{Path(path).parent.name}/{Path(path).name}")
        return real(path, drafter=drafter)

    monkeypatch.setattr(pool_module, "load", counted)
    return calls


def need(store, context=CONTEXT) -> int:
    """What one pair reserves: weights, KV of the rows, and the prompt cache's half of that."""
    entry = store.resolve(NAMES[0])
    kv = kv_bytes(entry, context, OPTIONS["max_batch"])
    return entry.bytes + kv + kv // 2


def generate(engine) -> list:
    return list(engine.submit(Request(PROMPT, max_tokens=6, draft_tokens=2)).result(WAIT).tokens)


def use(pool, name, **kw) -> list:
    with pool.lease(name, context=kw.pop("context", CONTEXT), **kw) as engine:
        return generate(engine)


def names(pool) -> list:
    return [r.name for r in pool.loaded()]


def test_keep_alive_reads_as_ollama_reads_it():
    assert keep_alive_seconds(10) == 10 and keep_alive_seconds(2.5) == 2.5 and keep_alive_seconds(0) == 0
    assert keep_alive_seconds("5m") == 300 and keep_alive_seconds("1h30m") == 5400
    assert keep_alive_seconds("300ms") == pytest.approx(0.3) and keep_alive_seconds("1.5s") == 1.5
    assert keep_alive_seconds("0") == 0
    assert keep_alive_seconds(-1) == math.inf and keep_alive_seconds("-1m") == math.inf
    for bad in ("5 minutes", "300", "", "m", True, None):
        with pytest.raises(ValueError, match="keep_alive"):
            keep_alive_seconds(bad)


def test_the_default_budget_is_the_devices_less_a_margin(store):
    budget = memory.Device.current().budget
    with Pool(store) as pool:
        assert pool.budget == budget - max(budget // 8, 2**30)


def test_a_budget_for_all_loads_each_pair_once(store, loads):
    with Pool(store, budget_bytes=3 * need(store), engine_options=OPTIONS) as pool:
        outputs = [[use(pool, name) for name in NAMES] for _ in range(3)]
        assert loads == NAMES and names(pool) == sorted(NAMES)
        assert all(o == outputs[0] for o in outputs)
        assert {(r.bytes, r.context, r.leases) for r in pool.loaded()} == {(need(store), CONTEXT, 0)}


def test_a_budget_for_one_loads_once_per_switch_least_recently_used_out(store, loads):
    with Pool(store, budget_bytes=need(store) * 3 // 2, engine_options=OPTIONS) as pool:
        for name in [NAMES[0], NAMES[1], NAMES[1], NAMES[0]]:
            use(pool, name)
        assert loads == [NAMES[0], NAMES[1], NAMES[0]] and names(pool) == [NAMES[0]]
    with Pool(store, budget_bytes=2 * need(store) + 1, engine_options=OPTIONS) as pool:
        for name in [NAMES[0], NAMES[1], NAMES[0]]:
            use(pool, name)
        assert pool.eviction_order() == [NAMES[1], NAMES[0]]
        use(pool, NAMES[2])
        assert names(pool) == [NAMES[2], NAMES[0]]  # by name


def test_outputs_equal_a_one_model_engines(store, loads):
    entry = store.resolve(NAMES[0])
    with Engine(mlx_mtp.load(entry.target.path, drafter=entry.drafter.path), **OPTIONS) as engine:
        expected = generate(engine)
    with Pool(store, budget_bytes=need(store) * 3 // 2, engine_options=OPTIONS) as pool:
        assert [use(pool, name) for name in NAMES[:2] * 2] == [expected] * 4


def test_concurrent_leases_of_a_loading_pair_share_one_load_while_others_serve(store, loads, monkeypatch):
    gate, counted = threading.Event(), pool_module.load

    def slow(path, drafter=None):
        if path.name == "tiny":
            assert gate.wait(WAIT)
        return counted(path, drafter=drafter)

    monkeypatch.setattr(pool_module, "load", slow)
    with Pool(store, budget_bytes=3 * need(store), engine_options=OPTIONS) as pool:
        other = use(pool, NAMES[1])
        got, errors = [], []

        def client():
            try:
                got.append(use(pool, NAMES[0]))
            except Exception as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=client) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.2)  # one client loads tiny, the others wait for that load
        assert use(pool, NAMES[1]) == other  # served while tiny loads
        gate.set()
        while any(t.is_alive() for t in threads):  # and while tiny's weights are read
            assert use(pool, NAMES[1]) == other
        assert not errors and len(got) == 4 and all(g == got[0] for g in got)
        assert loads == [NAMES[1], NAMES[0]]


def test_a_pair_in_flight_is_never_evicted_and_what_cannot_fit_evicts_nothing(store, loads):
    with Pool(store, budget_bytes=2 * need(store), engine_options=OPTIONS, wait_s=0) as pool:
        use(pool, NAMES[1])
        with pool.lease(NAMES[0], context=CONTEXT) as engine:
            big = need(store, context=512)  # more than the idle pair would free
            with pytest.raises(PoolFull) as full:
                pool.lease(NAMES[2], context=512).__enter__()
            assert (full.value.needed, full.value.free, full.value.evictable) == (big, 0, need(store))
            assert f"{big} bytes" in str(full.value) and "0 bytes" in str(full.value)
            assert NAMES[0] in str(full.value) and isinstance(full.value, ValueError)
            assert names(pool) == sorted(NAMES[:2])  # the idle pair was not evicted for nothing
            assert [r.leases for r in pool.loaded()] == [0, 1]
            use(pool, NAMES[2])  # this one fits once the idle pair goes, never the leased one
            assert names(pool) == [NAMES[2], NAMES[0]]
            generate(engine)
        assert loads == [NAMES[1], NAMES[0], NAMES[2]]


def test_a_lease_waits_for_a_pair_in_use_to_go_idle_then_evicts_it(store, loads):
    """Where only a pair in use stands in the way, a lease waits for its lease to end (Ollama's
    scheduler waits for a runner), up to `wait_s`; with none, PoolFull at once."""
    with Pool(store, budget_bytes=need(store) * 3 // 2, engine_options=OPTIONS) as pool:
        done, got = threading.Event(), []
        with pool.lease(NAMES[0], context=CONTEXT) as engine:
            waiter = threading.Thread(target=lambda: (got.append(use(pool, NAMES[1])), done.set()))
            waiter.start()
            assert not done.wait(0.5) and names(pool) == [NAMES[0]]  # waiting, nothing evicted in use
            generate(engine)
        assert done.wait(WAIT) and got and names(pool) == [NAMES[1]]
        waiter.join()
    with Pool(store, budget_bytes=need(store) * 3 // 2, engine_options=OPTIONS, wait_s=0.3) as pool:
        with pool.lease(NAMES[0], context=CONTEXT):
            started = time.monotonic()
            with pytest.raises(PoolFull, match="none is idle"):
                use(pool, NAMES[1])
            assert 0.3 <= time.monotonic() - started < 5
        assert names(pool) == [NAMES[0]] and loads[-1] == NAMES[0]


def test_a_pinned_pair_is_never_evicted_nor_expired(store, loads):
    with Pool(store, budget_bytes=need(store) * 3 // 2, pins=[NAMES[0]], engine_options=OPTIONS) as pool:
        use(pool, NAMES[0], keep_alive=0)
        with pytest.raises(PoolFull):
            use(pool, NAMES[1])
        [resident] = pool.loaded()
        assert (resident.name, resident.pinned, resident.expires_at) == (NAMES[0], True, None)
        assert not pool.unload(NAMES[0], pinned=False) and names(pool) == [NAMES[0]]  # a client's: it stays
        assert pool.unload(NAMES[0]) and pool.loaded() == []  # an explicit unload still unloads it


def test_an_adopted_engine_is_served_by_its_names_pinned_and_reserved_at_its_limit(store, loads):
    """A server's start model: built as the server builds it, then held by the pool beside the store's."""
    entry = store.resolve(NAMES[0])
    engine = Engine(mlx_mtp.load(entry.target.path, drafter=entry.drafter.path), memory_limit=need(store) // 2,
                    **OPTIONS)
    with Pool(store, budget_bytes=entry.bytes + need(store) // 2 + need(store), engine_options=OPTIONS) as pool:
        pool.adopt(entry, engine, names=["my-model"])
        assert pool.resolve("my-model:latest") is entry and pool.engine_of("my-model") is engine
        with pool.lease("my-model", context=10**6) as leased:  # never grown: served at its full context
            assert leased is engine and pool.context_of(engine) == entry.kv.context
        (resident,) = pool.loaded()
        assert (resident.bytes, resident.pinned, resident.expires_at) == (entry.bytes + need(store) // 2, True, None)
        use(pool, NAMES[1])  # fits beside it; a third does not, and the pinned one is not evicted for it
        with pytest.raises(PoolFull):
            use(pool, NAMES[2], context=512)
        assert loads == [NAMES[1]] and engine.running
        with pytest.raises(ValueError, match="already holds"):
            pool.adopt(entry, engine)
    assert not engine.running  # the pool closed it
    with Pool(store, budget_bytes=entry.bytes) as pool, Engine(mlx_mtp.load(entry.target.path), **OPTIONS) as e:
        with pytest.raises(PoolFull):  # its limit does not fit: refused, and left to its owner
            pool.adopt(entry, e)
        assert e.running and pool.loaded() == []


def test_keep_alive_zero_unloads_at_lease_end_a_short_one_expires_negative_keeps(store, loads):
    budget = 3 * need(store)
    with Pool(store, budget_bytes=budget, default_keep_alive="300ms", engine_options=OPTIONS) as pool:
        use(pool, NAMES[0], keep_alive=0)
        assert names(pool) == []
        use(pool, NAMES[2], keep_alive=-1)
        use(pool, NAMES[1])
        assert pool.loaded()[0].expires_at == pytest.approx(time.time() + 0.3, abs=0.25)
        deadline = time.monotonic() + 5
        while NAMES[1] in names(pool) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert names(pool) == [NAMES[2]] and pool.loaded()[0].expires_at is None
        time.sleep(0.5)
        assert names(pool) == [NAMES[2]]


def test_a_smaller_context_never_reloads_and_a_larger_one_grows_the_kv_in_place(store, loads):
    with Pool(store, budget_bytes=3 * need(store), engine_options=OPTIONS) as pool:
        entry = store.resolve(NAMES[0])
        with pool.lease(NAMES[0], context=128) as first:
            generate(first)
        prompt_cache = pool.kv_bytes(entry, 128) // 2
        for context, loaded_context in ((64, 128), (None, 128), (256, 256), (100000, 512)):
            with pool.lease(NAMES[0], context=context) as engine:
                assert engine is first
                generate(engine)  # the limit changes on the worker at its next admission
            [resident] = pool.loaded()
            kv = pool.kv_bytes(entry, loaded_context)
            assert (resident.context, resident.bytes) == (loaded_context, entry.bytes + kv + prompt_cache)
            assert engine.memory_limit == engine._worker._admission.limit == kv + prompt_cache
        assert loads == [NAMES[0]]


def test_a_pair_that_grows_evicts_others_never_itself(store, loads):
    entry = store.resolve(NAMES[0])
    grows = kv_bytes(entry, 512, 2) - kv_bytes(entry, CONTEXT, 2)
    with Pool(store, budget_bytes=2 * need(store) + grows - 1, engine_options=OPTIONS) as pool:
        use(pool, NAMES[0])  # the least recently used, and idle when it grows
        use(pool, NAMES[1])
        with pool.lease(NAMES[0], context=512) as engine:
            assert names(pool) == [NAMES[0]] and pool.loaded()[0].context == 512
            generate(engine)
        assert loads == NAMES[:2]


def test_a_deleted_model_finishes_its_leases_and_the_next_gets_not_found(models, tmp_path, loads):
    store = Store(shutil.copytree(models, tmp_path / "models"), hf_cache=None)
    with Pool(store, budget_bytes=3 * need(store), engine_options=OPTIONS) as pool:
        expected = use(pool, NAMES[0])
        with pool.lease(NAMES[0]) as engine:
            store.delete(NAMES[0])
            assert generate(engine) == expected
        with pytest.raises(NotFound, match="not found"):
            use(pool, NAMES[0])
        use(pool, NAMES[1])


def test_an_evicted_pairs_prefix_cache_survives_on_disk(store, loads, tmp_path):
    budget = need(store) * 3 // 2
    with Pool(store, budget_bytes=budget, prompt_cache_dir=tmp_path, engine_options=OPTIONS) as pool:
        reply = use(pool, NAMES[0])
        use(pool, NAMES[1])
        assert names(pool) == [NAMES[1]] and any((tmp_path / "testorg--tiny").rglob("*"))
        with pool.lease(NAMES[0], context=CONTEXT) as engine:
            assert engine.cached(PROMPT + reply, timeout=WAIT) >= len(PROMPT)
        assert loads == [NAMES[0], NAMES[1], NAMES[0]]


def test_of_pairs_idle_as_long_the_cheaper_to_reload_goes_first(store, loads, monkeypatch):
    with Pool(store, budget_bytes=3 * need(store, context=512), engine_options=OPTIONS) as pool:
        use(pool, NAMES[0], context=512)  # the larger pair
        use(pool, NAMES[1])
        for name in NAMES[:2]:  # idle 0.4 s and 0.3 s
            with pool.lease(name):
                pass
            time.sleep(0.1 if name == NAMES[0] else 0.3)
        assert pool.eviction_order() == [NAMES[0], NAMES[1]]  # tiny pairs reload at once: least recent first
        monkeypatch.setattr(pool_module, "RELOAD_BYTES_PER_S", 1000)  # as if each took half an hour
        assert pool.eviction_order() == [NAMES[1], NAMES[0]]


def test_a_failed_load_fails_every_lease_waiting_on_it_and_the_next_loads_again(store, loads, monkeypatch):
    gate, counted = threading.Event(), pool_module.load

    def broken(path, drafter=None):
        counted(path, drafter=drafter)
        assert gate.wait(WAIT)
        raise OSError("disk unplugged")

    monkeypatch.setattr(pool_module, "load", broken)
    with Pool(store, budget_bytes=need(store), engine_options=OPTIONS) as pool:
        errors = []

        def client():
            try:
                use(pool, NAMES[0])
            except OSError as e:
                errors.append(str(e))

        threads = [threading.Thread(target=client) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.3)  # the waiters are waiting on the one load
        gate.set()
        for t in threads:
            t.join(WAIT)
        assert errors == ["disk unplugged"] * 3 and loads == [NAMES[0]] and pool.free_bytes() == pool.budget
        monkeypatch.setattr(pool_module, "load", counted)
        use(pool, NAMES[0])
        assert loads == [NAMES[0]] * 2


def test_unload_waits_for_the_leases_and_changed_files_reload(models, tmp_path, loads):
    root = shutil.copytree(models, tmp_path / "models")
    store = Store(root, hf_cache=None)
    with Pool(store, budget_bytes=need(store), engine_options=OPTIONS) as pool:
        with pool.lease(NAMES[0], context=CONTEXT) as engine:
            assert pool.unload(NAMES[0]) and names(pool) == [NAMES[0]]
            generate(engine)
        assert names(pool) == [] and not engine.running and not pool.unload(NAMES[0])
        with pool.lease(NAMES[0], context=CONTEXT) as first:
            pass
        config = root / NAMES[0] / "config.json"
        config.write_text(config.read_text().replace("{", '{"note": "pulled again", ', 1))
        store.refresh()
        with pool.lease(NAMES[0], context=CONTEXT) as second:
            assert second is not first and not first.running
        assert loads == [NAMES[0]] * 3
