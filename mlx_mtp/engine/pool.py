"""A pool of engines, one per loaded pair (a target with its drafter), within a memory budget.

The `Engine` serves one pair; the pool decides which pairs are loaded. Each lease names a model:
a pair that is not loaded is loaded on demand, after admission has made room for it. Leases of a
pair that is loading wait for that one load (and get its error if it fails); a load runs on the
leasing thread, outside the pool's lock, so the other pairs serve meanwhile.

    pool = Pool(Store(), pins=["gemma4:e2b"], prompt_cache_dir="~/.cache/mlx_mtp/prompts")
    with pool.lease("gemma4:31b", context=8192, keep_alive="10m") as engine:
        handle = engine.submit(Request(messages=...))   # read the handle's events inside the block
    pool.loaded()                                        # [Resident]: for /api/ps and /v1/models
    pool.unload("gemma4:31b"); pool.close()

Admission runs before a load, against reservations, never against live memory (which lags a load
and the frees after an eviction). A pair reserves:
- its weights: `entry.bytes`, target and drafter, the media towers included (they are read with
  the first image or audio, later, without another admission);
- its KV cache: `rows` rows of `context` tokens (`rows`: the Engine's `max_batch`, as Ollama counts
  num_parallel x num_ctx), each with the speculative rollback slack the Engine's own admission
  adds, so that the Engine's `memory_limit` is exactly this reservation plus the prompt cache's;
- its prompt cache: `prompt_cache_bytes` from `engine_options`, else half the KV reservation (the
  memory plan's split of what the weights leave: KV a half, the prefix cache a quarter).
When the budget is short, idle pairs are evicted first (`Pool.eviction_order`): the most idle per second
of reload goes first, `idle seconds / (1 + bytes / RELOAD_BYTES_PER_S)`, so that of two pairs idle
as long the cheaper one to bring back goes. A pair with leases in flight, one that is loading, or a
pinned one is never evicted. Pairs are evicted only if evicting them makes the new one fit. Where
pairs in use stand in the way, the lease waits (`wait_s`) for them to go idle, as Ollama's
scheduler does; what would not fit even then, or still does not after the wait, gets `PoolFull`,
which says what is needed and what is free, and nothing is evicted for it.

A smaller context than the one loaded is served as it is; a larger one grows the KV reservation
(admitted like a load, evicting others if need be) and raises the Engine's `memory_limit` in place.
The prompt cache keeps the share it was loaded with. With `prompt_cache_dir`, each pair keeps its
prefix cache's states in a subdirectory of its own (`google--gemma-4-31B-it`), which outlives an
eviction: a pair loaded again resumes from them.

`keep_alive` has Ollama's meaning (`keep_alive_seconds`): seconds, or a Go duration string ("5m",
"1h30m", "300ms"); 0 unloads the pair when its last lease ends; negative keeps it loaded. The
latest lease's keep_alive applies, counted from when the pair's last lease ends. Expiry runs on a
timer thread of the pool (an idle server gives the memory back without a request to notice it).
Pins never expire and are never evicted; `unload` still unloads them, unless told to leave them. A model deleted from the
store keeps serving the leases it has; the next lease gets the store's NotFound, and the pair goes
at its keep_alive or to the first eviction. A model whose files changed (pulled again) is reloaded
at its next lease once it is idle.

The server keeps one Pool (`server/models.py`), built from `--memory-gb` (`budget_bytes`),
`--keep-alive` (`default_keep_alive`), `--pin` (`pins`), `--prompt-cache-dir` and the engine flags
(`engine_options`). The model it was started with is `adopt`ed: an Engine built as the server
always built it (its own memory plan), reserved at its weights and `memory_limit`, pinned, and
found by its served name as well as the store's (`resolve`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import logging
import math
import re
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, Sequence, Union

import mlx.core as mx

from ..cache.kv import FULL, SLIDING
from ..decode.speculative import MAX_ROLLBACK
from ..loading import load
from ..runtime import memory
from ..runtime.memory import size
from ..runtime.threads import mark_mlx_thread
from ..store import Entry, Store
from ..store.names import key
from .engine import Engine

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 4096  # a first load's context when a lease names none (Ollama's num_ctx default)
WAIT_S = 300.0  # how long a lease waits for busy pairs to make room (Ollama's load timeout)
RELOAD_BYTES_PER_S = 2 * 2**30  # about what a Mac's SSD reads: the cost of bringing a pair back
MARGIN = 1 / 8  # of the device's budget, never admitted: activations and MLX's buffer cache
MIN_MARGIN = 2**30
ROWS = inspect.signature(Engine).parameters["max_batch"].default
KeepAlive = Union[float, int, str, None]


class PoolFull(ValueError):
    """A pair that does not fit the budget even with every idle pair that may go gone. `needed`,
    `free` (now) and `evictable` (what evicting would add) are bytes; `str()` is one line."""

    def __init__(self, what: str, needed: int, free: int, evictable: int, budget: int, kept: Sequence[str]):
        self.needed, self.free, self.evictable, self.budget = needed, free, evictable, budget
        held = f" ({', '.join(kept)} in use or pinned)" if kept else ""
        more = f"evicting idle models would free {size(evictable)} more" if evictable else "none is idle"
        super().__init__(f"{what} needs {size(needed)} ({needed} bytes); {size(free)} ({free} bytes) of "
                         f"the pool's {size(budget)} is free, and {more}{held}")


def keep_alive_seconds(value: KeepAlive) -> float:
    """Ollama's keep_alive in seconds: a number of seconds, or a Go duration string ("5m",
    "1h30m", "300ms", "0"); negative is forever (`math.inf`).

    Raises:
        ValueError: a string that is not a Go duration, or a value of another type.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"keep_alive must be seconds or a duration string, got {value!r}")
    seconds = float(value) if not isinstance(value, str) else _duration(value.strip())
    return math.inf if seconds < 0 else seconds


_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def _duration(text: str) -> float:
    """Go's `time.ParseDuration`: a sign, then numbers each with a unit; "0" alone needs none."""
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.lstrip("+"))
    if body == "0":
        return 0.0
    parts = _PART.findall(body)
    if not parts or "".join(n + u for n, u in parts) != body:
        raise ValueError(f"keep_alive: invalid duration {text!r} (use seconds or e.g. \"5m\", \"1h30m\")")
    return sign * sum(float(n) * _UNITS[u] for n, u in parts)


@dataclasses.dataclass(frozen=True)
class Resident:
    """A loaded pair, as `/api/ps` and `/v1/models` report it."""

    name: str
    bytes: int  # what it reserves: weights, KV cache and prompt cache
    weights: int
    context: int
    expires_at: Optional[float]  # wall-clock seconds (time.time()); None: never
    leases: int
    pinned: bool
    entry: Entry = dataclasses.field(repr=False, compare=False)  # digest, details, model_info


class _Pair:
    """One pair in the pool, loading or loaded; fields change only under the pool's lock."""

    def __init__(self, entry: Entry, context: int, kv: int, prompt_cache: int, keep_alive: float):
        self.entry, self.context, self.kv, self.prompt_cache = entry, context, kv, prompt_cache
        self.keep_alive = keep_alive
        self.engine: Optional[Engine] = None  # None while loading
        self.error: Optional[BaseException] = None  # why its load failed
        self.leases = 0
        self.last_used = time.monotonic()
        self.expires = math.inf  # monotonic; inf while leased or kept forever
        self.unload_when_idle = False

    @property
    def bytes(self) -> int:
        return self.entry.bytes + self.kv + self.prompt_cache

    @property
    def idle(self) -> bool:
        return self.engine is not None and self.leases == 0


class Pool:
    """Engines for the pairs a store names, loaded on demand within `budget_bytes`.

    Args:
        store: the `Store` that names the models.
        budget_bytes: bytes all pairs may reserve together (default: the device's budget, as
            `runtime.memory.Device.budget` gives it (Metal's recommended working set, an NVIDIA GPU's
            memory, the physical memory on the CPU), less an eighth of it, at least 1 GiB).
        default_keep_alive: a lease's keep_alive when it gives none (seconds or a duration string).
        pins: names of pairs never evicted and never expired once loaded.
        prompt_cache_dir: where each pair's prefix cache keeps its states (a subdirectory each).
        engine_options: more `Engine` arguments for every pair (`max_batch`, `prefill_chunk`,
            `prompt_cache_bytes`, ...); `memory_limit` is the pool's to set.
        loader: `loader(entry)` loads a pair for its Engine (default: `load(target, drafter=...)`);
            a server's applies its dtype and media settings.
        default_context: a load's context when its lease names none (`--num-ctx`).
        wait_s: how long a lease waits for pairs in use to go idle where only they stand in the
            way of its pair (0: PoolFull at once).
    """

    def __init__(self, store: Store, budget_bytes: Optional[int] = None,
                 default_keep_alive: KeepAlive = 300.0, pins: Sequence[str] = (), prompt_cache_dir=None,
                 engine_options: Mapping = {}, loader: Optional[Callable[[Entry], object]] = None,
                 default_context: int = DEFAULT_CONTEXT, wait_s: float = WAIT_S):
        if "memory_limit" in engine_options or "prompt_cache_dir" in engine_options:
            raise ValueError("engine_options may not set memory_limit or prompt_cache_dir: the pool does")
        self.store = store
        self.budget = default_budget() if budget_bytes is None else int(budget_bytes)
        if self.budget <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
        self.default_keep_alive = keep_alive_seconds(default_keep_alive)
        self.pins = {key(p) for p in pins}
        self.prompt_cache_dir = Path(prompt_cache_dir).expanduser() if prompt_cache_dir else None
        inspect.signature(Engine).bind_partial(None, **engine_options)  # a typo fails here, not at a load
        self.engine_options = dict(engine_options)
        self.prompt_cache_bytes = self.engine_options.pop("prompt_cache_bytes", None)
        self.rows = self.engine_options.get("max_batch", ROWS)
        self.loader = loader or _load
        self.default_context = default_context
        self.wait_s = wait_s
        self._adopted: dict[str, Entry] = {}  # name key -> an adopted pair's entry (not the store's to resolve)
        self._pairs: dict[str, _Pair] = {}
        self._lock = threading.Condition()
        self._closed = False
        self._reaper = threading.Thread(target=self._expire_forever, name="mlx_mtp-pool-expiry", daemon=True)
        self._reaper.start()

    # ---- leases -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def lease(self, name: str, context: Optional[int] = None,
              keep_alive: KeepAlive = None) -> Iterator[Engine]:
        """The pair `name` names, loaded if need be, held loaded until the block ends.

        Args:
            name: a store name or alias.
            context: tokens per row to budget the KV cache for (clamped to the model's trained
                context); None: the loaded context, or `default_context` for a load.
            keep_alive: how long the pair stays loaded after its last lease (see the module).

        Raises:
            NotFound: the store has no such model. PoolFull: it does not fit the budget. ValueError:
            a bad keep_alive. Whatever the load raises (each lease waiting on that load gets it too).
        """
        ttl = self.default_keep_alive if keep_alive is None else keep_alive_seconds(keep_alive)
        entry = self.resolve(name)
        pair = self._acquire(entry, context, ttl)
        try:
            yield pair.engine
        finally:
            self._release(pair)

    def _acquire(self, entry: Entry, context: Optional[int], ttl: float) -> _Pair:
        victims: list[_Pair] = []
        try:
            with self._lock:
                pair = self._settle(entry, context, ttl, victims)
            if pair.engine is None:  # this lease loads it
                self._close(victims)
                victims = []
                self._load(pair)
            return pair
        finally:
            self._close(victims)

    def _settle(self, entry: Entry, context: Optional[int], ttl: float, victims: list) -> _Pair:
        """Under the lock: the pair leased (its lease counted), with room made for it. A new pair
        is returned without an engine, for the caller to load outside the lock. Where only pairs in
        use stand in the way, it waits (up to `wait_s`) for them to go idle, as Ollama's scheduler
        waits for a runner."""
        deadline = time.monotonic() + self.wait_s
        while True:
            if self._closed:
                raise RuntimeError("the pool is closed")
            pair = self._pairs.get(entry.name)
            if pair is not None and pair.idle and _digest(pair.entry) != _digest(entry):
                victims.append(self._drop(pair))  # pulled again: its files changed
                pair = None
            if pair is not None and pair.engine is None:  # another lease is loading it: wait for that load
                self._lock.wait()
                if pair.error is not None:
                    raise pair.error
                continue
            try:
                if pair is None:
                    return self._admit(entry, context, ttl, victims)
                if context is not None and self._context(entry, context) > pair.context:
                    self._grow(pair, self._context(entry, context), victims)
            except PoolFull as full:
                left = deadline - time.monotonic()
                if left <= 0 or not self._fits_once_idle(full.needed, pair):
                    raise
                self._lock.wait(left)  # a lease that ends, a load that fails, an expiry: look again
                continue
            pair.leases += 1
            pair.keep_alive, pair.expires = ttl, math.inf
            pair.unload_when_idle = False  # the latest lease's keep_alive wins, as Ollama's does
            return pair

    def _admit(self, entry: Entry, context: Optional[int], ttl: float, victims: list) -> _Pair:
        ctx = self._context(entry, self.default_context if context is None else context)
        kv = self.kv_bytes(entry, ctx)
        prompt = self.prompt_cache_bytes if self.prompt_cache_bytes is not None else kv // 2
        pair = _Pair(entry, ctx, kv, prompt, ttl)
        victims += self._make_room(f"model '{entry.name}' (context {ctx})", pair.bytes)
        pair.leases = 1
        self._pairs[entry.name] = pair
        return pair

    def _grow(self, pair: _Pair, context: int, victims: list) -> None:
        kv = self.kv_bytes(pair.entry, context)
        victims += self._make_room(f"growing '{pair.entry.name}' to context {context}", kv - pair.kv, pair)
        pair.context, pair.kv = context, kv
        pair.engine.set_memory_limit(kv + pair.prompt_cache)

    def _load(self, pair: _Pair) -> None:
        """Load a pair admitted under the lock, outside it: other pairs serve meanwhile."""
        entry = pair.entry
        try:
            mark_mlx_thread()
            loaded = self.loader(entry)
            engine = Engine(loaded, memory_limit=pair.kv + pair.prompt_cache,
                            prompt_cache_bytes=pair.prompt_cache, prompt_cache_dir=self._cache_dir(entry),
                            **self.engine_options)
        except BaseException as e:
            with self._lock:
                pair.error = e
                self._pairs.pop(entry.name, None)
                self._lock.notify_all()
            raise
        with self._lock:
            pair.engine = engine
            self._lock.notify_all()
            closed = self._closed
        if closed:  # `close` came during the load and did not see this engine
            self._close([pair])
            raise RuntimeError("the pool is closed")
        log.info("pool: loaded %s (%s reserved, context %d)", entry.name, size(pair.bytes), pair.context)

    def _release(self, pair: _Pair) -> None:
        with self._lock:
            pair.leases -= 1
            pair.last_used = time.monotonic()
            if pair.leases:
                return
            self._lock.notify_all()  # leases waiting for room, and the expiry thread's next deadline
            gone = pair.unload_when_idle or (pair.keep_alive == 0 and not self._pinned(pair))
            if gone and self._pairs.get(pair.entry.name) is pair:
                self._drop(pair)
            else:
                pair.expires = math.inf if self._pinned(pair) else pair.last_used + pair.keep_alive
                return
        self._close([pair])

    def adopt(self, entry: Entry, engine: Engine, names: Sequence[str] = (), pin: bool = True) -> None:
        """Take in an Engine built elsewhere (a server's start model), serving `entry` at its full
        context: reserved at its weights and `memory_limit`, never grown; found by `names` too.
        Loaded again after an unload, it is a pair like any other.

        Raises:
            PoolFull: it does not fit the budget beside the pairs there are.
        """
        with self._lock:
            if entry.name in self._pairs:
                raise ValueError(f"the pool already holds '{entry.name}'")
            pair = _Pair(entry, entry.kv.context, engine.memory_limit, 0, self.default_keep_alive)
            closing = self._make_room(f"model '{entry.name}'", pair.bytes)
            pair.engine = engine
            self._pairs[entry.name] = pair
            for name in (entry.name, *names):
                self._adopted[key(name)] = entry
            if pin:
                self.pins |= {key(n) for n in (entry.name, *names)}
            self._lock.notify_all()
        self._close(closing)

    def resolve(self, name: str) -> Entry:
        """The entry a lease of `name` serves: an adopted pair's, else the store's (NotFound)."""
        adopted = self._adopted.get(key(name))
        return adopted if adopted is not None else self.store.resolve(name)

    def engine_of(self, name: str) -> Optional[Engine]:
        """The Engine of the loaded pair `name` names (None: not loaded, or loading)."""
        with self._lock:
            pair = self._find(name)
            return pair.engine if pair is not None else None

    def context_of(self, engine: Engine) -> Optional[int]:
        """The context a loaded pair's KV is reserved for (its requests' longest reply by default)."""
        with self._lock:
            return next((p.context for p in self._pairs.values() if p.engine is engine), None)

    # ---- admission and eviction -------------------------------------------------------------

    def kv_bytes(self, entry: Entry, context: int) -> int:
        """The KV reservation of this pool's rows at `context` tokens (`kv_bytes`)."""
        return kv_bytes(entry, context, self.rows)

    def free_bytes(self) -> int:
        with self._lock:
            return self.budget - sum(p.bytes for p in self._pairs.values())

    def eviction_order(self) -> list[str]:
        """The pairs eviction would take, in its order (the first goes first)."""
        with self._lock:
            return [p.entry.name for p in self._candidates()]

    def _candidates(self, keep: Optional[_Pair] = None) -> list[_Pair]:
        now = time.monotonic()
        idle = [p for p in self._pairs.values() if p.idle and not self._pinned(p) and p is not keep]
        return sorted(idle, key=lambda p: -(now - p.last_used) / (1 + p.bytes / RELOAD_BYTES_PER_S))

    def _fits_once_idle(self, needed: int, keep: Optional[_Pair]) -> bool:
        """Whether `needed` bytes would fit with every unpinned pair but `keep` gone, busy ones too."""
        free = self.budget - sum(p.bytes for p in self._pairs.values())
        return free + sum(p.bytes for p in self._pairs.values() if not self._pinned(p) and p is not keep) >= needed

    def _make_room(self, what: str, needed: int, keep: Optional[_Pair] = None) -> list[_Pair]:
        """Evict what must go for `needed` more bytes to fit (never `keep`, the pair that grows),
        or nothing and raise PoolFull."""
        free = self.budget - sum(p.bytes for p in self._pairs.values())
        chosen: list[_Pair] = []
        for pair in self._candidates(keep):
            if free >= needed:
                break
            chosen.append(pair)
            free += pair.bytes
        if free < needed:  # evict nothing that would not make it fit
            evictable = sum(p.bytes for p in chosen)
            kept = [p.entry.name for p in self._pairs.values() if p not in chosen]
            raise PoolFull(what, needed, free - evictable, evictable, self.budget, kept)
        for pair in chosen:
            log.info("pool: evicting %s (%s) for %s", pair.entry.name, size(pair.bytes), what)
        return [self._drop(p) for p in chosen]

    def _drop(self, pair: _Pair) -> _Pair:
        """Take a pair out of the pool (under the lock); the caller closes it outside."""
        del self._pairs[pair.entry.name]
        return pair

    def _close(self, pairs: Sequence[_Pair]) -> None:
        """Stop evicted pairs' engines and free their memory before anything loads after them."""
        for pair in pairs:
            pair.engine.close()
            pair.engine = None
        if pairs:
            gc.collect()  # the weights go with the last reference to the loaded model
            mx.clear_cache()

    # ---- expiry -----------------------------------------------------------------------------

    def _expire_forever(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                due = [p for p in self._pairs.values() if p.idle and p.expires <= now]
                for pair in due:
                    self._drop(pair)
                if not due:
                    soonest = min((p.expires for p in self._pairs.values()), default=math.inf)
                    self._lock.wait(None if soonest == math.inf else soonest - now)
                    continue
            for pair in due:
                log.info("pool: %s expired", pair.entry.name)
            self._close(due)

    # ---- what the server reads and asks -----------------------------------------------------

    def loaded(self) -> list[Resident]:
        """The loaded pairs, by name (not those still loading)."""
        with self._lock:
            now, wall = time.monotonic(), time.time()
            out = []
            for p in sorted(self._pairs.values(), key=lambda p: p.entry.name):
                if p.engine is None:
                    continue
                ends = p.expires if not p.leases else now + p.keep_alive
                expires = None if self._pinned(p) or ends == math.inf else wall + ends - now
                out.append(Resident(p.entry.name, p.bytes, p.entry.bytes, p.context, expires, p.leases,
                                    self._pinned(p), p.entry))
            return out

    def unload(self, name: str, pinned: bool = True) -> bool:
        """Unload the pair `name` names now, or when its leases end; False if it is not loaded (or
        pinned, with `pinned=False`: a client's unload leaves what the server pinned)."""
        with self._lock:
            pair = self._find(name)
            if pair is None or pair.engine is None or (not pinned and self._pinned(pair)):
                return False
            if pair.leases:
                pair.unload_when_idle = True
                return True
            self._drop(pair)
        self._close([pair])
        return True

    def close(self) -> None:
        """Stop the expiry thread and close every engine (cancelling what they run)."""
        with self._lock:
            self._closed = True
            pairs = [p for p in self._pairs.values() if p.engine is not None]
            self._pairs.clear()
            self._lock.notify_all()
        self._reaper.join()
        self._close(pairs)

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- helpers ----------------------------------------------------------------------------

    def _find(self, name: str) -> Optional[_Pair]:
        """A pool's pair by any of its names, without the store (the model may be deleted)."""
        wanted = key(name)
        if wanted in self._adopted:
            return self._pairs.get(self._adopted[wanted].name)
        for pair in self._pairs.values():
            if wanted in {key(n) for n in (pair.entry.name, *pair.entry.aliases)}:
                return pair
        return None

    def _pinned(self, pair: _Pair) -> bool:
        return any(key(n) in self.pins for n in (pair.entry.name, *pair.entry.aliases))

    @staticmethod
    def _context(entry: Entry, context: int) -> int:
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        return min(context, entry.kv.context)

    def _cache_dir(self, entry: Entry) -> Optional[Path]:
        if self.prompt_cache_dir is None:
            return None
        return self.prompt_cache_dir / entry.name.replace("/", "--")


def _load(entry: Entry):
    return load(entry.target.path, drafter=entry.drafter.path if entry.drafter else None)


def default_budget() -> int:
    """What the device should use (`runtime.memory.Device.budget`), less an eighth (at least 1 GiB)."""
    budget = memory.Device.current().budget
    return budget - max(int(budget * MARGIN), MIN_MARGIN)


def kv_bytes(entry: Entry, context: int, rows: int) -> int:
    """The KV cache of `rows` rows of `context` tokens, as the Engine's admission counts a row: with
    the rollback slack past the context, the sliding rings at their full size."""
    per = entry.kv.token_bytes()
    ring = entry.kv.sliding_window + 1 + MAX_ROLLBACK
    return rows * (per[FULL] * (context + MAX_ROLLBACK) + per[SLIDING] * ring)


def _digest(entry: Entry) -> tuple:
    return entry.target.digest, entry.drafter.digest if entry.drafter else None
