"""Many models behind one server (issue 51): loads, evictions and outputs as a client switches models.

    python -m apps.pool_bench [--rounds 4] [--tokens 24] [--clients 8] [--requests 6] [--pull-seconds 10]
                              [--json PATH]

It builds a temporary model store with three copies of the demo pair (`bench/a`, `bench/b`,
`bench/c`, each with its `-assistant` drafter) and runs `python -m mlx_mtp.server --store-only` on
it, the servers seeing that store only (MLX_MTP_MODELS, HF_HOME and HF_HUB_CACHE in temp dirs,
HF_ENDPOINT unroutable or the fake Hub). What one pair reserves is read from `/api/ps` (`size`) of
a server that loaded one; the budgets (`--memory-gb`) follow from it.

1. `all` (3.5 pairs): one client alternates a, b, c, a, ... for `--rounds` rounds of greedy
   `/api/generate` requests. Expected: 3 loads in the first round, none after.
2. `one` (1.5 pairs): the same client. Expected: every request is a switch, and each loads once
   (evicting the last pair). A load is counted exactly: the model is absent from `/api/ps` before
   the request and present after (one client, requests one after another, keep_alive 10m).
   Per scenario: loads, `load_duration` medians of the requests that loaded and of those that did not,
   and request latency medians.
3. `concurrent, all` (3.5 pairs): `--clients` threads, each `--requests` greedy requests alternating
   `bench/a` and `bench/b` (loaded on demand by the first requests), while `/api/pull` brings
   `bench/d` (another copy) from a Hugging Face Hub faked on the loopback (tests/fake_hub.py,
   imported from the repository's tests/ dir: a checkout is needed), its weights sent slowly enough
   (`--pull-seconds`) that the pull overlaps the clients. Expected: no errors; every reply's text
   equals that of a one-model server (`--model <dir> --drafter <dir>`, same prompt, greedy, one
   request at a time) for the same model; `bench/d` not listed in `/api/tags` mid-pull, then listed and
   answering the same.
4. `concurrent, one` (1.5 pairs): the same with a budget for one model (and `bench/e` pulled): a
   request for the model that is not loaded waits for the other's requests to finish (the server's
   --load-wait), then evicts it. Expected: the same, no errors and outputs equal.

Prints a table per scenario and an overall line; exit status 1 if an expectation fails.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from apps.serve_load import PROMPTS, stop_server

ROOT = Path(__file__).resolve().parent.parent
NAMES = ["bench/a", "bench/b", "bench/c"]
KEEP = "10m"  # longer than a run: nothing expires, so every unload counted is an eviction


# ---- a server and its API ---------------------------------------------------------------------


class Server:
    """`python -m mlx_mtp.server ARGS --port 0`, up once its ready line (its only stdout) is read."""

    def __init__(self, args: list, env: dict, log: Path):
        self.log = log
        with open(log, "w") as err:
            command = [sys.executable, "-m", "mlx_mtp.server", "--port", "0", "--log-level", "warning", *args]
            self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, env=env, text=True)
        watchdog = threading.Timer(120, self.proc.kill)  # a server that never gets ready ends the readline
        watchdog.start()
        line = self.proc.stdout.readline()
        watchdog.cancel()
        if not line:
            stop_server(self.proc)
            raise RuntimeError(f"the server did not start (status {self.proc.returncode}); see {log}")
        self.url = json.loads(line)["url"]

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        stop_server(self.proc)


def call(url: str, path: str, body: dict | None = None, timeout: float = 300) -> dict:
    """GET (no body) or POST JSON; the decoded answer. Raises RuntimeError on an HTTP error."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{path} {e.code}: {e.read().decode(errors='replace')[:300]}") from None


def generate(url: str, model: str, prompt: str, tokens: int) -> dict:
    return call(url, "/api/generate", {"model": model, "prompt": prompt, "stream": False, "keep_alive": KEEP,
                                       "options": {"temperature": 0, "num_predict": tokens}})


def loaded(url: str) -> dict:
    """What `/api/ps` lists: name -> bytes reserved."""
    return {m["name"]: m["size"] for m in call(url, "/api/ps")["models"]}


def listed(url: str) -> set:
    """What `/api/tags` lists."""
    return {m["name"] for m in call(url, "/api/tags")["models"]}


def gb(nbytes: int) -> str:
    return f"{nbytes / 2**30:.6f}"  # --memory-gb in GiB, to ~1 KiB


def median(values: list) -> float | None:
    return statistics.median(values) if values else None  # None: no such request


def fmt(value: float | None, width: int, digits: int = 1) -> str:
    return f"{'-' if value is None else f'{value:.{digits}f}':>{width}}"


# ---- the store and the environment ------------------------------------------------------------


def build_store(root: Path, target: Path, drafter: Path, names: list) -> None:
    """Copies of the demo pair as `<org>/<name>` and `<org>/<name>-assistant` (paired by name)."""
    for name in names:
        shutil.copytree(target, root / name)
        shutil.copytree(drafter, root / f"{name}-assistant")


def server_env(tmp: Path, models: Path, endpoint: str = "http://127.0.0.1:9") -> dict:
    """The environment of a server that sees `models` only and reaches no Hub but `endpoint`."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_TOKEN")}
    return {**env, "MLX_MTP_MODELS": str(models), "HF_HOME": str(tmp / "hf"),
            "HF_HUB_CACHE": str(tmp / "hf" / "hub"), "HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1",
            "PYTHONPATH": str(ROOT)}


def pair_bytes(env: dict, tmp: Path) -> int:
    """What one pair reserves once loaded, as `/api/ps` says (weights + KV + prefix cache)."""
    with Server(["--store-only", "--memory-gb", "16"], env, tmp / "size.log") as s:
        generate(s.url, NAMES[0], PROMPTS[0], 1)
        return loaded(s.url)[NAMES[0]]


# ---- scenarios 1 and 2: one client alternating models -----------------------------------------


def alternate(label: str, budget: int, args, env: dict, tmp: Path) -> dict:
    rows = []
    with Server(["--store-only", "--memory-gb", gb(budget)], env, tmp / f"{label}.log") as s:
        for r in range(args.rounds):
            for name in NAMES:
                before = loaded(s.url)
                start = time.perf_counter()
                reply = generate(s.url, name, PROMPTS[r % len(PROMPTS)], args.tokens)
                latency = time.perf_counter() - start
                after = loaded(s.url)
                rows.append(dict(round=r, model=name, load=name not in before and name in after,
                                 evicted=sorted(set(before) - set(after)), resident=len(after),
                                 load_ms=reply["load_duration"] / 1e6, latency_ms=latency * 1e3,
                                 text=reply["response"]))
    return summarize_alternate(label, budget, rows)


def summarize_alternate(label: str, budget: int, rows: list) -> dict:
    later = [r for r in rows if r["round"] > 0]
    loads, others = [r for r in rows if r["load"]], [r for r in rows if not r["load"]]
    by_prompt: dict = {}
    for r in rows:
        by_prompt.setdefault(r["round"], set()).add(r["text"])
    return dict(scenario=label, budget_bytes=budget, requests=len(rows),
                loads_first_round=sum(r["load"] for r in rows if r["round"] == 0),
                loads_after=sum(r["load"] for r in later), switches_after=len(later),
                evictions=sum(len(r["evicted"]) for r in rows), max_resident=max(r["resident"] for r in rows),
                load_ms_loads=median([r["load_ms"] for r in loads]),
                load_ms_others=median([r["load_ms"] for r in others]),
                latency_ms_loads=median([r["latency_ms"] for r in loads]),
                latency_ms_others=median([r["latency_ms"] for r in others]),
                same_text_across_models=all(len(t) == 1 for t in by_prompt.values()), rows=rows)


def print_alternate(s: dict) -> None:
    print(f"\n{s['scenario']}: budget {s['budget_bytes'] / 2**20:.1f} MiB, {s['requests']} requests "
          f"(a, b, c, a, ...), {s['max_resident']} resident at most, {s['evictions']} evictions")
    print(f"{'loads 1st round':>15} {'loads after':>11} {'switches after':>14} {'load_duration ms':>16} "
          f"{'(no load)':>9} {'latency ms':>10} {'(no load)':>9} {'same text':>9}")
    print(f"{s['loads_first_round']:>15} {s['loads_after']:>11} {s['switches_after']:>14} "
          f"{fmt(s['load_ms_loads'], 16)} {fmt(s['load_ms_others'], 9, 2)} {fmt(s['latency_ms_loads'], 10)} "
          f"{fmt(s['latency_ms_others'], 9)} {s['same_text_across_models']!s:>9}")


# ---- scenario 3: concurrent clients on two models, a pull in flight ---------------------------


def references(models: Path, tmp: Path, args) -> dict:
    """(model, prompt) -> text from a one-model server per model, one request at a time; that
    server's store is an empty dir, so it serves its --model and nothing else."""
    empty = tmp / "empty"
    empty.mkdir(exist_ok=True)
    out = {}
    for name in NAMES[:2]:
        flags = ["--model", str(models / name), "--drafter", str(models / f"{name}-assistant"),
                 "--served-model-name", name]
        with Server(flags, server_env(tmp, empty), tmp / "reference.log") as s:
            for prompt in PROMPTS:
                out[(name, prompt)] = generate(s.url, name, prompt, args.tokens)["response"]
    return out


def pull(url: str, name: str, record: dict) -> None:
    """POST /api/pull, reading its NDJSON progress to the end (on a thread)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
    record["start"] = time.perf_counter()
    try:
        conn.request("POST", "/api/pull", json.dumps({"model": name}), {"Content-Type": "application/json"})
        response = conn.getresponse()
        record["http"] = response.status
        for raw in response:
            line = json.loads(raw)
            record["lines"] = record.get("lines", 0) + 1
            record["last"] = line.get("error") or line.get("status")
    except Exception as e:  # reported, counted as an error
        record["last"] = f"error: {e}"
    finally:
        record["end"] = time.perf_counter()
        conn.close()


def client(url: str, i: int, args, out: list) -> None:
    for j in range(args.requests):
        name, prompt = NAMES[(i + j) % 2], PROMPTS[(i + 3 * j) % len(PROMPTS)]
        row = dict(client=i, model=name, prompt=prompt, text=None, error=None)
        try:
            reply = generate(url, name, prompt, args.tokens)
            row.update(text=reply["response"], load_ms=reply["load_duration"] / 1e6)
        except Exception as e:  # counted
            row["error"] = str(e)
        row["end"] = time.perf_counter()
        out.append(row)


def concurrent(label: str, budget: int, pulled: str, expected: dict, args, models: Path, demo: tuple,
               tmp: Path) -> dict:
    """8 clients on two models while `pulled` comes from the fake Hub; under a budget for one, each
    switch waits for the other model's requests to finish (the pool's --load-wait)."""
    sys.path.insert(0, str(ROOT / "tests"))  # the fake Hub lives with the tests
    from fake_hub import FakeHub, read_repo

    target, drafter = read_repo(demo[0]), read_repo(demo[1])
    rate = sum(len(v) for k, v in target.items() if k.endswith(".safetensors")) / args.pull_seconds
    with FakeHub({pulled: target, f"{pulled}-assistant": drafter}, slow={pulled: rate}) as hub, \
            Server(["--store-only", "--memory-gb", gb(budget)], server_env(tmp, models, hub.url),
                   tmp / f"concurrent-{label}.log") as s:
        record: dict = {}
        puller = threading.Thread(target=pull, args=(s.url, pulled, record))
        puller.start()
        hub.event(hub.started, pulled, "model.safetensors").wait(60)  # its weights are on their way
        early = pulled in listed(s.url)  # a pull half done must not list
        rows: list = []
        threads = [threading.Thread(target=client, args=(s.url, i, args, rows)) for i in range(args.clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        clients_s = time.perf_counter() - start
        puller.join()
        done = pulled in listed(s.url)
        try:
            answer = generate(s.url, pulled, PROMPTS[0], args.tokens)["response"] if done else None
        except RuntimeError as e:  # an HTTP error: reported as a failed expectation, with the rest
            answer = f"error: {e}"
        resident = loaded(s.url)
    errors = [r for r in rows if r["error"]]
    return dict(scenario=f"concurrent, {label}", pulled=pulled, budget_bytes=budget, clients=args.clients,
                requests=len(rows),
                errors=len(errors), first_error=errors[0]["error"] if errors else None,
                mismatches=sum(r["text"] is not None and r["text"] != expected[(r["model"], r["prompt"])]
                               for r in rows),
                during_pull=sum(record["start"] < r["end"] < record["end"] for r in rows),
                clients_s=clients_s, pull_s=record["end"] - record["start"], pull_status=record.get("last"),
                pull_lines=record.get("lines", 0), listed_mid_pull=early, pulled_listed=done,
                pulled_equal=answer == expected[(NAMES[0], PROMPTS[0])], resident=sorted(resident),
                max_load_ms=max((r.get("load_ms", 0) for r in rows), default=0), rows=rows)


def print_concurrent(s: dict) -> None:
    print(f"\n{s['scenario']}: budget {s['budget_bytes'] / 2**20:.1f} MiB, {s['clients']} clients on "
          f"{', '.join(NAMES[:2])}, pull of {s['pulled']} in flight; resident after: {', '.join(s['resident'])}")
    print(f"{'requests':>8} {'errors':>6} {'!= one-model':>12} {'done in pull':>12} {'clients s':>9} "
          f"{'pull s':>6} {'pull':>8} {'pulled listed mid/after':>23} {'equal':>7} {'max load ms':>11}")
    print(f"{s['requests']:>8} {s['errors']:>6} {s['mismatches']:>12} {s['during_pull']:>12} "
          f"{s['clients_s']:>9.1f} {s['pull_s']:>6.1f} {s['pull_status']!s:>8} "
          f"{str(s['listed_mid_pull']) + '/' + str(s['pulled_listed']):>23} "
          f"{s['pulled_equal']!s:>7} {s['max_load_ms']:>11.0f}")
    if s["first_error"]:
        print(f"  first error: {s['first_error']}")


# ---- main ---------------------------------------------------------------------------------------


def failures(results: list) -> list:
    """The expectations of the issue that a run missed, in words."""
    all_, one, *concurrents = results
    out = []
    if all_["loads_after"] or all_["loads_first_round"] != len(NAMES):
        out.append(f"all: {all_['loads_first_round']} loads in round 1, {all_['loads_after']} after")
    if one["loads_after"] != one["switches_after"] or one["max_resident"] != 1:
        out.append(f"one: {one['loads_after']} loads for {one['switches_after']} switches, "
                   f"{one['max_resident']} resident at most")
    for conc in concurrents:
        what = conc["scenario"]
        if conc["errors"] or conc["mismatches"] or conc["listed_mid_pull"] or not conc["pulled_listed"] \
                or not conc["pulled_equal"]:
            out.append(f"{what}: {conc['errors']} errors, {conc['mismatches']} outputs differ, pulled "
                       f"listed mid-pull {conc['listed_mid_pull']} and after {conc['pulled_listed']}, answers "
                       f"equal {conc['pulled_equal']}")
        if conc["pull_status"] != "success" or not conc["during_pull"]:
            out.append(f"{what}: the pull ended {conc['pull_status']!r}, "
                       f"{conc['during_pull']} requests done during it")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m apps.pool_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4,
                    help="rounds of a, b, c in scenarios 1 and 2 (default: 4)")
    ap.add_argument("--tokens", type=int, default=24, help="tokens per reply, greedy (default: 24)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients of scenario 3 (default: 8)")
    ap.add_argument("--requests", type=int, default=6, help="requests per client in scenario 3 (default: 6)")
    ap.add_argument("--pull-seconds", type=float, default=10,
                    help="how long the fake Hub takes to send the pulled target's weights (default: 10)")
    ap.add_argument("--json", metavar="PATH",
                    help="also write every figure and request there (default: none)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    from mlx_mtp.cli import demo_pair

    args = parse_args(argv)
    demo = tuple(Path(p) for p in demo_pair())
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pool_bench-") as name:
        tmp = Path(name)
        models = tmp / "models"
        build_store(models, *demo, NAMES)
        env = server_env(tmp, models)
        pair = pair_bytes(env, tmp)
        print(f"one pair (demo copy) reserves {pair} bytes ({pair / 2**20:.1f} MiB) per /api/ps; "
              f"{args.tokens} tokens per greedy reply")
        # "all": three pairs and a half, "one": one and a half (two never fit)
        results = [alternate("all", pair * 7 // 2, args, env, tmp),
                   alternate("one", pair * 3 // 2, args, env, tmp)]
        for s in results:
            print_alternate(s)
        expected = references(models, tmp, args)
        for label, budget, pulled in (("all", pair * 7 // 2, "bench/d"), ("one", pair * 3 // 2, "bench/e")):
            results.append(concurrent(label, budget, pulled, expected, args, models, demo, tmp))
            print_concurrent(results[-1])
    missed = failures(results)
    verdict = "OK" if not missed else "FAILED: " + "; ".join(missed)
    print(f"\n{verdict} ({time.perf_counter() - started:.0f} s in all)")
    if args.json:
        Path(args.json).write_text(json.dumps({"pair_bytes": pair, "args": vars(args), "scenarios": results},
                                              indent=1))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
