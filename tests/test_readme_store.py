"""README's "Many models, one server", run as written: the server command and each curl line, against a
store-only server whose Hub is faked on the loopback (tests/fake_hub.py) and holds the tiny pair as Gemma 4
E2B; then `mlx-mtp ps` and `mlx-mtp models` against that running server, as a user runs them."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from chat_helpers import TINY, write_gemma4_tokenizer
from fake_hub import FakeHub, read_repo
from scripted import TEMPLATE

from apps.serve_load import free_port, start_server, stop_server, wait_healthy

README = Path(__file__).resolve().parents[1] / "README.md"
E2B = "google/gemma-4-E2B-it"


def section() -> str:
    return README.read_text().split("## Many models, one server", 1)[1].split("\n## ", 1)[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The README's server command (`mlx-mtp-server ...` as `python -m mlx_mtp.server ...`) on a free port,
    with an empty store and the fake Hub; yields (url, env, the store's directory)."""
    tmp = tmp_path_factory.mktemp("readme-store")
    tok = tmp / "tokenizer"
    tok.mkdir()
    write_gemma4_tokenizer(tok, TEMPLATE.read_text())
    target, drafter = {**read_repo(TINY / "target"), **read_repo(tok)}, read_repo(TINY / "drafter")
    repos = {E2B: target, f"{E2B}-assistant": drafter, "testorg/tiny": target, "testorg/tiny-assistant": drafter}
    (command,) = [line for line in re.findall(r"```sh\n(.*?)```", section(), re.S)[0].splitlines()
                  if line.startswith("mlx-mtp-server")]
    with FakeHub(repos) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "MLX_MTP_MODELS": str(tmp / "models"),
               "HF_HUB_CACHE": str(tmp / "hf")}
        port = free_port()
        proc = start_server([sys.executable, "-m", "mlx_mtp.server", *shlex.split(command)[1:]], port,
                            str(tmp / "server.log"), env=env)
        try:
            wait_healthy(proc, port)
            yield f"http://127.0.0.1:{port}", env, tmp / "models"
        finally:
            stop_server(proc)
    assert proc.returncode == 0, (tmp / "server.log").read_text()


def run(command: str, url: str, env: dict) -> list:
    """A README curl line against the server: its output's JSON lines (NDJSON, or one object)."""
    out = subprocess.run(["bash", "-c", command.replace("http://127.0.0.1:8000", url)], capture_output=True,
                         text=True, timeout=120, check=True, env=env).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_the_readme_curl_lines_pull_list_chat_unload_and_delete(server):
    url, env, models = server
    block = re.findall(r"```sh\n(.*?)```", section(), re.S)[1]
    commands = [line for line in block.splitlines() if line.startswith("curl ")]
    assert len(commands) == 6 and all("http://127.0.0.1:8000/" in c for c in commands)
    pull, listing, chat, ps, unload, delete = (run(c, url, env) for c in commands[:6])
    assert pull[0] == {"status": "pulling manifest"} and pull[-1] == {"status": "success"}
    downloads = [line for line in pull if line["status"].startswith("downloading")]
    assert downloads and all(line["completed"] <= line["total"] for line in downloads)
    (model,) = [m for m in listing[0]["data"] if m["id"] == E2B]
    assert model["loaded"] is False and "gemma4:e2b" in model["aliases"]  # listed, not yet loaded
    (answer,) = chat
    assert answer["done"] and answer["message"]["role"] == "assistant" and answer["eval_count"] > 0
    assert answer["load_duration"] > 0 and answer["model"] == "gemma4:e2b"
    (loaded,) = ps[0]["models"]
    assert loaded["name"] == E2B and loaded["context_length"] == min(8192, 512)  # num_ctx, at most the model's
    assert loaded["size"] > 0 and not loaded["expires_at"].startswith("9999")  # keep_alive "10m": it expires
    assert unload[0]["done_reason"] == "unload"
    assert delete == []  # 200, no body: as Ollama
    assert E2B not in [m["name"] for m in run(commands[3], url, env)[0]["models"]]  # unloaded
    assert not (models / E2B).exists() and E2B not in [m["id"] for m in run(commands[1], url, env)[0]["data"]]


def test_mlx_mtp_ps_and_models_ask_the_running_server(server):
    url, env, models = server
    store = [sys.executable, "-m", "mlx_mtp.store"]
    subprocess.run([*store, "pull", "testorg/tiny", "--quiet"], env=env, check=True, capture_output=True, timeout=120)
    ask = run(f"curl -s {url}/api/generate -d '{{\"model\": \"testorg/tiny\", \"keep_alive\": -1}}'", url, env)
    assert ask[0]["done_reason"] == "load"
    ps = subprocess.run([*store, "ps", "--host", url], env=env, capture_output=True, text=True, timeout=60)
    assert ps.returncode == 0, ps.stderr
    header, line = ps.stdout.splitlines()
    assert header.split() == ["NAME", "SIZE", "CONTEXT", "UNTIL"]
    assert line.split()[0] == "testorg/tiny" and line.split()[-1] == "Forever"  # keep_alive -1
    listed = subprocess.run([*store, "models", "--host", url], env=env, capture_output=True, text=True, timeout=60)
    (row,) = [r for r in listed.stdout.splitlines() if r.startswith("testorg/tiny ")]
    assert row.split()[-1] == "yes"
