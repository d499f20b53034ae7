"""What each way of rendering a history costs (issue 49): prompt tokens prefilled over a
conversation against the tokens new to it, per `Request.history` mode, thinking off and on.

Three conversations, each re-sent whole at every call as apps and agents send them, through one
`Engine` per run (its prefix cache starts empty):
- the agent: the 20-turn tool session of tests/test_server_agent.py on its scripted Gemma 4 model
  (tests/scripted.py: text before each call, a reminder beside every other result; the released
  31B template). Needs a checkout of the repository (the scripted model lives in tests/).
- a chat whose every reply reasons: 10 questions to the same scripted model (a system prompt, a
  question, a reply that reasons then answers);
- the demo chat: 10 user turns to the bundled demo pair (its own template), greedy replies.
Every mode sends back the same replies: those the model wrote on the first mode's run.

Modes: `generated` (the default: replies as the model generated them, reasoning left out once the
model's turn ended and a user message came), `generated + keep_thinking`, and `template` (the chat
template's own rendering, as `apply_chat_template`).

A prompt's new tokens are those past its longest common prefix with the previous prompt and its
reply (what no cache could have held); prefilled are what the engine fed (`Stats.prompt_tokens`).
The ratio is 1.00 when nothing is prefilled twice. Token counts are exact and the same on every
machine and run; no timing is measured.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from .report import section, table

ROOT = Path(__file__).resolve().parents[2]
MODES = {"generated": {}, "generated + keep_thinking": {"keep_thinking": True}, "template": {"history": "template"}}
DEMO_TURNS = ["def fib(n):", "Now write it iteratively.", "class Stack:", "Add a peek method.",
              "import os\nfor root, dirs, files in os.walk('.'):", "def read_lines(path):",
              "Handle a missing file.", "def parse_args(argv):", "Add a --verbose flag.", "def main():"]


def run_histories(args, log) -> dict:
    import mlx_mtp
    from mlx_mtp.demo import DRAFTER_DIR, TARGET_DIR

    agent = _agent_model(log)
    demo = mlx_mtp.load(TARGET_DIR, drafter=DRAFTER_DIR)
    scenarios = (("agent, 20 turns", agent, _agent_turns), ("scripted chat that reasons, 10 turns", agent, _chat_turns),
                 ("demo chat, 10 turns", demo, _demo_turns))
    runs = []
    for scenario, loaded, play in scenarios:
        for thinking in (False, True):
            replies: list = []  # the first mode's replies, sent back by the other modes: one conversation
            for mode, options in MODES.items():
                with mlx_mtp.Engine(loaded) as engine:
                    row = _measure(play(engine, thinking, options, replies))
                runs.append(dict(scenario=scenario, thinking=thinking, mode=mode, **row))
                log(f"{scenario}, thinking {'on' if thinking else 'off'}, {mode}: {row}")
    return dict(mode="histories", runs=runs)


def _measure(turns) -> dict:
    """Prefilled and new tokens over a conversation's calls, each (prompt ids, reply ids, prefilled,
    whether the reply is the one sent back)."""
    prefilled = new = 0
    before: list = []
    same, last = True, 0
    for prompt, reply, fed, kept in turns:
        common = next((i for i, (a, b) in enumerate(zip(prompt, before)) if a != b), min(len(prompt), len(before)))
        new += len(prompt) - common
        prefilled += fed
        before, last, same = prompt + reply, len(prompt), same and kept
    return dict(prefilled=prefilled, new=new, ratio=round(prefilled / new, 3), last_prompt=last, own_replies=same)


def _agent_model(log):
    tests = ROOT / "tests"
    if not (tests / "scripted.py").is_file():
        raise SystemExit("histories: the agent scenario needs the repository's tests/ (a checkout, not an install)")
    sys.path.insert(0, str(tests))
    from scripted import SCRIPT, load_scripted, make_scripted_model

    log("loading the scripted Gemma 4 model (tests/scripted.py)")
    return load_scripted(make_scripted_model(Path(tempfile.mkdtemp()) / "model"), [*SCRIPT, *_chat_script()])


def _call(engine, messages: list, replies: list, i: int, **options):
    """One call: (prompt ids, reply ids, prefilled, the reply is the one sent back), and the
    assistant message sent back: the model's own on the first mode's run, that run's later."""
    import mlx_mtp

    handle = engine.submit(mlx_mtp.Request(messages=list(messages), **options))
    done = handle.result()
    calls = [{"id": f"call_{i}_{c.index}", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in done.tool_calls]
    message = {"role": "assistant", "content": done.text, **({"reasoning_content": done.reasoning} if done.reasoning
                                                              else {}), **({"tool_calls": calls} if calls else {})}
    if len(replies) <= i:
        replies.append(message)
    return (handle.prompt_keys, list(done.tokens), done.stats.prompt_tokens, message == replies[i]), replies[i]


def _agent_turns(engine, thinking: bool, options: dict, replies: list):
    from scripted import SESSION, TOOLS, TURNS, reminded

    messages = [{"role": "system", "content": "OpenAI's session."}, {"role": "user", "content": SESSION}]
    for i in range(TURNS):
        measured, message = _call(engine, messages, replies, i, tools=TOOLS, enable_thinking=thinking,
                                  max_tokens=200, draft_tokens=3, **options)
        yield measured
        messages.append(message)
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": f"t{i}"} for c in message.get("tool_calls", [])]
        if reminded(i):
            messages.append({"role": "user", "content": f"<system-reminder>Mind step {i}.</system-reminder>"})


CHAT_QUESTIONS = [f"Please think it over, then tell me what {i} times {i + 2} makes." for i in range(10)]


def _chat_script() -> list:
    """The reasoning chat's replies, thinking on and off: each reasons, then answers."""
    from scripted import ask

    return [(ask(q, thinking), f"<|channel>thought\n{i} times {i + 2} is {i * (i + 2)}, since I multiply them."
                               f"<channel|>It makes {i * (i + 2)}.<turn|>")
            for i, q in enumerate(CHAT_QUESTIONS) for thinking in (False, True)]


def _chat_turns(engine, thinking: bool, options: dict, replies: list):
    messages = [{"role": "system", "content": "You answer arithmetic."}]
    for i, question in enumerate(CHAT_QUESTIONS):
        messages.append({"role": "user", "content": question})
        measured, message = _call(engine, messages, replies, i, enable_thinking=thinking, max_tokens=100,
                                  draft_tokens=3, **options)
        yield measured
        messages.append(message)


def _demo_turns(engine, thinking: bool, options: dict, replies: list):
    import mlx_mtp

    messages = []
    for i, text in enumerate(DEMO_TURNS):
        messages.append({"role": "user", "content": text})
        measured, message = _call(engine, messages, replies, i, enable_thinking=thinking, max_tokens=64,
                                  sampling=mlx_mtp.SamplingParams(temperature=0), **options)
        yield measured
        messages.append(message)


def histories_md(res: dict) -> str:
    intro = ("Exact token counts (no timing): each conversation re-sent whole at every call to a fresh `Engine`; "
             "*new*: tokens past each prompt's common prefix with the previous prompt and its reply; *prefilled*: "
             "what the engine fed (`Stats.prompt_tokens`); *last prompt*: the last call's prompt tokens (what the "
             "model reads). Every mode sends back the same replies, the first mode's (the model's own there); "
             "*own replies*: the model wrote the replies sent back (the scripted model answers as scripted only "
             "where the prompt is the one the script expects).")
    rows = [[r["scenario"], "on" if r["thinking"] else "off", r["mode"], r["prefilled"], r["new"],
             f"{r['ratio']:.2f}", r["last_prompt"], "yes" if r["own_replies"] else "no"] for r in res["runs"]]
    return section("Histories: prefilled tokens over new tokens, per mode", intro,
                   table(["conversation", "thinking", "history", "prefilled", "new", "prefilled / new",
                          "last prompt", "own replies"], rows))
