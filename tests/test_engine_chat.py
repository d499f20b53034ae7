"""Chat requests through the real Engine with MTP (and prompt lookup) on: a scripted Gemma 4 model
(tests/scripted.py) makes the replies known, so tool calls, reasoning and text are asserted
exactly, streamed and whole, alone and batched, and the chat prints them apart."""

import pytest
from scripted import STORY, TOOLS, TWO, WEATHER, ask, load_scripted, make_scripted_model

from mlx_mtp import chat
from mlx_mtp.formats import chat as chat_format
from mlx_mtp.formats.chat import Delta, ToolCall
from mlx_mtp.engine.conversation import Conversation
from mlx_mtp.engine.engine import Engine, Request
from mlx_mtp.decode.sample import SamplingParams

PARIS = "What is the weather in Paris right now?"
SEVEN = "Please work out six times seven for me."
EXPECTED = {  # (user message, thinking) -> the reply's parts
    (PARIS, False): [Delta("tool_call", call=ToolCall("get_weather", {"city": "Paris", "unit": "celsius"}))],
    (SEVEN, True): [Delta("reasoning", "Six sevens make 42."), Delta("content", "The answer is 42.")],
    (SEVEN, False): [Delta("content", "42, of course.")],
    ("Compare the weather in Oslo and in Rome.", False): [
        Delta("tool_call", call=ToolCall("get_weather", {"city": "Oslo"}, 0)),
        Delta("tool_call", call=ToolCall("get_weather", {"city": "Rome"}, 1))],
    ("Now show me a broken tool call.", False): [
        Delta("content", 'Trying.call:get_weather{city:"Lyon} oops')],  # less its control tokens
    ("Now use some other call syntax.", False): [
        Delta("content", "Sure: get_weather(city=Nice)")],
    ("What time is it in UTC, please?", False): [Delta("tool_call", call=ToolCall("get_time", {"zone": "UTC"}))],
    ("Tell me a short story about a robot.", False): [Delta("content", STORY)],
}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_scripted(make_scripted_model(tmp_path_factory.mktemp("scripted") / "model"))


@pytest.fixture(scope="module")
def engine(loaded):
    with Engine(loaded, max_batch=8) as engine:
        yield engine


def request(text: str, thinking: bool = False, **kwargs) -> Request:
    return Request(messages=[{"role": "user", "content": text}], tools=TOOLS, enable_thinking=thinking,
                   max_tokens=200, **kwargs)


def parts_of(events: list) -> list:
    """The parts a request streamed, merged (each token's text is its content parts')."""
    assert all(e.text == "".join(p.text for p in e.parts if p.kind == "content") for e in events[:-1])
    return chat_format.merge([p for e in events[:-1] for p in e.parts])


def test_scripted_replies_stream_as_parts_exactly_alone_and_batched(engine):
    # greedy and sampled (a seeded sampled row drafts a fixed 3 tokens a round under "auto"), all
    # submitted at once: rows join and leave one batch; the drafts are right and wrong in turn
    modes = [dict(draft_tokens=3), dict(sampling=SamplingParams(temperature=1.0), seed=5)]
    handles = [(key, mode, engine.submit(request(*key, **mode))) for key in EXPECTED for mode in modes]
    drafted = accepted = 0
    for key, mode, handle in handles:
        events = list(handle.events(120))
        parts, done = parts_of(events), events[-1]
        assert parts == EXPECTED[key], (key, mode)
        assert done.kind == "done" and done.finish_reason == "stop"
        assert done.text == "".join(p.text for p in parts if p.kind == "content")
        assert done.reasoning == "".join(p.text for p in parts if p.kind == "reasoning")
        assert list(done.tool_calls) == [p.call for p in parts if p.kind == "tool_call"]
        assert done.tokens[-1] in (106, 50)  # <turn|>, or <|tool_response> after calls
        drafted += done.stats.drafted
        accepted += done.stats.accepted
    assert 0 < accepted < drafted


def test_a_two_step_tool_loop(engine):
    first = engine.submit(request(PARIS)).result(60)
    call = first.tool_calls[0]
    history = [{"role": "user", "content": PARIS},
               {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                     "function": {"name": call.name, "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": "c1", "content": WEATHER[0]}]
    second = engine.submit(Request(messages=history, tools=TOOLS, max_tokens=100)).result(60)
    assert (second.text, second.tool_calls, second.finish_reason) == (WEATHER[1], (), "stop")
    both = history[:2] + [{"role": "tool", "tool_call_id": "c1", "content": r} for _, r in TWO]
    assert engine.submit(Request(messages=both, tools=TOOLS, max_tokens=100)).result(60).text.startswith("Oslo")


def test_parallel_tool_calls_off_keeps_the_first_call(engine):
    text = "Compare the weather in Oslo and in Rome."
    both, first = (engine.submit(request(text, parallel_tool_calls=p)) for p in (True, False))
    assert len(both.result(60).tool_calls) == 2
    events, oslo = list(first.events(60)), EXPECTED[(text, False)][0]
    assert parts_of(events) == [oslo] and events[-1].tool_calls == (oslo.call,)  # streamed and whole


def test_prompt_tokens_and_counting(engine, loaded):
    req = request(SEVEN, thinking=True)
    handle = engine.submit(req)
    handle.result(60)
    rendered = chat_format.render(loaded.tokenizer, req.messages, TOOLS, enable_thinking=True)
    assert handle.prompt_tokens == engine.count_tokens(req) == len(rendered.tokens)
    assert rendered.text.endswith(ask(SEVEN, thinking=True))


def test_bad_chat_requests_are_refused(engine):
    with pytest.raises(ValueError, match="go with `messages`"):
        engine.submit(Request(prompt="hi", tools=TOOLS))
    with pytest.raises(ValueError, match="tools\\[0\\]"):
        engine.submit(Request(messages=[{"role": "user", "content": "x"}], tools=[{"name": "f"}])).result(60)
    assert engine.submit(request(SEVEN)).result(60).text == "42, of course."  # and the engine goes on


def test_chat_prints_reasoning_apart_and_tool_calls_readably(loaded, capsys):
    options = dict(max_tokens=200, draft_tokens=3)
    chat.answer(Conversation(loaded, enable_thinking=True), SEVEN, options)
    out, err = capsys.readouterr()
    assert out == "The answer is 42.\n"
    assert err.startswith("thinking: Six sevens make 42.\n") and "tok/s" in err
    chat.answer(Conversation(loaded), SEVEN, options)  # thinking off: the template says so
    out, err = capsys.readouterr()
    assert out == "42, of course.\n" and "thinking" not in err
    chat.answer(Conversation(loaded), PARIS, options)
    out, _ = capsys.readouterr()
    assert out == '\n[tool call] get_weather {"city": "Paris", "unit": "celsius"}\n\n'

