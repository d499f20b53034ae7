"""The Anthropic Messages API, with the official `anthropic` client (and raw HTTP where the event
sequence itself is checked) against a real server process serving the scripted Gemma 4 model
(tests/scripted.py), MTP on: every reply is known."""

import json
import time

import anthropic
import httpx
import pytest
from scripted import KEY, STORY, TOOLS, TWO, WEATHER, run_readme_example

from mlx_mtp.server.metrics import parse as parse_metrics

MODEL = "gemma4-scripted"
PARIS = "What is the weather in Paris right now?"
SEVEN = "Please work out six times seven for me."
TOOLS_A = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.fixture(scope="module")
def client(scripted_server):
    return anthropic.Anthropic(base_url=scripted_server, api_key=KEY, max_retries=0, timeout=60)


def ask(client, text, **kwargs):
    kwargs = {"tools": TOOLS_A, "max_tokens": 200, **kwargs}
    return client.messages.create(model=MODEL, messages=[{"role": "user", "content": text}], **kwargs)


def streamed(client, **kwargs):
    """The final message the client assembles from a stream, and the event types it saw."""
    with client.messages.stream(model=MODEL, **{"max_tokens": 200, **kwargs}) as stream:
        kinds = [event.type for event in stream]
        return stream.get_final_message(), kinds


PROMPT = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")


def prompt(usage) -> int:
    """The whole prompt, which Anthropic's usage splits in three."""
    usage = usage if isinstance(usage, dict) else usage.model_dump()
    return sum(usage[k] for k in PROMPT)


def blocks(message) -> list:
    return [b.model_dump(include={"type", "text", "thinking", "name", "input"}) for b in message.content]


def test_a_two_step_tool_loop_whole_and_streamed(client):
    first = ask(client, PARIS)
    (use,) = first.content
    assert use.type == "tool_use" and use.id.startswith("toolu_") and use.name == "get_weather"
    assert use.input == {"city": "Paris", "unit": "celsius"} and first.stop_reason == "tool_use"
    assert prompt(first.usage) > 300 and first.usage.output_tokens > 0
    assert first.usage.input_tokens == 0 < first.usage.cache_creation_input_tokens  # what it prefilled was kept
    history = [{"role": "user", "content": PARIS}, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": WEATHER[0]}]}]
    second = client.messages.create(model=MODEL, max_tokens=200, tools=TOOLS_A, messages=history)
    assert blocks(second) == [{"type": "text", "text": WEATHER[1]}] and second.stop_reason == "end_turn"

    final, kinds = streamed(client, tools=TOOLS_A, messages=history[:1])
    assert blocks(final) == blocks(first) and final.stop_reason == "tool_use"
    assert kinds[0] == "message_start" and "input_json" in kinds and kinds[-1] == "message_stop"
    assert prompt(final.usage) == prompt(first.usage)
    assert final.usage.cache_read_input_tokens > 300  # the same prompt again: from the prefix cache
    assert final.usage.output_tokens == first.usage.output_tokens
    final, _ = streamed(client, tools=TOOLS_A, messages=history)
    assert blocks(final) == blocks(second)


def test_the_event_sequence_of_a_stream(scripted_server):
    body = {"model": MODEL, "max_tokens": 200, "stream": True, "tools": TOOLS_A, "thinking": {"type": "adaptive"},
            "messages": [{"role": "user", "content": SEVEN}]}
    r = httpx.post(scripted_server + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [(e.split("\n")[0].removeprefix("event: "), json.loads(e.split("\n")[1].removeprefix("data: ")))
              for e in r.text.strip().split("\n\n")]
    assert all(kind == data["type"] for kind, data in events)
    kinds = [kind for kind, _ in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    starts = [d["content_block"]["type"] for k, d in events if k == "content_block_start"]
    stops = [d["index"] for k, d in events if k == "content_block_stop"]
    assert starts == ["thinking", "text"] and stops == [0, 1]
    deltas = [d["delta"] for k, d in events if k == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "Six sevens make 42."
    assert "".join(d.get("text", "") for d in deltas) == "The answer is 42."
    message_delta = events[-2][1]
    assert message_delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert message_delta["usage"]["output_tokens"] > 0
    start = events[0][1]["message"]["usage"]
    assert sum(start[k] for k in PROMPT) == sum(message_delta["usage"][k] for k in PROMPT) > 0


def test_thinking_on_and_off(client):
    on = ask(client, SEVEN, thinking={"type": "enabled", "budget_tokens": 2048})
    assert blocks(on) == [{"type": "thinking", "thinking": "Six sevens make 42."},
                          {"type": "text", "text": "The answer is 42."}]
    off = ask(client, SEVEN)  # the server's default: off
    assert blocks(off) == [{"type": "text", "text": "42, of course."}]
    assert blocks(ask(client, SEVEN, thinking={"type": "disabled"})) == blocks(off)
    # earlier thinking is left out once a new user message comes, as the template does; `keep_thinking` keeps it
    again = [{"role": "user", "content": SEVEN}, {"role": "assistant", "content": on.content},
             {"role": "user", "content": "Thanks!"}]
    thinking = {"type": "enabled", "budget_tokens": 2048}
    dropped = client.messages.count_tokens(model=MODEL, messages=again, thinking=thinking).input_tokens
    kept = client.messages.count_tokens(model=MODEL, messages=again, thinking=thinking,
                                        extra_body={"keep_thinking": True}).input_tokens
    without = client.messages.count_tokens(model=MODEL, thinking=thinking, messages=[
        again[0], {"role": "assistant", "content": [{"type": "text", "text": "The answer is 42."}]}, again[2]])
    assert dropped == without.input_tokens
    assert kept == without.input_tokens + len("<|channel>thought\nSix sevens make 42.<channel|>") - 18  # 2 tags
    template = client.messages.count_tokens(model=MODEL, messages=again, thinking=thinking,
                                            extra_body={"history": "template"}).input_tokens
    assert template == dropped  # the template drops it too, and writes the rest as generated here


UNASKED = "Do you think before you answer, when nobody asks you to?"


@pytest.fixture(scope="module")
def thinking_default(tmp_path_factory):
    """The scripted model served in-process with thinking on by default (`--enable-thinking`): it
    reasons when the prompt turns thinking on, and with it off opens a reasoning channel anyway."""
    import scripted
    from starlette.testclient import TestClient

    from mlx_mtp.engine.engine import Engine
    from mlx_mtp.server.app import Settings, create_app, served_model

    script = [(scripted.ask(UNASKED, thinking=True), "<|channel>thought\nAsked to.<channel|>Yes.<turn|>"),
              (scripted.ask(UNASKED), "<|channel>thought\nUnasked.<channel|>No.<turn|>")]
    model = scripted.make_scripted_model(tmp_path_factory.mktemp("thinking") / "model")
    loaded = scripted.load_scripted(model, script)
    with Engine(loaded) as engine:
        yield TestClient(create_app(engine, Settings(served_model(loaded, MODEL, thinking=True))))


def sse_blocks(text: str) -> list:
    """The content blocks of an Anthropic stream: (type, its text as the deltas carried it)."""
    found = []
    for event in text.strip().split("\n\n"):
        data = json.loads(event.split("\n")[1].removeprefix("data: "))
        if data["type"] == "content_block_start":
            found.append([data["content_block"]["type"], ""])
        elif data["type"] == "content_block_delta":
            found[-1][1] += data["delta"].get("text", data["delta"].get("thinking", ""))
    return [tuple(b) for b in found]


@pytest.mark.parametrize("thinking", [None, {"type": "disabled"}], ids=["not-asked", "disabled"])
def test_no_thinking_block_unless_thinking_is_asked_for(thinking_default, thinking):
    """Not asked for, thinking is off whatever the server's default (OpenAI requests' only), and
    reasoning the model writes on its own stays hidden: no thinking block, whole or streamed."""
    body = {"model": MODEL, "max_tokens": 100, "messages": [{"role": "user", "content": UNASKED}],
            **({"thinking": thinking} if thinking else {})}
    whole = thinking_default.post("/v1/messages", json=body)
    assert whole.status_code == 200 and whole.json()["content"] == [{"type": "text", "text": "No."}]
    streamed = thinking_default.post("/v1/messages", json={**body, "stream": True})
    assert sse_blocks(streamed.text) == [("text", "No.")]
    asked = {**body, "thinking": {"type": "adaptive"}}
    content = thinking_default.post("/v1/messages", json=asked).json()["content"]
    assert [b["type"] for b in content] == ["thinking", "text"]
    assert sse_blocks(thinking_default.post("/v1/messages", json={**asked, "stream": True}).text) == [
        ("thinking", "Asked to."), ("text", "Yes.")]
    plain = {k: v for k, v in body.items() if k != "thinking"}
    openai = thinking_default.post("/v1/chat/completions", json=plain).json()
    assert openai["choices"][0]["message"]["reasoning_content"] == "Asked to."  # the server's default


def test_parallel_calls(client):
    text = "Compare the weather in Oslo and in Rome."
    r = ask(client, text)
    assert [(b.name, b.input) for b in r.content] == [("get_weather", {"city": city}) for city, _ in TWO]
    final, _ = streamed(client, tools=TOOLS_A, messages=[{"role": "user", "content": text}])
    assert blocks(final) == blocks(r)
    one = ask(client, text, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert blocks(one) == blocks(r)[:1] and one.stop_reason == "tool_use"
    results = [{"type": "tool_result", "tool_use_id": b.id, "content": [{"type": "text", "text": result}]}
               for b, (_, result) in zip(r.content, TWO)]
    answer = client.messages.create(model=MODEL, max_tokens=100, tools=TOOLS_A, messages=[
        {"role": "user", "content": text}, {"role": "assistant", "content": r.content},
        {"role": "user", "content": results}])
    assert answer.content[0].text == "Oslo is wet; Rome is the place to be."


def test_malformed_calls_come_back_as_text(client):
    r = ask(client, "Now show me a broken tool call.")
    assert blocks(r) == [{"type": "text", "text": 'Trying.call:get_weather{city:"Lyon} oops'}]  # no control token
    assert r.stop_reason == "end_turn"
    r = ask(client, "What time is it in UTC, please?")  # no close tag: still a call
    assert blocks(r) == [{"type": "tool_use", "name": "get_time", "input": {"zone": "UTC"}}]


def generated(url: str) -> int:
    """Tokens the server's engine has generated, once nothing runs (its counters are then current)."""
    while True:
        m = parse_metrics(httpx.get(url + "/metrics").text)
        if m["mlx_mtp:num_requests_running"] == 0:
            return m["mlx_mtp:generation_tokens_total"]
        time.sleep(0.02)


def test_stop_sequences_and_max_tokens(client, scripted_server):
    story = "Tell me a short story about a robot."
    before = generated(scripted_server)
    r = ask(client, story, stop_sequences=["lighthouse", "never"])
    assert blocks(r) == [{"type": "text", "text": STORY[: STORY.index("lighthouse")]}]
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", "lighthouse")
    # one token a character: up to the one completing the stop string; generation stopped there
    assert r.usage.output_tokens == STORY.index("lighthouse") + len("lighthouse")
    assert generated(scripted_server) - before <= r.usage.output_tokens + 2 * 4 < len(STORY)
    final, _ = streamed(client, messages=[{"role": "user", "content": story}], stop_sequences=["lighthouse"])
    assert blocks(final) == blocks(r) and final.stop_sequence == "lighthouse"
    sampling = {"temperature": 1.0, "top_p": 0.9, "top_k": 40}  # older clients send them (this one cannot)
    r = ask(client, story, max_tokens=9, extra_body=sampling)
    assert blocks(r) == [{"type": "text", "text": STORY[:9]}] and r.stop_reason == "max_tokens"


def claude_code_request(cch: str) -> dict:
    """A request shaped as Claude Code sends them: system blocks (a billing header first, cache
    control), a system entry among the messages, metadata, a server tool, unknown fields."""
    return {
        "model": MODEL, "max_tokens": 200, "metadata": {"user_id": "u"}, "context_management": {"edits": []},
        "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.37.1a2; cc_entrypoint=cli; "
                                            f"cch={cch};"},
                   {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
        "tools": [*TOOLS_A, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
        "messages": [{"role": "system", "content": "Be terse."},
                     {"role": "user", "content": [{"type": "text", "text": PARIS,
                                                   "cache_control": {"type": "ephemeral"}}]}],
    }


def test_claude_code_requests_are_understood_and_their_prefix_is_stable(client, scripted_server):
    counts = []
    for cch in ("1a2b3", "ff00e"):
        body = claude_code_request(cch)
        r = httpx.post(scripted_server + "/v1/messages/count_tokens", json=body, headers={"x-api-key": KEY})
        counts.append(r.json()["input_tokens"])
        answer = httpx.post(scripted_server + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["content"][0]["input"] == {"city": "Paris", "unit": "celsius"}
        usage = answer.json()["usage"]
        assert prompt(usage) == counts[-1]
    assert counts[0] == counts[1]
    assert usage["cache_read_input_tokens"] >= counts[-1] - 2  # the prefix stays stable across `cch` values
    cut = {**claude_code_request("1a2b3"), "system": "You are a coding agent."}
    assert client.messages.count_tokens(**{k: cut[k] for k in ("model", "system", "messages")}).input_tokens < counts[0]


def test_bearer_and_x_api_key_both_authenticate(scripted_server):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": SEVEN}]}
    bearer = anthropic.Anthropic(base_url=scripted_server, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(**body).content[0].text == "42"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=scripted_server, api_key="wrong", max_retries=0).messages.create(**body)
    assert e.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("change, status, kind, match", [
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "claude-opus-4"}, 404, "not_found_error", "does not exist"),
    ({"tool_choice": {"type": "any"}, "tools": None}, 400, "invalid_request_error", "needs `tools`"),
    ({"tool_choice": {"type": "tool"}}, 400, "invalid_request_error", "`name`"),
    ({"output_config": {"format": {"type": "xml"}}}, 400, "invalid_request_error", "json_schema"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     "source must be"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400, "invalid_request_error",
     "document blocks are not supported"),
    ({"messages": [{"role": "bot", "content": "x"}]}, 400, "invalid_request_error", "role"),
    ({"messages": []}, 400, "invalid_request_error", "non-empty"),
    ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({"thinking": {"type": "sometimes"}}, 400, "invalid_request_error", "thinking.type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]},
     400, "invalid_request_error", "object `input`"),
])
def test_errors_are_anthropic_shaped(client, change, status, kind, match):
    body = {"model": MODEL, "max_tokens": 20, "messages": [{"role": "user", "content": SEVEN}], "tools": TOOLS_A}
    body = {k: v for k, v in {**body, **change}.items() if v is not None}
    with pytest.raises(anthropic.APIStatusError) as e:  # the client's raw post: it would refuse some of these
        client.post("/v1/messages", body=body, cast_to=object)
    assert e.value.status_code == status and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == kind and match in e.value.body["error"]["message"]


def test_readme_anthropic_example_runs_as_written(scripted_server):
    out = run_readme_example(scripted_server, "import anthropic").splitlines()
    assert out[0] == WEATHER[1]  # the first reply was a tool call, with no text
    stop, used_in, stored, cached, used_out = out[1].split()
    # the conversation counted at the end is the last prompt and its reply (less its stop token)
    assert stop == "end_turn" and int(out[2]) == int(used_in) + int(stored) + int(cached) + int(used_out) - 1
    assert int(cached) > int(stored) > 0  # the last call re-sent the first one's prompt: read from the cache


def test_every_status_has_its_anthropic_error_type(scripted_server):
    from mlx_mtp.server.anthropic import error_body
    from mlx_mtp.server.common import APIError

    kinds = {status: error_body(APIError(status, "m"))["error"]["type"] for status in (413, 429, 500, 503)}
    assert kinds == {413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "api_error"}
    r = httpx.get(scripted_server + "/v1/messages", headers={"x-api-key": KEY})  # a route's errors take its shape
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(scripted_server + "/v1/messages", content=b"{oops", headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error" and "not valid JSON" in r.json()["error"]["message"]
