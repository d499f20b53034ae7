"""Structured output, forced tool calls, log-probabilities and penalties through the real server
(the scripted Gemma 4 model, MTP on) with the official `openai` and `anthropic` clients."""

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from scripted import KEY, OSLO, TOOLS, run_readme_example

MODEL = "gemma4-scripted"
OSLO_Q = "Describe the weather in Oslo as JSON."
SEVEN = "Please work out six times seven for me."
PARIS = "What is the weather in Paris right now?"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "sky", "temperature"],
           "properties": {"city": {"type": "string"}, "sky": {"enum": ["rain", "sun", "snow"]},
                          "temperature": {"type": "integer"}}}
ANSWER = {"type": "object", "additionalProperties": False, "required": ["answer"],
          "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}}}


@pytest.fixture(scope="module")
def client(scripted_server):
    return openai.OpenAI(base_url=scripted_server + "/v1", api_key=KEY, max_retries=0, timeout=60)


def chat(client, text, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=120,
                                          temperature=0, **kwargs)


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


def test_json_schema_replies_validate_whole_and_streamed(client):
    reply = chat(client, OSLO_Q, response_format=schema_format(WEATHER))
    assert reply.choices[0].message.content == OSLO  # a model already in the schema is left as it is
    jsonschema.validate(json.loads(OSLO), WEATHER)
    # A model that would answer in prose is made to fit; its logprobs come in the stream's chunks.
    chunks = list(chat(client, SEVEN, response_format=schema_format(ANSWER), stream=True, logprobs=True,
                       top_logprobs=2, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), ANSWER)
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens and "".join(e.token for e in entries[:11]) == '{"answer": '
    assert all(e.logprob <= 0 and len(e.top_logprobs) <= 2 for e in entries)
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-2].timings["draft_n"] > 0


def test_json_object_and_the_extension_field(client):
    reply = chat(client, OSLO_Q, response_format={"type": "json_object"})
    assert json.loads(reply.choices[0].message.content) == json.loads(OSLO)
    reply = chat(client, SEVEN, extra_body={"structured_outputs": {"regex": "(forty-two|42)\\."}})
    assert reply.choices[0].message.content in ("forty-two.", "42.")


def test_a_dead_end_grammar_ends_the_reply_cleanly(client):
    """The tokenizer cannot spell "\u00e9": the reply ends where the grammar needs it, whole and streamed."""
    extra = {"structured_outputs": {"regex": "42\u00e9"}}
    choice = chat(client, SEVEN, extra_body=extra).choices[0]
    assert (choice.message.content, choice.finish_reason, choice.finish_detail) == ("42", "stop", "dead_end")
    chunks = [c for c in chat(client, SEVEN, extra_body=extra, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "42"
    assert (chunks[-1].choices[0].finish_reason, chunks[-1].choices[0].finish_detail) == ("stop", "dead_end")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_openai(client, choice):
    reply = chat(client, PARIS, tools=TOOLS, tool_choice=choice)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris",
                                                                                          "unit": "celsius"}
    assert reply.choices[0].finish_reason == "tool_calls"


def test_anthropic_output_format_and_forced_tool(scripted_server):
    client = anthropic.Anthropic(base_url=scripted_server, api_key=KEY, max_retries=0)
    reply = client.messages.create(model=MODEL, max_tokens=120, messages=[{"role": "user", "content": OSLO_Q}],
                                   extra_body={"output_config": {"format": {"type": "json_schema", "schema": WEATHER}}})
    jsonschema.validate(json.loads(reply.content[0].text), WEATHER)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        reply = client.messages.create(model=MODEL, max_tokens=120, tools=tools, tool_choice=choice,
                                       messages=[{"role": "user", "content": PARIS}])
        assert [(b.type, b.name, b.input) for b in reply.content] == [
            ("tool_use", "get_weather", {"city": "Paris", "unit": "celsius"})]
        assert reply.stop_reason == "tool_use"


def test_completions_logprobs_and_penalties(client):
    prompt = "<|turn>user\n" + SEVEN + "<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, logprobs=2,
                                    presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"60": 1.0},
                                    extra_body={"repetition_penalty": 1.1})
    choice = out.choices[0]
    assert choice.text == "42, of course." and len(choice.logprobs.tokens) == out.usage.completion_tokens
    assert "".join(choice.logprobs.tokens[:-1]) == choice.text  # the stop token spells nothing in the text
    assert choice.logprobs.text_offset[:3] == [0, 1, 2] and all(len(t) <= 2 for t in choice.logprobs.top_logprobs)


@pytest.mark.parametrize("extra, param, match", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     None, "does not compile"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "<= 20"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"presence_penalty": 3}, "presence_penalty", "[-2.0, 2.0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "no tool"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, None, "one output"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one of"),
])
def test_bad_structured_requests_get_a_400(scripted_server, extra, param, match):
    body = {"model": MODEL, "messages": [{"role": "user", "content": SEVEN}], "max_tokens": 5, **extra}
    r = httpx.post(scripted_server + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and match in error["message"], error


def test_readme_structured_output_example_runs_as_written(scripted_server):
    out = run_readme_example(scripted_server, "response_format", heading="## Structured output").splitlines()
    assert out[0] == str(json.loads(OSLO))
    assert out[1].startswith("[('{', 0.0, ['{'") and out[1].count("(") == 4
