"""chat_format: the released Gemma 4 templates rendered exactly as transformers renders them
(fixtures made once by tests/reference/make_chat_renderings.py), and the model's output split into
content, reasoning and tool calls however it is cut into pieces."""

import json
from functools import lru_cache
from pathlib import Path

import pytest
from chat_helpers import IMAGE_SPECIALS, gemma4_vocab, write_gemma4_tokenizer

from mlx_mtp.formats import chat as chat_format
from mlx_mtp.formats.chat import Delta, OutputParser, ToolCall, parse, parse_call, render
from mlx_mtp.loading import load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
CASES = {c["name"]: c for c in json.loads((FIXTURES / "chat_templates" / "cases.json").read_text())}
REFERENCE = json.loads((FIXTURES / "chat_templates" / "renderings.json").read_text())
# "demo" (the demo pair's own template, rendered with its BPE tokenizer) is covered by the template-mode tests
TEMPLATES = {name: t for name, t in REFERENCE["templates"].items() if name != "demo"}


@lru_cache(maxsize=None)
def tokenizer(name: str, root: Path):
    """The reference's tokenizer: Gemma 4's control tokens, its image tokens at the vision fixtures' ids."""
    path = root / name
    vocab = {t: i for t, i in gemma4_vocab().items() if i not in IMAGE_SPECIALS.values()}
    write_gemma4_tokenizer(path, (FIXTURES / TEMPLATES[name]["file"]).read_text(), {**vocab, **IMAGE_SPECIALS})
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("templates")
    return lambda name: tokenizer(name, root)


def options(case: dict) -> dict:
    return dict(tools=case.get("tools"), enable_thinking=case.get("enable_thinking", False),
                add_generation_prompt=case.get("add_generation_prompt", True),
                continue_final_message=case.get("continue_final_message", False))


# ---- rendering -----------------------------------------------------------------------------------


def test_fixtures_come_from_transformers_5_23_for_every_template_and_case():
    assert REFERENCE["transformers"] == "5.23.0"
    assert len(TEMPLATES) == 5 and len(CASES) >= 15
    for name, t in TEMPLATES.items():
        assert set(t["renderings"]) == set(CASES), name
        assert all("text" in r for r in t["renderings"].values()), name  # none of the cases is refused


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_renderings_equal_transformers(tokenizers, template):
    """The template's own rendering (history="template") is apply_chat_template's, token for token:
    with content as text, its `sanitize_control_tokens=True` tokens; parsing content, its default."""
    tok = tokenizers(template)
    for name, expected in TEMPLATES[template]["renderings"].items():
        case = CASES[name]
        prompt = render(tok, case["messages"], **options(case))
        assert prompt.text == expected["text"], (template, name)
        assert prompt.tokens == expected.get("tokens_sanitized", expected["tokens"]), (template, name)
        assert prompt.tokens[0] == 2 and prompt.tokens.count(2) == 1  # the template's own <bos>, once
        parsed = render(tok, case["messages"], **options(case), content_as_text=False)
        assert (parsed.text, parsed.tokens) == (expected["text"], expected["tokens"]), (template, name)


def test_the_demo_template_renders_as_transformers_with_the_demo_tokenizer():
    from mlx_mtp.demo import TARGET_DIR

    tok = load_tokenizer(Path(TARGET_DIR))
    for name, expected in REFERENCE["templates"]["demo"]["renderings"].items():
        case = CASES[name]
        prompt = render(tok, case["messages"], **options(case))
        assert (prompt.text, prompt.tokens) == (expected["text"], expected.get("tokens_sanitized", expected["tokens"])), name


def test_a_prompt_that_opens_the_reasoning_channel_starts_the_parser_in_it(tokenizers):
    case = CASES["tool_loop_thinking"]
    latest = render(tokenizers("large-2026-07-14"), case["messages"], **options(case))
    assert latest.text.endswith("<|channel>thought\n") and latest.open == "thought\n"
    reply = parse("Rain is likely.<channel|>Take an umbrella.", reasoning=latest.open)
    assert (reply.reasoning, reply.content) == ("Rain is likely.", "Take an umbrella.")
    older = render(tokenizers("31b-2026-04-10"), case["messages"], **options(case))
    assert older.open is None  # the older template leaves the model to open it
    off = render(tokenizers("31b-2026-04-10"), CASES["system_user"]["messages"])
    assert off.text.endswith("<|turn>model\n<|channel>thought\n<channel|>") and off.open is None


def test_turn_ends_are_shared_with_the_rendering_of_more_turns(tokenizers):
    tok = tokenizers("e2b-2026-04-13")
    case = CASES["tool_loop_answered"]
    messages, tools = case["messages"], case["tools"]
    stops = [tok.convert_tokens_to_ids(t) for t in chat_format.STOP_TOKENS]
    full = render(tok, messages, tools, add_generation_prompt=False).tokens
    for i in range(1, len(messages)):
        prefix = render(tok, messages[:i], tools).tokens  # as the call after message i was sent
        ends = chat_format.turn_ends(prefix, stops)
        assert ends and all(full[:end] == prefix[:end] for end in ends), i
    ends = chat_format.turn_ends(full, stops)
    assert tok.decode(full[: ends[0]]).endswith("<tool|><turn|>")  # the system turn, tools included
    assert tok.decode(full[: ends[1]]).endswith("run a command.<turn|>")


@pytest.mark.parametrize("messages, tools, match", [
    ([], None, "non-empty"),
    ([{"role": "bot", "content": "x"}], None, "role"),
    ([{"role": "user", "content": 3}], None, "content"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}], None, "object"),
    ([{"role": "assistant", "tool_calls": [{"type": "function"}]}], None, "name"),
    ([{"role": "user", "content": "x"}], [{"name": "f"}], "tools\\[0\\]"),
    ([{"role": "user", "content": "x"}], [{"type": "function", "function": {"name": "f", "parameters": 1}}],
     "parameters"),
])
def test_malformed_messages_and_tools_are_refused_in_one_line(tokenizers, messages, tools, match):
    with pytest.raises(ValueError, match=match):
        render(tokenizers("e2b-2026-04-13"), messages, tools)


def test_a_template_refusal_or_deep_nesting_is_a_value_error(tokenizers):
    nested: dict = {}
    for _ in range(400):
        nested = {"x": nested}
    call = {"type": "function", "function": {"name": "f", "arguments": nested}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]}]
    with pytest.raises(ValueError, match="nested too deeply"):
        render(tokenizers("e2b-2026-04-13"), messages)
    with pytest.raises(ValueError, match="cannot render.*no \"content\""):  # transformers: nothing to continue
        render(tokenizers("e2b-2026-04-13"), [messages[0], {"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": {}}}]}], continue_final_message=True)


# ---- histories as generated ----------------------------------------------------------------------

GET_TIME = [{"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}, "fmt": {"type": "string"}}}}}]


def generate(prompt, reply: str) -> tuple[dict, str]:
    """The assistant message a client sends back for `reply` (the model's output after `prompt`,
    ending with its stop token), and the text the model's state holds after it (less the stop)."""
    message = parse(reply, reasoning=prompt.open).message()
    stop = "<|tool_response>" if reply.endswith("<|tool_response>") else "<turn|>"
    return message, prompt.text + reply.removesuffix(stop)


@pytest.mark.parametrize("template", sorted(TEMPLATES))
@pytest.mark.parametrize("thinking", [False, True], ids=["off", "on"])
@pytest.mark.parametrize("keep", [False, True], ids=["drop-thinking", "keep-thinking"])
def test_a_history_renders_as_the_model_generated_it(tokenizers, template, thinking, keep):
    """Text before calls (untrimmed), arguments in the model's order, thinking, tool responses,
    a reminder beside them and the next user turn: each prompt extends the last one's state, but
    that a model turn's reasoning goes once the turn ended and a new user message came (unless kept)."""
    tok, think = tokenizers(template), "<|channel>thought\nLet me see.<channel|>" if thinking else ""
    kw = dict(tools=GET_TIME, enable_thinking=thinking, as_generated=True, keep_thinking=keep)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Time in UTC?"}]
    prompt = render(tok, messages, **kw)
    assert prompt.text == render(tok, messages, GET_TIME, enable_thinking=thinking).text  # no history: the template
    call = '<|tool_call>call:get_time{zone:<|"|>UTC<|"|>,fmt:<|"|>24h<|"|>}<tool_call|><|tool_response>'
    turns = [(think + " I will look.\n" + call, [{"role": "tool", "content": "12:00"}]),
             ("Again." + call, [{"role": "tool", "content": "12:01"},
                                {"role": "user", "content": "<system-reminder>Be quick.</system-reminder>"}]),
             (think + "It is 12:01.<turn|>", [{"role": "system", "content": "Mind the user."},
                                              {"role": "user", "content": " Thanks! "}]),
             (think + "You are welcome.<turn|>", [])]
    for i, (reply, after) in enumerate(turns):
        message, state = generate(prompt, (prompt.open is not None) * "Thinking.<channel|>" + reply)
        messages += [message, *[{**m, "tool_call_id": "call_0"} for m in after]]
        prompt = render(tok, messages, **kw)
        if i == 2 and thinking and not keep:  # the first turn ended (reminders inside it did not end it)
            for thought in (think, "<|channel>thought\nThinking.<channel|>", "Thinking.<channel|>"):
                state = state.replace(thought, "")
            assert "Let me see." not in prompt.text and "Thinking." not in prompt.text
        assert prompt.text.startswith(state), (template, i, prompt.text[len(state) - 60:], state[-60:])
    assert prompt.text.count("<|turn>model") == 4 and "<|turn>system\nMind the user.<turn|>" in prompt.text
    assert '<tool_response|><turn|>\n<|turn>user\n<system-reminder>' in prompt.text  # the model turn closed
    assert ("It is 12:01." in prompt.text) and (prompt.text.count("Let me see.") == ((3 if keep else 1) if thinking else 0))  # the last reply keeps its own
    partial = render(tok, messages + [{"role": "assistant", "content": "You"}], **kw, continue_final_message=True)
    assert partial.text == prompt.text + "You"  # an answer continued (Anthropic's prefill)


# ---- parsing -------------------------------------------------------------------------------------


def stream(text: str, cut: int, **kwargs) -> list:
    """The deltas of `text` fed in pieces of `cut` characters (0: all at once)."""
    parser, out = OutputParser(**kwargs), []
    pieces = [text[i: i + cut] for i in range(0, len(text), cut)] if cut else [text]
    for piece in pieces:
        out += parser.feed(piece)
    return out + parser.finish()


def merged(deltas: list) -> list:
    return chat_format.merge(deltas)


WEATHER = ToolCall("get_weather", {"city": "Paris", "n": 3}, 0)
CASES_PARSE = [
    ("plain text", {}, [Delta("content", "plain text")]),
    ("<|channel>thought\nHmm, {x} <|\"|>.<channel|>The answer.", {},
     [Delta("reasoning", 'Hmm, {x} ".'), Delta("content", "The answer.")]),  # no control token in text
    ('Sure.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,n:3}<tool_call|>', {},
     [Delta("content", "Sure."), Delta("tool_call", call=WEATHER)]),
    # braces, quotes, commas and tags inside strings; nested objects and lists; every scalar
    ('<|tool_call>call:run{cmd:<|"|>echo "}" {a:[1,2]} <tool_call|> x<|"|>,opts:{deep:[1,-2.5e3,true,false,null,'
     '<|"|>s<|"|>,{k:[]}]},"quoted":"j\\"son"}<tool_call|>', {},
     [Delta("tool_call", call=ToolCall("run", {"cmd": 'echo "}" {a:[1,2]} <tool_call|> x', "quoted": 'j"son',
                                             "opts": {"deep": [1, -2500.0, True, False, None, "s", {"k": []}]}}))]),
    # several calls back to back; the second one's close tag is missing at the end of the output
    ('<|tool_call>call:a{}<tool_call|><|tool_call>call:b{x:<|"|>1<|"|>}', {},
     [Delta("tool_call", call=ToolCall("a", {}, 0)), Delta("tool_call", call=ToolCall("b", {"x": "1"}, 1))]),
    # a call with no close tag, followed by the next call
    ('<|tool_call>call:a{x:1}<|tool_call>call:b{y:2}<tool_call|>', {},
     [Delta("tool_call", call=ToolCall("a", {"x": 1}, 0)), Delta("tool_call", call=ToolCall("b", {"y": 2}, 1))]),
    # malformed calls come back as what the model wrote, less its control tokens
    ('Oops <|tool_call>call:f{a:<|"|>never closed', {}, [Delta("content", 'Oops call:f{a:"never closed')]),
    ("<|tool_call>not a call<tool_call|> then text", {}, [Delta("content", "not a call then text")]),
    ("<|tool_call>call:f{a:1,,}<tool_call|>", {}, [Delta("content", "call:f{a:1,,}")]),
    # the `call:` prefix missing: repaired
    ("<|tool_call>f{a:1}<tool_call|>", {}, [Delta("tool_call", call=ToolCall("f", {"a": 1}, 0))]),
    # stray tags are dropped: a close tag after a call, a tool response, a lone channel close
    ("<|tool_call>call:f{}<tool_call|><tool_call|><|tool_response>Done<channel|>.", {},
     [Delta("tool_call", call=ToolCall("f", {}, 0)), Delta("content", "Done.")]),
    # a call inside the reasoning ends it
    ('<|channel>thought\nI will call.<|tool_call>call:f{}<tool_call|>', {},
     [Delta("reasoning", "I will call."), Delta("tool_call", call=ToolCall("f", {}, 0))]),
    # without tools the call syntax is text, less its control tokens
    ('<|tool_call>call:f{a:<|"|>x<|"|>}<tool_call|>', {"tools": False}, [Delta("content", 'call:f{a:"x"}')]),
    # text that only looks like the start of a tag is released at the end
    ("a <| b <|tool", {}, [Delta("content", "a <| b <|tool")]),
    # output that starts inside a channel the prompt opened (with or without its label)
    ("Thinking.<channel|>Answer.", {"reasoning": "thought\n"},
     [Delta("reasoning", "Thinking."), Delta("content", "Answer.")]),
    ("thought\nThinking.<channel|>Answer.", {"reasoning": ""},
     [Delta("reasoning", "Thinking."), Delta("content", "Answer.")]),
]


@pytest.mark.parametrize("text, kwargs, expected", CASES_PARSE)
@pytest.mark.parametrize("cut", [0, 1, 2, 5])
def test_output_parser(text, kwargs, expected, cut):
    assert merged(stream(text, cut, **kwargs)) == expected


def test_a_call_cut_by_the_budget_is_dropped_unless_its_arguments_are_complete():
    for text, expected in [('Let me edit.<|tool_call>call:Edit{path:<|"|>a.py<|"|>,new:<|"|>def f', []),
                           ("<|tool_call>call:f{a:1}", [Delta("tool_call", call=ToolCall("f", {"a": 1}, 0))])]:
        parser = OutputParser()
        deltas = parser.feed(text)
        assert merged(deltas + parser.finish(cut=True)) == [Delta("content", "Let me edit.")] * bool(deltas) + expected


def test_a_call_is_released_whole_and_only_when_complete():
    text = 'Hi <|tool_call>call:f{a:<|"|>x}y<|"|>}<tool_call|>Bye'
    parser, seen = OutputParser(), []
    for i, ch in enumerate(text):
        deltas = parser.feed(ch)
        seen.append((i, deltas))
        for d in deltas:
            assert d.kind == "tool_call" or "<|tool_call>" not in d.text and "call:" not in d.text
    calls = [(i, d) for i, ds in seen for d in ds if d.kind == "tool_call"]
    assert len(calls) == 1 and calls[0][0] == text.index("<tool_call|>") + len("<tool_call|>") - 1
    assert calls[0][1].call.arguments == {"a": "x}y"}


def test_parse_call_and_reply_message():
    assert parse_call('call:ns.tool-1{k:<|"|>v<|"|>} tail') == ("ns.tool-1", {"k": "v"}, " tail")
    assert parse_call("call:{a:1}") is None and parse_call("call:f[1]") is None and parse_call("call:f{") is None
    deep = "call:f{a:" + "[" * 100 + "]" * 100 + "}"
    assert parse_call(deep) is None  # nesting beyond MAX_DEPTH is not a call
    reply = parse('<|channel>thought\nr<channel|>c<|tool_call>call:f{x:1}<tool_call|>')
    assert reply.message() == {"role": "assistant", "content": "c", "reasoning_content": "r", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
    assert WEATHER.arguments_json == '{"city": "Paris", "n": 3}'


def test_stop_tokens_are_the_turn_end_and_the_tool_response(tokenizers):
    assert chat_format.stop_tokens(tokenizers("e2b-2026-04-13")) == {106, 50}
