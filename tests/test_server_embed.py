"""The server as an app embeds it (issue 51): `--port 0` and the ready line on stdout, shutting down
when the app's process or its pipe to standard input goes, and serving on a Unix socket. Each test
starts the real server on the bundled demo pair."""

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVER = [sys.executable, "-m", "mlx_mtp.server", "--log-level", "warning"]


def readme_ready_lines() -> list:
    """The README's ready lines (its "Serve" section's json block): TCP's, then the Unix socket's."""
    section = (ROOT / "README.md").read_text().split("## Serve", 1)[1].split("\n## ", 1)[0]
    return [json.loads(line) for line in re.search(r"```json\n(.*?)```", section, re.S)[1].splitlines()]


def ready(proc: subprocess.Popen, timeout: float = 60) -> dict:
    """The server's ready line, parsed; it must be the first line on its stdout."""
    if not select.select([proc.stdout], [], [], timeout)[0]:
        proc.kill()
        raise TimeoutError(f"no ready line within {timeout} s")
    line = proc.stdout.readline()
    assert line.endswith("\n"), (line, proc.wait(), proc.stderr.read() if proc.stderr else "")
    return json.loads(line)


def wait_gone(pid: int, within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"the server {pid} still runs {within} s after its parent exited")


@pytest.fixture
def sock_dir():
    with tempfile.TemporaryDirectory(prefix="mtp-") as d:  # short: a socket's path has ~100 bytes at most
        yield Path(d)


def test_port_0_prints_one_ready_line_whose_url_serves_and_stdin_closing_stops_it():
    proc = subprocess.Popen([*SERVER, "--port", "0", "--exit-on-stdin-close"], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ready(proc)
        assert line.keys() == readme_ready_lines()[0].keys() and line["event"] == "ready"
        assert line["url"] == f"http://127.0.0.1:{line['port']}" and line["port"] > 0
        assert line["model"] == "mlx-mtp-demo" and line["pid"] == proc.pid
        assert httpx.get(line["url"] + "/health", timeout=10).json() == {"status": "ok"}
        proc.stdin.close()
        assert proc.wait(10) == 0
        assert proc.stdout.read() == ""  # the ready line only: start-up lines and the access log go to stderr
        assert "standard input closed: shutting down" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_the_server_exits_with_status_0_when_its_parent_process_is_gone(tmp_path):
    """The app (here a Python process that starts the server and then exits) passes its own pid. The
    server runs under a wrapper that outlives the app and records its exit status."""
    status = tmp_path / "status"
    wrapper = "import subprocess, sys; open(sys.argv[1], 'w').write(str(subprocess.call(sys.argv[2:])))"
    app = ("import os, subprocess, sys\n"
           f"server = subprocess.Popen([sys.executable, '-c', {wrapper!r}, {str(status)!r}, *{SERVER!r}, "
           "'--port', '0', '--parent-pid', str(os.getpid())], stdin=subprocess.DEVNULL)\n"
           "sys.stdin.readline()  # until the test lets it exit\n")
    proc = subprocess.Popen([sys.executable, "-c", app], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        line = ready(proc)
        assert httpx.get(line["url"] + "/health", timeout=10).status_code == 200
        proc.stdin.close()  # the app exits
        assert proc.wait(10) == 0
        wait_gone(line["pid"], within=5)
        deadline = time.monotonic() + 5
        while not status.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status.read_text() == "0"
    finally:
        proc.kill()
        proc.wait()


def test_uds_serves_on_the_socket_replaces_a_stale_one_refuses_a_live_one_and_removes_it_at_exit(sock_dir):
    path = sock_dir / "server.sock"
    with socket.socket(socket.AF_UNIX) as stale:  # a crashed server's: the file stays, nothing listens
        stale.bind(str(path))
    proc = subprocess.Popen([*SERVER, "--uds", str(path)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = ready(proc)
        assert line == {"event": "ready", "uds": str(path), "model": "mlx-mtp-demo", "pid": proc.pid}
        assert line.keys() == readme_ready_lines()[1].keys()
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), timeout=10) as client:
            assert client.get("http://server/health").json() == {"status": "ok"}
        second = subprocess.run([*SERVER, "--uds", str(path)], cwd=ROOT, capture_output=True, text=True,
                                timeout=60)
        assert (second.returncode, second.stdout) == (2, "")
        assert second.stderr.strip().splitlines() == [f"error: --uds {path}: another server listens on it"]
        proc.terminate()
        assert proc.wait(10) == 0
        assert not path.exists()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("flags", [["--port", "8000"], ["--host", "127.0.0.1"]])
def test_uds_with_a_host_or_port_is_refused_in_one_line(flags, sock_dir):
    path = sock_dir / "server.sock"
    out = subprocess.run([*SERVER, "--uds", str(path), *flags], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert (out.returncode, out.stdout) == (2, "")
    refusal = "mlx-mtp-server: error: --uds serves on a Unix socket: it takes no --host or --port"
    assert out.stderr.splitlines() == [refusal]
    assert not path.exists()


def test_a_parent_pid_that_is_already_gone_is_refused_in_one_line():
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    out = subprocess.run([*SERVER, "--port", "0", "--parent-pid", str(gone.pid)], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.strip().splitlines() == [f"error: --parent-pid {gone.pid}: no such process"]
