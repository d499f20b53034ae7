"""The HTTP side: a Starlette app that hands every OpenAI request to the Engine.

No MLX call runs here; the Engine's worker thread owns them all. A handle's events arrive on
a blocking queue, so each request gets a reader thread that passes them to the event loop
(`EventStream`). Whatever way a request ends early (a stop string, a client that went away,
an error), its handle is cancelled, which frees its engine row within one round.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import threading
import time
from typing import AsyncIterator, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine import Engine, QueueFull, RequestHandle
from ..generate import ContextLengthError
from . import protocol
from .metrics import render as render_metrics
from .protocol import APIError, Job, ServedModel, invalid

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class Settings:
    model: ServedModel
    api_key: Optional[str] = None
    max_body_bytes: int = MAX_BODY_BYTES
    started: int = dataclasses.field(default_factory=lambda: int(time.time()))


def create_app(engine: Engine, settings: Settings) -> Starlette:
    """The OpenAI-compatible app serving `engine` (which the caller starts and closes)."""
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    handlers = {APIError: api_error, HTTPException: http_error, Exception: server_error}
    app = Starlette(routes=routes, exception_handlers=handlers)
    app.state.engine, app.state.settings = engine, settings
    return app


def served_model(loaded, model_id: str, draft_tokens="auto") -> ServedModel:
    config = loaded.target.config
    return ServedModel(model_id, config.max_position_embeddings, config.vocab_size, draft_tokens)


# ---- endpoints ---------------------------------------------------------------------------------


async def chat_completions(request: HTTPRequest) -> Response:
    settings = _authorized(request)
    job = protocol.parse_chat(await read_json(request, settings.max_body_bytes), settings.model)
    return await run(request, job)


async def completions(request: HTTPRequest) -> Response:
    settings = _authorized(request)
    job = protocol.parse_completion(await read_json(request, settings.max_body_bytes), settings.model)
    return await run(request, job)


async def list_models(request: HTTPRequest) -> Response:
    settings = _authorized(request)
    return JSONResponse({"object": "list", "data": [_model_card(settings)]})


async def get_model(request: HTTPRequest) -> Response:
    settings = _authorized(request)
    protocol.check_model(request.path_params["model"], settings.model)
    return JSONResponse(_model_card(settings))


async def health(request: HTTPRequest) -> Response:
    ok = request.app.state.engine.running
    return JSONResponse({"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503)


async def metrics(request: HTTPRequest) -> Response:
    text = render_metrics(request.app.state.engine.metrics())
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def _model_card(settings: Settings) -> dict:
    return {"id": settings.model.id, "object": "model", "created": settings.started, "owned_by": "mlx_mtp",
            "max_model_len": settings.model.context}


# ---- request plumbing --------------------------------------------------------------------------


def _authorized(request: HTTPRequest) -> Settings:
    """The settings, once the Bearer key (when the server has one) checks out."""
    settings = request.app.state.settings
    if settings.api_key is not None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, settings.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send `Authorization: Bearer <key>`",
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
        return json.loads(body)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
        raise invalid(None, f"the body is not valid JSON: {e}", code="invalid_json") from None


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


async def run(request: HTTPRequest, job: Job) -> Response:
    """Submit the job and answer it. The first event is awaited before any header is sent, so
    a request the engine refuses (an over-long prompt, say) gets a real HTTP error."""
    engine = request.app.state.engine
    try:
        handle = engine.submit(job.request)
    except QueueFull as e:
        raise APIError(429, f"the server is busy ({e}); retry shortly", type="rate_limit_error",
                       code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
    except ValueError as e:
        raise invalid(None, str(e)) from None
    events = EventStream(handle)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, events))
    handed_over = False
    try:
        first = await events.peek()
        if first.kind == "error":
            raise engine_error(first.error, job)
        if job.stream:
            handed_over = True
            return StreamingResponse(_sse(job, events, watcher), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        outcome = Outcome()
        text = "".join([piece async for piece in deltas(job, events, outcome)])
        answer = protocol.response(job, text, outcome.finish_reason, outcome.usage, outcome.timings)
        return JSONResponse(answer)
    finally:
        if not handed_over:
            watcher.cancel()
            events.close()


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

    async def peek(self):
        if self._peeked is None:
            self._peeked = await self._queue.get()
        return self._peeked

    async def next(self):
        event = await self.peek()
        self._peeked = None
        self.finished = event.kind != "token"
        return event

    def close(self) -> None:
        """Cancel the request unless it has already ended."""
        if not self.finished:
            self.handle.cancel()


@dataclasses.dataclass
class Outcome:
    """How a request ended, filled in by `deltas`."""

    finish_reason: Optional[str] = None
    usage: Optional[dict] = None
    timings: Optional[dict] = None


async def deltas(job: Job, events: EventStream, outcome: Outcome) -> AsyncIterator[str]:
    """The text to send, piece by piece, cut at the first stop string.

    `usage` counts the tokens whose text was read (the one completing a stop string included);
    `timings` is the engine's account, which after a stop may include the rest of its round.
    """
    matcher, n_tokens = protocol.StopMatcher(job.stop), 0
    while True:
        event = await events.next()
        if event.kind == "token":
            n_tokens += 1
            text = matcher.feed(event.text)
            if text:
                yield text
            if matcher.hit:
                events.close()
                while (event := await events.next()).kind == "token":
                    pass
                finish = "stop"
                break
            continue
        if event.kind == "error":
            if not (isinstance(event.error, ContextLengthError) and n_tokens):
                raise engine_error(event.error, job)
            finish = "length"  # the answer reached the end of the model's context
        else:
            finish = event.finish_reason
        if rest := matcher.flush():
            yield rest
        break
    stats = event.stats if event.kind == "done" else None
    outcome.finish_reason = finish
    outcome.usage = protocol.usage(stats, n_tokens)
    outcome.timings = protocol.timings(stats) if stats else None


async def _sse(job: Job, events: EventStream, watcher: asyncio.Task) -> AsyncIterator[str]:
    """Server-sent events as OpenAI streams them, ending with `data: [DONE]`."""
    try:
        if job.chat:
            yield _frame(protocol.chunk(job, first=True))
        outcome = Outcome()
        try:
            async for text in deltas(job, events, outcome):
                yield _frame(protocol.chunk(job, text))
            yield _frame(protocol.chunk(job, finish_reason=outcome.finish_reason, timings=outcome.timings))
            if job.include_usage:
                yield _frame(protocol.usage_chunk(job, outcome.usage))
        except APIError as e:  # the headers are out: the error travels in the stream
            yield _frame(e.body())
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        events.close()


def _frame(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


# ---- errors ------------------------------------------------------------------------------------


def engine_error(error: BaseException, job: Job) -> APIError:
    """The HTTP face of an error the engine reported for a request."""
    if isinstance(error, ContextLengthError):
        param = "messages" if job.chat else "prompt"
        return APIError(400, str(error), param=param, code="context_length_exceeded")
    if isinstance(error, ValueError):
        return invalid(None, str(error))
    log.error("request failed in the engine", exc_info=error)
    return APIError(500, f"the engine failed: {type(error).__name__}: {error}")


async def api_error(request: HTTPRequest, exc: APIError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def http_error(request: HTTPRequest, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return await api_error(request, APIError(exc.status_code, message, code=code, headers=exc.headers))


async def server_error(request: HTTPRequest, exc: Exception) -> Response:
    log.error("unexpected error", exc_info=exc)
    return await api_error(request, APIError(500, f"internal error: {type(exc).__name__}"))
