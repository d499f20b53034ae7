"""`mlx-mtp`: the model store from a terminal. `models` lists what can be served (and, where a
server runs, which are loaded), `pull NAME` fetches a model with its drafter, `rm NAME` deletes
one, `ps` asks a running server what it holds (its `/api/ps`)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Optional, TextIO

from ..cli import error_line, prog_name
from .catalog import Entry
from .errors import StoreError
from .pull import QUANTIZE, PullEvent
from .store import ENV, Store, default_hf_cache, default_models_dir

COLUMNS = ("NAME", "ALIASES", "SIZE", "QUANTIZATION", "DRAFTER", "LOADED")
PS_COLUMNS = ("NAME", "SIZE", "CONTEXT", "UNTIL")
HOST_ENV, KEY_ENV = "MLX_MTP_HOST", "MLX_MTP_API_KEY"
DEFAULT_HOST = "http://127.0.0.1:8000"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog_name("mlx_mtp.store"),
                                description="The model store: list, pull and delete Gemma 4 models with "
                                            "their drafters.")
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--models-dir", metavar="DIR",
                       help=f"where models are stored and pulls go (default: ${ENV}, else "
                            f"~/.cache/mlx_mtp/models; here {default_models_dir()})")
    where.add_argument("--no-hf-cache", action="store_true",
                       help=f"leave out the Hugging Face cache (default: list it too; here "
                            f"{default_hf_cache()})")
    server = argparse.ArgumentParser(add_help=False)
    server.add_argument("--host", default=os.environ.get(HOST_ENV) or DEFAULT_HOST,
                        help=f"the running server to ask (default: ${HOST_ENV}, else {DEFAULT_HOST})")
    server.add_argument("--api-key", default=os.environ.get(KEY_ENV),
                        help=f"the server's --api-key (default: ${KEY_ENV}, else none)")
    sub = p.add_subparsers(dest="command", required=True, metavar="{models,pull,rm,ps}")
    sub.add_parser("models", parents=[where, server], help="list the models, their sizes and drafters, and which "
                   "a running server has loaded")
    pull = sub.add_parser("pull", parents=[where], help="fetch a model and its drafter from the Hub")
    pull.add_argument("name", help="gemma4:<tag> (e2b, e4b, 12b, 26b, 31b, latest; -4bit etc. converts) "
                                   "or a Hub repo, org/name")
    pull.add_argument("--quantize", choices=list(QUANTIZE),
                      help="convert the target to quantized MLX on the way (default: keep the Hub's weights)")
    pull.add_argument("--quiet", action="store_true", help="no progress (default: a progress bar on stderr)")
    rm = sub.add_parser("rm", parents=[where], help="delete models (a drafter goes with its last model)")
    rm.add_argument("names", nargs="+", metavar="NAME", help="a model's name or alias")
    sub.add_parser("ps", parents=[server], help="the models a running server has loaded, what each reserves and "
                   "until when")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "ps":
            return ps(running(args.host, args.api_key, timeout=10))
        store = Store(args.models_dir, hf_cache=None if args.no_hf_cache else default_hf_cache())
        if args.command == "models":
            return list_models(store, args.host, args.api_key)
        if args.command == "pull":
            return pull(store, args.name, args.quantize, None if args.quiet else Bar())
        return remove(store, args.names)
    except (StoreError, ServerError) as e:
        print(f"{prog_name('mlx_mtp.store')}: {error_line(e)}", file=sys.stderr)
        return 1


class ServerError(Exception):
    """No server answers at the host, or it answered an error."""


def running(host: str, key: Optional[str], timeout: float) -> list:
    """The server's `/api/ps` models. Raises ServerError."""
    url = host.rstrip("/") + "/api/ps"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.load(answer)["models"]
    except urllib.error.HTTPError as e:
        raise ServerError(f"{url}: HTTP {e.code}" + (" (pass --api-key)" if e.code == 401 else "")) from None
    except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
        reason = getattr(e, "reason", e)
        raise ServerError(f"no mlx_mtp server answers at {host} ({reason}); start one (mlx-mtp-server) or "
                          f"pass --host") from None


def ps(models: list) -> int:
    rows = [PS_COLUMNS] + [(m["name"], size(m["size"]), str(m.get("context_length", "-")), until(m["expires_at"]))
                           for m in models]
    table(rows)
    if not models:
        print("no model is loaded")
    return 0


def until(expires_at: str) -> str:
    """Ollama's `expires_at` as `ollama ps` says it: "Forever", or how long from now."""
    if expires_at.startswith("9999"):
        return "Forever"
    when = datetime.datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    left = (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    return "Stopping..." if left <= 0 else f"{int(left // 60)} minutes from now" if left >= 120 else \
        f"{int(left)} seconds from now"


def table(rows: list) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows if len(rows) > 1 else ():
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def list_models(store: Store, host: str, key: Optional[str]) -> int:
    entries = store.entries()
    try:  # where a server runs, which of them it has loaded
        loaded = {m["name"] for m in running(host, key, timeout=0.5)}
    except ServerError:
        loaded = None
    table([COLUMNS] + [row(e, loaded) for e in entries])
    if not entries:
        print(f"no models in {store.models_dir}; pull one: {prog_name('mlx_mtp.store')} pull gemma4:e2b")
    for problem in store.problems():
        print(f"refused: {problem}", file=sys.stderr)
    return 0


def row(entry: Entry, loaded: Optional[set]) -> tuple[str, ...]:
    """A model's line; LOADED is "-" where no server answers."""
    up = "-" if loaded is None else "yes" if {entry.name, *entry.aliases} & loaded else "no"
    return (entry.name, ",".join(entry.aliases) or "-", size(entry.bytes), entry.target.quantization,
            entry.drafter.name if entry.drafter else "-", up)


def size(n: float) -> str:
    """Bytes in decimal units, as Ollama prints them."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" or n >= 100 else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def pull(store: Store, name: str, quantize: Optional[str], bar: Optional["Bar"]) -> int:
    try:
        entry = store.pull(name, progress=bar, quantize=quantize)
    except KeyboardInterrupt:
        print("\ninterrupted: the next pull of it resumes from what was fetched", file=sys.stderr)
        sys.stderr.flush()
        os._exit(130)  # not waiting for the download threads: a pull is safe to stop at any point
    drafter = f" with {entry.drafter.name}" if entry.drafter else " (no drafter)"
    print(f"{entry.name}{drafter}, {size(entry.bytes)}")
    return 0


def remove(store: Store, names: list[str]) -> int:
    for name in names:
        entry = store.delete(name)
        print(f"deleted {entry.name}")
    return 0


class Bar:
    """Pull events on a terminal: a step per line, the download as one bar over every file
    (redrawn in place). Without a terminal, a line per step and per file done."""

    def __init__(self, stream: TextIO = sys.stderr):
        self.stream, self.tty = stream, stream.isatty()
        self.files: dict[str, tuple[int, int]] = {}  # file -> (completed, total)
        self.start = time.monotonic()
        self.status: Optional[str] = None
        self.open = False  # a bar is drawn on the current line

    def __call__(self, event: PullEvent) -> None:
        if event.file is not None:
            before = self.files.get(event.file, (0, 0))[0]
            self.files[event.file] = (event.completed, event.total)
            done, total = (sum(v[i] for v in self.files.values()) for i in (0, 1))
            if self.tty:
                self._draw("downloading", done, total)
            elif event.completed == event.total and before != event.total:
                self._line(f"{event.file} ({size(event.total)})")
        elif event.total is not None:
            if self.tty:
                self._draw(event.status, event.completed, event.total)
            elif event.status != self.status:
                self._line(event.status)
        else:
            self._line(event.status)
        self.status = event.status if event.file is None else "downloading"

    def _draw(self, what: str, done: int, total: int) -> None:
        rate = done / max(time.monotonic() - self.start, 1e-6)
        pct = 100 * done / max(total, 1)
        self.stream.write(f"\r{what} {pct:5.1f}%  {size(done)} / {size(total)}  {size(rate)}/s ")
        self.stream.flush()
        self.open = True

    def _line(self, text: str) -> None:
        self.stream.write(("\n" if self.open else "") + text + "\n")
        self.stream.flush()
        self.open = False


if __name__ == "__main__":
    sys.exit(main())
