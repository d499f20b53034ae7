"""Tool calls and thinking over the OpenAI API, with the official client against a real server
process serving the scripted Gemma 4 model (tests/scripted.py), MTP on: every reply is known."""

import json
import re

import httpx
import openai
import pytest
from scripted import KEY, STORY, TOOLS, TWO, WEATHER, run_readme_example

MODEL = "gemma4-scripted"
PARIS = "What is the weather in Paris right now?"
SEVEN = "Please work out six times seven for me."


@pytest.fixture(scope="module")
def client(scripted_server):
    return openai.OpenAI(base_url=scripted_server + "/v1", api_key=KEY, max_retries=0, timeout=60)


def ask(client, text, **kwargs):
    kwargs = {"tools": TOOLS, "max_tokens": 200, "temperature": 0, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], **kwargs)


def streamed(client, messages, **kwargs):
    """The chunks of a streamed answer, and what they add up to."""
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [call for d in deltas for call in d.tool_calls or []]
    return chunks, {
        "content": "".join(d.content or "" for d in deltas),
        "reasoning": "".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
        "calls": [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls],
        "finish": [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason],
    }


def test_a_two_step_tool_loop_whole_and_streamed(client):
    first = ask(client, PARIS)
    choice = first.choices[0]
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    assert first.usage.completion_tokens == first.timings["predicted_n"] and first.timings["draft_n"] > 0

    messages = [{"role": "user", "content": PARIS}, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": WEATHER[0]}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=200)
    assert second.choices[0].message.content == WEATHER[1] and second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.tool_calls is None

    chunks, got = streamed(client, [messages[0]], tools=TOOLS)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert got["calls"] == [(0, "get_weather", {"city": "Paris", "unit": "celsius"})]
    assert got["content"] == "" and got["finish"] == ["tool_calls"]
    assert chunks[-1].usage.completion_tokens == first.usage.completion_tokens
    _, got = streamed(client, messages, tools=TOOLS)
    assert (got["content"], got["calls"], got["finish"]) == (WEATHER[1], [], ["stop"])


def test_parallel_calls_and_their_results(client):
    text = "Compare the weather in Oslo and in Rome."
    r = ask(client, text)
    calls = r.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("get_weather", {"city": city}) for city, _ in TWO]
    assert len({c.id for c in calls}) == 2
    _, got = streamed(client, [{"role": "user", "content": text}], tools=TOOLS)
    assert [c[:2] for c in got["calls"]] == [(0, "get_weather"), (1, "get_weather")]
    only = ask(client, text, parallel_tool_calls=False).choices[0]
    assert len(only.message.tool_calls) == 1 and only.finish_reason == "tool_calls"
    history = [{"role": "user", "content": text}, r.choices[0].message.model_dump(exclude_none=True),
               *[{"role": "tool", "tool_call_id": c.id, "content": [{"type": "text", "text": result}]}
                 for c, (_, result) in zip(calls, TWO)]]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=100)
    assert answer.choices[0].message.content == "Oslo is wet; Rome is the place to be."


def test_thinking_on_and_off(client):
    on = ask(client, SEVEN, extra_body={"chat_template_kwargs": {"enable_thinking": True}}).choices[0].message
    assert (on.reasoning_content, on.content) == ("Six sevens make 42.", "The answer is 42.")
    _, got = streamed(client, [{"role": "user", "content": SEVEN}],
                      extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert (got["reasoning"], got["content"]) == ("Six sevens make 42.", "The answer is 42.")
    off = ask(client, SEVEN).choices[0].message
    assert off.content == "42, of course." and getattr(off, "reasoning_content", None) is None


def test_malformed_calls_come_back_as_text_without_control_tokens(client):
    broken = ask(client, "Now show me a broken tool call.").choices[0]
    assert broken.message.content == 'Trying.call:get_weather{city:"Lyon} oops'
    assert broken.message.tool_calls is None and broken.finish_reason == "stop"
    other = ask(client, "Now use some other call syntax.").choices[0]
    assert other.message.content == "Sure: get_weather(city=Nice)"
    unclosed = ask(client, "What time is it in UTC, please?").choices[0]  # no close tag: still a call
    assert unclosed.message.tool_calls[0].function.arguments == '{"zone": "UTC"}'


def test_tool_choice_none_keeps_the_tools_declared_and_bans_a_call(client):
    auto = ask(client, PARIS)
    assert auto.choices[0].message.tool_calls  # the scripted model calls a tool here ...
    r = ask(client, PARIS, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None  # ... but cannot open one under "none"
    assert "<|" not in (r.choices[0].message.content or "") and "call:" not in (r.choices[0].message.content or "")
    assert r.usage.prompt_tokens == auto.usage.prompt_tokens  # the same prompt: the tools stay declared
    assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1  # read from the prefix cache


def test_stop_strings_and_length_with_parsing(client):
    r = ask(client, "Tell me a short story about a robot.", stop=["lighthouse"])
    assert r.choices[0].message.content == STORY[: STORY.index("lighthouse")]
    assert r.choices[0].finish_reason == "stop"
    r = ask(client, "Tell me a short story about a robot.", max_tokens=9)
    assert r.choices[0].message.content == STORY[:9] and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra, param, match", [
    ({"tool_choice": "required", "tools": []}, "tool_choice", "needs `tools`"),
    ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice", "names a function"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "tools\\[0\\]"),
    ({"tools": {"get_weather": {}}}, "tools", "list"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs", "true or false"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     None, "takes no images"),  # the scripted model has no vision tower
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[0]", "input_audio\": {\"data\": <base64>"),
])
def test_bad_tool_requests_get_a_one_line_400(scripted_server, extra, param, match):
    body = {"model": MODEL, "messages": [{"role": "user", "content": PARIS}], "tools": TOOLS, **extra}
    r = httpx.post(scripted_server + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "\n" not in error["message"]
    assert re.search(match, error["message"])


def test_a_body_nested_5000_deep_is_a_400_on_both_apis(scripted_server):
    deep = '{"model": "x", "messages": ' + "[" * 5000 + "]" * 5000 + "}"
    for path in ("/v1/chat/completions", "/v1/messages"):
        r = httpx.post(scripted_server + path, content=deep, headers={"x-api-key": KEY})
        assert r.status_code == 400, (path, r.text)
        assert "nested" in r.text
    r = httpx.post(scripted_server + "/v1/messages", content=deep, headers={"x-api-key": KEY})
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    def body(depth: int) -> dict:  # the nesting counted from the body itself (a field OpenAI takes any object in)
        return {"messages": [{"role": "user", "content": SEVEN}], "max_tokens": 2,
                "metadata": {"note": json.loads("[" * (depth - 2) + "]" * (depth - 2))}}

    r = httpx.post(scripted_server + "/v1/chat/completions", headers={"x-api-key": KEY}, json=body(64))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "42"
    r = httpx.post(scripted_server + "/v1/chat/completions", headers={"x-api-key": KEY}, json=body(65))
    assert r.status_code == 400 and "64 levels" in r.json()["error"]["message"]


def test_readme_openai_example_runs_as_written(scripted_server):
    out = run_readme_example(scripted_server, "from openai import OpenAI")
    assert out == f"{WEATHER[1]}\nSix sevens make 42. -> The answer is 42.\n"
