"""The engine's worker on its own, with a fake batch generator: admission first in, first out up to
`max_batch`, cancellation, a failed step, a drafter swap after the running rows, the counts."""

import threading

import pytest
from chat_helpers import DRAFTER, make_chat_model

import mlx_mtp
from mlx_mtp.engine.conversations import Conversations
from mlx_mtp.engine.prepare import Preparer
from mlx_mtp.engine.requests import Request
from mlx_mtp.decode.row import RowEvent
from mlx_mtp.decode.stats import Stats
from mlx_mtp.engine.worker import Settings, Worker

WAIT = 30


class FakeGenerator:
    """Each row gets one token a step (5, 6, 7, ...) until its `max_tokens`; a step may be held (`gate`)
    or made to fail (`fail`)."""

    def __init__(self, made: list, loaded):
        self.loaded, self.rows, self.order, self.cancelled, self.widest = loaded, {}, [], [], 0
        self.stats, self.fail, self.gate = Stats(), False, threading.Event()
        self.gate.set()
        made.append(self)

    @property
    def busy(self) -> bool:
        return bool(self.rows)

    def insert(self, tokens, max_tokens, **options) -> int:
        uid = len(self.order) + 1
        self.order.append(list(tokens))
        self.rows[uid] = [max_tokens, 0, None]
        return uid

    def step(self) -> list:
        assert self.gate.wait(WAIT)
        if self.fail:
            raise RuntimeError("a step failed")
        self.widest = max(self.widest, len(self.rows))
        events = []
        for uid, row in self.rows.items():
            row[1] += 1
            finish = row[2] or ("length" if row[1] >= row[0] else None)
            events.append(RowEvent(uid, [4 + row[1]], [False], finish, Stats() if finish else None))
        return events

    def cancel(self, uid: int) -> None:
        self.cancelled.append(uid)
        self.rows[uid][2] = "cancelled"

    def remove(self, uid: int, keep=None) -> None:
        del self.rows[uid]

    def release(self, key) -> None:
        pass

    def trim_prefix_cache(self, n: int) -> None:
        pass


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return mlx_mtp.load(make_chat_model(tmp_path_factory.mktemp("worker") / "model"), DRAFTER)


@pytest.fixture
def worker(loaded, request):
    made = []
    settings = Settings(max_batch=getattr(request, "param", 2), memory_limit=2**34)
    w = Worker(loaded, settings, Preparer(loaded), Conversations(loaded, lambda *a: None),
               generator=lambda loaded, prefix: FakeGenerator(made, loaded))
    w.made = made
    yield w
    w.stop(WAIT)
    assert not w.alive


def generator(worker) -> FakeGenerator:
    """The worker's batch generator (made on its thread as it starts)."""
    for _ in range(WAIT * 100):
        if worker.made:
            return worker.made[-1]
        threading.Event().wait(0.01)
    raise TimeoutError("the worker made no generator")


def submit(worker, prompt, max_tokens):
    request, prepared = worker._preparer.one_shot(Request(prompt, max_tokens=max_tokens))
    return worker.submit(request, prepared)


def test_rows_start_first_in_first_out_up_to_max_batch(worker):
    handles = [submit(worker, [1, 2, i], 3 + i) for i in range(5)]
    results = [h.result(WAIT) for h in handles]
    assert [list(r.tokens) for r in results] == [list(range(5, 8 + i)) for i in range(5)]
    assert all(r.finish_reason == "length" for r in results)
    gen = generator(worker)
    assert gen.order == [[1, 2, i] for i in range(5)] and gen.widest == 2  # in order, never more than 2
    counts = worker.counts()
    assert counts["requests_total"] == 5 and counts["requests_running"] == counts["requests_waiting"] == 0


def test_a_cancelled_row_ends_cancelled_with_what_it_streamed(worker):
    handle = submit(worker, [1, 2], 10_000)
    first = next(iter(handle))
    assert first.kind == "token" and first.token == 5
    handle.cancel()
    done = handle.result(WAIT)
    assert done.finish_reason == "cancelled" and done.tokens[0] == 5 and generator(worker).cancelled == [1]


def test_a_failed_step_fails_its_rows_and_the_next_request_runs_on_a_new_batch(worker):
    gen = generator(worker)
    gen.gate.clear()  # hold the first step until the row is in
    handle = submit(worker, [1, 2], 5)
    gen.fail = True
    gen.gate.set()
    with pytest.raises(RuntimeError, match="a step failed"):
        handle.result(WAIT)
    assert list(submit(worker, [3], 2).result(WAIT).tokens) == [5, 6]
    assert len(worker.made) == 2


class Drafter:
    def check_target(self, target) -> None:
        pass


def test_a_drafter_swap_waits_for_the_running_rows(worker):
    gen = generator(worker)
    gen.gate.clear()
    running = submit(worker, [1], 3)
    new = Drafter()
    swapped = worker.swap(new)
    later = submit(worker, [2], 2)  # queued behind the swap: it starts on the new drafter
    assert not swapped.done()
    gen.gate.set()
    assert swapped.result(WAIT) and list(running.result(WAIT).tokens) == [5, 6, 7]
    assert list(later.result(WAIT).tokens) == [5, 6]
    assert worker.loaded.drafter is new and worker.made[-1].loaded.drafter is new and gen.order == [[1]]


def test_a_closed_worker_refuses_requests(worker):
    worker.stop(WAIT)
    with pytest.raises(RuntimeError, match="closed"):
        submit(worker, [1], 2)
