"""Pipeline parallelism over `mx.distributed`, with MTP speculative decoding across ranks.

Each rank of an `mlx.launch` group holds a contiguous range of the target's layers, balanced by
weight bytes, and the KV cache of those layers; it loads only those weights (lazily loaded
checkpoint tensors, of which it evaluates its own). Every rank runs the same `BatchGenerator`
calls in lockstep; what crosses ranks in one round, all inside each rank's lazy graph:

    last rank -> rank 0        the drafts (B, K) int32: the drafter lives on the last rank, next
                               to the store layers it reads and the final hidden state
    rank i -> rank i + 1       the activations (B, K + 1, H) of the verify forward
    last -> 0 -> ... -> last-1 the decision (B, K + 3) int32: drafts, accepted count, next token, drafts counted.
                               Acceptance and sampling happen once, on the last rank (it has the
                               logits); every rank rolls its cache back with the same count.

Every send goes to the next rank round the ring and is queued (`mx.async_eval`) as soon as it
is built, so the sends and receives of each rank stay in one order all ranks agree on, and the
driver still queues round n + 1 before it reads round n. Host-side choices (rows joining or
leaving, the draft length, random seeds of unseeded rows) are rank 0's: `Leader` tells the
other ranks over the control connections of `group.Group`, and `Follower.follow` repeats them.

E2B/E4B (per-layer embeddings, KV-shared layers reading earlier layers) are refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import signal
import threading
import time
import traceback
import weakref
from pathlib import Path
from typing import Callable, Optional, Sequence, TypeVar, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..cache.kv import FULL, SLIDING
from ..decode.drafters import MTPProposer
from .group import Group, GroupError, Traffic
from ..loading import Loaded, _private_arrays, eos_ids, load_model, load_tokenizer
from ..decode.lockstep import Lockstep
from ..cache.prefix import PrefixCache
from ..decode.sample import SamplingParams
from ..decode.speculative import Drafts


T = TypeVar("T")


class PlacementError(ValueError):
    """A model that cannot be split over the group as asked."""


# ---- placement ---------------------------------------------------------------------------------


def nbytes(module: Optional[nn.Module]) -> int:
    """Bytes of a module's parameters (known without loading them)."""
    return 0 if module is None else sum(a.nbytes for _, a in tree_flatten(module.parameters()))


def split_layers(sizes: Sequence[int], ranks: int, first: int = 0, last: int = 0,
                 last_from: Optional[int] = None) -> list[tuple[int, int]]:
    """Contiguous layer ranges [start, end), one per rank in order, minimising the largest
    rank's bytes. Rank 0 also holds `first` bytes (the embedding), the last rank `last` bytes
    (norm, head, drafter) and every layer from `last_from` on (the layers its drafter reads)."""
    n = len(sizes)
    last_from = n - 1 if last_from is None else last_from
    if ranks > n:
        raise PlacementError(f"{ranks} ranks for a model of {n} layers: every rank needs a layer")
    if ranks - 1 > last_from:
        raise PlacementError(
            f"the drafter reads layers {last_from} and up, which must sit on the last rank with the final "
            f"norm; that leaves {last_from} layers for the other {ranks - 1} ranks, who need one each")
    prefix = list(itertools.accumulate(sizes, initial=0))
    # best[r][i]: (largest load, cuts) putting layers [0, i) on ranks 0..r-1
    best = [{0: (0, [])}] + [{} for _ in range(ranks)]
    for r in range(ranks):
        extra = (first if r == 0 else 0) + (last if r == ranks - 1 else 0)
        for a, (worst, cuts) in best[r].items():
            # every later rank needs a layer; no rank but the last may reach past `last_from`
            ends = [n] if r == ranks - 1 else range(a + 1, min(n - (ranks - 1 - r), last_from) + 1)
            for b in ends:
                option = (max(worst, prefix[b] - prefix[a] + extra), cuts + [b])
                if b not in best[r + 1] or option[0] < best[r + 1][b][0]:
                    best[r + 1][b] = option
    cuts = [0] + best[ranks][n][1]
    return list(zip(cuts[:-1], cuts[1:]))


def refuse_unsupported(cfg) -> None:
    if cfg.num_kv_shared_layers or cfg.hidden_size_per_layer_input:
        raise PlacementError(
            "pipeline parallelism supports the dense and MoE Gemma 4 targets; E2B/E4B-style models (per-layer "
            "embeddings, KV-shared layers reading earlier layers' K/V) run in one process only")


def place(target, drafter, ranks: int) -> list[tuple[int, int]]:
    """Each rank's layers: `target`'s split over `ranks` ranks by weight bytes, the embedding on
    the first, the final norm, head (the tied embedding) and `drafter` on the last."""
    cfg, m = target.config, target.model
    refuse_unsupported(cfg)
    sizes = [nbytes(layer) for layer in m.layers]
    head = nbytes(target["lm_head"]) if "lm_head" in target else nbytes(m.embed_tokens)
    last_from = min(cfg.store_layer(t) for t in (SLIDING, FULL)) if drafter is not None else None
    tail = head + nbytes(m.norm) + nbytes(drafter)
    return split_layers(sizes, ranks, nbytes(m.embed_tokens), tail, last_from)


# ---- one rank's stage: the device side -------------------------------------------------------------


class Stage(Lockstep):
    """This rank's layers and its neighbours on the ring (what `gemma4.Model.keep_stage` and the
    driver's `share` use). `Leader` and `Follower` add the host side."""

    def __init__(self, group: Group, span: tuple[int, int], dtype: mx.Dtype):
        self.group = group
        self.rank, self.size = group.rank, group.size
        self.span = span
        self.last = self.rank == self.size - 1
        self.dtype = dtype  # of the activations passed between ranks
        self.sent = Traffic()  # counted as the sends are built, which is when they are queued
        self.weight_bytes = 0  # of the weights this rank holds, drafter included
        self.drafter = False  # whether the drafter runs here

    def receive(self, shape: tuple, dtype: Optional[mx.Dtype] = None) -> mx.array:
        """The previous rank's next message (activations unless `dtype` says otherwise)."""
        source = (self.rank - 1) % self.size
        return mx.distributed.recv(shape, dtype or self.dtype, source, group=self.group.world)

    def send(self, x: mx.array) -> None:
        """Queue `x` for the next rank now: each rank's sends and receives then run in the
        order they were built, the same order on every rank."""
        mx.async_eval(mx.distributed.send(x, (self.rank + 1) % self.size, group=self.group.world))
        self.sent.messages += 1
        self.sent.bytes += x.nbytes

    def share(self, decide, shapes: Sequence[tuple]) -> tuple:
        """`decide()` (int32 arrays of these shapes, B rows first) runs on the last rank, which has
        the logits; the result goes round the ring, last -> 0 -> 1 -> ... -> last - 1."""
        B = shapes[0][0]
        widths = [math.prod(s[1:]) for s in shapes]
        self.sent.decisions += 1
        if self.last:
            parts = decide()
            self.send(mx.concatenate([p.reshape(B, -1).astype(mx.int32) for p in parts], axis=1))
            return parts
        packed = self.receive((B, sum(widths)), mx.int32)
        if self.rank < self.size - 2:
            self.send(packed)
        bounds = list(itertools.accumulate(widths))[:-1]
        return tuple(p.reshape(s) for p, s in zip(mx.split(packed, bounds, axis=1), shapes))

    def seed(self, gen, uid: int) -> int:
        """The random seed of an unseeded row: a function of the group's secret and the row."""
        text = f"{self.group.secret}:{self._gen_id(gen)}:{uid}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=4).digest(), "little")

    def describe(self) -> str:
        a, b = self.span
        parts = [f"layers {a}-{b - 1}"] + ["embedding"] * (self.rank == 0) + ["norm, head"] * self.last
        parts += ["drafter"] * self.drafter
        mib = self.weight_bytes / 2**20
        return f"rank {self.rank} of {self.size}: {', '.join(parts)}: {mib:.2f} MiB of weights"


class SendDrafts:
    """The last rank's proposer: the MTP drafter runs here, next to the store layers it reads and
    the final hidden state; its tokens go to rank 0 for the next verify."""

    def __init__(self, proposer, stage: Stage):
        self.proposer, self.stage = proposer, stage
        self.needs_history = proposer.needs_history

    def propose(self, state, cache, k: int, plan) -> Drafts:
        drafts = self.proposer.propose(state, cache, k, plan)
        self.stage.send(drafts.tokens.astype(mx.int32))
        return drafts


class DraftsFromLast:
    """Rank 0 receives the drafts from the last rank; the ranks between only need their count."""

    needs_history = False

    def __init__(self, stage: Stage):
        self.stage = stage

    def propose(self, state, cache, k: int, plan) -> Drafts:
        B = state.tokens.shape[0]
        if self.stage.rank == 0:
            return Drafts(self.stage.receive((B, k), mx.int32))
        return Drafts(mx.zeros((B, k), dtype=mx.int32))


# ---- the host side: rank 0 leads, the others follow ------------------------------------------------


class Leader(Stage):
    """Rank 0: tells the other ranks each generator call it makes and each draft length it
    chooses, in order. Calls from several threads take turns; a step is one turn."""

    def __init__(self, *args):
        super().__init__(*args)
        self._gens: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # generator -> id
        self._prefixes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # PrefixCache -> id
        self._ids, self._prefix_ids = itertools.count(), itertools.count()
        self._forgotten: list = []  # ("gens" | "prefixes", id) of objects gone on rank 0
        self._turn = threading.RLock()  # held from `called(gen, "step")` to `stepped`
        self._stepping = False

    def _gen_id(self, gen) -> int:
        return self._gens[gen]

    def _tell(self, message: dict) -> None:
        with self._turn:
            if self._stepping:  # this thread left a step by an exception
                self.group.fail("a generation step on rank 0 was interrupted; the ranks are out of step")
            if self._forgotten:
                gone = [self._forgotten.pop() for _ in range(len(self._forgotten))]  # finalizers may append
                lists = {k: [i for kind, i in gone if kind == k] for k in ("gens", "prefixes")}
                self.group.send({"call": "forget", **lists})
            self.group.send(message)

    def made(self, gen) -> None:
        if gen.proposer is not None and not isinstance(gen.proposer, DraftsFromLast):
            raise GroupError("in a pipeline group only the group's own drafter (pipeline.load) can draft")
        if gen.prefix is not None and gen.prefix.disk is not None:  # each rank would have to read its own layers
            raise GroupError("the prefix cache's disk tier (prompt_cache_dir) does not run in a pipeline group")
        fixed = gen.policy.fixed
        with self._turn:  # numbered in the order the other ranks hear of them
            gen_id, prefix = next(self._ids), self._prefix_id(gen.prefix)
            self._tell({"call": "new", "gen": gen_id, "mtp": gen.proposer is not None,
                        "draft_tokens": "auto" if fixed is None else fixed, "prefill_chunk": gen.prefill_chunk,
                        "prefill_tokens": gen.prefill_tokens, "prefix": prefix,
                        "budget": None if gen.prefix is None else gen.prefix.budget})
        self._gens[gen] = gen_id
        weakref.finalize(gen, self._forgotten.append, ("gens", gen_id))

    def _prefix_id(self, prefix) -> Optional[int]:
        """The number of a prefix cache, which the other ranks mirror: they store, resume and
        evict alike since they repeat every call that changes it."""
        if prefix is None:
            return None
        if prefix not in self._prefixes:
            self._prefixes[prefix] = next(self._prefix_ids)
            weakref.finalize(prefix, self._forgotten.append, ("prefixes", self._prefixes[prefix]))
        return self._prefixes[prefix]

    def inserting(self, gen, row) -> None:
        self._tell({"call": "insert", "gen": self._gens[gen], "uid": row.uid, "prompt": row.prompt,
                    "max_tokens": row.max_tokens, "sampling": dataclasses.asdict(row.params),
                    "seed": row.seed if row.seeded else None, "stop_ids": sorted(row.stop_ids),
                    "mtp": row.draft is not None, "draft_tokens": "auto" if row.draft is None else row.draft,
                    "boundaries": sorted(row.marks), "owner": row.owner})

    def called(self, gen, call: str, *args) -> None:
        if call == "step":
            self._turn.acquire()
        self._tell({"call": call, "gen": self._gens[gen], "args": list(args)})
        if call == "step":
            self._stepping, self.group.busy_since = True, time.monotonic()

    def stepped(self, gen) -> None:
        if not gen.busy:
            _drain()
        self._stepping, self.group.busy_since = False, None
        self._turn.release()

    def draft_tokens(self, gen, choose) -> int:
        k = choose()
        self.group.send({"call": "k", "k": k})
        return k

    def done(self) -> None:
        """This model is done: the other ranks return from `follow`."""
        _drain()
        self._tell({"call": "done"})


class Follower(Stage):
    """Ranks 1 and up: `follow` repeats rank 0's generator calls; draft lengths come from rank 0."""

    def __init__(self, *args):
        super().__init__(*args)
        self._gens: dict[int, object] = {}
        self._prefixes: dict[int, PrefixCache] = {}  # rank 0's prefix caches, mirrored
        self._ids = itertools.count()

    def _gen_id(self, gen) -> int:
        return next(i for i, g in self._gens.items() if g is gen)

    def made(self, gen) -> None:
        self._gens[next(self._ids)] = gen

    def draft_tokens(self, gen, choose) -> int:
        return self._expect("k")["k"]

    def _expect(self, call: str) -> dict:
        message = self.group.receive()
        if message["call"] != call:
            self.group.fail(f"out of step with rank 0: expected {call!r}, got {message['call']!r}")
        return message

    def follow(self, loaded: Loaded) -> None:
        """Repeat rank 0's generator calls on this rank's part of `loaded` until rank 0 is done.
        A call that fails here stops the group: this rank could no longer keep in step."""
        while True:
            message = self.group.receive()
            if message["call"] == "done":
                return _drain()
            try:
                self._repeat(message, loaded)
            except Exception as e:
                self.group.fail(f"repeating rank 0's {message['call']!r} failed: {type(e).__name__}: {e}")

    def _repeat(self, message: dict, loaded: Loaded) -> None:
        from ..decode.batch import BatchGenerator

        call = message["call"]
        if call == "new":
            prefix = None
            if message["prefix"] is not None:
                if message["prefix"] not in self._prefixes:
                    self._prefixes[message["prefix"]] = PrefixCache(loaded.target, message["budget"])
                prefix = self._prefixes[message["prefix"]]
            gen = BatchGenerator(loaded.target, loaded.drafter if message["mtp"] else None,
                                 draft_tokens=message["draft_tokens"], prefill_chunk=message["prefill_chunk"],
                                 prefix_cache=prefix, prefill_tokens=message["prefill_tokens"])
            if self._gen_id(gen) != message["gen"]:
                self.group.fail("out of step with rank 0: generators numbered differently")
        elif call == "forget":
            self._forget(message["gens"], message["prefixes"])
        elif call == "insert":
            self._insert(self._gens[message["gen"]], message)
        elif call == "step":
            self.group.busy_since = time.monotonic()
            gen = self._gens[message["gen"]]
            gen.step()
            if not gen.busy:
                _drain()
            self.group.busy_since = None
        elif call in ("cancel", "remove", "release", "trim_prefix_cache"):
            getattr(self._gens[message["gen"]], call)(*message["args"])
        else:
            self.group.fail(f"out of step with rank 0: unexpected {call!r}")

    def _insert(self, gen, m: dict) -> None:
        uid = gen.insert(m["prompt"], max_tokens=m["max_tokens"], sampling=SamplingParams(**m["sampling"]),
                         seed=m["seed"], stop_ids=m["stop_ids"], mtp=m["mtp"], draft_tokens=m["draft_tokens"],
                         boundaries=m["boundaries"], owner=m["owner"])
        if uid != m["uid"]:
            self.group.fail(f"out of step with rank 0: row {uid} here is row {m['uid']} there")

    def _forget(self, gens: list, prefixes: list) -> None:
        for gen_id in gens:
            self._gens.pop(gen_id, None)
        for prefix_id in prefixes:
            self._prefixes.pop(prefix_id, None)


def _drain() -> None:
    """Wait for this thread's queued work: the driver queues one round past the last it reads, and
    its messages must not outlive the peer's process. Every rank drains at the same step."""
    for device in {mx.cpu, mx.default_device()}:
        mx.synchronize(device)


# ---- loading -----------------------------------------------------------------------------------


def load(model: Union[str, Path], drafter: Union[str, Path, None], dtype: Optional[mx.Dtype],
         group: Group) -> Loaded:
    """This rank's part of a target (and drafter) split over `group` (see `group.launched`).

    The checkpoint is read lazily and only this rank's tensors are evaluated; rank 0 also gets
    the tokenizer. The returned `Loaded` works with every front end: on rank 0 they run as
    usual, the other ranks call `loaded.target.pipeline.follow(loaded)`.

    Raises:
        PlacementError: E2B/E4B, more ranks than layers, a drafter that cannot be placed, or
            MLX's CUDA backend.
    """
    check_backend()
    target, config, path = load_model(model, dtype=dtype, lazy=True)
    draft = None
    if drafter is not None:
        draft, draft_config, _ = load_model(drafter, dtype=dtype, lazy=True)
        if draft_config.get("model_type") != "gemma4_assistant":
            raise ValueError(f"{drafter} is a {draft_config.get('model_type')!r} model, not an MTP drafter")
        draft.check_target(target)
    spans = place(target, draft, group.size)
    _agree(group, config, spans)
    dtype_between = target.embed(mx.zeros((1, 1), dtype=mx.int32)).dtype  # lazy: nothing is loaded
    stage = (Leader if group.leader else Follower)(group, spans[group.rank], dtype_between)
    target.keep_stage(stage)
    stage.drafter = draft is not None and stage.last
    mine = [target] + [draft] * stage.drafter
    mx.eval([m.parameters() for m in mine], [_private_arrays(m) for m in mine])  # this rank's tensors only
    stage.weight_bytes = sum(nbytes(m) for m in mine)
    proposer = None
    if draft is not None:
        proposer = SendDrafts(MTPProposer(draft, target), stage) if stage.last else DraftsFromLast(stage)
    tokenizer = load_tokenizer(path) if group.leader else None
    return Loaded(target, tokenizer, proposer, eos_ids(path, config))


def check_backend() -> None:
    """Stages pass activations with `mx.distributed.send`/`recv`, which MLX's CUDA backend does not
    implement (its NCCL backend has collectives only)."""
    if mx.default_device() == mx.gpu and mx.cuda.is_available():
        raise PlacementError("pipeline parallelism needs mx.distributed send/recv, which MLX's CUDA backend "
                             "does not have: run one process per GPU instead")


def run(loaded: Loaded, group: Group, front_end: Callable[[], T]) -> Optional[T]:
    """Rank 0 runs `front_end()` (the chat, an app around an `Engine`, a server) and does all the
    I/O; the other ranks repeat its generator calls until it returns. Then the group closes."""
    stage = loaded.target.pipeline
    if group.leader:
        try:
            result = front_end()
        except Exception as e:  # the other ranks cannot go on without rank 0: stop them too
            traceback.print_exc()
            return group.fail(f"{type(e).__name__}: {e}")
        stage.done()
        group.close()
        return result
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for rank 0 to handle
    stage.follow(loaded)
    group.close()
    return None


def _agree(group: Group, config: dict, spans: list) -> None:
    """Every rank must split the same model the same way (the same files on every machine)."""
    text = json.dumps([config, spans], sort_keys=True, default=str).encode()
    mine = int.from_bytes(hashlib.blake2b(text, digest_size=3).digest(), "little")
    every = mx.distributed.all_gather(mx.array([mine], dtype=mx.int32), group=group.world).tolist()
    if len(set(every)) > 1:
        raise PlacementError(f"the ranks loaded different models or configs (fingerprints {every})")
