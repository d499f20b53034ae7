"""The HTTP side: a Starlette app that hands every OpenAI, Anthropic and Ollama request to the Engine
of the model it names.

Each request first leases its model (`models.py`: the one Engine an app built the app on, or the
server's pool, which loads it if need be, within its memory budget), is parsed for that model,
and gives the lease back once its answer is done (a stream: when it ends). No MLX call runs
here; each Engine's worker thread owns them all. A handle's events arrive on
a blocking queue, so each request gets a reader thread that passes them to the event loop
(`EventStream`). Whatever way a request ends early (a client that went away, an error), its
handle is cancelled, which frees its engine row within one round; a stop string ends it in the
engine itself, which applies what a request means (`Request.stop`, `parallel_tool_calls`).

Each API is a wire format of its own (`protocol` for OpenAI, `anthropic`, `ollama`): a parsed job, an
`answer` and a `stream` of its reply's pieces (`pieces`: content, reasoning and tool calls as
the engine streamed them, and `KEEPALIVE` while nothing comes), and its error shapes; the
plumbing here is shared. A stream opens once its first event comes or `OPEN_AFTER` seconds pass, whichever is
first: a long prefill keeps the client informed instead of silent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import hmac
import json
import logging
import threading
import time
from typing import AsyncIterator, Callable, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..formats.chat import Delta
from ..engine.pool import PoolFull
from ..engine.requests import ContextLengthError, QueueFull, RequestHandle
from ..store import NotFound, NotOnHub, PullError, StoreError
from . import anthropic, ollama, protocol
from .common import KEEPALIVE, APIError, Outcome, ServedModel, flag, invalid, keep_alive
from .metrics import render as render_metrics
from .models import Lease, One, Pooled, in_thread, served_model  # noqa: F401 (served_model: the package's)

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 << 20
MAX_JSON_DEPTH = 64  # deeper bodies are refused before any code walks them
OPEN_AFTER = 0.5  # seconds a stream waits for its first event before it opens anyway
KEEPALIVE_EVERY = 5.0  # seconds of silence after which a stream sends a keep-alive (by default)
LOOPBACK = ("127.0.0.1", "::1", "localhost")  # who may swap the drafter (POST /v1/drafter)
SWAP_WAIT = 60.0  # seconds a swap waits for the running requests to finish before it answers


@dataclasses.dataclass(frozen=True)
class Wire:
    """One API's shapes: the whole answer, the stream, and its context-overflow error."""

    answer: Callable[..., dict]  # (job, parts, outcome) -> the reply
    stream: Callable[..., AsyncIterator[str]]  # (job, parts, outcome) -> its server-sent events
    context_error: Callable[..., APIError]  # (ContextLengthError, job) -> the 400 in the API's words
    media_type: str = "text/event-stream"  # the stream's (Ollama's: NDJSON)


OPENAI = Wire(protocol.response, protocol.stream, protocol.context_error)
ANTHROPIC = Wire(anthropic.answer, anthropic.stream, anthropic.context_error)
OLLAMA = Wire(ollama.answer, ollama.stream, ollama.context_error, "application/x-ndjson")


@dataclasses.dataclass(frozen=True)
class Settings:
    model: ServedModel
    api_key: Optional[str] = None
    max_body_bytes: int = MAX_BODY_BYTES
    keepalive: float = KEEPALIVE_EVERY
    started: int = dataclasses.field(default_factory=lambda: int(time.time()))


def create_app(engine, settings: Settings) -> Starlette:
    """The OpenAI-, Anthropic- and Ollama-compatible app serving `engine`: an `Engine` (one model,
    `settings.model`; the caller starts and closes it) or a server's `models.Pooled` (every model
    of its store, by the name each request gives)."""
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/drafter", put_drafter, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        # Ollama's native API (`ollama`)
        Route("/", ollama_root, methods=["GET", "HEAD"]),
        Route("/api/chat", ollama_chat, methods=["POST"]),
        Route("/api/generate", ollama_generate, methods=["POST"]),
        Route("/api/tags", ollama_tags, methods=["GET"]),
        Route("/api/show", ollama_show, methods=["POST"]),
        Route("/api/ps", ollama_ps, methods=["GET"]),
        Route("/api/version", ollama_version, methods=["GET"]),
        Route("/api/pull", ollama_pull, methods=["POST"]),
        Route("/api/delete", ollama_delete, methods=["DELETE"]),
    ]
    handlers = {APIError: api_error, HTTPException: http_error, Exception: server_error}
    app = Starlette(routes=routes, exception_handlers=handlers)
    models = engine if isinstance(engine, (One, Pooled)) else One(engine, settings.model, settings.started)
    app.state.models, app.state.settings = models, settings
    return app


# ---- endpoints ---------------------------------------------------------------------------------


async def chat_completions(request: HTTPRequest) -> Response:
    settings = _authorized(request)
    body = await read_json(request, settings.max_body_bytes)
    return await serve(request, body, lambda lease: protocol.parse_chat(body, lease.model), OPENAI)


async def completions(request: HTTPRequest) -> Response:
    settings = _authorized(request)
    body = await read_json(request, settings.max_body_bytes)
    return await serve(request, body, lambda lease: protocol.parse_completion(body, lease.model), OPENAI)


async def messages(request: HTTPRequest) -> Response:
    settings = _authorized(request)
    body = await read_json(request, settings.max_body_bytes)
    return await serve(request, body, lambda lease: anthropic.parse_messages(body, lease.model), ANTHROPIC)


async def count_tokens(request: HTTPRequest) -> Response:
    settings = _authorized(request)
    body = await read_json(request, settings.max_body_bytes)
    lease = await leased(request, body)
    try:
        job = anthropic.parse_messages(body, lease.model, count=True)
        n = await asyncio.to_thread(lease.engine.count_tokens, job.request)
    except ValueError as e:
        raise invalid(None, str(e)) from None
    finally:
        lease.release()
    return JSONResponse({"input_tokens": n})


async def list_models(request: HTTPRequest) -> Response:
    """GET /v1/models: every model there is, with whether it is loaded (`loaded`, an extension)."""
    _authorized(request)
    return JSONResponse({"object": "list", "data": [_model_card(item) for item in request.app.state.models.listing()]})


async def get_model(request: HTTPRequest) -> Response:
    _authorized(request)
    name = request.path_params["model"]
    for item in request.app.state.models.listing():
        if ollama.same_model(name, item.card.name) or any(ollama.same_model(name, a) for a in item.aliases):
            return JSONResponse(_model_card(item))
    raise model_error(request, name, NotFound(name))


async def put_drafter(request: HTTPRequest) -> Response:
    """POST /v1/drafter {"drafter": DIR}: serve another MTP drafter of the start model's target (an
    adapted one, `mlx_mtp.learn`) from the next request on; the running ones finish on the old. The
    server's own machine only (loopback), with the key when the server has one."""
    settings = _authorized(request)
    if request.client is None or request.client.host not in LOOPBACK:
        raise APIError(403, "POST /v1/drafter is taken from the server's own machine only", type="permission_error",
                       code="forbidden")
    body = await read_json(request, settings.max_body_bytes)
    path = body.get("drafter") if isinstance(body, dict) else None
    if not isinstance(path, str) or not path:
        raise invalid("drafter", "the body must be {\"drafter\": \"<directory of an MTP drafter>\"}")
    engines = request.app.state.models.engines()
    if not engines:
        raise APIError(409, f"`{settings.model.id}` is not loaded: send it a request first", code="not_loaded")
    swap = engines[0].swap_drafter(path)
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(swap)), SWAP_WAIT)
    except (OSError, ValueError) as e:
        raise invalid("drafter", str(e).splitlines()[0]) from None
    except asyncio.TimeoutError:  # still waiting for running requests: it goes into service after them
        return JSONResponse({"drafter": path, "in_service": False})
    return JSONResponse({"drafter": path, "in_service": True})


async def health(request: HTTPRequest) -> Response:
    ok = all(engine.running for engine in request.app.state.models.engines())
    return JSONResponse({"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503)


async def metrics(request: HTTPRequest) -> Response:
    """The start model's engine's counters (zero while it is not loaded), and the pool's gauges."""
    models = request.app.state.models
    engines = models.engines()
    text = render_metrics(engines[0].metrics() if engines else {}, models.gauges())
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


async def ollama_root(request: HTTPRequest) -> Response:
    return PlainTextResponse("Ollama is running")


async def ollama_chat(request: HTTPRequest) -> Response:
    return await _ollama(request, ollama.parse_chat, generate=False)


async def ollama_generate(request: HTTPRequest) -> Response:
    return await _ollama(request, ollama.parse_generate, generate=True)


async def _ollama(request: HTTPRequest, parse, generate: bool) -> Response:
    """A chat or generate request; one with nothing to generate loads its model, or with
    keep_alive 0 unloads it (without loading it first)."""
    settings = _authorized(request)
    body = await read_json(request, settings.max_body_bytes)
    if ollama.unloads(body, generate):
        name = ollama.named(body)
        try:
            request.app.state.models.unload(name)
        except NotFound as e:
            raise model_error(request, name, e) from None
        return JSONResponse(ollama.unloaded(name, generate))

    def parsed(lease: Lease):
        job = parse(body, lease.model)
        return dataclasses.replace(job, load_ns=lease.load_ns, started=lease.started_ns)

    return await serve(request, body, parsed, OLLAMA, context=ollama.num_ctx(body))


async def ollama_tags(request: HTTPRequest) -> Response:
    _authorized(request)
    return JSONResponse(ollama.tags([item.card for item in request.app.state.models.listing()]))


async def ollama_show(request: HTTPRequest) -> Response:
    settings = _authorized(request)
    body = await read_json(request, settings.max_body_bytes)
    name = ollama.named(body)
    try:
        card = request.app.state.models.show(name)
    except NotFound as e:
        raise model_error(request, name, e) from None
    return JSONResponse(ollama.show(card))


async def ollama_ps(request: HTTPRequest) -> Response:
    _authorized(request)
    return JSONResponse(ollama.ps(request.app.state.models.listing(loaded_only=True)))


async def ollama_version(request: HTTPRequest) -> Response:
    return JSONResponse(ollama.version())


async def ollama_pull(request: HTTPRequest) -> Response:
    """POST /api/pull {"model", "stream"}: the model and its drafter from the Hub, its progress as
    NDJSON (Ollama's lines); a pull the client leaves goes on to the end."""
    settings = _authorized(request)
    body = await read_json(request, settings.max_body_bytes)
    name, store = ollama.named(body), request.app.state.models.store
    if store is None:
        raise ollama.no_store(request.url.path)
    events: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    pulling = in_thread(store.pull, name, lambda event: loop.call_soon_threadsafe(events.put_nowait, event.json()))
    pulling.add_done_callback(lambda _: events.put_nowait(None))
    if not flag(body, "stream", True):
        try:
            await asyncio.shield(pulling)
        except StoreError as e:
            raise model_error(request, name, e) from None
        return JSONResponse({"status": "success"})

    async def lines() -> AsyncIterator[str]:
        while (line := await events.get()) is not None:
            yield json.dumps(line) + "\n"
        if pulling.exception() is not None:
            yield json.dumps(ollama.error_body(model_error(request, name, pulling.exception()))) + "\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


async def ollama_delete(request: HTTPRequest) -> Response:
    """DELETE /api/delete {"model"}: the model's files (its drafter with its last model); a loaded one
    finishes its requests and is unloaded."""
    settings = _authorized(request)
    body = await read_json(request, settings.max_body_bytes)
    name, models = ollama.named(body), request.app.state.models
    if models.store is None:
        raise ollama.no_store(request.url.path)
    try:
        await asyncio.to_thread(models.delete, name)
    except StoreError as e:
        raise model_error(request, name, e) from None
    return Response(status_code=200)


def _model_card(item) -> dict:
    """A model in OpenAI's listing, with this server's `loaded`, `aliases` and `max_model_len` (vLLM's)."""
    created = int(datetime.datetime.fromisoformat(item.card.modified_at.replace("Z", "+00:00")).timestamp())
    return {"id": item.card.name, "object": "model", "created": created, "owned_by": "mlx_mtp",
            "max_model_len": item.card.context, "loaded": item.loaded, "aliases": list(item.aliases)}


# ---- request plumbing --------------------------------------------------------------------------


def _authorized(request: HTTPRequest) -> Settings:
    """The settings, once the key (when the server has one) checks out: `Authorization: Bearer`
    (OpenAI's clients) or `x-api-key` (Anthropic's); either one right is enough."""
    settings = request.app.state.settings
    if settings.api_key is not None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = [token.strip() if scheme.lower() == "bearer" else "", request.headers.get("x-api-key", "")]
        if not any([hmac.compare_digest(g.encode(), settings.api_key.encode()) for g in given]):
            raise APIError(401, "missing or wrong API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return settings


async def read_json(request: HTTPRequest, limit: int):
    """The body as JSON, refused (413) as soon as it is known to pass `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise _too_large(limit)
    try:
        value = json.loads(body)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
        raise invalid(None, f"the body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # deeper than Python's own parser goes
        raise _too_deep() from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise _too_deep()
    return value


def _too_deep() -> APIError:
    return invalid(None, f"the body is nested more than {MAX_JSON_DEPTH} levels deep", code="invalid_json")


def _depth(value) -> int:
    """How deeply JSON containers nest in `value` (without recursion)."""
    deepest, level = 0, [(value, 1)]
    while level:
        item, d = level.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, d)
            level.extend((v, d + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


def _learns(request: HTTPRequest) -> bool:
    """Whether the request may be kept for adapting the drafter (`X-MLX-MTP-Learn: off` opts out)."""
    return request.headers.get("x-mlx-mtp-learn", "").strip().lower() not in ("off", "0", "false", "no")


async def serve(request: HTTPRequest, body, parse: Callable, wire: Wire, context: Optional[int] = None) -> Response:
    """Lease the model the body names, parse the body for it (`parse(lease)`: the lease's
    `model` is what the parsers read) and answer it; the lease goes back when the answer is done.
    An Ollama request with nothing to generate only loaded the model."""
    lease = await leased(request, body, context)
    try:
        job = parse(lease)
        if job.request is None:
            lease.release()
            return JSONResponse(ollama.loaded(job))
    except BaseException:
        lease.release()
        raise
    return await run(request, job, wire, lease)


async def leased(request: HTTPRequest, body, context: Optional[int] = None) -> Lease:
    """The model the body names (`model`; Ollama's clients may say `name`), loaded and held, with
    the body's `keep_alive` (every API's: the pool's meaning, Ollama's)."""
    name = body.get("model") or body.get("name") if isinstance(body, dict) else None
    if name is not None and not isinstance(name, str):
        raise invalid("model", "model must be a string")
    ttl, models = keep_alive(body), request.app.state.models
    if not name and not models.has_default:
        raise invalid("model", "model is required: this server serves the models of its store (GET /v1/models "
                               "lists them)")
    try:
        return await models.lease(name or None, context, ttl)
    except (NotFound, PoolFull, StoreError) as e:
        raise model_error(request, name, e) from None
    except Exception as e:  # its load failed: a corrupt shard, a mismatched drafter
        from ..cli import error_line

        log.error("loading %s failed", name, exc_info=e)
        raise APIError(500, f"could not load model '{name}': {error_line(e)}", code="load_failed") from None


def model_error(request: HTTPRequest, name, error: Exception) -> APIError:
    """A model that is not there, does not fit, or could not be pulled or deleted, in the called API's
    words."""
    on_ollama = request.url.path.startswith("/api/")
    if isinstance(error, NotOnHub) and "/api/pull" not in request.url.path:  # --allow-pull: neither here nor there
        error = NotFound(name, why=str(error))
    if isinstance(error, NotFound):
        if on_ollama:
            return ollama.not_found(name)
        why = f" ({error.why})" if error.why else ""
        near = f"; near: {', '.join(error.near)}" if error.near else "; GET /v1/models lists them"
        return APIError(404, f"the model `{name}` does not exist on this server{why}{near}", param="model",
                        code="model_not_found")
    if isinstance(error, PoolFull):  # Ollama answers 500 for a model that needs more memory than is free
        return APIError(500 if on_ollama else 507, f"model '{name}' does not fit in memory: {error}",
                        code="insufficient_memory")
    if isinstance(error, PullError):  # the Hub's failure, or a checkpoint it serves that cannot be used
        return APIError(502, f"pulling '{name}' failed: {error}", code="pull_failed")
    return invalid("model", str(error))


async def run(request: HTTPRequest, job, wire: Wire, lease: Lease) -> Response:
    """Submit the job and answer it: `wire.answer(job, parts, outcome)` makes the whole reply,
    `wire.stream(job, parts, outcome)` its server-sent events. A prompt that does not fit is
    refused by `submit`, and what the engine refuses at once is awaited (`OPEN_AFTER`) before
    any header is sent: both get a real HTTP error. `lease` goes back once the answer is done."""
    engine = lease.engine
    if not _learns(request):
        job = dataclasses.replace(job, request=dataclasses.replace(job.request, learn=False))
    try:  # off the event loop: submitting renders the prompt
        handle = await asyncio.to_thread(engine.submit, job.request)
    except BaseException as e:
        lease.release()
        raise _refused(e, job, wire) from None
    events = EventStream(handle)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, events))
    handed_over = False
    try:
        first = await events.peek(OPEN_AFTER if job.stream else None)
        if first is not None and first.kind == "error":
            raise engine_error(first.error, job, wire)
        outcome = Outcome(prompt_tokens=handle.prompt_tokens or 0, handle=handle,
                          logprobs=[] if job.request.logprobs is not None else None)
        if job.stream:
            handed_over = True
            parts = pieces(job, events, outcome, wire, request.app.state.settings.keepalive)
            frames = _streamed(wire.stream(job, parts, outcome), events, watcher, lease)
            return StreamingResponse(frames, media_type=wire.media_type,
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        parts = [part async for part in pieces(job, events, outcome, wire)]
        return JSONResponse(wire.answer(job, parts, outcome))
    finally:
        if not handed_over:
            watcher.cancel()
            events.close()
            lease.release()


def _refused(e: BaseException, job, wire: Wire) -> BaseException:
    """What `submit` raised, as the HTTP error it is."""
    if isinstance(e, QueueFull):
        return APIError(429, f"the server is busy ({e}); retry shortly", type="rate_limit_error",
                        code="rate_limit_exceeded", headers={"Retry-After": "1"})
    if isinstance(e, ContextLengthError):
        return wire.context_error(e, job)
    if isinstance(e, ValueError):
        return invalid(None, str(e))
    return e


async def _cancel_on_disconnect(request: HTTPRequest, events: "EventStream") -> None:
    """A client that goes away (while queued, or mid-answer) cancels its request. Streams need
    this too: Starlette stops writing when the client leaves, but a generator suspended at a
    `yield` is only closed (and its `finally` run) whenever it is garbage-collected."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    events.close()


class EventStream:
    """A handle's events, awaited on the event loop.

    A reader thread blocks on the handle and passes each event to the loop. It is a thread of
    its own, not the default executor's: a request can wait minutes in the queue, and a few such
    waits would take the executor's whole (small) pool.
    """

    def __init__(self, handle: RequestHandle):
        self.handle = handle
        self.finished = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._peeked = None
        loop = asyncio.get_running_loop()
        name = f"mlx_mtp-server-{handle.id}"
        threading.Thread(target=self._read, args=(loop,), name=name, daemon=True).start()

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        for event in self.handle:
            try:
                loop.call_soon_threadsafe(self._queue.put_nowait, event)
            except RuntimeError:  # the loop has closed (server shutdown): nobody is listening
                self.handle.cancel()

    async def peek(self, timeout: Optional[float] = None):
        """The next event, left to `next`; None when none came within `timeout` seconds."""
        if self._peeked is None:
            try:
                self._peeked = await asyncio.wait_for(self._queue.get(), timeout)
            except asyncio.TimeoutError:
                return None
        return self._peeked

    async def next(self, timeout: Optional[float] = None):
        """The next event; None when none came within `timeout` seconds."""
        event = await self.peek(timeout)
        if event is not None:
            self._peeked = None
            self.finished = event.kind != "token"
        return event

    def close(self) -> None:
        """Cancel the request unless it has already ended."""
        if not self.finished:
            self.handle.cancel()


async def pieces(job, events: EventStream, outcome: Outcome, wire: Wire,
                 keepalive: Optional[float] = None) -> AsyncIterator[Delta]:
    """The reply piece by piece (`chat_format.Delta`s: content, reasoning, tool calls), as the
    engine streamed them (cut at a stop string, one tool call where parallel calls are off);
    `KEEPALIVE` after each `keepalive` seconds with nothing to send.

    `outcome.completion_tokens` counts the tokens streamed (the one completing a stop string
    included); `outcome.stats` is the engine's account.
    """
    while True:
        event = await events.next(keepalive)
        if event is None:
            yield KEEPALIVE
            continue
        if event.kind != "token":
            break
        outcome.completion_tokens += 1
        if outcome.logprobs is not None and event.logprob is not None:
            outcome.logprobs.append(event.logprob)
        for part in event.parts:
            outcome.tool_calls += part.kind == "tool_call"
            yield part
    if event.kind == "error":
        if not (isinstance(event.error, ContextLengthError) and outcome.completion_tokens):
            raise engine_error(event.error, job, wire)
        outcome.finish_reason = "length"  # the answer reached the end of the model's context
    else:
        outcome.finish_reason, outcome.stop_sequence = event.finish_reason, event.stop_sequence
        outcome.stats = event.stats


async def _streamed(frames: AsyncIterator[str], events: EventStream, watcher: asyncio.Task,
                    lease: Lease) -> AsyncIterator[str]:
    try:
        async for frame in frames:
            yield frame
    finally:
        watcher.cancel()
        events.close()
        lease.release()


# ---- errors ------------------------------------------------------------------------------------


def engine_error(error: BaseException, job, wire: Wire) -> APIError:
    """The HTTP face of an error the engine reported for a request."""
    if isinstance(error, ContextLengthError):
        return wire.context_error(error, job)
    if isinstance(error, ValueError):
        return invalid(None, str(error))
    log.error("request failed in the engine", exc_info=error)
    return APIError(500, f"the engine failed: {type(error).__name__}: {error}")


async def api_error(request: HTTPRequest, exc: APIError) -> Response:
    """The error in the shape of the API that was called."""
    path = request.url.path
    body = anthropic.error_body(exc) if path.startswith("/v1/messages") else \
        ollama.error_body(exc) if path.startswith("/api/") or path == "/" else exc.body()
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


async def http_error(request: HTTPRequest, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return await api_error(request, APIError(exc.status_code, message, code=code, headers=exc.headers))


async def server_error(request: HTTPRequest, exc: Exception) -> Response:
    log.error("unexpected error", exc_info=exc)
    return await api_error(request, APIError(500, f"internal error: {type(exc).__name__}"))
