"""The OpenAI-compatible server, driven live: the README's start command serves the demo pair on a
free loopback port (one server for the module), a second one (`python -m mlx_mtp.server`) has an
API key. Requests go through the official `openai` client, or raw HTTP where it cannot send them."""

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

import mlx_mtp
from apps.serve_load import free_port, run_clients, start_server, stop_server, stream, wait_healthy
from mlx_mtp.demo import load_demo
from mlx_mtp.server.metrics import parse as parse_metrics

README = Path(__file__).resolve().parents[1] / "README.md"
MODEL = "mlx-mtp-demo"
KEY = "sk-test-key"
MAX_QUEUE, MAX_BATCH, MAX_BODY = 8, 8, 64 << 10
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add two numbers."}]
LONG = {"prompt": "import os\n", "max_tokens": 1500, "temperature": 0}  # runs to length: greedy loops


def readme_blocks() -> list:
    """The fenced code blocks of the README's "Serve" section."""
    section = README.read_text().split("## Serve", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w*)\n(.*?)```", section, re.S)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(url, keyed url, logs): both started at once, so their start-up overlaps; the keyed one runs
    with the prefix cache off."""
    logs = tmp_path_factory.mktemp("server")
    start = readme_blocks()[0][1].split("#")[0].split()
    assert start == ["mlx-mtp-server"]
    start[0] = str(Path(sys.executable).parent / start[0])  # the console script of this environment
    port, keyed_port = free_port(), free_port()
    limits = ["--max-queue", str(MAX_QUEUE), "--max-batch", str(MAX_BATCH), "--max-body-bytes", str(MAX_BODY)]
    procs = [
        start_server([*start, *limits, "--log-level", "warning"], port, str(logs / "server.log")),
        start_server([sys.executable, "-m", "mlx_mtp.server", "--api-key", KEY, "--log-level", "warning",
                      "--prompt-cache-bytes", "0"], keyed_port, str(logs / "keyed.log")),
    ]
    try:
        for proc, p in zip(procs, (port, keyed_port)):
            wait_healthy(proc, p)
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{keyed_port}", logs
    finally:
        for proc in procs:
            stop_server(proc)
    for proc in procs:
        assert proc.returncode == 0, (logs / "server.log").read_text() + (logs / "keyed.log").read_text()


@pytest.fixture(scope="module")
def url(servers):
    return servers[0]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def loaded():
    return load_demo()


def metrics(url) -> dict:
    return parse_metrics(httpx.get(url + "/metrics").text)


def wait_idle(url, within: float) -> dict:
    """Metrics once nothing runs or waits; fails after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        m = metrics(url)
        if m["mlx_mtp:num_requests_running"] == 0 and m["mlx_mtp:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, f"still busy after {within} s: {m}"
        time.sleep(0.02)


def assert_serving(url) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": "x = ", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# ---- answers --------------------------------------------------------------------------------------


def test_models_and_health(client, url):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_chat_answer_is_the_models_greedy_reply_with_usage_and_timings(client, loaded):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    ids = loaded.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)  # with the system message
    expected = mlx_mtp.generate(loaded, ids, max_tokens=24)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason == "length"
    u, t = r.usage, r.timings
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(ids), 24, len(ids) + 24)
    assert (t["prompt_n"] + t["cache_n"], t["predicted_n"]) == (len(ids), 24)
    assert u.prompt_tokens_details.cached_tokens == t["cache_n"]
    assert min(t["prompt_ms"], t["predicted_ms"], t["prompt_per_second"], t["predicted_per_second"]) > 0
    assert 0 < t["draft_n"] and 0 <= t["draft_n_accepted"] <= t["draft_n"]  # MTP ran
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                           extra_body={"mtp": False})
    assert plain.choices[0].message.content == expected.text and plain.timings["draft_n"] == 0


def test_chat_stream_equals_the_answer_and_ends_with_timings_and_usage(client):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"draft_tokens": 2}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    final, usage = chunks[-2], chunks[-1]
    assert final.choices[0].finish_reason == "length" and final.timings["predicted_n"] == 20
    assert usage.choices == [] and usage.usage.completion_tokens == 20
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completions_of_text_and_of_token_ids(client, loaded):
    prompt = "def fib(n):"
    expected = mlx_mtp.generate(loaded, prompt, max_tokens=16).text
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == expected and r.usage.completion_tokens == 16
    ids = loaded.tokenizer.encode(prompt)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0)
    assert r.choices[0].text == expected
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].timings["predicted_n"] == 16


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="def main():", max_tokens=24, temperature=1.0,
                                         seed=seed).choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


# ---- stop strings ---------------------------------------------------------------------------------


def drafted_pair_stop(loaded, **request) -> tuple:
    """The request's greedy token events (the server's too, rounds included) and a stop string
    made of the end of one accepted draft's text and the start of the next one's (so its round
    goes on past it), found first there: (events, k, stop, at), tokens k and k + 1 making it,
    the text before it ending at `at`."""
    with mlx_mtp.Engine(loaded) as engine:  # to see which tokens were drafts
        events = list(engine.submit(mlx_mtp.Request(**request, draft_tokens=3)))[:-1]
    pieces = [e.text for e in events]
    text = "".join(pieces)
    for k in range(4, len(pieces) - 1):  # past the first rounds
        left, right = pieces[k][-2:], pieces[k + 1][:2]
        at = len("".join(pieces[: k + 1])) - len(left)
        drafts = events[k].from_draft and events[k + 1].from_draft
        if drafts and left and right and text.find(left + right) == at:
            return events, k, left + right, at
    pytest.fail(f"no usable pair of drafts in {pieces}")


def test_a_stop_string_inside_a_draft_round_ends_the_generation(client, url, loaded):
    base = {"prompt": "def fib(n):", "max_tokens": 40, "temperature": 0, "extra_body": {"draft_tokens": 3}}
    events, k, stop, at = drafted_pair_stop(loaded, prompt=base["prompt"], max_tokens=40)
    text = "".join(e.text for e in events)
    chunks = list(client.completions.create(model=MODEL, stream=True, **base))
    assert [c.choices[0].text for c in chunks if not c.choices[0].finish_reason] == [e.text for e in events]
    r = client.completions.create(model=MODEL, stop=[stop, "never appears"], **base)
    assert r.choices[0].text == text[:at] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == k + 2  # up to the token that completed the stop string
    generated = r.model_extra["timings"]["predicted_n"]
    assert generated <= k + 2 + 2 * 4 < 40  # its round, and the one queued after it at most
    streamed = list(client.completions.create(model=MODEL, stream=True, stop=stop, **base))
    assert "".join(c.choices[0].text for c in streamed) == text[:at]  # nothing past (or of) the stop string
    assert streamed[-1].choices[0].finish_reason == "stop" and streamed[-1].model_extra["timings"]["predicted_n"] < 40
    assert wait_idle(url, 2)  # the request ended with its stop string


def test_a_stop_sequence_inside_a_draft_round_on_the_anthropic_api(url, loaded):
    # the chat format the demo target learnt (apps/demo_pair/data.py): its reply does not repeat one piece
    messages = [{"role": "user", "content": "Write a Python function `add`: Return a + b."}]
    events, k, stop, at = drafted_pair_stop(loaded, messages=messages, max_tokens=40)
    text = "".join(e.text for e in events)
    claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60)
    base = dict(model=MODEL, messages=messages, max_tokens=40, extra_body={"draft_tokens": 3, "temperature": 0})
    before = wait_idle(url, 2)["mlx_mtp:generation_tokens_total"]
    r = claude.messages.create(stop_sequences=[stop, "never appears"], **base)
    assert [b.text for b in r.content] == [text[:at]] and r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.usage.output_tokens == k + 2
    generated = wait_idle(url, 2)["mlx_mtp:generation_tokens_total"] - before
    assert generated <= k + 2 + 2 * 4 < 40  # generation stopped with the stop string
    with claude.messages.stream(stop_sequences=[stop], **base) as stream:
        sent = "".join(stream.text_stream)
        assert sent == text[:at] and stream.get_final_message().stop_sequence == stop


# ---- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body, param, code", [
    ("/v1/chat/completions", b"{not json", None, "invalid_json"),
    ("/v1/chat/completions", b"[1, 2]", None, "invalid_value"),
    ("/v1/chat/completions", {"messages": []}, "messages", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, "messages[0]", "invalid_value"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, "temperature", "invalid_value"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 1.5}, "top_p", "invalid_value"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": [""]}, "stop", "invalid_value"),
    ("/v1/chat/completions", {"messages": CHAT, "draft_tokens": 99}, "draft_tokens", "invalid_value"),
    ("/v1/chat/completions", {"messages": CHAT, "mtp": "yes"}, "mtp", "invalid_value"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2}, "n", "unsupported"),
    ("/v1/completions", {"prompt": []}, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": [5] * 2100}, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 3000}], "stream": True},
     "messages", "context_length_exceeded"),
])
def test_bad_requests_get_400_and_the_server_goes_on(url, path, body, param, code):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(url + path, **kwargs)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert error["message"]
    assert_serving(url)


def test_openai_client_sees_n_above_1_and_an_unknown_model_refused(client, url):
    with pytest.raises(openai.BadRequestError, match="one choice per request"):
        client.chat.completions.create(model=MODEL, messages=CHAT, n=2)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-5", messages=CHAT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")
    assert_serving(url)


def test_unknown_routes_and_methods_get_error_objects(url):
    r = httpx.get(url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_body_over_the_limit_gets_413(url):
    big = {"prompt": "a" * MAX_BODY, "max_tokens": 1}
    r = httpx.post(url + "/v1/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit holds while reading
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"a" * 1024
        yield b'"}'

    r = httpx.post(url + "/v1/completions", content=chunks())
    assert r.status_code == 413
    assert_serving(url)


def test_api_key_is_required_when_set(servers):
    keyed = servers[1]
    assert httpx.get(keyed + "/health").status_code == 200  # health and metrics stay open
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(keyed + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=keyed + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_start_up_says_what_the_prefix_cache_is_once(servers):
    plain, keyed = [(servers[2] / name).read_text() for name in ("server.log", "keyed.log")]
    assert re.search(r"prefix cache [\d.]+ [KMG]iB;", plain) and "prefix cache off" not in plain
    assert "prefix cache off;" in keyed and not re.search(r"prefix cache [\d.]+ [KMG]iB", keyed)
    assert "context 2048 tokens" in keyed


def test_a_forced_tool_call_on_a_template_without_tool_calls_is_one_clear_line(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, tools=tools, tool_choice="required", max_tokens=5)
    assert e.value.body["message"] == "`mlx-mtp-demo`'s chat template has no tool calls: a tool_choice cannot force one"
    assert e.value.body["param"] == "tool_choice"


def test_queue_full_gets_429_with_retry_after(url):
    n = MAX_BATCH + MAX_QUEUE + 4
    before = metrics(url)["mlx_mtp:requests_total"]

    async def flood():
        async with httpx.AsyncClient(timeout=60) as http:
            tasks = [asyncio.create_task(http.post(url + "/v1/completions", json=LONG)) for _ in range(n)]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until every request is either refused or accepted
                done, pending = await asyncio.wait(tasks, timeout=0.05)
                page = parse_metrics((await http.get(url + "/metrics")).text)
                accepted = page["mlx_mtp:requests_total"] - before
                if len(done) + accepted == n:
                    break
            for task in pending:
                task.cancel()  # the clients go away: the server cancels their queued and running requests
            await asyncio.gather(*pending, return_exceptions=True)
            return [t.result() for t in done], len(pending)

    refused, accepted = asyncio.run(flood())
    assert refused and all(r.status_code == 429 for r in refused)
    assert all(r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "rate_limit_exceeded"
               for r in refused)
    assert accepted >= MAX_QUEUE  # the queue filled up before anyone was refused
    wait_idle(url, 5)
    assert_serving(url)


def test_client_disconnecting_mid_stream_cancels_its_request(url):
    before = metrics(url)["mlx_mtp:generation_tokens_total"]
    with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(5):
            assert next(lines).startswith("data: {")
            next(lines)  # the blank line after each event
        assert metrics(url)["mlx_mtp:num_requests_running"] == 1
    after = wait_idle(url, 2)
    assert after["mlx_mtp:generation_tokens_total"] - before < LONG["max_tokens"] / 2


def test_metrics_count_each_request(client, url):
    before = metrics(url)
    r = client.completions.create(model=MODEL, prompt="class Stack:\n", max_tokens=32, temperature=0,
                                  extra_body={"draft_tokens": 3})
    after = metrics(url)

    def delta(name):
        return after["mlx_mtp:" + name] - before["mlx_mtp:" + name]

    t = r.timings
    assert delta("requests_total") == 1 and delta("prompt_tokens_total") == t["prompt_n"]
    assert delta("generation_tokens_total") == t["predicted_n"] == 32
    assert delta("spec_decode_num_draft_tokens_total") == t["draft_n"] > 0
    assert delta("spec_decode_num_accepted_tokens_total") == t["draft_n_accepted"]
    drafts = delta("spec_decode_num_drafts_total")
    assert 0 < drafts <= t["draft_n"] <= 3 * drafts  # 1 to K = 3 drafts per verify forward
    per_pos = sum(after[k] - before.get(k, 0) for k in after if "per_pos" in k)
    assert per_pos == t["draft_n_accepted"]
    # the pool's gauges: the one model the server started with, within the budget
    ps = httpx.get(url + "/api/ps").json()["models"]
    assert after["mlx_mtp:models_loaded"] == len(ps) == 1
    assert after["mlx_mtp:pool_reserved_bytes"] == ps[0]["size"] <= after["mlx_mtp:pool_budget_bytes"]


def test_a_growing_conversation_prefills_only_what_is_new(client, url):
    """An agent re-sends the whole conversation each call: the prefix cache restores what the
    last call computed, and every figure says so (usage, timings, /metrics)."""
    messages = [{"role": "system", "content": "You write Python. " * 8}, {"role": "user", "content": "Sort a list."}]
    before, answers = metrics(url), []
    for call in range(3):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
        answers.append(r)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"Now call it on [{call}, 3, 1]."}]
    after = metrics(url)
    for previous, r in zip(answers, answers[1:]):
        cached, t = r.usage.prompt_tokens_details.cached_tokens, r.timings
        assert cached == t["cache_n"] >= previous.usage.prompt_tokens  # the last call's prompt, whole
        assert r.usage.prompt_tokens == cached + t["prompt_n"] and t["prompt_n"] < 60
    hits = sum(r.usage.prompt_tokens_details.cached_tokens for r in answers)
    assert after["mlx_mtp:prefix_cache_hits_total"] - before["mlx_mtp:prefix_cache_hits_total"] == hits
    queries = after["mlx_mtp:prefix_cache_queries_total"] - before["mlx_mtp:prefix_cache_queries_total"]
    assert queries == sum(r.usage.prompt_tokens for r in answers)
    assert after["mlx_mtp:prefix_cache_bytes"] > 0


def test_engine_queue_limit_and_metrics(loaded):
    """The two engine additions the server relies on, on the Engine itself."""
    from mlx_mtp.engine.engine import Engine, QueueFull, Request

    with Engine(loaded, max_queue=1) as engine:
        running = engine.submit(Request(prompt="import os\n", max_tokens=1500, draft_tokens=2))
        events = running.events(60)
        for _ in range(12):  # it runs, and has drafted
            assert next(events).kind == "token"
        waiting = engine.submit(Request(prompt="x", max_tokens=4))
        with pytest.raises(QueueFull):
            engine.submit(Request(prompt="y", max_tokens=4))
        m = engine.metrics()
        assert (m["requests_running"], m["requests_waiting"], m["requests_total"]) == (1, 1, 2)
        running.cancel()
        stats = list(events)[-1].stats
        waiting.result(60)
        m = engine.metrics()
        assert (m["requests_running"], m["requests_waiting"]) == (0, 0)
        assert m["spec_draft_tokens"] >= stats.drafted > 0 and m["spec_drafts"] >= stats.rounds
        assert m["spec_accepted_per_pos"][0] >= stats.accepted_at[0]


# ---- load ----------------------------------------------------------------------------------------


def test_concurrent_streams_each_equal_their_solo_output(url):
    prompts = ["import os\n", "def fib(n):", "class Stack:\n", "def parse(argv):", "import json\n",
               "def __init__(self, name):", "for i in range(10):", "try:\n    import ssl\n"]
    body = {"max_tokens": 12, "temperature": 0}
    solo = [stream(url, "/v1/completions", {**body, "prompt": p, "mtp": False}).text for p in prompts]
    modes = [{"mtp": True}, {"mtp": False}, {"draft_tokens": 2}, {"draft_tokens": 1}]
    bodies = [[{**body, "prompt": p, **modes[i % len(modes)]}] * 3 for i, p in enumerate(prompts)]
    replies, errors, _ = run_clients(url, bodies)
    assert errors == []
    for i, row in enumerate(replies):
        assert [r.text for r in row] == [solo[i]] * 3, prompts[i]
    wait_idle(url, 2)


# ---- the README ----------------------------------------------------------------------------------


def test_readme_examples_run_as_written(url):
    blocks = readme_blocks()
    port = url.rsplit(":", 1)[1]
    curl = next(code for lang, code in blocks if code.startswith("curl "))
    python = next(code for lang, code in blocks if lang == "python")
    assert "127.0.0.1:8000" in curl and "127.0.0.1:8000" in python
    out = subprocess.run(["bash", "-c", curl.replace(":8000", ":" + port)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert '"finish_reason"' in out and '"timings"' in out and '"content"' in out
    run = subprocess.run([sys.executable, "-c", python.replace(":8000", ":" + port)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "predicted_per_second" in run.stdout and "completion_tokens=" in run.stdout


def test_a_ten_turn_history_sent_back_feeds_only_its_new_tokens(client):
    """A client that sends the whole conversation each turn (as the OpenAI API is used), replies as
    it received them: each reply renders as the model generated it, whatever the template does to
    it (the demo's trims), so only the new tokens are prefilled (each reply's stop token aside)."""
    from test_conversation import ten_turns

    messages, fed, new, seen = [], 0, 0, None
    for text in ten_turns():
        messages.append({"role": "user", "content": text})
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
        u = r.usage
        if seen is not None:
            fed, new = fed + u.prompt_tokens - u.prompt_tokens_details.cached_tokens, new + u.prompt_tokens - seen
        seen = u.prompt_tokens + u.completion_tokens
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    assert fed / new <= 1.05, (fed, new)
