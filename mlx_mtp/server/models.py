"""What a request's `model` names, held while its answer is made.

Two kinds, one interface. `One` is a single Engine (an app that calls `create_app(engine, ...)`):
the parsers check the name, as they always did. `Pooled` is the server's: the model it started
with and every model in the store, loaded on demand by the pool (`engine/pool.py`), which decides
admission, eviction and keep_alive for every API alike.

    lease = await models.lease(name, context=num_ctx, keep_alive=seconds)   # loads if need be
    lease.engine, lease.model      # the pair's Engine; the ServedModel its parsers read
    lease.load_ns                  # what waiting for the model took (Ollama's load_duration)
    lease.release()                # once the answer is done (a stream: when it ends)

A lease is taken on a thread of its own: a load can take a minute, and the requests waiting for it
must not take the event loop's executor (which the running ones submit through). A request that
goes away while its model loads gives its lease back once the load is done.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import threading
import time
import weakref
from pathlib import Path
from typing import Callable, Optional

from ..engine.pool import Pool, Resident
from ..formats import chat as chat_format
from ..store import Entry, NotFound, StoreError
from . import ollama
from .common import ServedModel


@dataclasses.dataclass
class Lease:
    engine: object
    model: ServedModel
    load_ns: int = 0
    started_ns: int = 0  # time.perf_counter_ns() when the request asked for its model
    _release: Optional[Callable[[], None]] = None

    def release(self) -> None:
        """Give the model back (once; later calls do nothing)."""
        release, self._release = self._release, None
        if release is not None:
            release()


@dataclasses.dataclass(frozen=True)
class Listed:
    """A model as `/api/tags`, `/api/ps` and `/v1/models` describe it."""

    card: "ollama.Card"
    resident: Optional[Resident] = None  # None: not loaded
    aliases: tuple = ()

    @property
    def loaded(self) -> bool:
        return self.resident is not None


class One:
    """The one Engine an app built the server on: every name goes to it, and the parsers say 404 for
    another name, as before there was a pool."""

    store = None  # no pulls, no deletes
    has_default = True

    def __init__(self, engine, model: ServedModel, started: int):
        self.engine, self.model, self.started = engine, model, started
        self._card = None

    async def lease(self, name, context=None, keep_alive=None) -> Lease:
        return Lease(self.engine, self.model, started_ns=time.perf_counter_ns())

    def listing(self, loaded_only: bool = False) -> list[Listed]:
        if self._card is None:
            self._card = ollama.card(self.engine.loaded, self.model, self.started)
        return [Listed(self._card, Resident(self.model.id, self._card.size, self._card.size, self.model.context,
                                            None, 0, True, None))]

    def _check(self, name: str) -> None:
        if not ollama.same_model(name, self.model.id):
            raise NotFound(name)

    def show(self, name: str) -> "ollama.Card":
        self._check(name)
        return self.listing()[0].card

    def unload(self, name: str) -> bool:
        """The app's engine is the app's: an unload request leaves it."""
        self._check(name)
        return False

    def engines(self) -> list:
        return [self.engine]

    def gauges(self) -> None:
        return None  # no pool


class Pooled:
    """The pool's pairs by name: the start model under its served name (and the store's, where it came
    from the store), and the store's models, each loaded when a request first names it.

    Args:
        pool: the Pool, with the start model adopted.
        defaults: the start model's ServedModel: its id is the `model` of a request that names none
            (none with `start_card` None: a store-only server), and its request defaults (draft
            tokens, thinking, history) are every model's.
        start_card: how the listings describe the start model (read from its loaded weights).
        allow_pull: a name the store lacks is pulled from the Hub before it loads.
    """

    def __init__(self, pool: Pool, defaults: ServedModel, start_card: Optional["ollama.Card"],
                 allow_pull: bool = False):
        self.pool, self.defaults, self.start_card, self.allow_pull = pool, defaults, start_card, allow_pull
        self.store = pool.store
        self.has_default = start_card is not None
        self._served: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Engine -> {(name, context): model}
        self._pulls = threading.Lock()

    def resolve(self, name: Optional[str]) -> Entry:
        """The entry `name` names (None: the start model's). Raises NotFound."""
        if name is None and self.start_card is None:
            raise NotFound("(none)", why="this server has no default model")
        return self.pool.resolve(self.defaults.id if name is None else name)

    async def lease(self, name: Optional[str], context: Optional[int] = None,
                    keep_alive: Optional[float] = None) -> Lease:
        """The pair `name` names, loaded, held until `release`.

        Raises:
            NotFound: no such model (and no pull). PoolFull: it does not fit. StoreError: a pull
            failed. Whatever its load raised.
        """
        started = time.perf_counter_ns()
        try:
            entry = self.resolve(name)
        except NotFound:
            if not self.allow_pull or name is None:
                raise
            await in_thread(self._pull, name)
            entry = self.resolve(name)
        name = self.defaults.id if name is None else name
        manager = self.pool.lease(name, context=context, keep_alive=keep_alive)
        entering = in_thread(manager.__enter__)
        try:
            engine = await asyncio.shield(entering)
        except asyncio.CancelledError:  # the client went away while it loaded: give it back after
            entering.add_done_callback(lambda f: f.cancelled() or f.exception() or manager.__exit__(None, None, None))
            raise
        waited = time.perf_counter_ns() - started
        try:
            model = self._model(name, entry, engine)
        except BaseException:
            manager.__exit__(None, None, None)
            raise
        return Lease(engine, model, waited, started, lambda: manager.__exit__(None, None, None))

    def _pull(self, name: str) -> None:
        with self._pulls:  # one on-demand pull at a time: a second request for it finds it pulled
            try:
                self.resolve(name)
            except NotFound:
                self.store.pull(name)

    def _model(self, name: str, entry: Entry, engine) -> ServedModel:
        """The ServedModel of a leased pair as `name` names it: its context is the one the pool
        reserved its KV for (each reply's longest, by default)."""
        context = self.pool.context_of(engine) or entry.kv.context
        served = self._served.setdefault(engine, {})  # an engine's entries go with it
        if (name, context) not in served:
            d = self.defaults
            model = served_model(engine.loaded, name, d.draft_tokens, d.thinking, d.history, d.keep_thinking,
                                 d.parse_control_tokens)
            served[name, context] = dataclasses.replace(model, context=min(context, model.context))
        return served[name, context]

    def _start(self) -> Optional[Entry]:
        return None if self.start_card is None else self.resolve(None)

    def listing(self, loaded_only: bool = False) -> list[Listed]:
        """Every model: the start model first, then the store's by name; with whether each is loaded.
        `loaded_only`: the loaded ones, those deleted from the store while serving included."""
        residents = {r.name: r for r in self.pool.loaded()}
        start, out = self._start(), []
        if start is not None:
            aliases = tuple(a for a in _names(start) if a != self.defaults.id)
            out.append(Listed(self.start_card, residents.get(start.name), aliases))
        for entry in self.store.entries():
            if start is None or entry.name != start.name:
                out.append(Listed(entry_card(entry), residents.pop(entry.name, None), entry.aliases))
        if start is not None:
            residents.pop(start.name, None)
        if loaded_only:  # deleted from the store while serving: loaded (and holding memory) until its requests end
            out += [Listed(entry_card(r.entry), r, r.entry.aliases) for r in residents.values()]
        return [item for item in out if item.loaded or not loaded_only]

    def show(self, name: str) -> "ollama.Card":
        entry = self.resolve(name)
        return self.start_card if entry is self._start() else entry_card(entry)

    def unload(self, name: str) -> bool:
        """A client's unload (keep_alive 0, nothing to generate): a pinned model stays loaded."""
        self.resolve(name)  # NotFound for a name there is not
        return self.pool.unload(name, pinned=False)

    def delete(self, name: str) -> Entry:
        """Delete a store model; a loaded one is unloaded once its requests end (they finish first)."""
        entry = self.store.resolve(name)
        start = self._start()
        if start is not None and entry.name == start.name:
            raise StoreError(f"model '{name}' is the one this server was started with: stop the server to delete it")
        self.store.delete(name)
        self.pool.unload(entry.name)
        return entry

    def gauges(self) -> dict:
        """The pool's, for /metrics."""
        loaded = self.pool.loaded()
        return {"models_loaded": len(loaded), "pool_reserved_bytes": sum(r.bytes for r in loaded),
                "pool_budget_bytes": self.pool.budget}

    def engines(self) -> list:
        """The start model's Engine while it is loaded (health, metrics and drafter swaps are its)."""
        start = self._start()
        engine = self.pool.engine_of(start.name) if start is not None else None
        return [engine] if engine is not None else []


def served_model(loaded, model_id: str, draft_tokens="auto", thinking: bool = False, history: str = "generated",
                 keep_thinking: bool = False, parse_control_tokens: bool = False) -> ServedModel:
    """What the parsers know of `loaded`, with the server's defaults for requests that do not say."""
    config = loaded.target.config
    return ServedModel(model_id, config.max_position_embeddings, config.vocab_size, draft_tokens, thinking,
                       chat_format.has_tool_calls(loaded.tokenizer), history, keep_thinking, parse_control_tokens)


def _names(entry: Entry) -> tuple:
    return (entry.name, *entry.aliases)


def in_thread(fn, *args) -> asyncio.Future:
    """`fn(*args)` on a daemon thread of its own, as a future of the running loop."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run():
        try:
            result = fn(*args)
        except BaseException as e:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(_settle, future, None, e)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    threading.Thread(target=run, name="mlx_mtp-lease", daemon=True).start()
    return future


def _settle(future: asyncio.Future, result, error) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def served_entry(loaded, name: str) -> Entry:
    """A store entry for a model loaded from elsewhere (a directory, a hub id, the demo pair), as
    the pool reserves and reloads it: its weights' bytes, its KV shape, its directory."""
    from mlx import nn
    from mlx.utils import tree_flatten

    from ..runtime.memory import nbytes
    from ..store import Checkpoint, KVShape

    model = loaded.target if isinstance(loaded.target, nn.Module) else nn.Module()  # a wrapped one: not read
    floats = [a.dtype for _, a in tree_flatten(model.parameters()) if "float" in str(a.dtype)]
    weights = nbytes(loaded.target) + nbytes(loaded.drafter)
    target = Checkpoint(name, Path("."), "served", {}, (), weights, 0, 0, 0, "", f"served:{name}", time.time(),
                        KVShape.of(loaded.target.config, floats[0].size if floats else 2))
    return Entry(name, target, None)


def entry_card(entry: Entry) -> "ollama.Card":
    """How Ollama's listings describe a store model, from its config and headers (nothing loaded)."""
    template = chat_template(entry.target.path)
    quantization = entry.target.quantization
    label = f"Q{quantization.split('-')[0].split('/')[0]}" if quantization.endswith("-bit") else quantization.upper()
    when = datetime.datetime.fromtimestamp(entry.target.modified, datetime.timezone.utc)
    return ollama.Card(entry.name, entry.bytes, entry.target.parameters, label, entry.kv.context,
                       entry.target.tower_bytes > 0, chat_format.TOOL_CALL in template, template,
                       when.isoformat().replace("+00:00", "Z"))


def chat_template(path: Path) -> str:
    """A checkpoint's chat template: `chat_template.jinja`, else tokenizer_config.json's ("" if none)."""
    try:
        if (path / "chat_template.jinja").is_file():
            return (path / "chat_template.jinja").read_text()
        template = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return ""
    return template if isinstance(template, str) else ""
