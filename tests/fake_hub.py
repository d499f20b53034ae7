"""A Hugging Face Hub on the loopback, for tests: the routes huggingface_hub's downloads use, over
repos held in memory, so that the real client code runs with no network (point HF_ENDPOINT, or
`endpoint=`, at `hub.url`).

Routes: `GET /api/models/<org>/<name>[/revision/<rev>]` (the repo, its commit and its files, sizes
and LFS sha256 included), `GET /api/models/<org>/<name>/tree/<rev>` (the listing snapshot_download
reads), and `HEAD`/`GET /<org>/<name>/resolve/<rev>/<path>` (`Range: bytes=N-` answered with 206).
A repo in `slow` sends its `.safetensors` files at that many bytes per second, so that a test can
kill a client mid-download; `requests`, `started` and `finished` say what was served.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional
from urllib.parse import unquote, urlparse


def read_repo(path: Path) -> dict[str, bytes]:
    """A directory's files as a repo."""
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, bytes]], slow: Optional[dict[str, float]] = None):
        self.repos = repos
        self.slow = dict(slow or {})
        self.requests: Counter = Counter()  # (method, repo, path) -> count
        self.started: dict[tuple[str, str], threading.Event] = {}
        self.finished: dict[tuple[str, str], threading.Event] = {}
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._server.handle_error = lambda *_: None  # a client killed mid-body is expected here
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def sha(self, repo: str) -> str:
        """The repo's (one) commit."""
        return hashlib.sha1(f"commit:{repo}".encode()).hexdigest()

    def event(self, table: dict, repo: str, path: str) -> threading.Event:
        return table.setdefault((repo, path), threading.Event())

    def gets(self, repo: str, path: str) -> int:
        return self.requests[("GET", repo, path)]

    # ---- what the routes answer ------------------------------------------------------------

    def info(self, repo: str) -> dict:
        siblings = []
        for path, content in self.repos[repo].items():
            lfs = {"size": len(content), "sha256": _sha256(content), "pointerSize": 134}
            siblings.append({"rfilename": path, "size": len(content), "blobId": _blob(content),
                             **({"lfs": lfs} if _lfs(path) else {})})
        return {"id": repo, "modelId": repo, "sha": self.sha(repo), "private": False, "gated": False,
                "siblings": siblings}

    def tree(self, repo: str) -> list:
        return [{"type": "file", "path": p, "size": len(c), "oid": _blob(c),
                 **({"lfs": {"oid": _sha256(c), "size": len(c), "pointerSize": 134}} if _lfs(p) else {})}
                for p, c in self.repos[repo].items()]

    def file_headers(self, repo: str, path: str) -> dict:
        content = self.repos[repo][path]
        etag = _sha256(content) if _lfs(path) else _blob(content)
        return {"X-Repo-Commit": self.sha(repo), "ETag": f'"{etag}"', "Content-Length": str(len(content)),
                "Accept-Ranges": "bytes"}


def _lfs(path: str) -> bool:
    return path.endswith(".safetensors")


def _sha256(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def _blob(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_HEAD(self):
            self._route(body=False)

        def do_GET(self):
            self._route(body=True)

        def _route(self, body: bool):
            parts = [unquote(p) for p in urlparse(self.path).path.strip("/").split("/")]
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo, rest = "/".join(parts[2:4]), parts[4:]
                if repo not in hub.repos:
                    return self._missing("RepoNotFound")
                if rest[:1] == ["tree"]:
                    return self._json(hub.tree(repo), body)
                return self._json(hub.info(repo), body)
            if len(parts) >= 5 and parts[2] == "resolve":
                repo, rev, path = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                if repo not in hub.repos:
                    return self._missing("RepoNotFound")
                if rev not in ("main", hub.sha(repo)):
                    return self._missing("RevisionNotFound")
                if path not in hub.repos[repo]:
                    return self._missing("EntryNotFound")
                hub.requests[(self.command, repo, path)] += 1
                return self._file(repo, path, body)
            self._missing("RepoNotFound")

        def _json(self, data, body: bool):
            raw = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            if body:
                self.wfile.write(raw)

        def _missing(self, code: str):
            self.send_response(404)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _file(self, repo: str, path: str, body: bool):
            content = hub.repos[repo][path]
            start = int(self.headers.get("Range", "bytes=0-")[len("bytes="):].split("-")[0] or 0)
            headers = hub.file_headers(repo, path)
            self.send_response(206 if start else 200)
            for name, value in headers.items():
                self.send_header(name, value)
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(content) - 1}/{len(content)}")
                self.send_header("Content-Length", str(len(content) - start))
            self.end_headers()
            if body:
                self._send(repo, path, content[start:])

        def _send(self, repo: str, path: str, data: bytes):
            hub.event(hub.started, repo, path).set()
            rate = hub.slow.get(repo) if _lfs(path) else None
            step = 16384 if rate else len(data) or 1
            try:
                for i in range(0, len(data), step):
                    self.wfile.write(data[i:i + step])
                    if rate:
                        time.sleep(step / rate)
            except (BrokenPipeError, ConnectionResetError):
                return
            hub.event(hub.finished, repo, path).set()

    return Handler
