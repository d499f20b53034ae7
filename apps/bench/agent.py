"""Agent mode (issue 17): scripted agent sessions through the HTTP server, prefix cache on vs off.

An agent calls the server statelessly: every call re-sends the whole conversation. A session
here is a system prompt of about `--system-tokens` tokens (tool declarations, as agents send
them), a task, then up to `--calls` calls that each append the model's last reply and a "tool
result" of 40-120 tokens (held-out stdlib source, the demo pair's split), until the next call
would not fit the model's context. Scenarios: one session; `--sessions` concurrent sessions
with the same system prompt (different tasks); one session sampled with a seed. Each runs on a
fresh server with the prefix cache on (`--prompt-cache-gb`) and on one with it off
(`--prompt-cache-bytes 0`), started in turn by this command with the same model and warmed up
with one unrelated request.

Reported per scenario and server: prompt tokens prefilled over the session (llama.cpp's
`timings.prompt_n`) over the tokens new to it (the last call's prompt: every token of it was new
to exactly one call), client-side time to first token of the first and the last call, how many
sessions prefilled the shared system prompt (a call did if it restored fewer of its tokens from
the cache, `usage.prompt_tokens_details.cached_tokens`), and whether every reply equals the
cache-off reply. `--pair mid` runs the mid pair (the ~313M Gemma-4-shaped target with random
weights, here with the demo tokenizer's 4096-token vocabulary and `--context` positions) from a
checkpoint written once under the user cache dir, for long contexts where prefill dominates.

`--caches disk` (issue 30) runs each scenario on a server that also keeps its states in a fresh
directory (`--prompt-cache-dir`), stops it (SIGTERM), starts a new server on the directory and
runs the scenario again ("disk, restarted"): the replayed sessions restore from disk from their
first call. Reported beside it: the restarted server's first TTFT over the first server's (a cold
prefill), and the bytes per token new to the sessions that memory and the directory hold.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

import numpy as np

from apps.serve_load import free_port, start_server, stop_server, stream, wait_healthy

from . import regime
from .env import median
from .pairs import MID_DRAFTER, MID_TARGET, ROOT, build, n_params
from .report import fmt, section, table

DEMO = ROOT / "mlx_mtp" / "demo"
TOOLS = ["read_file(path: str) -> str: the file's text", "write_file(path: str, text: str): replace a file",
         "edit_file(path: str, old: str, new: str): replace one occurrence", "run(cmd: str) -> str: a shell command",
         "grep(pattern: str, path: str = '.') -> list[str]: matching lines", "list_dir(path: str) -> list[str]",
         "run_tests(path: str = 'tests') -> str: pytest's summary", "git_diff() -> str: the working tree's diff"]


def run_agent(args, log) -> dict:
    env = regime.child_env()  # the servers compute in our regime (refused before any work if they cannot)
    model, drafter, description = pair_dirs(args, log)
    tokenizer = _tokenizer(model)
    context = args.context if args.pair == "mid" else json.loads((model / "config.json").read_text())[
        "max_position_embeddings"]
    system = system_prompt(tokenizer, args.system_tokens)
    scenarios = {
        "one session": lambda url: [session(url, system, 0, args, context, tokenizer)],
        f"{args.sessions} sessions": lambda url: concurrently(url, system, args, context, tokenizer),
        "one session, seeded": lambda url: [session(url, system, 0, args, context, tokenizer, seed=7)],
    }
    chosen = args.scenarios.split(",")
    scenarios = {name: run for (key, (name, run)) in zip(("one", "many", "seeded"), scenarios.items())
                 if key in chosen}
    caches = args.caches.split(",")
    results, metrics = {}, {}
    for name, run in scenarios.items():
        for cache in caches:
            served = run_servers(cache, run, model, drafter, env, args, log)
            for server, (runs, served) in zip(_servers(cache), served):
                results.setdefault(server, {})[name], metrics[server, name] = runs, served
                done = summary(name, server, runs, None, len(tokenizer.encode(system)), served)
                log(f"{name}, prefix cache {server}: done " + json.dumps({k: v for k, v in done.items()
                                                                         if k != "same_replies"}))
    disk = results.get("disk", {})
    rows = [summary(name, cache, runs, results.get("off", {}).get(name) or disk.get(name),
                    len(tokenizer.encode(system)), metrics[cache, name],
                    disk[name] if cache == "disk, restarted" else None)
            for cache in results for name, runs in results[cache].items()]
    mismatches = [f"{r['scenario']}: replies differ with the cache on" for r in rows if r["same_replies"] is False]
    return dict(mode="agent", pair=args.pair, description=description, system_tokens=len(tokenizer.encode(system)),
                calls=args.calls, reply_tokens=args.max_tokens, context=context, rows=rows, mismatches=mismatches)


def _servers(cache: str) -> list[str]:
    return ["disk", "disk, restarted"] if cache == "disk" else [cache]


def run_servers(cache: str, run, model, drafter, env, args, log) -> list[tuple[list, dict]]:
    """The scenario on a fresh server with the prefix cache `cache` (on, off; disk: on a server with a
    fresh directory, then on a new server on that directory); (its records, /metrics) per server."""
    budget = "0" if cache == "off" else str(int(args.prompt_cache_gb * 2**30))
    directory = tempfile.mkdtemp(prefix="mlx_mtp_agent_states_") if cache == "disk" else None
    extra = ["--prompt-cache-dir", directory] if directory else []
    out = []
    try:
        for _ in _servers(cache):
            url, proc = serve(model, drafter, budget, env, args, log, extra)
            try:
                stream(url, "/v1/completions", {"prompt": "import os\n", "max_tokens": 4}, timeout=600)  # warm-up
                records = run(url)
                out.append((records, _metrics(url)))
            finally:
                stop_server(proc)
    finally:
        if directory:
            shutil.rmtree(directory, ignore_errors=True)
    return out


def _metrics(url: str) -> dict:
    from mlx_mtp.server.metrics import parse

    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        return {k.removeprefix("mlx_mtp:"): v for k, v in parse(r.read().decode()).items()}


def session(url: str, system: str, tag: int, args, context: int, tokenizer, seed=None) -> list[dict]:
    """One agent session; a record per call."""
    rng = np.random.default_rng(1000 + tag)
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": f"Task {tag}: the tests in tests/test_parse.py fail. Fix the bug."}]
    records = []
    for call in range(args.calls):
        body = {"messages": messages, "max_tokens": args.max_tokens, "stream_options": {"include_usage": True},
                "temperature": 1.0 if seed is not None else 0.0}
        if seed is not None:
            body["seed"] = seed + call
        reply = stream(url, "/v1/chat/completions", body, timeout=3600)
        usage, timings = reply.usage, reply.timings
        reply.ttft = reply.ttft if reply.ttft is not None else reply.seconds  # a reply with no text
        records.append(dict(prompt=usage["prompt_tokens"], cached=usage["prompt_tokens_details"]["cached_tokens"],
                            prefilled=timings["prompt_n"], prefill_ms=timings["prompt_ms"], ttft_ms=1000 * reply.ttft,
                            reply=reply.text))
        result = tool_result(tokenizer, int(rng.integers(40, 121)), rng)
        messages = messages + [{"role": "assistant", "content": reply.text},
                               {"role": "user", "content": f"Tool result ({call}):\n{result}"}]
        grows = usage["completion_tokens"] + len(tokenizer.encode(result)) + 24  # + the turn markers
        if usage["prompt_tokens"] + grows + args.max_tokens > context:
            break
    return records


def concurrently(url: str, system: str, args, context: int, tokenizer) -> list[list[dict]]:
    out: list = [None] * args.sessions
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, session(url, system, i, args, context,
                                                                                 tokenizer)))
               for i in range(args.sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def summary(name: str, cache: str, runs: list, reference: list, system_tokens: int, metrics: dict = None,
            cold: list = None) -> dict:
    """A scenario's figures on one server; `cold`: the first disk server's records, for a restarted one."""
    prefilled = sum(r["prefilled"] for run in runs for r in run)
    new = sum(run[-1]["prompt"] for run in runs)
    same = None if reference is None or reference is runs else all(
        [r["reply"] for r in a] == [r["reply"] for r in b] for a, b in zip(runs, reference))
    firsts, lasts = [run[0]["ttft_ms"] for run in runs], [run[-1]["ttft_ms"] for run in runs]
    metrics = metrics or {}
    per_token = {k: metrics[f"prefix_cache_{k}bytes"] / new if f"prefix_cache_{k}bytes" in metrics else None
                 for k in ("", "disk_")}
    return dict(scenario=name, cache=cache, sessions=len(runs), calls=median([len(run) for run in runs]),
                last_prompt=median([run[-1]["prompt"] for run in runs]), prefilled=prefilled, new=new,
                prefilled_over_new=prefilled / new, ttft_first_ms=median(firsts), ttft_last_ms=median(lasts),
                ttft_last_over_first=median([b / a for a, b in zip(firsts, lasts)]),
                prefill_ms_last=median([run[-1]["prefill_ms"] for run in runs]),
                system_prefills=sum(run[0]["cached"] < system_tokens for run in runs), same_replies=same,
                ttft_first_over_cold=median([a[0]["ttft_ms"] / b[0]["ttft_ms"] for a, b in zip(runs, cold)])
                if cold is not None else None,
                memory_bytes_per_token=per_token[""], disk_bytes_per_token=per_token["disk_"])


def agent_md(res: dict) -> str:
    intro = (f"Measured. {res['description']}. System prompt {res['system_tokens']} tokens (tool declarations); up "
             f"to {res['calls']} calls per session, each appending the model's reply (at most {res['reply_tokens']} "
             f"tokens, greedy unless seeded) and a 40-120-token tool result, while the next call fits the "
             f"{res['context']}-token context. Prefilled / new: prompt tokens the server prefilled over a session "
             f"(`timings.prompt_n`) over the tokens new to it (its last prompt). TTFT: client-side, streamed, median "
             f"over sessions. System prompt prefilled by: sessions whose first call restored fewer than the system "
             f"prompt's tokens from the cache. Same replies: every reply equals the cache-off server's (or the first "
             f"disk server's). Disk: the scenario on a server with `--prompt-cache-dir`, then on a new server on the "
             f"directory (restarted); first TTFT / cold: the restarted server's first TTFT over the first server's. "
             f"Bytes / token: what the prefix cache holds in memory and on disk at the end, over the tokens new to "
             f"the sessions.")
    header = ["scenario", "prefix cache", "sessions", "calls", "last prompt", "prefilled", "new",
              "prefilled / new", "TTFT first ms", "TTFT last ms", "last / first", "first TTFT / cold",
              "system prompt prefilled by", "memory bytes / token", "disk bytes / token", "same replies"]
    rows = [[r["scenario"], r["cache"], r["sessions"], fmt(r["calls"], ".0f"), fmt(r["last_prompt"], ".0f"),
             r["prefilled"], r["new"], fmt(r["prefilled_over_new"]), fmt(r["ttft_first_ms"], ".0f"),
             fmt(r["ttft_last_ms"], ".0f"), fmt(r["ttft_last_over_first"]),
             fmt(r.get("ttft_first_over_cold"), ".3f"), r["system_prefills"],
             fmt(r.get("memory_bytes_per_token"), ".0f"), fmt(r.get("disk_bytes_per_token"), ".0f"),
             {True: "yes", False: "**no**", None: "-"}[r["same_replies"]]] for r in res["rows"]]
    return section(f"Agent sessions through the server: {res['pair']}", intro, table(header, rows))


# ---- servers, pairs and text ----------------------------------------------------------------------


def serve(model: Path, drafter: Path, budget: str, env: dict | None, args, log, extra=()):
    port = free_port()
    command = [sys.executable, "-m", "mlx_mtp.server", "--model", str(model), "--drafter", str(drafter),
               "--served-model-name", args.pair, "--dtype", "float32", "--max-batch", str(max(args.sessions, 1)),
               "--prompt-cache-bytes", budget, "--log-level", "warning", *extra]
    logfile = os.path.join(tempfile.gettempdir(), f"mlx_mtp_agent_{port}.log")
    proc = start_server(command, port, logfile, env=env)
    wait_healthy(proc, port, timeout=600)
    log(f"server with --prompt-cache-bytes {budget} {' '.join(extra)} on port {port} (log: {logfile})")
    return f"http://127.0.0.1:{port}", proc


def pair_dirs(args, log) -> tuple[Path, Path, str]:
    if args.pair == "demo":
        return DEMO / "target", DEMO / "drafter", "the bundled demo pair, fp32"
    if args.pair != "mid":
        raise SystemExit(f"--pair must be demo or mid, not {args.pair!r}")
    return mid_checkpoint(args.context, log)


def mid_checkpoint(context: int, log, seed: int = 0) -> tuple[Path, Path, str]:
    """The mid pair with the demo tokenizer (vocab 4096) and `context` positions, written once."""
    target_config = dict(MID_TARGET, vocab_size=4096, max_position_embeddings=context, dtype="float32",
                         architectures=["Gemma4ForCausalLM"])
    text = dict(MID_DRAFTER["text_config"], vocab_size=4096, max_position_embeddings=context)
    drafter_config = dict(MID_DRAFTER, text_config=text)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlx_mtp" / f"bench-agent-mid-{context}"
    if not (cache / "drafter" / "model.safetensors").exists():
        log(f"writing the mid pair ({context} positions, demo tokenizer) to {cache}")
        tmp = cache.with_name(cache.name + f".{os.getpid()}.tmp")
        for name, config, s in (("target", target_config, seed), ("drafter", drafter_config, seed + 1)):
            _write(tmp / name, config, build(config, s))
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "generation_config.json"):
            shutil.copy(DEMO / "target" / f, tmp / "target" / f)
        shutil.rmtree(cache, ignore_errors=True)
        os.replace(tmp, cache)
    import mlx_mtp

    params = n_params(mlx_mtp.load(cache / "target").target)
    return cache / "target", cache / "drafter", f"mid pair ({params / 1e6:.0f}M params, random weights, fp32)"


def _write(path: Path, config: dict, model) -> None:
    import mlx.core as mx

    from mlx_mtp.models.layout import checkpoint_weights

    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), checkpoint_weights(model))
    (path / "config.json").write_text(json.dumps(config, indent=1))


def _tokenizer(model: Path):
    from mlx_mtp.loading import load_tokenizer

    return load_tokenizer(model)


def system_prompt(tokenizer, n_tokens: int) -> str:
    """Tool declarations, as an agent's system prompt has them, to about `n_tokens` tokens."""
    lines = ["You are a coding agent working in a Python repository. Call tools to read and change files; "
             "answer with a tool call or a short message.", "Tools:"]
    i = 0
    while len(tokenizer.encode("\n".join(lines))) < n_tokens:
        name, _, doc = TOOLS[i % len(TOOLS)].partition(": ")
        lines.append(json.dumps({"name": name.split("(")[0] + (f"_{i // len(TOOLS)}" if i >= len(TOOLS) else ""),
                                 "signature": name, "description": doc}))
        i += 1
    return "\n".join(lines)


def tool_result(tokenizer, n_tokens: int, rng) -> str:
    """About `n_tokens` tokens of held-out source code from a random place."""
    source = _source()
    start = int(rng.integers(0, len(source) - 20 * n_tokens))
    return tokenizer.decode(tokenizer.encode(source[start : start + 6 * n_tokens])[:n_tokens])


@functools.lru_cache(maxsize=1)
def _source() -> str:
    from apps.demo_pair.data import stdlib_files

    return "\n".join(stdlib_files(held_out=True).values())
