"""Many models, one server (issue 51), as a user meets it: `python -m mlx_mtp.server --store-only` in a
subprocess over a store of tiny pairs, driven by the official clients (`ollama`, `openai`, `anthropic`,
unchanged) and raw HTTP where a client cannot say it. Pulls come from a Hub faked on the loopback
(tests/fake_hub.py).

Each pair is the dense fixture's target with Gemma 4's tokenizer and the released 31B chat template, and
its drafter as `<name>-assistant`, laid out as a pull lays it out. What a pair reserves in the pool is
test_pool's `need`: its weights, the KV of `--max-batch` rows of its context (512 tokens, the tiny
target's trained context, which caps the default `--num-ctx`) and the prompt cache's half of that.

A stream "in flight" is an OpenAI completion whose `logit_bias` forces one letter for `LONG` tokens,
without drafting (~2 s on a CPU): each such test also checks the stream was still being produced after
the step it was in flight for, so that it cannot pass vacuously.
"""

import contextlib
import datetime
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
from chat_helpers import TINY, gemma4_vocab, write_gemma4_tokenizer
from fake_hub import FakeHub, read_repo
from scripted import TEMPLATE
from test_pool import OPTIONS, need

from apps.serve_load import free_port, start_server, stop_server, wait_healthy
from mlx_mtp.store import Store

ROOT = Path(__file__).resolve().parent.parent
ROWS = OPTIONS["max_batch"]  # --max-batch of every server here: test_pool's `need` counts these rows
CONTEXT = 512  # the tiny pairs' trained context: a store model's KV context when nothing asks for less
TINY_NAME, OTHER, THIRD = "testorg/tiny", "testorg/other", "testorg/third"
BASE = sorted([TINY_NAME, OTHER, THIRD])
PULLED, BUSY, SLOW, ON_DEMAND = "testorg/pulled", "testorg/busy", "testorg/slow", "testorg/ondemand"
TRUNCATED = "bad/trunc"
HI = [{"role": "user", "content": "hi"}]
LETTER = "a"
LONG = 480  # tokens of a stream in flight (the prompt "hi" is 2 tokens of the 512)
WAIT = 60


# ---- the store, the Hub and the servers ------------------------------------------------------------


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    """One tiny pair's files: (the target's with the tokenizer and chat template, the drafter's)."""
    tok = tmp_path_factory.mktemp("tokenizer")
    write_gemma4_tokenizer(tok, TEMPLATE.read_text())
    return {**read_repo(TINY / "target"), **read_repo(tok)}, read_repo(TINY / "drafter")


def install(root: Path, name: str, pair_files) -> None:
    """The pair as `name` and `name-assistant` in the models dir `root`, as a pull lays them out."""
    for repo, files in zip((name, f"{name}-assistant"), pair_files):
        (root / repo).mkdir(parents=True)
        for path, content in files.items():
            (root / repo / path).write_bytes(content)


def base_store(root: Path, pair_files) -> Path:
    for name in BASE:
        install(root, name, pair_files)
    return root


@pytest.fixture(scope="module")
def hub(pair_files):
    """The same pair on a fake Hub under the names the tests pull."""
    target, drafter = pair_files
    repos = {}
    for name in (PULLED, BUSY, SLOW, ON_DEMAND):
        repos[name], repos[f"{name}-assistant"] = dict(target), dict(drafter)
    with FakeHub(repos) as hub:
        yield hub


def server_env(tmp: Path, root: Path, hub) -> dict:
    """A user's environment: the store in `root`, an empty Hugging Face cache, the fake Hub as the Hub."""
    return {**os.environ, "MLX_MTP_MODELS": str(root), "HF_HUB_CACHE": str(tmp / "hf-cache"),
            "HF_HOME": str(tmp / "hf-home"), "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1",
            "PYTHONPATH": str(ROOT)}


def launch(tmp: Path, root: Path, hub, *flags: str):
    """Start `python -m mlx_mtp.server --store-only` over `root`; (its url, process, log path)."""
    port = free_port()
    log = tmp / f"server-{port}.log"
    argv = [sys.executable, "-m", "mlx_mtp.server", "--store-only", "--models-dir", str(root),
            "--max-batch", str(ROWS), "--log-level", "warning", *flags]
    proc = start_server(argv, port, str(log), server_env(tmp, root, hub))
    try:
        wait_healthy(proc, port)
    except (RuntimeError, TimeoutError) as e:  # it exited, or never answered
        proc.kill()
        raise RuntimeError(f"{e}: {log.read_text()[-3000:]}") from None
    return f"http://127.0.0.1:{port}", proc, log


@contextlib.contextmanager
def serving(tmp: Path, root: Path, hub, *flags: str):
    """A server for a module's tests; it must shut down cleanly (status 0) at the end."""
    url, proc, log = launch(tmp, root, hub, *flags)
    try:
        yield url
    finally:
        stop_server(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]


def budget_gb(nbytes: int) -> str:
    """--memory-gb for exactly `nbytes` (the server reads int(GB * 2**30): exact for a float's GB)."""
    gb = nbytes / 2**30
    assert int(float(repr(gb)) * 2**30) == nbytes
    return repr(gb)


@pytest.fixture(scope="module")
def store_server(tmp_path_factory, pair_files, hub):
    """(url, models dir): the base pairs, a truncated checkpoint, and the fake Hub to pull from."""
    tmp = tmp_path_factory.mktemp("store-server")
    root = base_store(tmp / "models", pair_files)
    shutil.copytree(root / TINY_NAME, root / TRUNCATED)
    weights = root / TRUNCATED / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with serving(tmp, root, hub) as url:
        yield url, root


@pytest.fixture(scope="module")
def one_pair_server(tmp_path_factory, pair_files, hub):
    """(url, one pair's reservation): a budget for one pair and a half, so never two; --load-wait 0, so
    that a model the busy one stands in the way of is refused at once."""
    tmp = tmp_path_factory.mktemp("one-pair")
    root = base_store(tmp / "models", pair_files)
    pair = need(Store(root, hf_cache=None), CONTEXT)
    with serving(tmp, root, hub, "--memory-gb", budget_gb(pair * 3 // 2), "--load-wait", "0") as url:
        yield url, pair


@pytest.fixture(scope="module")
def all_pairs_server(tmp_path_factory, pair_files, hub):
    """(url, models dir): a budget for exactly the three pairs at their full context; --num-ctx 128,
    --keep-alive 2m and --pin THIRD."""
    tmp = tmp_path_factory.mktemp("all-pairs")
    root = base_store(tmp / "models", pair_files)
    budget = 3 * need(Store(root, hf_cache=None), CONTEXT)
    flags = ["--memory-gb", budget_gb(budget), "--num-ctx", "128", "--keep-alive", "2m", "--pin", THIRD]
    with serving(tmp, root, hub, *flags) as url:
        yield url, root


# ---- what a user reads back -------------------------------------------------------------------------


def client_of(url: str) -> ollama.Client:
    return ollama.Client(host=url, timeout=WAIT)


def openai_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=WAIT)


def anthropic_of(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=WAIT)


def running(url: str) -> dict:
    """/api/ps as a dict by name."""
    r = httpx.get(url + "/api/ps", timeout=WAIT)
    assert r.status_code == 200
    return {m["name"]: m for m in r.json()["models"]}


def listed(url: str) -> list:
    """/api/tags's names, in its order."""
    r = httpx.get(url + "/api/tags", timeout=WAIT)
    assert r.status_code == 200
    return [m["name"] for m in r.json()["models"]]


def chat(client: ollama.Client, model: str, **kwargs):
    options = {"num_predict": 3, **kwargs.pop("options", {})}
    return client.chat(model=model, messages=HI, options=options, **kwargs)


def unload(client: ollama.Client, model: str) -> None:
    """Ollama's unload: a generate with no prompt and keep_alive 0."""
    assert client.generate(model=model, keep_alive=0).done_reason == "unload"


def long_stream(url: str, model: str):
    """An OpenAI streamed completion of LONG tokens, each LETTER (logit_bias), without drafting."""
    letter = str(gemma4_vocab()[LETTER])
    return openai_of(url).completions.create(model=model, prompt="hi", max_tokens=LONG, stream=True,
                                             logit_bias={letter: 100}, extra_body={"draft_tokens": 0})


def finish(chunks) -> tuple:
    """Read a stream to its end: (its text, its finish_reason, when its last chunk came)."""
    text, reason = "", None
    for chunk in chunks:
        text += chunk.choices[0].text if chunk.choices else ""
        reason = (chunk.choices[0].finish_reason if chunk.choices else None) or reason
    return text, reason, time.monotonic()


def expires_in(entry: dict) -> float:
    """Seconds until a /api/ps entry's model unloads."""
    when = datetime.datetime.fromisoformat(entry["expires_at"].replace("Z", "+00:00"))
    return (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds()


def not_found(name: str) -> str:
    """Ollama's 404 for a model it does not have."""
    return f'model "{name}" not found, try pulling it first'


def wait_until(check, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ---- Ollama's client ----------------------------------------------------------------------------------


def test_ollama_list_and_show_name_every_store_model_without_loading_any(store_server):
    """`list` has each store model (and not the truncated one) with its weights' bytes; `show` reads a
    store model's config and template without loading it; neither loads anything."""
    url, root = store_server
    client = client_of(url)
    for name in BASE:
        unload(client, name)
    store = Store(root, hf_cache=None)
    models = client.list().models
    assert [m.model for m in models] == BASE
    assert all(m.size == store.resolve(m.model).bytes and len(m.digest) == 64 for m in models)
    assert all(m.details.family == "gemma4" and m.details.format == "mlx" for m in models)
    shown = client.show(OTHER)
    assert shown.modelinfo["gemma4.context_length"] == CONTEXT and shown.template == TEMPLATE.read_text()
    assert shown.capabilities[0] == "completion" and "thinking" in shown.capabilities
    assert client.ps().models == [] and running(url) == {}
    with pytest.raises(ollama.ResponseError) as e:
        client.show("testorg/absent")
    assert e.value.status_code == 404 and e.value.error == not_found("testorg/absent")


def test_ollama_chat_loads_a_store_model_on_demand_whole_and_streamed(store_server):
    """A chat naming a store model loads it (its load counted in load_duration) and answers; `ps` then
    lists it with what it reserves, its context, and an `expires_at` the keep_alive away (the server's
    5 minutes by default, the request's when it sends one)."""
    url, root = store_server
    client = client_of(url)
    unload(client, TINY_NAME)
    assert TINY_NAME not in running(url)
    whole = chat(client, TINY_NAME)
    assert whole.done and whole.model == TINY_NAME and whole.message.role == "assistant"
    assert 1 <= whole.eval_count <= 3 and whole.load_duration > 0 and whole.prompt_eval_count > 10
    (ps,) = [m for m in client.ps().models if m.model == TINY_NAME]
    assert ps.size == ps.size_vram == need(Store(root, hf_cache=None), CONTEXT)
    assert ps.context_length == CONTEXT
    assert 290 < (ps.expires_at - datetime.datetime.now(datetime.timezone.utc)).total_seconds() <= 300.5

    chunks = list(chat(client, TINY_NAME, stream=True, keep_alive="10m"))
    assert chunks[-1].done and all(not c.done for c in chunks[:-1]) and chunks[-1].model == TINY_NAME
    assert 1 <= chunks[-1].eval_count <= 3 and len(chunks) <= chunks[-1].eval_count + 1
    assert 590 < expires_in(running(url)[TINY_NAME]) <= 600.5


def test_keep_alive_0_unloads_after_the_request_and_an_empty_generate_unloads(store_server):
    """keep_alive 0 on a chat answers it, then unloads the model; a generate with no prompt and
    keep_alive 0 unloads a loaded model, and loads nothing that was not loaded."""
    url, _ = store_server
    client = client_of(url)
    answered = chat(client, OTHER, keep_alive=0)
    assert answered.done and answered.eval_count >= 1
    assert OTHER not in running(url)
    chat(client, OTHER)
    assert OTHER in running(url)
    gone = client.generate(model=OTHER, keep_alive=0)
    assert (gone.done, gone.done_reason, gone.response) == (True, "unload", "")
    assert OTHER not in running(url)
    assert client.generate(model=OTHER, keep_alive=0).done_reason == "unload" and OTHER not in running(url)
    streamed = list(chat(client, OTHER, stream=True, keep_alive=0))
    assert streamed[-1].done
    assert wait_until(lambda: OTHER not in running(url), 5)  # once the stream's lease is back


def test_a_pull_streams_progress_then_the_model_is_listed_answers_and_is_deleted(store_server, pair_files):
    """`pull` streams Ollama's progress lines (each file's total and completed bytes) ending in success;
    the model is then listed and answers; `delete` removes it: not listed, its files gone, and the next
    chat (and delete) of it is Ollama's 404."""
    url, root = store_server
    client = client_of(url)
    progress = list(client.pull(PULLED, stream=True))
    assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
    downloads = [p for p in progress if p.status.startswith("downloading ")]
    last = {p.digest: p for p in downloads}
    assert all(p.status == f"downloading {p.digest}" and p.total is not None for p in downloads)
    assert all(p.completed == p.total for p in last.values())
    weights = sorted(len(files["model.safetensors"]) for files in pair_files)
    assert sorted(p.total for d, p in last.items() if d.startswith("sha256:")) == weights
    assert [m.model for m in client.list().models] == sorted(BASE + [PULLED])

    answered = chat(client, PULLED)
    assert answered.done and answered.model == PULLED and answered.eval_count >= 1
    assert PULLED in running(url)

    assert client.delete(PULLED).status == "success"
    assert [m.model for m in client.list().models] == BASE
    assert not (root / PULLED).exists() and not (root / f"{PULLED}-assistant").exists()
    assert PULLED not in running(url)
    with pytest.raises(ollama.ResponseError) as e:
        chat(client, PULLED)
    assert e.value.status_code == 404 and e.value.error == not_found(PULLED)
    with pytest.raises(ollama.ResponseError) as e:
        client.delete(PULLED)
    assert e.value.status_code == 404


# ---- OpenAI's and Anthropic's clients ---------------------------------------------------------------


def test_openai_lists_every_store_model_with_loaded_flags_that_follow_the_requests(store_server):
    """/v1/models has every store model with `loaded`; a chat naming an unloaded one loads it (its flag
    turns true), and keep_alive 0 in the body unloads it after (the flag turns false again)."""
    url, _ = store_server
    client = openai_of(url)
    unload(client_of(url), THIRD)
    flags = {m.id: m.loaded for m in client.models.list().data}
    assert sorted(flags) == BASE and flags[THIRD] is False
    reply = client.chat.completions.create(model=THIRD, messages=HI, max_tokens=3)
    assert reply.model == THIRD and 1 <= reply.usage.completion_tokens <= 3
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert {m.id: m.loaded for m in client.models.list().data}[THIRD] is True
    assert client.models.retrieve(THIRD).loaded is True

    text = client.completions.create(model=THIRD, prompt="hi", max_tokens=2, extra_body={"keep_alive": 0})
    assert text.model == THIRD and 1 <= text.usage.completion_tokens <= 2
    assert {m.id: m.loaded for m in client.models.list().data}[THIRD] is False
    assert THIRD not in running(url)
    client.chat.completions.create(model=THIRD, messages=HI, max_tokens=2, extra_body={"keep_alive": "10m"})
    assert 590 < expires_in(running(url)[THIRD]) <= 600.5


def test_openai_unknown_model_is_404_and_no_model_is_400(store_server):
    """A name the store lacks: 404 model_not_found on both OpenAI routes; no `model` at all on a
    store-only server (which has no default): 400 naming the param."""
    url, _ = store_server
    client = openai_of(url)
    for call in (lambda: client.chat.completions.create(model="testorg/absent", messages=HI, max_tokens=2),
                 lambda: client.completions.create(model="testorg/absent", prompt="hi", max_tokens=2),
                 lambda: client.models.retrieve("testorg/absent")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.status_code == 404 and e.value.code == "model_not_found"
    r = httpx.post(url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2}, timeout=WAIT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "model is required" in r.json()["error"]["message"]


def test_anthropic_messages_name_a_store_model(store_server):
    """Anthropic's client: a message to a store model is answered by it (loaded on demand, rendered by
    its chat template), keep_alive 0 in the body unloads it after; an unknown model is Anthropic's
    not_found_error."""
    url, _ = store_server
    client = anthropic_of(url)
    unload(client_of(url), OTHER)
    reply = client.messages.create(model=OTHER, max_tokens=3, messages=HI)
    assert reply.model == OTHER and reply.type == "message" and reply.role == "assistant"
    usage = reply.usage
    assert 1 <= usage.output_tokens <= 3 and reply.stop_reason in ("end_turn", "max_tokens")
    cached = (usage.cache_creation_input_tokens or 0) + (usage.cache_read_input_tokens or 0)
    assert usage.input_tokens + cached > 10  # the rendered template (the prefix cache's part counted apart)
    assert OTHER in running(url)
    client.messages.create(model=OTHER, max_tokens=2, messages=HI, extra_body={"keep_alive": 0})
    assert OTHER not in running(url)
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="testorg/absent", max_tokens=3, messages=HI)
    assert e.value.status_code == 404 and e.value.body["error"]["type"] == "not_found_error"


# ---- budgets ---------------------------------------------------------------------------------------


def test_a_budget_for_one_pair_keeps_only_the_last_model_used(one_pair_server):
    """With room for one pair, each request for another model evicts the idle one: `ps` lists only the
    last model used, reserving one pair's bytes, and each model still answers."""
    url, pair = one_pair_server
    client = client_of(url)
    for name in (TINY_NAME, OTHER, OTHER, TINY_NAME, THIRD):
        answered = chat(client, name)
        assert answered.done and answered.model == name
        ps = running(url)
        assert list(ps) == [name] and ps[name]["size"] == pair


def test_a_budget_for_all_pairs_evicts_none(all_pairs_server):
    """With room for every pair, using them in turn loads each once and evicts nothing."""
    url, _ = all_pairs_server
    client = client_of(url)
    for name in BASE * 2:
        chat(client, name)
        assert name in running(url)
    assert sorted(running(url)) == BASE


def test_num_ctx_sets_the_kv_a_store_model_reserves(all_pairs_server):
    """--num-ctx 128 is what a store model's KV is reserved for when a request does not ask (`ps`:
    context_length 128, that reservation's bytes); `options.num_ctx` asking more grows it, less keeps it."""
    url, root = all_pairs_server
    client = client_of(url)
    store = Store(root, hf_cache=None)
    unload(client, TINY_NAME)
    chat(client, TINY_NAME)
    ps = running(url)[TINY_NAME]
    assert (ps["context_length"], ps["size"]) == (128, need(store, 128))
    chat(client, TINY_NAME, options={"num_ctx": 256})
    assert running(url)[TINY_NAME]["context_length"] == 256
    chat(client, TINY_NAME, options={"num_ctx": 64})
    assert running(url)[TINY_NAME]["context_length"] == 256


def test_keep_alive_and_pin_flags_set_when_a_store_model_unloads(all_pairs_server):
    """--keep-alive 2m: a model used without keep_alive unloads 2 minutes after; --pin: the pinned model,
    once loaded, never expires (`expires_at` in the year 9999): neither keep_alive 0 nor a client's unload
    (an empty generate with keep_alive 0) unloads what the server pinned."""
    url, _ = all_pairs_server
    client = client_of(url)
    chat(client, OTHER)
    assert 110 < expires_in(running(url)[OTHER]) <= 120.5
    chat(client, THIRD, keep_alive=0)
    assert running(url)[THIRD]["expires_at"].startswith("9999-")
    client.generate(model=THIRD, keep_alive=0)
    assert running(url)[THIRD]["expires_at"].startswith("9999-")


# ---- faults ----------------------------------------------------------------------------------------


def test_a_model_that_cannot_fit_is_refused_in_each_apis_shape_and_evicts_nothing_in_use(one_pair_server):
    """While one pair streams (the whole budget in use), a request for another pair is refused at once
    (--load-wait 0; test_a_request_waits_... shows the default):
    Ollama's 500 `{"error"}`, OpenAI's 507 insufficient_memory, Anthropic's 507 api_error, each naming
    the bytes needed and free. The stream goes on to its end, the streaming pair stays loaded, nothing
    else is; once it is idle, the other pair loads in its place."""
    url, pair = one_pair_server
    client = client_of(url)
    chat(client, TINY_NAME)
    chunks = iter(long_stream(url, TINY_NAME))
    assert next(chunks).choices[0].text == LETTER
    # a second pair needs `pair` bytes; the budget is pair * 3 // 2, of which the streaming pair holds `pair`
    words = [f"({pair} bytes)", f"({pair * 3 // 2 - pair} bytes)", TINY_NAME, f"model '{OTHER}'"]

    with pytest.raises(ollama.ResponseError) as e:
        chat(client, OTHER)
    assert e.value.status_code == 500 and all(w in e.value.error for w in words), e.value.error
    body = {"model": OTHER, "prompt": "hi", "raw": True, "stream": False}
    raw = httpx.post(url + "/api/generate", json=body, timeout=WAIT)
    assert raw.status_code == 500 and list(raw.json()) == ["error"]
    with pytest.raises(openai.APIStatusError) as e:
        openai_of(url).chat.completions.create(model=OTHER, messages=HI, max_tokens=2)
    assert e.value.status_code == 507 and e.value.code == "insufficient_memory"
    assert all(w in e.value.message for w in words), e.value.message
    with pytest.raises(anthropic.APIStatusError) as e:
        anthropic_of(url).messages.create(model=OTHER, max_tokens=2, messages=HI)
    assert e.value.status_code == 507 and e.value.body["type"] == "error"
    assert all(w in e.value.body["error"]["message"] for w in words)
    refused = time.monotonic()
    assert list(running(url)) == [TINY_NAME]

    text, reason, ended = finish(chunks)
    assert text == LETTER * (LONG - 1) and reason == "length"
    assert ended - refused > 0.1, "the stream had ended before the refusals: nothing was in flight"
    assert list(running(url)) == [TINY_NAME]
    assert httpx.get(url + "/health", timeout=WAIT).json() == {"status": "ok"}
    assert chat(client, OTHER).done and list(running(url)) == [OTHER]


def test_a_request_waits_for_the_model_in_use_to_finish_then_takes_its_place(tmp_path, pair_files, hub):
    """By default (--load-wait 300), a request for a model that only a busy one stands in the way of waits
    for it to finish, as Ollama's scheduler waits, and is answered once the busy one is evicted."""
    root = base_store(tmp_path / "models", pair_files)
    pair = need(Store(root, hf_cache=None), CONTEXT)
    with serving(tmp_path, root, hub, "--memory-gb", budget_gb(pair * 3 // 2)) as url:
        chunks = iter(long_stream(url, TINY_NAME))
        assert next(chunks).choices[0].text == LETTER
        answered = []
        waiter = threading.Thread(target=lambda: answered.append((chat(client_of(url), OTHER), time.monotonic())))
        waiter.start()
        text, reason, ended = finish(chunks)
        waiter.join(WAIT)
        (reply, when), = answered
        assert text == LETTER * (LONG - 1) and reply.done and when > ended  # answered after the stream ended
        assert reply.load_duration > 0.1e9  # its wait is its load_duration, as Ollama counts it
        assert list(running(url)) == [OTHER]


def test_a_model_deleted_while_it_streams_finishes_the_stream_then_is_404(store_server):
    """A model deleted with a stream in flight: the delete answers at once and the model is no longer
    listed; the stream goes on to its last token; the next request for it is a 404 on each API."""
    url, root = store_server
    client = client_of(url)
    pulled = httpx.post(url + "/api/pull", json={"model": BUSY, "stream": False}, timeout=WAIT)
    assert pulled.status_code == 200 and pulled.json() == {"status": "success"}
    chunks = iter(long_stream(url, BUSY))
    assert next(chunks).choices[0].text == LETTER

    assert client.delete(BUSY).status == "success"
    deleted = time.monotonic()
    assert BUSY not in listed(url) and not (root / BUSY).exists()
    assert BUSY in running(url)  # still loaded, and holding its memory, while its stream runs
    text, reason, ended = finish(chunks)
    assert text == LETTER * (LONG - 1) and reason == "length"
    assert ended - deleted > 0.1, "the stream had ended before the delete: nothing was in flight"
    assert wait_until(lambda: BUSY not in running(url))  # unloaded once its last request ended

    with pytest.raises(ollama.ResponseError) as e:
        chat(client, BUSY)
    assert e.value.status_code == 404 and e.value.error == not_found(BUSY)
    with pytest.raises(openai.NotFoundError) as e:
        openai_of(url).completions.create(model=BUSY, prompt="hi", max_tokens=2)
    assert e.value.code == "model_not_found"
    assert listed(url) == BASE


def test_a_truncated_checkpoint_is_not_listed_and_naming_it_is_a_404(store_server):
    """A store directory whose safetensors file is cut short is on no listing; a request naming it is a
    404 on each API, and the server serves on."""
    url, _ = store_server
    assert TRUNCATED not in listed(url) and TRUNCATED not in [m.id for m in openai_of(url).models.list().data]
    with pytest.raises(ollama.ResponseError) as e:
        chat(client_of(url), TRUNCATED)
    assert e.value.status_code == 404 and e.value.error == not_found(TRUNCATED)
    with pytest.raises(openai.NotFoundError) as e:
        openai_of(url).chat.completions.create(model=TRUNCATED, messages=HI, max_tokens=2)
    assert e.value.code == "model_not_found" and "truncated" in e.value.message  # and why
    assert httpx.get(url + "/health", timeout=WAIT).status_code == 200
    assert chat(client_of(url), TINY_NAME).done


def test_a_server_killed_mid_pull_lists_nothing_half_and_the_next_pull_completes(tmp_path, hub):
    """kill -9 of the server while /api/pull downloads (the target's weights slowly): the server started
    again on the same store lists nothing (neither the target nor its drafter alone), the next /api/pull
    fetches only what was left (the drafter was done) and ends in success, and the model answers."""
    root = tmp_path / "models"
    partial = root / ".partial" / f"{SLOW.replace('/', '--')}-assistant" / "model.safetensors"
    before = {repo: hub.gets(repo, "model.safetensors") for repo in (SLOW, f"{SLOW}-assistant")}
    hub.slow[SLOW] = 100_000  # the target's weights take ~10 s
    url, proc, log = launch(tmp_path, root, hub)
    lines, errors = [], []

    def pull():
        try:
            with httpx.stream("POST", url + "/api/pull", json={"model": SLOW}, timeout=WAIT) as r:
                lines.extend(json.loads(line) for line in r.iter_lines() if line)
        except httpx.HTTPError as e:  # the server is killed mid-stream
            errors.append(e)

    puller = threading.Thread(target=pull)
    puller.start()
    try:
        assert hub.event(hub.started, SLOW, "model.safetensors").wait(WAIT), log.read_text()[-3000:]
        assert wait_until(partial.exists, 20) and proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(WAIT) == -signal.SIGKILL
        puller.join(WAIT)
    finally:
        hub.slow.clear()
        proc.kill()
    assert errors and not any(line.get("status") == "success" for line in lines)
    assert any(line.get("status", "").startswith("downloading ") for line in lines)  # progress was streaming

    with serving(tmp_path, root, hub) as again:
        assert listed(again) == [] and openai_of(again).models.list().data == []
        with httpx.stream("POST", again + "/api/pull", json={"model": SLOW}, timeout=WAIT) as r:
            progress = [json.loads(line) for line in r.iter_lines() if line]
        assert r.status_code == 200 and progress[-1] == {"status": "success"}
        assert listed(again) == [SLOW]
        answered = chat(client_of(again), SLOW)
        assert answered.done and answered.model == SLOW and answered.eval_count >= 1
    fetched = {repo: hub.gets(repo, "model.safetensors") - n for repo, n in before.items()}
    assert fetched == {SLOW: 2, f"{SLOW}-assistant": 1}


def test_allow_pull_pulls_a_model_the_store_lacks_when_a_request_names_it(tmp_path, hub):
    """--allow-pull: a chat naming a model that is on the Hub but not in the store pulls it (target and
    drafter), then answers; it is listed and loaded after, and a second request pulls nothing."""
    root = tmp_path / "models"
    before = hub.gets(ON_DEMAND, "model.safetensors")
    with serving(tmp_path, root, hub, "--allow-pull") as url:
        assert listed(url) == []
        client = client_of(url)
        answered = chat(client, ON_DEMAND)
        assert answered.done and answered.model == ON_DEMAND and answered.eval_count >= 1
        assert listed(url) == [ON_DEMAND] and ON_DEMAND in running(url)
        assert Store(root, hf_cache=None).resolve(ON_DEMAND).drafter.name == f"{ON_DEMAND}-assistant"
        reply = openai_of(url).chat.completions.create(model=ON_DEMAND, messages=HI, max_tokens=2)
        assert reply.model == ON_DEMAND
        # neither in the store nor on the Hub: a 404, as for any model that is not there
        with pytest.raises(openai.NotFoundError) as e:
            openai_of(url).chat.completions.create(model="testorg/nowhere", messages=HI, max_tokens=2)
        assert e.value.code == "model_not_found" and "not found on the Hub" in e.value.message
        with pytest.raises(ollama.ResponseError) as e:
            chat(client, "testorg/nowhere")
        assert e.value.status_code == 404 and e.value.error == not_found("testorg/nowhere")
    assert hub.gets(ON_DEMAND, "model.safetensors") - before == 1
