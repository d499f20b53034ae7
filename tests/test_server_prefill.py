"""A prefill longer than the client's patience, against the scripted Gemma 4 model made slow (each
prompt chunk takes CHUNK seconds more; tests/scripted.py): a stream opens at once and keeps the
client informed, and a client that gives up and retries resumes where the last attempt stopped."""

import json
import time

import httpx
import pytest
from scripted import KEY, serve_scripted

from mlx_mtp.server.metrics import parse as parse_metrics

MODEL = "gemma4-scripted"
CHUNK, KEEPALIVE = 0.45, 0.3  # seconds: a prompt chunk (512 tokens), the keep-alive period
SEVEN = "Please work out six times seven for me."


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    with serve_scripted(tmp_path_factory.mktemp("slow-server"), "--chunk-seconds", str(CHUNK),
                        "--keepalive-seconds", str(KEEPALIVE)) as url:
        yield url


def long_chat(seed: str) -> list:
    """About 2,600 tokens (char-level) before the scripted question: 6 chunks, ~7 forwards."""
    system = " ".join(f"{seed} rule {i}: keep the code tidy." for i in range(100))
    return [{"role": "system", "content": system}, {"role": "user", "content": SEVEN}]


def prefilled(url: str) -> float:
    return parse_metrics(httpx.get(url + "/metrics").text)["mlx_mtp:prompt_tokens_total"]


def attempt(url: str, body: dict, patience: float) -> tuple[float, list, bool]:
    """One streamed try that gives up after `patience` seconds: (seconds to the headers, the
    events seen with their times, whether the reply came whole)."""
    start, events = time.monotonic(), []
    with httpx.stream("POST", url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30) as r:
        opened = time.monotonic() - start
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append((time.monotonic() - start, json.loads(line[len("data: "):])))
                if events[-1][1]["type"] == "message_stop":
                    return opened, events, True
            if time.monotonic() - start > patience:
                break  # the client gives up: the connection closes
    return opened, events, False


def test_a_client_that_gives_up_every_t_seconds_gets_its_answer_and_nothing_is_prefilled_twice(slow):
    messages = long_chat("A")
    n = httpx.post(slow + "/v1/messages/count_tokens", headers={"x-api-key": KEY},
                   json={"model": MODEL, "messages": messages}).json()["input_tokens"]
    body = {"model": MODEL, "max_tokens": 50, "stream": True, "system": messages[0]["content"],
            "messages": messages[1:]}
    patience = 7 * CHUNK / 3  # a third of the prefill
    before, tries = prefilled(slow), []
    while len(tries) < 10:
        tries.append(attempt(slow, body, patience))
        if tries[-1][2]:
            break
    assert 3 <= len(tries) < 10 and tries[-1][2]
    for opened, events, _ in tries:  # headers, message_start and a ping at once (0.5 s), pings meanwhile
        assert opened < 1.5 and [e["type"] for _, e in events[:2]] == ["message_start", "ping"]
        assert events[1][0] < 1.5
    pings = [[t for t, e in events if e["type"] == "ping"] for _, events, _ in tries[:-1]]
    assert max(map(len, pings)) >= 2 and all(b - a < KEEPALIVE + 0.6 for p in pings for a, b in zip(p, p[1:]))
    text = "".join(e["delta"].get("text", "") for _, e in tries[-1][1] if e["type"] == "content_block_delta")
    assert text == "42, of course."
    usage = tries[-1][1][-2][1]["usage"]  # message_delta: what the last try read and prefilled
    assert usage["cache_read_input_tokens"] > n / 2
    work = prefilled(slow) - before
    assert n <= work <= 1.2 * n, (work, n)  # every attempt resumed where the last one stopped


def test_an_openai_stream_opens_with_its_role_chunk_then_comments_until_the_answer(slow):
    body = {"model": MODEL, "max_tokens": 50, "stream": True, "messages": long_chat("B")}
    start, lines = time.monotonic(), []
    with httpx.stream("POST", slow + "/v1/chat/completions", json=body, headers={"x-api-key": KEY},
                      timeout=30) as r:
        for line in r.iter_lines():
            if line:
                lines.append((time.monotonic() - start, line))
    first = json.loads(lines[0][1].removeprefix("data: "))
    assert lines[0][0] < 1.5 and first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = next(i for i, (_, line) in enumerate(lines) if '"content":"4' in line)
    assert content >= 3 and all(line == ": keep-alive" for _, line in lines[1:content])
    assert lines[content][0] > 7 * CHUNK * 0.8 and lines[-1][1] == "data: [DONE]"
