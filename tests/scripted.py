"""A Gemma 4 chat model whose replies are scripted, for tests of tool calls and thinking end to end.

`make_scripted_model` writes a checkpoint directory: the tiny dense fixture target with a
character-level tokenizer that has Gemma 4's control tokens at their real ids, the released
31B chat template (`chat_template.jinja`) and Gemma 4's stop tokens. `ScriptedTarget` wraps the
loaded target: its cache, hidden states and K/V stay real (so the real MTP drafter drafts
against it, mostly wrongly: rejections happen), but its logits put all the probability on the
token that follows the last N tokens in one of the script's transcripts (`<turn|>` where none
matches). A transcript is the end of a prompt (N tokens or more) followed by the reply the model
gives to it, so a reply is known exactly, whatever API, batch or draft length produced the prompt.

The row's token history lives in one extra full-attention cache layer (token ids as values,
slot = position), so it follows the rows through batching and rollback like any K/V.

`python tests/scripted.py --model DIR [--script FILE] [--chunk-seconds S] [server options]` serves it
over HTTP (`--chunk-seconds`: each prompt chunk takes S seconds more, a long prefill in small).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from chat_helpers import DRAFTER, GEMMA4_EOS, TINY, write_gemma4_tokenizer  # noqa: E402

TEMPLATE = TESTS / "fixtures" / "real_configs" / "google--gemma-4-31B-it" / "chat_template.jinja"
CONTEXT = 8192  # char-level prompts with tool declarations (and a 20-turn session) are long
N = 48  # tokens of context that select the next token
TURN_END = 106


def make_scripted_model(dest: Path) -> Path:
    shutil.copytree(TINY / "target", dest)
    write_gemma4_tokenizer(dest, TEMPLATE.read_text())
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    gen = json.loads((dest / "generation_config.json").read_text())
    (dest / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": GEMMA4_EOS}))
    return dest


class _Config:
    """The inner target's config, with geometry for the history layer the cache adds."""

    def __init__(self, inner, layers: int):
        self._inner, self._layers = inner, layers

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def layer_kv_heads(self, i: int) -> int:
        return self._inner.layer_kv_heads(i) if i < self._layers else 1

    def layer_head_dim(self, i: int) -> int:
        return self._inner.layer_head_dim(i) if i < self._layers else 1


class ScriptedTarget:
    """`inner` with scripted logits; `script` holds (end of a prompt, reply) token id lists."""

    pipeline = None

    def __init__(self, inner, script: Sequence[tuple[list, list]], n: int = N, chunk_seconds: float = 0.0):
        self.inner, self.n, self.chunk_seconds = inner, n, chunk_seconds
        self.layer = len(inner.make_cache(1).layer_types)  # the history layer's index
        self.config = _Config(inner.config, self.layer)
        table: dict = {}
        for tail, reply in script:
            if len(tail) < n:
                raise ValueError(f"a prompt's end must be {n} tokens or more, got {len(tail)}")
            t = [*tail, *reply]
            for j in range(len(tail) - 1, len(t) - 1):  # the windows that pick the reply's tokens
                key = tuple(t[j - n + 1: j + 1])
                if table.setdefault(key, t[j + 1]) != t[j + 1]:
                    raise ValueError(f"the script is ambiguous after {key}")
        self.windows = mx.array(list(table) or [[-2] * n], dtype=mx.int32)
        self.nexts = mx.array(list(table.values()) or [TURN_END], dtype=mx.int32)

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def make_cache(self, batch_size: int = 1, max_rollback: int = 0):
        from mlx_mtp.cache.kv import FULL, KVCache

        c = self.inner.make_cache(batch_size, max_rollback)
        return KVCache([*c.layer_types, FULL], c.window, batch_size, max_rollback)

    def __call__(self, tokens: mx.array, cache=None, keep: Optional[int] = None):
        from mlx_mtp.models.base import TargetOutput

        steps, begin = [], cache.begin
        cache.begin = lambda length: steps.append(begin(length)) or steps[-1]  # the forward's slots
        try:
            out = self.inner(tokens, cache, keep)
        finally:
            del cache.begin
        ids = tokens.astype(mx.float32)[:, None, :, None]
        _, history = steps[0].store(self.layer, ids, ids)  # (B, 1, T, 1): slot = position
        if keep == 0:
            if self.chunk_seconds:  # a prompt chunk of a slow model: the worker is busy meanwhile
                mx.eval(out.hidden if out.hidden is not None else history)
                time.sleep(self.chunk_seconds)
            return out
        positions = steps[0].positions[:, tokens.shape[1] - (keep or tokens.shape[1]):]
        return TargetOutput(self._logits(history[:, 0, :, 0].astype(mx.int32), positions), out.hidden,
                            out.shared_kv)

    def ragged(self, chunks, caches, wanted):
        from mlx_mtp.models.base import one_by_one

        return one_by_one(self, chunks, caches, wanted)

    def _logits(self, history: mx.array, positions: mx.array) -> mx.array:
        B, L = positions.shape
        at = positions[..., None] - (self.n - 1) + mx.arange(self.n)  # (B, L, n) the last n positions
        context = mx.take_along_axis(history, mx.maximum(at, 0).reshape(B, -1), axis=1).reshape(B, L, self.n)
        context = mx.where(at >= 0, context, -1)
        match = mx.all(context[:, :, None, :] == self.windows[None, None], axis=-1)  # (B, L, windows)
        nxt = mx.where(match.any(-1), self.nexts[mx.argmax(match, axis=-1)], TURN_END)
        return mx.where(mx.arange(self.vocab_size) == nxt[..., None], 0.0, -1e9)

    def shared_kv(self, cache):
        return self.inner.shared_kv(cache)

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed(tokens)


def load_scripted(model_dir: Path, script: Sequence[tuple[str, str]] = (), ngram: bool = True,
                  chunk_seconds: float = 0.0):
    """`load()` the model with the tiny MTP drafter (and prompt lookup where its proposal is
    long, so that drafts are accepted too) and script it: `script` holds (end of a prompt,
    reply) texts; a reply ends with its stop token (`<turn|>` or `<|tool_response>`)."""
    import mlx_mtp

    loaded = mlx_mtp.load(model_dir, DRAFTER, ngram=ngram)

    def encode(text: str) -> list:
        return loaded.tokenizer.encode(text, add_special_tokens=False)

    pairs = [(encode(tail), encode(reply)) for tail, reply in script or SCRIPT]
    return loaded._replace(target=ScriptedTarget(loaded.target, pairs, chunk_seconds=chunk_seconds))


# ---- the scenarios the tests play --------------------------------------------------------------

OFF = "<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"  # the 31B template's generation prompt
ON = "<turn|>\n<|turn>model\n"  # ... with thinking on


def _function(name: str, description: str, **properties) -> dict:
    parameters = {"type": "object", "properties": {k: {"type": v} for k, v in properties.items()},
                  "required": list(properties)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


TOOLS = [_function("get_weather", "The weather in a city now", city="string", unit="string"),
         _function("get_time", "The time in a time zone", zone="string")]
WEATHER = ('{"temperature": 15, "sky": "clear"}', "It is 15 degrees and clear in Paris.")  # tool result, answer
TWO = [("Oslo", "Oslo: light rain"), ("Rome", "Rome: sunny and 24")]
OSLO = '{"city": "Oslo", "sky": "rain", "temperature": 7}'
STORY = ("Once upon a time a small robot named Bolt lived in a lighthouse. Every night Bolt polished the lamp, "
         "and every morning the fishermen waved. The end.")


def ask(text: str, thinking: bool = False) -> str:
    """The end of a prompt whose last message is the user's `text`."""
    return "<|turn>user\n" + text + (ON if thinking else OFF)


def _call(name: str, **arguments) -> str:
    return f"<|tool_call>call:{name}{{" + ",".join(f'{k}:<|"|>{v}<|"|>' for k, v in arguments.items()) + "}<tool_call|>"


def _result(name: str, value: str) -> str:
    return f'<|tool_response>response:{name}{{value:<|"|>{value}<|"|>}}<tool_response|>'


# An agent's tool session: text before every call, a reminder beside every other result (as
# Claude Code sends them), thinking off or on. Its replies follow each other only where each
# prompt renders the earlier replies as the model generated them.
SESSION, TURNS = "Please run the twenty-step session for me now.", 20


def session_reply(i: int, thinking: bool, channel_open: bool) -> str:
    body = "All twenty steps are done.<turn|>" if i == TURNS - 1 else \
        f"Step {i}: on it.\n" + _call("get_time", zone=f"Z{i}") + "<|tool_response>"
    thought = f"Step {i} needs the time.<channel|>"
    return (thought if channel_open else "<|channel>thought\n" + thought) + body if thinking else body


def reminded(i: int) -> bool:
    return i % 2 == 1


def session_script(thinking: bool) -> list:
    """(end of prompt, reply) pairs of the session's turns."""
    pairs, tail, channel_open = [], ask(SESSION, thinking), False
    for i in range(TURNS):
        reply = session_reply(i, thinking, channel_open)
        pairs.append((tail, reply))
        tail = reply.removesuffix("<|tool_response>") + _result("get_time", f"t{i}")
        channel_open = thinking and not reminded(i)
        tail += "<turn|>\n" + ask(f"<system-reminder>Mind step {i}.</system-reminder>", thinking) if reminded(i) \
            else "<|channel>thought\n" * channel_open
    return pairs


SCRIPT = [
    # a two-step tool loop: the call, then the answer once the result is in
    (ask("What is the weather in Paris right now?"),
     _call("get_weather", city="Paris", unit="celsius") + "<|tool_response>"),
    (_result("get_weather", WEATHER[0]), WEATHER[1] + "<turn|>"),
    # thinking on and off: the same question, a different prompt, a different reply
    (ask("Please work out six times seven for me.", thinking=True), "<|channel>thought\nSix sevens make 42.<channel|>The answer is 42.<turn|>"),
    (ask("Please work out six times seven for me."), "42, of course.<turn|>"),
    # parallel calls, then an answer from both results
    (ask("Compare the weather in Oslo and in Rome."),
     "".join(_call("get_weather", city=c) for c, _ in TWO) + "<|tool_response>"),
    ("".join(_result("get_weather", r) for _, r in TWO), "Oslo is wet; Rome is the place to be.<turn|>"),
    # malformed calls come back as text: an unterminated string, a syntax that is not Gemma's
    (ask("Now show me a broken tool call."), 'Trying.<|tool_call>call:get_weather{city:<|"|>Lyon}<tool_call|> oops<turn|>'),
    (ask("Now use some other call syntax."), "Sure: <|tool_call>get_weather(city=Nice)<tool_call|><turn|>"),
    # a call whose close tag never comes: the tool response (a stop token) ends it
    (ask("What time is it in UTC, please?"), '<|tool_call>call:get_time{zone:<|"|>UTC<|"|>}<|tool_response>'),
    # a long plain answer (past the sliding window, stop strings and max_tokens cut it)
    (ask("Tell me a short story about a robot."), STORY + "<turn|>"),
    # JSON as a schema asks for it (structured output)
    (ask("Describe the weather in Oslo as JSON."), OSLO + "<turn|>"),
    *session_script(thinking=False), *session_script(thinking=True),
]


KEY = "sk-scripted"
README = TESTS.parent / "README.md"


def serve_scripted(tmp: Path, *server_args: str):
    """Start `python tests/scripted.py` on a free port (with the API key KEY); a context
    manager yielding its URL."""
    import contextlib

    from apps.serve_load import free_port, start_server, stop_server, wait_healthy

    @contextlib.contextmanager
    def running():
        model = make_scripted_model(tmp / "model")
        port, log = free_port(), tmp / "server.log"
        argv = [sys.executable, str(Path(__file__)), "--model", str(model), "--api-key", KEY,
                "--draft-tokens", "3", "--log-level", "warning", *server_args]  # drafting always
        proc = start_server(argv, port, str(log))
        try:
            wait_healthy(proc, port)
            yield f"http://127.0.0.1:{port}"
        finally:
            stop_server(proc)
        assert proc.returncode == 0, log.read_text()

    return running()


def run_readme_example(url: str, marker: str, heading: str = "## Agents") -> str:
    """Run the README's Python block under `heading` that contains `marker`, as written but for the
    server's address, model name and key, in a fresh process against the scripted server at `url`;
    returns what it printed."""
    section = README.read_text().split(heading, 1)[1].split("\n## ", 1)[0]
    code = next(block for block in re.findall(r"```python\n(.*?)```", section, re.S) if marker in block)
    assert "127.0.0.1:8000" in code and '"mlx-mtp-demo"' in code and 'api_key="none"' in code
    code = (code.replace(":8000", ":" + url.rsplit(":", 1)[1]).replace('"mlx-mtp-demo"', '"gemma4-scripted"')
            .replace('api_key="none"', f'api_key="{KEY}"'))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def main(argv=None) -> int:
    import argparse

    from mlx_mtp.server import cli

    ap = argparse.ArgumentParser(description="serve a scripted Gemma 4 chat model")
    ap.add_argument("--model", required=True)
    ap.add_argument("--script", help="a JSON list of [end of prompt, reply] pairs (default: SCRIPT)")
    ap.add_argument("--chunk-seconds", type=float, default=0.0, help="extra seconds each prompt chunk takes")
    args, rest = ap.parse_known_args(argv)
    script = json.loads(Path(args.script).read_text()) if args.script else SCRIPT
    loaded = load_scripted(Path(args.model), script, chunk_seconds=args.chunk_seconds)
    return cli.serve(loaded, "gemma4-scripted", cli.parse_args(rest))


if __name__ == "__main__":
    sys.exit(main())
