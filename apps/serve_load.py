"""Load test of the OpenAI-compatible server: N concurrent streaming clients, MTP on and off.

    python -m apps.serve_load                                  # starts the demo server itself
    python -m apps.serve_load --url http://127.0.0.1:8000 --clients 8 --requests 6 --max-tokens 64

Each client sends `--requests` streamed, greedy requests one after another (prompt i of the
list goes to client i). Per mode it prints aggregate tok/s (completion tokens over the phase's
wall time), time to first token p50/p95 as the clients saw it, errors, and the acceptance
length from the server's /metrics. A benchmark, not a test: it prints numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from typing import Optional, Sequence

PROMPTS = [
    "import os\n", "def fib(n):", "class Stack:\n", "def parse_args(argv):", "import json\n\ndef load(path):",
    "def __init__(self, name):", "for i in range(10):", "try:\n    import ssl\n",
]


@dataclasses.dataclass
class Reply:
    text: str
    ttft: Optional[float]  # seconds to the first chunk with text
    seconds: float
    finish_reason: Optional[str]
    usage: Optional[dict]
    timings: Optional[dict]


def stream(url: str, path: str, body: dict, api_key: Optional[str] = None, timeout: float = 120) -> Reply:
    """POST a streamed request and read its server-sent events to `data: [DONE]`.

    Raises:
        RuntimeError: an HTTP error status, or an error object inside the stream.
    """
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    start = time.perf_counter()
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}), headers)
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read().decode(errors='replace')}")
        return _read_events(response, start)
    finally:
        conn.close()


def _read_events(response, start: float) -> Reply:
    reply = Reply("", None, 0.0, None, None, None)
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            break
        event = json.loads(line[len("data: "):])
        if "error" in event:
            raise RuntimeError(f"error in stream: {event['error']}")
        reply.usage = event.get("usage") or reply.usage
        reply.timings = event.get("timings") or reply.timings
        for choice in event.get("choices", []):
            text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if text and reply.ttft is None:
                reply.ttft = time.perf_counter() - start
            reply.text += text
            reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
    reply.seconds = time.perf_counter() - start
    return reply


def run_clients(url: str, bodies: Sequence[Sequence[dict]], path: str = "/v1/completions",
                api_key: Optional[str] = None) -> tuple[list, list, float]:
    """Client i sends bodies[i] in order, all clients at once.

    Returns:
        (replies[i][j], errors as strings, wall seconds).
    """
    replies = [[None] * len(b) for b in bodies]
    errors: list[str] = []

    def client(i: int) -> None:
        for j, body in enumerate(bodies[i]):
            try:
                replies[i][j] = stream(url, path, body, api_key)
            except Exception as e:  # counted, reported
                errors.append(f"client {i} request {j}: {e}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return replies, errors, time.perf_counter() - start


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def metrics(url: str) -> dict:
    from mlx_mtp.server.metrics import parse

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return parse(r.read().decode())


def measure(url: str, args, mtp: bool) -> dict:
    bodies = [[{"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": args.max_tokens, "temperature": 0,
                "mtp": mtp, "draft_tokens": args.draft_tokens, "stream_options": {"include_usage": True}}]
              * args.requests for i in range(args.clients)]
    before = metrics(url)
    replies, errors, wall = run_clients(url, bodies, api_key=args.api_key)
    after = metrics(url)
    done = [r for row in replies for r in row if r is not None]
    tokens = sum(r.usage["completion_tokens"] for r in done if r.usage)
    ttfts = [r.ttft * 1000 for r in done if r.ttft is not None]
    drafts = after["mlx_mtp:spec_decode_num_drafts_total"] - before["mlx_mtp:spec_decode_num_drafts_total"]
    accepted = (after["mlx_mtp:spec_decode_num_accepted_tokens_total"]
                - before["mlx_mtp:spec_decode_num_accepted_tokens_total"])
    return dict(mode="mtp" if mtp else "plain", requests=len(done) + len(errors), errors=len(errors),
                tokens=tokens, wall_s=wall, agg_tps=tokens / wall, ttft_p50_ms=percentile(ttfts, 50),
                ttft_p95_ms=percentile(ttfts, 95),
                acceptance_length=1 + accepted / drafts if drafts else None,
                first_error=errors[0] if errors else None)


def start_server(argv: Sequence[str], port: int, log_path: str, env: dict | None = None) -> subprocess.Popen:
    """Start a server command on `port`, its output going to `log_path`; see `wait_healthy`."""
    with open(log_path, "w") as log:
        return subprocess.Popen([*argv, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float = 120) -> None:
    """Wait until the server answers /health; stop it and raise if it exits or never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    stop_server(proc)
    raise TimeoutError(f"the server did not answer /health within {timeout} s")


def stop_server(proc: subprocess.Popen, timeout: float = 15) -> None:
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m apps.serve_load", description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (default: start the demo pair's server for the run)")
    ap.add_argument("--server-args", default="",
                    help="extra arguments, one string, for the server this command starts (default: none)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (default: 8)")
    ap.add_argument("--requests", type=int, default=6,
                    help="streamed requests per client, one after another (default: 6)")
    ap.add_argument("--max-tokens", type=int, default=64, help="completion tokens per request (default: 64)")
    ap.add_argument("--draft-tokens", default="auto", metavar="N|auto",
                    type=lambda s: s if s == "auto" else int(s),
                    help="draft length of the MTP phase's requests, 0-6 or auto (default: auto)")
    ap.add_argument("--modes", default="mtp,plain", help="phases to run, comma-separated: mtp, plain "
                                                         "(default: mtp,plain)")
    ap.add_argument("--api-key", help="the server's key, for --url (default: none)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    url, proc = args.url, None
    if url is None:
        port = free_port()
        command = [sys.executable, "-m", "mlx_mtp.server", "--log-level", "warning",
                   *args.server_args.split()]
        log = os.path.join(tempfile.gettempdir(), "mlx_mtp_serve_load.log")
        proc = start_server(command, port, log)
        try:
            wait_healthy(proc, port)
        except Exception as e:
            raise SystemExit(f"error: {e}; its output is in {log}") from None
        url = f"http://127.0.0.1:{port}"
    try:
        stream(url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 8}, args.api_key)  # warm-up
        print(f"{args.clients} clients x {args.requests} streamed requests, {args.max_tokens} tokens each, "
              f"greedy, draft tokens {args.draft_tokens}, server {url}")
        print(f"{'mode':6} {'requests':>8} {'errors':>6} {'tokens':>7} {'wall s':>7} {'agg tok/s':>9} "
              f"{'TTFT p50 ms':>11} {'TTFT p95 ms':>11} {'accept len':>10}")
        failed = False
        for mode in args.modes.split(","):
            r = measure(url, args, mtp=mode == "mtp")
            accept = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
            print(f"{r['mode']:6} {r['requests']:>8} {r['errors']:>6} {r['tokens']:>7} {r['wall_s']:>7.2f} "
                  f"{r['agg_tps']:>9.1f} {r['ttft_p50_ms']:>11.0f} {r['ttft_p95_ms']:>11.0f} {accept:>10}",
                  flush=True)
            if r["first_error"]:
                print(f"  first error: {r['first_error']}")
                failed = True
        return 1 if failed else 0
    finally:
        if proc is not None:
            stop_server(proc)


if __name__ == "__main__":
    sys.exit(main())
