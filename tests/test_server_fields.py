"""Strict request fields (issue 43): a field neither API nor this server knows is refused in the
API's own words, at the top of a request and inside its messages, blocks and tools, while every
field the official clients and Claude Code send is taken; a tool result answers a call of the
message before, on both APIs. Parsed without a model or HTTP (the wire through the clients:
test_server_agent.py)."""

import pytest

from mlx_mtp.server import anthropic as wire_anthropic
from mlx_mtp.server import protocol
from mlx_mtp.server.common import APIError, ServedModel
from mlx_mtp.server.fields import ANTHROPIC_MESSAGES, OPENAI_CHAT

MODEL = ServedModel("m", context=8192, vocab_size=262144)
USER = {"role": "user", "content": "Hi"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}


def refused(parse, body) -> APIError:
    with pytest.raises(APIError) as e:
        parse(body, MODEL)
    assert e.value.status == 400
    return e.value


def claude(body, count=False):
    return wire_anthropic.parse_messages({"model": "m", "max_tokens": 8, **body}, MODEL, count=count)


@pytest.mark.parametrize("body, where", [
    ({"temprature": 0.5}, "temprature"),
    ({"messages": [{**USER, "name": "x"}]}, "messages.0.name"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "txet": 1}]}]},
     "messages.0.content.0.text.txet"),
    ({"system": [{"type": "text", "text": "S", "cache_contrl": {}}]}, "system.0.text.cache_contrl"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}, "descripton": "d"}]}, "tools.0.custom.descripton"),
    ({"tool_choice": {"type": "auto", "parallel": False}}, "tool_choice.parallel"),
    ({"thinking": {"type": "adaptive", "budget": 9}}, "thinking.budget"),
    ({"metadata": {"user_id": "u", "session": "s"}}, "metadata.session"),
    ({"output_config": {"effort": "low", "schema": {}}}, "output_config.schema"),
    ({"messages": [USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_eror": True}]}]},
     "messages.2.content.0.tool_result.is_eror"),
])
def test_an_unknown_anthropic_field_is_refused_in_anthropics_words(body, where):
    e = refused(lambda b, m: claude(b), {"messages": [USER], **body})
    assert str(e) == f"{where}: Extra inputs are not permitted"
    assert wire_anthropic.error_body(e) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": f"{where}: Extra inputs are not permitted"}}
    refused(lambda b, m: claude(b, count=True), {"messages": [USER], **body})  # count_tokens too


def test_what_claude_code_and_the_client_send_is_taken():
    """A Claude Code 2.x request (the beta API's fields, cache_control on blocks and tools, adaptive
    thinking, effort) and this server's extensions."""
    cached = {"cache_control": {"type": "ephemeral", "ttl": "1h"}}
    body = {"model": "m", "max_tokens": 32000, "stream": True, "temperature": 1, "top_p": 1, "top_k": 0,
            "metadata": {"user_id": "user_x_account_y_session_z"}, "thinking": {"type": "adaptive"},
            "output_config": {"effort": "high"}, "context_management": {"edits": []}, "service_tier": "auto",
            "stop_sequences": ["\n\nHuman:"], "tool_choice": {"type": "auto", "disable_parallel_tool_use": False},
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1;"},
                       {"type": "text", "text": "You are Claude Code.", **cached}],
            "tools": [{"name": "Bash", "description": "Run", "input_schema": {"type": "object"}, "strict": False,
                       "eager_input_streaming": True, **cached},
                      {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "ls", **cached}]},
                         {"role": "assistant", "content": [
                             {"type": "thinking", "thinking": "t", "signature": "s"},
                             {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}, **cached}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                       "is_error": False, **cached,
                                                       "content": [{"type": "text", "text": "a.py"}]}]}],
            "draft_tokens": 3, "mtp": True, "min_p": 0}
    assert wire_anthropic.parse_messages(body, MODEL).stream
    assert set(body) - {"draft_tokens", "mtp", "min_p"} <= ANTHROPIC_MESSAGES


def openai_chat(body):
    return protocol.parse_chat({"model": "m", **body}, MODEL)


@pytest.mark.parametrize("messages, tools, where", [
    ([{**USER, "nmae": "x"}], None, ("nmae", "messages.[0]")),
    ([{"role": "user", "content": [{"type": "text", "text": "Hi", "cache": 1}]}], None,
     ("cache", "messages.[0].content.[0]")),
    ([USER, {"role": "assistant", "tool_calls": [{**CALL, "extra": 1}]}], None,
     ("extra", "messages.[1].tool_calls.[0]")),
    ([USER, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{}", "x": 0}}]}],
     None, ("x", "messages.[1].tool_calls.[0].function")),
    ([USER], [{**TOOL, "function": {**TOOL["function"], "paramters": {}}}], ("paramters", "tools.[0].function")),
])
def test_an_unknown_nested_openai_field_is_refused_in_openais_words(messages, tools, where):
    e = refused(lambda b, m: openai_chat(b), {"messages": messages, **({"tools": tools} if tools else {})})
    name, at = where
    assert str(e) == f"Additional properties are not allowed ('{name}' was unexpected) - '{at}'"
    assert e.body()["error"]["param"] == at


def test_what_the_openai_client_and_agents_send_is_taken():
    history = [{"role": "developer", "content": "Be brief.", "name": "d"},
               {"role": "user", "content": [{"type": "text", "text": "Weather?"}], "name": "ana"},
               {"role": "assistant", "content": None, "tool_calls": [{**CALL, "index": 0}], "refusal": None,
                "reasoning_content": "I should call f."},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    body = {"messages": history, "tools": [{**TOOL, "function": {**TOOL["function"], "strict": True}}],
            "stream": True, "stream_options": {"include_usage": True}, "user": "u", "seed": 3, "store": False,
            "metadata": {"k": "v"}, "reasoning_effort": "low", "max_completion_tokens": 9, "logit_bias": {"5": 1},
            "parallel_tool_calls": True, "response_format": {"type": "text"}, "n": 1, "service_tier": "auto",
            "chat_template_kwargs": {}, "draft_tokens": "auto"}
    job = openai_chat(body)
    assert job.include_usage and job.request.messages[-1]["name"] == "f"
    assert set(body) - {"chat_template_kwargs", "draft_tokens"} <= OPENAI_CHAT


@pytest.mark.parametrize("result, message", [
    ({"tool_call_id": "call_2"}, "Invalid parameter: 'tool_call_id' of 'call_2' not found in 'tool_calls' of previous "
                                 "message."),
    ({}, "Missing required parameter: 'messages.[2].tool_call_id'."),
])
def test_an_openai_tool_result_must_answer_a_call(result, message):
    history = [USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "sunny", **result}]
    e = refused(lambda b, m: openai_chat(b), {"messages": history})
    assert str(e) == message and e.param == "messages.[2].tool_call_id"
    alone = [USER, {"role": "tool", "tool_call_id": "call_1", "content": "x"}]  # no call before it
    refused(lambda b, m: openai_chat(b), {"messages": alone})


# ---- max_tokens ----------------------------------------------------------------------------------


CHAT, COMPLETION = (protocol.parse_chat, {"messages": [USER]}), (protocol.parse_completion, {"prompt": "Hi"})


@pytest.mark.parametrize("parse, prompt, field", [(*CHAT, "max_tokens"), (*CHAT, "max_completion_tokens"),
                                                  (*COMPLETION, "max_tokens")])
def test_an_openai_max_tokens_past_the_context_is_refused_in_openais_words(parse, prompt, field):
    """As OpenAI refuses a max_tokens its model cannot write (Anthropic's route refuses it too, "input
    length and `max_tokens` exceed context limit"); the context itself is taken, and is the default."""
    e = refused(parse, {"model": "m", **prompt, field: 1_000_000_000})
    assert str(e) == (f"{field} is too large: 1000000000. This model supports at most 8192 completion "
                      "tokens, whereas you provided 1000000000.")
    assert e.body()["error"] == {"message": str(e), "type": "invalid_request_error", "param": field,
                                 "code": "invalid_value"}
    assert parse({"model": "m", **prompt, field: 8192}, MODEL).request.max_tokens == 8192
    assert parse({"model": "m", **prompt}, MODEL).request.max_tokens == 8192
    if field == "max_completion_tokens":  # the newer field wins where both are sent
        assert parse({"model": "m", **prompt, field: 9, "max_tokens": 99}, MODEL).request.max_tokens == 9
