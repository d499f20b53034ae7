"""`python -m mlx_mtp.server` / `mlx-mtp-server`: load a model, start the Engine, serve HTTP."""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import socket
import stat
import sys
import threading
import time

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
DEMO_ID = "mlx-mtp-demo"
PARENT_POLL = 0.5  # seconds between two checks that --parent-pid is alive


def parser() -> argparse.ArgumentParser:
    """The command line; every option says what it does and its default."""
    from ..cli import draft_tokens, positive_int
    from ..formats.chat import HISTORIES
    from .app import KEEPALIVE_EVERY, MAX_BODY_BYTES

    ap = argparse.ArgumentParser(prog="mlx-mtp-server", description="An OpenAI- and Anthropic-compatible server "
                                 "for Gemma 4 with MTP speculative decoding (chat, text completions and messages, "
                                 "tool calls and thinking, SSE streaming).")
    ap.add_argument("--model", help="target model dir, hub id, or a name in the model store (`gemma4:e2b`: its "
                                    "drafter too; mlx-mtp models lists them) (default: the bundled demo pair)")
    ap.add_argument("--drafter", help="MTP drafter dir or hub id (default: none, plain decoding; the demo's "
                    "own drafter for the demo pair)")
    ap.add_argument("--served-model-name",
                    help=f"the id clients send as `model` (default: --model, or {DEMO_ID!r})")
    ap.add_argument("--host", help="address to bind (default: 127.0.0.1, this machine only)")
    ap.add_argument("--port", type=int, help="port to listen on; 0: a free one, named by the ready line "
                    "(default: 8000)")
    embed = ap.add_argument_group("for an app that embeds the server (README: 'Serve')",
                                  "Once it accepts connections, the server prints one JSON line on stdout: "
                                  '{"event": "ready", "url": ..., "port": ..., "model": ..., "pid": ...}.')
    embed.add_argument("--uds", metavar="PATH", help="serve on this Unix socket instead of TCP (then the ready "
                       "line has `uds`, not `url` and `port`; no --host or --port with it; default: none, TCP)")
    embed.add_argument("--parent-pid", type=int, metavar="PID", help="shut down, with exit status 0, once the "
                       f"process PID is gone (checked every {PARENT_POLL:g} s; default: none, not watched)")
    embed.add_argument("--exit-on-stdin-close", action="store_true",
                       help="shut down, with exit status 0, once standard input closes (default: off)")
    store = ap.add_argument_group("many models (README: 'Many models, one server')",
                                  "Each request's `model` picks a model: the one --model names (loaded at start, "
                                  "pinned) or any in the model store, loaded when first asked for, within a memory "
                                  "budget; idle ones are evicted, least recently used first, to make room.")
    store.add_argument("--store-only", action="store_true",
                       help="serve the store's models only: nothing loads at start, and each request names its "
                            "model (default: off: --model, or the demo pair, is loaded at start and pinned)")
    store.add_argument("--models-dir", metavar="DIR", help="the model store (default: $MLX_MTP_MODELS, else "
                       "~/.cache/mlx_mtp/models; the Hugging Face cache is listed too)")
    store.add_argument("--memory-gb", type=float, metavar="GB", help="what all loaded models may reserve together: "
                       "weights, KV cache and prefix cache (default: what the device should use, less an eighth)")
    store.add_argument("--keep-alive", default="5m", metavar="DURATION",
                       help="how long a model stays loaded after its last request, for requests that do not send "
                            "`keep_alive`: seconds or a duration (\"10m\", \"1h\"), 0 to unload at once, negative "
                            "to keep (default: 5m, as Ollama)")
    store.add_argument("--pin", action="append", default=[], metavar="NAME",
                       help="keep this model loaded once loaded: never evicted, never expired (repeatable; the "
                            "--model one is pinned already; default: none)")
    store.add_argument("--num-ctx", type=positive_int, default=4096, metavar="N",
                       help="tokens per row a store model's KV cache is reserved for when a request does not ask "
                            "(Ollama's `options.num_ctx`); also its replies' default longest (default: 4096)")
    store.add_argument("--load-wait", type=float, default=300.0, metavar="S",
                       help="how long a request waits for models in use to finish when only they stand in the way "
                            "of loading its model; then, or for a model that would never fit, a clear error "
                            "(default: 300; 0: the error at once)")
    store.add_argument("--allow-pull", action="store_true",
                       help="pull a model the store lacks from the Hub when a request names it (default: off: "
                            "404, pull with /api/pull or mlx-mtp pull)")
    ap.add_argument("--max-batch", type=int, default=8, help="requests generating at once (default: 8)")
    ap.add_argument("--max-queue", type=int, default=64,
                    help="requests waiting; more are answered 429 (default: 64)")
    ap.add_argument("--prefill-tokens", type=positive_int, metavar="N",
                    help="prompt tokens of all queued requests prefilled together in one forward per round "
                         "(default: one 512-token chunk; 1: one prompt at a time)")
    ap.add_argument("--api-key", help="require the key on /v1/ endpoints (`Authorization: Bearer KEY` or "
                    "`x-api-key: KEY`; default: none, no key asked)")
    ap.add_argument("--draft-tokens", type=draft_tokens, default="auto", metavar="N|auto",
                    help="draft length for requests that do not send `draft_tokens`: 0-6, or auto, chosen by "
                         "measured cost and acceptance (default: auto)")
    ap.add_argument("--enable-thinking", action="store_true",
                    help="let the model reason before answering, for OpenAI requests that do not say "
                         "(`chat_template_kwargs.enable_thinking`; Anthropic's requests say with `thinking`, "
                         "and are off without it; default: off)")
    ap.add_argument("--history", choices=HISTORIES, default="generated",
                    help="how earlier replies render, for requests that do not say (`history`): as the model "
                         "generated them (prefix-cache friendly), or exactly as the chat template renders them "
                         "(apply_chat_template's tokens; default: generated)")
    ap.add_argument("--keep-thinking", action="store_true",
                    help="keep earlier replies' reasoning in later prompts, for requests that do not say "
                         "(`keep_thinking`; default: left out once the model's turn ended and a user message came)")
    ap.add_argument("--parse-control-tokens", action="store_true",
                    help="parse control tokens spelled in messages, as apply_chat_template does by default "
                         "(default: off: any text in a message is text, and only the template makes control tokens)")
    ap.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                    help=f"larger request bodies get 413 (default: {MAX_BODY_BYTES})")
    ap.add_argument("--keepalive-seconds", type=float, default=KEEPALIVE_EVERY, metavar="S",
                    help="a stream with nothing to send (a long prefill) sends a keep-alive every S seconds: "
                         f"Anthropic's ping event, an SSE comment on OpenAI's (default: {KEEPALIVE_EVERY:g})")
    cache = ap.add_mutually_exclusive_group()
    cache.add_argument("--prompt-cache-bytes", type=int, metavar="N",
                       help="prefix cache budget in bytes: a request prefills only what no earlier one "
                            "computed (default: a quarter of the memory the weights leave; 0: off)")
    cache.add_argument("--prompt-cache-gb", type=float, metavar="GB", help="the same, in GiB (default: as above)")
    ap.add_argument("--prompt-cache-dir", metavar="DIR", help="keep the prefix cache's states in DIR too: they "
                    "outlive the server and its memory budget, and the next server on DIR starts from them "
                    "(default: none, memory only)")
    ap.add_argument("--prompt-cache-disk-gb", type=float, metavar="GB",
                    help="how much DIR may hold, least recently used states out first (default: 16)")
    learn = ap.add_argument_group("learning from use (python -m mlx_mtp.learn; README: 'A drafter that learns')")
    learn.add_argument("--learn-dir", metavar="DIR", help="keep each finished request's token ids and the drafter's "
                                                           "counts in DIR (nothing is kept without it; a request "
                                                           "opts out with the header `X-MLX-MTP-Learn: off`; "
                                                           "default: none)")
    learn.add_argument("--learn-gb", type=float, metavar="GB", help="--learn-dir's budget, oldest requests out first "
                       "(default: none, unbounded)")
    learn.add_argument("--learn-every", type=positive_int, metavar="N",
                       help="adapt the drafter after N new requests, while the server is idle, and serve the "
                            "adapted one if it is better (the drafter must be unquantized; default: never, "
                            "adapt with python -m mlx_mtp.learn)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="compute dtype (default: the checkpoint's; float32 for the demo pair)")
    ap.add_argument("--allow-image-urls", action="store_true",
                    help="fetch http(s) image URLs in requests (default: off, images come as base64 data only)")
    ap.add_argument("--load-vision", action="store_true",
                    help="read the vision tower at start (default: with the first image; text-only use never reads it)")
    ap.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                    help="uvicorn's log level (default: info)")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser()
    args = ap.parse_args(argv)
    if args.uds is not None and (args.host is not None or args.port is not None):
        ap.exit(2, f"{ap.prog}: error: --uds serves on a Unix socket: it takes no --host or --port\n")
    args.host = "127.0.0.1" if args.host is None else args.host
    args.port = 8000 if args.port is None else args.port
    if args.prompt_cache_gb is not None:
        args.prompt_cache_bytes = int(args.prompt_cache_gb * 2**30)
    if args.prompt_cache_bytes is not None and args.prompt_cache_bytes < 0:
        ap.error("the prompt cache budget must be >= 0 (0 turns it off)")
    if not args.keepalive_seconds > 0:
        ap.error("--keepalive-seconds must be > 0")
    if args.prompt_cache_disk_gb is not None and (args.prompt_cache_disk_gb <= 0 or args.prompt_cache_dir is None):
        ap.error("--prompt-cache-disk-gb takes a size > 0, with --prompt-cache-dir")
    if (args.learn_gb is not None or args.learn_every is not None) and args.learn_dir is None:
        ap.error("--learn-gb and --learn-every go with --learn-dir")
    if args.store_only and (args.model or args.drafter or args.served_model_name or args.learn_dir):
        ap.error("--store-only serves the store's models: it takes no --model, --drafter, --served-model-name "
                 "or --learn-dir")
    if args.load_wait < 0:
        ap.error("--load-wait must be >= 0")
    if args.memory_gb is not None and not args.memory_gb > 0:
        ap.error("--memory-gb must be > 0")
    from ..engine.pool import keep_alive_seconds

    try:
        keep_alive_seconds(args.keep_alive)
    except ValueError as e:
        ap.error(f"--keep-alive: {e}")
    return args


def load_model(args):
    """The model to serve and the id clients name it by (and, on `args`, the drafter's path)."""
    import mlx.core as mx

    from ..cli import demo_pair
    from ..loading import load

    model, drafter, dtype, name = args.model, args.drafter, args.dtype, args.model
    if model is None:
        model, demo_drafter = demo_pair()
        drafter, dtype, name = drafter or demo_drafter, dtype or "float32", DEMO_ID
    else:
        from .. import store

        args.store_entry = _stored(model, getattr(args, "models_dir", None))
        # a store name (gemma4:e2b) is its pair's directories
        model, drafter = store.named(model, drafter, store.Store(getattr(args, "models_dir", None)))
    loaded = load(model, drafter, dtype=getattr(mx, dtype) if dtype else None,
                  load_vision=getattr(args, "load_vision", False))
    from ..formats import vision

    images = vision.encoder(loaded)
    if images is not None:
        images.fetch_urls = getattr(args, "allow_image_urls", False)
    if loaded.tokenizer is None:
        raise ValueError(f"{model} has no tokenizer: the server needs one")
    args.drafter_dir = drafter if drafter not in (None, "ngram") else None
    return loaded, args.served_model_name or str(name)


def _stored(model: str, models_dir):
    """The store's entry `model` names, where it names one (the server then serves it under both names)."""
    from pathlib import Path

    from ..store import NotFound, Store

    if Path(model).expanduser().exists():
        return None
    try:
        return Store(models_dir).resolve(model)
    except NotFound:
        return None


def main(argv=None) -> int:
    from ..cli import error_line

    args = parse_args(argv)
    if args.host not in LOCAL_HOSTS:
        print(f"warning: serving on {args.host}, reachable from other machines"
              + ("" if args.api_key else "; consider --api-key"), file=sys.stderr)
    try:
        claim_socket(args.uds)
        if args.parent_pid is not None and not alive(args.parent_pid):
            raise ValueError(f"--parent-pid {args.parent_pid}: no such process")
        loaded, model_id = (None, None) if args.store_only else load_model(args)
    except Exception as e:  # bad path, wrong pair, unreadable checkpoint: one line, no traceback
        print(error_line(e), file=sys.stderr)
        return 2
    return serve(loaded, model_id, args)


def where(args) -> str:
    if args.uds is not None:
        return f"on the Unix socket {args.uds}"
    if args.port == 0:
        return f"at http://{args.host} on a free port (the ready line on stdout names it)"
    return f"at http://{args.host}:{args.port}/v1"


def start_lines(model_id: str, args, context: int, mtp: bool, prompt_cache_bytes: int) -> list[str]:
    """What the server says as it starts: where it serves, the draft policy, the prompt cache's
    tiers, and whether requests are being kept (--learn-dir)."""
    from ..runtime.memory import size
    from ..cache.disk import DEFAULT_BUDGET

    if not mtp:
        policy = "MTP off (no drafter: plain decoding)"
    elif args.drafter == "ngram":
        policy = f"prompt lookup (ngram), draft tokens {args.draft_tokens}"
    else:
        policy = f"MTP on, draft tokens {args.draft_tokens}" + (
            " (chosen by measured cost and acceptance)" if args.draft_tokens == "auto" else "")
    lines = [f"serving {model_id!r} {where(args)} ({policy}; context {context} tokens)"]
    tiers = [f"{size(prompt_cache_bytes)} in memory"] if prompt_cache_bytes else ["off in memory"]
    if args.prompt_cache_dir is not None:
        disk = DEFAULT_BUDGET / 2**30 if args.prompt_cache_disk_gb is None else args.prompt_cache_disk_gb
        tiers.append(f"{disk:g} GiB on disk in {args.prompt_cache_dir}")
    lines.append("prompt cache: " + ", ".join(tiers))
    if args.learn_dir is not None:
        budget = "no budget" if args.learn_gb is None else f"within {args.learn_gb:g} GiB, oldest out first"
        every = (f"; the drafter adapts every {args.learn_every} new requests while idle" if args.learn_every
                 else "; python -m mlx_mtp.learn adapts the drafter on them")
        lines.append(f"keeping each finished request's token ids in {args.learn_dir} ({budget}; a request opts "
                     f"out with `X-MLX-MTP-Learn: off`){every}")
    return lines


def serve(loaded, model_id: str, args) -> int:
    """Serve a loaded model as `model_id`, and the store's models beside it, until interrupted."""
    import uvicorn

    from ..runtime import jit
    from ..cli import error_line
    from ..engine.pool import PoolFull
    from .app import Settings, create_app, served_model
    from .common import ServedModel

    if loaded is None:  # --store-only: only the request defaults
        model = ServedModel("", 0, 0, args.draft_tokens, args.enable_thinking, True, args.history, args.keep_thinking,
                            args.parse_control_tokens)
    else:
        model = served_model(loaded, model_id, args.draft_tokens, args.enable_thinking, args.history,
                             args.keep_thinking, args.parse_control_tokens)
    settings = Settings(model, args.api_key, args.max_body_bytes, args.keepalive_seconds)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again: let SIGTERM
    # also become KeyboardInterrupt, so the engine closes on the way out and the exit status is 0.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        engine, pool = start_pool(loaded, model, args)
    except (OSError, ValueError, PoolFull) as e:  # an unwritable --learn-dir, a quantized drafter to adapt
        print(error_line(e), file=sys.stderr)
        return 2
    try:
        with pool:
            if engine is not None:
                print(engine.memory.describe(engine.prompt_cache_bytes), file=sys.stderr)
                lines = start_lines(model_id, args, model.context, loaded.drafter is not None,
                                    engine.prompt_cache_bytes)
            else:
                lines = [f"serving the model store {where(args)}"]
            print("\n".join(lines + [pool_line(pool, args)]), file=sys.stderr, flush=True)
            jit.on_first_compile(lambda: sys.stderr.write(jit.NOTICE + "\n"))  # one write: a line of its own
            # Open streams get a few seconds to finish on shutdown; then they are cancelled.
            config = uvicorn.Config(create_app(served_models(pool, loaded, model, args), settings), host=args.host,
                                    port=args.port, uds=args.uds, log_level=args.log_level,
                                    log_config=log_config(), timeout_graceful_shutdown=3)
            server = ready_server(config, lambda server: print(ready_line(server, model_id), flush=True))
            watch(server, args.parent_pid, args.exit_on_stdin_close)
            server.run()
    except KeyboardInterrupt:
        pass
    finally:
        if args.uds is not None and os.path.exists(args.uds):  # uvicorn.run does this; Server does not
            os.remove(args.uds)
    return 0


def start_pool(loaded, model, args):
    """The start model's Engine (as the server always built it) and the pool that holds it beside
    the store's models: pinned, found by its served name (and its store name, where it has one)."""
    from ..engine.engine import Engine
    from ..engine.pool import Pool, default_budget
    from ..runtime import memory
    from ..store import Store
    from .models import served_entry

    budget = None if args.memory_gb is None else int(args.memory_gb * 2**30)
    disk = None if args.prompt_cache_disk_gb is None else int(args.prompt_cache_disk_gb * 2**30)
    shared = dict(max_batch=args.max_batch, max_queue=args.max_queue, prefill_tokens=args.prefill_tokens,
                  prompt_cache_disk_bytes=disk)
    options = {**shared, **({"prompt_cache_bytes": args.prompt_cache_bytes} if args.prompt_cache_bytes is not None
                            else {})}
    if loaded is None:  # --store-only
        pool = Pool(Store(args.models_dir), budget, args.keep_alive, args.pin, args.prompt_cache_dir, options,
                    loader=lambda e: load_entry(e, args), default_context=args.num_ctx, wait_s=args.load_wait)
        return None, pool
    plan = memory.plan(loaded.target, loaded.drafter)
    limit = None if budget is None else min(plan.kv_limit, max((budget - plan.model_bytes) // 2, 1))
    learn = None if args.learn_gb is None else int(args.learn_gb * 2**30)
    engine = Engine(loaded, memory_limit=limit, prompt_cache_bytes=args.prompt_cache_bytes,
                    prompt_cache_dir=args.prompt_cache_dir, learn_dir=args.learn_dir, learn_bytes=learn,
                    learn_every=args.learn_every, drafter_dir=getattr(args, "drafter_dir", None), **shared)
    entry = getattr(args, "store_entry", None) or served_entry(loaded, model.id)
    if budget is None:  # the start model is held as the server always held it, whatever the default budget
        budget = max(default_budget(), entry.bytes + engine.memory_limit)
    pool = Pool(Store(args.models_dir), budget, args.keep_alive, args.pin, args.prompt_cache_dir, options,
                loader=lambda e: load_model(args)[0] if e is entry else load_entry(e, args),
                default_context=args.num_ctx, wait_s=args.load_wait)
    try:
        pool.adopt(entry, engine, names=[model.id])
    except BaseException:
        pool.close()
        engine.close()
        raise
    return engine, pool


def load_entry(entry, args):
    """A store model, loaded as the server's flags say (dtype, vision at start, image URLs)."""
    import mlx.core as mx

    from ..formats import vision
    from ..loading import load

    loaded = load(entry.target.path, entry.drafter.path if entry.drafter else None,
                  dtype=getattr(mx, args.dtype) if args.dtype else None, load_vision=args.load_vision)
    images = vision.encoder(loaded)
    if images is not None:
        images.fetch_urls = args.allow_image_urls
    return loaded


def served_models(pool, loaded, model, args):
    from . import ollama
    from .models import Pooled

    card = None if loaded is None else ollama.card(loaded, model, int(time.time()))
    return Pooled(pool, model, card, allow_pull=args.allow_pull)


def pool_line(pool, args) -> str:
    from ..runtime.memory import size

    entries = pool.store.entries()
    pulls = "on demand" if args.allow_pull else "with /api/pull or mlx-mtp pull"
    return (f"models: {len(entries)} in the store ({pool.store.models_dir}); loaded on demand within "
            f"{size(pool.budget)}, kept {args.keep_alive} after their last request; pulls {pulls}")


# ---- for an app that embeds the server -----------------------------------------------------------


def ready_server(config, on_ready):
    """uvicorn's server, which calls `on_ready(server)` once it accepts connections."""
    import uvicorn

    class ReadyServer(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                on_ready(self)

    return ReadyServer(config)


def ready_line(server, model_id: str) -> str:
    """The one JSON line on stdout that says the server accepts connections, and where: the bound
    socket's address, so `--port 0` names the port it got."""
    ready = {"event": "ready"}
    if server.config.uds is not None:
        ready["uds"] = server.config.uds
    else:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        ready["url"] = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        ready["port"] = port
    return json.dumps({**ready, "model": model_id, "pid": os.getpid()})


def log_config() -> dict:
    """uvicorn's logging, with its access log on stderr too: stdout carries the ready line only, so
    an app that reads that line and no more never fills the pipe."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return config


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's
        return True
    return True


def claim_socket(path) -> None:
    """Make way for a Unix socket at `path`: remove a stale one, which nothing listens on; refuse a
    live one, or a file that is no socket."""
    if path is None or not os.path.lexists(path):
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise ValueError(f"--uds {path}: the file exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except ConnectionRefusedError:  # stale: its server is gone
            os.remove(path)
            return
    raise ValueError(f"--uds {path}: another server listens on it")


def watch(server, parent_pid, stdin_close: bool) -> None:
    """Shut `server` down gracefully once `parent_pid` is gone, or standard input closes."""

    def stop(why: str) -> None:
        print(f"{why}: shutting down", file=sys.stderr, flush=True)
        server.should_exit = True

    def parent() -> None:
        child = parent_pid == os.getppid()  # once the parent exits, this process gets another one
        while alive(parent_pid) and not (child and os.getppid() != parent_pid):
            time.sleep(PARENT_POLL)
        stop(f"the parent process {parent_pid} exited")

    def stdin() -> None:
        try:
            while os.read(sys.stdin.fileno(), 65536):
                pass
        except (OSError, ValueError):  # no standard input at all: as closed
            pass
        stop("standard input closed")

    if parent_pid is not None:
        threading.Thread(target=parent, name="watch-parent", daemon=True).start()
    if stdin_close:
        threading.Thread(target=stdin, name="watch-stdin", daemon=True).start()
