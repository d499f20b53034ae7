"""An agent's use of the server, through the official clients against the scripted Gemma 4 model
(tests/scripted.py): a long tool session reads each earlier turn back from the prefix cache,
Claude Code's requests keep their prefix from session to session, a prompt over the context is
refused in each API's own words, and the smaller rules an agent meets."""

import json

import anthropic
import httpx
import openai
import pytest
from scripted import KEY, SESSION, TOOLS, TURNS, reminded

MODEL = "gemma4-scripted"
TOOLS_A = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]
PARIS = "What is the weather in Paris right now?"


@pytest.fixture(scope="module")
def claude(scripted_server):
    return anthropic.Anthropic(base_url=scripted_server, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def gpt(scripted_server):
    return openai.OpenAI(base_url=scripted_server + "/v1", api_key=KEY, max_retries=0, timeout=60)


# ---- a long tool session -------------------------------------------------------------------------


def anthropic_turns(client, thinking: bool):
    """Play the session; yield each turn's (reply's text and calls, prompt, prefilled, cached, output)."""
    messages = [{"role": "user", "content": SESSION}]
    extra = {"thinking": {"type": "adaptive"}} if thinking else {}
    for i in range(TURNS):  # (a system prompt of its own: nothing comes from the other API's session)
        r = client.messages.create(model=MODEL, max_tokens=200, tools=TOOLS_A, messages=messages,
                                   system="Anthropic's session.", **extra)
        u = r.usage
        calls = [b for b in r.content if b.type == "tool_use"]
        yield ("".join(b.text for b in r.content if b.type == "text"), [c.input for c in calls],
               u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens,
               u.input_tokens + u.cache_creation_input_tokens, u.cache_read_input_tokens, u.output_tokens)
        messages.append({"role": "assistant", "content": r.content})
        results = [{"type": "tool_result", "tool_use_id": c.id, "content": f"t{i}"} for c in calls]
        reminder = [{"type": "text", "text": f"<system-reminder>Mind step {i}.</system-reminder>"}] * reminded(i)
        messages.append({"role": "user", "content": results + reminder})


def openai_turns(client, thinking: bool):
    messages = [{"role": "system", "content": "OpenAI's session."}, {"role": "user", "content": SESSION}]
    extra = {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}} if thinking else {}
    for i in range(TURNS):
        r = client.chat.completions.create(model=MODEL, max_tokens=200, tools=TOOLS, messages=messages, **extra)
        message, u = r.choices[0].message, r.usage
        calls = message.tool_calls or []
        cached = u.prompt_tokens_details.cached_tokens
        yield (message.content or "", [json.loads(c.function.arguments) for c in calls], u.prompt_tokens,
               u.prompt_tokens - cached, cached, u.completion_tokens)
        messages.append(message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": f"t{i}"} for c in calls]
        if reminded(i):
            messages.append({"role": "user", "content": f"<system-reminder>Mind step {i}.</system-reminder>"})


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking-off", "thinking-adaptive"])
@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_a_tool_session_prefills_each_token_once(claude, gpt, api, thinking):
    """20 turns with text before each call and a reminder beside every other result: each prompt
    starts from the state the previous reply left (no earlier turn is prefilled again), and the
    tokens prefilled over the session are the new tokens (each turn's last reply token, which the
    reply never fed, aside)."""
    turns = anthropic_turns(claude, thinking) if api == "anthropic" else openai_turns(gpt, thinking)
    prefilled = new = 0
    seen = None  # what the previous prompt and its reply covered
    for i, (text, calls, prompt, fill, cached, output) in enumerate(turns):
        assert (text, calls) == ((f"Step {i}: on it.\n", [{"zone": f"Z{i}"}]) if i < TURNS - 1 else
                                 ("All twenty steps are done.", [])), i  # the script's reply: the prompt was right
        if seen is not None:
            assert cached >= seen - 1, (i, cached, seen)  # the previous reply's state, at least
        prefilled, new = prefilled + fill, new + prompt - (seen or 0)
        seen = prompt + output
    assert prefilled / new <= 1.05, (prefilled, new)


# ---- Claude Code's requests ----------------------------------------------------------------------


def claude_code(billing: str, history: list) -> dict:
    """A request shaped as Claude Code 2.1 sends them: its billing line (a block of its own, or
    the first line of one), system entries among the messages, metadata."""
    system = [billing] if billing.endswith("agent.") else [billing, "You are a coding agent."]
    return {"model": MODEL, "max_tokens": 200, "metadata": {"user_id": "u"}, "tools": TOOLS_A,
            "system": [{"type": "text", "text": text} for text in system],
            "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": PARIS}, *history]}


def test_a_new_claude_code_session_reads_its_prompt_from_the_cache(scripted_server):
    """Whatever the billing line holds (new fields, no `cch=`), the prompt is the same."""
    lines = ["x-anthropic-billing-header: cc_version=2.1.197.1c6; cc_entrypoint=sdk-cli;",
             "x-anthropic-billing-header: cc_version=2.1.197.191; cc_entrypoint=cli; cc_workload=x; cch=0a1b2;",
             "x-anthropic-billing-header: cc_version=2.2.0.ffe; future_field=1;\nYou are a coding agent."]
    counts, usages = [], []
    for line in lines:
        body = claude_code(line, [])
        counts.append(httpx.post(scripted_server + "/v1/messages/count_tokens", json=body,
                                 headers={"x-api-key": KEY}).json()["input_tokens"])
        r = httpx.post(scripted_server + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
        assert r.status_code == 200 and r.json()["content"][0]["input"] == {"city": "Paris", "unit": "celsius"}
        usages.append(r.json()["usage"])
    assert counts[0] == counts[1] == counts[2]  # the line is dropped whole, the text after it kept
    assert all(u["cache_read_input_tokens"] == counts[0] - 1 for u in usages[1:])  # all but the last token


def test_a_system_message_in_the_conversation_stays_where_it_is(scripted_server, claude):
    """A later system entry adds a turn where it is: the turns before it are read from the cache."""
    line = "x-anthropic-billing-header: cc_version=2.1.197.1c0;"
    first = httpx.post(scripted_server + "/v1/messages", json=claude_code(line, []), headers={"x-api-key": KEY},
                       timeout=60).json()
    history = [{"role": "assistant", "content": first["content"]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first["content"][0]["id"],
                                             "content": '{"temperature": 15, "sky": "clear"}'}]},
               {"role": "system", "content": "The user prefers Fahrenheit."}]
    later = httpx.post(scripted_server + "/v1/messages", json=claude_code(line, history),
                       headers={"x-api-key": KEY}, timeout=60).json()["usage"]
    total = sum(first["usage"][k] for k in ("input_tokens", "cache_creation_input_tokens",
                                             "cache_read_input_tokens"))
    assert later["cache_read_input_tokens"] >= total + first["usage"]["output_tokens"] - 1


# ---- the context ---------------------------------------------------------------------------------


def test_a_prompt_over_the_context_is_refused_in_each_apis_words(claude, gpt, scripted_server):
    long = [{"role": "user", "content": "word " * 1700}]  # 8,500 character tokens > 8,192
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=10, messages=long)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith("prompt is too long: ")
    n, limit = [int(w) for w in e.value.body["error"]["message"].split() if w.isdigit()]
    n_long = claude.messages.count_tokens(model=MODEL, messages=long).input_tokens
    assert n == n_long > limit == 8191
    with pytest.raises(anthropic.BadRequestError) as e:  # a stream is refused before it starts
        with claude.messages.stream(model=MODEL, max_tokens=10, messages=long) as stream:
            list(stream)
    assert e.value.status_code == 400 and "prompt is too long" in e.value.message

    fits = [{"role": "user", "content": PARIS}]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=8190, messages=fits)
    n = claude.messages.count_tokens(model=MODEL, messages=fits).input_tokens
    assert e.value.body["error"]["message"] == (f"input length and `max_tokens` exceed context limit: {n} + 8190 > "
                                                "8192, decrease input length or `max_tokens` and try again")
    assert claude.messages.create(model=MODEL, max_tokens=8192 - n, messages=fits).stop_reason == "end_turn"

    with pytest.raises(anthropic.BadRequestError) as e:  # a max_tokens no reply can reach: both refuse it
        claude.messages.create(model=MODEL, max_tokens=10**9, messages=fits)
    assert "exceed context limit" in e.value.body["error"]["message"]
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as e:
            gpt.chat.completions.create(model=MODEL, messages=fits, **{field: 10**9})
        assert (e.value.body["param"], e.value.body["code"]) == (field, "invalid_value")
    with pytest.raises(openai.BadRequestError) as e:
        gpt.completions.create(model=MODEL, prompt=PARIS, max_tokens=10**9, stream=True)
    assert e.value.body["message"].startswith("max_tokens is too large: 1000000000.")

    with pytest.raises(openai.BadRequestError) as e:
        gpt.chat.completions.create(model=MODEL, max_tokens=10, messages=long, stream=True)
    assert (e.value.body["code"], e.value.body["param"]) == ("context_length_exceeded", "messages")
    assert e.value.body["message"] == (f"This model's maximum context length is 8192 tokens. However, your messages "
                                       f"resulted in {n_long} tokens. Please reduce the length of the messages.")


# ---- smaller rules -------------------------------------------------------------------------------


def test_a_call_cut_by_max_tokens_never_reaches_the_text(claude, gpt):
    for max_tokens in (5, 30):  # inside the call's tag, inside its arguments
        r = claude.messages.create(model=MODEL, max_tokens=max_tokens, tools=TOOLS_A,
                                   messages=[{"role": "user", "content": PARIS}])
        assert r.stop_reason == "max_tokens" and all(b.type == "text" and "<|" not in b.text for b in r.content)
        c = gpt.chat.completions.create(model=MODEL, max_tokens=max_tokens, tools=TOOLS,
                                        messages=[{"role": "user", "content": PARIS}]).choices[0]
        assert c.finish_reason == "length" and c.message.tool_calls is None and "<|" not in (c.message.content or "")


def test_tool_choice_none_bans_a_call_and_keeps_the_prompt(claude):
    ask = dict(model=MODEL, tools=TOOLS_A, messages=[{"role": "user", "content": PARIS}])
    auto = claude.messages.create(**ask, max_tokens=200)
    none = claude.messages.create(**ask, max_tokens=8, tool_choice={"type": "none"})
    assert auto.stop_reason == "tool_use" and none.stop_reason != "tool_use"
    assert all(b.type == "text" and "<|" not in b.text for b in none.content)
    assert none.usage.cache_read_input_tokens == auto.usage.input_tokens + auto.usage.cache_creation_input_tokens \
        + auto.usage.cache_read_input_tokens - 1  # the same prompt, tools declared


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"temperature": 5}, "temperature"),
    ("/v1/chat/completions", {"temperature": -0.1}, "temperature"),
    ("/v1/chat/completions", {"user": 7}, "user"),
    ("/v1/chat/completions", {"metadata": "x"}, "metadata"),
    ("/v1/messages", {"metadata": "x"}, "metadata"),
    ("/v1/messages", {"metadata": {"user_id": 3}}, "metadata.user_id"),
    ("/v1/messages", {"temperature": 1.5}, "temperature"),
    ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 100}}, "budget_tokens"),
    ("/v1/messages", {"service_tier": 1}, "service_tier"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"verbosity": 3}, "verbosity"),
])
def test_fields_are_checked_as_the_real_apis_check_them(scripted_server, path, body, param):
    base = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": PARIS}]}
    r = httpx.post(scripted_server + path, json={**base, **body}, headers={"x-api-key": KEY})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert param in error.get("param", "") + error["message"] and "\n" not in error["message"]


def test_an_unknown_field_is_refused_as_openai_refuses_it_and_the_fields_clients_send_are_not(scripted_server):
    base = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": PARIS}]}
    client = openai.OpenAI(base_url=scripted_server + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**base, extra_body={"frobnicate": 1})
    assert e.value.status_code == 400 and e.value.body["message"] == "Unrecognized request argument supplied: frobnicate"
    with pytest.raises(openai.BadRequestError, match="Unrecognized request arguments supplied: tempreature, topk"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"tempreature": 0, "topk": 3})
    sent = dict(stream_options=None, user="u", metadata={"k": "v"}, store=False, service_tier="auto", seed=1,
                parallel_tool_calls=True, presence_penalty=0, frequency_penalty=0, logprobs=False, top_p=1,
                prompt_cache_key="k", safety_identifier="s", verbosity="medium", modalities=["text"],
                extra_body={"draft_tokens": 3, "mtp": True, "top_k": 0, "min_p": 0, "repetition_penalty": 1.0,
                            "chat_template_kwargs": {}})
    assert client.chat.completions.create(**base, **{k: v for k, v in sent.items() if v is not None}).choices
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    with pytest.raises(openai.BadRequestError) as e:  # a tool result must answer a call, as on Anthropic's side
        client.chat.completions.create(model=MODEL, max_tokens=2, tools=TOOLS, messages=[
            {"role": "user", "content": PARIS}, {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}])
    assert e.value.body["param"] == "messages.[2].tool_call_id"


def test_an_unknown_field_is_refused_as_anthropic_refuses_it(scripted_server, claude):
    """On the wire, through the client; the fields themselves: test_server_fields.py."""
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": PARIS}],
                               extra_body={"temprature": 0.5})
    assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": "temprature: Extra inputs are not permitted"}}
    r = httpx.post(scripted_server + "/v1/messages/count_tokens", headers={"x-api-key": KEY},
                   json={"model": MODEL, "messages": [{"role": "user", "content": PARIS, "nmae": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["message"] == "messages.0.nmae: Extra inputs are not permitted"


def test_a_tool_result_must_answer_a_call_of_the_message_before(claude):
    calls = [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]
    answer = [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "sunny"}]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": PARIS}, {"role": "assistant", "content": calls},
            {"role": "user", "content": answer}])
    assert e.value.body["error"]["message"] == (
        "messages.2.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_2. Each `tool_result` "
        "block must have a corresponding `tool_use` block in the previous message.")
    answer[0]["tool_use_id"] = "toolu_1"
    assert claude.messages.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": PARIS}, {"role": "assistant", "content": calls},
        {"role": "user", "content": answer}]).content is not None


def test_either_right_key_is_enough(scripted_server):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": PARIS}]}
    for headers in ({"x-api-key": KEY, "Authorization": "Bearer wrong"},
                    {"x-api-key": "wrong", "Authorization": f"Bearer {KEY}"}):
        assert httpx.post(scripted_server + "/v1/messages", json=body, headers=headers).status_code == 200
    wrong = {"x-api-key": "a", "Authorization": "Bearer b"}
    r = httpx.post(scripted_server + "/v1/messages", json=body, headers=wrong)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
