"""Ollama's native API, driven live by the official `ollama` client (unchanged) and by raw HTTP:
the scripted Gemma 4 model (tests/scripted.py: tool calls, thinking, JSON; every reply known, MTP
on), a tiny vision model for images, and the demo pair for the README's curl examples."""

import base64
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import ollama
import pytest
from chat_helpers import DRAFTER, make_vision_chat_model
from PIL import Image
from scripted import KEY, OSLO, STORY, TOOLS, WEATHER, ask

from apps.serve_load import free_port, start_server, stop_server, wait_healthy

README = Path(__file__).resolve().parents[1] / "README.md"
MODEL = "gemma4-scripted"
VISION = "gemma4-vision"
AUTH = {"Authorization": f"Bearer {KEY}"}
PARIS = "What is the weather in Paris right now?"
SEVEN = "Please work out six times seven for me."
STORY_ASK = "Tell me a short story about a robot."
FINAL = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
         "eval_duration")


@pytest.fixture(scope="module")
def client(scripted_server):
    return ollama.Client(host=scripted_server, headers=AUTH, timeout=60)


@pytest.fixture(scope="module")
def others(tmp_path_factory):
    """(the vision model's url, the demo pair's url): both started at once."""
    tmp = tmp_path_factory.mktemp("ollama")
    model = make_vision_chat_model(tmp / "vision")
    argvs = [[sys.executable, "-m", "mlx_mtp.server", "--model", str(model), "--drafter", str(DRAFTER),
              "--served-model-name", VISION, "--log-level", "warning"],
             [sys.executable, "-m", "mlx_mtp.server", "--log-level", "warning"]]
    ports = [free_port(), free_port()]
    procs = [start_server(argv, port, str(tmp / f"server{i}.log")) for i, (argv, port) in enumerate(zip(argvs, ports))]
    try:
        for proc, port in zip(procs, ports):
            wait_healthy(proc, port)
        yield [f"http://127.0.0.1:{port}" for port in ports]
    finally:
        for proc in procs:
            stop_server(proc)
    assert all(proc.returncode == 0 for proc in procs), [(tmp / f"server{i}.log").read_text() for i in (0, 1)]


def chat(client, text, **kwargs):
    return client.chat(model=MODEL, messages=[{"role": "user", "content": text}], **kwargs)


def lines(url, path, body, headers=AUTH):
    """The NDJSON lines of a streamed answer (each one JSON object), and the response."""
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=60) as r:
        return [json.loads(line) for line in r.iter_lines() if line], r


# ---- the model -------------------------------------------------------------------------------------


def test_list_show_ps_version_and_root(client, scripted_server):
    (entry,) = client.list().models
    assert entry.model == MODEL and entry.size >= 0 and len(entry.digest) == 64  # (wrapped: no weights read)
    raw = httpx.get(scripted_server + "/api/tags", headers=AUTH).json()["models"][0]
    # Zed reads every one of these as a required string
    assert raw["name"] == MODEL and isinstance(raw["modified_at"], str) and isinstance(raw["digest"], str)
    assert all(isinstance(raw["details"][k], str) and raw["details"][k]
               for k in ("format", "family", "parameter_size", "quantization_level"))
    assert re.fullmatch(r"\d+(\.\d[KMB])?", raw["details"]["parameter_size"])  # the scripted target: a wrapper

    for name in (MODEL, MODEL + ":latest"):
        shown = client.show(name)
        assert shown.modelinfo["gemma4.context_length"] == 8192 and shown.modelinfo["general.architecture"] == "gemma4"
        assert shown.capabilities == ["completion", "tools", "thinking"]  # no vision tower
        assert "num_ctx 8192" in shown.parameters and "Suffix" not in shown.template and "<|turn>" in shown.template
        assert shown.details.family == "gemma4"
    continue_style = httpx.post(scripted_server + "/api/show", json={"name": MODEL}, headers=AUTH)
    assert continue_style.status_code == 200 and continue_style.json()["capabilities"][0] == "completion"

    (running,) = client.ps().models
    assert running.model == MODEL and running.size_vram == running.size and running.context_length == 8192
    assert running.expires_at.year == 9999

    version = httpx.get(scripted_server + "/api/version").json()["version"]
    assert tuple(map(int, version.split("."))) >= (0, 6, 4)  # Copilot Chat's floor
    assert httpx.get(scripted_server + "/").text == "Ollama is running"
    assert httpx.head(scripted_server + "/").status_code == 200  # OllamaKit's probe


def test_unknown_models_and_bad_requests_in_ollamas_shapes(client, scripted_server):
    for call in (lambda: client.chat(model="llama3", messages=[]),
                 lambda: client.show("llama3:8b"),
                 lambda: list(client.chat(model="llama3", messages=[{"role": "user", "content": "hi"}], stream=True))):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 404 and 'model "llama3' in e.value.error and "try pulling it first" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        chat(client, "hi", options={"temprature": 0.5})
    assert e.value.status_code == 400 and "temprature" in e.value.error
    r = httpx.post(scripted_server + "/api/chat", content=b"{nope", headers=AUTH)
    assert r.status_code == 400 and list(r.json()) == ["error"]
    for body in ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "format": "yaml"},
                 {"model": MODEL, "messages": [{"role": "user", "content": "hi", "images": ["%%%"]}]},
                 {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "keep_alive": "5 minutes"},
                 {"model": MODEL, "prompt": "x", "suffix": "y"}, {"prompt": "x"}):
        path = "/api/generate" if "prompt" in body else "/api/chat"
        r = httpx.post(scripted_server + path, json=body, headers=AUTH)
        assert r.status_code == 400 and isinstance(r.json()["error"], str), (body, r.text)
    assert httpx.post(scripted_server + "/api/chat", json={"model": MODEL}).status_code == 401  # the server's key
    with pytest.raises(ollama.ResponseError) as e:  # pulls and deletes: tests/test_server_models.py
        client.delete("gemma4:e2b")
    assert e.value.status_code == 404 and 'model "gemma4:e2b" not found' in e.value.error


def test_a_request_with_nothing_to_generate_loads_the_model(client):
    loaded = client.chat(model=MODEL, messages=[])
    assert loaded.done and loaded.done_reason == "load" and loaded.message.content == ""
    assert client.generate(model=MODEL, keep_alive=0).done_reason == "unload"


# ---- chats ---------------------------------------------------------------------------------------


def test_chat_whole_and_streamed(client):
    whole = chat(client, STORY_ASK, options={"temperature": 0, "num_ctx": 4096, "seed": 3, "top_k": 40,
                                              "repeat_penalty": 1.0, "num_gpu": 99})
    assert whole.message.role == "assistant" and whole.message.content == STORY
    assert whole.done and whole.done_reason == "stop" and whole.eval_count > 0 and whole.prompt_eval_count > 0
    chunks = list(chat(client, STORY_ASK, stream=True))
    assert all(not c.done for c in chunks[:-1]) and chunks[-1].done and chunks[-1].done_reason == "stop"
    assert "".join(c.message.content for c in chunks) == STORY
    assert chunks[-1].eval_count == whole.eval_count and len(chunks) > 10

    cut = chat(client, STORY_ASK, options={"num_predict": 5})
    assert cut.done_reason == "length" and cut.eval_count == 5 and STORY.startswith(cut.message.content)
    stopped = chat(client, STORY_ASK, options={"stop": ["lighthouse"]})
    assert stopped.message.content == STORY.split("lighthouse")[0] and stopped.done_reason == "stop"


def test_thinking_on_and_off(client):
    on = chat(client, SEVEN, think=True)
    assert (on.message.thinking, on.message.content) == ("Six sevens make 42.", "The answer is 42.")
    off = chat(client, SEVEN, think=False)
    assert (off.message.thinking, off.message.content) == (None, "42, of course.")
    chunks = list(chat(client, SEVEN, think="high", stream=True))
    assert "".join(c.message.thinking or "" for c in chunks) == "Six sevens make 42."
    assert "".join(c.message.content for c in chunks) == "The answer is 42."


def test_a_tool_loop_whole_and_streamed(client):
    first = chat(client, PARIS, tools=TOOLS)
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris", "unit": "celsius"}
    assert first.message.content == "" and first.done_reason == "stop"
    history = [{"role": "user", "content": PARIS}, first.message,
               {"role": "tool", "content": WEATHER[0], "tool_name": "get_weather"}]
    second = client.chat(model=MODEL, messages=history, tools=TOOLS)
    assert second.message.content == WEATHER[1] and not second.message.tool_calls
    calls = [c for chunk in chat(client, PARIS, tools=TOOLS, stream=True) for c in chunk.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", {"city": "Paris",
                                                                                        "unit": "celsius"})]
    # a client that drops the calls' ids and the result's name: the one call is the one answered
    bare = [history[0], {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "content": WEATHER[0]}]
    assert client.chat(model=MODEL, messages=bare, tools=TOOLS).message.content == WEATHER[1]


def test_format_with_a_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "sky": {"type": "string"},
                                               "temperature": {"type": "integer"}},
              "required": ["city", "sky", "temperature"]}
    r = chat(client, "Describe the weather in Oslo as JSON.", format=schema)
    assert json.loads(r.message.content) == json.loads(OSLO)
    assert json.loads(chat(client, "Describe the weather in Oslo as JSON.", format="json").message.content) \
        == json.loads(OSLO)


def test_generate_templated_and_raw(client):
    r = client.generate(model=MODEL, prompt=STORY_ASK)
    assert r.response == STORY and r.done_reason == "stop" and r.context is None
    streamed = list(client.generate(model=MODEL, prompt=SEVEN, think=True, stream=True))
    assert "".join(c.thinking or "" for c in streamed) == "Six sevens make 42."
    assert "".join(c.response for c in streamed) == "The answer is 42."
    raw = client.generate(model=MODEL, prompt="<bos>" + ask(STORY_ASK), raw=True)
    assert raw.response.startswith(STORY)


# ---- the wire ------------------------------------------------------------------------------------


def test_ndjson_lines_and_durations_in_nanoseconds(scripted_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": STORY_ASK}]}
    start = time.perf_counter_ns()
    got, r = lines(scripted_server, "/api/chat", body)
    wall = time.perf_counter_ns() - start
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    *pieces, last = got
    assert all(p["done"] is False and p["model"] == MODEL and p["message"]["role"] == "assistant" for p in pieces)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z", pieces[0]["created_at"])
    assert last["done"] is True and last["done_reason"] == "stop" and last["message"]["content"] == ""
    assert all(type(last[k]) is int for k in FINAL)
    # nanoseconds: the whole request took more than a millisecond and less than the wall clock saw
    assert 10**6 < last["total_duration"] <= wall
    assert 0 < last["prompt_eval_duration"] + last["eval_duration"] <= last["total_duration"]
    assert last["eval_count"] - 1 <= len(pieces) <= last["eval_count"] and last["draft_n"] >= last["draft_n_accepted"] > 0

    whole = httpx.post(scripted_server + "/api/generate", json={"model": MODEL, "prompt": STORY_ASK, "stream": False},
                       headers=AUTH)
    assert whole.headers["content-type"].startswith("application/json")
    assert whole.json()["response"] == STORY and all(type(whole.json()[k]) is int for k in FINAL)


# ---- images, and the README ----------------------------------------------------------------------


def png(seed=0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def test_an_image_in_a_chat(others):
    client = ollama.Client(host=others[0], timeout=60)
    assert client.show(VISION).capabilities == ["completion", "tools", "thinking", "vision"]
    text = {"role": "user", "content": "What is in the picture?"}
    plain = client.chat(model=VISION, messages=[text], options={"num_predict": 3, "temperature": 0})
    seen = client.chat(model=VISION, messages=[{**text, "images": [png()]}],  # bytes: the client sends base64
                       options={"num_predict": 3, "temperature": 0})
    assert seen.done and seen.eval_count == 3
    assert seen.prompt_eval_count > plain.prompt_eval_count + 10  # the image's soft tokens
    raw = httpx.post(others[0] + "/api/generate", json={
        "model": VISION, "prompt": "Describe it.", "images": [base64.b64encode(png(1)).decode()], "stream": False,
        "options": {"num_predict": 2}}).json()
    assert raw["done"] and raw["prompt_eval_count"] > plain.prompt_eval_count


def test_readme_curl_examples_run_as_written(others):
    section = README.read_text().split("## Serve", 1)[1].split("\n## ", 1)[0]
    block = next(code for code in re.findall(r"```sh\n(.*?)```", section, re.DOTALL) if "/api/" in code)
    commands = [line for line in block.splitlines() if line.startswith("curl ")]
    assert len(commands) >= 3 and all("127.0.0.1:8000/api/" in c for c in commands)
    port = others[1].rsplit(":", 1)[1]
    outs = {}
    for command in commands:
        out = subprocess.run(["bash", "-c", command.replace(":8000", ":" + port)], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        outs[command.split()[2].rsplit("/", 1)[1]] = [json.loads(line) for line in out.splitlines() if line]
    (demo,) = outs["tags"][0]["models"]
    assert demo["name"] == "mlx-mtp-demo" and demo["size"] > 0 and demo["details"]["parameter_size"].endswith("M")
    assert outs["chat"][-1]["done"] and len(outs["chat"]) > 2  # streamed: NDJSON lines
    assert outs["generate"][0]["done"] and outs["generate"][0]["response"]
    assert "capabilities" in outs["show"][0]


def test_an_app_built_on_one_engine_serves_it_by_name_and_has_no_store():
    """`create_app(engine, ...)`: the one model, listed as loaded; no pulls or deletes (501); an unload
    request leaves the app's engine as it is."""
    from starlette.testclient import TestClient

    import mlx_mtp
    from mlx_mtp.cli import demo_pair
    from mlx_mtp.server import Settings, create_app, served_model

    loaded = mlx_mtp.load(*demo_pair())
    with mlx_mtp.Engine(loaded) as engine, TestClient(create_app(engine, Settings(served_model(loaded, "m")))) as c:
        assert [(m["id"], m["loaded"]) for m in c.get("/v1/models").json()["data"]] == [("m", True)]
        assert c.get("/v1/models/nope").status_code == 404
        for method, path in (("POST", "/api/pull"), ("DELETE", "/api/delete")):
            r = c.request(method, path, json={"model": "m"})
            assert r.status_code == 501 and "no model store" in r.json()["error"]
        assert c.post("/api/generate", json={"model": "m", "keep_alive": 0}).json()["done_reason"] == "unload"
        assert engine.running and [m["name"] for m in c.get("/api/ps").json()["models"]] == ["m"]
        r = c.post("/api/generate", json={"model": "x", "keep_alive": 0})
        assert r.status_code == 404 and r.json() == {"error": 'model "x" not found, try pulling it first'}
